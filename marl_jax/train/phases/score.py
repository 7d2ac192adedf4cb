"""The score phase: one pass over sampled responses gives old and reference logprobs, critic
values, the sequence score (reward model, gold function or host) and the per-token rewards.

The model-application functions here (`token_logprobs`, `critic_outputs`, `sequence_scores`)
are the one scoring path of the project: the update, evaluation and the benchmarks call them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax import estimators, losses
from marl_jax.models import last_token_score
from marl_jax.models.heads import (backbone_hidden, continuation_scores, scalar_outputs,
                                   trunk_states)
from marl_jax.train import async_schedule
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PPOState, PPOStatic,
                                      in_row_chunks, role_model, role_params,
                                      sampler_logprobs_are_exact)


def _concat(prompt_ids, prompt_mask, response_ids, response_mask):
    return (jnp.concatenate([prompt_ids, response_ids], axis=1),
            jnp.concatenate([prompt_mask, response_mask], axis=1))


def token_logprobs(policy, params, prompt_ids, prompt_mask, response_ids, response_mask,
                   temperature, trunk=None, rngs=None):
    """(logprobs `[B, R]`, entropy `[B, R]`): the logprob of each response token and the entropy
    of the temperature-scaled next-token distribution it was sampled from, 0 on padding,
    differentiable with respect to `params`. The one scoring path for old, reference and new
    logprobs. `trunk`: the shared trunk's output (`shared_trunk`), or None; `rngs`: the
    training forward's (`{"dropout": key}`), or None."""
    out = continuation_scores(policy, params, prompt_ids, prompt_mask, response_ids,
                              response_mask, temperature, trunk, rngs)
    return out.logprobs, out.entropy


def _scalar_per_token(module, params, ids, mask, trunk, rngs=None):
    if trunk is None:
        return module.apply({"params": params}, ids, mask, rngs=rngs)
    return scalar_outputs(module.config, params,
                          backbone_hidden(module.config, params, ids, mask, trunk, rngs))


def critic_outputs(critic, params, prompt_ids, prompt_mask, response_ids, response_mask,
                   trunk=None, rngs=None):
    """(values `[B, R]`, final `[B]`): the value of the state in which each response token is
    chosen (zero on padding), and the critic's output at the last valid token of prompt +
    response, where the reward model reads its score."""
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    per_token = _scalar_per_token(critic, params, ids, mask, trunk, rngs)
    p = prompt_ids.shape[1]
    return per_token[:, p - 1:-1] * response_mask, last_token_score(per_token, mask)


def response_values(critic, params, prompt_ids, prompt_mask, response_ids, response_mask,
                    trunk=None, rngs=None):
    """Critic values `[B, R]`: the value of the state in which each response token is chosen."""
    return critic_outputs(critic, params, prompt_ids, prompt_mask, response_ids,
                          response_mask, trunk, rngs)[0]


def sequence_scores(reward_model, params, prompt_ids, prompt_mask, response_ids, response_mask,
                    trunk=None):
    """Reward-model score `[B]` read at the last valid token of prompt + response."""
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    return last_token_score(_scalar_per_token(reward_model, params, ids, mask, trunk), mask)


def shared_trunk(static: PPOStatic, models: Models, params, prompt_ids, prompt_mask,
                 response_ids, response_mask):
    """(hidden states after the first `static.shared_trunk_layers` layers `[B, P + R, D]`, that
    count) of prompt + response, computed once for the actor, reference, critic and reward
    model, which share those layers and the embeddings (`ppo.shared_trunk_layers` checks it);
    None when they do not. Constant: no gradient flows into it."""
    k = static.shared_trunk_layers
    if not k:
        return None
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    states = trunk_states(models.policy.config, params, ids, mask, k)
    return jax.lax.stop_gradient(states), k


def rollout_mismatch(trainer_logprobs, sampler_logprobs, response_mask, cliprange):
    """How far the sampler's logprobs of the sampled tokens are from the trainer's: mean and max
    |trainer - sampler| over the response tokens, and the share of tokens whose exp(trainer -
    sampler) lies outside PPO's clip range [1 - cliprange, 1 + cliprange] before any update."""
    valid = response_mask != 0
    diff = jnp.where(valid, trainer_logprobs - sampler_logprobs, 0.0)
    ratio = jnp.exp(diff)
    outside = ((ratio < 1.0 - cliprange) | (ratio > 1.0 + cliprange)).astype(jnp.float32)
    # Unmeasured (NaN) logprobs stay NaN in every metric.
    outside = jnp.where(jnp.isnan(diff), jnp.nan, outside)
    return {"rollout/logprob_diff_mean": losses.masked_mean(jnp.abs(diff), valid),
            "rollout/logprob_diff_max": jnp.abs(diff).max(),
            "rollout/ratio_outside_clip": losses.masked_mean(outside, valid)}


def sequence_score(static: PPOStatic, models: Models, frozen: Frozen, prompt_ids, prompt_mask,
                   response_ids, response_mask, documents=None, host_scores=None, trunk=None):
    """(score, raw score) `[B]`: the reward model's (normalised when `normalize_reward`), the
    gold function's on `documents`, or the host's `host_scores` (an environment's trajectories:
    0, its rewards are the turns'), before clipping."""
    if static.reward_source in ("host", "env"):
        scores = jnp.asarray(host_scores, jnp.float32)
        return scores, scores
    if static.reward_source == "gold":
        scores = models.gold_fn(documents, response_ids, response_mask)
        return scores, scores
    raw = sequence_scores(models.reward, role_params(static, "reward", frozen), prompt_ids,
                          prompt_mask, response_ids, response_mask, trunk)
    if static.normalize_reward:
        return (raw - frozen.reward_mean) / frozen.reward_std, raw
    return raw, raw


def terminal_reward(static: PPOStatic, scores, ended_with_eos, lengths):
    """The score as the last token's reward: clipped to +-reward_clip, minus the missing-EOS
    penalty and the overlong penalty of responses of `lengths` tokens (what
    `losses.assemble_rewards` adds on the last token)."""
    out = jnp.clip(scores, -static.reward_clip, static.reward_clip)
    if static.missing_eos_penalty:
        out = jnp.where(ended_with_eos, out, out - static.missing_eos_penalty)
    penalties = length_penalties(static, lengths)
    return out if penalties is None else out - penalties


def length_penalties(static: PPOStatic, lengths):
    """DAPO's overlong penalties `[B]` of responses of `lengths` tokens
    (`losses.overlong_penalty`), or None without overlong shaping."""
    if not static.overlong_buffer:
        return None
    return losses.overlong_penalty(lengths, budget=static.action_budget or static.response_length,
                                   buffer=static.overlong_buffer,
                                   penalty=static.overlong_penalty)


def score(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
          prompt_mask, response_ids, response_mask, documents=None, host_scores=None,
          sampled_logprobs=None, sampled_entropy=None, first_step=None, action_mask=None,
          turn_ids=None, turn_rewards=None, versions=None):
    """One scoring pass over sampled responses: (Experience, metrics).

    Old and reference logprobs, critic values, the sequence score (the reward model's, the gold
    function's on `documents`, or `host_scores [B]` computed on the host, e.g. unit tests) and
    the per-token rewards: -kl_coef * KL on every token plus the clipped score on the last one.
    `sampled_logprobs [B, R]` (the sampler's) replace the actor's scoring pass when
    `static.reuses_sampler_logprobs`; where both exist, their mismatch is measured
    (`rollout_mismatch`). Reused where they are not exact, the scoring pass still runs on the
    first step, to measure what the choice costs (NaN on later steps). `first_step`: whether
    this is the first step (default `state.step == 0`); a vmapped caller passes one unbatched
    flag for all its runs, so the extra pass stays a branch taken once (under vmap a batched
    predicate turns `lax.cond` into a select that runs both branches at every step).

    A multi-turn trajectory passes `action_mask [B, R]` (the policy's tokens; `response_mask`
    then marks actions and observations, which every forward pass reads), `turn_ids [B, R]` and
    `turn_rewards [B, R]` (the environment's reward of each turn on its last action token,
    added to the per-token rewards). Logprobs, entropies, values, KL and rewards are then 0 on
    the observation tokens, and the score lands on the trajectory's last action token.

    `versions [B, R]` (int32): the policy version that sampled each token (an asynchronous
    rollout's, `async_schedule`); None: the actor's, `state.step`, on every action token.
    """
    args = (prompt_ids, prompt_mask, response_ids, response_mask)
    actions = response_mask if action_mask is None else action_mask
    only_actions = (lambda x: x) if action_mask is None else (lambda x: x * action_mask)
    trunk = shared_trunk(static, models, role_params(static, "reference", frozen), *args)
    # A shared trunk's states cover the whole batch; the config keeps it and chunks apart.
    n = static.rollout_chunks if trunk is None else 1
    entropies = None if sampled_entropy is None else sampled_entropy * actions
    sampler = None if sampled_logprobs is None else sampled_logprobs * actions
    trainer_pass = lambda: jax.tree.map(only_actions, in_row_chunks(
        n, lambda *a: token_logprobs(models.policy, role_params(
            static, "actor", frozen, state.actor_params), *a, static.temperature, trunk), *args))
    if sampler is not None and static.reuses_sampler_logprobs:
        old_logprobs = sampler
        trainer = None
        if not sampler_logprobs_are_exact(static):
            first = state.step == 0 if first_step is None else first_step
            trainer = jax.lax.cond(first, lambda: trainer_pass()[0],
                                   lambda: jnp.full_like(sampler, jnp.nan))
    else:
        old_logprobs, actor_entropy = trainer_pass()
        trainer = old_logprobs
        entropies = actor_entropy if entropies is None else entropies
    ref = jax.tree.map(only_actions, in_row_chunks(n, lambda *a: continuation_scores(
        role_model(static, models, "reference"), role_params(static, "reference", frozen), *a,
        static.temperature, trunk), *args))
    if entropies is None:
        entropies = jnp.zeros_like(old_logprobs)
    if static.uses_critic:
        values, final_values = in_row_chunks(n, lambda *a: critic_outputs(
            models.critic, role_params(static, "critic", frozen, state.critic_params), *a, trunk),
            *args)
        values = only_actions(values)
    else:
        values = final_values = None
    scores, raw_scores = in_row_chunks(n, lambda *a: sequence_score(
        static, models, frozen, *a, trunk), *args, documents, host_scores)
    ended_with_eos = ends_with_eos(response_ids, actions, static.eos_id)
    penalties = length_penalties(static, actions.sum(axis=1))
    rewards, reward_metrics = losses.assemble_rewards(
        old_logprobs, ref.logprobs, scores, actions, kl_coef=state.kl_coef,
        kl_estimator=static.kl_estimator, reward_clip=static.reward_clip,
        missing_eos_penalty=static.missing_eos_penalty or None, ended_with_eos=ended_with_eos,
        length_penalties=penalties)
    if turn_rewards is not None:
        rewards = rewards + turn_rewards * actions
    exp = Experience(prompt_ids, prompt_mask, response_ids, response_mask, old_logprobs,
                     ref.logprobs, ref.base_logprobs,
                     jnp.zeros_like(old_logprobs) if values is None else values, scores, rewards,
                     ended_with_eos, entropies,
                     # Only Monte Carlo branches score again (with the gold function).
                     documents if estimators.ESTIMATORS[static.estimator].branches else None,
                     None if trunk is None else trunk[0],
                     sampler if static.rollout_correction != "none" else None,
                     action_mask=action_mask, turn_ids=turn_ids,
                     turn_rewards=None if turn_rewards is None else turn_rewards * actions,
                     versions=async_schedule.stamp_versions(actions, state.step)
                     if versions is None else jnp.where(actions != 0, versions,
                                                        async_schedule.NO_VERSION))
    seq_kl = (losses.kl_per_token(old_logprobs, ref.logprobs, "k1") * actions).sum(axis=1)
    metrics = {
        "objective/kl": seq_kl.mean(),
        "objective/entropy": (-old_logprobs * actions).sum(axis=1).mean(),
        "objective/scores": scores.mean(),
        "objective/raw_scores": raw_scores.mean(),
        "objective/non_score_reward": reward_metrics["non_score_reward"],
        "objective/rlhf_reward": reward_metrics["rlhf_reward"],
        "val/num_eos_tokens": ended_with_eos.sum().astype(jnp.float32),
        "val/response_length": actions.sum(axis=1).mean().astype(jnp.float32),
    }
    if turn_rewards is not None:
        # A trajectory's score is everything it earned: its turns' rewards too.
        returns = (turn_rewards * actions).sum(axis=1)
        metrics["objective/turn_rewards"] = returns.mean()
        metrics["objective/scores"] = (scores + returns).mean()
        metrics["objective/rlhf_reward"] = metrics["objective/rlhf_reward"] + losses.masked_mean(
            returns, actions.sum(axis=1) > 0)
    if penalties is not None:
        metrics["overlong/penalty_mean"] = penalties.mean()
    if final_values is not None:
        # How far the critic is from the reward's scale where the score is read (0 at the first
        # step when the critic starts from the reward model, rescaled to normalised scores).
        metrics["critic/score_value_error"] = jnp.abs(final_values - scores).mean()
    if sampler is not None and trainer is not None:
        metrics.update(rollout_mismatch(trainer, sampler, actions, static.cliprange))
    return exp, metrics


def ends_with_eos(response_ids, response_mask, eos_id):
    """`[B]` bool: the response's last valid token is (one of) `eos_id` (the last action token
    of a trajectory, whose mask has holes)."""
    positions = jnp.arange(response_mask.shape[1])
    last = jnp.maximum(jnp.where(response_mask != 0, positions, -1).max(axis=1), 0)
    last_tok = jnp.take_along_axis(response_ids, last[:, None], axis=1)[:, 0]
    eos = jnp.atleast_1d(jnp.asarray(eos_id))
    return jnp.isin(last_tok, eos) & (response_mask.sum(axis=1) > 0)
