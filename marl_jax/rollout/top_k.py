"""The sampler's top-k over the vocabulary, without sorting every row of it at every decode step.

XLA's GPU top-k kernel takes k <= 16; for a larger k (the sampler's default is 50) it sorts
each row of the `[B, V]` logits, 49k entries for SmolLM2 and 256k for Gemma, at every step.
`blocked_top_k` takes the `per_block` largest entries of every block of `block`, then the k
largest of those candidates: exactly `lax.top_k`'s values and indices, ties included (the lower
index first). With `per_block` = k no block can hold more of the k largest than it gives; with
fewer (16, the kernel's limit), a step where some row's block might (its `per_block`-th value
reaches the k-th candidate) runs `lax.top_k` on the whole rows instead, so the result is exact
at every step (under `vmap` that `lax.cond` runs both branches).

`top_k` takes `blocked_top_k` (per_block = k, blocks of 1024) on GPUs, where a sort of the
whole row is the alternative, and `lax.top_k` elsewhere: on a CPU its partial sort is several
times faster than the blocks (measured: 73 against 484 ms for `[256, 49152]`, k = 50). On a GPU
the blocked top-k has not been timed yet (`bench.py device --suite --only decode_parts_b256`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax.models import attention

# XLA's GPU top-k kernel takes k up to this.
KERNEL_MAX_K = 16
BLOCK = 1024


def blocked_top_k(x: jax.Array, k: int, *, block: int = BLOCK,
                  per_block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` of `x [B, V]` (values `[B, k]`, int32 indices `[B, k]`), from the
    `per_block` (default k) largest entries of each block of `block` entries."""
    batch, vocab = x.shape
    per_block = min(k if per_block is None else per_block, k, block)
    blocks = -(-vocab // block)
    if blocks * per_block < k or blocks == 1:
        return jax.lax.top_k(x, k)
    pad = blocks * block - vocab
    # Padding sorts last: below every entry, and among equal ones (-inf) after them by index.
    padded = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    values, local = jax.lax.top_k(padded.reshape(batch * blocks, block), per_block)
    values, local = values.reshape(batch, blocks, per_block), local.reshape(batch, blocks, -1)
    # Candidates in block order, each block's in lax.top_k's order: for equal values the lower
    # vocabulary index comes first, as lax.top_k of the whole row puts them.
    index = (local + (jnp.arange(blocks, dtype=local.dtype) * block)[:, None]).reshape(batch, -1)
    top_values, at = jax.lax.top_k(values.reshape(batch, -1), k)
    top_index = jnp.take_along_axis(index, at, axis=-1)
    if per_block == k:
        return top_values, top_index
    # A block whose smallest candidate reaches the k-th value may hold more of the k largest.
    saturated = jnp.any(values[:, :, -1] >= top_values[:, -1:], axis=-1)
    return jax.lax.cond(jnp.any(saturated), lambda: tuple(jax.lax.top_k(x, k)),
                        lambda: (top_values, top_index))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x [B, V], k)`: through `blocked_top_k` on GPUs when k is above the kernel's
    limit and the vocabulary spans several blocks."""
    if (attention.traced_platform() == "gpu" and k > KERNEL_MAX_K
            and x.shape[-1] >= 4 * BLOCK):
        return blocked_top_k(x, k)
    return jax.lax.top_k(x, k)
