"""Generalised advantage estimation over macro actions (and over tokens).

A macro tau covers the tokens omega_tau of one segment id. Its value is
V_tau = sum_i sigma_i V(s_i) and its reward R_tau is either the same sigma-weighted sum of the
token rewards ("weighted", what the official code does) or their plain sum ("sum", the paper).
GAE then runs over macro steps,

    delta_tau = R_tau + gamma V_{tau+1} - V_tau        (V after the last macro = 0)
    A_tau     = delta_tau + gamma lam A_{tau+1}
    G_tau     = A_tau + V_tau,

and every token of a macro carries its macro's A_tau and G_tau. Value weightings sigma:

- "equal":    1 / |omega| on every token;
- "unit":     1 on the macro's last token;
- "position": proportional to 1 / (|omega| - i) for the 0-based position i, normalised to sum 1,
              so the last token weighs most (the paper's position-decayed weighting);
- "first":    1 on the macro's first token, the value of the state where the macro starts
              (the semi-MDP option value).

With one token per macro every weighting gives sigma = 1 and the result equals token-level GAE
exactly.

A multi-turn trajectory's action mask has holes: the observation spans between turns (tool
output, a user's reply) are not the policy's. Segment ids then cover the action tokens only,
rising by 0 or 1 from one action token to the next; the holes contribute nothing and take no
GAE step (the recursion runs over the macros, and token-level GAE over the action tokens, in
order), so inserting observation spans anywhere between segments leaves every action token's
advantage and return unchanged. Without holes every result is what it was, bit for bit. The computation is O(B * T): segment sums over flattened (row, macro) ids, a reverse
loop over the macro steps in use (`lax.fori_loop` with a data-dependent trip count, so about
T / n steps rather than T), and a gather back to tokens. Advantages and returns are targets:
no gradient flows through them.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.macro.checks import (
    check_choice,
    check_mask,
    check_rank,
    check_same_shape,
    is_concrete,
)

VALUE_WEIGHTINGS = ("equal", "unit", "position", "first")
REWARD_AGGREGATIONS = ("weighted", "sum")


def macro_gae(values, rewards, response_mask, segment_ids, *, gamma=1.0, lam=0.95,
              value_weighting="equal", reward_aggregation="weighted"):
    """Macro-action GAE.

    Args:
      values: float `[B, T]`, the critic's value of the state in which response token t is chosen.
      rewards: float `[B, T]`, the reward for token t (KL penalty, plus the score on the last
        valid token).
      response_mask: `[B, T]` 0/1 mask of the action tokens: left-aligned for one response; a
        multi-turn trajectory's has holes (observation spans, which take no step).
      segment_ids: int `[B, T]` macro index of each action token (see `termination`): 0 at the
        first, rising by 0 or 1 from one action token to the next.
      gamma, lam: discount and GAE lambda in [0, 1]; Python floats or (traced) scalars.
      value_weighting: one of `VALUE_WEIGHTINGS`.
      reward_aggregation: one of `REWARD_AGGREGATIONS`.

    Returns:
      `(advantages, returns)`, float `[B, T]`, zero on padding; targets, with no gradient
      flowing back into `values` or `rewards`.
    """
    check_choice(value_weighting, VALUE_WEIGHTINGS, "value_weighting")
    check_choice(reward_aggregation, REWARD_AGGREGATIONS, "reward_aggregation")
    _check_inputs(values, rewards, response_mask, gamma, lam)
    check_same_shape(values, "values", segment_ids=segment_ids)
    _check_segment_ids(segment_ids, response_mask)

    return _macro_gae(values, rewards, response_mask, segment_ids, gamma, lam,
                      value_weighting=value_weighting, reward_aggregation=reward_aggregation)


def gae(values, rewards, response_mask, *, gamma=1.0, lam=0.95):
    """Token-level GAE: `(advantages, returns)` float `[B, T]`, zero on padding.

    The value after the last valid token is 0. Arguments as in `macro_gae`; this is `macro_gae`
    with one action token per macro (run through the same code, so the two agree bit for bit):
    a token's next state is the next action token's, across any observation span.
    """
    _check_inputs(values, rewards, response_mask, gamma, lam)
    return _macro_gae(values, rewards, response_mask, action_ranks(response_mask), gamma, lam,
                      value_weighting="equal", reward_aggregation="weighted")


def action_ranks(response_mask):
    """int32 `[B, T]`: each valid token's index among its row's valid tokens (its position,
    for a left-aligned mask), 0 elsewhere: the segment ids of one token per macro."""
    valid = jnp.asarray(response_mask) != 0
    return jnp.where(valid, jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)


def whiten(x, mask, *, shift_mean=True):
    """Masked whitening over all valid entries: `(x - mean) / sqrt(var + 1e-8)`.

    The variance is the unbiased masked variance (TRL's `masked_whiten`); with
    `shift_mean=False` the mean is added back. Entries outside the mask are 0, and an all-zero
    mask gives all zeros.

    Args:
      x: float `[B, T]`.
      mask: `[B, T]` 0/1 mask (any alignment).
    """
    check_rank(x, 2, "x")
    check_same_shape(x, "x", mask=mask)
    check_mask(mask, "mask", left_aligned=False)
    x = jnp.asarray(x, _float_dtype(x))
    valid = jnp.asarray(mask) != 0
    count = jnp.sum(valid).astype(x.dtype)
    mean = jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(count, 1)
    centered = jnp.where(valid, x - mean, 0)
    variance = jnp.sum(centered * centered) / jnp.maximum(count - 1, 1)
    whitened = centered * jax.lax.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(valid, whitened, 0)


@functools.partial(jax.jit, static_argnames=("value_weighting", "reward_aggregation"))
def _macro_gae(values, rewards, response_mask, segment_ids, gamma, lam, value_weighting,
               reward_aggregation):
    dtype = _float_dtype(values, rewards)
    valid = jnp.asarray(response_mask) != 0
    # Targets carry no gradient (as in every PPO implementation); this also keeps the
    # data-dependent loop below out of reverse-mode differentiation.
    values = jax.lax.stop_gradient(jnp.asarray(values, dtype))
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, dtype))
    batch, width = valid.shape
    positions = jnp.arange(width, dtype=jnp.int32)
    # A padded position t (or a hole) parks in slot t, so padding does not pile onto one slot,
    # which would serialise the scatter-adds on that one address; it adds zeros (every sum
    # below masks it), so sharing a slot with a real macro (after a hole) changes nothing.
    ids = jnp.where(valid, segment_ids, positions).astype(jnp.int32)
    # Macro slots are laid out slot-major ([T, B] flattened): the reverse loop then walks the
    # leading axis, and neither its input nor its output needs a transpose.
    slots = (ids * batch + jnp.arange(batch, dtype=jnp.int32)[:, None]).reshape(-1)

    def per_macro(x):
        """Sum a token quantity `[B, T]` over each macro -> `[T, B]` (slot k = macro k)."""
        x = jnp.where(valid, x, 0).reshape(-1)
        return jax.ops.segment_sum(x, slots, num_segments=batch * width).reshape(width, batch)

    def per_token(x):
        """Read each token's macro slot from `[T, B]` -> `[B, T]`."""
        return jnp.take(x.reshape(-1), slots, mode="clip").reshape(batch, width)

    weights, normalised = _value_weights(value_weighting, ids, valid, positions, dtype, slots,
                                         per_token)
    if normalised:
        total = per_macro(weights)
        total = jnp.where(total > 0, total, 1)
    else:
        total = 1
    macro_values = per_macro(weights * values) / total
    if reward_aggregation == "weighted":
        macro_rewards = per_macro(weights * rewards) / total
    else:
        macro_rewards = per_macro(rewards)

    next_values = jnp.concatenate([macro_values[1:], jnp.zeros_like(macro_values[:1])])
    deltas = macro_rewards + gamma * next_values - macro_values
    decay = jnp.asarray(gamma * lam, dtype)
    # Slots past the batch's last macro hold delta = 0 and so A = 0: the reverse recurrence only
    # walks the macro steps in use (about T / n of them).
    num_steps = jnp.max(jnp.where(valid, ids, -1)) + 1

    def step(k, carry):
        next_advantage, advantages = carry
        slot = num_steps - 1 - k
        advantage = jax.lax.dynamic_index_in_dim(deltas, slot, keepdims=False)
        advantage = advantage + decay * next_advantage
        return advantage, jax.lax.dynamic_update_index_in_dim(advantages, advantage, slot, 0)

    _, macro_advantages = jax.lax.fori_loop(0, num_steps, step,
                                            (jnp.zeros_like(deltas[0]), jnp.zeros_like(deltas)))
    advantages = jnp.where(valid, per_token(macro_advantages), 0)
    returns = jnp.where(valid, per_token(macro_advantages + macro_values), 0)
    return advantages, returns


def _value_weights(weighting, ids, valid, positions, dtype, slots, per_token):
    """Unnormalised per-token weights `[B, T]` and whether they still need normalising per macro.

    "unit" and "first" put weight 1 on exactly one token of each macro, so they are already
    normalised; "equal" and "position" are divided by their per-macro sum. A token's neighbours
    are the action tokens before and after it, across any hole.
    """
    if weighting == "equal":
        return valid.astype(dtype), True
    if weighting == "first":
        # The id of the previous action token: ids rise over the action tokens.
        seen = jax.lax.cummax(jnp.where(valid, ids, -1), axis=1)
        previous = jnp.concatenate([jnp.full_like(ids[:, :1], -1), seen[:, :-1]], axis=1)
        return (valid & (ids != previous)).astype(dtype), False
    # The id of the next action token (-1 after the last one).
    width = ids.shape[1]
    ahead = jax.lax.cummin(jnp.where(valid, ids, width), axis=1, reverse=True)
    following = jnp.concatenate([ahead[:, 1:], jnp.full_like(ids[:, :1], width)], axis=1)
    is_last = valid & (ids != following)
    if weighting == "unit":
        return is_last.astype(dtype), False
    # position: sigma_i proportional to 1 / (|omega| - i), the number of action tokens from i
    # to the macro's end: its last token's rank minus i's plus one.
    batch = ids.shape[0]
    ranks = action_ranks(valid)
    last_ranks = jax.ops.segment_max(jnp.where(valid, ranks, -1).reshape(-1), slots,
                                     num_segments=batch * width).reshape(width, batch)
    to_end = per_token(last_ranks) - ranks + 1
    return jnp.where(valid, 1 / jnp.maximum(to_end, 1).astype(dtype), 0), True


def _float_dtype(*arrays):
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _check_inputs(values, rewards, response_mask, gamma, lam):
    check_rank(values, 2, "values")
    check_same_shape(values, "values", rewards=rewards, response_mask=response_mask)
    check_mask(response_mask, "response_mask", left_aligned=False)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if is_concrete(value):
            array = np.asarray(value)
            if array.ndim != 0 or not 0 <= float(array) <= 1:
                raise ValueError(f"{name} must be a scalar in [0, 1], got {value!r}")


def _check_segment_ids(segment_ids, response_mask):
    dtype = segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"segment_ids must be integers, got dtype {dtype}")
    # Host arrays are checked; device arrays (typically straight from `termination`, which
    # guarantees contiguous ids) are not, since reading them back would stall the dispatch.
    if isinstance(segment_ids, jax.Array) or not is_concrete(response_mask):
        return
    ids = np.asarray(segment_ids).astype(np.int64)
    valid = np.asarray(response_mask) != 0
    for row_ids, row_valid in zip(ids, valid):
        on_actions = row_ids[row_valid]
        steps = np.diff(on_actions)
        if len(on_actions) and (on_actions[0] != 0 or np.any((steps != 0) & (steps != 1))):
            raise ValueError(
                "segment_ids must start at 0 and rise by 0 or 1 from one action token to the "
                "next within each response (contiguous macros)")
