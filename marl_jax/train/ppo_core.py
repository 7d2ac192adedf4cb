"""One PPO / MA-PPO step: the composition of its phases (`marl_jax.train.phases`).

    rollout      sample responses from the current actor
    score        old and reference logprobs, critic values, sequence score, per-token rewards
    advantages   termination -> segment ids, (macro) GAE or a critic-free estimator
    update       `ppo_epochs` x `num_minibatches` actor and critic updates, the KL controller

Everything here is a pure function of pytrees and is jitted by the caller: `train/ppo.py` for one
sharded run, `experiment.py` vmapped over arms and seeds. Hyper-parameters that arms of an
experiment vary (kl_coef, lam, gamma, ngram, termination, weighting, aggregation) are traced
values in `RunHparams`, so a single compiled program serves every arm. The step's types are in
`marl_jax.train.ppo_types`.
"""
from __future__ import annotations

import jax.numpy as jnp

from marl_jax.train.phases import advantages, rollout as rollout_phases, score, update
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PPOState, PPOStatic,
                                      RunHparams, step_keys)


def rollout(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
            prompt_mask, key, documents=None, first_step=None):
    """The rollout phase then the score phase: (Experience, metrics). The prompts `[B /
    group_size, P]` (and documents) are repeated to one row per sample."""
    sample = rollout_phases.generate_responses(static, models, state, prompt_ids, prompt_mask,
                                               key, frozen)
    prompt_ids, prompt_mask, documents = rollout_phases.repeat_groups(
        static, prompt_ids, prompt_mask, documents)
    return score.score(static, models, state, frozen, prompt_ids, prompt_mask, sample.tokens,
                       sample.mask.astype(jnp.int32), documents, sampled_logprobs=sample.logprobs,
                       sampled_entropy=sample.entropy, first_step=first_step)


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


def update_phase(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                 roll_metrics: dict, hparams: RunHparams, host_segments=None, frozen=None):
    """The second half (advantages and update): (state, metrics).

    `host_segments` (`[B, R]` int32) are the parsing termination's segment ids, computed on the
    host from the sampled text between the two halves.
    """
    _, k_segment, k_update = step_keys(state)
    adv, adv_metrics = advantages.compute_advantages(static, models, state, frozen, hparams,
                                                     exp, k_segment, host_segments)
    new_state, upd_metrics = update.update(static, models, state, exp, adv, k_update, frozen)
    new_state = new_state.replace(
        step=state.step + 1,
        kl_coef=update.adapt_kl_coef(static, state.kl_coef, roll_metrics["objective/kl"]),
        generated_tokens=state.generated_tokens + adv_metrics["budget/generated_tokens"],
        prefill_tokens=state.prefill_tokens + adv_metrics["budget/prefill_tokens"])
    metrics = {**roll_metrics, **upd_metrics, **adv_metrics,
               "objective/kl_coef": state.kl_coef,
               "budget/generated_tokens_total": new_state.generated_tokens}
    return new_state, metrics


def ppo_step(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
             hparams: RunHparams, prompt_ids, prompt_mask, documents=None, first_step=None):
    """rollout -> score -> advantages -> update, for on-device terminations. `first_step`: see
    `score.score`."""
    exp, roll_metrics = rollout_phase(static, models, state, frozen, prompt_ids, prompt_mask,
                                      documents, first_step)
    return update_phase(static, models, state, exp, roll_metrics, hparams, frozen=frozen)
