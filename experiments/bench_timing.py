"""What the benchmarks share: the timers (best wall-clock time of a call; paired times of two
programs called alternately, summarised as the median of their ratios with an interval), the
config loader and the command line of the step timings."""
import argparse
import importlib.util
import pathlib
import sys
import time

import jax
import numpy as np
from scipy import stats


def best_time(fn, repeats: int, *, warmup: bool = True) -> float:
    """Seconds of the fastest of `repeats` calls of `fn()`, each waited on with
    `jax.block_until_ready` (a no-op on host values). The warm-up call compiles and is not timed."""
    if warmup:
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def paired_times(first, second, pairs: int, *, warmup: bool = True,
                 clock=time.perf_counter) -> tuple[np.ndarray, np.ndarray]:
    """Seconds `[pairs]` of `first()` and of `second()`, called alternately: pair i runs
    first then second for even i, second then first for odd i, each call waited on with
    `jax.block_until_ready`. On a shared machine a change of load (or a clock that throttles)
    then lands on both sides of a pair alike, and a drift within the run on neither side more
    than the other. The warm-up calls (one each) compile and are not timed."""
    if warmup:
        jax.block_until_ready(first())
        jax.block_until_ready(second())
    times = np.zeros((2, pairs))
    for i in range(pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            fn = first if side == 0 else second
            start = clock()
            jax.block_until_ready(fn())
            times[side, i] = clock() - start
    return times[0], times[1]


def median_ratio(numerator, denominator, *, level: float = 0.95) -> dict:
    """The median of the paired ratios numerator_i / denominator_i `[n]` with its
    distribution-free interval: the order statistics r_(j) and r_(n+1-j) of the sorted ratios,
    j the largest with P(Binomial(n, 1/2) <= j - 1) <= (1 - level) / 2 (coverage >= `level`
    for any continuous distribution of the ratios). None for the interval when n is too small
    (n < 6 at 95%).

    Returns {"n", "median", "ci": [lo, hi] | None, "ratios"}."""
    ratios = np.asarray(numerator, np.float64) / np.asarray(denominator, np.float64)
    n = int(ratios.size)
    ordered = np.sort(ratios)
    j = int(stats.binom.ppf((1 - level) / 2, n, 0.5)) if n else 0
    ci = None if j < 1 else [float(ordered[j - 1]), float(ordered[n - j])]
    return {"n": n, "median": float(np.median(ratios)), "ci": ci, "ratios": ratios.tolist()}


def ratio_line(summary: dict, what: str, *, claim: float | None = None) -> str:
    """"<what>: median ratio 1.012, 95% interval [0.995, 1.031] over 200 pairs" and, with a
    `claim` (a relative bound such as 0.03 for "within 3%"), what the interval says of it:
    within the claim (the interval lies below 1 + claim), above it (above 1 + claim), or not
    resolved, saying so when the interval is wider than the claim."""
    ci = summary["ci"]
    interval = ("no interval" if ci is None else f"95% interval [{ci[0]:.3f}, {ci[1]:.3f}]")
    line = f"{what}: median ratio {summary['median']:.3f}, {interval} over {summary['n']} pairs"
    if claim is None:
        return line
    bound = 1 + claim
    if ci is None:
        return line + f"; too few pairs to test the claim <= {bound:.2f}"
    if ci[1] <= bound:
        return line + f"; within the claim (<= {bound:.2f})"
    if ci[0] > bound:
        return line + f"; above the claim (> {bound:.2f}): the overhead is real"
    verdict = f"; not resolved against the claim <= {bound:.2f}"
    half = (ci[1] - ci[0]) / 2
    if half > claim:
        verdict += (f" (the interval's half-width {half:.3f} is wider than the claim "
                    f"{claim:.3f}: more pairs or a quieter machine)")
    return line + verdict


def load_config(path):
    """`get_config()` of the config file at `path` (configs import one another as
    `configs.<name>`, so the repository root goes on the path)."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def step_timing_args(argv, *, prog: str, doc: str, config: str, batch: int, repeats: int):
    """`--config` (a file under configs/, default `config`), `--batch` and `--repeats` of a
    step-timing benchmark."""
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--config", default=str(root / "configs" / config))
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser.parse_args(argv)
