"""Whole-sequence attention on TPUs through the Pallas splash-attention kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`), the contract of `attention.attend`.

The causal (or causal sliding-window) structure is the kernel's static block-sparse mask, so
blocks above the diagonal, or outside the window, are never computed; padding is a segment id:
valid tokens are segment 1 and padding segment 0, so a valid query sees exactly the valid keys
the decoder's mask gives it (padding query rows see padding keys, and are not part of the
contract). Grouped-query attention runs natively (query heads share their key-value head).
Logit soft-capping (Gemma-2) is the kernel's own. Sequence lengths must be multiples of 128
(the kernel's lane width); `shape_problem` says when they are not.
"""
from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

_LANES = 128
# Query / key block of the kernel: the largest of these that divides the sequence length.
_BLOCKS = (512, 256, 128)


def problem(config) -> str | None:
    """Why the kernel cannot take this config on a TPU (None: it can)."""
    if config.dtype not in ("bfloat16", "float16"):
        return (f"it is used for bfloat16 / float16 compute (model.dtype is {config.dtype}; float32 "
                "takes the reference einsums at the configured matmul precision)")
    if config.head_dim % 8:
        return f"it takes head dims that are multiples of 8 (head_dim is {config.head_dim})"
    return None


def shape_problem(q: jax.Array, k: jax.Array) -> str | None:
    """Why the kernel cannot take these query / key lengths (None: it can)."""
    if q.shape[1] % _LANES or k.shape[1] % _LANES:
        return (f"it needs query and key lengths that are multiples of {_LANES}, got {q.shape[1]} "
                f"and {k.shape[1]}")
    return None


def _block(length: int) -> int:
    return next(b for b in _BLOCKS if length % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, length: int, window: int | None, softcap: float | None, interpret: bool):
    """The splash kernel of `heads` heads over `length` tokens (causal, or causal within `window`),
    its block-sparsity tables as host (numpy) constants of the programs that call it.

    The tables are built in a thread of their own: JAX's trace and mesh contexts are per thread,
    so they are concrete host arrays there even when the caller traces under a compile-only TPU
    mesh, which has no devices to hold them."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_host_kernel, heads, length, window, softcap, interpret).result()


def _host_kernel(heads, length, window, softcap, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    shape = (length, length)
    if window is None:
        head_mask = mask_lib.CausalMask(shape)
    else:
        head_mask = mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    block = _block(length)
    blocks = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                   block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                   block_q_dq=block, block_kv_dq=block)
    with jax.default_device(jax.devices("cpu")[0]):
        kernel = kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([head_mask] * heads), block_sizes=blocks,
                                            attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
                                            interpret=interpret)
    return jax.tree.map(np.asarray, kernel)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, *, softcap: float | None = None,
           window: int | None = None, window_active=None, interpret: bool = False) -> jax.Array:
    """q `[B, T, N, H]` (already scaled), k, v `[B, T, K, H]`, valid bool `[B, T]` ->
    `[B, T, N, H]` in v's dtype: causal attention among the valid tokens, restricted to the last
    `window` keys when `window` is set and `window_active` (a traced flag; None: always) holds.
    `interpret`: run the kernel in Pallas' interpreter (any backend; tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    problem_text = shape_problem(q, k)
    if problem_text is not None:
        raise ValueError(f"splash attention: {problem_text}")
    heads, length = q.shape[2], q.shape[1]
    segments = valid.astype(jnp.int32)
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k.astype(q.dtype), v.astype(q.dtype)))

    def local_attention(qh, kh, vh, segments, *flag):
        causal = _kernel(qh.shape[1], length, None, softcap, interpret)

        def run(kernel):
            def one(q_row, k_row, v_row, segment_row):
                return kernel(q_row, k_row, v_row, segment_ids=kernel_lib.SegmentIds(segment_row, segment_row))

            return jax.vmap(one)(qh, kh, vh, segments)

        if window is None:
            return run(causal)
        local = _kernel(qh.shape[1], length, window, softcap, interpret)
        if not flag:
            return run(local)
        return jax.lax.cond(flag[0], lambda: run(local), lambda: run(causal))

    flags = () if window is None or window_active is None else (window_active,)
    args = (qh, kh, vh, segments) + flags
    specs = _shard_specs(heads, k.shape[2])
    if specs is None:
        out = local_attention(*args)
    else:
        # Mosaic kernels do not partition themselves: each device runs the kernel on its shard.
        q_spec, kv_spec, row_spec = specs
        out = jax.shard_map(local_attention, in_specs=(q_spec, kv_spec, kv_spec, row_spec) + (P(),) * len(flags),
                            out_specs=q_spec, check_vma=False)(*args)
    return out.transpose(0, 2, 1, 3).astype(v.dtype)


def _shard_specs(heads: int, kv_heads: int):
    """(query, key / value, row) partition specs of the head-major operands `[B, N, T, H]`,
    `[B, K, T, H]`, `[B, T]` under the current mesh and logical axis rules, or None without a
    mesh. The batch takes the activations' batch axes; the heads their axes when the key-value
    heads split the same way (or there is one, shared by all), else the heads stay whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    import flax.linen as nn

    batch, head_axes, kv_axes = nn.logical_to_mesh_axes(("activation_batch", "activation_heads",
                                                         "activation_kv_heads"))
    if head_axes is not None and head_axes != kv_axes and kv_heads != 1:
        head_axes = None
    kv = head_axes if kv_axes == head_axes else None
    return P(batch, head_axes, None, None), P(batch, kv, None, None), P(batch, None)
