"""LoRA adapters written in PEFT's format, so `peft.PeftModel.from_pretrained(base, directory)`
adds them to the transformers model of their base.

    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
                               (rank_pattern / alpha_pattern for fused modules)
    adapter_model.safetensors  base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight
                               [r, in] and ...lora_B.weight [out, r], per targeted projection;
                               a reward model's head as base_model.model.score.weight [1, D]
                               (task SEQ_CLS, `score` among PEFT's modules_to_save)

Our A `[in..., r]` and B `[r, out...]` flatten their head axes in the order the key map
(`keymap.py`) flattens the kernels', so the adapter acts on the same rows and columns.

Phi-3 fuses q, k and v into one `qkv_proj` and gate and up into one `gate_up_proj`; PEFT can only
adapt those fused modules. Their adapter stacks the parts' A matrices, `A = [A_q; A_k; A_v]`
`[m r, in]` for the m targeted parts, and places each part's B on its own output rows and rank
columns (block-diagonal, zero rows for an untargeted part), at rank m r and alpha m alpha
(`rank_pattern`, `alpha_pattern`), so alpha / r and every part's update are unchanged.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from flax import traverse_util

from marl_jax.models import lora
from marl_jax.models.config import ModelConfig
from marl_jax.models.params import unstack_layers

# Our projection name -> PEFT's module name under a llama-like decoder layer.
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
# Phi-3's modules: its fused ones hold several of our projections, in this order.
PHI3_MODULES = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
                "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": ("down",)}
_PARENT = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_modules(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """PEFT's module name -> the targeted projections it holds, in its output order (one each,
    except Phi-3's fused `qkv_proj` and `gate_up_proj`)."""
    modules = PHI3_MODULES if config.family == "phi3" else {
        module: (target,) for target, module in MODULES.items()}
    out = {}
    for module, parts in modules.items():
        targeted = tuple(p for p in parts if p in config.lora_targets)
        if targeted:
            out[module] = targeted
    return out


def adapter_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    """PEFT-named float32 tensors of the adapters in a CausalLM's `params` (unrolled or
    scanned)."""
    if config.family == "gpt2":
        raise ValueError("PEFT export: gpt2 fuses q, k and v into one c_attn Conv1D, which has "
                         "no per-projection LoRA module; export the merged model instead")
    params = jax.tree.map(np.asarray, jax.device_get(params))
    flat = traverse_util.flatten_dict(unstack_layers(params) if config.scan_layers else params)
    dims = lora.projection_dims(config)
    fused = PHI3_MODULES if config.family == "phi3" else {}
    state = {}
    for i in range(config.num_layers):
        for module, targeted in peft_modules(config).items():
            a_parts, b_parts = {}, {}
            for target in targeted:
                ours = ("backbone", f"layers_{i}", _PARENT[target], target)
                if ours + ("lora_a",) not in flat:
                    raise ValueError(f"PEFT export: params lack the {target} adapter of layer {i}")
                a, b = flat[ours + ("lora_a",)], flat[ours + ("lora_b",)]
                rank = a.shape[-1]
                a_parts[target] = a.reshape(-1, rank).T.astype(np.float32)  # [r, in]
                b_parts[target] = b.reshape(rank, -1).T.astype(np.float32)  # [out, r]
            if len(fused.get(module, ())) > 1:
                a_out, b_out = _fused(fused[module], targeted, a_parts, b_parts, dims)
            else:
                a_out, b_out = a_parts[targeted[0]], b_parts[targeted[0]]
            name = f"base_model.model.model.layers.{i}.{module}"
            state[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_out)
            state[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_out)
    if ("head", "kernel") in flat:
        state["base_model.model.score.weight"] = np.ascontiguousarray(flat[("head", "kernel")].T)
    return state


def _fused(parts, targeted, a_parts, b_parts, dims):
    """(A `[m r, in]`, B `[sum of the parts' outputs, m r]`) of a fused module: the targeted
    parts' A stacked, each one's B on its own output rows and rank columns."""
    rank = a_parts[targeted[0]].shape[0]
    a = np.concatenate([a_parts[t] for t in targeted])
    b = np.zeros((sum(dims[p][1] for p in parts), rank * len(targeted)), np.float32)
    row = 0
    for part in parts:
        if part in targeted:
            col = targeted.index(part) * rank
            b[row:row + dims[part][1], col:col + rank] = b_parts[part]
        row += dims[part][1]
    return a, b


def adapter_config(config: ModelConfig, base_model_name_or_path: str, scores: bool = False) -> dict:
    """`scores`: a reward model's adapter (sequence classification with its `score` head)."""
    modules = peft_modules(config)
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if scores else "CAUSAL_LM",
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(module.split(".")[-1] for module in modules),
        # Fused modules (Phi-3) at rank m r and alpha m alpha: the same alpha / r.
        "rank_pattern": {module.split(".")[-1]: len(parts) * config.lora_rank
                         for module, parts in modules.items() if len(parts) > 1},
        "alpha_pattern": {module.split(".")[-1]: len(parts) * config.lora_alpha
                          for module, parts in modules.items() if len(parts) > 1},
        "base_model_name_or_path": str(base_model_name_or_path),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": ["score"] if scores else None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_adapter(config: ModelConfig, params, directory: str | os.PathLike,
                 base_model_name_or_path: str) -> pathlib.Path:
    """Writes `adapter_config.json` and `adapter_model.safetensors` of the adapters in `params`
    (a CausalLM's, or a reward model's with its head) into `directory`; only process 0
    writes."""
    import safetensors.numpy

    state = adapter_state_dict(config, params)
    directory = pathlib.Path(directory)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(
            adapter_config(config, base_model_name_or_path, "head" in params), indent=2,
            sort_keys=True))
        safetensors.numpy.save_file(state, str(directory / ADAPTER_WEIGHTS),
                                    metadata={"format": "pt"})
    return directory
