"""Autoregressive sampling with a KV cache: `generate` (temperature, top-k, top-p, EOS, pad).

One jitted program: a prefill over the left-padded prompt writes keys/values for slots
`[0, P)` of a preallocated cache `[B, K, P + N, H]` per layer, then a `lax.while_loop` feeds one
token per step at slot `P + i` (updated in place with `dynamic_update_slice`: the cache is created
inside the program and carried by the loop, so XLA aliases it across iterations instead of
copying) and stops as soon as every row has emitted an EOS token.
Only the last position's logits are computed per step; the training path of the model is
untouched. `generate` is callable inside an outer `jax.jit` and with sharded params.
"""
from __future__ import annotations

import functools
import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models.decoder import init_cache, positions_from_mask
from marl_jax.models.heads import CausalLM, check_tokens


class SampleOutput(NamedTuple):
    """tokens `[B, N]` int32 (pad after EOS), logprobs `[B, N]` float32 (of the distribution
    sampled from; 0 where masked), mask `[B, N]` int32 (1 up to and including EOS)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array


def _is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _eos_tuple(eos_id, vocab_size: int) -> tuple[int, ...]:
    ids = tuple(eos_id) if isinstance(eos_id, (tuple, list)) else (eos_id,)
    if not ids or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_id must be an int or a non-empty tuple of ints, got {eos_id!r}")
    bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"eos_id {bad} outside the vocabulary [0, {vocab_size})")
    return tuple(int(i) for i in ids)


def filtered_logits(logits: jax.Array, temperature, *, top_k: int, top_p, use_top_p: bool):
    """Temperature-scaled logits restricted to the top-k / top-p candidates.

    Returns (candidate logits `[B, C]` with -inf on filtered entries, candidate token ids `[B, C]`
    or None when C == V and candidates are the vocabulary in order). Top-p keeps the smallest
    prefix of tokens (by descending probability after top-k) whose mass reaches `top_p`: a token
    is kept when the mass strictly before it is below `top_p` (transformers' TopPLogitsWarper).
    """
    scaled = logits / temperature
    ids = None
    if top_k > 0:
        scaled, ids = jax.lax.top_k(scaled, top_k)
    elif use_top_p:
        ids = jnp.argsort(-scaled, axis=-1)
        scaled = jnp.take_along_axis(scaled, ids, axis=-1)
    if use_top_p:
        probs = jax.nn.softmax(scaled, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        scaled = jnp.where(mass_before < top_p, scaled, -jnp.inf)
    return scaled, ids


def _choose(logits, key, temperature, top_p, *, top_k, greedy, dynamic_temperature, use_top_p):
    """Next tokens `[B]` and their logprobs `[B]` from logits `[B, V]` float32."""
    if greedy:
        token = jnp.argmax(logits, axis=-1)
        return token, jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0) if dynamic_temperature else temperature
    candidates, ids = filtered_logits(logits, safe_temperature, top_k=top_k, top_p=top_p, use_top_p=use_top_p)
    choice = jax.random.categorical(key, candidates, axis=-1)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(candidates), choice[:, None], axis=-1)[:, 0]
    token = choice if ids is None else jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    if dynamic_temperature:
        greedy_token = jnp.argmax(logits, axis=-1)
        greedy_logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), greedy_token[:, None], axis=-1)[:, 0]
        token = jnp.where(temperature > 0, token, greedy_token)
        logprob = jnp.where(temperature > 0, logprob, greedy_logprob)
    return token, logprob


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k", "eos_ids", "pad_id", "greedy",
                                             "dynamic_temperature", "use_top_p"))
def _generate(model: CausalLM, params, prompt_ids, prompt_mask, key, temperature, top_p, *, max_new_tokens,
              top_k, eos_ids, pad_id, greedy, dynamic_temperature, use_top_p):
    batch, prompt_len = prompt_ids.shape
    steps = max_new_tokens
    choose = functools.partial(_choose, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               dynamic_temperature=dynamic_temperature, use_top_p=use_top_p)
    eos = jnp.asarray(eos_ids, jnp.int32)

    def decode(tokens, kv_mask, positions, cache, index):
        return model.apply({"params": params}, tokens, kv_mask, positions, cache, index, method=CausalLM.decode)

    prompt_mask = prompt_mask.astype(jnp.int32)
    kv_mask = jnp.concatenate([prompt_mask, jnp.ones((batch, steps), jnp.int32)], axis=1)
    lengths = prompt_mask.sum(axis=-1)
    cache = init_cache(model.config, batch, prompt_len + steps)
    logits, cache = decode(prompt_ids, kv_mask, positions_from_mask(prompt_mask), cache, 0)
    token, logprob = choose(logits, jax.random.fold_in(key, 0))
    token = token.astype(jnp.int32)
    tokens = jnp.full((batch, steps), pad_id, jnp.int32).at[:, 0].set(token)
    logprobs = jnp.zeros((batch, steps), jnp.float32).at[:, 0].set(logprob)
    mask = jnp.zeros((batch, steps), jnp.int32).at[:, 0].set(1)
    done = jnp.any(token[:, None] == eos, axis=-1)

    def cond(state):
        step, _, _, done, *_ = state
        return (step < steps) & ~jnp.all(done)

    def body(state):
        step, cache, previous, done, tokens, logprobs, mask = state
        # `previous` is token `step - 1`, at cache slot P + step - 1 and position L_b + step - 1.
        logits, cache = decode(previous[:, None], kv_mask, (lengths + step - 1)[:, None], cache,
                               prompt_len + step - 1)
        token, logprob = choose(logits, jax.random.fold_in(key, step))
        alive = ~done
        token = jnp.where(alive, token.astype(jnp.int32), pad_id)
        logprob = jnp.where(alive, logprob, 0.0)
        column = (0, step)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], column)
        logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], column)
        mask = jax.lax.dynamic_update_slice(mask, alive.astype(jnp.int32)[:, None], column)
        done = done | (alive & jnp.any(token[:, None] == eos, axis=-1))
        return step + 1, cache, token, done, tokens, logprobs, mask

    state = (jnp.asarray(1, jnp.int32), cache, token, done, tokens, logprobs, mask)
    _, _, _, _, tokens, logprobs, mask = jax.lax.while_loop(cond, body, state)
    return SampleOutput(tokens, logprobs, mask)


def generate(model: CausalLM, params, prompt_ids, prompt_mask, *, key, max_new_tokens: int, temperature,
             top_k: int = 0, top_p=1.0, eos_id: int | Sequence[int], pad_id: int) -> SampleOutput:
    """Samples `max_new_tokens` (N) tokens after left-padded prompts.

    prompt_ids, prompt_mask `[B, P]` (every row's last column valid). temperature 0 is greedy
    (logprobs: log-softmax of the raw logits); otherwise tokens are drawn from softmax(logits / T)
    restricted to the `top_k` most likely tokens (0: all) and then to the top-p nucleus, and the
    logprobs are those of that filtered distribution. Rows stop after an EOS token (any of
    `eos_id`, an int or tuple); the EOS keeps mask 1, later entries are `pad_id` with mask 0.
    temperature and top_p may be traced; model, max_new_tokens, top_k, eos_id and pad_id are static.
    """
    if not isinstance(model, CausalLM):
        raise ValueError(f"generate needs a CausalLM, got {type(model).__name__}")
    cfg = model.config
    prompt_ids = prompt_ids if isinstance(prompt_ids, jax.Array) else jnp.asarray(prompt_ids)
    prompt_mask = prompt_mask if isinstance(prompt_mask, jax.Array) else jnp.asarray(prompt_mask)
    check_tokens(cfg, prompt_ids, prompt_mask, "prompt_ids")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompt_len = prompt_ids.shape[1]
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    if not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be an int in [0, vocab_size={cfg.vocab_size}], got {top_k!r}")
    if _is_number(temperature) and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if _is_number(top_p) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    eos_ids = _eos_tuple(eos_id, cfg.vocab_size)
    if not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < cfg.vocab_size:
        raise ValueError(f"pad_id must be an int in [0, {cfg.vocab_size}), got {pad_id!r}")
    if not isinstance(prompt_mask, jax.core.Tracer):
        mask = np.asarray(prompt_mask)
        if not mask[:, -1].all():
            rows = np.flatnonzero(~mask[:, -1].astype(bool)).tolist()
            raise ValueError(f"prompt_mask must be left-padded (last column valid); rows {rows} are not")
    greedy = _is_number(temperature) and temperature == 0
    dynamic_temperature = not _is_number(temperature)
    use_top_p = not (_is_number(top_p) and top_p >= 1.0)
    return _generate(model, params, prompt_ids, prompt_mask, key,
                     jnp.asarray(1.0 if greedy else temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                     max_new_tokens=int(max_new_tokens), top_k=int(top_k), eos_ids=eos_ids, pad_id=int(pad_id),
                     greedy=greedy, dynamic_temperature=dynamic_temperature, use_top_p=use_top_p)
