"""Writing a transformers-loadable directory (config.json + model.safetensors) from our params, so
a trained policy, reward model or critic can be served or evaluated with any HF tool."""
from __future__ import annotations

import json
import os
import pathlib

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils

from marl_jax.models import keymap
from marl_jax.models.config import SEQUENCE_CLASSIFICATION_ARCHITECTURES
from marl_jax.models.heads import CausalLM, ScalarHeadModel
from marl_jax.models.params import unstack_layers


def _to_numpy(params) -> dict:
    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(fetch, nn.meta.unbox(params))


def hf_state_dict(model: nn.Module, params) -> dict[str, np.ndarray]:
    """HF-named tensors (contiguous numpy arrays, parameter dtype) of `params` (unrolled or, with
    `config.scan_layers`, stacked: the same checkpoint either way)."""
    cfg = model.config
    params = _to_numpy(params)
    flat = traverse_util.flatten_dict(unstack_layers(params) if cfg.scan_layers else params)
    rules = keymap.backbone_rules(cfg)
    if isinstance(model, ScalarHeadModel):
        rules.append(keymap.score_rule())
    elif not cfg.tie_word_embeddings:
        rules.append(keymap.lm_head_rule())
    state = {}
    for rule in rules:
        missing = [path for path in rule.paths if path not in flat]
        if missing:
            raise ValueError(f"params lack {['/'.join(p) for p in missing]} needed for {rule.hf_name}")
        state[rule.hf_name] = np.ascontiguousarray(rule.to_hf(*(flat[path] for path in rule.paths)))
    return state


def hf_config(model: nn.Module) -> dict:
    config = model.config.to_hf()
    if isinstance(model, ScalarHeadModel):
        config.update(architectures=[SEQUENCE_CLASSIFICATION_ARCHITECTURES[model.config.family]],
                      num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return config


def save_pretrained(model: nn.Module, params, path: str | os.PathLike) -> pathlib.Path:
    """Writes `config.json` and `model.safetensors` into directory `path` (created if needed).
    `CausalLM` -> `*ForCausalLM` / `GPT2LMHeadModel`; `ScalarHeadModel` ->
    `*ForSequenceClassification` with `num_labels=1`. Only process 0 writes."""
    import safetensors.numpy

    if not isinstance(model, (CausalLM, ScalarHeadModel)):
        raise ValueError(f"save_pretrained expects a CausalLM or ScalarHeadModel, got {type(model).__name__}")
    state = hf_state_dict(model, params)
    directory = pathlib.Path(path)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(hf_config(model), indent=2, sort_keys=True))
        safetensors.numpy.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
