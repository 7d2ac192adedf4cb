"""Stage 2: a Bradley-Terry reward model on preference pairs, started from the SFT backbone.

The reward normalisation statistics (mean and std of the reward model's scores over the
training responses, chosen and rejected) are saved with the model, so PPO can centre scores.
A reward model that trains only its top layers (`rm.num_layers_unfrozen`) runs the frozen
embeddings and layers below them once per distinct training sequence (`pair_trunk`); every step
and the statistics then run only the layers above.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import distributed, losses
from marl_jax.models import last_token_score
from marl_jax.models.heads import backbone_hidden, scalar_outputs, trunk_states
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


def frozen_trunk_layers(params, num_layers_unfrozen: int) -> int:
    """k = L - n, the layers that a stage training only its top n = `num_layers_unfrozen` of L
    unrolled layers leaves frozen with the embeddings (`optim.trainable_mask`); 0 when it trains
    them all (n < 0 or n >= L) or the layers are scanned."""
    backbone = params["backbone"]
    if num_layers_unfrozen < 0 or "layers" in backbone:
        return 0
    num_layers = sum(1 for name in backbone if name.startswith("layers_"))
    return max(num_layers - num_layers_unfrozen, 0)


@dataclasses.dataclass(frozen=True)
class PairTrunk:
    """The hidden states after the frozen embeddings and first `num_layers` layers of each
    distinct sequence of a set of pairs (host arrays), computed once: a reward model that trains
    only the layers above them runs just those layers on every step.

    states `[U, P + R, D]`, mask `[U, P + R]`: the U distinct prompt + response sequences;
    chosen, rejected `[N]`: each pair's rows of them.
    """
    states: np.ndarray
    mask: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    num_layers: int

    @property
    def num_pairs(self) -> int:
        return len(self.chosen)

    def training_data(self, data: dict) -> dict:
        """`data` (the pairs, `TaskData.rm` arrays) with each pair's `chosen_states`,
        `rejected_states` `[N, P + R, D]`, what `rm_loss_from_trunk` reads."""
        return dict(data, chosen_states=self.states[self.chosen],
                    rejected_states=self.states[self.rejected])


def pair_trunk(reward_model, params, data, num_layers: int, *, batch_size: int) -> PairTrunk:
    """The `PairTrunk` of every pair of `data` under `params` (their embeddings and first
    `num_layers` layers), each distinct sequence run once, `2 batch_size` a batch."""
    n = len(data["prompt_ids"])
    unique, inverse = unique_sequences(data, n)
    cfg = reward_model.config

    @jax.jit
    def run(p, b):
        ids = jnp.concatenate([b["prompt_ids"], b["response_ids"]], axis=1)
        mask = jnp.concatenate([b["prompt_mask"], b["response_mask"]], axis=1)
        return trunk_states(cfg, p, ids, mask, num_layers)

    states = _per_sequence(run, params, unique, 2 * batch_size)
    mask = np.concatenate([unique["prompt_mask"], unique["response_mask"]], axis=1)
    return PairTrunk(states=states, mask=mask.astype(np.int32), chosen=inverse[:n],
                     rejected=inverse[n:], num_layers=int(num_layers))


def trunk_sequence_scores(reward_model, params, batch, num_layers: int):
    """Scores `[B]` of sequences from their trunk states: `batch` `states [B, T, D]` (after the
    first `num_layers` layers) and `mask [B, T]`; layers `num_layers..L-1` and the head run."""
    cfg = reward_model.config
    hidden = backbone_hidden(cfg, params, None, batch["mask"], (batch["states"], num_layers))
    return last_token_score(scalar_outputs(cfg, params, hidden), batch["mask"])


def rm_loss_from_trunk(reward_model, num_layers: int, params, batch):
    """`rm_loss` on `PairTrunk.training_data` batches: the same loss, the frozen trunk not
    rerun."""
    def full_mask(response):
        return jnp.concatenate([batch["prompt_mask"], batch[response]], axis=1)

    b = batch["prompt_ids"].shape[0]
    scores = trunk_sequence_scores(reward_model, params, dict(
        states=jnp.concatenate([batch["chosen_states"], batch["rejected_states"]], axis=0),
        mask=jnp.concatenate([full_mask("chosen_mask"), full_mask("rejected_mask")], axis=0)),
        num_layers)
    return losses.bradley_terry_loss(scores[:b], scores[b:])


def unique_sequences(data, n: int):
    """The distinct (prompt, response) sequences of the first `n` pairs of `data`: (their
    `SEQUENCE_KEYS` arrays `[U, ...]`, the index `[2 n]` into them of each pair's chosen then
    rejected sequence). Pairs cut from k samples of a prompt share their responses
    (k (k - 1) / 2 pairs, k sequences)."""
    data = {k: np.asarray(data[k])[:n] for k in PAIR_KEYS}
    seqs = dict(prompt_ids=np.concatenate([data["prompt_ids"]] * 2),
                prompt_mask=np.concatenate([data["prompt_mask"]] * 2),
                response_ids=np.concatenate([data["chosen_ids"], data["rejected_ids"]]),
                response_mask=np.concatenate([data["chosen_mask"], data["rejected_mask"]]))
    rows = np.concatenate([seqs[k].astype(np.int64) for k in SEQUENCE_KEYS], axis=1)
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return {k: v[first] for k, v in seqs.items()}, np.reshape(inverse, -1)


def _per_sequence(fn, params, sequences: dict, batch_size: int) -> np.ndarray:
    """`fn(params, batch)` over `sequences` (host arrays `[U, ...]`) in whole batches of
    `batch_size` rows (the last one padded with its final row, so one shape compiles), the
    results `[U, ...]` fetched once at the end. With params on a mesh the batches are placed on
    the same mesh and the results gathered back, so every process gets the same numbers."""
    u = len(next(iter(sequences.values())))
    mesh = mesh_of(params)
    out = []
    for start in range(0, u, batch_size):
        idx = np.minimum(np.arange(start, start + batch_size), u - 1)
        batch = {k: v[idx] for k, v in sequences.items()}
        if mesh is not None:
            batch = sharding.put_global(batch, mesh)
        out.append(fn(params, batch))
    # One fetch at the end: the batches run back to back, without a host round trip each.
    return np.asarray(distributed.global_to_host(jnp.concatenate(out)))[:u]


def all_pair_scores(reward_model, params, data, *, batch_size: int, max_rows: int = 0,
                    trunk=None):
    """Host arrays (chosen `[M]`, rejected `[M]`) of the scores of the first `max_rows` (0: all)
    pairs of `data` (the `TaskData.rm` arrays).

    Each distinct (prompt, response) sequence is scored once (`unique_sequences`), in batches
    of `2 batch_size` sequences. With `trunk` (a `PairTrunk` of these pairs, `pair_trunk`) only
    the layers above it run.
    """
    total = len(data["prompt_ids"])
    n = min(total, max_rows) if max_rows else total
    if n == 0:
        return np.zeros((0,), np.float32), np.zeros((0,), np.float32)
    if trunk is not None:
        if trunk.num_pairs != total:
            raise ValueError(f"the reward model's trunk states are of {trunk.num_pairs} pairs, "
                             f"the data has {total}")
        score = jax.jit(lambda p, b: trunk_sequence_scores(reward_model, p, b, trunk.num_layers))
        per_sequence = _per_sequence(score, params, dict(states=trunk.states, mask=trunk.mask),
                                     2 * batch_size)
        out = per_sequence[np.concatenate([trunk.chosen, trunk.rejected])]
        return out[:total][:n], out[total:][:n]
    unique, inverse = unique_sequences(data, n)
    score = jax.jit(lambda p, b: sequence_scores(reward_model, p, b))
    out = _per_sequence(score, params, unique, 2 * batch_size)[inverse]
    return out[:n], out[n:]


SEQUENCE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
PAIR_KEYS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids",
             "rejected_mask")


def reward_stats(reward_model, params, data, *, batch_size: int, max_rows: int = 1024,
                 trunk=None):
    """Mean and std of scores over up to `max_rows` pairs' chosen and rejected responses (only
    the layers above `trunk`, a `PairTrunk` of `data`, run when given)."""
    c, r = all_pair_scores(reward_model, params, data, batch_size=batch_size, max_rows=max_rows,
                           trunk=trunk)
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


def run_rm(config, task, reward_model, init_params, *, mesh, writer, workdir, trunk=None):
    """Trains the reward model on `task.rm`; returns its params (resumes, or reuses a finished
    run). With `trunk` (the `PairTrunk` of `task.rm` under `init_params`, whose first
    `trunk.num_layers` layers the stage leaves frozen) each step runs only the layers above."""
    if trunk is None:
        data, loss_fn = task.rm, lambda p, batch: rm_loss(reward_model, p, batch)
    else:
        frozen = frozen_trunk_layers(init_params, int(config.rm.get("num_layers_unfrozen", -1)))
        if trunk.num_layers > frozen or trunk.num_pairs != len(task.rm["prompt_ids"]):
            raise ValueError(f"a reward-model trunk of {trunk.num_layers} layers and "
                             f"{trunk.num_pairs} pairs: the stage freezes {frozen} layers and "
                             f"has {len(task.rm['prompt_ids'])} pairs")
        data = trunk.training_data(task.rm)
        loss_fn = lambda p, batch: rm_loss_from_trunk(reward_model, trunk.num_layers, p, batch)
    return supervised.train(
        name="rm", cfg=config.rm, seed=config.seed + 1, module=reward_model,
        init_params=init_params, loss_fn=loss_fn, data=data, mesh=mesh,
        writer=writer, workdir=workdir, checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_to_keep=config.max_to_keep,
        metadata=dict(stage="rm", config=config.to_dict()), progress_keys=("loss", "accuracy"))
