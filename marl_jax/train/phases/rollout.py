"""The rollout phase: `group_size` responses to each prompt, sampled by the current actor."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax import rollout as rollout_engine
from marl_jax.train.ppo_types import Frozen, Models, PPOState, PPOStatic, in_row_chunks, role_params


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
