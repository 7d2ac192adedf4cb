"""The advantages phase: termination (segment ids of every on-device termination), (macro) GAE
with the critic's values or a critic-free estimator, and the rollout-correction weights."""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

from marl_jax import estimators, losses
from marl_jax import rollout as rollout_engine
from marl_jax.macro import advantage, termination
from marl_jax.models.heads import continuation_scores
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PPOState, PPOStatic,
                                      RunHparams, role_model, role_params)


@flax.struct.dataclass
class Advantages:
    """What the update trains on: every response token carries its macro's advantage (and,
    with a critic, its macro's return)."""

    advantages: jax.Array  # [B, R]
    returns: Any  # [B, R] the critic's targets; None for the critic-free estimators
    is_weights: Any  # [B, R] rollout-correction weights; None without a correction
    segment_ids: jax.Array  # [B, R] int32 the run variant's macro segment ids
    # [B] bool: the rows that enter the loss (dynamic sampling's shortfall and, with
    # `mask_truncated`, responses that hit the budget without EOS leave it); None: every row.
    loss_rows: Any = None


def compute_advantages(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                       hparams: RunHparams, exp: Experience, key, host_segments=None):
    """Termination, then advantages (macro GAE with the critic's values, or the estimator's
    without one) and the rollout-correction weights: (Advantages, metrics).

    `host_segments [B, R]` (int32) are the parsing termination's segment ids, computed on the
    host from the sampled text between the rollout and this phase. The metrics carry the run
    variant's macro statistics and, for an estimator that samples Monte Carlo branches, their
    sampling budget (`budget/branch_generated_tokens`, `budget/branch_prefill_tokens`; the
    rollout's own is the score phase's).
    """
    segments = segment_ids_for(static, hparams, exp, key)
    if host_segments is not None:
        segments["parsing"] = host_segments
    if static.uses_critic:
        adv, ret = advantages_and_returns(static, hparams, exp, segments)
        est_metrics = branch_budget = {}
    else:
        ret = None
        adv, est_metrics, branch_budget = critic_free_advantages(
            static, models, state, frozen, hparams, exp, segments, jax.random.fold_in(key, 1))
    weights, weight_metrics = correction_weights(static, exp, segments, hparams.variant)
    loss_rows, row_metrics = rows_in_loss(static, exp)
    out = Advantages(adv, ret, weights, variant_segments(static, segments, hparams.variant),
                     loss_rows)
    return out, {**est_metrics, **branch_budget, **weight_metrics, **row_metrics,
                 **segment_stats(segments, hparams.variant, static, exp.actions)}


def rows_in_loss(static: PPOStatic, exp: Experience):
    """(`[B]` bool rows that enter the loss or None for every row, metrics): the rollout's
    (`exp.loss_rows`), without the truncated responses (the budget reached without EOS) when
    `static.mask_truncated`, whose share is `overlong/truncated_frac`."""
    rows = exp.loss_rows
    if not static.mask_truncated:
        return rows, {}
    truncated = ~exp.ended_with_eos & (exp.response_mask.sum(axis=1) >= static.response_length)
    kept = ~truncated if rows is None else rows & ~truncated
    return kept, {"overlong/truncated_frac": truncated.astype(jnp.float32).mean()}


def segment_ids_for(static: PPOStatic, hparams: RunHparams, exp: Experience, key):
    """Segment ids `[B, R]` of every distinct on-device termination, selected by the variant:
    over the action tokens, within turns for a multi-turn trajectory (`exp.turn_ids`)."""
    terminations = sorted({v[0] for v in static.variants})
    by_name = {}
    for name in terminations:
        if name == "parsing":
            continue
        extra = {"entropy": dict(entropies=exp.entropies,
                                 entropy_quantile=static.entropy_quantile),
                 # The probability the policy gave each token it sampled: its old logprobs.
                 "low_probability": dict(
                     logprobs=exp.old_logprobs,
                     low_probability_quantile=static.low_probability_quantile,
                     low_probability_threshold=static.low_probability_threshold or None),
                 }.get(name, {})
        by_name[name] = termination.segment(
            name, exp.actions, key=key, ref_logprobs=exp.ref_base_logprobs,
            n=hparams.ngram, lengths=static.randomized_lengths, repeats=static.randomized_repeats,
            isolate_last=static.isolate_last, turn_ids=exp.turn_ids,
            token_ids=exp.response_ids, step_table=static.step_table, **extra)
    return by_name


def advantages_and_returns(static: PPOStatic, hparams: RunHparams, exp: Experience,
                           segments: dict):
    """Macro GAE for the run's variant; `segments` maps termination name -> `[B, R]` ids."""
    results = []
    for term, weighting, aggregation in static.variants:
        results.append(estimators.ESTIMATORS["gae"].advantages(
            exp.values, exp.rewards, exp.actions, segments[term], gamma=hparams.gamma,
            lam=hparams.lam, value_weighting=weighting, reward_aggregation=aggregation))
    if len(results) == 1:
        adv, ret = results[0]
    else:
        stacked_adv = jnp.stack([r[0] for r in results])
        stacked_ret = jnp.stack([r[1] for r in results])
        adv, ret = stacked_adv[hparams.variant], stacked_ret[hparams.variant]
    if static.whiten_advantages:
        # Over the tokens of the rows whose environment did not fail (`exp.loss_rows`).
        mask = exp.actions if exp.loss_rows is None else exp.actions * exp.loss_rows[:, None]
        adv = advantage.whiten(adv, mask)
    return adv, ret


def variant_segments(static: PPOStatic, segments: dict, variant):
    """The `[B, R]` segment ids of the run's variant (a traced index into `static.variants`)."""
    names = [v[0] for v in static.variants]
    if len(set(names)) == 1:
        return segments[names[0]]
    return jnp.stack([segments[n] for n in names])[variant]


def critic_free_advantages(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                           hparams: RunHparams, exp: Experience, segments: dict, key):
    """Per-token advantages `[B, R]` without a critic: (advantages, metrics, extra budget), from
    the estimator's record (`estimators.ESTIMATORS`).

    The record's advantage function reads the responses' terminal rewards (clipped score, a
    trajectory's turn rewards added,
    missing-EOS penalty), their per-token KL estimates to the reference at `state.kl_coef`, and
    the per-token rewards (`estimators.AdvantageInputs`). An estimator that branches (macro_mc)
    first samples `mc_rollouts` continuations from up to `mc_branch_points` macro starts of
    the run variant's segments with the current policy, whose mean returns are the values of
    those states (`monte_carlo_returns`).
    """
    estimator = estimators.ESTIMATORS[static.estimator]
    mask = exp.actions
    inputs = advantage_inputs(static, exp, state.kl_coef, static.group_size)
    if not estimator.branches:
        return estimator.advantages(inputs), {}, {}
    k_points, k_rollouts = jax.random.split(key)
    seg = variant_segments(static, segments, hparams.variant)
    starts, valid = estimators.choose_branch_points(k_points, seg, mask, static.mc_branch_points)
    actor = role_params(static, "actor", frozen, state.actor_params)
    returns, budget = monte_carlo_returns(static, models, actor, frozen, exp, starts, valid,
                                          k_rollouts, state.kl_coef)
    values = returns.mean(axis=-1)
    adv = estimator.advantages(inputs._replace(branches=(starts, valid, values)))
    metrics = {"mc/branch_points_avg": valid.sum(axis=1).astype(jnp.float32).mean(),
               "mc/value_at_start": values[:, 0].mean(),
               "mc/value_std_avg": returns.std(axis=-1).mean()}
    return adv, metrics, budget


def advantage_inputs(static: PPOStatic, exp: Experience, kl_coef, group_size: int):
    """What a critic-free estimator reads of a scored batch (`estimators.AdvantageInputs`):
    each response's terminal reward (clipped score, missing-EOS and overlong penalties, a
    trajectory's turn rewards added), its per-token KL estimates to the reference, the
    per-token rewards at `kl_coef`, with groups of `group_size` adjacent rows, whose statistics
    count the rows whose environment did not fail (`exp.loss_rows`)."""
    mask = exp.actions
    kl = losses.kl_per_token(exp.old_logprobs, exp.ref_logprobs, static.kl_estimator)
    terminal = score.terminal_reward(static, exp.scores, exp.ended_with_eos, mask.sum(axis=1))
    if exp.turn_rewards is not None:
        # A trajectory's score is everything it earned: its turns' rewards too.
        terminal = terminal + exp.turn_rewards.sum(axis=1)
    return estimators.AdvantageInputs(
        scores=jnp.where(mask.sum(axis=1) > 0, terminal, 0.0),
        kl=jnp.where(mask != 0, kl, 0.0), kl_coef=kl_coef, rewards=exp.rewards,
        response_mask=mask, group_size=group_size, turn_ids=exp.turn_ids, rows=exp.loss_rows)


def monte_carlo_returns(static: PPOStatic, models: Models, actor_params, frozen: Frozen,
                        exp: Experience, starts, valid, key, kl_coef=0.0):
    """Returns of `mc_rollouts` continuations from each branch point: (`[B, M, m]`, budget).

    Branch point (b, j) is the state after the first `starts[b, j]` response tokens of row b;
    each continuation is sampled by `actor_params` from there (prompt + prefix prefilled once
    per branch point) and its return is its terminal reward (clipped score, missing-EOS
    penalty) minus `kl_coef` x its summed per-token KL to the reference (the tokens it
    sampled, not the prefix), so the mean over the last axis is an unbiased Monte Carlo
    estimate of the state's KL-regularised value. The budget counts the continuation tokens and
    prefills of valid points.
    """
    rows, prefix, flat_valid = estimators.flatten_branches(starts, valid)
    m = static.mc_rollouts
    cont = rollout_engine.continue_responses(
        models.policy, actor_params, exp.prompt_ids[rows], exp.prompt_mask[rows],
        exp.response_ids[rows], exp.response_mask[rows], prefix,
        row_keys=jax.random.split(key, rows.shape[0] * m), num_samples=m,
        temperature=static.temperature, top_k=static.top_k, top_p=static.top_p,
        eos_id=static.eos_id, pad_id=static.pad_id)
    cont_mask = cont.mask.astype(jnp.int32)
    prompt_ids, prompt_mask, documents = (
        None if a is None else jnp.repeat(a[rows], m, axis=0)
        for a in (exp.prompt_ids, exp.prompt_mask, exp.documents))
    cont_scores, _ = score.sequence_score(static, models, frozen, prompt_ids, prompt_mask, cont.tokens,
                                    cont_mask, documents)
    returns = score.terminal_reward(static, cont_scores,
                                    score.ends_with_eos(cont.tokens, cont_mask, static.eos_id),
                                    cont_mask.sum(axis=1))
    sampled = cont_mask * (jnp.arange(cont_mask.shape[1])[None] >= jnp.repeat(prefix, m)[:, None])
    cont_args = (prompt_ids, prompt_mask, cont.tokens, cont_mask)
    ref = continuation_scores(role_model(static, models, "reference"),
                              role_params(static, "reference", frozen), *cont_args,
                              static.temperature)
    if static.reuses_sampler_logprobs:
        actor_logprobs = cont.logprobs
    else:
        actor_logprobs, _ = score.token_logprobs(models.policy, actor_params, *cont_args,
                                           static.temperature)
    kl = losses.kl_per_token(actor_logprobs, ref.logprobs, static.kl_estimator)
    returns = returns - kl_coef * jnp.where(sampled != 0, kl, 0.0).sum(axis=1)
    used = jnp.repeat(flat_valid, m).astype(jnp.float32)
    generated = ((cont_mask.sum(axis=1) - jnp.repeat(prefix, m)) * used).sum()
    prefilled = ((exp.prompt_mask[rows].sum(axis=1) + prefix) * flat_valid).sum()
    return returns.reshape(starts.shape + (m,)), {
        "budget/branch_generated_tokens": generated.astype(jnp.float32),
        "budget/branch_prefill_tokens": prefilled.astype(jnp.float32)}


def segment_stats(segments, variant, static, mask):
    """`macro/num_macros_avg` (per response) and `macro/len_avg` (tokens per macro) of the
    run's variant."""
    names = [v[0] for v in static.variants]
    seg = jnp.stack([segments[n] for n in names])[variant]
    return {"macro/num_macros_avg": termination.macros_per_row(seg, mask).mean(dtype=jnp.float32),
            "macro/len_avg": termination.mean_macro_length(seg, mask)}


def correction_weights(static: PPOStatic, exp: Experience, segments: dict, variant):
    """(`[B, R]` rollout-correction weights or None, metrics): `static.rollout_correction` at
    the level of tokens, responses, the run variant's macros or a trajectory's turns, capped at
    `rollout_is_cap`."""
    if static.rollout_correction == "none":
        return None, {}
    level = static.rollout_correction
    seg = None
    if level == "macro":
        seg = variant_segments(static, segments, variant)
    elif level == "turn":
        seg = exp.turn_ids
    args = (exp.old_logprobs, exp.sampler_logprobs, exp.actions)
    weights = losses.rollout_correction_weights(*args, level=level, cap=static.rollout_is_cap,
                                                segment_ids=seg)
    uncapped = losses.rollout_correction_weights(*args, level=level, cap=jnp.inf,
                                                 segment_ids=seg)
    valid = exp.actions != 0
    return weights, {"rollout/is_weight_mean": losses.masked_mean(weights, valid),
                     "rollout/is_weight_capped_frac": losses.masked_mean(
                         uncapped > static.rollout_is_cap, valid)}
