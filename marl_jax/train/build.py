"""Models, meshes and sharded train states for the stages.

The policy is a `CausalLM`; the reward model and the critic are `ScalarHeadModel`s over the same
backbone, so the reward model starts from the SFT backbone and the critic from the reward model,
as in the paper.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import models
from marl_jax.train import sharding


@flax.struct.dataclass
class TrainState:
    """State of a supervised stage (SFT, reward model)."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped_updates: jax.Array


def model_config(config, tokenizer) -> models.ModelConfig:
    """The policy's ModelConfig: from `config.model.path` or from `config.model.config` fields."""
    m = config.model
    if m.path:
        base, _ = models.load_pretrained(m.path, dtype=jnp.float32)
        cfg = base.config
    else:
        fields = dict(m.config)
        fields.setdefault("vocab_size", len(tokenizer))
        fields.setdefault("eos_token_id", (tokenizer.eos_token_id,))
        fields.setdefault("pad_token_id", tokenizer.pad_token_id)
        fields.setdefault("bos_token_id", tokenizer.bos_token_id)
        cfg = models.ModelConfig(**fields)
    return dataclasses.replace(cfg, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)


def policy_module(cfg: models.ModelConfig):
    return models.CausalLM(cfg)


def reward_module(cfg: models.ModelConfig):
    """Reward model: head std 1/sqrt(d + 1), so initial scores have unit scale."""
    return models.ScalarHeadModel(cfg, head_init_std=models.reward_head_init_std(cfg))


def critic_module(cfg: models.ModelConfig):
    """Critic: a near-zero head, so untrained values start near 0."""
    return models.ScalarHeadModel(cfg, head_init_std=models.VALUE_HEAD_INIT_STD)


def initial_policy_params(config, module, key):
    """Pretrained weights from `config.model.path`, or a fresh init."""
    if config.model.path:
        _, params = models.load_pretrained(config.model.path, dtype=jnp.float32)
        return params
    return models.init_params(module, key)


def param_shardings(module, mesh, abstract_params):
    return sharding.logical_to_sharding(models.logical_axes(module), mesh, shapes=abstract_params)


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
