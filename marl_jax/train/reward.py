"""Stage 2: a Bradley-Terry reward model on preference pairs, started from the SFT backbone.

The reward normalisation statistics (mean and std of the reward model's scores over the
training responses, chosen and rejected) are saved with the model, so PPO can centre scores.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import distributed, losses
from marl_jax.models import last_token_score
from marl_jax.train import sharding, supervised


def pair_scores(reward_model, params, batch):
    """Scores `[B]` of the chosen and of the rejected responses, in one forward pass."""
    prompt_ids = jnp.concatenate([batch["prompt_ids"]] * 2, axis=0)
    prompt_mask = jnp.concatenate([batch["prompt_mask"]] * 2, axis=0)
    response_ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]], axis=0)
    response_mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1)
    scores = last_token_score(reward_model.apply({"params": params}, ids, mask), mask)
    b = batch["prompt_ids"].shape[0]
    return scores[:b], scores[b:]


def rm_loss(reward_model, params, batch):
    chosen, rejected = pair_scores(reward_model, params, batch)
    return losses.bradley_terry_loss(chosen, rejected)


def sequence_scores(reward_model, params, batch):
    """Scores `[B]` of the sequences `prompt_ids, prompt_mask, response_ids, response_mask`."""
    ids = jnp.concatenate([batch["prompt_ids"], batch["response_ids"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    return last_token_score(reward_model.apply({"params": params}, ids, mask), mask)


def all_pair_scores(reward_model, params, data, *, batch_size: int, max_rows: int = 0):
    """Host arrays (chosen `[M]`, rejected `[M]`) of the scores of the first `max_rows` (0: all)
    pairs of `data` (the `TaskData.rm` arrays).

    Each distinct (prompt, response) sequence is scored once: pairs cut from k samples of a
    prompt share their responses (k (k - 1) / 2 pairs, 2 k sequences scored). Batches hold
    `2 batch_size` sequences and are whole (the last one padded with its final sequence), so
    one shape compiles. With params on a mesh (global arrays, possibly over several processes)
    the sequences are placed on the same mesh and the scores gathered back, so every process
    gets the same numbers.
    """
    total = len(data["prompt_ids"])
    n = min(total, max_rows) if max_rows else total
    if n == 0:
        return np.zeros((0,), np.float32), np.zeros((0,), np.float32)
    data = {k: np.asarray(data[k])[:n] for k in PAIR_KEYS}
    seqs = dict(prompt_ids=np.concatenate([data["prompt_ids"]] * 2),
                prompt_mask=np.concatenate([data["prompt_mask"]] * 2),
                response_ids=np.concatenate([data["chosen_ids"], data["rejected_ids"]]),
                response_mask=np.concatenate([data["chosen_mask"], data["rejected_mask"]]))
    rows = np.concatenate([seqs[k].astype(np.int64) for k in SEQUENCE_KEYS], axis=1)
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    unique = {k: v[first] for k, v in seqs.items()}
    u, size = len(first), 2 * batch_size
    mesh = mesh_of(params)
    score = jax.jit(lambda p, b: sequence_scores(reward_model, p, b))
    scores = []
    for start in range(0, u, size):
        idx = np.minimum(np.arange(start, start + size), u - 1)
        batch = {k: v[idx] for k, v in unique.items()}
        if mesh is not None:
            batch = sharding.put_global(batch, mesh)
        scores.append(score(params, batch))
    # One fetch at the end: the batches run back to back, without a host round trip each.
    per_sequence = np.asarray(distributed.global_to_host(jnp.concatenate(scores)))[:u]
    out = per_sequence[np.reshape(inverse, -1)]
    return out[:n], out[n:]


SEQUENCE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
PAIR_KEYS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids",
             "rejected_mask")


def reward_stats(reward_model, params, data, *, batch_size: int, max_rows: int = 1024):
    """Mean and std of scores over up to `max_rows` pairs' chosen and rejected responses."""
    c, r = all_pair_scores(reward_model, params, data, batch_size=batch_size, max_rows=max_rows)
    s = np.concatenate([c, r])
    return {"mean": float(s.mean()), "std": float(max(s.std(), 1e-6))}


def pair_agreement(reward_model, params, pairs, *, batch_size: int) -> float:
    """The fraction of `pairs` (chosen / rejected as a reference labelled them, e.g. the gold)
    whose chosen response the reward model scores higher."""
    c, r = all_pair_scores(reward_model, params, pairs, batch_size=batch_size)
    return float(np.mean(c > r))


def sample_policy_pairs(policy, params, prompts: dict, label_pairs, *, key, sampler: dict,
                        batch_size: int) -> dict:
    """Preference pairs on what the policy produces: two responses per prompt sampled from
    `policy` (the SFT model PPO starts from), labelled by `label_pairs` (the task's annotator).

    Args:
      prompts: `ids` / `mask` `[K, P]` and `documents` `[K, D]` (host arrays).
      sampler: `sampling.generate` settings (max_new_tokens, temperature, top_k, top_p, eos_id,
        pad_id).
    Returns the `TaskData.rm` arrays of the K pairs (prompts, chosen and rejected `[K, R]`).
    """
    from marl_jax import sampling

    mesh = mesh_of(params)

    @jax.jit
    def generate(p, ids, mask, k):
        out = sampling.generate(policy, p, ids, mask, key=k, **sampler)
        return out.tokens, out.mask

    n = len(prompts["ids"])
    samples = []
    for start in range(0, n, batch_size):
        # Whole batches (the last one padded with its final row), each prompt twice in a row.
        rows = np.minimum(np.arange(start, start + batch_size), n - 1)
        ids = np.repeat(prompts["ids"][rows], 2, axis=0)
        mask = np.repeat(prompts["mask"][rows], 2, axis=0)
        if mesh is not None:
            ids, mask = sharding.put_global((ids, mask), mesh)
        samples.append(generate(params, ids, mask, jax.random.fold_in(key, start)))
    tokens, masks = (np.concatenate(x)[:2 * n]
                     for x in zip(*distributed.global_to_host(samples)))
    ids_a, ids_b, mask_a, mask_b = tokens[0::2], tokens[1::2], masks[0::2], masks[1::2]
    a_wins = np.asarray(label_pairs(prompts["documents"], ids_a, mask_a, ids_b, mask_b), bool)
    pick = lambda a, b: np.where(a_wins[:, None], a, b).astype(np.int32)
    return dict(prompt_ids=prompts["ids"], prompt_mask=prompts["mask"],
                chosen_ids=pick(ids_a, ids_b), chosen_mask=pick(mask_a, mask_b),
                rejected_ids=pick(ids_b, ids_a), rejected_mask=pick(mask_b, mask_a))


def mesh_of(params):
    """The mesh the params live on, or None for host arrays."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, jax.sharding.NamedSharding):
            return leaf.sharding.mesh
    return None


def run_rm(config, task, reward_model, init_params, *, mesh, writer, workdir):
    """Trains the reward model on `task.rm`; returns its params (resumes, or reuses a finished
    run)."""
    return supervised.train(
        name="rm", cfg=config.rm, seed=config.seed + 1, module=reward_model,
        init_params=init_params,
        loss_fn=lambda p, batch: rm_loss(reward_model, p, batch), data=task.rm, mesh=mesh,
        writer=writer, workdir=workdir, checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_to_keep=config.max_to_keep,
        metadata=dict(stage="rm", config=config.to_dict()), progress_keys=("loss", "accuracy"))
