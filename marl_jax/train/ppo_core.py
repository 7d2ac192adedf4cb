"""One PPO / MA-PPO step: the composition of its phases (`marl_jax.train.phases`).

    rollout      sample responses from the current actor
    score        old and reference logprobs, critic values, sequence score, per-token rewards
    advantages   termination -> segment ids, (macro) GAE or a critic-free estimator
    update       `ppo_epochs` x `num_minibatches` actor and critic updates, the KL controller

`ppo_step` is `rollout_phase` (rollout, score) then `update_phase` (advantages, update); each
phase is also a function of its own (`generate_phase`, `score_phase`, `advantages_phase`,
`update_from_advantages`), the programs `train/phased_step.py` runs and times one by one.
Everything here is a pure function of pytrees and is jitted by the caller: `train/ppo.py` for one
sharded run, `experiment.py` vmapped over arms and seeds. Hyper-parameters that arms of an
experiment vary (kl_coef, lam, gamma, ngram, termination, weighting, aggregation) are traced
values in `RunHparams`, so a single compiled program serves every arm. The step's types are in
`marl_jax.train.ppo_types`.
"""
from __future__ import annotations

import jax.numpy as jnp

from marl_jax.rollout import turns
from marl_jax.train import async_schedule
from marl_jax.train.phases import advantages, rollout as rollout_phases, score, update
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PartialBatch, PPOState,
                                      PPOStatic, RunHparams, step_keys)


def score_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
                prompt_mask, sample, documents=None, host_scores=None, first_step=None):
    """The score phase on a rollout's `sample` (a `SampleOutput` `[prompts_per_step *
    group_size, R]`): the prompts `[prompts_per_step, P]` (and documents) repeated to one row
    per sample, then `score.score`; with dynamic sampling the groups trained on are kept
    (`rollout.keep_informative_groups`): (Experience `[B, ...]`, metrics). The metrics carry
    the rollout's sampling budget (`budget/*`, every sampled row's) as replicated scalars: the
    Experience holds only row-split `[B, ...]` leaves."""
    prompt_ids, prompt_mask, documents = rollout_phases.repeat_groups(
        static, prompt_ids, prompt_mask, documents)
    response_mask = sample.mask.astype(jnp.int32)
    exp, metrics = score.score(static, models, state, frozen, prompt_ids, prompt_mask,
                               sample.tokens, response_mask, documents,
                               host_scores, sampled_logprobs=sample.logprobs,
                               sampled_entropy=sample.entropy, first_step=first_step)
    budget = rollout_phases.rollout_budget(static, prompt_mask, response_mask)
    exp, group_metrics = rollout_phases.keep_informative_groups(static, exp)
    return exp, {**metrics, **budget, **group_metrics}


def score_trajectory_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                           prompt_ids, prompt_mask, trajectory: dict, first_step=None):
    """The score phase on multi-turn trajectories (`rollout.turns.run_turns`, one row per
    sample, the prompts `[B, P]` already repeated): `trajectory` holds the `[B, T]` arrays
    `tokens`, `kinds`, `turn_ids`, `logprobs`, `entropy`, `turn_rewards` and the `[B]` flags
    `truncated`, `failed`. The forward passes read the observations, the policy's terms the
    action tokens only (`score.score`); the environment's rewards are the turn rewards (no
    sequence score on top). (Experience `[B, ...]`, metrics with the rollout's budget: the
    action tokens generated, the prompt and observation tokens prefilled.) An asynchronous
    trajectory's `versions [B, T]` (the version of each turn's policy, `train/async_turns.py`)
    are kept, with the batch's accounting (`async_accounting`); without them every action token
    is the actor's."""
    kinds = trajectory["kinds"]
    context = (kinds != turns.PAD).astype(jnp.int32)
    actions = (kinds == turns.ACTION).astype(jnp.int32)
    versions = trajectory.get("versions")
    exp, metrics = score.score(
        static, models, state, frozen, prompt_ids, prompt_mask, trajectory["tokens"], context,
        host_scores=jnp.zeros(kinds.shape[:1], jnp.float32),
        sampled_logprobs=trajectory["logprobs"], sampled_entropy=trajectory["entropy"],
        first_step=first_step, action_mask=actions, turn_ids=trajectory["turn_ids"],
        turn_rewards=trajectory["turn_rewards"], versions=versions)
    if versions is not None:
        metrics.update(async_accounting(static, state.step, actions, versions,
                                        jnp.ones(kinds.shape[:1], bool)))
    # A row whose environment failed (it raised or answered something malformed) leaves the
    # loss: an infrastructure failure is no evidence about the policy
    # (`multiturn/failed_frac` counts these rows).
    exp = exp.replace(loss_rows=~jnp.asarray(trajectory["failed"], bool))
    turn_count = jnp.where(actions != 0, trajectory["turn_ids"] + 1, 0).max(axis=1)
    observed = (kinds == turns.OBSERVATION).sum()
    metrics = dict(metrics, **{
        "budget/generated_tokens": actions.sum().astype(jnp.float32),
        "budget/prefill_tokens": (prompt_mask.sum() + observed).astype(jnp.float32),
        "multiturn/turns_avg": turn_count.mean().astype(jnp.float32),
        "multiturn/observation_tokens_avg": (observed / kinds.shape[0]).astype(jnp.float32),
        "multiturn/truncated_frac": trajectory["truncated"].astype(jnp.float32).mean(),
        "multiturn/failed_frac": trajectory["failed"].astype(jnp.float32).mean()})
    return exp, metrics


def score_async_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                      batch: PartialBatch):
    """The score phase of asynchronous PPO on a batch whose chunks are all decoded
    (`train/async_step.py`): the actor's logprobs are the proximal policy's (version
    `state.step`), the sampler's stay as the behaviour policy's, each token keeps its version;
    the groups still unfinished leave the loss (`loss_rows`: they carry over). (Experience,
    metrics with the batch's accounting: `async/batch_tokens_trained` and
    `async/batch_tokens_masked` (the tokens of the rows trained more than `max_token_staleness`
    versions old), the token-weighted
    staleness of each trained response from its oldest token, `async/staleness_avg`, and the
    widest version span within one, `async/version_span_max`.)"""
    exp, metrics = score.score(static, models, state, frozen, batch.prompt_ids,
                               batch.prompt_mask, batch.tokens, batch.mask, batch.documents,
                               sampled_logprobs=batch.logprobs, sampled_entropy=batch.entropy,
                               versions=batch.versions)
    budget = rollout_phases.rollout_budget(static, batch.prompt_mask, batch.mask)
    exp, group_metrics = rollout_phases.keep_informative_groups(static, exp)
    trained = ~rollout_phases.unfinished_groups(static, batch)
    accounting = async_accounting(static, state.step, batch.mask, batch.versions, trained)
    return exp.replace(loss_rows=trained), {**metrics, **budget, **group_metrics, **accounting,
                                            "async/carried_frac": 1.0 - trained.astype(
                                                jnp.float32).mean()}


def async_accounting(static: PPOStatic, step, actions, versions, trained):
    """The accounting of a batch an asynchronous update `step` trains on, its policy's tokens
    `actions [B, R]` with their `versions [B, R]`, the rows `trained [B]`: the tokens trained
    and those masked (more than `static.max_token_staleness` versions old), the token-weighted
    staleness of each trained response from its oldest token, the widest version span within
    one."""
    tokens = (actions != 0) & trained[:, None]
    fresh = async_schedule.fresh_tokens(versions, step, static.max_token_staleness)
    oldest = jnp.where(tokens, versions, jnp.iinfo(jnp.int32).max).min(axis=1)
    newest = jnp.where(tokens, versions, -1).max(axis=1)
    lengths = tokens.sum(axis=1)
    staleness = jnp.where(lengths > 0, step - oldest, 0)
    return {"async/batch_tokens_trained": (tokens & fresh).sum().astype(jnp.int32),
            "async/batch_tokens_masked": (tokens & ~fresh).sum().astype(jnp.int32),
            "async/staleness_avg": ((lengths * staleness).sum()
                                    / jnp.maximum(lengths.sum(), 1)).astype(jnp.float32),
            "async/version_span_max": jnp.where(lengths > 0, newest - oldest, 0).max().astype(
                jnp.int32)}


def rollout(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
            prompt_mask, key, documents=None, first_step=None):
    """The rollout phase then the score phase: (Experience, metrics). The prompts
    `[prompts_per_step, P]` (and documents) are repeated to one row per sample; with dynamic
    sampling the groups trained on are kept (`rollout.keep_informative_groups`)."""
    sample = rollout_phases.generate_responses(static, models, state, prompt_ids, prompt_mask,
                                               key, frozen)
    return score_phase(static, models, state, frozen, prompt_ids, prompt_mask, sample, documents,
                       first_step=first_step)


def rollout_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                  prompt_ids, prompt_mask, documents=None, first_step=None):
    """The first half of a step (rollout and score): (Experience, rollout metrics).
    `first_step`: see `score.score`."""
    return rollout(static, models, state, frozen, prompt_ids, prompt_mask, step_keys(state)[0],
                   documents, first_step)


def generate_phase(static: PPOStatic, models: Models, state: PPOState, prompt_ids,
                   prompt_mask, frozen: Frozen = None):
    """The sampling part of `rollout_phase` alone, for steps with host work in between (parsing
    termination, host-computed rewards): a `SampleOutput`."""
    return rollout_phases.generate_responses(static, models, state, prompt_ids, prompt_mask,
                                             step_keys(state)[0], frozen)


def advantages_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                     hparams: RunHparams, exp: Experience, host_segments=None):
    """The advantages phase (`advantages.compute_advantages` with the step's segment key):
    (Advantages, metrics)."""
    _, k_segment, _ = step_keys(state)
    return advantages.compute_advantages(static, models, state, frozen, hparams, exp, k_segment,
                                         host_segments)


def update_from_advantages(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                           adv: advantages.Advantages, roll_metrics: dict, adv_metrics: dict,
                           frozen=None):
    """The update phase (`update.update` with the step's update key), the KL controller and the
    step's counts: (state, the step's metrics: the rollout's, the update's, the advantages')."""
    _, _, k_update = step_keys(state)
    new_state, upd_metrics = update.update(static, models, state, exp, adv, k_update, frozen)
    # The step's budget: the rollout's (score phase) and any Monte Carlo branches'.
    budget = {k: roll_metrics[k] + adv_metrics.get(k.replace("budget/", "budget/branch_"), 0.0)
              for k in ("budget/generated_tokens", "budget/prefill_tokens")}
    new_state = new_state.replace(
        step=state.step + 1,
        kl_coef=update.adapt_kl_coef(static, state.kl_coef, roll_metrics["objective/kl"]),
        generated_tokens=state.generated_tokens + budget["budget/generated_tokens"],
        prefill_tokens=state.prefill_tokens + budget["budget/prefill_tokens"])
    metrics = {**roll_metrics, **upd_metrics, **adv_metrics, **budget,
               "objective/kl_coef": state.kl_coef,
               "budget/generated_tokens_total": new_state.generated_tokens}
    return new_state, metrics


def update_phase(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                 roll_metrics: dict, hparams: RunHparams, host_segments=None, frozen=None):
    """The second half (advantages and update): (state, metrics).

    `host_segments` (`[B, R]` int32) are the parsing termination's segment ids, computed on the
    host from the sampled text between the two halves.
    """
    adv, adv_metrics = advantages_phase(static, models, state, frozen, hparams, exp,
                                        host_segments)
    return update_from_advantages(static, models, state, exp, adv, roll_metrics, adv_metrics,
                                  frozen)


def ppo_step(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
             hparams: RunHparams, prompt_ids, prompt_mask, documents=None, first_step=None):
    """rollout -> score -> advantages -> update, for on-device terminations. `first_step`: see
    `score.score`."""
    exp, roll_metrics = rollout_phase(static, models, state, frozen, prompt_ids, prompt_mask,
                                      documents, first_step)
    return update_phase(static, models, state, exp, roll_metrics, hparams, frozen=frozen)
