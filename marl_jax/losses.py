"""Losses for SFT, reward modelling and (MA-)PPO, plus the KL-shaped PPO reward.

Every loss returns `(scalar_loss, metrics)` where metrics is a dict of float32 scalars. Means are
masked; an all-zero mask gives 0, never NaN. Metric names follow TRL where TRL has one (approxkl
is TRL's 0.5 * mean((logp - old_logp)^2), clipfrac the fraction of tokens where the clipped
term is the active one).
"""
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

POLICY_AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum")
KL_ESTIMATORS = ("k1", "k3")
ROLLOUT_CORRECTIONS = ("none", "token", "sequence", "macro", "turn")
RATIO_LEVELS = ("token", "macro", "sequence")
RATIO_FORMS = ("product", "geometric")
# |s_u| bound on a unit's log-ratio before exp (verl clamps at the same +-20): exp(20) = 4.9e8
# is far outside every clip range, and a product over a long macro or a whole response cannot
# reach float32's overflow at 88.7 nats.
LOG_RATIO_BOUND = 20.0


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, *, cliprange=0.2,
                    aggregation="token_mean", is_weights=None, ratio_level="token",
                    ratio_form="product", segment_ids=None, cliprange_low=None,
                    cliprange_high=None, dual_clip=None):
    """PPO's clipped surrogate, with the ratio of a token, a macro action or a whole response.

    The unit u whose ratio is clipped (`ratio_level`): each valid token ("token": PPO, and the
    official MA-RLHF code, each token's own ratio with its macro's advantage), each macro action
    of `segment_ids` ("macro": the MA-RLHF paper's objective) or each response ("sequence":
    GSPO). With d_t = logp_t - old_logp_t over the unit's n_u valid tokens:

        s_u = sum_t d_t            ("product": r_u = exp(s_u), the product of its tokens' ratios)
        s_u = (1 / n_u) sum_t d_t  ("geometric": their geometric mean, GSPO's length-normalised
                                    ratio)
        r_u = exp(clip(s_u, -20, 20))   (`LOG_RATIO_BOUND`: no overflow, a finite loss and
                                         gradient; a unit beyond it is clipped anyway)
        l_u = w_u max(-A_u r_u, -A_u clip(r_u, 1 - c_low, 1 + c_high)),

    A_u and w_u the means over the unit's tokens of `advantages` and `is_weights` (the macro's
    advantage and weight wherever they are constant over the unit: macro GAE, the group
    estimators, a rollout correction at the unit's level or a coarser one). With `dual_clip` = c
    > 1 (Ye et al., 2019; verl's clip_ratio_c, Tunix's epsilon_c), a unit with A_u < 0 has
    l_u = w_u min(max(...), -c A_u): its loss is bounded by c |A_u|. The gradient of l_u reaches
    every token of the unit, through s_u (d s_u / d logp_t = 1, or 1 / n_u for "geometric").

    The units' terms become the loss as tokens do in `aggregate_tokens`, the unit in the
    token's place: "token_mean" is the mean over every unit of the batch, "sequence_mean" the
    mean over each response's units then over the responses, "token_sum" each response's sum of
    unit terms over the constant R (the most units a response can have), then the mean over the
    responses. So "token" is the per-token loss exactly; "macro" with one-token macros equals
    "token"; "sequence" with "geometric" is GSPO's mean_i max(-A_i s_i, -A_i clip(s_i)) under
    either mean (one unit per response).

    Args:
      logprobs, old_logprobs, advantages: float `[B, T]`.
      mask: `[B, T]` 0/1 mask of the tokens that are trained.
      cliprange: c > 0, both clip ranges unless `cliprange_low` / `cliprange_high` set one.
      aggregation: how the units' terms become the loss (above).
      is_weights: optional float `[B, T]` constant per-token weights (rollout correction).
      ratio_level: "token", "macro" or "sequence"; static.
      ratio_form: "product" or "geometric" (units of one token are the same either way); static.
      segment_ids: int `[B, T]` macro index of each token, contiguous from 0 on each row
        (`marl_jax.macro.termination`); required for "macro".
      cliprange_low, cliprange_high: c_low, c_high > 0 (None: `cliprange`), DAPO's clip-higher.
      dual_clip: None (off) or c > 1.

    Returns:
      `(loss, metrics)` with metrics over units: clipfrac (the clipped term is the active one),
      clipfrac_low (A_u < 0 and r_u < 1 - c_low), clipfrac_high (A_u > 0 and r_u > 1 + c_high),
      dual_clipfrac (the dual bound is the active term), ratio_mean, ratio_var; and over
      tokens: approxkl, policy_kl (mean old_logp - logp).
    """
    check_rank(logprobs, 2, "logprobs")
    check_same_shape(logprobs, "logprobs", old_logprobs=old_logprobs, advantages=advantages,
                     mask=mask)
    check_mask(mask, "mask", left_aligned=False)
    check_choice(aggregation, POLICY_AGGREGATIONS, "aggregation")
    check_choice(ratio_level, RATIO_LEVELS, "ratio_level")
    check_choice(ratio_form, RATIO_FORMS, "ratio_form")
    _check_positive(cliprange, "cliprange")
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    _check_positive(low, "cliprange_low")
    _check_positive(high, "cliprange_high")
    if dual_clip is not None and is_concrete(dual_clip) and not float(dual_clip) > 1:
        raise ValueError(f"dual_clip must be > 1 (None: off), got {dual_clip!r}")
    valid = jnp.asarray(mask) != 0
    log_ratio = jnp.where(valid, jnp.asarray(logprobs, jnp.float32) - old_logprobs, 0)
    advantages = jnp.where(valid, jnp.asarray(advantages, jnp.float32), 0)
    weights = None if is_weights is None else jnp.asarray(is_weights, jnp.float32)
    if weights is not None:
        check_same_shape(logprobs, "logprobs", is_weights=is_weights)
    if ratio_level == "token":
        unit_log_ratio, unit_advantages, unit_valid, unit_weights = (
            log_ratio, advantages, valid, weights)
    else:
        if ratio_level == "macro":
            if segment_ids is None:
                raise ValueError("segment_ids is required for ratio_level='macro'")
            check_same_shape(logprobs, "logprobs", segment_ids=segment_ids)
            units = segment_ids
        else:
            units = jnp.zeros(np.shape(logprobs), jnp.int32)
        counts = unit_sums(valid.astype(jnp.float32), units, valid)
        unit_valid = counts > 0
        per_unit = jnp.maximum(counts, 1.0)
        unit_log_ratio = unit_sums(log_ratio, units, valid)
        if ratio_form == "geometric":
            unit_log_ratio = unit_log_ratio / per_unit
        unit_advantages = unit_sums(advantages, units, valid) / per_unit
        unit_weights = None if weights is None else unit_sums(weights, units, valid) / per_unit
    ratio = jnp.exp(jnp.clip(unit_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = -unit_advantages * ratio
    clipped = -unit_advantages * jnp.clip(ratio, 1 - low, 1 + high)
    per_unit_loss = jnp.maximum(unclipped, clipped)
    dual_active = jnp.zeros_like(per_unit_loss, bool)
    if dual_clip is not None:
        bound = -unit_advantages * dual_clip
        dual_active = (unit_advantages < 0) & (bound < per_unit_loss)
        per_unit_loss = jnp.where(dual_active, bound, per_unit_loss)
    if unit_weights is not None:
        per_unit_loss = per_unit_loss * jax.lax.stop_gradient(unit_weights)
    loss = aggregate_tokens(per_unit_loss, unit_valid, aggregation)
    ratio_mean = masked_mean(ratio, unit_valid)
    as_share = lambda x: masked_mean(x.astype(jnp.float32), unit_valid)  # noqa: E731
    metrics = {
        "clipfrac": as_share(clipped > unclipped),
        "clipfrac_low": as_share((unit_advantages < 0) & (ratio < 1 - low)),
        "clipfrac_high": as_share((unit_advantages > 0) & (ratio > 1 + high)),
        "dual_clipfrac": as_share(dual_active),
        "approxkl": 0.5 * masked_mean(log_ratio * log_ratio, valid),
        "policy_kl": masked_mean(-log_ratio, valid),
        "ratio_mean": ratio_mean,
        "ratio_var": masked_mean(jnp.square(ratio - ratio_mean), unit_valid),
    }
    return loss, metrics


def unit_sums(values, segment_ids, valid):
    """Per-unit sums in unit slots, float32 `[B, R]`: slot (b, u) holds the sum of `values`
    `[B, R]` over the valid tokens of row b whose segment id is u (0 on slots no token fills).
    `segment_ids` `[B, R]`: each row's unit index of its tokens, in [0, R); invalid tokens are
    left out. One `jax.ops.segment_sum` over the flattened rows."""
    batch, width = np.shape(values)
    slots = (jnp.arange(batch)[:, None] * width
             + jnp.clip(jnp.asarray(segment_ids, jnp.int32), 0, width - 1))
    # Invalid tokens go to slot B * R, past the last segment: segment_sum drops them.
    slots = jnp.where(jnp.asarray(valid) != 0, slots, batch * width)
    sums = jax.ops.segment_sum(jnp.asarray(values, jnp.float32).reshape(-1), slots.reshape(-1),
                               num_segments=batch * width)
    return sums.reshape(batch, width)


def aggregate_tokens(per_token, mask, aggregation):
    """A scalar loss from per-token terms `[B, T]` over the valid tokens of `mask`:

    - "token_mean": mean over all valid tokens of the batch (PPO, REINFORCE++; `rloo` too,
      where its paper averages one sequence ratio per response);
    - "sequence_mean": mean over each sequence's valid tokens, then over the sequences that
      have any (GRPO);
    - "token_sum": each sequence's sum divided by the constant T, then the mean over
      sequences (Dr. GRPO: no length normalisation).
    """
    check_choice(aggregation, POLICY_AGGREGATIONS, "aggregation")
    valid = jnp.asarray(mask) != 0
    per_token = jnp.where(valid, jnp.asarray(per_token, jnp.float32), 0)
    if aggregation == "token_mean":
        return masked_mean(per_token, valid)
    counts = jnp.sum(valid, axis=1)
    divisor = jnp.maximum(counts, 1) if aggregation == "sequence_mean" else per_token.shape[1]
    return masked_mean(jnp.sum(per_token, axis=1) / divisor, counts > 0)


def ppo_value_loss(values, old_values, returns, mask, *, cliprange_value=0.2):
    """Clipped value loss 0.5 * max((v - G)^2, (clip(v, v_old - c, v_old + c) - G)^2), masked mean.

    Args:
      values, old_values, returns: float `[B, T]` (returns: each token's macro return G_tau).
      mask: `[B, T]` 0/1 mask.
      cliprange_value: c > 0.

    Returns:
      `(loss, metrics)` with metrics clipfrac, vpred (mean value), error (mean unclipped squared
      error), returns_mean, returns_var.
    """
    check_rank(values, 2, "values")
    check_same_shape(values, "values", old_values=old_values, returns=returns, mask=mask)
    check_mask(mask, "mask", left_aligned=False)
    _check_positive(cliprange_value, "cliprange_value")
    valid = jnp.asarray(mask) != 0
    values = jnp.where(valid, jnp.asarray(values, jnp.float32), 0)
    old_values = jnp.where(valid, jnp.asarray(old_values, jnp.float32), 0)
    returns = jnp.where(valid, jnp.asarray(returns, jnp.float32), 0)
    clipped_values = old_values + jnp.clip(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = 0.5 * masked_mean(jnp.maximum(unclipped_error, clipped_error), valid)
    returns_mean = masked_mean(returns, valid)
    metrics = {
        "clipfrac": masked_mean((clipped_error > unclipped_error).astype(jnp.float32), valid),
        "vpred": masked_mean(values, valid),
        "error": masked_mean(unclipped_error, valid),
        "returns_mean": returns_mean,
        "returns_var": masked_mean(jnp.square(returns - returns_mean), valid),
    }
    return loss, metrics


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """Per-token KL(policy || reference) estimate `[B, T]` from sampled-token log-probabilities.

    k1 = logp - ref_logp (unbiased, can be negative); k3 = (r - 1) - log r with
    r = exp(ref_logp - logp) (unbiased, never negative).
    """
    check_choice(estimator, KL_ESTIMATORS, "estimator")
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs)
    log_ratio = jnp.asarray(ref_logprobs, jnp.float32) - jnp.asarray(logprobs, jnp.float32)
    if estimator == "k1":
        return -log_ratio
    # expm1 keeps (r - 1) - log r accurate (and >= 0) when r is close to 1.
    return jnp.expm1(log_ratio) - log_ratio


def kl_penalty_loss(logprobs, ref_logprobs, mask, *, kl_coef, aggregation="token_mean"):
    """The KL to the reference as a loss term: kl_coef x the k3 estimate of each token,
    aggregated like the policy loss (`aggregate_tokens`), as DeepSeekMath's GRPO and TRL do.
    Gradients flow through `logprobs` `[B, T]` only."""
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs, mask=mask)
    kl = kl_per_token(logprobs, jax.lax.stop_gradient(ref_logprobs), "k3")
    return jnp.asarray(kl_coef, jnp.float32) * aggregate_tokens(kl, mask, aggregation)


def assemble_rewards(logprobs, ref_logprobs, scores, response_mask, *, kl_coef,
                     kl_estimator="k1", reward_clip=2.5, missing_eos_penalty=None,
                     ended_with_eos=None, length_penalties=None):
    """Per-token PPO rewards: r_t = -kl_coef * kl_t, plus the clipped score on the last token.

    The reward-model score is clipped to [-reward_clip, reward_clip] (None: no clipping) and
    added on each sequence's last valid response token (a trajectory's last action token when
    the mask has holes at observation spans, which take no KL and no reward). With `missing_eos_penalty` (a positive
    number, as in TRL), sequences whose `ended_with_eos` is False get `score - penalty`; the
    penalty is applied after clipping, so it always lowers the reward; so are
    `length_penalties` (DAPO's overlong punishment, `overlong_penalty`). Rows without any
    response token get zero rewards.

    Args:
      logprobs, ref_logprobs: float `[B, T]` log-probabilities of the sampled response tokens
        under the policy that generated them and under the reference model.
      scores: float `[B]` reward-model scores.
      response_mask: `[B, T]` 0/1 mask of the policy's tokens: left-aligned for one response,
        with holes for a multi-turn trajectory.
      kl_coef: beta >= 0; a Python float or a (traced) scalar.
      kl_estimator: one of `KL_ESTIMATORS`.
      reward_clip: positive float or None.
      missing_eos_penalty: None or a float >= 0.
      ended_with_eos: bool `[B]`, required with `missing_eos_penalty`.
      length_penalties: None or float `[B]` >= 0, subtracted from the clipped score.

    Returns:
      `(rewards [B, T], metrics)`; metrics are means over the rows that have a response:
      kl (per-sequence summed KL), non_score_reward (per-sequence summed KL penalty), scores
      (the score as added, after clipping and penalty), rlhf_reward (scores + non_score_reward).
    """
    check_rank(logprobs, 2, "logprobs")
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs,
                     response_mask=response_mask)
    check_mask(response_mask, "response_mask", left_aligned=False)
    if np.shape(scores) != np.shape(logprobs)[:1]:
        raise ValueError(
            f"scores must have shape {np.shape(logprobs)[:1]} (one per row), got "
            f"{np.shape(scores)}")
    if reward_clip is not None:
        _check_positive(reward_clip, "reward_clip")
    if is_concrete(kl_coef) and not float(np.asarray(kl_coef)) >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    valid = jnp.asarray(response_mask) != 0
    kl = jnp.where(valid, kl_per_token(logprobs, ref_logprobs, kl_estimator), 0)
    non_score = -jnp.asarray(kl_coef, jnp.float32) * kl

    scores = jnp.asarray(scores, jnp.float32)
    if reward_clip is not None:
        scores = jnp.clip(scores, -reward_clip, reward_clip)
    if missing_eos_penalty is not None:
        if ended_with_eos is None:
            raise ValueError("ended_with_eos is required when missing_eos_penalty is set")
        if np.shape(ended_with_eos) != np.shape(scores):
            raise ValueError(
                f"ended_with_eos must have shape {np.shape(scores)}, got "
                f"{np.shape(ended_with_eos)}")
        if is_concrete(missing_eos_penalty) and not float(missing_eos_penalty) >= 0:
            raise ValueError(
                f"missing_eos_penalty must be >= 0 (it is subtracted), got {missing_eos_penalty!r}")
        scores = jnp.where(jnp.asarray(ended_with_eos), scores, scores - missing_eos_penalty)
    if length_penalties is not None:
        if np.shape(length_penalties) != np.shape(scores):
            raise ValueError(f"length_penalties must have shape {np.shape(scores)}, got "
                             f"{np.shape(length_penalties)}")
        scores = scores - jnp.asarray(length_penalties, jnp.float32)

    positions = jnp.arange(valid.shape[1])
    last = jnp.where(valid, positions, -1).max(axis=1, keepdims=True)
    is_last = valid & (positions == last)
    rewards = non_score + jnp.where(is_last, scores[:, None], 0)
    has_response = jnp.any(valid, axis=1)
    kl_sum = masked_mean(jnp.sum(kl, axis=1), has_response)
    non_score_sum = masked_mean(jnp.sum(non_score, axis=1), has_response)
    score_mean = masked_mean(scores, has_response)
    metrics = {
        "kl": kl_sum,
        "non_score_reward": non_score_sum,
        "scores": score_mean,
        "rlhf_reward": score_mean + non_score_sum,
    }
    return rewards, metrics


def overlong_penalty(lengths, *, budget, buffer, penalty):
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) as the amount subtracted from a
    response's score: float32 `[B]`, 0 for a length L <= budget - buffer, rising linearly over
    the last `buffer` tokens of the budget to `penalty` at L = budget:

        penalty x clip((L - (budget - buffer)) / buffer, 0, 1).

    Args:
      lengths: int `[B]` response lengths (tokens, EOS included).
      budget: the response budget (`ppo.response_length`), an int.
      buffer: its last tokens where the penalty rises, an int in [1, budget).
      penalty: the largest amount, a float >= 0.
    """
    if not 1 <= int(buffer) < int(budget):
        raise ValueError(f"buffer must be in [1, budget={budget}), got {buffer!r}")
    if not float(penalty) >= 0:
        raise ValueError(f"penalty must be >= 0, got {penalty!r}")
    excess = jnp.asarray(lengths, jnp.float32) - (int(budget) - int(buffer))
    return jnp.float32(penalty) * jnp.clip(excess / int(buffer), 0.0, 1.0)


def bradley_terry_loss(chosen, rejected, weights=None):
    """Reward-model loss mean(-log sigmoid(chosen - rejected)).

    Args:
      chosen, rejected: float `[B]` scores of the preferred and the other response.
      weights: optional `[B]` pair weights (0 drops a padding pair); the loss and metrics are
        then weighted means (0 when every weight is 0).

    Returns:
      `(loss, metrics)` with metrics accuracy (fraction with chosen > rejected), margin
      (mean chosen - rejected), chosen_mean, rejected_mean.
    """
    check_rank(chosen, 1, "chosen")
    check_same_shape(chosen, "chosen", rejected=rejected)
    chosen = jnp.asarray(chosen, jnp.float32)
    rejected = jnp.asarray(rejected, jnp.float32)
    if weights is None:
        w = jnp.ones_like(chosen)
        total = max(np.shape(chosen)[0], 1)
    else:
        check_same_shape(chosen, "chosen", weights=weights)
        w = jnp.asarray(weights, jnp.float32)
        total = jnp.maximum(w.sum(), 1e-9)
    margin = chosen - rejected
    loss = jnp.sum(w * -jax.nn.log_sigmoid(margin)) / total
    metrics = {
        "accuracy": jnp.sum(w * (margin > 0).astype(jnp.float32)) / total,
        "margin": jnp.sum(w * margin) / total,
        "chosen_mean": jnp.sum(w * chosen) / total,
        "rejected_mean": jnp.sum(w * rejected) / total,
    }
    return loss, metrics


def sft_cross_entropy(logits, targets, mask):
    """Masked next-token cross-entropy, the mean over target tokens.

    `logits[b, t]` is the prediction for `targets[b, t]` (shift before calling).

    Args:
      logits: float `[B, T, V]`.
      targets: int `[B, T]` token ids; only positions inside `mask` need be valid ids.
      mask: `[B, T]` 0/1 mask of the target tokens (for SFT: the response tokens).

    Returns:
      `(loss, metrics)` with metrics accuracy (argmax == target) and perplexity (exp(loss)).
    """
    check_rank(logits, 3, "logits")
    check_rank(targets, 2, "targets")
    check_same_shape(targets, "targets", mask=mask)
    if np.shape(targets) != np.shape(logits)[:2]:
        raise ValueError(
            f"targets have shape {np.shape(targets)} but logits have {np.shape(logits)}")
    check_mask(mask, "mask", left_aligned=False)
    vocab = np.shape(logits)[2]
    if is_concrete(targets) and is_concrete(mask):
        inside = np.asarray(targets)[np.asarray(mask) != 0]
        if inside.size and (inside.min() < 0 or inside.max() >= vocab):
            raise ValueError(f"targets inside the mask must lie in [0, {vocab}), got "
                             f"[{inside.min()}, {inside.max()}]")
    valid = jnp.asarray(mask) != 0
    targets = jnp.where(valid, jnp.asarray(targets), 0)
    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return token_cross_entropy(target_log_probs, correct, mask)


def token_cross_entropy(target_logprobs, correct, mask):
    """`sft_cross_entropy` from per-token results: log p(target) and argmax == target, `[B, T]`
    (what `models.heads.token_scores` gives without building the logits)."""
    check_rank(target_logprobs, 2, "target_logprobs")
    check_same_shape(target_logprobs, "target_logprobs", correct=correct, mask=mask)
    valid = jnp.asarray(mask) != 0
    loss = masked_mean(-jnp.asarray(target_logprobs, jnp.float32), valid)
    metrics = {"accuracy": masked_mean(correct, valid), "perplexity": jnp.exp(loss)}
    return loss, metrics


def rollout_correction_weights(trainer_logprobs, sampler_logprobs, response_mask, *, level, cap,
                               segment_ids=None):
    """Truncated importance weights of the trainer's policy against the sampler's: float32 `[B, R]`.

    The sampler and the trainer compute the same policy in different programs (a KV-cache decode
    loop vs one scoring pass; bfloat16 differs between them; top-k / top-p draw from a truncated
    distribution), so the tokens PPO trains on are samples of the sampler's distribution. The
    weight w = min(pi_trainer / pi_sampler, cap) re-weights each token's policy-gradient term:

    - "token":    w_t = min(exp(t_t - s_t), cap);
    - "sequence": min(exp(sum over the row's valid tokens of (t - s)), cap) on every valid token;
    - "macro":    min(exp(sum over the macro's tokens of (t - s)), cap) on every token of the
      macro (`segment_ids` as `marl_jax.macro.termination` makes them);
    - "turn":     the same over each turn's tokens (`segment_ids`: a trajectory's turn ids).

    Asynchronously (`train/async_step.py`) the sampler's logprobs are the behaviour policy's,
    each token's from the version that sampled it, and the trainer's the proximal policy's (the
    actor before the update): one weight corrects both the staleness and the precision mismatch
    (decoupled PPO), over units whose tokens may come from several versions.

    Args:
      trainer_logprobs, sampler_logprobs: float `[B, R]` logprobs of the sampled tokens under the
        trainer's scoring pass and under the sampler.
      response_mask: `[B, R]` 0/1 mask of the response tokens.
      level: "token", "sequence", "macro" or "turn".
      cap: the truncation, >= 1.
      segment_ids: int `[B, R]` macro (or turn) index of each token (required for "macro" and
        "turn").

    Returns:
      float32 `[B, R]` weights, 0 on padding; constants (no gradient flows through them).
    """
    check_rank(trainer_logprobs, 2, "trainer_logprobs")
    check_same_shape(trainer_logprobs, "trainer_logprobs", sampler_logprobs=sampler_logprobs,
                     response_mask=response_mask)
    check_mask(response_mask, "response_mask", left_aligned=False)
    check_choice(level, ROLLOUT_CORRECTIONS[1:], "level")
    if is_concrete(cap) and not float(np.asarray(cap)) >= 1:
        raise ValueError(f"cap must be >= 1, got {cap!r}")
    valid = jnp.asarray(response_mask) != 0
    log_ratio = jnp.where(valid, jnp.asarray(trainer_logprobs, jnp.float32)
                          - jnp.asarray(sampler_logprobs, jnp.float32), 0.0)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(log_ratio.sum(axis=1, keepdims=True), log_ratio.shape)
    elif level in ("macro", "turn"):
        if segment_ids is None:
            raise ValueError(f"segment_ids is required for level={level!r}")
        check_same_shape(trainer_logprobs, "trainer_logprobs", segment_ids=segment_ids)
        ids = jnp.clip(jnp.asarray(segment_ids, jnp.int32), 0, log_ratio.shape[1] - 1)
        log_ratio = jnp.take_along_axis(unit_sums(log_ratio, ids, valid), ids, axis=1)
    # exp of the clipped log-ratio: a huge log-ratio cannot overflow before the cap applies.
    weights = jnp.exp(jnp.minimum(log_ratio, jnp.log(jnp.asarray(cap, jnp.float32))))
    return jnp.where(valid, weights, 0.0).astype(jnp.float32)


def masked_mean(x, valid):
    """Mean of x over valid entries; 0 when there are none."""
    count = jnp.sum(valid)
    return (jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(count, 1)).astype(jnp.float32)


def _check_positive(value, name):
    if is_concrete(value) and not float(np.asarray(value)) > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
