"""LoRA adapters written in PEFT's format, so `peft.PeftModel.from_pretrained(base, directory)`
adds them to the transformers model of their base.

    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
    adapter_model.safetensors  base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight
                               [r, in] and ...lora_B.weight [out, r], per targeted projection;
                               a reward model's head as base_model.model.score.weight [1, D]
                               (task SEQ_CLS, `score` among PEFT's modules_to_save)

Our A `[in..., r]` and B `[r, out...]` flatten their head axes in the order the key map
(`keymap.py`) flattens the kernels', so the adapter acts on the same rows and columns.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from flax import traverse_util

from marl_jax.models.config import ModelConfig
from marl_jax.models.params import unstack_layers

# Our projection name -> PEFT's module name under a llama-like decoder layer.
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
_PARENT = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    """PEFT-named float32 tensors of the adapters in a CausalLM's `params` (unrolled or
    scanned)."""
    if config.family == "gpt2":
        raise ValueError("PEFT export: gpt2 fuses q, k and v into one c_attn Conv1D, which has "
                         "no per-projection LoRA module; export the merged model instead")
    params = jax.tree.map(np.asarray, jax.device_get(params))
    flat = traverse_util.flatten_dict(unstack_layers(params) if config.scan_layers else params)
    state = {}
    for i in range(config.num_layers):
        for target in config.lora_targets:
            ours = ("backbone", f"layers_{i}", _PARENT[target], target)
            if ours + ("lora_a",) not in flat:
                raise ValueError(f"PEFT export: params lack the {target} adapter of layer {i}")
            a, b = flat[ours + ("lora_a",)], flat[ours + ("lora_b",)]
            name = f"base_model.model.model.layers.{i}.{MODULES[target]}"
            rank = a.shape[-1]
            state[f"{name}.lora_A.weight"] = np.ascontiguousarray(
                a.reshape(-1, rank).T.astype(np.float32))
            state[f"{name}.lora_B.weight"] = np.ascontiguousarray(
                b.reshape(rank, -1).T.astype(np.float32))
    if ("head", "kernel") in flat:
        state["base_model.model.score.weight"] = np.ascontiguousarray(flat[("head", "kernel")].T)
    return state


def adapter_config(config: ModelConfig, base_model_name_or_path: str, scores: bool = False) -> dict:
    """`scores`: a reward model's adapter (sequence classification with its `score` head)."""
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if scores else "CAUSAL_LM",
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(MODULES[t].split(".")[-1] for t in config.lora_targets),
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
