"""Parameter initialisation, logical sharding axes, and conversion between the unrolled and the
scanned layer layouts, as plain pytrees."""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from marl_jax.models.lora import ADAPTER_NAMES

_LAYER_KEY = re.compile(r"layers_(\d+)$")


def _boxed_init(model: nn.Module, key: jax.Array):
    ids = jnp.zeros((1, 1), jnp.int32)
    return model.init(key, ids, jnp.ones_like(ids))["params"]


def init_params(model: nn.Module, key: jax.Array) -> dict:
    """Random parameters (plain arrays, no partitioning boxes). Jittable: wrap in
    `jax.jit(..., out_shardings=...)` to initialise directly into a sharded layout."""
    return nn.meta.unbox(_boxed_init(model, key))


def logical_axes(model: nn.Module) -> dict:
    """`jax.sharding.PartitionSpec` of logical axis names for every parameter, same tree as
    `init_params`."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(model, jax.random.key(0))))


def _backbone(params: dict) -> dict:
    if not isinstance(params, dict) or "backbone" not in params:
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"expected the params of a CausalLM or ScalarHeadModel (a dict with 'backbone'), got {keys}")
    return dict(params["backbone"])


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled params (`backbone/layers_{i}/...`, i < num_layers) -> scanned params
    (`backbone/layers/...`, every leaf stacked on a new leading axis `[L, ...]`). Other entries
    (embeddings, final norm, LM or scalar head) are kept as they are. Jittable."""
    backbone = _backbone(params)
    found = sorted(int(m.group(1)) for key in backbone if (m := _LAYER_KEY.match(key)))
    if "layers" in backbone or found != list(range(num_layers)):
        raise ValueError(f"params['backbone'] must hold layers_0 .. layers_{num_layers - 1} (num_layers="
                         f"{num_layers}), got {'a stacked layers entry' if 'layers' in backbone else found}")
    layers = [backbone.pop(f"layers_{i}") for i in range(num_layers)]
    backbone["layers"] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
    return {**params, "backbone": backbone}


def unstack_layers(params: dict) -> dict:
    """Scanned params (`backbone/layers/...` with a leading layer axis `[L, ...]`) -> unrolled
    params (`backbone/layers_{i}/...`); the inverse of `stack_layers`. Jittable."""
    backbone = _backbone(params)
    if "layers" not in backbone:
        raise ValueError("params['backbone'] has no stacked 'layers' entry (are they unrolled already?)")
    stacked = backbone.pop("layers")
    num_layers = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(num_layers) != 1:
        raise ValueError(f"params['backbone']['layers'] leaves disagree on the layer count: {sorted(num_layers)}")
    for i in range(num_layers.pop()):
        backbone[f"layers_{i}"] = jax.tree.map(lambda leaf, i=i: leaf[i], stacked)
    return {**params, "backbone": backbone}


# Leaves every forward casts to the compute dtype before its matmul or lookup (Dense kernels,
# token and position embeddings, the untied LM head, a scalar head's kernel); norm scales, biases
# and LoRA adapters keep their storage dtype, as the forward reads them.
_COMPUTE_CAST_LEAVES = ("kernel", "embedding", "position_embedding", "lm_head")


def compute_weights(params, config) -> dict:
    """`params` with the leaves each forward casts to `config.compute_dtype` cast once, here:
    a model applied to the result computes the same numbers as on `params`, without a cast per
    layer call (and per rematerialised call in the backward pass). Gradients through it reach
    the float32 master weights. Unchanged when the compute and storage dtypes agree."""
    dtype = jnp.dtype(config.dtype)
    if dtype == jnp.dtype(config.param_dtype):
        return params

    def cast(path, leaf):
        name = getattr(path[-1], "key", None)
        if name in _COMPUTE_CAST_LEAVES and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def _fuse_attention(attn: dict, groups: int) -> dict:
    """`q`, `k`, `v` of one attention block (kernels `[..., D, N, H]`, `[..., D, K, H]`; biases
    `[..., N, H]`, `[..., K, H]`) -> one `qkv` (kernel `[..., D, K, G + 2, H]`, bias
    `[..., K, G + 2, H]`): per KV head its G query heads, then its key and value."""
    attn = dict(attn)
    q, k, v = (attn.pop(name) for name in ("q", "k", "v"))

    def fuse(leaf):  # [..., N, H], [..., K, H], [..., K, H] -> [..., K, G + 2, H]
        grouped = q[leaf].reshape(*q[leaf].shape[:-2], -1, groups, q[leaf].shape[-1])
        return jnp.concatenate([grouped, k[leaf][..., None, :], v[leaf][..., None, :]], axis=-2)

    attn["qkv"] = {leaf: fuse(leaf) for leaf in q if leaf not in ADAPTER_NAMES}
    return attn


def _fuse_mlp(mlp: dict) -> dict:
    """`gate`, `up` (kernels `[..., D, F]`, biases `[..., F]`) -> one `gate_up` (`[..., D, 2, F]`,
    `[..., 2, F]`, gate first)."""
    mlp = dict(mlp)
    gate, up = mlp.pop("gate"), mlp.pop("up")
    mlp["gate_up"] = {leaf: jnp.stack([gate[leaf], up[leaf]], axis=-2) for leaf in gate
                      if leaf not in ADAPTER_NAMES}
    return mlp


def fuse_projections(params: dict, config) -> dict:
    """Params of `config` (unrolled or scanned layers, no LoRA adapters) -> the params of
    `config.replace(fused_projections=True)`: each layer's q / k / v kernels (and biases) in one
    `attn/qkv` and, in a gated MLP, gate / up in one `mlp/gate_up`, so a forward runs one matmul
    where it ran three and two. The same numbers up to the matmuls' rounding. Adapter leaves of
    the fused projections (params of a LoRA model applied with its adapters off, which ignores
    them) are left out. Jittable."""
    if config.lora_rank:
        raise ValueError("fuse_projections: the params hold LoRA adapters; fused projections take none")
    groups = config.num_heads // config.num_kv_heads
    backbone = _backbone(params)
    for name, layer in backbone.items():
        if name != "layers" and not _LAYER_KEY.match(name):
            continue
        if "qkv" in layer["attn"]:
            raise ValueError(f"fuse_projections: params['backbone'][{name!r}] is fused already")
        layer = {**layer, "attn": _fuse_attention(layer["attn"], groups)}
        if config.gated_mlp:
            layer["mlp"] = _fuse_mlp(layer["mlp"])
        backbone[name] = layer
    return {**params, "backbone": backbone}
