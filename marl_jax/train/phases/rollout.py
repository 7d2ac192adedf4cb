"""The rollout phase: `group_size` responses to each prompt, sampled by the current actor; with
dynamic sampling, the groups of the scored rollout a step trains on."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax import estimators
from marl_jax import rollout as rollout_engine
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PPOState, PPOStatic,
                                      in_row_chunks, role_params)


def generate_responses(static: PPOStatic, models: Models, state: PPOState, prompt_ids,
                       prompt_mask, key, frozen: Frozen = None):
    """Samples `group_size` responses to each of `prompt_ids [B / group_size, P]` from the
    current actor (each prompt prefilled once): `SampleOutput` with tokens, logprobs, mask and
    entropy `[B, R]`, the samples of a prompt in adjacent rows."""
    groups = {} if static.group_size == 1 else {"num_samples": static.group_size}
    actor = role_params(static, "actor", frozen, state.actor_params)
    k, n = static.group_size, static.rollout_chunks

    def sample(ids, mask, chunk_key):
        out = rollout_engine.generate(
            models.policy, actor, ids, mask, key=chunk_key,
            max_new_tokens=static.response_length, temperature=static.temperature,
            top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
            decode_slots=static.decode_slots, **groups)
        # [prompts, k, ...]: a prompt's samples stay adjacent when the chunks are joined.
        return jax.tree.map(lambda x: x.reshape((ids.shape[0], k) + x.shape[1:]), out)

    if n == 1:
        out = sample(prompt_ids, prompt_mask, key)
    else:
        # Row r's key is its chunk's, r % n: each chunk draws with one key.
        keys = jnp.tile(jax.random.split(key, n), prompt_ids.shape[0] // n)
        out = in_row_chunks(n, lambda ids, mask, row_keys: sample(ids, mask, row_keys[0]),
                            prompt_ids, prompt_mask, keys)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def repeat_groups(static: PPOStatic, *arrays):
    """Each row of every array (None passes through) repeated `group_size` times, adjacent."""
    if static.group_size == 1:
        return arrays
    return tuple(None if a is None else jnp.repeat(a, static.group_size, axis=0) for a in arrays)


def rollout_budget(static: PPOStatic, prompt_mask, response_mask):
    """`budget/generated_tokens` (every sampled token) and `budget/prefill_tokens` of a rollout
    of `response_mask [B, R]` from `prompt_mask [B, P]` (each prompt prefilled once for its
    group of samples), float32 scalars."""
    return {"budget/generated_tokens": response_mask.sum().astype(jnp.float32),
            "budget/prefill_tokens": prompt_mask.sum().astype(jnp.float32) / static.group_size}


def keep_informative_groups(static: PPOStatic, exp: Experience):
    """Dynamic sampling on a scored rollout: (Experience, metrics).

    With `group_size` >= 2 the metrics hold `dynamic/informative_share`, the share of the
    rollout's groups whose terminal rewards (`score.terminal_reward`: clipped score and
    penalties, what the group baselines see) are not all equal. With
    `dynamic_sampling_oversample` m > 1 the rollout holds m x `groups_per_step` groups; the
    Experience returned holds `batch_size` rows, the first `groups_per_step` informative groups
    in order (`estimators.informative_groups`), a shortfall filled with uninformative groups
    that `loss_rows` leaves out of the loss; `dynamic/groups_trained` says how many are
    informative. Otherwise `exp` is returned unchanged. The whole rollout's sampling budget
    is the caller's to count (`rollout_budget` before the selection).
    """
    if static.group_size < 2:
        return exp, {}
    lengths = exp.response_mask.sum(axis=1)
    rewards = jnp.where(lengths > 0, score.terminal_reward(static, exp.scores, exp.ended_with_eos,
                                                           lengths), 0.0)
    rows, trained, informative = estimators.informative_groups(rewards, static.group_size,
                                                               static.groups_per_step)
    sampled_groups = static.prompts_per_step
    metrics = {"dynamic/informative_share": informative.astype(jnp.float32) / sampled_groups}
    if static.dynamic_sampling_oversample == 1:
        return exp, metrics
    exp = jax.tree.map(lambda x: x[rows], exp)
    metrics["dynamic/groups_trained"] = jnp.minimum(informative, static.groups_per_step).astype(
        jnp.float32)
    return exp.replace(loss_rows=trained), metrics
