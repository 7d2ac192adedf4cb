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
- `auto`: `fused` on an NVIDIA GPU (`unrolled` with LoRA adapters), `train` elsewhere (CPUs,
  where it changes nothing measurable, and TPUs until measured there).
The tokens are the same up to the matmuls' rounding: on a CPU in float32 the logprobs agree to
float32 rounding (tests).
"""
from __future__ import annotations

from marl_jax.models import attention as attention_lib
from marl_jax.models.params import compute_weights, fuse_projections, unstack_layers


def resolve(config) -> str:
    """`config.sampler_layout` with `auto` resolved for the backend (`attention.target_platform`
    overrides JAX's default backend): train, unrolled or fused."""
    layout = config.sampler_layout
    if layout != "auto":
        return layout
    if attention_lib.traced_platform() != "gpu":
        return "train"
    return "unrolled" if config.lora_rank else "fused"


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
