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
from marl_jax.train.optim import adapter_weight_decay


def pair_scores(reward_model, params, batch, rngs=None):
    """Scores `[B]` of the chosen and of the rejected responses, in one forward pass."""
    prompt_ids = jnp.concatenate([batch["prompt_ids"]] * 2, axis=0)
    prompt_mask = jnp.concatenate([batch["prompt_mask"]] * 2, axis=0)
    response_ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]], axis=0)
    response_mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1)
    scores = last_token_score(reward_model.apply({"params": params}, ids, mask, rngs=rngs), mask)
    b = batch["prompt_ids"].shape[0]
    return scores[:b], scores[b:]


def rm_loss(reward_model, params, batch, rngs=None):
    chosen, rejected = pair_scores(reward_model, params, batch, rngs)
    return losses.bradley_terry_loss(chosen, rejected)


def sequence_scores(reward_model, params, batch, rngs=None):
    """Scores `[B]` of the sequences `prompt_ids, prompt_mask, response_ids, response_mask`."""
    ids = jnp.concatenate([batch["prompt_ids"], batch["response_ids"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    return last_token_score(reward_model.apply({"params": params}, ids, mask, rngs=rngs), mask)


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


@dataclasses.dataclass(frozen=True)
class PromptGroups:
    """Preference pairs grouped by prompt, InstructGPT's "all K-choose-2 comparisons of a prompt
    as one batch element": a step scores each distinct response of its prompts once and puts
    every labelled pair among them into the loss (k samples of a prompt give k (k - 1) / 2
    pairs for k forward passes, where pair batches need k (k - 1)).

    sequences `[G, K]`: each group's distinct sequences, as rows of `unique_sequences` of the
    pairs (a group with fewer than K repeats its first); win, lose `[G, M]`: the slots in
    `0..K-1` of each pair's preferred and other response; pair_mask `[G, M]` float32, 0 on the
    padding of a group with fewer than M pairs.
    """
    sequences: np.ndarray
    win: np.ndarray
    lose: np.ndarray
    pair_mask: np.ndarray

    @property
    def num_pairs(self) -> int:
        return int(self.pair_mask.sum())

    def training_data(self, data: dict, trunk: "PairTrunk | None" = None) -> dict:
        """Rows of groups: the pairs' slots and either the groups' token arrays (`prompt_ids`,
        `prompt_mask` `[G, P]`, `response_ids`, `response_mask` `[G, K, R]`) or, with `trunk`
        (the `PairTrunk` of the same pairs), their trunk `states [G, K, P + R, D]` and
        `mask [G, K, P + R]`; what `grouped_rm_loss` reads."""
        out = dict(win=self.win, lose=self.lose, pair_mask=self.pair_mask)
        if trunk is not None:
            return dict(out, states=trunk.states[self.sequences], mask=trunk.mask[self.sequences])
        unique, _ = unique_sequences(data, len(data["prompt_ids"]))
        first = self.sequences[:, 0]
        return dict(out, prompt_ids=unique["prompt_ids"][first],
                    prompt_mask=unique["prompt_mask"][first],
                    response_ids=unique["response_ids"][self.sequences],
                    response_mask=unique["response_mask"][self.sequences])


def prompt_groups(data) -> PromptGroups:
    """The `PromptGroups` of the pairs of `data` (`TaskData.rm` arrays): pairs with the same
    prompt tokens form a group, in the order of their first pair."""
    n = len(data["prompt_ids"])
    if n == 0:
        raise ValueError("prompt_groups: no preference pairs")
    _, inverse = unique_sequences(data, n)
    chosen, rejected = inverse[:n], inverse[n:]
    prompts = np.concatenate([np.asarray(data["prompt_ids"]), np.asarray(data["prompt_mask"])],
                             axis=1)
    _, first, group = np.unique(prompts, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    group = rank[np.reshape(group, -1)]
    members = [[] for _ in first]
    pairs = [[] for _ in first]
    for g, c, r in zip(group, chosen, rejected):
        slots = members[g]
        for seq in (c, r):
            if seq not in slots:
                slots.append(seq)
        pairs[g].append((slots.index(c), slots.index(r)))
    k = max(len(m) for m in members)
    m = max(len(p) for p in pairs)
    win, lose = np.zeros((len(first), m), np.int32), np.zeros((len(first), m), np.int32)
    pair_mask = np.zeros((len(first), m), np.float32)
    for g, group_pairs in enumerate(pairs):
        for j, (a, b) in enumerate(group_pairs):
            win[g, j], lose[g, j], pair_mask[g, j] = a, b, 1.0
    sequences = np.array([s + [s[0]] * (k - len(s)) for s in members], np.int64)
    return PromptGroups(sequences=sequences, win=win, lose=lose, pair_mask=pair_mask)


def grouped_scores(reward_model, params, batch, num_layers: int = 0, rngs=None):
    """Scores `[B, K]` of the responses of a batch of `PromptGroups.training_data` rows (from
    their trunk states when the batch has them: `num_layers` is then the trunk's depth)."""
    if "states" in batch:
        b, k = batch["mask"].shape[:2]
        flat = dict(states=batch["states"].reshape((b * k,) + batch["states"].shape[2:]),
                    mask=batch["mask"].reshape(b * k, -1))
        return trunk_sequence_scores(reward_model, params, flat, num_layers).reshape(b, k)
    b, k, r = batch["response_ids"].shape
    flat = dict(prompt_ids=jnp.repeat(batch["prompt_ids"], k, axis=0),
                prompt_mask=jnp.repeat(batch["prompt_mask"], k, axis=0),
                response_ids=batch["response_ids"].reshape(b * k, r),
                response_mask=batch["response_mask"].reshape(b * k, r))
    return sequence_scores(reward_model, params, flat, rngs).reshape(b, k)


def grouped_rm_loss(reward_model, params, batch, num_layers: int = 0, rngs=None):
    """The Bradley-Terry loss averaged over every pair of a batch of prompt groups: the
    `rm_loss` of those pairs as one pair batch, each response run once."""
    scores = grouped_scores(reward_model, params, batch, num_layers, rngs)
    pick = lambda slots: jnp.take_along_axis(scores, slots, axis=1).reshape(-1)
    return losses.bradley_terry_loss(pick(batch["win"]), pick(batch["lose"]),
                                     batch["pair_mask"].reshape(-1))


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
      sampler: `rollout.generate` settings (max_new_tokens, temperature, top_k, top_p, eos_id,
        pad_id).
    Returns the `TaskData.rm` arrays of the K pairs (prompts, chosen and rejected `[K, R]`).
    """
    from marl_jax import rollout

    mesh = mesh_of(params)

    @jax.jit
    def generate(p, ids, mask, k):
        out = rollout.generate(policy, p, ids, mask, key=k, **sampler)
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
    `trunk.num_layers` layers the stage leaves frozen) each step runs only the layers above.
    With `config.rm.group_by_prompt` a batch is `rm.batch_size` prompts with all their pairs
    (`PromptGroups`), else `rm.batch_size` pairs."""
    if trunk is not None:
        frozen = frozen_trunk_layers(init_params, int(config.rm.get("num_layers_unfrozen", -1)))
        if trunk.num_layers > frozen or trunk.num_pairs != len(task.rm["prompt_ids"]):
            raise ValueError(f"a reward-model trunk of {trunk.num_layers} layers and "
                             f"{trunk.num_pairs} pairs: the stage freezes {frozen} layers and "
                             f"has {len(task.rm['prompt_ids'])} pairs")
    weight_fn = None
    widths = [task.rm["prompt_ids"].shape[1] + task.rm[k].shape[1]
              for k in ("chosen_ids", "rejected_ids")]
    sequences = tuple((1, w) for w in widths)  # the prompt with each response of a pair
    if config.rm.get("group_by_prompt", False):
        groups = prompt_groups(task.rm)
        data = groups.training_data(task.rm, trunk)
        layers = 0 if trunk is None else trunk.num_layers
        loss_fn = lambda p, batch, rngs=None: grouped_rm_loss(reward_model, p, batch, layers, rngs)
        # Micro-batches of gradient accumulation weigh by their pairs: the mean over the pairs.
        weight_fn = lambda batch: batch["pair_mask"].sum()
        sequences = ((groups.sequences.shape[1], widths[0]),)
    elif trunk is None:
        data, loss_fn = task.rm, lambda p, batch, rngs=None: rm_loss(reward_model, p, batch, rngs)
    else:
        data = trunk.training_data(task.rm)
        loss_fn = lambda p, batch: rm_loss_from_trunk(reward_model, trunk.num_layers, p, batch)
    return supervised.train(
        name="rm", cfg=config.rm, seed=config.seed + 1, module=reward_model,
        init_params=init_params, loss_fn=loss_fn, data=data, mesh=mesh,
        writer=writer, workdir=workdir, checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_to_keep=config.max_to_keep,
        metadata=dict(stage="rm", config=config.to_dict()), progress_keys=("loss", "accuracy"),
        weight_fn=weight_fn, sequences=sequences,
        lora_weight_decay=adapter_weight_decay(config) or 0.0)
