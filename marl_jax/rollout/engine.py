"""Autoregressive sampling with a KV cache: `generate` (temperature, top-k, top-p, EOS, pad; several
samples per prompt; per-row keys) and `continue_responses` (resampling after a response prefix).

One jitted program: a prefill over the left-padded prompt writes keys/values for slots
`[0, P)` of a preallocated cache `[B, K, P + N, H]` per layer, then a `lax.while_loop` feeds one
token per step at slot `P + i` (updated in place with `dynamic_update_slice`: the cache is created
inside the program and carried by the loop, so XLA aliases it across iterations instead of
copying) and stops as soon as every row has emitted an EOS token.
Only the last position's logits are computed per step; the training path of the model is
untouched. `generate` is callable inside an outer `jax.jit` and with sharded params.

Groups: with `num_samples = k` each prompt is prefilled once and its cache and last logits are
repeated k times along the batch axis (row `b * k + j` is sample j of prompt b), so the prefill
costs B rows instead of B * k.

Keys: by default step t draws one categorical over the whole batch with `fold_in(key, t)` (a row's
sample then depends on the batch it is in). With `row_keys` `[B * k]` the token at response
position t of row i is drawn with `fold_in(row_keys[i], t)` alone, so a row's sample depends only
on its key, its context and t; `continue_responses` relies on this to reproduce a response from
any prefix of it.

Building blocks the multi-turn engine (`rollout/turns.py`) decodes with, public so that it
reuses them rather than copies them: `sampling_model`, `decode_fn`, `choose_tokens`, `draw_row`,
`sampler_flags`, `sampler_scalars`, and the argument checks `check_model`, `check_left_padded`,
`check_row_keys`, `is_int`, `as_array`.
"""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from marl_jax.rollout import draws, slots as slot_engine
from marl_jax.rollout import top_k as top_k_lib
from marl_jax.models.decoder import init_cache, positions_from_mask
from marl_jax.models import attention, decode_layout
from marl_jax.models.heads import CausalLM, check_tokens


class SampleOutput(NamedTuple):
    """tokens `[B, N]` int32 (pad after EOS), logprobs `[B, N]` float32 (of the distribution
    sampled from; 0 where masked), mask `[B, N]` int32 (1 up to and including EOS), entropy
    `[B, N]` float32 (of the distribution sampled from: temperature-scaled and top-k / top-p
    filtered; greedy: of the softmax of the raw logits; 0 where masked)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    entropy: jax.Array


def _is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


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
        scaled, ids = top_k_lib.top_k(scaled, top_k)
    elif use_top_p:
        ids = jnp.argsort(-scaled, axis=-1)
        scaled = jnp.take_along_axis(scaled, ids, axis=-1)
    if use_top_p:
        probs = jax.nn.softmax(scaled, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        scaled = jnp.where(mass_before < top_p, scaled, -jnp.inf)
    return scaled, ids


def _entropy(log_probs: jax.Array) -> jax.Array:
    """Entropy `[B]` of log-probabilities `[B, C]` (-inf entries: probability 0)."""
    return -jnp.sum(jnp.where(log_probs > -jnp.inf, jnp.exp(log_probs) * log_probs, 0.0), axis=-1)


def _greedy(logits):
    """argmax tokens `[B]`, their log-softmax `[B]` and the entropy `[B]` of softmax(logits)."""
    token = jnp.argmax(logits, axis=-1)
    log_probs = jax.nn.log_softmax(logits)
    return token, jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0], _entropy(log_probs)


def choose_tokens(logits, draw: Callable, temperature, top_p, *, top_k, greedy, dynamic_temperature, use_top_p):
    """Next tokens `[B]`, their logprobs `[B]` and the entropy `[B]` of the distribution they are
    drawn from, given logits `[B, V]` float32; `draw(candidates [B, C]) -> [B]` picks a candidate
    index per row."""
    if greedy:
        return _greedy(logits)
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0) if dynamic_temperature else temperature
    candidates, ids = filtered_logits(logits, safe_temperature, top_k=top_k, top_p=top_p, use_top_p=use_top_p)
    choice = draw(candidates)
    log_probs = jax.nn.log_softmax(candidates)
    logprob = jnp.take_along_axis(log_probs, choice[:, None], axis=-1)[:, 0]
    entropy = _entropy(log_probs)
    token = choice if ids is None else jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    if dynamic_temperature:
        greedy_token, greedy_logprob, greedy_entropy = _greedy(logits)
        token = jnp.where(temperature > 0, token, greedy_token)
        logprob = jnp.where(temperature > 0, logprob, greedy_logprob)
        entropy = jnp.where(temperature > 0, entropy, greedy_entropy)
    return token, logprob, entropy


def _draws(key, row_keys, offsets):
    """`draw_at(step)`: the candidate picker of decode step `step`. With `key`, one categorical over
    the batch keyed `fold_in(key, step)`, or with `offsets` `[B]` (response position of step 0,
    per row) row i of the one keyed `fold_in(key, offsets[i] + step)`; with `row_keys` `[B]`, row
    i's categorical keyed `fold_in(row_keys[i], offsets[i] + step)`."""
    if row_keys is None and offsets is None:
        def batch_draw(step):
            step_key = jax.random.fold_in(key, step)
            return lambda candidates: jax.random.categorical(step_key, candidates, axis=-1)

        return batch_draw
    if row_keys is None:
        rows = jnp.arange(offsets.shape[0], dtype=jnp.int32)
        at_positions = _slot_draws(key, None)
        return lambda step: lambda candidates: at_positions(candidates, rows, offsets + step)

    def row_draw(step):
        return lambda candidates: jax.vmap(draw_row)(row_keys, offsets + step, candidates)

    return row_draw


def draw_row(row_key, position, candidates):
    """One row's pick among candidates `[C]` at response position `position`, keyed by its own key."""
    return jax.random.categorical(jax.random.fold_in(row_key, position), candidates)


def _slot_draws(key, row_keys):
    """The draws of `_draws` for rows at different steps: `draw(candidates [S, C], rows [S],
    positions [S]) -> [S]`, row `rows[s]` at response position `positions[s]`."""
    if row_keys is None:
        def batch_rows(candidates, rows, positions):
            step_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, positions)
            return draws.categorical_rows(step_keys, candidates, rows)

        return batch_rows
    return lambda candidates, rows, positions: jax.vmap(draw_row)(jnp.take(row_keys, rows), positions, candidates)


def _repeat_rows(model: CausalLM, k: int, logits, cache, *rows):
    """Repeats the prefill's logits `[B, V]`, cache and per-row arrays `[B, ...]` k times along the
    batch axis (row b -> rows `[b * k, (b + 1) * k)`)."""
    if k == 1:
        return (logits, cache, *rows)
    batch_axis = 1 if model.config.scan_layers else 0  # scanned caches are [L, B, K, S, H]
    cache = jax.tree.map(lambda x: jnp.repeat(x, k, axis=batch_axis), cache)
    return (jnp.repeat(logits, k, axis=0), cache, *(jnp.repeat(x, k, axis=0) for x in rows))


# The decode loop reads the KV cache in blocks of this many new-token columns: the steps of block
# j attend to the prompt and the first (j + 1) x DECODE_BLOCK columns only, not the whole budget
# (one `while_loop` per block, each with its own static width).
DECODE_BLOCK = 128


def read_widths(start_slot: int, steps: int, block: int = DECODE_BLOCK) -> list[tuple[int, int]]:
    """[(last step + 1, key-mask width)] of the decode loop's blocks: steps `[1, steps)` feed the
    token of step s - 1 at slot start_slot + s - 1, which attends to slots `[0, start_slot + s)`."""
    ends = list(range(block, steps, block)) + [steps]
    return [(end, min(start_slot + end, start_slot + steps)) for end in ends]


def _sample_loop(decode, choose, draw_at, logits, cache, kv_mask, lengths, start_slot, *, steps, eos_ids, pad_id,
                 done=None, remaining=None, block: int = DECODE_BLOCK) -> SampleOutput:
    """Samples up to `steps` tokens per row after a prefill.

    logits `[B, V]`: the prefill's last logits; cache: slots `[0, start_slot)` filled; kv_mask
    `[B, start_slot + steps]`; lengths `[B]`: valid tokens per row before the first new one (its
    position). done `[B]` bool (optional): rows that sample nothing; remaining `[B]` int32
    (optional): at most this many tokens per row. Returns `[B, steps]` arrays; the loop stops when
    every row is done. `block`: new-token columns per decode block (`read_widths`).
    """
    batch = logits.shape[0]
    eos = jnp.asarray(eos_ids, jnp.int32)
    token, logprob, entropy = choose(logits, draw_at(0))
    token = token.astype(jnp.int32)
    first_mask = jnp.ones((batch,), jnp.int32)
    if done is not None:
        alive = ~done
        token = jnp.where(alive, token, pad_id)
        logprob, entropy = jnp.where(alive, logprob, 0.0), jnp.where(alive, entropy, 0.0)
        first_mask = alive.astype(jnp.int32)
    tokens = jnp.full((batch, steps), pad_id, jnp.int32).at[:, 0].set(token)
    logprobs = jnp.zeros((batch, steps), jnp.float32).at[:, 0].set(logprob)
    entropies = jnp.zeros((batch, steps), jnp.float32).at[:, 0].set(entropy)
    mask = jnp.zeros((batch, steps), jnp.int32).at[:, 0].set(first_mask)
    hit = jnp.any(token[:, None] == eos, axis=-1)
    done = hit if done is None else done | hit
    if remaining is not None:
        done = done | (remaining <= 1)

    def body_reading(width):
        def body(state):
            step, cache, previous, done, tokens, logprobs, entropies, mask = state
            # `previous` is token `step - 1`, at cache slot start_slot + step - 1 and position
            # lengths + step - 1.
            logits, cache = decode(previous[:, None], kv_mask[:, :width], (lengths + step - 1)[:, None], cache,
                                   start_slot + step - 1)
            token, logprob, entropy = choose(logits, draw_at(step))
            alive = ~done
            token = jnp.where(alive, token.astype(jnp.int32), pad_id)
            logprob = jnp.where(alive, logprob, 0.0)
            entropy = jnp.where(alive, entropy, 0.0)
            column = (0, step)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], column)
            logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], column)
            entropies = jax.lax.dynamic_update_slice(entropies, entropy[:, None], column)
            mask = jax.lax.dynamic_update_slice(mask, alive.astype(jnp.int32)[:, None], column)
            done = done | (alive & jnp.any(token[:, None] == eos, axis=-1))
            if remaining is not None:
                done = done | (step + 1 >= remaining)
            return step + 1, cache, token, done, tokens, logprobs, entropies, mask

        return body

    state = (jnp.asarray(1, jnp.int32), cache, token, done, tokens, logprobs, entropies, mask)
    for end, width in read_widths(start_slot, steps, block):
        state = jax.lax.while_loop(lambda s, end=end: (s[0] < end) & ~jnp.all(s[3]), body_reading(width), state)
    _, _, _, _, tokens, logprobs, entropies, mask = state
    return SampleOutput(tokens, logprobs, mask, entropies)


def sampling_model(model: CausalLM, params) -> tuple[CausalLM, dict]:
    """The model and params the sampler decodes with: the weights cast once to the compute dtype
    and laid out as `decode_layout.resolve` says (built once per call)."""
    config, params = decode_layout.for_decoding(model.config, params)
    return (model if config is model.config else CausalLM(config)), params


def decode_fn(model: CausalLM, params):
    def decode(tokens, kv_mask, positions, cache, index):
        return model.apply({"params": params}, tokens, kv_mask, positions, cache, index, method=CausalLM.decode)

    return decode


_STATIC = ("model", "top_k", "eos_ids", "pad_id", "greedy", "dynamic_temperature", "use_top_p", "num_samples",
           "decode_slots", "decode_block")


def _prefill(model: CausalLM, decode, ids, mask, steps: int):
    """Prefill of left-padded `ids, mask [B, W]` into a fresh cache of W + steps slots: (last
    logits `[B, V]`, cache, key mask `[B, W + steps]`, valid tokens per row `[B]`)."""
    batch, width = ids.shape
    mask = mask.astype(jnp.int32)
    kv_mask = jnp.concatenate([mask, jnp.ones((batch, steps), jnp.int32)], axis=1)
    cache = init_cache(model.config, batch, width + steps)
    logits, cache = decode(ids, kv_mask, positions_from_mask(mask), cache, 0)
    return logits, cache, kv_mask, mask.sum(axis=-1)


def _over_slots(model: CausalLM, decode, choose, draw, ids, mask, *, slots, samples, steps, eos_ids, pad_id,
                unit_order=None, live_units=None, offsets=None, remaining=None):
    """Continuous batching of `samples` rows per context `ids, mask [U, W]` over `slots` decode
    slots (marl_jax.rollout.slots); `[U * samples, steps]` outputs as `_sample_loop` gives them."""
    units, width = ids.shape
    rows = units * samples
    out = slot_engine.sample(
        lambda picks: _prefill(model, decode, jnp.take(ids, picks, axis=0), jnp.take(mask, picks, axis=0), steps),
        decode, choose, draw, units=units, samples=samples, slots=slots, steps=steps, context_width=width,
        eos_ids=eos_ids, pad_id=pad_id,
        unit_order=jnp.arange(units, dtype=jnp.int32) if unit_order is None else unit_order,
        live_units=units if live_units is None else live_units,
        offsets=jnp.zeros((rows,), jnp.int32) if offsets is None else offsets,
        remaining=jnp.full((rows,), steps, jnp.int32) if remaining is None else remaining,
        batch_axis=1 if model.config.scan_layers else 0, logits_width=model.config.vocab_size)
    return SampleOutput(*out)


@functools.partial(attention.jit_per_platform, static_argnames=("max_new_tokens", *_STATIC))
def _generate(model: CausalLM, params, prompt_ids, prompt_mask, key, row_keys, temperature, top_p, max_lengths, *,
              max_new_tokens, num_samples, top_k, eos_ids, pad_id, greedy, dynamic_temperature, use_top_p,
              decode_slots, decode_block):
    batch, prompt_len = prompt_ids.shape
    steps = max_new_tokens
    choose = functools.partial(choose_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               dynamic_temperature=dynamic_temperature, use_top_p=use_top_p)
    model, params = sampling_model(model, params)
    decode = decode_fn(model, params)
    if decode_slots:
        return _over_slots(model, decode, choose, _slot_draws(key, row_keys), prompt_ids, prompt_mask,
                           slots=decode_slots, samples=num_samples, steps=steps, eos_ids=eos_ids, pad_id=pad_id,
                           remaining=max_lengths)
    logits, cache, kv_mask, lengths = _prefill(model, decode, prompt_ids, prompt_mask, steps)
    logits, cache, kv_mask, lengths = _repeat_rows(model, num_samples, logits, cache, kv_mask, lengths)
    offsets = None if row_keys is None else jnp.zeros((batch * num_samples,), jnp.int32)
    return _sample_loop(decode, choose, _draws(key, row_keys, offsets), logits, cache, kv_mask, lengths, prompt_len,
                        steps=steps, eos_ids=eos_ids, pad_id=pad_id, remaining=max_lengths, block=decode_block)


def sampler_flags(cfg, temperature, top_k, top_p, eos_id, pad_id) -> dict:
    """Validates the sampling settings; returns the static flags of the jitted programs."""
    if not is_int(top_k) or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be an int in [0, vocab_size={cfg.vocab_size}], got {top_k!r}")
    if _is_number(temperature) and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if _is_number(top_p) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    eos_ids = _eos_tuple(eos_id, cfg.vocab_size)
    if not is_int(pad_id) or not 0 <= pad_id < cfg.vocab_size:
        raise ValueError(f"pad_id must be an int in [0, {cfg.vocab_size}), got {pad_id!r}")
    return dict(top_k=int(top_k), eos_ids=eos_ids, pad_id=int(pad_id),
                greedy=_is_number(temperature) and temperature == 0,
                dynamic_temperature=not _is_number(temperature),
                use_top_p=not (_is_number(top_p) and top_p >= 1.0))


def as_array(x) -> jax.Array:
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def check_model(model, name: str) -> None:
    if not isinstance(model, CausalLM):
        raise ValueError(f"{name} needs a CausalLM, got {type(model).__name__}")


def check_left_padded(prompt_mask) -> None:
    if isinstance(prompt_mask, jax.core.Tracer):
        return
    mask = np.asarray(prompt_mask)
    if not mask[:, -1].all():
        rows = np.flatnonzero(~mask[:, -1].astype(bool)).tolist()
        raise ValueError(f"prompt_mask must be left-padded (last column valid); rows {rows} are not")


def _check_num_samples(num_samples) -> int:
    if not is_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    return int(num_samples)


def check_row_keys(row_keys, rows: int) -> None:
    if not isinstance(row_keys, jax.Array) or not jnp.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
        raise ValueError("row_keys must be a typed key array (e.g. jax.random.split(jax.random.key(0), n)), "
                         f"got {type(row_keys).__name__} of dtype {getattr(row_keys, 'dtype', None)}")
    if tuple(row_keys.shape) != (rows,):
        raise ValueError(f"row_keys must have shape ({rows},) = [batch * num_samples], got {tuple(row_keys.shape)}")


def _data_shards() -> int:
    """Shards of the batch axis under the current mesh and logical rules (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    axes = dict(nn.get_logical_axis_rules()).get("activation_batch")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def _check_decode_slots(decode_slots, rows: int, key, candidates: int) -> int:
    """The number of decode slots to use (0: the static batch) after validating `decode_slots`."""
    if decode_slots is None or (is_int(decode_slots) and decode_slots == 0):
        return 0
    if not is_int(decode_slots) or decode_slots < 0:
        raise ValueError(f"decode_slots must be None or a non-negative int, got {decode_slots!r}")
    if decode_slots >= rows:
        warnings.warn(f"decode_slots={decode_slots} is not below the {rows} rows to sample: they are sampled as one "
                      "static batch", stacklevel=3)
        return 0
    shards = _data_shards()
    if decode_slots % shards:
        raise ValueError(f"decode_slots={decode_slots} is not divisible by the {shards} data-parallel shards of the "
                         "mesh")
    if key is not None:
        draws.check_supported(key, rows, candidates)
    return int(decode_slots)


def _check_max_lengths(max_lengths, rows: int, budget: int):
    max_lengths = as_array(max_lengths)
    if tuple(max_lengths.shape) != (rows,) or not jnp.issubdtype(max_lengths.dtype, jnp.integer):
        raise ValueError(f"max_lengths must be an int array of shape ({rows},) = [batch * num_samples], got "
                         f"shape {tuple(max_lengths.shape)} and dtype {max_lengths.dtype}")
    if not isinstance(max_lengths, jax.core.Tracer):
        values = np.asarray(max_lengths)
        bad = np.flatnonzero((values < 1) | (values > budget)).tolist()
        if bad:
            raise ValueError(f"max_lengths must be in [1, max_new_tokens={budget}]; rows {bad[:8]} are not")
    return max_lengths.astype(jnp.int32)


def sampler_scalars(flags: dict, temperature, top_p):
    return jnp.asarray(1.0 if flags["greedy"] else temperature, jnp.float32), jnp.asarray(top_p, jnp.float32)


def generate(model: CausalLM, params, prompt_ids, prompt_mask, *, key=None, row_keys=None, max_new_tokens: int,
             temperature, top_k: int = 0, top_p=1.0, eos_id: int | Sequence[int], pad_id: int,
             num_samples: int = 1, decode_slots: int | None = None, max_lengths=None,
             decode_block: int = DECODE_BLOCK) -> SampleOutput:
    """Samples `max_new_tokens` (N) tokens after left-padded prompts, `num_samples` (k) per prompt.

    prompt_ids, prompt_mask `[B, P]` (every row's last column valid). Returns `[B * k, N]` arrays;
    row `b * k + j` is sample j of prompt b. Each prompt is prefilled once and its cache shared by
    its k samples, which draw exactly what `generate` draws for `jnp.repeat(prompt_ids, k, axis=0)`.
    temperature 0 is greedy (logprobs: log-softmax of the raw logits); otherwise tokens are drawn
    from softmax(logits / T) restricted to the `top_k` most likely tokens (0: all) and then to the
    top-p nucleus, and the logprobs are those of that filtered distribution. Rows stop after an
    EOS token (any of `eos_id`, an int or tuple); the EOS keeps mask 1, later entries are `pad_id`
    with mask 0.

    Exactly one of `key` (step t draws one categorical over the batch with `fold_in(key, t)`) and
    `row_keys` (typed keys `[B * k]`: row i's token t is drawn with `fold_in(row_keys[i], t)`,
    independently of the other rows). temperature and top_p may be traced; model, max_new_tokens,
    top_k, eos_id, pad_id, num_samples and decode_slots are static.

    `decode_slots` S (None or 0: one static batch): continuous batching (marl_jax.rollout.slots):
    S rows decode at once and a finished row's slot takes the next waiting one, so a batch of
    uneven responses costs about sum(lengths) / S decode steps instead of max(length) and its
    KV cache holds S (plus a prefill stage) rows instead of B * k. The draws of a row depend on its
    key and response position only, so the outputs equal the static call's (up to floating-point
    ties). S at or above B * k samples the static batch (with a warning); on a mesh S must
    split over the data-parallel shards.

    `max_lengths` `[B * k]` int (optional): row i samples at most `max_lengths[i]` tokens
    (in [1, N]), as if its budget ended there: prescribed lengths for benchmarks.

    `decode_block` (static): the static decode loop reads the KV cache in blocks of this many
    new-token columns, the steps of block j attending to the prompt and the first (j + 1) x
    `decode_block` columns only (one `while_loop` per block); the tokens do not depend on it.

    With bfloat16 compute and float32 parameters, the weights are cast to bfloat16 once per call
    (`models.compute_weights`), not at every decode step; the numbers are the same. The decode
    step runs the layout `model.config.sampler_layout` names (`models.decode_layout`: on a GPU by
    default unrolled layers with fused q / k / v and gate / up projections), built once per call.
    """
    check_model(model, "generate")
    cfg = model.config
    prompt_ids, prompt_mask = as_array(prompt_ids), as_array(prompt_mask)
    check_tokens(cfg, prompt_ids, prompt_mask, "prompt_ids")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompt_len = prompt_ids.shape[1]
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    flags = sampler_flags(cfg, temperature, top_k, top_p, eos_id, pad_id)
    check_left_padded(prompt_mask)
    num_samples = _check_num_samples(num_samples)
    if (key is None) == (row_keys is None):
        raise ValueError("generate needs exactly one of key (batch-level draws) and row_keys (per-row draws), got "
                         + ("both" if key is not None else "neither"))
    rows = prompt_ids.shape[0] * num_samples
    if row_keys is not None:
        check_row_keys(row_keys, rows)
    decode_slots = _check_decode_slots(decode_slots, rows, key, flags["top_k"] or cfg.vocab_size)
    if max_lengths is not None:
        max_lengths = _check_max_lengths(max_lengths, rows, int(max_new_tokens))
    if not is_int(decode_block) or decode_block < 1:
        raise ValueError(f"decode_block must be a positive int, got {decode_block!r}")
    return _generate(model, params, prompt_ids, prompt_mask, key, row_keys,
                     *sampler_scalars(flags, temperature, top_p), max_lengths, max_new_tokens=int(max_new_tokens),
                     num_samples=num_samples, decode_slots=decode_slots, decode_block=int(decode_block), **flags)


# Continuation from a response prefix --------------------------------------------------------------------

def _context(prompt_ids, prompt_mask, response_ids, prefix_lengths):
    """Prompt + the first `prefix_lengths [B]` response tokens, left-padded again so that every
    row's last column is valid: ids, mask `[B, P + R]` int32."""
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1).astype(jnp.int32)
    response_len = response_ids.shape[1]
    prefix_mask = jnp.arange(response_len)[None, :] < prefix_lengths[:, None]
    mask = jnp.concatenate([prompt_mask.astype(jnp.int32), prefix_mask.astype(jnp.int32)], axis=1)
    # Row b's valid tokens end at column P + t_b - 1: shift it right by R - t_b.
    source = jnp.arange(ids.shape[1])[None, :] - (response_len - prefix_lengths)[:, None]
    inside = source >= 0
    source = jnp.maximum(source, 0)
    ids = jnp.take_along_axis(ids, source, axis=1)
    mask = jnp.where(inside, jnp.take_along_axis(mask, source, axis=1), 0)
    return ids, mask


def _after_prefix(response_ids, prefix_lengths, new: SampleOutput, pad_id: int) -> SampleOutput:
    """Full responses `[B, R]`: `response_ids [B, R]` on `[0, t_b)` (mask 1, logprobs and entropy 0),
    then the new tokens `[B, N]` from position t_b on, cut at R."""
    response_len, steps = response_ids.shape[1], new.tokens.shape[1]
    offset = jnp.arange(response_len)[None, :] - prefix_lengths[:, None]
    in_prefix, in_new = offset < 0, (offset >= 0) & (offset < steps)
    source = jnp.clip(offset, 0, steps - 1)

    def place(new_values, fill):
        return jnp.where(in_new, jnp.take_along_axis(new_values, source, axis=1), fill)

    return SampleOutput(tokens=jnp.where(in_prefix, response_ids.astype(jnp.int32), place(new.tokens, pad_id)),
                        logprobs=place(new.logprobs, 0.0),
                        mask=jnp.where(in_prefix, 1, place(new.mask, 0)).astype(jnp.int32),
                        entropy=place(new.entropy, 0.0))


@functools.partial(attention.jit_per_platform, static_argnames=("steps", *_STATIC))
def _continue(model: CausalLM, params, prompt_ids, prompt_mask, response_ids, prefix_lengths, key, row_keys,
              temperature, top_p, *, steps, num_samples, top_k, eos_ids, pad_id, greedy, dynamic_temperature, use_top_p,
              decode_slots, decode_block=DECODE_BLOCK):
    response_len = response_ids.shape[1]
    width = prompt_ids.shape[1] + response_len
    choose = functools.partial(choose_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               dynamic_temperature=dynamic_temperature, use_top_p=use_top_p)
    model, params = sampling_model(model, params)
    decode = decode_fn(model, params)
    prefix_lengths = prefix_lengths.astype(jnp.int32)
    ids, mask = _context(prompt_ids, prompt_mask, response_ids, prefix_lengths)
    last = jnp.take_along_axis(response_ids, jnp.maximum(prefix_lengths - 1, 0)[:, None], axis=1)[:, 0]
    ended = (prefix_lengths > 0) & jnp.any(last[:, None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)
    done = ended | (prefix_lengths >= response_len)
    remaining = jnp.minimum(response_len - prefix_lengths, steps)
    if decode_slots:
        rows = functools.partial(jnp.repeat, repeats=num_samples, axis=0)
        new = _over_slots(model, decode, choose, _slot_draws(key, row_keys), ids, mask, slots=decode_slots,
                          samples=num_samples, steps=steps, eos_ids=eos_ids, pad_id=pad_id,
                          unit_order=jnp.argsort(done, stable=True).astype(jnp.int32), live_units=(~done).sum(),
                          offsets=rows(prefix_lengths), remaining=rows(remaining))
        return _after_prefix(rows(response_ids), rows(prefix_lengths), new, pad_id)
    logits, cache, kv_mask, lengths = _prefill(model, decode, ids, mask, steps)
    logits, cache, kv_mask, lengths, done, remaining, prefix_lengths, response_ids = _repeat_rows(
        model, num_samples, logits, cache, kv_mask, lengths, done, remaining, prefix_lengths, response_ids)
    new = _sample_loop(decode, choose, _draws(key, row_keys, prefix_lengths), logits, cache, kv_mask, lengths, width,
                       steps=steps, eos_ids=eos_ids, pad_id=pad_id, done=done, remaining=remaining,
                       block=decode_block)
    return _after_prefix(response_ids, prefix_lengths, new, pad_id)


def _leading_ones(mask: np.ndarray) -> np.ndarray:
    """Per row, the number of leading 1 entries of a `[B, R]` mask."""
    return np.cumprod(mask.astype(bool), axis=1).sum(axis=1)


def _check_prefix_lengths(prefix_lengths, response_mask, batch: int) -> None:
    if tuple(prefix_lengths.shape) != (batch,) or not jnp.issubdtype(prefix_lengths.dtype, jnp.integer):
        raise ValueError(f"prefix_lengths must be an int array of shape ({batch},), got shape "
                         f"{tuple(prefix_lengths.shape)} and dtype {prefix_lengths.dtype}")
    if isinstance(prefix_lengths, jax.core.Tracer) or isinstance(response_mask, jax.core.Tracer):
        return
    lengths, valid = np.asarray(prefix_lengths), _leading_ones(np.asarray(response_mask))
    bad = np.flatnonzero((lengths < 0) | (lengths > valid)).tolist()
    if bad:
        raise ValueError(f"prefix_lengths must be in [0, valid length of the response row]; rows {bad} are not "
                         f"(prefix_lengths {lengths[bad].tolist()}, valid lengths {valid[bad].tolist()})")


def continue_responses(model: CausalLM, params, prompt_ids, prompt_mask, response_ids, response_mask, prefix_lengths,
                       *, row_keys=None, key=None, num_samples: int = 1, temperature, top_k: int = 0,
                       top_p=1.0, eos_id: int | Sequence[int], pad_id: int, max_new_tokens: int | None = None,
                       decode_slots: int | None = None) -> SampleOutput:
    """Resamples responses after their first `prefix_lengths` tokens, `num_samples` (k) per row.

    prompt_ids, prompt_mask `[B, P]` (left-padded); response_ids, response_mask `[B, R]`
    (right-padded, as `generate` returns them; the mask only bounds prefix_lengths and is checked
    on concrete arrays); prefix_lengths `[B]` int: t_b in `[0, valid length of response row b]`. Each row's prompt + prefix is prefilled once and shared
    by its k continuations (row `b * k + j` is continuation j of row b), sampled with the settings
    of `generate` and `row_keys` `[B * k]`: the token at response position t of row i is drawn
    with `fold_in(row_keys[i], t)`, so with the keys a response was generated with
    (`generate(..., row_keys=...)`) a continuation reproduces it from any prefix. Or, with `key`
    instead (exactly one of the two), that token is row i of `generate`'s batch draw at position
    t, `categorical(fold_in(key, t), [B * k, C])` (`draws.categorical_rows`), whatever the other
    rows' positions: a continuation of `generate(..., key=key)`'s responses reproduces them from
    any prefixes, and rows continue from different positions in one call.

    Returns full responses `[B * k, R]`: positions `[0, t_b)` hold the prefix with mask 1 and
    logprobs / entropy 0 (they were not sampled here; the sampled part is
    `mask * (arange(R) >= repeat(prefix_lengths, k))`), then up to `max_new_tokens` (default R)
    sampled tokens, stopping after EOS or at R. A row whose prefix ends with EOS, or is the whole
    response, samples nothing. `decode_slots`: as in `generate` (rows that sample nothing take no
    slot). max_new_tokens, num_samples, top_k, eos_id, pad_id and decode_slots are static.
    """
    check_model(model, "continue_responses")
    cfg = model.config
    prompt_ids, prompt_mask = as_array(prompt_ids), as_array(prompt_mask)
    response_ids, response_mask = as_array(response_ids), as_array(response_mask)
    prefix_lengths = as_array(prefix_lengths)
    check_tokens(cfg, prompt_ids, prompt_mask, "prompt_ids")
    check_tokens(cfg, response_ids, response_mask, "response_ids")
    batch, response_len = response_ids.shape
    if prompt_ids.shape[0] != batch:
        raise ValueError(f"response_ids has {batch} rows but prompt_ids has {prompt_ids.shape[0]}")
    if response_len < 1:
        raise ValueError("response_ids must have at least one column")
    if prompt_ids.shape[1] + response_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + response length {response_len} exceeds the "
                         f"model's max_position_embeddings {cfg.max_position_embeddings}")
    if max_new_tokens is None:
        max_new_tokens = response_len
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int or None, got {max_new_tokens!r}")
    flags = sampler_flags(cfg, temperature, top_k, top_p, eos_id, pad_id)
    check_left_padded(prompt_mask)
    num_samples = _check_num_samples(num_samples)
    _check_prefix_lengths(prefix_lengths, response_mask, batch)
    if (key is None) == (row_keys is None):
        raise ValueError("continue_responses needs exactly one of row_keys (per-row draws) and key (the rows of a "
                         "batch draw), got " + ("both" if key is not None else "neither"))
    if row_keys is not None:
        check_row_keys(row_keys, batch * num_samples)
    else:
        draws.check_supported(key, batch * num_samples, flags["top_k"] or cfg.vocab_size)
    decode_slots = _check_decode_slots(decode_slots, batch * num_samples, None, 0)
    return _continue(model, params, prompt_ids, prompt_mask, response_ids, prefix_lengths, key, row_keys,
                     *sampler_scalars(flags, temperature, top_p), steps=min(int(max_new_tokens), response_len),
                     num_samples=num_samples, decode_slots=decode_slots, **flags)
