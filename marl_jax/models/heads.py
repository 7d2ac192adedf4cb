"""Models on top of the shared `Decoder` backbone: the causal LM (policy, reference) and the
per-token scalar head (critic values, reward-model scores).

Both keep the backbone under `params["backbone"]` with the same structure, so a reward model can
start from an SFT checkpoint and a critic from a reward model.

Head initialisation (`ScalarHeadModel.head_init_std`):
- reward model: std 1/sqrt(D + 1) (`reward_head_init_std`), so initial scores have unit scale;
- critic / value head: `VALUE_HEAD_INIT_STD` (0): initial values are exactly zero, the critic
  starts from a neutral baseline and its first updates come from the returns alone.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models.config import ModelConfig
from marl_jax.models.decoder import Cache, Decoder, partitioned_param

VALUE_HEAD_INIT_STD = 0.0


def reward_head_init_std(config: ModelConfig) -> float:
    return 1.0 / math.sqrt(config.hidden_size + 1)


class CausalLM(nn.Module):
    """`apply({"params": p}, input_ids [B, T], attention_mask [B, T], positions=None)` ->
    logits `[B, T, V]` float32. Params `{"backbone", "lm_head"}` (`lm_head` absent when tied)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.backbone = Decoder(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = partitioned_param(self, "lm_head", nn.initializers.normal(cfg.initializer_range),
                                             (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.weight_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`[B, T, D] -> [B, T, V]` float32."""
        if self.config.tie_word_embeddings:
            logits = self.backbone.attend(hidden)
        else:
            logits = jnp.einsum("btd,dv->btv", hidden, self.lm_head.astype(hidden.dtype),
                                preferred_element_type=jnp.float32)
        if self.config.final_logit_softcap is not None:
            logits = jnp.tanh(logits / self.config.final_logit_softcap) * self.config.final_logit_softcap
        return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))

    def __call__(self, input_ids, attention_mask, positions=None):
        hidden, _ = self.backbone(input_ids, attention_mask, positions)
        return self.logits(hidden)

    def decode(self, input_ids, kv_mask, positions, cache: Cache, cache_index):
        """Incremental step: feeds `input_ids [B, T]` at cache slots `[cache_index, cache_index + T)`
        with `positions [B, T]`; `kv_mask [B, S]` marks valid cache slots. Returns (logits of the
        last fed token `[B, V]` float32, updated cache)."""
        hidden, cache = self.backbone(input_ids, kv_mask, positions, cache, cache_index)
        return self.logits(hidden[:, -1:])[:, 0], cache


class ScalarHeadModel(nn.Module):
    """`apply({"params": p}, input_ids [B, T], attention_mask [B, T], positions=None)` ->
    per-token scalars `[B, T]` float32. Params `{"backbone", "head": {"kernel": [D, 1]}}`."""

    config: ModelConfig
    head_init_std: float = VALUE_HEAD_INIT_STD

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions=None):
        cfg = self.config
        hidden, _ = Decoder(cfg, name="backbone")(input_ids, attention_mask, positions)
        return _ScalarHead(cfg, self.head_init_std, name="head")(hidden)


class _ScalarHead(nn.Module):
    """`[B, T, D] -> [B, T]` float32 through a bias-free `[D, 1]` kernel (as HF `score`)."""

    config: ModelConfig
    init_std: float

    @nn.compact
    def __call__(self, hidden):
        kernel = partitioned_param(self, "kernel", nn.initializers.normal(self.init_std),
                                   (self.config.hidden_size, 1), ("embed", None), self.config.weight_dtype)
        scores = jnp.einsum("btd,do->bto", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return scores[..., 0]


def last_token_score(scores: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Score at each row's last valid token: `scores [B, T]`, `attention_mask [B, T]` -> `[B]`.
    Works for left padding, right padding and both (prompt left-padded, response right-padded)."""
    length = attention_mask.shape[-1]
    last = length - 1 - jnp.argmax(jnp.flip(attention_mask.astype(bool), axis=-1), axis=-1)
    return jnp.take_along_axis(scores, last[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits(model: CausalLM, params, input_ids, attention_mask):
    return model.apply({"params": params}, input_ids, attention_mask)


def forward_logits(model: CausalLM, params, input_ids, attention_mask) -> jax.Array:
    """Logits `[B, T, V]` float32 of `input_ids [B, T]` under `attention_mask [B, T]` (any mix of
    left and right padding; positions from the mask). Jitted per model; jittable itself."""
    check_tokens(model.config, input_ids, attention_mask, "input_ids")
    return _forward_logits(model, params, input_ids, attention_mask)


def check_tokens(config: ModelConfig, input_ids, attention_mask, name: str) -> None:
    """Shape checks, and (for concrete arrays) token ids inside the vocabulary."""
    if input_ids.ndim != 2:
        raise ValueError(f"{name} must be [batch, length], got shape {tuple(input_ids.shape)}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from {name} shape "
                         f"{tuple(input_ids.shape)}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {input_ids.dtype}")
    if isinstance(input_ids, jax.core.Tracer):
        return
    ids = np.asarray(input_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
        bad = int(ids.max()) if ids.max() >= config.vocab_size else int(ids.min())
        raise ValueError(f"{name} holds token id {bad} outside the vocabulary [0, {config.vocab_size})")
