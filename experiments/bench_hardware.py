"""Peak dense bfloat16 FLOP/s and HBM bandwidth of one JAX device: the physical bounds the
benchmarks print their numbers beside, from the one table of device kinds
(`marl_jax.train.perf.DEVICE_KINDS`, vendors' datasheets) or, for kinds it lacks (CPUs), timed.
"""
import time

import jax
import jax.numpy as jnp

from bench_timing import best_time


def table_entry(device_kind: str, dtype: str = "bfloat16", precision: str | None = None):
    """(peak FLOP/s of `dtype` matmuls at `precision` (`perf.peak_flops`), HBM bytes/s) of a
    device kind from `perf.DEVICE_KINDS`, or None where the table lacks the kind or that rate."""
    from marl_jax.train import perf

    row = perf.device_kind(device_kind)
    peak = perf.peak_flops(device_kind, dtype, precision)
    return None if row is None or peak is None else (peak, row.hbm_bandwidth)


def timed_matmul_peak(dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` `[size, size] @ [size, size]` matmuls on one device."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * size ** 3 / best_time(lambda: matmul(a), repeats)


def timed_copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` copies (read + write) of a float32 array on one device."""
    x = jnp.ones((megabytes * 2 ** 18,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def device_bounds(dtype, small: bool = False) -> dict:
    """Peak FLOP/s and HBM bytes/s of this process's first device, from the table or, for kinds
    it lacks (CPUs), timed: {"flops", "bandwidth", "source"}."""
    kind = jax.devices()[0].device_kind
    entry = table_entry(kind, jnp.dtype(dtype).name)
    if entry is not None:
        return dict(flops=entry[0], bandwidth=entry[1], source=f"table ({kind})")
    size = 256 if small else 2048
    return dict(flops=timed_matmul_peak(dtype, size), bandwidth=timed_copy_bandwidth(16 if small else 256),
                source=f"timed on {kind}: best {size}^3 {jnp.dtype(dtype).name} matmul, float32 copy")
