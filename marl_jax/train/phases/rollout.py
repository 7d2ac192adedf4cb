"""The rollout phase: `group_size` responses to each prompt, sampled by the current actor; with
dynamic sampling, the groups of the scored rollout a step trains on. Asynchronous PPO's sampler
(`train/async_step.py`) decodes its batches chunk by chunk (`decode_chunk`) and carries the
groups still unfinished after their chunks into a later batch (`carry_over`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax import estimators
from marl_jax import rollout as rollout_engine
from marl_jax.train import async_schedule
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import (Experience, Frozen, Models, PartialBatch, PPOState,
                                      PPOStatic, in_row_chunks, role_params)


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


# Asynchronous PPO's sampler -----------------------------------------------------------------------

def empty_batch(static: PPOStatic, prompt_ids, prompt_mask, documents=None) -> PartialBatch:
    """A batch of the prompts `[B / group_size, P]` (and documents), each repeated to its
    `group_size` rows, with nothing sampled yet."""
    prompt_ids, prompt_mask, documents = repeat_groups(static, prompt_ids, prompt_mask, documents)
    return PartialBatch(prompt_ids, prompt_mask, *_no_responses(static, prompt_ids.shape[0]),
                        documents=documents)


def _no_responses(static: PPOStatic, rows: int):
    """(tokens, mask, logprobs, entropy, versions) `[rows, R]` of responses not yet begun."""
    shape = (rows, static.response_length)
    return (jnp.full(shape, static.pad_id, jnp.int32), jnp.zeros(shape, jnp.int32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.full(shape, async_schedule.NO_VERSION, jnp.int32))


def finished_rows(static: PPOStatic, batch: PartialBatch):
    """`[B]` bool: the responses that ended (an EOS token) or filled the budget."""
    return score.ends_with_eos(batch.tokens, batch.mask, static.eos_id) | (
        batch.mask.sum(axis=1) >= static.response_length)


def unfinished_groups(static: PPOStatic, batch: PartialBatch):
    """`[B]` bool: the rows of the groups (a prompt's `group_size` adjacent rows) that have a
    response still going: after a batch's last chunk they carry over (`carry_over`), and the
    update leaves them out."""
    going = ~finished_rows(static, batch)
    groups = going.reshape(-1, static.group_size).any(axis=1)
    return jnp.repeat(groups, static.group_size)


def carry_over(static: PPOStatic, finished: PartialBatch, fresh: PartialBatch, target_step):
    """The batch trained by update `target_step`: `fresh` (its own prompts, nothing sampled),
    with the unfinished groups of `finished` (a batch whose chunks are all decoded) in the places
    of its groups at the same positions. A finished row of such a group whose tokens would all
    be more than `static.max_token_staleness` versions old at `target_step` is cleared, to be
    sampled again from its prompt. Returns (batch, tokens cleared, groups carried)."""
    carried = unfinished_groups(static, finished)
    pick = lambda old, new: jnp.where(  # noqa: E731
        carried.reshape((-1,) + (1,) * (old.ndim - 1)), old, new)
    batch = jax.tree.map(pick, finished, fresh)
    cleared = jnp.zeros((), jnp.int32)
    if static.max_token_staleness >= 0:
        newest = batch.versions.max(axis=1)
        expired = carried & finished_rows(static, finished) & (
            target_step - newest > static.max_token_staleness)
        cleared = (batch.mask * expired[:, None]).sum().astype(jnp.int32)
        restart = lambda old, new: jnp.where(expired[:, None], new, old)  # noqa: E731
        fields = ("tokens", "mask", "logprobs", "entropy", "versions")
        batch = batch.replace(**{name: restart(getattr(batch, name), value) for name, value in
                                 zip(fields, _no_responses(static, batch.tokens.shape[0]))})
    return batch, cleared, (carried.sum() // static.group_size).astype(jnp.int32)


def decode_chunk(static: PPOStatic, models: Models, params, batch: PartialBatch, key, version,
                 steps: int):
    """Up to `steps` more tokens of every unfinished response of `batch`, sampled by `params`
    (policy version `version`): each row's prompt and response so far are prefilled again with
    these weights (the KV cache of the version before is not reused), then it decodes from its
    own position with the draws `generate(key=key)` gives its row there
    (`rollout.continue_responses`). Returns (batch with the new tokens stamped `version`, tokens
    sampled, tokens prefilled)."""
    lengths = batch.mask.sum(axis=1)
    out = rollout_engine.continue_responses(
        models.policy, params, batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask,
        lengths, key=key, max_new_tokens=steps, temperature=static.temperature,
        top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
        decode_slots=static.decode_slots or None)
    new = (out.mask != 0) & (jnp.arange(out.mask.shape[1])[None] >= lengths[:, None])
    going = ~finished_rows(static, batch)
    prefilled = ((batch.prompt_mask.sum(axis=1) + lengths) * going).sum()
    batch = batch.replace(tokens=out.tokens, mask=out.mask.astype(jnp.int32),
                          logprobs=jnp.where(new, out.logprobs, batch.logprobs),
                          entropy=jnp.where(new, out.entropy, batch.entropy),
                          versions=jnp.where(new, jnp.asarray(version, jnp.int32),
                                             batch.versions))
    return batch, new.sum().astype(jnp.int32), prefilled.astype(jnp.int32)
