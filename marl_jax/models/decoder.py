"""One config-driven decoder-only transformer (Flax linen) for the GPT-2, Llama, Gemma, Gemma-2,
Gemma 3, Qwen2, Qwen3, Mistral, OLMo-2 and Phi-3 families.

Two call paths share every layer:
- training / scoring: `Decoder(input_ids [B, T], attention_mask [B, T], positions [B, T])`, causal
  plus padding mask, no cache;
- incremental decoding: the same call with `cache` (`init_cache`) and `cache_index` (a scalar, or
  `[B]` when rows decode at different slots); the new keys/values are written at slots
  `[cache_index, cache_index + T)` and the queries attend to the whole cache under
  `kv_mask [B, S]` and causality.

Layers run unrolled (params `layers_{i}`, cache a list of per-layer `{"k", "v"}: [B, K, S, H]`) or,
with `config.scan_layers`, as one `nn.scan` over a stacked layer (params `layers` with a leading
"layers" axis, cache `{"k", "v"}: [L, B, K, S, H]` carried through the scan and updated in place),
so the compiled program holds one layer whatever the depth.

Every parameter carries logical axis names ("vocab", "embed", "heads", "kv_heads", "head_dim",
"mlp", "norm"; "layers" first when scanned) and the major activations carry logical constraints, so
a trainer shards by rules.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import attention as attention_lib
from marl_jax.models import lora as lora_lib
from marl_jax.models.config import (
    ModelConfig,
    local_rope_inverse_frequencies,
    rope_attention_factor,
    rope_inverse_frequencies,
)

# Unrolled: a list, per layer {"k": [B, K, S, H], "v": [B, K, S, H]}; scanned: {"k", "v"}: [L, B, K, S, H].
Cache = list | dict


def precision_scope(config: ModelConfig):
    """The context every dot of a model is traced in: `config.precision` (JAX's
    default_matmul_precision), so the policy, reference, critic and reward model compute each
    matmul and einsum, sampling and scoring alike, at one precision."""
    return jax.default_matmul_precision(config.precision)


def partitioned_param(module: nn.Module, name: str, init, shape: Sequence[int], axes: Sequence[str | None],
                      dtype):
    """`module.param` boxed with logical axis names (one per dimension) for rule-based sharding."""
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Position ids `[B, T]` int32: `cumsum(mask) - 1`, clamped at 0 on left padding."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def _activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.relu(x)


class Dense(nn.Module):
    """`y = x . W (+ b)` contracting the last `contract_dims` axes of x; W has shape
    `in_shape + features` and logical names `kernel_axes`; with `lora` (and this projection's
    name among its targets) plus a low-rank adapter path (`lora.low_rank_update`)."""

    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    contract_dims: int = 1
    use_bias: bool = False
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: lora_lib.LoraSettings | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[-self.contract_dims:]
        kernel = partitioned_param(self, "kernel", nn.initializers.normal(self.init_std),
                                   (*in_shape, *self.features), self.kernel_axes, self.param_dtype)
        y = jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.contract_dims)
        if self.use_bias:
            bias = partitioned_param(self, "bias", nn.initializers.zeros, self.features,
                                     self.kernel_axes[self.contract_dims:], self.param_dtype)
            y = y + bias.astype(self.dtype)
        return lora_lib.low_rank_update(self, x, y, self.lora, in_shape, self.kernel_axes,
                                        self.contract_dims, self.dtype)


class Norm(nn.Module):
    """RMSNorm (Llama: normalise in float32, cast, times w; OLMo-2: times w in float32, then
    cast; Gemma: times (1 + w) in float32, then cast) or LayerNorm (GPT-2), over the last
    axis."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dim = x.shape[-1]
        dtype = cfg.compute_dtype
        scale_init = nn.initializers.zeros if cfg.norm_scale_offset else nn.initializers.ones
        scale = partitioned_param(self, "scale", scale_init, (dim,), ("norm",), cfg.weight_dtype)
        xf = x.astype(jnp.float32)
        if cfg.norm_type == "layernorm":
            bias = partitioned_param(self, "bias", nn.initializers.zeros, (dim,), ("norm",), cfg.weight_dtype)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            y = (xf - mean) * jax.lax.rsqrt(var + cfg.norm_eps)
            return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + cfg.norm_eps)
        if cfg.norm_scale_offset or cfg.norm_scale_in_float32:
            return (y * (cfg.norm_scale_offset + scale.astype(jnp.float32))).astype(dtype)
        return y.astype(dtype) * scale.astype(dtype)


def rotary_tables(config: ModelConfig, positions: jax.Array, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, T, H / 2]` float32 for integer `positions [B, T]`; `local`: those of the
    sliding-window layers of a config with `local_rope_theta`."""
    if local:
        inv_freq = jnp.asarray(local_rope_inverse_frequencies(config))
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        return jnp.cos(angles), jnp.sin(angles)
    inv_freq = jnp.asarray(rope_inverse_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    factor = rope_attention_factor(config)
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x [B, T, heads, H]` in the half-split layout of Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _write_rows(cache: jax.Array, new: jax.Array, cache_index) -> jax.Array:
    """`cache [B, K, S, H]` with `new [B, K, T, H]` at slots `[cache_index, cache_index + T)`;
    cache_index a scalar or, per row, `[B]` (rows decoding at different slots: one scatter)."""
    if jnp.ndim(cache_index) == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, cache_index, 0))
    return jax.vmap(lambda rows, values, index: jax.lax.dynamic_update_slice(rows, values, (0, index, 0)))(
        cache, new, cache_index)


def _update_cache(cache: jax.Array, new: jax.Array, cache_index, layer) -> tuple[jax.Array, jax.Array]:
    """Writes `new [B, K, T, H]` at slots `[cache_index, cache_index + T)` (cache_index a scalar or
    `[B]`) of a layer cache `[B, K, S, H]` or, given `layer`, of that layer of a stacked cache
    `[L, B, K, S, H]`. Returns (this layer's keys or values to attend to `[B, K, S, H]`, the updated
    cache)."""
    new = new.astype(cache.dtype)
    axes = ("activation_batch", "activation_kv_heads", None, None)
    if layer is None:
        updated = nn.with_logical_constraint(_write_rows(cache, new, cache_index), axes)
        return updated, updated
    # Write the new slots into the carried stack, then read the layer back: XLA then updates the
    # stack in place at every decode step (reading the layer before the write, or scanning the
    # cache in and out of the layer scan, costs copies of whole layers or of the whole stack).
    if jnp.ndim(cache_index) == 0:
        stacked = jax.lax.dynamic_update_slice(cache, new[None], (layer, 0, 0, cache_index, 0))
    else:
        layer_cache = _write_rows(jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False), new, cache_index)
        stacked = jax.lax.dynamic_update_index_in_dim(cache, layer_cache, layer, 0)
    stacked = nn.with_logical_constraint(stacked, (None, *axes))
    return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False), stacked


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, rotary, mask, cache=None, cache_index=None, layer=None, valid=None, window_active=None,
                 window=None, prefill=False):
        """x `[B, T, D]`; rotary (cos, sin) or None; mask bool `[B, T, S]`; cache: this layer's
        `{"k", "v"}: [B, K, S, H]`, or with `layer` (traced index) the stacked `[L, B, K, S, H]`.
        Without a cache, or with `prefill` (a fresh cache written from slot 0) under a fused
        kernel, the queries attend to this call's own keys through `attention.attend` (valid
        `[B, T]`: the tokens that are not padding; window: the sliding window the mask holds
        (static), window_active: a traced flag saying whether it does, in a scan over mixed
        layers); a decode step, and a prefill under the reference einsums, attend to the cache.
        Returns (`[B, T, D]`, updated cache or None)."""
        cfg = self.config
        dense = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, init_std=cfg.initializer_range,
                     lora=lora_lib.settings(cfg))
        if cfg.fused_projections:
            # One matmul: per KV head its G query heads, then its key and its value
            # (`params.fuse_projections`), so a split over KV heads keeps each group whole.
            groups = cfg.num_heads // cfg.num_kv_heads
            qkv = Dense((cfg.num_kv_heads, groups + 2, cfg.head_dim), ("embed", "kv_heads", None, "head_dim"),
                        use_bias=cfg.qkv_bias, name="qkv", **dense)(x)
            q = qkv[..., :groups, :].reshape(*qkv.shape[:2], cfg.num_heads, cfg.head_dim)
            k, v = qkv[..., groups, :], qkv[..., groups + 1, :]
        else:
            q = Dense((cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"), use_bias=cfg.qkv_bias,
                      name="q", **dense)(x)
            k = Dense((cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), use_bias=cfg.qkv_bias,
                      name="k", **dense)(x)
            v = Dense((cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), use_bias=cfg.qkv_bias,
                      name="v", **dense)(x)
        q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
        k = nn.with_logical_constraint(k, ("activation_batch", "activation_length", "activation_kv_heads", None))
        v = nn.with_logical_constraint(v, ("activation_batch", "activation_length", "activation_kv_heads", None))
        if cfg.qk_norm == "head":
            q, k = Norm(cfg, name="q_norm")(q), Norm(cfg, name="k_norm")(k)
        elif cfg.qk_norm == "projection":
            q = Norm(cfg, name="q_norm")(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
            k = Norm(cfg, name="k_norm")(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
            k = apply_rotary(k, *rotary)
        q = q * jnp.asarray((cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5, q.dtype)
        new_cache = None
        # A prefill through a fused kernel attends to its own keys; the reference einsums read
        # the cache as a decode step does (the numbers of every earlier version).
        if cache is None or (prefill and attention_lib.resolve(cfg) != "reference"):
            if cache is not None:
                length = x.shape[1]
                (_, new_k), (_, new_v) = (_update_cache(cache[name], new.transpose(0, 2, 1, 3), 0, layer)
                                          for name, new in (("k", k), ("v", v)))
                new_cache = {"k": new_k, "v": new_v}
                mask, valid = mask[..., :length], valid[:, :length]
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            out = attention_lib.attend(q, k, v, mask, valid=valid, config=cfg, window=window,
                                       window_active=window_active)
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            (k, new_k), (v, new_v) = (_update_cache(cache[name], new, cache_index, layer)
                                      for name, new in (("k", k), ("v", v)))
            # A key mask narrower than the cache: the slots beyond it are not read.
            read = mask.shape[-1]
            k, v, new_cache = k[:, :, :read].astype(q.dtype), v[:, :, :read].astype(q.dtype), {"k": new_k, "v": new_v}
            out = attention_lib.reference(q, k, v, mask, cfg.attn_logit_softcap)
        out = nn.with_logical_constraint(out, ("activation_batch", "activation_length", "activation_heads", None))
        out = Dense((cfg.hidden_size,), ("heads", "head_dim", "embed"), contract_dims=2, use_bias=cfg.out_bias,
                    name="o", **dense)(out)
        return out, new_cache


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dense = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, init_std=cfg.initializer_range,
                     use_bias=cfg.mlp_bias, lora=lora_lib.settings(cfg))
        if cfg.fused_projections and cfg.gated_mlp:
            # One matmul for both halves (`params.fuse_projections`): [..., 2, F], gate first.
            both = Dense((2, cfg.intermediate_size), ("embed", None, "mlp"), name="gate_up", **dense)(x)
            hidden = _activation(cfg.activation, both[..., 0, :]) * both[..., 1, :]
        else:
            hidden = _activation(cfg.activation, Dense((cfg.intermediate_size,), ("embed", "mlp"), name=(
                "gate" if cfg.gated_mlp else "up"), **dense)(x))
            if cfg.gated_mlp:
                hidden = hidden * Dense((cfg.intermediate_size,), ("embed", "mlp"), name="up", **dense)(x)
        hidden = nn.with_logical_constraint(hidden, ("activation_batch", "activation_length", "activation_mlp"))
        return Dense((cfg.hidden_size,), ("mlp", "embed"), name="down", **dense)(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with `sandwich_norms` (Gemma-2/3,
    OLMo-2) the attention and MLP outputs are normalised before the residual add, and without
    `pre_norms` (OLMo-2) their inputs are not."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, rotary, mask, cache=None, cache_index=None, layer=None, valid=None, window_active=None,
                 window=None, prefill=False):
        """See `Attention` for the arguments; `window` and `prefill` are static."""
        cfg = self.config
        attn_in = Norm(cfg, name="attn_norm")(x) if cfg.pre_norms else x
        attn_out, new_cache = Attention(cfg, name="attn")(attn_in, rotary, mask, cache, cache_index, layer, valid,
                                                          window_active, window, prefill)
        if cfg.sandwich_norms:
            attn_out = Norm(cfg, name="post_attn_norm")(attn_out)
        x = x + attn_out
        mlp_out = MLP(cfg, name="mlp")(Norm(cfg, name="mlp_norm")(x) if cfg.pre_norms else x)
        if cfg.sandwich_norms:
            mlp_out = Norm(cfg, name="post_mlp_norm")(mlp_out)
        x = x + mlp_out
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
        return x, new_cache


class Embedding(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embedding = partitioned_param(self, "embedding", nn.initializers.normal(cfg.initializer_range),
                                           (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.weight_dtype)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, input_ids, axis=0).astype(self.config.compute_dtype)


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
# DecoderLayer.__call__'s static arguments (window, prefill), counting self.
_STATIC_LAYER_ARGS = (9, 10)


def _layer_class(cfg: ModelConfig):
    if cfg.remat == "none":
        return DecoderLayer
    policy = _REMAT_POLICIES[cfg.remat]
    if cfg.scan_layers:
        # With full remat, of each layer only its input (the scan carry) is kept for the backward
        # pass, so activation memory is L x [B, T, D] plus one layer's intermediates. The scan's
        # loop already keeps XLA from merging recomputation and forward pass, so no CSE barriers.
        return nn.remat(DecoderLayer, prevent_cse=False, policy=policy, static_argnums=_STATIC_LAYER_ARGS)
    return nn.remat(DecoderLayer, policy=None if cfg.remat == "full" else policy,
                    static_argnums=_STATIC_LAYER_ARGS)


def _scanned_layer(layer: DecoderLayer, carry, index, sliding, rotary, local_rotary, mask, window_mask,
                   cache_index, valid, *, window, mixed, prefill):
    """One step of the layer scan: carry (x `[B, T, D]`, stacked cache or None); per layer its
    index and sliding-window flag. window: the sliding window of the windowed layers (None when
    there are none); mixed: whether the stack mixes windowed and full layers (the attention
    kernels then get the window with this layer's flag)."""
    x, cache = carry
    if window_mask is not None:
        mask = jnp.where(sliding, window_mask, mask)
    if local_rotary is not None:
        rotary = tuple(jnp.where(sliding, local, full) for local, full in zip(local_rotary, rotary))
    x, cache = layer(x, rotary, mask, cache, cache_index, None if cache is None else index, valid,
                     sliding if mixed else None, window, prefill)
    return (x, cache), None


def _rotaries(cfg: ModelConfig, positions) -> tuple:
    """(rotary tables of full-attention layers, of sliding layers when they differ, else None)."""
    if cfg.position_embedding == "learned":
        return None, None
    local = rotary_tables(cfg, positions, local=True) if cfg.local_rope_theta and cfg.sliding_layers else None
    return rotary_tables(cfg, positions), local


class Decoder(nn.Module):
    """Token embedding, layers, final norm. Returns hidden states `[B, T, D]` (and the updated
    cache when called with one)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = Embedding(cfg)
        if cfg.position_embedding == "learned":
            self.position_embed = partitioned_param(
                self, "position_embedding", nn.initializers.normal(cfg.initializer_range),
                (cfg.max_position_embeddings, cfg.hidden_size), (None, "embed"), cfg.weight_dtype)
        layer = _layer_class(cfg)
        if cfg.scan_layers:
            self.layers = layer(cfg)
        else:
            self.layers = [layer(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.final_norm = Norm(cfg)

    def __call__(self, input_ids, attention_mask, positions=None, cache: Cache | None = None, cache_index=None):
        """input_ids `[B, T]`; attention_mask `[B, T]` (no cache) or the key mask `[B, S]` over the
        first S slots of the cache (with cache; a decode step reads only those, so a mask as wide
        as the longest live position saves reading the rest); positions `[B, T]` (default: from
        the mask, without cache).
        A call with a cache and `cache_index` the Python int 0 is a prefill: its queries attend
        to their own keys through the whole-sequence attention (`attention.attend`)."""
        with precision_scope(self.config):
            return self._forward(input_ids, attention_mask, positions, cache, cache_index)

    def _forward(self, input_ids, attention_mask, positions, cache, cache_index):
        cfg = self.config
        batch, length = input_ids.shape
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when decoding with a cache")
            positions = positions_from_mask(attention_mask)
        if cache is not None and isinstance(cache, dict) != cfg.scan_layers:
            raise ValueError(f"the cache layout does not match config.scan_layers={cfg.scan_layers}; "
                             "build the cache with init_cache(config, ...)")
        prefill = cache is not None and isinstance(cache_index, int) and cache_index == 0
        x = self._embed(input_ids, positions)
        rotary, local_rotary = _rotaries(cfg, positions)
        key_valid = attention_mask.astype(bool)
        if cache is None:
            query_slot = jnp.arange(length)
            key_slot = jnp.arange(length)
        else:
            # [T], or [B, T] when each row writes at its own cache_index.
            query_slot = jnp.asarray(cache_index)[..., None] + jnp.arange(length)
            key_slot = jnp.arange(key_valid.shape[1])
        distance = query_slot[..., :, None] - key_slot  # [T, S] or [B, T, S]
        mask = (distance >= 0) & key_valid[:, None, :]
        # Valid tokens of a row occupy contiguous slots, so slot distance is position distance.
        window_mask = mask & (distance < cfg.sliding_window) if cfg.sliding_layers else None
        if cfg.scan_layers:
            sliding = np.isin(np.arange(cfg.num_layers), cfg.sliding_layers)
            window = cfg.sliding_window if sliding.any() else None
            # Each layer draws its own rngs: init's, and the adapters' dropout masks.
            scan = nn.scan(functools.partial(_scanned_layer, window=window, mixed=not sliding.all(),
                                             prefill=prefill),
                           variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                           in_axes=(0, 0) + (nn.broadcast,) * 6, length=cfg.num_layers,
                           unroll=cfg.scan_unroll, metadata_params={nn.PARTITION_NAME: "layers"})
            (x, new_cache), _ = scan(self.layers, (x, cache), jnp.arange(cfg.num_layers), jnp.asarray(sliding),
                                     rotary, local_rotary, mask, window_mask, cache_index, key_valid)
            return self.final_norm(x), new_cache
        new_cache = [] if cache is not None else None
        for i, layer in enumerate(self.layers):
            sliding = i in cfg.sliding_layers
            x, layer_cache = layer(x, local_rotary if sliding and local_rotary else rotary,
                                   window_mask if sliding else mask, None if cache is None else cache[i], cache_index,
                                   None, key_valid, None, cfg.sliding_window if sliding else None, prefill)
            if cache is not None:
                new_cache.append(layer_cache)
        return self.final_norm(x), new_cache

    def _embed(self, input_ids, positions):
        """Token (and learned position) embeddings `[B, T, D]`."""
        cfg = self.config
        x = self.embed(input_ids)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
        if cfg.position_embedding == "learned":
            x = x + jnp.take(self.position_embed, positions, axis=0).astype(x.dtype)
        return nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))

    def _unrolled_inputs(self, attention_mask, name: str):
        """(positions, (rotary tables, sliding-layer rotary tables), causal mask, sliding-window mask)
        of a full sequence (no cache)."""
        cfg = self.config
        if cfg.scan_layers:
            raise ValueError(f"Decoder.{name} runs a range of layers: it needs unrolled layers "
                             "(config.scan_layers=False)")
        positions = positions_from_mask(attention_mask)
        rotary = _rotaries(cfg, positions)
        slot = jnp.arange(attention_mask.shape[1])
        distance = slot[:, None] - slot[None, :]
        mask = (distance >= 0)[None] & attention_mask.astype(bool)[:, None, :]
        window_mask = mask & (distance < cfg.sliding_window)[None] if cfg.sliding_layers else None
        return positions, rotary, mask, window_mask

    def _layer_range(self, x, rotary, mask, window_mask, valid, start: int, stop: int):
        """Layers `[start, stop)`; rotary: (full-attention tables, sliding-layer tables or None)."""
        cfg = self.config
        full, local = rotary
        for i in range(start, stop):
            sliding = i in cfg.sliding_layers
            x, _ = self.layers[i](x, local if sliding and local else full, window_mask if sliding else mask, None,
                                  None, None, valid, None, cfg.sliding_window if sliding else None, False)
        return x

    def trunk(self, input_ids, attention_mask, num_layers: int):
        """The embeddings and the first `num_layers` layers: hidden states `[B, T, D]` (positions
        from the mask, no cache), which `top` finishes. Models whose embeddings and first
        `num_layers` layers are equal share them."""
        with precision_scope(self.config):
            positions, rotary, mask, window_mask = self._unrolled_inputs(attention_mask, "trunk")
            return self._layer_range(self._embed(input_ids, positions), rotary, mask, window_mask,
                                     attention_mask.astype(bool), 0, num_layers)

    def top(self, x, attention_mask, start: int):
        """Layers `start..L-1` and the final norm on `trunk(input_ids, attention_mask, start)`:
        the hidden states `[B, T, D]` of `__call__`."""
        with precision_scope(self.config):
            _, rotary, mask, window_mask = self._unrolled_inputs(attention_mask, "top")
            return self.final_norm(self._layer_range(x, rotary, mask, window_mask, attention_mask.astype(bool),
                                                     start, self.config.num_layers))


def init_cache(config: ModelConfig, batch: int, length: int, dtype=None) -> Cache:
    """Zero KV cache in the compute dtype: per layer `{"k", "v"}: [B, K, S, H]`, or with
    `config.scan_layers` one stacked `{"k", "v"}: [L, B, K, S, H]`."""
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    if config.scan_layers:
        shape = (config.num_layers, *shape)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(config.num_layers)]
