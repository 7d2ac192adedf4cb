"""Models, meshes and sharded train states for the stages.

The policy is a `CausalLM`; the reward model and the critic are `ScalarHeadModel`s over the same
backbone, so the reward model starts from the SFT backbone and the critic from the reward model,
as in the paper.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import config as config_lib
from marl_jax import models
from marl_jax.models import attention, lora
from marl_jax.train import sharding


@flax.struct.dataclass
class TrainState:
    """State of a supervised stage (SFT, reward model)."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped_updates: jax.Array


# Weights read for `model_config` wait here for `initial_policy_params`, so a checkpoint that has
# to be read in full to learn its config (a GGUF file) is read once.
_pending_weights: dict = {}
_pending_lock = threading.Lock()
HUB_WEIGHT_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")


def pretrained_path(path: str) -> str:
    """A local checkpoint for `config.model.path`: the path itself when it exists (an HF
    directory or a .gguf file), else a Hugging Face Hub name ("google/gemma-2b") downloaded
    once into the hub cache (config, safetensors and tokenizer files only; gated models need
    `HF_TOKEN`; with `HF_HUB_OFFLINE=1` only an already cached copy is used)."""
    if os.path.exists(path):
        return path
    name = str(path)
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or name.endswith(".gguf"):
        raise FileNotFoundError(f"config.model.path={path!r}: no such file or directory (and not "
                                "a Hugging Face Hub name like 'google/gemma-2b')")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=name, allow_patterns=list(HUB_WEIGHT_PATTERNS))
    except Exception as error:  # offline, gated, misspelt: all end the same way for the user
        raise FileNotFoundError(
            f"config.model.path={path!r} is neither a local checkpoint nor a downloadable Hugging "
            f"Face Hub model ({type(error).__name__}: {error}); pass a local HF directory or "
            ".gguf file") from error


def _weights_key(config):
    m = config.model
    return (os.path.abspath(pretrained_path(m.path)), str(m.param_dtype))


def _read_pretrained(config):
    """(ModelConfig, params) of `config.model.path`, parameters in `config.model.param_dtype`,
    stacked when `config.model.scan_layers`."""
    path, dtype = _weights_key(config)
    module, params = models.load_pretrained(path, dtype=jnp.dtype(dtype),
                                            scan_layers=config.model.get("scan_layers", False))
    return module.config, params


def compute_dtype(config) -> str:
    """`config.model.dtype`, "auto" resolved: bfloat16 on GPUs and TPUs, float32 on CPUs."""
    dtype = config.model.dtype
    if dtype == "auto":
        # bf16 matmuls run at full rate on TPUs and GPUs; CPUs emulate bf16, so stay in fp32.
        dtype = "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"
    return dtype


def matmul_precision(config) -> str:
    """`config.model.matmul_precision`, "auto" resolved: highest when computing in float32,
    default otherwise (`ModelConfig.precision`)."""
    precision = config.model.get("matmul_precision", "auto")
    if precision == "auto":
        return "highest" if compute_dtype(config) == "float32" else "default"
    return precision


def model_config(config, tokenizer) -> models.ModelConfig:
    """The policy's ModelConfig: from `config.model.path` or from `config.model.config` fields.

    `config.model.dtype` is the compute dtype; "auto" means bfloat16 on GPUs and TPUs and
    float32 on CPUs.

    An HF directory is known from its config.json alone; a GGUF file is read in full, and its
    weights are kept for the `initial_policy_params` call that follows.
    """
    m = config.model
    if m.path:
        key = _weights_key(config)
        hf_config = pathlib.Path(key[0]) / "config.json"
        if hf_config.is_file():
            cfg = models.ModelConfig.from_hf(json.loads(hf_config.read_text()))
        else:
            cfg, params = _read_pretrained(config)
            with _pending_lock:
                _pending_weights.clear()
                _pending_weights[key] = params
    else:
        fields = dict(m.config)
        fields.setdefault("vocab_size", len(tokenizer))
        fields.setdefault("eos_token_id", (tokenizer.eos_token_id,))
        fields.setdefault("pad_token_id", tokenizer.pad_token_id)
        fields.setdefault("bos_token_id", tokenizer.bos_token_id)
        cfg = models.ModelConfig(**fields)
    precision = m.get("matmul_precision", "auto")
    cfg = dataclasses.replace(cfg, dtype=compute_dtype(config), param_dtype=m.param_dtype,
                              remat=config_lib.remat_policy(m.remat),
                              scan_layers=m.get("scan_layers", False), attention=m.get("attention", "auto"),
                              matmul_precision=None if precision == "auto" else precision,
                              sampler_layout=m.get("sampler_layout", "auto"))
    attention.resolve(cfg)  # a kernel asked for by name that cannot run here: one line, now
    return with_lora(cfg, config)


def with_lora(cfg: models.ModelConfig, config) -> models.ModelConfig:
    """`cfg` with the LoRA fields of `config.model.lora` (rank 0: unchanged), checked against
    the architecture's projections (one-line ValueError)."""
    lo = config.model.get("lora", None)
    if lo is None or not lo.rank:
        return cfg
    targets = tuple(lo.targets) or tuple(t for t in lora.TARGETS if t in lora.projection_dims(cfg))
    lora.check(int(lo.rank), targets, cfg)
    return dataclasses.replace(cfg, lora_rank=int(lo.rank), lora_alpha=float(lo.alpha),
                               lora_dropout=float(lo.get("dropout", 0.0)), lora_targets=targets)


def release_pretrained() -> None:
    """Drops weights `model_config` read that no `initial_policy_params` call took (e.g. when a
    stage only loads trained models)."""
    with _pending_lock:
        _pending_weights.clear()


def policy_module(cfg: models.ModelConfig):
    return models.CausalLM(cfg)


def reward_module(cfg: models.ModelConfig):
    """Reward model: head std 1/sqrt(d + 1), so initial scores have unit scale."""
    return models.ScalarHeadModel(cfg, head_init_std=models.reward_head_init_std(cfg))


def critic_module(cfg: models.ModelConfig):
    """Critic: a zero head with a bias, so untrained values start at 0, and a critic started
    from the reward model can be put on the scale of normalised scores."""
    return models.ScalarHeadModel(cfg, head_init_std=models.VALUE_HEAD_INIT_STD, head_bias=True)


def initial_policy_params(config, module, key):
    """Pretrained weights from `config.model.path` (in `config.model.param_dtype`; taken from
    `model_config`'s read when it had to read them), or a fresh init."""
    if config.model.path:
        with _pending_lock:
            params = _pending_weights.pop(_weights_key(config), None)
        if params is None:
            _, params = _read_pretrained(config)
        return params
    return models.init_params(module, key)


def param_shardings(module, mesh, abstract_params):
    """Shardings of `module`'s params, or of the part of them `abstract_params` holds (a LoRA
    stage's adapters and heads)."""
    logical = lora.select(models.logical_axes(module), abstract_params)
    return sharding.logical_to_sharding(logical, mesh, shapes=abstract_params)


def model_dims(cfg: models.ModelConfig) -> dict:
    """Sizes of the logical axes, so activation constraints fall back to replication when a
    mesh axis does not divide them."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "vocab": cfg.vocab_size,
            "mlp": cfg.intermediate_size, "embed": cfg.hidden_size}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def train_state_shardings(module, optimizer, mesh, params):
    """Shardings of a TrainState built from `params` (arrays or ShapeDtypeStructs)."""
    p_sh = param_shardings(module, mesh, abstract(params))
    o_sh = sharding.opt_state_shardings(optimizer, p_sh, mesh, params=abstract(params))
    rep = sharding.replicated(mesh)
    return TrainState(step=rep, params=p_sh, opt_state=o_sh, skipped_updates=rep)


def new_train_state(params, optimizer, shardings: TrainState) -> TrainState:
    """A sharded TrainState at step 0 (optimizer state created directly with its sharding).

    The params are copied: the state is donated to the train step, and the arrays it starts
    from (an earlier stage's model) must survive.
    """
    params = jax.device_put(params, shardings.params, may_alias=False)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
                      params=params, opt_state=opt_state,
                      skipped_updates=jax.device_put(jnp.zeros((), jnp.float32),
                                                     shardings.skipped_updates))
