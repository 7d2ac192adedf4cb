"""Ground-truth advantages from Monte Carlo continuations (VinePPO's estimate), the truth that
`credit.estimator_scores` scores estimators against.

States. Row b of a batch of sampled responses (right-padded, response_mask `[B, R]` with
leading ones: L_b valid tokens) has the states (b, t), t in [0, L_b]: the prompt and the first
t response tokens, before response token t; (b, L_b) is terminal (value 0). From every state K
continuations are sampled by the policy with `rollout.continue_responses` (the prompt + prefix
prefilled once and shared by its K continuations, all states of a chunk in one call), each
continued response is rewarded by the caller's `reward_fn` and its discounted return from t on,
sum_{u >= t} gamma^(u - t) r_u, averaged: V(b, t) with its standard error (sample std, ddof 1,
/ sqrt K) and the means of two independent halves (the first K // 2 continuations, the rest).

Spans. A span [s, e) of row b (a token t: [t, t + 1); a macro: its first token to one past its
last) has the advantage
    A* = sum_{u in [s, e)} gamma^(u - s) r_u + gamma^(e - s) V(b, e) - V(b, s),
r_u the rewards of the row's own tokens; for a token A*_t = r_t + gamma V(s_{t+1}) - V(s_t).
Its standard error is sqrt(se(V(b, s))^2 + gamma^(2 (e - s)) se(V(b, e))^2): the two states are
distinct and their continuations drawn with distinct keys. Its halves use the halves' values.
States are evaluated once however many spans share them (a boundary is the end of one macro and
the start of the next).

reward_fn(prompt_ids [N, P], prompt_mask [N, P], response_ids [N, R], response_mask [N, R])
-> rewards [N, R] float: the run's per-token reward r_u of each response token (padding is
ignored), e.g. the KL terms -beta (logp(a_u) - logp_ref(a_u)) on every token and the clipped
reward-model score (or the gold, where a task has one) on the last one. r_u must depend on the
prompt and tokens 0..u only (the state's value is an expectation over what follows it). The
responses must have the run's response budget R: continuations stop after EOS or at R. With
`reward_rows=True` it is also given `rows=` `[N]` int, the batch row each scored response is
(or continues), to read that row's own data (e.g. the document a gold scores against).

Keys. `continuation_keys(key, M, K)` = `jax.random.split(key, (M, K))`: continuation j of
state i (states in the order of `StateValues.rows / positions`) draws its token at response
position u with `fold_in(keys[i, j], u)`, whatever the chunking.

Public (arrays `[M]` per state, `[S]` per span):
- `valid_lengths(response_mask [B, R]) -> [B]`
- `segment_spans(segment_ids [B, R], response_mask [B, R]) -> (rows, starts, ends)` `[S]` each:
  one span per macro of a termination's segment ids.
- `continuation_keys(key, num_states, num_continuations) -> [M, K]` typed keys
- `continue_states(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows,
  positions, keys [M, K], *, temperature, top_k, top_p, eos_id, pad_id, decode_slots)
  -> SampleOutput` `[M * K, R]` (row i * K + j: continuation j of state i)
- `state_values(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows,
  positions, *, reward_fn, key, num_continuations, temperature, top_k=0, top_p=1.0, eos_id,
  pad_id, gamma=1.0, chunk_states=None, decode_slots=None, reward_rows=False) -> StateValues`
- `span_advantages(states, start_state, end_state, span_rewards, lengths, gamma)
  -> (value, se, halves)` (pure numpy)
- `advantage_truth(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows,
  starts, ends, *, <the keywords of state_values>) -> AdvantageTruth`
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.rollout import SampleOutput, continue_responses


class StateValues(NamedTuple):
    """Monte Carlo values of M states (numpy): rows, positions `[M]` int (state (b, t)); mean,
    se `[M]`; halves `[M, 2]` (means of continuations [0, K // 2) and [K // 2, K)); returns
    `[M, K]` (each continuation's discounted return from the state on)."""

    rows: np.ndarray
    positions: np.ndarray
    mean: np.ndarray
    se: np.ndarray
    halves: np.ndarray
    returns: np.ndarray


class AdvantageTruth(NamedTuple):
    """Ground-truth advantages of S spans (numpy): rows, starts, ends `[S]` int (span [s, e) of
    row b); value, se `[S]`; halves `[S, 2]`; rewards `[S]` (sum_{u in [s, e)} gamma^(u - s) r_u
    of the row's own tokens); start_state, end_state `[S]` (indices into `states`); states: the
    `StateValues` they were computed from."""

    rows: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    value: np.ndarray
    se: np.ndarray
    halves: np.ndarray
    rewards: np.ndarray
    start_state: np.ndarray
    end_state: np.ndarray
    states: StateValues


def valid_lengths(response_mask) -> np.ndarray:
    """The number of leading valid tokens of each response row, `[B]` int."""
    mask = np.asarray(response_mask)
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {mask.shape}")
    return np.cumprod(mask != 0, axis=1).sum(axis=1)


def segment_spans(segment_ids, response_mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One span [start, end) per macro of segment ids `[B, R]` (contiguous, from 0 on each row,
    as `macro.termination` gives them) over the valid tokens: rows, starts, ends `[S]`, in row
    then position order."""
    seg = np.asarray(segment_ids)
    lengths = valid_lengths(response_mask)
    if seg.shape != np.asarray(response_mask).shape:
        raise ValueError(f"segment_ids {seg.shape} and response_mask {np.asarray(response_mask).shape} "
                         "must have the same shape")
    positions = np.arange(seg.shape[1])
    valid = positions[None, :] < lengths[:, None]
    previous = np.concatenate([np.full((seg.shape[0], 1), -1), seg[:, :-1]], axis=1)
    first = valid & (seg != previous)
    rows, starts = np.nonzero(first)
    following = np.r_[starts[1:], 0]
    same_row = np.r_[rows[1:] == rows[:-1], False]
    ends = np.where(same_row, following, lengths[rows])
    return rows, starts, ends


def continuation_keys(key, num_states: int, num_continuations: int) -> jax.Array:
    """Typed keys `[M, K]`: continuation j of state i is drawn with `keys[i, j]`."""
    if not isinstance(key, jax.Array) or not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape:
        raise ValueError("key must be one typed key (jax.random.key(seed)), got "
                         f"{type(key).__name__} of shape {getattr(key, 'shape', None)}")
    return jax.random.split(key, (num_states, num_continuations))


def continue_states(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows, positions,
                    keys, *, temperature, top_k: int = 0, top_p=1.0, eos_id: int | Sequence[int],
                    pad_id: int, decode_slots: int | None = None) -> SampleOutput:
    """K continuations of each state (rows[i], positions[i]) with keys `[M, K]`: one
    `continue_responses` call over the M states' rows, prefill shared by a state's K. Returns
    full responses `[M * K, R]` (row i * K + j: continuation j of state i; the prefix, then the
    sampled tokens)."""
    rows = jnp.asarray(rows, jnp.int32)
    num_continuations = keys.shape[1]
    return continue_responses(
        model, params, jnp.asarray(prompt_ids)[rows], jnp.asarray(prompt_mask)[rows],
        jnp.asarray(response_ids)[rows], jnp.asarray(response_mask)[rows], jnp.asarray(positions, jnp.int32),
        row_keys=keys.reshape(-1), num_samples=num_continuations, temperature=temperature, top_k=top_k,
        top_p=top_p, eos_id=eos_id, pad_id=pad_id, decode_slots=decode_slots)


@jax.jit
def _discounted_returns(rewards, mask, positions, gamma):
    """sum_{u >= t} gamma^(u - t) r_u over valid tokens, `[N]`, for rewards, mask `[N, R]` and
    t = positions `[N]`."""
    offset = jnp.arange(rewards.shape[1])[None, :] - positions[:, None]
    live = (mask != 0) & (offset >= 0)
    return jnp.where(live, rewards * gamma ** jnp.maximum(offset, 0).astype(rewards.dtype), 0.0).sum(axis=1)


def _rewards(reward_fn: Callable, prompt_ids, prompt_mask, response_ids, response_mask, rows=None) -> jax.Array:
    extra = {} if rows is None else {"rows": np.asarray(rows, np.int64)}
    rewards = jnp.asarray(reward_fn(prompt_ids, prompt_mask, response_ids, response_mask, **extra), jnp.float32)
    if rewards.shape != response_ids.shape:
        raise ValueError(f"reward_fn must return one reward per response token, shape {tuple(response_ids.shape)}; "
                         f"got {tuple(rewards.shape)}")
    return rewards


def _check_num_continuations(k) -> int:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 2:
        raise ValueError(f"num_continuations must be an int >= 2 (a standard error and two halves need two "
                         f"continuations per state), got {k!r}")
    return int(k)


def _check_gamma(gamma) -> float:
    if not isinstance(gamma, numbers.Real) or not 0 < gamma <= 1:
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")
    return float(gamma)


def _check_chunk(chunk_states, num_states: int) -> int:
    if chunk_states is None:
        return num_states
    if not isinstance(chunk_states, (int, np.integer)) or isinstance(chunk_states, bool) or chunk_states < 1:
        raise ValueError(f"chunk_states must be None or a positive int, got {chunk_states!r}")
    return min(int(chunk_states), num_states)


def _as_index(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D int array, got shape {a.shape} and dtype {a.dtype}")
    if a.size == 0:
        raise ValueError(f"{name} is empty: no states to score")
    return a.astype(np.int64)


def _check_rows(rows: np.ndarray, batch: int) -> None:
    bad = np.flatnonzero((rows < 0) | (rows >= batch))
    if bad.size:
        raise ValueError(f"rows must index the {batch} responses; entries {bad[:8].tolist()} are "
                         f"{rows[bad[:8]].tolist()}")


def state_values(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows, positions, *,
                 reward_fn: Callable, key, num_continuations: int, temperature, top_k: int = 0, top_p=1.0,
                 eos_id: int | Sequence[int], pad_id: int, gamma: float = 1.0, chunk_states: int | None = None,
                 decode_slots: int | None = None, reward_rows: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> StateValues:
    """Monte Carlo values of the states (rows[i], positions[i]) `[M]`, K = `num_continuations`
    each (a state listed twice is valued twice, with other keys), `chunk_states` states per
    `continue_responses` call (None: all at once; the last chunk is filled with terminal states
    so that every chunk runs the same program). States are chunked latest position first, so
    that a chunk's decode loop stops at its longest remaining budget (each state keeps its own
    keys: the values do not depend on the order). `progress(states valued, M)` is called after
    every chunk."""
    k = _check_num_continuations(num_continuations)
    gamma = _check_gamma(gamma)
    rows, positions = _as_index(rows, "rows"), _as_index(positions, "positions")
    if rows.shape != positions.shape:
        raise ValueError(f"rows {rows.shape} and positions {positions.shape} must have the same shape")
    response_ids, response_mask = jnp.asarray(response_ids), jnp.asarray(response_mask)
    lengths = valid_lengths(response_mask)
    _check_rows(rows, lengths.size)
    bad = np.flatnonzero((positions < 0) | (positions > lengths[rows]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"state positions must lie in [0, valid length] of their response; {bad.size} do not, e.g. "
                         f"row {rows[i]} position {positions[i]} (valid length {lengths[rows[i]]})")
    keys = continuation_keys(key, rows.size, k)
    chunk = _check_chunk(chunk_states, rows.size)
    filler = int(np.argmax(lengths))
    order = np.argsort(-positions, kind="stable")
    returns = []
    for lo in range(0, rows.size, chunk):
        size = min(chunk, rows.size - lo)
        fill = chunk - size
        picked = order[lo:lo + size]
        chunk_rows = np.r_[rows[picked], np.full(fill, filler)]
        chunk_positions = np.r_[positions[picked], np.full(fill, lengths[filler])]
        chunk_keys = keys[picked]
        if fill:
            chunk_keys = jnp.concatenate([chunk_keys, jnp.repeat(keys[:1], fill, axis=0)], axis=0)
        out = continue_states(model, params, prompt_ids, prompt_mask, response_ids, response_mask, chunk_rows,
                              chunk_positions, chunk_keys, temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_id=eos_id, pad_id=pad_id, decode_slots=decode_slots)
        rep = jnp.asarray(np.repeat(chunk_rows, k), jnp.int32)
        rewards = _rewards(reward_fn, jnp.asarray(prompt_ids)[rep], jnp.asarray(prompt_mask)[rep], out.tokens,
                           out.mask, rows=np.repeat(chunk_rows, k) if reward_rows else None)
        chunk_returns = _discounted_returns(rewards, out.mask, jnp.asarray(np.repeat(chunk_positions, k)),
                                            jnp.float32(gamma))
        returns.append(np.asarray(chunk_returns, np.float64).reshape(chunk, k)[:size])
        if progress is not None:
            progress(lo + size, rows.size)
    return values_from_returns(rows, positions, np.concatenate(returns)[np.argsort(order, kind="stable")])


def values_from_returns(rows, positions, returns) -> StateValues:
    """The `StateValues` of states (rows, positions) `[M]` from their continuations' discounted
    returns `[M, K]` (float64): mean, standard error (ddof 1, / sqrt K) and the halves' means."""
    if not np.all(np.isfinite(returns)):
        raise ValueError("reward_fn gave non-finite rewards to the continuations of states "
                         f"{np.flatnonzero(~np.isfinite(returns).all(axis=1))[:8].tolist()}")
    k = returns.shape[1]
    half = k // 2
    return StateValues(rows=rows, positions=positions, mean=returns.mean(axis=1),
                       se=returns.std(axis=1, ddof=1) / math.sqrt(k),
                       halves=np.stack([returns[:, :half].mean(axis=1), returns[:, half:].mean(axis=1)], axis=1),
                       returns=returns)


def span_advantages(states: StateValues, start_state, end_state, span_rewards, lengths,
                    gamma: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A* `[S]`, its standard error `[S]` and the halves' A* `[S, 2]` of spans whose start and
    end states are `states` entries start_state, end_state `[S]`, with own discounted rewards
    `span_rewards [S]` over `lengths [S]` = e - s tokens."""
    start_state, end_state = np.asarray(start_state), np.asarray(end_state)
    discount = float(gamma) ** np.asarray(lengths, np.float64)
    span_rewards = np.asarray(span_rewards, np.float64)
    value = span_rewards + discount * states.mean[end_state] - states.mean[start_state]
    se = np.sqrt(states.se[start_state] ** 2 + (discount * states.se[end_state]) ** 2)
    halves = (span_rewards[:, None] + discount[:, None] * states.halves[end_state]
              - states.halves[start_state])
    return value, se, halves


def advantage_truth(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows, starts, ends, *,
                    reward_fn: Callable, key, num_continuations: int, temperature, top_k: int = 0, top_p=1.0,
                    eos_id: int | Sequence[int], pad_id: int, gamma: float = 1.0, chunk_states: int | None = None,
                    decode_slots: int | None = None, reward_rows: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> AdvantageTruth:
    """Ground-truth A* of the spans [starts[i], ends[i]) of response rows[i] (`[S]` each; see
    the module docstring): the distinct start and end states valued by `state_values` (one
    `key`), the row's own rewards from `reward_fn` on the sampled responses."""
    _check_num_continuations(num_continuations)
    gamma = _check_gamma(gamma)
    rows, starts, ends = (_as_index(x, name) for x, name in ((rows, "rows"), (starts, "starts"), (ends, "ends")))
    if not rows.shape == starts.shape == ends.shape:
        raise ValueError(f"rows {rows.shape}, starts {starts.shape} and ends {ends.shape} must have the same shape")
    response_ids, response_mask = jnp.asarray(response_ids), jnp.asarray(response_mask)
    lengths = valid_lengths(response_mask)
    _check_rows(rows, lengths.size)
    bad = np.flatnonzero((starts < 0) | (ends <= starts) | (ends > lengths[rows]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"spans [start, end) must be non-empty and lie inside their response; {bad.size} do not, "
                         f"e.g. row {rows[i]} span [{starts[i]}, {ends[i]}) (valid length {lengths[rows[i]]})")
    width = response_ids.shape[1] + 1
    codes, inverse = np.unique(np.r_[rows * width + starts, rows * width + ends], return_inverse=True)
    inverse = inverse.reshape(-1)
    states = state_values(model, params, prompt_ids, prompt_mask, response_ids, response_mask, codes // width,
                          codes % width, reward_fn=reward_fn, key=key, num_continuations=num_continuations,
                          temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id,
                          gamma=gamma, chunk_states=chunk_states, decode_slots=decode_slots,
                          reward_rows=reward_rows, progress=progress)
    own = np.asarray(_rewards(reward_fn, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), response_ids,
                              response_mask, rows=np.arange(lengths.size) if reward_rows else None),
                     np.float64)
    span_rewards = _span_rewards(own, rows, starts, ends, gamma)
    if not np.all(np.isfinite(span_rewards)):
        raise ValueError("reward_fn gave non-finite rewards to the tokens of spans "
                         f"{np.flatnonzero(~np.isfinite(span_rewards))[:8].tolist()}")
    start_state, end_state = inverse[:rows.size], inverse[rows.size:]
    value, se, halves = span_advantages(states, start_state, end_state, span_rewards, ends - starts, gamma)
    return AdvantageTruth(rows=rows, starts=starts, ends=ends, value=value, se=se, halves=halves,
                          rewards=span_rewards, start_state=start_state, end_state=end_state, states=states)


def _span_rewards(rewards: np.ndarray, rows, starts, ends, gamma: float) -> np.ndarray:
    """sum_{u in [s, e)} gamma^(u - s) rewards[b, u] per span, `[S]`."""
    offset = np.arange(rewards.shape[1])[None, :] - starts[:, None]
    inside = (offset >= 0) & (np.arange(rewards.shape[1])[None, :] < ends[:, None])
    return np.where(inside, rewards[rows] * gamma ** np.maximum(offset, 0), 0.0).sum(axis=1)

