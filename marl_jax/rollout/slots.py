"""Continuous batching over a fixed number of decode slots (JetStream's prefill / insert / generate).

The static sampler decodes every row until the longest one has finished: B rows of lengths L_i
cost B x max L_i decode positions for sum L_i tokens. Here S slots decode at once; when a slot's
row finishes (EOS or its budget), the slot takes the next waiting row: its context, prefilled in a
batch of waiting units (prompts, or prompt + response prefix), is inserted into the slot's cache
rows and its first token is drawn from the prefill's logits. One `lax.while_loop`, static shapes,
no host round trip; each iteration is

  insert  while a slot is free and rows wait: prefill the next `stage` units when the staged ones
          are used up (`run_if`), then copy staged rows into the free slots (in slot order);
  draw    one token per occupied slot, from its row's key and response position;
  decode  every slot feeds its token at its own cache column (`cache_index [S]`).

A slot holds a row exactly as the static sampler lays it out (context at columns `[0, W)`,
response token j at column `W + j`, the same key mask and positions), so a row's logits do not
depend on its slot or on when it started, and neither do its draws: its tokens equal the static
sampler's. Memory: the KV cache holds S + stage rows instead of the batch's rows.

Units and rows: unit u (a prompt, or a context for continuation) is sampled `samples` (k) times,
as rows `u * k + j`; its prefill is inserted into the k slots that take those rows.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp


class SlotOutputs(NamedTuple):
    """tokens, logprobs, mask, entropy `[R, N]` (R = units x samples), in row order."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    entropy: jax.Array


def stage_units(slots: int, samples: int, units: int) -> int:
    """Units prefilled together. Rows of uneven length free slots a few at a time, so a prefill
    of half the slots' worth of units keeps slots busy while the staged cache costs at most half
    of the slots' memory."""
    return max(1, min(units, slots // (2 * samples)))


def _rows_at(cache, rows, batch_axis: int):
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=batch_axis), cache)


def _put_rows(cache, targets, values, batch_axis: int):
    """cache rows `targets [M]` set to rows of `values` (targets out of range are dropped)."""
    def put(x, v):
        index = (slice(None),) * batch_axis + (targets,)
        return x.at[index].set(v, mode="drop")

    return jax.tree.map(put, cache, values)


def run_if(pred, fn: Callable, state):
    """`fn(state)` where `pred` holds, else `state`: a `while_loop` of at most one iteration.
    Alone it is `lax.cond`. Under `vmap` with a per-run predicate (runs whose slots refill at
    different iterations), a `lax.cond` becomes a select that runs `fn` at every iteration for
    every run; this loop runs it only at the iterations where some run needs it."""
    def body(carry):
        return jnp.bool_(True), fn(carry[1])

    return jax.lax.while_loop(lambda carry: pred & ~carry[0], body, (jnp.bool_(False), state))[1]


@flax.struct.dataclass
class SlotState:
    """The decode state of `sample`'s loop. Per slot (S): its rows of the KV `cache`, key mask
    `kv_mask [S, W]`, valid context tokens `lengths [S]`, next-token `logits [S, V]`, the `row`
    it decodes (R when free), the tokens it has decoded of that row `done_steps [S]` and
    whether it is `active`. The prefill stage: `stage_*` (the next units' prefill, `stage_first`
    the queue position of its first unit). `next_row`: the queue position of the next row to
    insert. Outputs `tokens`, `logprobs`, `mask`, `entropy` `[R, N]`."""

    cache: Any
    kv_mask: jax.Array
    lengths: jax.Array
    logits: jax.Array
    row: jax.Array
    done_steps: jax.Array
    active: jax.Array
    stage_cache: Any
    stage_logits: jax.Array
    stage_kv_mask: jax.Array
    stage_lengths: jax.Array
    stage_first: jax.Array
    next_row: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    entropy: jax.Array


def sample(prefill: Callable, decode: Callable, choose: Callable, draw: Callable, *, units: int, samples: int,
           slots: int, steps: int, context_width: int, eos_ids, pad_id: int, unit_order, live_units, offsets,
           remaining, batch_axis: int, logits_width: int) -> SlotOutputs:
    """Samples up to `steps` (N) tokens for each row of the live units over `slots` (S) slots.

    prefill(unit_ids `[Q]`) -> (last logits `[Q, V]`, cache of Q rows and `context_width + N`
    columns, key mask `[Q, context_width + N]`, valid context tokens `[Q]`);
    decode(tokens `[S, 1]`, key mask, positions `[S, 1]`, cache, cache_index `[S]`) ->
    (logits `[S, V]`, cache); choose(logits, pick) -> (token, logprob, entropy) `[S]` with
    pick(candidates `[S, C]`) -> `[S]`; draw(candidates, rows `[S]`, response positions `[S]`)
    -> `[S]` picks for those rows. unit_order `[units]` int32: the live units first, in order;
    live_units: how many (rows of the others sample nothing). offsets `[R]`: response position
    of a row's first token; remaining `[R]`: at most this many tokens (<= N). batch_axis: the
    cache's batch axis. Returns `SlotOutputs` `[R, N]`.
    """
    rows_total = units * samples
    stage = stage_units(slots, samples, units)
    eos = jnp.asarray(eos_ids, jnp.int32)
    live_rows = live_units * samples
    width = context_width + steps

    def prefill_stage(first_unit):
        """Prefill of queue units `[first_unit, first_unit + stage)` (the tail repeats the last)."""
        picks = jnp.minimum(first_unit + jnp.arange(stage), units - 1)
        return prefill(jnp.take(unit_order, picks))

    empty_logits, empty_cache, empty_kv_mask, empty_lengths = jax.eval_shape(prefill_stage, jnp.int32(0))

    def zeros(shaped):
        return jnp.zeros(shaped.shape, shaped.dtype)

    slot_cache = jax.tree.map(
        lambda s: jnp.zeros(s.shape[:batch_axis] + (slots,) + s.shape[batch_axis + 1:], s.dtype), empty_cache)

    state = SlotState(
        cache=slot_cache, kv_mask=jnp.zeros((slots, width), jnp.int32), lengths=jnp.zeros((slots,), jnp.int32),
        logits=jnp.zeros((slots, logits_width), jnp.float32), row=jnp.full((slots,), rows_total, jnp.int32),
        done_steps=jnp.zeros((slots,), jnp.int32), active=jnp.zeros((slots,), bool),
        stage_cache=jax.tree.map(zeros, empty_cache), stage_logits=zeros(empty_logits),
        stage_kv_mask=zeros(empty_kv_mask), stage_lengths=zeros(empty_lengths),
        stage_first=jnp.int32(-stage), next_row=jnp.int32(0),
        tokens=jnp.full((rows_total, steps), pad_id, jnp.int32), logprobs=jnp.zeros((rows_total, steps), jnp.float32),
        mask=jnp.zeros((rows_total, steps), jnp.int32), entropy=jnp.zeros((rows_total, steps), jnp.float32))

    def can_insert(s: SlotState):
        return jnp.any(~s.active) & (s.next_row < live_rows)

    def insert(s: SlotState) -> SlotState:
        """Copies staged rows into the free slots (in slot order), prefilling the next stage of
        units first when the staged ones are used up."""
        unit_position = s.next_row // samples

        def restage(s: SlotState) -> SlotState:
            logits, cache, kv_mask, lengths = prefill_stage(unit_position)
            return s.replace(stage_cache=cache, stage_logits=logits, stage_kv_mask=kv_mask, stage_lengths=lengths,
                             stage_first=unit_position)

        s = run_if(unit_position >= s.stage_first + stage, restage, s)
        free = ~s.active
        rank = jnp.cumsum(free) - 1
        available = jnp.minimum((s.stage_first + stage) * samples, live_rows) - s.next_row
        take = free & (rank < available)
        queue_row = s.next_row + rank
        staged_unit = jnp.clip(queue_row // samples - s.stage_first, 0, stage - 1)
        row = jnp.take(unit_order, jnp.minimum(queue_row // samples, units - 1)) * samples + queue_row % samples
        # Each staged row (unit q, sample j) goes to the free slot of its rank, if it has one.
        staged_rows = jnp.arange(stage * samples)
        staged_rank = s.stage_first * samples + staged_rows - s.next_row
        free_slots = jnp.nonzero(free, size=slots, fill_value=slots)[0]
        target = jnp.where((staged_rank >= 0) & (staged_rank < jnp.minimum(available, free.sum())),
                           jnp.take(free_slots, jnp.clip(staged_rank, 0, slots - 1)), slots)

        def pick(slot_values, stage_values):
            chosen = jnp.take(stage_values, staged_unit, axis=0)
            return jnp.where(take.reshape(take.shape + (1,) * (chosen.ndim - 1)), chosen, slot_values)

        return s.replace(
            cache=_put_rows(s.cache, target, _rows_at(s.stage_cache, staged_rows // samples, batch_axis),
                            batch_axis),
            logits=pick(s.logits, s.stage_logits), kv_mask=pick(s.kv_mask, s.stage_kv_mask),
            lengths=pick(s.lengths, s.stage_lengths), row=jnp.where(take, row, s.row),
            done_steps=jnp.where(take, 0, s.done_steps), active=s.active | take,
            next_row=s.next_row + take.sum().astype(jnp.int32))

    def generate_step(s: SlotState) -> SlotState:
        """Refill, then one token per occupied slot (drawn from its row's key and response
        position) and one decode step of every slot at its own cache column."""
        s = jax.lax.while_loop(can_insert, insert, s)
        safe_row = jnp.minimum(s.row, rows_total - 1)
        position = jnp.take(offsets, safe_row) + s.done_steps
        token, logprob, entropy = choose(s.logits, lambda candidates: draw(candidates, safe_row, position))
        token = token.astype(jnp.int32)
        out_row = jnp.where(s.active, s.row, rows_total)

        def record(output, value):
            return output.at[out_row, s.done_steps].set(value.astype(output.dtype), mode="drop")

        finished = jnp.any(token[:, None] == eos, axis=-1) | (s.done_steps + 1 >= jnp.take(remaining, safe_row))
        going = s.active & ~finished
        logits, cache = decode(token[:, None], s.kv_mask, (s.lengths + s.done_steps)[:, None], s.cache,
                               context_width + jnp.minimum(s.done_steps, steps - 1))
        return s.replace(tokens=record(s.tokens, token), logprobs=record(s.logprobs, logprob),
                         entropy=record(s.entropy, entropy), mask=record(s.mask, jnp.ones_like(token)), cache=cache,
                         logits=jnp.where(going[:, None], logits, s.logits), done_steps=s.done_steps + going,
                         active=going)

    s = jax.lax.while_loop(lambda s: jnp.any(s.active) | (s.next_row < live_rows), generate_step, state)
    return SlotOutputs(s.tokens, s.logprobs, s.mask, s.entropy)
