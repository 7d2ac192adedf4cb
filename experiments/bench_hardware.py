"""Peak dense bfloat16 FLOP/s and HBM bandwidth of one JAX device, by device kind: the physical
bounds the benchmarks print their numbers beside (vendors' datasheets; first match of a
lower-cased `device_kind` substring). TPU v2 / v3 expose each TensorCore as a device (half a
chip); v4 and later one device per chip.
"""
import time

import jax
import jax.numpy as jnp

from bench_timing import best_time

# (device kind substring, bf16 dense FLOP/s, HBM bytes/s) per JAX device.
DEVICES = (
    ("tpu v6 lite", 918e12, 1.64e12),  # v6e (Trillium)
    ("tpu v6e", 918e12, 1.64e12),
    ("tpu v5 lite", 197e12, 0.819e12),  # v5e
    ("tpu v5e", 197e12, 0.819e12),
    ("tpu v5p", 459e12, 2.765e12),
    ("tpu v5", 459e12, 2.765e12),  # v5p reports "TPU v5"
    ("tpu v4", 275e12, 1.2e12),
    ("tpu v3", 61.5e12, 0.45e12),
    ("tpu v2", 22.5e12, 0.35e12),
    ("gb200", 2.5e15, 8.0e12),
    ("b200", 2.25e15, 8.0e12),
    ("gh200", 989e12, 4.0e12),
    ("h200", 989e12, 4.8e12),
    ("h100 pcie", 756e12, 2.0e12),
    ("h100", 989e12, 3.35e12),  # SXM
    ("h800", 989e12, 3.35e12),
    ("a100", 312e12, 2.0e12),
    ("a800", 312e12, 2.0e12),
    ("l40s", 362e12, 0.864e12),
    ("l4", 121e12, 0.3e12),
    ("a10", 125e12, 0.6e12),
    ("v100", 125e12, 0.9e12),  # fp16 tensor cores (no bf16)
)


def table_entry(device_kind: str):
    """(peak FLOP/s, HBM bytes/s) of a device kind, or None."""
    kind = device_kind.lower()
    for name, flops, bandwidth in DEVICES:
        if name in kind:
            return flops, bandwidth
    return None


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
    entry = table_entry(kind)
    if entry is not None:
        return dict(flops=entry[0], bandwidth=entry[1], source=f"table ({kind})")
    size = 256 if small else 2048
    return dict(flops=timed_matmul_peak(dtype, size), bandwidth=timed_copy_bandwidth(16 if small else 256),
                source=f"timed on {kind}: best {size}^3 {jnp.dtype(dtype).name} matmul, float32 copy")
