"""The layout the sampler decodes with (`ModelConfig.sampler_layout`).

A decode step feeds one token per row: its matmuls are thin, so on a GPU the step's time is the
count of kernels it launches more than the bytes it reads. The sampler therefore may decode with
another layout of the same weights than the one the trainer keeps, built once per rollout:
- `train`: the model's own layout (layers in one scan when `scan_layers`);
- `unrolled`: the layers unrolled (no loop over layers inside the decode step, no dynamic slice
  of the stacked weights per layer);
- `fused`: unrolled, and q / k / v as one projection and gate / up as one
  (`params.fuse_projections`): four matmuls per layer instead of seven; refused with LoRA
  adapters on (`lora_rank` > 0), which run beside separate projections;
- `auto`: `fused` on an NVIDIA GPU (`unrolled` with LoRA adapters, or where the mesh shards the
  query heads over an axis the KV heads do not divide), `train` elsewhere (CPUs, where it
  changes nothing measurable, and TPUs until measured there).
The tokens are the same up to the matmuls' rounding: on a CPU in float32 the logprobs agree to
float32 rounding (tests).
"""
from __future__ import annotations

import flax.linen as nn

from marl_jax.models import attention as attention_lib
from marl_jax.models.params import compute_weights, fuse_projections, unstack_layers


def resolve(config, rules=None) -> str:
    """`config.sampler_layout` with `auto` resolved for the backend (`attention.target_platform`
    overrides JAX's default backend) and the logical axis `rules` (default: the current ones):
    train, unrolled or fused."""
    layout = config.sampler_layout
    if layout != "auto":
        return layout
    if attention_lib.traced_platform() != "gpu":
        return "train"
    return "unrolled" if config.lora_rank or kv_groups_split(rules) else "fused"


def kv_groups_split(rules=None) -> bool:
    """Whether the logical axis `rules` (default: the current ones; `sharding.logical_rules` of a
    mesh) shard the query heads over mesh axes the KV heads are not sharded over: KV heads that
    do not divide the tensor axis. The fused q / k / v kernel, one block per KV head, then
    compiles to more collectives per decode step than the separate projections (a sampler of 2
    layers over a tensor axis of 4 on fake CPU devices, the test: 13 all-reduces instead of 9,
    plus collective-permutes and all-to-alls the separate ones do without); sharding constraints
    on the fused kernel and on its output brought the all-reduces back, not the rest."""
    # One name per query: a spec uses a mesh axis once.
    heads, kv_heads = (nn.logical_to_mesh_axes((name,), rules)[0] for name in ("heads", "kv_heads"))
    return heads != kv_heads


def for_decoding(config, params):
    """(config, params) the sampler decodes with: `params` of a CausalLM with the weights cast to
    the compute dtype once (`compute_weights`), relaid for `resolve(config)`. Callable inside `jax.jit`: in a
    jitted rollout the relaid weights are built once per call."""
    params = compute_weights(params, config)
    layout = resolve(config)
    if layout == "train":
        return config, params
    changes = dict(remat="none", sampler_layout="train")
    if config.scan_layers:
        params, changes["scan_layers"] = unstack_layers(params), False
    if layout == "fused":
        params, changes["fused_projections"] = fuse_projections(params, config), True
    return config.replace(**changes), params
