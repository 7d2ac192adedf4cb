"""Multi-turn rollout over one KV cache: `run_turns` decodes every row to the end of its turn,
hands the finished turns to a host callback (the environments' step), prefills the observations
it returns on top of the same cache and decodes on; `reprefill_turns` is its reference, which
prefills the prompt and the whole history again at every turn (`engine.continue_responses`).

A trajectory row is the left-padded prompt `[P]` followed by T columns, each an ACTION (sampled by
the policy), an OBSERVATION (written by the environment, chat-template markers included) or PAD
(after the end). `turn_ids [B, T]` is the turn of each column: an observation carries the turn it
follows, padding the row's last turn, so turn ids never decrease along a row. Column t is drawn
with `fold_in(row_keys[i], t)` (as `generate` draws response position t), so a row's trajectory
depends on its key, its prompt and the callback's answers only, and both drivers give the same
tokens.

Cache layout: cache slots `[0, P)` the prompt, `P + t` column t, and a scratch tail of `chunk`
slots. Rows write at their own cache slot (`cache_index [B]`): a row that idles while others decode, or
takes no observation, writes to the scratch tail, which no valid query reads; an observation
shorter than the chunk writes past its end into columns that the row's next tokens overwrite
before any query reads them (causality). Positions are the prompt's valid length plus the column,
so the keys are those of the re-prefilled history. Every forward pass reads the first `P + T`
cache slots (the key mask), as `generate` does for T new tokens: one turn is `generate` to the
bit (tests).

Continuous batching (`decode_slots` S < B): the cache holds S rows; a row keeps its slot from its
first turn to its end, and the slot then takes the next waiting prompt (its prompt prefilled into
the slot's cache rows) at the next round of turns. A round is one turn of every seated row and
one call of the callback.

Turn ends (`end_turns`, the one statement of these rules): an end-of-turn token or
`max_turn_tokens` actions end a turn, which the callback then steps. A row ends when the callback says done (or failed); it ends truncated when its budget of
T columns cuts a turn short (that turn is not stepped), when its observation and one more action
do not fit, or after `max_turns` turns without done.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import attention
from marl_jax.models.decoder import init_cache, positions_from_mask
from marl_jax.models.heads import CausalLM, check_tokens
from marl_jax.rollout import engine

# Kinds of trajectory columns.
PAD, ACTION, OBSERVATION = 0, 1, 2

# Observation tokens prefilled per forward pass (a longer observation takes several): the scratch
# tail of the cache has this many slots.
OBSERVATION_CHUNK = 32


class Trajectory(NamedTuple):
    """A batch of multi-turn trajectories (numpy arrays).

    tokens `[B, T]` int32 (pad_id on PAD columns), kinds `[B, T]` int8 (PAD, ACTION,
    OBSERVATION), turn_ids `[B, T]` int32, logprobs and entropy `[B, T]` float32 (the sampler's,
    at ACTION columns; 0 elsewhere), turn_rewards `[B, T]` float32 (each stepped turn's reward on
    its last action column), num_turns `[B]` int32 (turns with actions), truncated `[B]` bool,
    failed `[B]` bool; prefill_tokens: valid tokens the driver ran through multi-token forward
    passes (prompts and observations; the reference: prompt and history of every row at every
    turn it plays; not counted: the copies that pad a batch of seated prompts to its size, and
    the reference's rows that sit a turn out), generated_tokens: ACTION columns sampled.
    """

    tokens: np.ndarray
    kinds: np.ndarray
    turn_ids: np.ndarray
    logprobs: np.ndarray
    entropy: np.ndarray
    turn_rewards: np.ndarray
    num_turns: np.ndarray
    truncated: np.ndarray
    failed: np.ndarray
    prefill_tokens: int
    generated_tokens: int


# step_turns(rows [R] int, actions: R arrays of int32 ids) -> (observations: R arrays or None,
# rewards [R] float32, done [R] bool, failed [R] bool)
StepTurns = Callable[[np.ndarray, list], tuple]


class _TurnOut(NamedTuple):
    """One turn of every row, from its first column on: tokens, logprobs, entropy `[B, N]` and
    the actions taken `[B]` (0 for rows that did not play)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    entropy: np.ndarray
    lengths: np.ndarray


# Device programs of run_turns -----------------------------------------------------------------------

_FLAGS = ("top_k", "eos_ids", "pad_id", "greedy", "dynamic_temperature", "use_top_p")


@functools.partial(attention.jit_per_platform, static_argnames=("model", "total"))
def _seat_prompts(model: CausalLM, params, cache, logits, kv_mask, prompt_lengths, prompt_ids, prompt_mask, slots, *,
                  total):
    """Prefills the prompts `[n, P]` and puts their rows at decode slots `slots [n]` of the
    carried cache `[S, ...]`, logits `[S, V]`, key mask `[S, P + total]` and valid prompt tokens
    `[S]` (a slot listed twice gets the same row twice). The key mask covers the prompt and the
    trajectory, not the scratch tail: every forward pass reads `P + total` cache slots, as
    `generate`'s prefill and decode steps for `total` new tokens do."""
    batch = prompt_ids.shape[0]
    mask = prompt_mask.astype(jnp.int32)
    new_kv_mask = jnp.concatenate([mask, jnp.ones((batch, total), jnp.int32)], axis=1)
    new_logits, new_cache = engine.decode_fn(model, params)(
        prompt_ids, new_kv_mask, positions_from_mask(mask), init_cache(model.config, batch, _cache_width(cache, model)),
        0)
    batch_axis = 1 if model.config.scan_layers else 0  # scanned caches are [L, S, K, W, H]
    index = (slice(None),) * batch_axis + (slots,)
    cache = jax.tree.map(lambda old, new: old.at[index].set(new), cache, new_cache)
    return (cache, logits.at[slots].set(new_logits), kv_mask.at[slots].set(new_kv_mask),
            prompt_lengths.at[slots].set(mask.sum(axis=-1)))


def _cache_width(cache, model: CausalLM) -> int:
    """Cache slots of a cache in the `init_cache` layout of `model.config`."""
    return (cache["k"] if model.config.scan_layers else cache[0]["k"]).shape[-2]


@functools.partial(attention.jit_per_platform,
                   static_argnames=("model", "prompt_width", "total", "turn_tokens", *_FLAGS))
def _decode_turn(model: CausalLM, params, cache, logits, kv_mask, prompt_lengths, row_keys, cursor, active,
                 temperature, top_p, *, prompt_width, total, turn_tokens, top_k, eos_ids, pad_id, greedy,
                 dynamic_temperature, use_top_p):
    """Decodes one turn of the `active [B]` rows, whose next column is `cursor [B]`: each step
    draws a token from the pending logits, feeds it at slot `P + cursor + step` and keeps the
    logits after it, until every row has sampled an end-of-turn token, `turn_tokens` tokens or
    reached column `total`. Returns (tokens, logprobs, entropy `[B, turn_tokens]`, actions taken
    `[B]`, cache, pending logits `[B, V]`)."""
    batch = logits.shape[0]
    choose = functools.partial(engine.choose_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               dynamic_temperature=dynamic_temperature, use_top_p=use_top_p)
    decode = engine.decode_fn(model, params)
    eos = jnp.asarray(eos_ids, jnp.int32)
    budget = jnp.minimum(turn_tokens, total - cursor)
    scratch = prompt_width + total

    def body(state):
        step, cache, logits, live, taken, tokens, logprobs, entropies = state
        column = cursor + step
        token, logprob, entropy = choose(logits, lambda c: jax.vmap(engine.draw_row)(row_keys, column, c))
        token = jnp.where(live, token.astype(jnp.int32), pad_id)
        at = (0, step)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], at)
        logprobs = jax.lax.dynamic_update_slice(logprobs, jnp.where(live, logprob, 0.0)[:, None], at)
        entropies = jax.lax.dynamic_update_slice(entropies, jnp.where(live, entropy, 0.0)[:, None], at)
        slot = jnp.where(live, prompt_width + column, scratch)
        position = jnp.where(live, prompt_lengths + column, 0)
        new_logits, cache = decode(token[:, None], kv_mask, position[:, None], cache, slot)
        logits = jnp.where(live[:, None], new_logits, logits)
        taken = taken + live.astype(jnp.int32)
        ended = jnp.any(token[:, None] == eos, axis=-1) | (step + 1 >= budget)
        return step + 1, cache, logits, live & ~ended, taken, tokens, logprobs, entropies

    state = (jnp.asarray(0, jnp.int32), cache, logits, active, jnp.zeros((batch,), jnp.int32),
             jnp.full((batch, turn_tokens), pad_id, jnp.int32), jnp.zeros((batch, turn_tokens), jnp.float32),
             jnp.zeros((batch, turn_tokens), jnp.float32))
    _, cache, logits, _, taken, tokens, logprobs, entropies = jax.lax.while_loop(
        lambda s: jnp.any(s[3]), body, state)
    return tokens, logprobs, entropies, taken, cache, logits


def _chunk_logits(module: CausalLM, ids, kv_mask, positions, cache, cache_index, last):
    """A multi-token forward on top of the cache: the logits `[B, V]` after column `last [B]` of
    `ids [B, W]`, and the updated cache."""
    hidden, cache = module.backbone(ids, kv_mask, positions, cache, cache_index)
    return module.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1))[:, 0], cache


@functools.partial(attention.jit_per_platform, static_argnames=("model", "prompt_width", "total"))
def _append_chunk(model: CausalLM, params, cache, logits, kv_mask, prompt_lengths, ids, counts, cursor, *,
                  prompt_width, total):
    """Prefills `ids [B, W]` (the first `counts [B]` of each row valid) at columns `cursor [B]`
    on top of the cache; rows with count 0 write to the scratch tail and keep their logits.
    Returns (cache, logits `[B, V]` after each row's last new token)."""
    width = ids.shape[1]
    has = counts > 0
    slot = jnp.where(has, prompt_width + cursor, prompt_width + total)
    positions = jnp.minimum((prompt_lengths + cursor)[:, None] + jnp.arange(width),
                            model.config.max_position_embeddings - 1)
    new_logits, cache = model.apply({"params": params}, ids, kv_mask, positions, cache, slot,
                                    jnp.maximum(counts - 1, 0), method=_chunk_logits)
    return cache, jnp.where(has[:, None], new_logits, logits)


def _bucket(count: int, limit: int) -> int:
    """The smallest power of two at least `count`, at most `limit`: the prefill batch sizes that
    seating compiles for."""
    return min(1 << max(count - 1, 0).bit_length(), limit)


class _CacheDriver:
    """The turns of `run_turns` over `slots` (S) decode slots: a row takes a free slot (its prompt
    prefilled into the slot's cache rows) and keeps it until it ends; per turn a decode program
    over the carried cache, and the observations prefilled on top of it in chunks of `chunk`
    tokens. With S = B every row is seated at once."""

    def __init__(self, model, params, prompt_ids, prompt_mask, row_keys, temperature, top_p, flags, *, total,
                 turn_tokens, chunk, slots):
        self.model, self.params = engine.sampling_model(model, params)
        self.prompt_ids, self.prompt_mask, self.row_keys = prompt_ids, prompt_mask, row_keys
        self.total, self.turn_tokens, self.chunk = total, turn_tokens, chunk
        self.flags = flags
        self.scalars = engine.sampler_scalars(flags, temperature, top_p)
        self.prompt_width = prompt_ids.shape[1]
        # Cache: prompt, T columns, and a scratch tail as wide as one observation chunk.
        width = self.prompt_width + total + chunk
        self.cache = init_cache(self.model.config, slots, width)
        self.logits = jnp.zeros((slots, self.model.config.vocab_size), jnp.float32)
        self.kv_mask = jnp.zeros((slots, self.prompt_width + total), jnp.int32)
        self.prompt_lengths = jnp.zeros((slots,), jnp.int32)
        self.slot_rows = np.full((slots,), -1)  # -1: free
        self.seated = np.zeros((prompt_ids.shape[0],), bool)
        self.prompt_tokens = np.asarray(prompt_mask).sum(axis=1)
        self.prefill_tokens = 0

    def seat(self, live: np.ndarray) -> np.ndarray:
        """Frees the slots of rows that ended, seats waiting rows (in row order) in free slots (in
        slot order) and returns the rows that play this round `[B]` bool."""
        held = self.slot_rows >= 0
        self.slot_rows[held & ~live[np.maximum(self.slot_rows, 0)]] = -1
        free = np.flatnonzero(self.slot_rows < 0)
        waiting = np.flatnonzero(live & ~self.seated)[:free.size]
        if waiting.size:
            slots = free[:waiting.size]
            self.slot_rows[slots] = waiting
            self.seated[waiting] = True
            # Pad the prefill batch to its bucket by repeating the first row into its own slot.
            size = _bucket(waiting.size, self.slot_rows.size)
            rows, slots = (np.concatenate([x, np.full(size - x.size, x[0])]) for x in (waiting, slots))
            self.cache, self.logits, self.kv_mask, self.prompt_lengths = _seat_prompts(
                self.model, self.params, self.cache, self.logits, self.kv_mask, self.prompt_lengths,
                jnp.take(self.prompt_ids, rows, axis=0), jnp.take(self.prompt_mask, rows, axis=0),
                jnp.asarray(slots, jnp.int32), total=self.total)
            self.prefill_tokens += int(self.prompt_tokens[waiting].sum())
        playing = np.zeros_like(live)
        playing[self.slot_rows[self.slot_rows >= 0]] = True
        return playing & live

    def decode(self, active: np.ndarray, cursor: np.ndarray) -> _TurnOut:
        rows = np.maximum(self.slot_rows, 0)
        tokens, logprobs, entropy, taken, self.cache, self.logits = _decode_turn(
            self.model, self.params, self.cache, self.logits, self.kv_mask, self.prompt_lengths,
            jnp.take(self.row_keys, jnp.asarray(rows)), jnp.asarray(cursor[rows], jnp.int32),
            jnp.asarray((self.slot_rows >= 0) & active[rows]), *self.scalars, prompt_width=self.prompt_width,
            total=self.total, turn_tokens=self.turn_tokens, **self.flags)
        out = [np.asarray(x) for x in (tokens, logprobs, entropy, taken)]
        batch = active.shape[0]
        by_row = [np.zeros((batch,) + x.shape[1:], x.dtype) for x in out]
        held = np.flatnonzero(self.slot_rows >= 0)
        for full, part in zip(by_row, out):
            full[self.slot_rows[held]] = part[held]
        return _TurnOut(*by_row)

    def append(self, observations: dict, cursor: np.ndarray) -> None:
        """Prefills `observations {row: ids}` at columns `cursor [B]` of their rows' slots."""
        slot_of = {int(row): slot for slot, row in enumerate(self.slot_rows) if row >= 0}
        slots = self.slot_rows.size
        starts = cursor[np.maximum(self.slot_rows, 0)]
        longest = max(len(ids) for ids in observations.values())
        for start in range(0, longest, self.chunk):
            ids = np.full((slots, self.chunk), self.flags["pad_id"], np.int32)
            counts = np.zeros((slots,), np.int32)
            for row, obs in observations.items():
                piece = obs[start:start + self.chunk]
                ids[slot_of[row], :len(piece)], counts[slot_of[row]] = piece, len(piece)
            self.cache, self.logits = _append_chunk(
                self.model, self.params, self.cache, self.logits, self.kv_mask, self.prompt_lengths,
                jnp.asarray(ids), jnp.asarray(counts), jnp.asarray(starts + start, jnp.int32),
                prompt_width=self.prompt_width, total=self.total)
            self.prefill_tokens += int(counts.sum())


class _ReprefillDriver:
    """The turns of `reprefill_turns`: every turn prefills each playing row's prompt and history
    again (`engine.continue_responses` from its cursor) and samples the turn after it, with
    `params_of_turn(j)` at round j (every playing row's turn j) when given."""

    def __init__(self, model, params, prompt_ids, prompt_mask, row_keys, temperature, top_p, flags, *, total,
                 turn_tokens, params_of_turn=None):
        self.model, self.params = model, params
        self.params_of_turn, self.round = params_of_turn, 0
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.row_keys, self.total, self.turn_tokens = row_keys, total, turn_tokens
        self.settings = dict(temperature=temperature, top_k=flags["top_k"], top_p=top_p, eos_id=flags["eos_ids"],
                             pad_id=flags["pad_id"])
        self.prompt_lengths = np.asarray(prompt_mask).sum(axis=1)
        self.history = np.full((prompt_ids.shape[0], total), flags["pad_id"], np.int32)
        self.prefill_tokens = 0

    def seat(self, live: np.ndarray) -> np.ndarray:
        return live

    def decode(self, active: np.ndarray, cursor: np.ndarray) -> _TurnOut:
        batch = active.shape[0]
        prefix = np.where(active, cursor, self.total).astype(np.int32)
        params = self.params if self.params_of_turn is None else self.params_of_turn(self.round)
        self.round += 1
        out = engine.continue_responses(
            self.model, params, self.prompt_ids, self.prompt_mask, jnp.asarray(self.history),
            jnp.ones((batch, self.total), jnp.int32), jnp.asarray(prefix), row_keys=self.row_keys,
            max_new_tokens=self.turn_tokens, **self.settings)
        self.prefill_tokens += int((self.prompt_lengths + cursor)[active].sum())
        columns = np.minimum(prefix[:, None] + np.arange(self.turn_tokens), self.total - 1)
        sampled = (np.asarray(out.mask) * (np.arange(self.total) >= prefix[:, None])).sum(axis=1)
        keep = np.arange(self.turn_tokens)[None] < sampled[:, None]
        pick = lambda x, fill: np.where(keep, np.take_along_axis(np.asarray(x), columns, axis=1), fill)
        turn = _TurnOut(pick(out.tokens, self.settings["pad_id"]).astype(np.int32), pick(out.logprobs, 0.0),
                        pick(out.entropy, 0.0), sampled.astype(np.int32))
        for row in np.flatnonzero(active):
            self.history[row, cursor[row]:cursor[row] + sampled[row]] = turn.tokens[row, :sampled[row]]
        return turn

    def append(self, observations: dict, cursor: np.ndarray) -> None:
        for row, obs in observations.items():
            self.history[row, cursor[row]:cursor[row] + len(obs)] = obs


# The host loop shared by both drivers ---------------------------------------------------------------

def _step_results(result, rows: np.ndarray, vocab_size: int):
    """Validates a step_turns answer for `rows`: (observations, rewards, done, failed)."""
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        raise ValueError("step_turns must return (observations, rewards, done, failed), got "
                         f"{type(result).__name__}" + (f" of {len(result)} items" if isinstance(result, (tuple, list))
                                                       else ""))
    observations, rewards, done, failed = result
    count = len(rows)
    if not isinstance(observations, (list, tuple)) or len(observations) != count:
        raise ValueError(f"step_turns returned {len(observations) if hasattr(observations, '__len__') else '?'} "
                         f"observations for {count} rows")
    named = (("rewards", rewards, np.float32), ("done", done, bool), ("failed", failed, bool))
    arrays = {}
    for name, value, dtype in named:
        value = np.asarray(value)
        if value.shape != (count,):
            raise ValueError(f"step_turns returned {name} of shape {value.shape} for {count} rows")
        if dtype is bool and value.dtype != bool:
            raise ValueError(f"step_turns returned {name} of dtype {value.dtype}, expected bool")
        if dtype is np.float32 and not np.issubdtype(value.dtype, np.number):
            raise ValueError(f"step_turns returned {name} of dtype {value.dtype}, expected float")
        arrays[name] = value.astype(dtype)
    ended = arrays["done"] | arrays["failed"]
    checked = []
    for i, (row, obs) in enumerate(zip(rows, observations)):
        if ended[i]:
            checked.append(None)
            continue
        ids = None if obs is None else np.asarray(obs)
        if ids is None or ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"step_turns must return a non-empty 1-D array of int ids as the observation of row "
                             f"{row}, which is not done; got " + ("None" if ids is None else
                                                                 f"shape {ids.shape}, dtype {ids.dtype}"))
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"step_turns returned observation ids for row {row} outside the vocabulary "
                             f"[0, {vocab_size})")
        checked.append(ids.astype(np.int32))
    return checked, arrays["rewards"], arrays["done"], arrays["failed"]


class TurnEnds(NamedTuple):
    """The turn rules' verdict on one round of turns (`end_turns`): rows `[R]` whose turn ended
    and was stepped, with the environment's rewards and failed flags `[R]`; ended and
    truncated `[B]` (rows whose episode is over, and those of them cut short); observations
    {row: ids} of the rows that play on."""

    rows: np.ndarray
    rewards: np.ndarray
    failed: np.ndarray
    ended: np.ndarray
    truncated: np.ndarray
    observations: dict


def end_turns(step_turns: StepTurns, played, last_token, turn_actions, turns_played, cursor,
              actions_of: Callable[[int], np.ndarray], *, eos_ids, turn_tokens: int, max_turns: int,
              total: int, vocab_size: int) -> TurnEnds:
    """The turn rules, once for every driver of a multi-turn episode (`run_turns`,
    `reprefill_turns` and the credit probe's continuations): the rows `played [B]` have just
    sampled through column `cursor [B]`, their turn's last token `last_token [B]`, its action
    count so far `turn_actions [B]` and `turns_played [B]` turns with this one. A turn ends at an
    end-of-turn id or when its actions reach `turn_tokens`; one that stopped otherwise was cut
    by the trajectory's budget: the row ends truncated and that turn is not stepped. The ended
    turns are stepped (`step_turns` with `actions_of(row)`, the turn's action ids); an episode
    ends when the environment says done or failed, and ends truncated after `max_turns` turns
    or when its observation and one more action do not fit in `total` columns; the other rows
    go on with their observation."""
    complete = played & (np.isin(last_token, np.asarray(eos_ids)) | (turn_actions == turn_tokens))
    ended, truncated = played & ~complete, played & ~complete
    rows = np.flatnonzero(complete)
    if not rows.size:
        return TurnEnds(rows, np.zeros(0, np.float32), np.zeros(0, bool), ended, truncated, {})
    observations, rewards, done, failed = _step_results(step_turns(rows, [actions_of(row) for row in rows]),
                                                        rows, vocab_size)
    going_on = {}
    for i, row in enumerate(rows):
        if done[i] or failed[i]:
            ended[row] = True
        elif turns_played[row] == max_turns or cursor[row] + len(observations[i]) + 1 > total:
            ended[row] = truncated[row] = True
        else:
            going_on[row] = observations[i]
    return TurnEnds(rows, rewards, failed, ended, truncated, going_on)


def _play(driver, step_turns: StepTurns, *, batch: int, total: int, max_turns: int, turn_tokens: int, eos_ids,
          pad_id: int, vocab_size: int) -> Trajectory:
    tokens = np.full((batch, total), pad_id, np.int32)
    kinds = np.full((batch, total), PAD, np.int8)
    turn_ids = np.zeros((batch, total), np.int32)
    logprobs, entropy, rewards = (np.zeros((batch, total), np.float32) for _ in range(3))
    cursor = np.zeros((batch,), np.int64)
    num_turns = np.zeros((batch,), np.int32)
    live = np.ones((batch,), bool)
    truncated, failed = np.zeros((batch,), bool), np.zeros((batch,), bool)
    eos = np.asarray(eos_ids)
    while live.any():
        # Each round, every seated row plays its next turn (turn index num_turns before it).
        active = driver.seat(live)
        out = driver.decode(active, cursor)
        for row in np.flatnonzero(active):
            n, at = int(out.lengths[row]), slice(cursor[row], cursor[row] + out.lengths[row])
            tokens[row, at], logprobs[row, at], entropy[row, at] = (
                out.tokens[row, :n], out.logprobs[row, :n], out.entropy[row, :n])
            kinds[row, at], turn_ids[row, at] = ACTION, num_turns[row]
        num_turns[active] += 1
        last = np.take_along_axis(out.tokens, np.maximum(out.lengths - 1, 0)[:, None], axis=1)[:, 0]
        cursor = cursor + np.where(active, out.lengths, 0)
        ends = end_turns(step_turns, active, last, out.lengths, num_turns, cursor,
                         lambda row: tokens[row, cursor[row] - out.lengths[row]:cursor[row]].copy(),
                         eos_ids=eos, turn_tokens=turn_tokens, max_turns=max_turns, total=total,
                         vocab_size=vocab_size)
        truncated |= ends.truncated
        live &= ~ends.ended
        rewards[ends.rows, cursor[ends.rows] - 1] = ends.rewards
        failed[ends.rows] = ends.failed
        appended = ends.observations
        if appended:
            driver.append(appended, cursor)
            for row, obs in appended.items():
                at = slice(cursor[row], cursor[row] + len(obs))
                tokens[row, at], kinds[row, at], turn_ids[row, at] = obs, OBSERVATION, num_turns[row] - 1
                cursor[row] += len(obs)
    for row in range(batch):
        turn_ids[row, cursor[row]:] = num_turns[row] - 1
    return Trajectory(tokens, kinds, turn_ids, logprobs, entropy, rewards, num_turns, truncated, failed,
                      prefill_tokens=driver.prefill_tokens, generated_tokens=int((kinds == ACTION).sum()))


def _settings(model, prompt_ids, prompt_mask, row_keys, *, step_turns, max_turns, max_total_tokens, max_turn_tokens,
              end_of_turn, temperature, top_k, top_p, pad_id, name: str):
    """Validated (prompt_ids, prompt_mask, flags) of a multi-turn call."""
    engine.check_model(model, name)
    cfg = model.config
    prompt_ids, prompt_mask = engine.as_array(prompt_ids), engine.as_array(prompt_mask)
    check_tokens(cfg, prompt_ids, prompt_mask, "prompt_ids")
    engine.check_left_padded(prompt_mask)
    if not callable(step_turns):
        raise ValueError(f"step_turns must be callable, got {type(step_turns).__name__}")
    if not engine.is_int(max_turns) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    if not engine.is_int(max_turn_tokens) or max_turn_tokens < 1:
        raise ValueError(f"max_turn_tokens must be an int >= 1, got {max_turn_tokens!r}")
    if not engine.is_int(max_total_tokens) or max_total_tokens < max_turn_tokens:
        raise ValueError(f"max_total_tokens (the trajectory budget) must be an int >= max_turn_tokens="
                         f"{max_turn_tokens} (one whole turn), got {max_total_tokens!r}")
    if prompt_ids.shape[1] + max_total_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + max_total_tokens {max_total_tokens} exceeds the "
                         f"model's max_position_embeddings {cfg.max_position_embeddings}")
    engine.check_row_keys(row_keys, prompt_ids.shape[0])
    flags = engine.sampler_flags(cfg, temperature, top_k, top_p, end_of_turn, pad_id)
    return prompt_ids, prompt_mask, flags


def run_turns(model: CausalLM, params, prompt_ids, prompt_mask, *, step_turns: StepTurns, row_keys, max_turns: int,
              max_total_tokens: int, max_turn_tokens: int, end_of_turn: int | Sequence[int], temperature,
              top_k: int = 0, top_p=1.0, pad_id: int, chunk: int = OBSERVATION_CHUNK,
              decode_slots: int | None = None) -> Trajectory:
    """Multi-turn rollout of left-padded prompts `prompt_ids, prompt_mask [B, P]` against a host
    callback, reusing one KV cache: the prompts are prefilled once, every observation is prefilled
    on top of the cache (`chunk` tokens per forward pass), and no history is computed twice.

    Each turn, the rows still playing decode until an `end_of_turn` id (an int or tuple), or
    `max_turn_tokens` tokens, or their budget of `max_total_tokens` (T) columns; then
    `step_turns(rows [R] int, actions: R int32 arrays) -> (observations: R int arrays or None
    (done rows), rewards [R], done [R] bool, failed [R] bool)` steps the rows whose turn ended.
    Column t of row i is drawn with `fold_in(row_keys[i], t)` (typed keys `[B]`); temperature 0
    is greedy, top_k / top_p as in `generate`. Returns a `Trajectory` of `[B, T]` arrays (module
    docstring: the layout and when a row ends or is truncated).

    `decode_slots` S (None or 0: every row at once): continuous batching over S slots; the KV
    cache holds S rows, a row keeps its slot until it ends, and a row that ends leaves its slot to
    the next waiting prompt (prefilled in a batch of the next power of two of waiting rows, at
    most S, padded by repeating one) at the next round of turns. A row's draws depend on its key
    and columns only, so the trajectories are those of S = B (up to floating-point ties).
    """
    prompt_ids, prompt_mask, flags = _settings(
        model, prompt_ids, prompt_mask, row_keys, step_turns=step_turns, max_turns=max_turns,
        max_total_tokens=max_total_tokens, max_turn_tokens=max_turn_tokens, end_of_turn=end_of_turn,
        temperature=temperature, top_k=top_k, top_p=top_p, pad_id=pad_id, name="run_turns")
    if not engine.is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    batch = prompt_ids.shape[0]
    if decode_slots is not None and (not engine.is_int(decode_slots) or decode_slots < 0):
        raise ValueError(f"decode_slots must be None or a non-negative int, got {decode_slots!r}")
    slots = min(int(decode_slots), batch) if decode_slots else batch
    driver = _CacheDriver(model, params, prompt_ids, prompt_mask, row_keys, temperature, top_p, flags,
                          total=int(max_total_tokens), turn_tokens=int(max_turn_tokens), chunk=int(chunk), slots=slots)
    return _play(driver, step_turns, batch=prompt_ids.shape[0], total=int(max_total_tokens), max_turns=int(max_turns),
                 turn_tokens=int(max_turn_tokens), eos_ids=flags["eos_ids"], pad_id=flags["pad_id"],
                 vocab_size=model.config.vocab_size)


def reprefill_turns(model: CausalLM, params, prompt_ids, prompt_mask, *, step_turns: StepTurns, row_keys,
                    max_turns: int, max_total_tokens: int, max_turn_tokens: int, end_of_turn: int | Sequence[int],
                    temperature, top_k: int = 0, top_p=1.0, pad_id: int, params_of_turn=None) -> Trajectory:
    """`run_turns` by re-prefilling: every turn samples with `engine.continue_responses` after the
    prompt and the whole history so far (one prefill of prompt + history per row and turn), with
    the same keys. The reference `run_turns` is tested against, and its cost in prefill tokens.
    An observation ending with an end-of-turn id would stop `continue_responses` before it
    samples: give such environments to `run_turns` only.

    `params_of_turn(j) -> params` (optional): the params every row samples its turn j with (all
    rows play round j together), in place of `params`: a turn's whole context is prefilled again
    with them, so each turn is exactly its params' policy given the history (asynchronous PPO's
    versions, `train/async_turns.py`)."""
    prompt_ids, prompt_mask, flags = _settings(
        model, prompt_ids, prompt_mask, row_keys, step_turns=step_turns, max_turns=max_turns,
        max_total_tokens=max_total_tokens, max_turn_tokens=max_turn_tokens, end_of_turn=end_of_turn,
        temperature=temperature, top_k=top_k, top_p=top_p, pad_id=pad_id, name="reprefill_turns")
    driver = _ReprefillDriver(model, params, prompt_ids, prompt_mask, row_keys, temperature, top_p, flags,
                              total=int(max_total_tokens), turn_tokens=int(max_turn_tokens),
                              params_of_turn=params_of_turn)
    return _play(driver, step_turns, batch=prompt_ids.shape[0], total=int(max_total_tokens), max_turns=int(max_turns),
                 turn_tokens=int(max_turn_tokens), eos_ids=flags["eos_ids"], pad_id=flags["pad_id"],
                 vocab_size=model.config.vocab_size)
