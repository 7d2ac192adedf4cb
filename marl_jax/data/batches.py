"""Deterministic, resumable batch order: the rows of step s are a pure function of (seed, s)."""
from __future__ import annotations

import jax
import numpy as np

from marl_jax import distributed


def batch_indices(num_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Row indices `[batch_size]` of step `step`: epochs of independent seeded permutations."""
    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples}: the dataset is empty")
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, positions = np.divmod(flat, num_examples)
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_examples)
        sel = epochs == epoch
        out[sel] = perm[positions[sel]]
    return out


def process_rows(indices: np.ndarray, sharding=None) -> np.ndarray:
    """This process's share of a global batch's row indices (all of them with one process).

    Args:
      indices: `[B]` row indices of the global batch.
      sharding: the batch's NamedSharding (`sharding.batch_sharding(mesh)`): the rows whose
        shards live on this process's devices, in the order `sharding.shard_batch` expects. None:
        contiguous equal blocks in process order.
    """
    if sharding is not None:
        return indices[distributed.local_batch_rows(len(indices), sharding)]
    count, index = jax.process_count(), jax.process_index()
    if len(indices) % count:
        raise ValueError(f"batch of {len(indices)} rows is not divisible by {count} processes")
    per = len(indices) // count
    return indices[index * per:(index + 1) * per]


def take(arrays: dict, indices: np.ndarray) -> dict:
    return {k: v[indices] for k, v in arrays.items()}
