"""The one timer the benchmarks share: best wall-clock time of a call, after a warm-up call."""
import time

import jax


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
