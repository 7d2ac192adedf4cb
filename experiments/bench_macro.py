"""Macro-action core: batched jitted segmentation + macro GAE vs a per-sample loop implementation.

`python experiments/bench.py macro [--batch 64] [--length 512] [--n 5] [--repeats 7]`

Both sides compute fixed n-gram segmentation followed by macro GAE ("equal" value weighting,
"weighted" reward aggregation) on the same random batch with random response lengths 1..T. Two
loop implementations are timed: the plain Python reference in tests/macro_oracle.py (one row,
token and macro at a time) and a numpy version organised like the official code (one sample at
a time, numpy means over macro slices). The batched side is timed as one jitted call and as the
public functions called eagerly (with their input checks). Times are the best of
`--repeats` runs; the jitted side is timed after a warm-up call, with `block_until_ready`.
"""
import argparse
import importlib.util
import pathlib

import jax
import numpy as np

from marl_jax.macro.advantage import macro_gae
from marl_jax.macro.termination import fixed_ngram

from bench_timing import best_time


def _load_oracle():
    path = pathlib.Path(__file__).resolve().parent.parent / "tests" / "macro_oracle.py"
    spec = importlib.util.spec_from_file_location("macro_oracle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numpy_per_sample(values, rewards, mask, n, gamma, lam):
    """The same math as the official implementation organises it: one sample at a time, numpy
    means over each macro's slice, a Python GAE loop over macros, slice assignment back
    (fixed n-grams, last token alone, `equal` weighting, `weighted` rewards)."""
    advantages, returns = np.zeros_like(values), np.zeros_like(values)
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        if length == 0:
            continue
        starts = list(range(0, length - 1, n)) + [length - 1]
        ends = starts[1:] + [length]
        macro_values = [values[b, s:e].mean() for s, e in zip(starts, ends)]
        macro_rewards = [rewards[b, s:e].mean() for s, e in zip(starts, ends)]
        running, per_macro = 0.0, [0.0] * len(starts)
        for k in reversed(range(len(starts))):
            next_value = macro_values[k + 1] if k + 1 < len(starts) else 0.0
            delta = macro_rewards[k] + gamma * next_value - macro_values[k]
            running = delta + gamma * lam * running
            per_macro[k] = running
        for k, (s, e) in enumerate(zip(starts, ends)):
            advantages[b, s:e] = per_macro[k]
            returns[b, s:e] = per_macro[k] + macro_values[k]
    return advantages, returns


def main(argv):
    parser = argparse.ArgumentParser(prog="bench.py macro", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    oracle = _load_oracle()

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(1, args.length + 1, args.batch)
    mask = (np.arange(args.length)[None, :] < lengths[:, None]).astype(np.int32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    rewards = (rng.normal(size=mask.shape) * 0.05 * mask).astype(np.float32)

    @jax.jit
    def batched(values, rewards, mask):
        ids = fixed_ngram(mask, args.n)
        return macro_gae(values, rewards, mask, ids, gamma=1.0, lam=0.95)

    device_inputs = [jax.device_put(x) for x in (values, rewards, mask)]
    jit_time = best_time(lambda: jax.block_until_ready(batched(*device_inputs)), args.repeats)

    def loop():
        ids = oracle.fixed_ngram(mask, args.n)
        return oracle.macro_gae(values, rewards, mask, ids, gamma=1.0, lam=0.95)

    loop_time = best_time(loop, args.repeats)
    numpy_time = best_time(lambda: numpy_per_sample(values, rewards, mask, args.n, 1.0, 0.95),
                            args.repeats)
    eager_time = best_time(lambda: jax.block_until_ready(macro_gae(
        values, rewards, mask, fixed_ngram(mask, args.n), gamma=1.0, lam=0.95)), args.repeats)

    advantages, returns = batched(*device_inputs)
    loop_advantages, loop_returns = loop()
    numpy_advantages, numpy_returns = numpy_per_sample(values, rewards, mask, args.n, 1.0, 0.95)
    max_diff = max(np.abs(np.asarray(advantages) - loop_advantages).max(),
                   np.abs(np.asarray(returns) - loop_returns).max(),
                   np.abs(np.asarray(advantages) - numpy_advantages).max(),
                   np.abs(np.asarray(returns) - numpy_returns).max())

    print(f"macro core: fixed n-gram (n={args.n}) + macro GAE, B={args.batch} T={args.length}, "
          f"lengths 1..T, backend={jax.default_backend()}, best of {args.repeats}")
    print(f"  per-sample loop, pure Python (tests/macro_oracle.py): {loop_time * 1e3:9.3f} ms")
    print(f"  per-sample loop, numpy slices (official layout)    : {numpy_time * 1e3:9.3f} ms")
    print(f"  batched, one jitted call                           : {jit_time * 1e3:9.3f} ms")
    print(f"  batched, public eager calls (input checks)         : {eager_time * 1e3:9.3f} ms")
    print(f"  speed-up, jitted vs pure-Python / numpy loops      : "
          f"{loop_time / jit_time:7.1f}x / {numpy_time / jit_time:7.1f}x")
    print(f"  speed-up, eager calls vs pure-Python / numpy loops : "
          f"{loop_time / eager_time:7.1f}x / {numpy_time / eager_time:7.1f}x")
    print(f"  max |difference|: {max_diff:.2e}")
    if not np.isfinite(max_diff) or max_diff > 1e-3:
        raise SystemExit(f"batched and loop results disagree (max difference {max_diff:.2e})")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
