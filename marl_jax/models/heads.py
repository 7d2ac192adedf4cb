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
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import attention
from marl_jax.models.config import ModelConfig
from marl_jax.models.decoder import Cache, Decoder, partitioned_param, precision_scope

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
            return vocab_logits(self.config, self.backbone.embed.embedding, hidden)
        return vocab_logits(self.config, self.lm_head, hidden)

    def hidden_states(self, input_ids, attention_mask, positions=None):
        """The backbone's final hidden states `[B, T, D]` (what `logits` projects), for callers
        that need the vocabulary only at some positions or in chunks (`token_scores`)."""
        hidden, _ = self.backbone(input_ids, attention_mask, positions)
        return hidden

    def __call__(self, input_ids, attention_mask, positions=None):
        return self.logits(self.hidden_states(input_ids, attention_mask, positions))

    def decode(self, input_ids, kv_mask, positions, cache: Cache, cache_index):
        """Incremental step: feeds `input_ids [B, T]` at cache slots `[cache_index, cache_index + T)`
        (cache_index a scalar or `[B]`) with `positions [B, T]`; `kv_mask [B, S]` marks valid
        cache slots. Returns (logits of the last fed token `[B, V]` float32, updated cache)."""
        hidden, cache = self.backbone(input_ids, kv_mask, positions, cache, cache_index)
        return self.logits(hidden[:, -1:])[:, 0], cache


def vocab_logits(config: ModelConfig, weight: jax.Array, hidden: jax.Array) -> jax.Array:
    """The LM head: hidden `[..., T, D]` -> logits `[..., T, V]` float32 (Gemma-2's final
    soft-cap included). `weight` is the tied embedding `[V, D]` or the untied head `[D, V]`."""
    spec = "...d,vd->...v" if config.tie_word_embeddings else "...d,dv->...v"
    with precision_scope(config):
        logits = jnp.einsum(spec, hidden, weight.astype(hidden.dtype),
                            preferred_element_type=jnp.float32)
    if config.final_logit_softcap is not None:
        logits = jnp.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length",
                                               "activation_vocab"))


def head_weight(config: ModelConfig, params) -> jax.Array:
    """The LM head's weight in a CausalLM's params: `[V, D]` when tied, else `[D, V]`."""
    if config.tie_word_embeddings:
        return params["backbone"]["embed"]["embedding"]
    return params["lm_head"]


# Logits of one chunk hold at most this many (positions x vocabulary) float32 values per
# sequence (32 MiB): 32 positions of Gemma's 256k vocabulary, the whole response of a small one.
LOGITS_CHUNK_ELEMENTS = 2 ** 23


class TokenScores(NamedTuple):
    """Per-position statistics of target tokens under a LM head, all `[B, T]` float32."""

    logprobs: jax.Array  # log p(target) under softmax(logits / temperature)
    entropy: jax.Array  # entropy of softmax(logits / temperature)
    base_logprobs: jax.Array  # log p(target) under softmax(logits) (temperature 1)
    correct: jax.Array  # 1.0 where argmax(logits) == target


def token_scores(config: ModelConfig, params, hidden, targets, temperature=1.0,
                 chunk: int | None = None) -> TokenScores:
    """Target-token statistics from hidden states without ever holding `[B, T, V]` logits.

    The LM head runs over chunks of `chunk` positions (default: `LOGITS_CHUNK_ELEMENTS / V`) in
    a scan whose body is rematerialised, so the forward pass keeps one chunk's logits and the
    backward pass recomputes them chunk by chunk: memory is `[B, chunk, V]` instead of
    `[B, T, V]` several times over. Differentiable with respect to `params` and `hidden`.

    Args:
      config: the CausalLM's ModelConfig; params: its params (for the head weight).
      hidden: `[B, T, D]` hidden states; position t predicts `targets[:, t]`.
      targets: `[B, T]` int token ids (any id on positions the caller masks out).
      temperature: divides the logits for `logprobs` and `entropy` (traced or static).
    """
    weight = head_weight(config, params)
    batch, length, _ = hidden.shape
    vocab = config.vocab_size
    if chunk is None:
        chunk = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    chunk = min(chunk, length)
    num_chunks = -(-length // chunk)
    chunk = -(-length // num_chunks)  # equal chunks, the least padding
    pad = num_chunks * chunk - length
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    scale = 1.0 / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)

    @jax.checkpoint
    def one_chunk(h, t):
        logits = vocab_logits(config, weight, h)  # [B, chunk, V]
        base = jax.nn.log_softmax(logits, axis=-1)
        scaled = jax.nn.log_softmax(logits * scale, axis=-1)
        pick = lambda logp: jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
        probs = jnp.exp(scaled)
        entropy = -jnp.sum(probs * jnp.where(probs > 0, scaled, 0.0), axis=-1)
        correct = (jnp.argmax(logits, axis=-1) == t).astype(jnp.float32)
        return TokenScores(pick(scaled), entropy, pick(base), correct)

    chunks = lambda x: x.reshape((batch, num_chunks, chunk) + x.shape[2:]).swapaxes(0, 1)
    out = jax.lax.map(lambda ht: one_chunk(*ht), (chunks(hidden), chunks(targets)))
    return TokenScores(*(x.swapaxes(0, 1).reshape(batch, -1)[:, :length] for x in out))


def trunk_states(config: ModelConfig, params, input_ids, attention_mask, num_layers: int):
    """`Decoder.trunk` of a causal LM's or scalar-head model's `params`: the hidden states after
    the embeddings and the first `num_layers` layers `[B, T, D]`."""
    return Decoder(config).apply({"params": params["backbone"]}, input_ids, attention_mask,
                                 num_layers, method=Decoder.trunk)


def backbone_hidden(config: ModelConfig, params, input_ids, attention_mask, trunk=None,
                    rngs=None):
    """The backbone's final hidden states `[B, T, D]` of a causal LM's or scalar-head model's
    `params`. With `trunk` = (hidden states after the first k layers `[B, T, D]`, k), as
    `trunk_states` gives for any model with the same embeddings and first k layers, only layers
    k.. run. `rngs`: the training forward's (`{"dropout": key}`), or None."""
    backbone = {"params": params["backbone"]}
    if trunk is None:
        return Decoder(config).apply(backbone, input_ids, attention_mask, rngs=rngs)[0]
    states, start = trunk
    return Decoder(config).apply(backbone, states, attention_mask, start, method=Decoder.top,
                                 rngs=rngs)


def scalar_outputs(config: ModelConfig, params, hidden) -> jax.Array:
    """A `ScalarHeadModel`'s head on its backbone's final hidden states: `[B, T]` float32."""
    head = _ScalarHead(config, 0.0, use_bias="bias" in params["head"])
    return head.apply({"params": params["head"]}, hidden)


def continuation_scores(policy: "CausalLM", params, prompt_ids, prompt_mask, response_ids,
                        response_mask, temperature=1.0, trunk=None, rngs=None) -> TokenScores:
    """`TokenScores` `[B, R]` of the response tokens given the prompt, zero on padding.

    The decoder runs over prompt + response (from `trunk`, see `backbone_hidden`, when given);
    the LM head only over the positions that predict a response token, in chunks
    (`token_scores`), so no `[B, P + R, V]` logits are ever built. Prompts `[B, P]` are
    left-padded, responses `[B, R]` left-aligned. `rngs`: a training forward's
    (`{"dropout": key}`: the adapters' dropout), or None.
    """
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1)
    if trunk is None:
        hidden = policy.apply({"params": params}, ids, mask, method=CausalLM.hidden_states,
                              rngs=rngs)
    else:
        hidden = backbone_hidden(policy.config, params, ids, mask, trunk, rngs)
    p = prompt_ids.shape[1]
    out = token_scores(policy.config, params, hidden[:, p - 1:-1], response_ids, temperature)
    m = response_mask.astype(jnp.float32)
    return TokenScores(*(x * m for x in out))


class ScalarHeadModel(nn.Module):
    """`apply({"params": p}, input_ids [B, T], attention_mask [B, T], positions=None)` ->
    per-token scalars `[B, T]` float32. Params `{"backbone", "head": {"kernel": [D, 1]}}`, plus
    `head.bias` `[1]` with `head_bias` (the critic: a reward model's head rescaled to normalised
    scores needs an offset; the reward model itself stays bias-free, as HF `score`)."""

    config: ModelConfig
    head_init_std: float = VALUE_HEAD_INIT_STD
    head_bias: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions=None):
        cfg = self.config
        hidden, _ = Decoder(cfg, name="backbone")(input_ids, attention_mask, positions)
        return _ScalarHead(cfg, self.head_init_std, self.head_bias, name="head")(hidden)


class _ScalarHead(nn.Module):
    """`[B, T, D] -> [B, T]` float32 through a `[D, 1]` kernel (and an optional bias)."""

    config: ModelConfig
    init_std: float
    use_bias: bool = False

    @nn.compact
    def __call__(self, hidden):
        # With LoRA the head trains beside the adapters, in float32 like them.
        dtype = jnp.float32 if self.config.lora_rank else self.config.weight_dtype
        kernel = partitioned_param(self, "kernel", nn.initializers.normal(self.init_std),
                                   (self.config.hidden_size, 1), ("embed", None), dtype)
        with precision_scope(self.config):
            scores = jnp.einsum("btd,do->bto", hidden, kernel.astype(hidden.dtype),
                                preferred_element_type=jnp.float32)
        if self.use_bias:
            bias = partitioned_param(self, "bias", nn.initializers.zeros, (1,), (None,), dtype)
            scores = scores + bias.astype(jnp.float32)
        return scores[..., 0]


def last_token_score(scores: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Score at each row's last valid token: `scores [B, T]`, `attention_mask [B, T]` -> `[B]`.
    Works for left padding, right padding and both (prompt left-padded, response right-padded)."""
    length = attention_mask.shape[-1]
    last = length - 1 - jnp.argmax(jnp.flip(attention_mask.astype(bool), axis=-1), axis=-1)
    return jnp.take_along_axis(scores, last[:, None], axis=-1)[:, 0]


@functools.partial(attention.jit_per_platform, static_argnums=0)
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
