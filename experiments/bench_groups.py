"""Group sampling: `generate(num_samples=k)` (one prefill per prompt, its cache shared by the k
samples) vs `generate` of the prompts repeated k times, on the same random Llama.

`python experiments/bench.py group [--batch 2] [--k 8] [--prompt 512] [--new 8] [--repeats 20]`

Both calls draw the same tokens (same key, batch-level draws; checked here); with long prompts
and few new tokens the prefill dominates, so the grouped call should be about k times cheaper in
the prefill. The model is a random 4-layer width-256 Llama (float32). After a compile run of
each, the two calls are timed in `--repeats` pairs, called alternately
(`bench_timing.paired_times`); the result is the median of the paired ratios repeated /
grouped with its 95% distribution-free interval. The last line of the output is the whole
result as JSON.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_timing import median_ratio, paired_times, ratio_line
from marl_jax import models, rollout

TEMPERATURE = 1.0
TOP_K = 50


def _model(prompt: int, new: int):
    config = models.ModelConfig.for_family("llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
                                           num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                           max_position_embeddings=prompt + new)
    model = models.CausalLM(config)
    return model, models.init_params(model, jax.random.key(0))


def _prompts(batch: int, prompt: int, vocab: int):
    """Random left-padded prompts `[batch, prompt]`, each at least 3/4 of `prompt` long."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, size=(batch, prompt)).astype(np.int32)
    lengths = rng.integers(3 * prompt // 4, prompt + 1, size=batch)
    mask = (np.arange(prompt)[None, :] >= prompt - lengths[:, None]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py group", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="prompts")
    parser.add_argument("--k", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20, help="pairs of timed calls")
    args = parser.parse_args(argv)

    model, params = _model(args.prompt, args.new)
    ids, mask = _prompts(args.batch, args.prompt, model.config.vocab_size)
    settings = dict(max_new_tokens=args.new, temperature=TEMPERATURE, top_k=TOP_K, eos_id=0, pad_id=0)
    key = jax.random.key(1)
    repeated_ids, repeated_mask = jnp.repeat(ids, args.k, axis=0), jnp.repeat(mask, args.k, axis=0)
    runners = {
        "grouped": lambda: rollout.generate(model, params, ids, mask, key=key, num_samples=args.k, **settings),
        "repeated": lambda: rollout.generate(model, params, repeated_ids, repeated_mask, key=key, **settings),
    }
    outputs = {}
    for name, run in runners.items():
        start = time.perf_counter()
        outputs[name] = jax.block_until_ready(run())
        print(f"{name}: compile + first run {time.perf_counter() - start:.1f}s")
    same_tokens = bool(np.array_equal(np.asarray(outputs["grouped"].tokens), np.asarray(outputs["repeated"].tokens)))
    repeated, grouped = paired_times(runners["repeated"], runners["grouped"], args.repeats,
                                     warmup=False)
    summary = median_ratio(repeated, grouped)
    medians = {"grouped": float(np.median(grouped)), "repeated": float(np.median(repeated))}
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"model: random llama, 4 layers, width 256, {num_params / 1e6:.1f}M params, device "
          f"{jax.devices()[0].device_kind}; {args.batch} prompts x {args.k} samples, prompt {args.prompt}, "
          f"{args.new} new tokens")
    for name, seconds in medians.items():
        print(f"{name:9s}: {seconds * 1e3:8.1f} ms (median of {args.repeats})")
    print(ratio_line(summary, "repeated / grouped") + f"; same tokens: {same_tokens}")
    print(json.dumps(dict(benchmark="group", device_kind=jax.devices()[0].device_kind, params=num_params,
                          batch=args.batch, k=args.k, prompt=args.prompt, new=args.new, pairs=args.repeats,
                          grouped_s=medians["grouped"], repeated_s=medians["repeated"],
                          ratio=summary["median"], ratio_ci=summary["ci"], same_tokens=same_tokens)))
