"""Ground-truth state values on multi-turn trajectories (`rollout.turns.Trajectory`): the truth of
the advantage-quality probe (`credit.turn_probe`) when the policy plays an environment.

States. A trajectory row b (prompt `[P]`, then T columns of ACTION, OBSERVATION or PAD) with L_b
action tokens has the states (b, a), a in [0, L_b]: the prompt and every column before its a-th
action token (observations included), before that token is sampled; (b, L_b) is terminal
(value 0: after the last action token the episode is over, done, failed or out of budget, and
no observation follows). Observation tokens are not actions and carry no state of their own: the
state after a turn's last action token is the next action token's, after the observation.
`action_columns` maps action ranks to columns; `compress` gathers `[B, T]` arrays at them, which
gives the layout the single-response scorer reads (`credit.truth.span_advantages`,
`credit.probe_scores.score_probe`): left-aligned action tokens, one discount step per action token as
the trajectory GAE takes them.

Continuations. From state (b, a) at column t, `continue_trajectories` plays the episode on as
the run does (`rollout.turns.run_turns`): a fresh environment episode of the row's task row and
seed, replayed through the turns completed before t (the callback's observations and rewards
are checked against the trajectory's), then the policy samples the rest of the current turn
(its actions so far count against `max_turn_tokens`), the environment steps the whole turn, and
the turns go on until done, failed, `max_turns` or the budget of T columns: the engine's own
turn rules (`rollout.turns.end_turns`), not a copy of them. Column u is drawn
with `fold_in(key, u)`, as `run_turns` draws it, so the trajectory's own row key continues it
into itself from any state. Each turn is sampled by `engine.continue_responses` after the
prompt and the whole history (one prefill of every live row per turn), so, as for
`turns.reprefill_turns`, an observation may not end with an end-of-turn id (ValueError).

Values. K continuations per state; each is rewarded by the caller's `reward_fn` (the run's
per-token rewards of a trajectory: the environment's turn rewards, KL terms) and its return
from a on is sum over its action tokens u >= t of gamma^(rank(u) - a) r_u; V(b, a) is their mean
with its standard error and two halves (`credit.truth.StateValues`). Terminal states are
not continued: value 0, standard error 0.

make_step_turns(task_rows, seeds) -> step_turns: a fresh episode per row (the task's
`turn_callback`), step_turns as `rollout.turns.StepTurns`.

reward_fn(prompt_ids [N, P], prompt_mask [N, P], trajectory: dict of `[N, T]` arrays tokens,
kinds, turn_ids, logprobs, entropy, turn_rewards and `[N]` truncated, failed) -> rewards
`[N, T]` (read at action columns). r_u must depend on the prompt and columns 0..u only.

Public:
- `action_columns(kinds [B, T]) -> (columns [B, T] int, lengths [B] int)`
- `compress(x [B, T], columns, lengths) -> [B, T]` (0 past each row's length)
- `terminal_columns(kinds [B, T]) -> [B]`
- `continue_trajectories(model, params, prompt_ids, prompt_mask, trajectory, rows, positions,
  keys [M, K], *, make_step_turns, task_rows, seeds, max_turns, max_turn_tokens, end_of_turn,
  temperature, top_k, top_p, pad_id) -> Trajectory` `[M * K, T]`
- `state_values(model, params, prompt_ids, prompt_mask, trajectory, rows, positions, *,
  reward_fn, key, num_continuations, gamma, chunk_states, <the keywords of
  continue_trajectories>) -> StateValues`
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from marl_jax.credit.truth import StateValues, continuation_keys, values_from_returns
from marl_jax.rollout import engine
from marl_jax.rollout.turns import ACTION, OBSERVATION, PAD, Trajectory, end_turns

TRAJECTORY_ARRAYS = ("tokens", "kinds", "turn_ids", "logprobs", "entropy", "turn_rewards")


def action_columns(kinds) -> tuple[np.ndarray, np.ndarray]:
    """(columns `[B, T]`: the column of each row's a-th action token at [b, a], T past its
    last; lengths `[B]`: its action tokens)."""
    kinds = np.asarray(kinds)
    actions = kinds == ACTION
    width = kinds.shape[1]
    order = np.argsort(~actions, axis=1, kind="stable")
    lengths = actions.sum(axis=1)
    columns = np.where(np.arange(width)[None, :] < lengths[:, None], order, width)
    return columns.astype(np.int64), lengths.astype(np.int64)


def compress(x, columns, lengths) -> np.ndarray:
    """`x [B, T]` at each row's action columns, left-aligned `[B, T]`, 0 past the row's
    action tokens."""
    x = np.asarray(x)
    valid = np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None]
    picked = np.take_along_axis(x, np.minimum(columns, x.shape[1] - 1), axis=1)
    return np.where(valid, picked, np.zeros((), x.dtype))


def terminal_columns(kinds) -> np.ndarray:
    """`[B]` one past each row's last action token (every later column is PAD)."""
    kinds = np.asarray(kinds)
    positions = np.arange(kinds.shape[1])
    return np.where(kinds != PAD, positions + 1, 0).max(axis=1)


def _arrays(trajectory) -> dict:
    if isinstance(trajectory, dict):
        return {k: np.asarray(trajectory[k]) for k in TRAJECTORY_ARRAYS}
    return {k: np.asarray(getattr(trajectory, k)) for k in TRAJECTORY_ARRAYS}


def _replay(step_turns, arrays: dict, sources: np.ndarray, starts: np.ndarray) -> None:
    """Steps row i of `step_turns` (a fresh episode of row `sources[i]`'s task row) through the
    turns of trajectory row `sources[i]` completed before column `starts[i]`, checking that
    the environment answers as it answered the trajectory."""
    tokens, kinds, turn_ids = arrays["tokens"], arrays["kinds"], arrays["turn_ids"]
    current = turn_ids[sources, starts]
    for turn in range(int(current.max(initial=0))):
        rows = np.flatnonzero(current > turn)
        actions = [tokens[sources[i]][(kinds[sources[i]] == ACTION) & (turn_ids[sources[i]] == turn)]
                   for i in rows]
        observations, rewards, done, failed = step_turns(rows, actions)
        for j, i in enumerate(rows):
            b = sources[i]
            columns = np.flatnonzero((kinds[b] == ACTION) & (turn_ids[b] == turn))
            expected = tokens[b][(kinds[b] == OBSERVATION) & (turn_ids[b] == turn)]
            got = np.asarray([] if observations[j] is None else observations[j])
            if (done[j] or failed[j] or not np.array_equal(got, expected)
                    or np.float32(rewards[j]) != np.float32(arrays["turn_rewards"][b, columns[-1]])):
                raise ValueError(f"the environment does not replay trajectory row {b}: its turn "
                                 f"{turn} answers otherwise than it did (a seed or state outside "
                                 "the task row?)")


def continue_trajectories(model, params, prompt_ids, prompt_mask, trajectory, rows, positions, keys, *,
                          make_step_turns: Callable, task_rows: Sequence, seeds: Sequence, max_turns: int,
                          max_turn_tokens: int, end_of_turn: int | Sequence[int], temperature, top_k: int = 0,
                          top_p=1.0, pad_id: int) -> Trajectory:
    """K continuations of each non-terminal state (rows[i], positions[i]) `[M]` (action ranks)
    of `trajectory` (a `Trajectory` or its arrays, `[B, T]`), keys `[M, K]` (see the module).
    Returns the continued trajectories `[M * K, T]` (row i * K + j: continuation j of state i):
    the columns before the state copied from its row, then the played columns; num_turns,
    truncated and failed are the continued episode's; prefill_tokens counts every turn's
    prefill of prompt and history."""
    arrays = _arrays(trajectory)
    columns, lengths = action_columns(arrays["kinds"])
    rows, positions = np.asarray(rows, np.int64), np.asarray(positions, np.int64)
    if np.any(positions >= lengths[rows]) or np.any(positions < 0):
        raise ValueError("continue_trajectories continues non-terminal states: positions must lie in "
                         "[0, action tokens) of their rows")
    k = keys.shape[1]
    sources = np.repeat(rows, k)
    starts = columns[sources, np.repeat(positions, k)]
    n, width = sources.size, arrays["kinds"].shape[1]
    eos = np.atleast_1d(np.asarray(end_of_turn))
    before = np.arange(width)[None, :] < starts[:, None]
    out = {name: np.where(before, a[sources], np.zeros((), a.dtype)) for name, a in arrays.items()}
    out["tokens"] = np.where(before, out["tokens"], pad_id).astype(np.int32)
    step_turns = make_step_turns([task_rows[b] for b in sources], [seeds[b] for b in sources])
    _replay(step_turns, arrays, sources, starts)
    turn = arrays["turn_ids"][sources, starts].astype(np.int64)
    # Actions of the current turn already taken (they count against its budget).
    taken = ((arrays["kinds"][sources] == ACTION) & before & (arrays["turn_ids"][sources] == turn[:, None])).sum(1)
    cursor = starts.copy()
    live = np.ones(n, bool)
    truncated, failed = np.zeros(n, bool), np.zeros(n, bool)
    ids, mask = jnp.asarray(prompt_ids)[sources], jnp.asarray(prompt_mask)[sources]
    row_keys = keys.reshape(-1)
    prompt_tokens = np.asarray(prompt_mask).sum(axis=1)[sources]
    prefill = 0
    while live.any():
        previous = out["tokens"][np.arange(n), np.maximum(cursor - 1, 0)]
        if np.any(live & (cursor > 0) & np.isin(previous, eos)):
            raise ValueError("an observation ends with an end-of-turn id, after which "
                             "continue_responses samples nothing: continuations cannot play this "
                             "environment's chat template")
        sample = engine.continue_responses(
            model, params, ids, mask, jnp.asarray(out["tokens"]), jnp.ones((n, width), jnp.int32),
            jnp.asarray(np.where(live, cursor, width), jnp.int32), row_keys=row_keys, temperature=temperature,
            top_k=top_k, top_p=top_p, eos_id=tuple(int(e) for e in eos), pad_id=pad_id,
            max_new_tokens=max_turn_tokens)
        prefill += int((prompt_tokens + cursor)[live].sum())
        drawn = np.asarray(sample.mask) * (np.arange(width)[None, :] >= cursor[:, None])
        budget = np.minimum(max_turn_tokens - taken, width - cursor)
        count = np.where(live, np.minimum(drawn.sum(axis=1), budget), 0)
        sampled = {name: np.asarray(getattr(sample, name)) for name in ("tokens", "logprobs", "entropy")}
        for i in np.flatnonzero(live):
            at = slice(cursor[i], cursor[i] + count[i])
            for name in sampled:
                out[name][i, at] = sampled[name][i, at]
            out["kinds"][i, at], out["turn_ids"][i, at] = ACTION, turn[i]
        cursor += count
        taken += count
        last = out["tokens"][np.arange(n), np.maximum(cursor - 1, 0)]
        ends = end_turns(step_turns, live, last, taken, turn + 1, cursor,
                         lambda i: out["tokens"][i][(out["kinds"][i] == ACTION) & (out["turn_ids"][i] == turn[i])],
                         eos_ids=eos, turn_tokens=max_turn_tokens, max_turns=max_turns, total=width,
                         vocab_size=model.config.vocab_size)
        truncated |= ends.truncated
        live &= ~ends.ended
        out["turn_rewards"][ends.rows, cursor[ends.rows] - 1] = ends.rewards
        failed[ends.rows] = ends.failed
        for i, obs in ends.observations.items():
            at = slice(cursor[i], cursor[i] + len(obs))
            out["tokens"][i, at], out["kinds"][i, at], out["turn_ids"][i, at] = obs, OBSERVATION, turn[i]
            cursor[i] += len(obs)
            turn[i] += 1
            taken[i] = 0
    for i in range(n):
        out["turn_ids"][i, cursor[i]:] = turn[i]
    num_turns = np.where(out["kinds"] == ACTION, out["turn_ids"] + 1, 0).max(axis=1).astype(np.int32)
    return Trajectory(out["tokens"], out["kinds"], out["turn_ids"], out["logprobs"], out["entropy"],
                      out["turn_rewards"], num_turns, truncated, failed, prefill_tokens=prefill,
                      generated_tokens=int(((out["kinds"] == ACTION) & ~before).sum()))


def discounted_returns(rewards, kinds, starts, ranks, gamma: float) -> np.ndarray:
    """`[N]` sum over the action columns u >= starts[i] of gamma^(rank(u) - ranks[i]) r_u, rank(u)
    the action tokens before column u, for rewards, kinds `[N, T]`."""
    rewards, actions = np.asarray(rewards, np.float64), np.asarray(kinds) == ACTION
    rank = np.cumsum(actions, axis=1) - 1
    live = actions & (np.arange(actions.shape[1])[None, :] >= np.asarray(starts)[:, None])
    offset = np.maximum(rank - np.asarray(ranks)[:, None], 0)
    return np.where(live, rewards * float(gamma) ** offset, 0.0).sum(axis=1)


def state_values(model, params, prompt_ids, prompt_mask, trajectory, rows, positions, *, reward_fn: Callable,
                 key, num_continuations: int, gamma: float = 1.0, chunk_states: int | None = None,
                 progress: Callable[[int, int], None] | None = None, **play) -> StateValues:
    """Monte Carlo values of the states (rows[i], positions[i]) `[M]` (action ranks, terminal
    included) of `trajectory`, K = `num_continuations` each (state i's continuation j drawn with
    `continuation_keys(key, M, K)[i, j]`), `chunk_states` non-terminal states per
    `continue_trajectories` call (the last chunk filled with copies of its first state); `play`:
    the keywords of `continue_trajectories`; `progress(non-terminal states valued, their
    number)` is called after every chunk."""
    k = int(num_continuations)
    if k < 2:
        raise ValueError(f"num_continuations must be an int >= 2, got {num_continuations!r}")
    arrays = _arrays(trajectory)
    _, lengths = action_columns(arrays["kinds"])
    rows, positions = np.asarray(rows, np.int64), np.asarray(positions, np.int64)
    if np.any((positions < 0) | (positions > lengths[rows])):
        raise ValueError("state positions must lie in [0, action tokens] of their rows")
    keys = continuation_keys(key, rows.size, k)
    returns = np.zeros((rows.size, k))
    live = np.flatnonzero(positions < lengths[rows])
    chunk = min(int(chunk_states or live.size), max(live.size, 1))
    for lo in range(0, live.size, chunk):
        part = live[lo:lo + chunk]
        filled = np.r_[part, np.full(chunk - part.size, part[0])]
        out = continue_trajectories(model, params, prompt_ids, prompt_mask, arrays, rows[filled],
                                    positions[filled], keys[jnp.asarray(filled)], **play)
        rep = jnp.asarray(np.repeat(rows[filled], k))
        played = {name: getattr(out, name) for name in (*TRAJECTORY_ARRAYS, "truncated", "failed")}
        rewards = np.asarray(reward_fn(jnp.asarray(prompt_ids)[rep], jnp.asarray(prompt_mask)[rep], played))
        columns, _ = action_columns(arrays["kinds"])
        starts = columns[np.repeat(rows[filled], k), np.repeat(positions[filled], k)]
        got = discounted_returns(rewards, out.kinds, starts, np.repeat(positions[filled], k), gamma)
        returns[part] = got.reshape(chunk, k)[:part.size]
        if progress is not None:
            progress(lo + part.size, live.size)
    return values_from_returns(rows, positions, returns)
