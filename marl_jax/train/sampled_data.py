"""SFT demonstrations and preference pairs made from a model's own samples, picked by a gold.

For a task that ships prompts only (the review task): k responses of the initial model to each
prompt, scored by the task's gold on their decoded text, become

- best-of-k SFT data: each prompt's highest-gold response (`best_of_k`);
- preference pairs labelled by a Bradley-Terry annotator with noise (`labelled_pairs`): of two
  responses with gold g_a and g_b the annotator prefers a with probability
  sigmoid((g_a - g_b) / temperature) (temperature 0: the gold's preference exactly);
- held-out pairs labelled by the gold alone, on which the reward model's agreement with the gold
  is measured.

The samples are written once to `<workdir>/sampled/<part>.npz` (complete or absent: written to a
temporary file and renamed) with the settings that made them; a later run reuses them and
refuses samples made with other settings.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from marl_jax import distributed
from marl_jax.train import sharding

SAMPLED_DIR = "sampled"


def sample_responses(policy, params, prompts: dict, *, num_samples: int, key, sampler: dict,
                     batch_size: int, desc: str = "sample"):
    """`num_samples` responses to each prompt: (ids, mask) int32 host arrays `[N, k, R]`.

    Args:
      prompts: `ids` / `mask` `[N, P]` host arrays (left-padded).
      sampler: `rollout.generate` settings (max_new_tokens, temperature, top_k, top_p, eos_id,
        pad_id).
      batch_size: prompts per call (the last batch is padded with its final prompt, so every
        call has one compiled shape).
      desc: the name of the progress line (`[<desc>] step i/n ...`, on process 0).
    """
    from marl_jax.train.metrics import ProgressBar

    from marl_jax import rollout
    from marl_jax.train.reward import mesh_of

    mesh = mesh_of(params)

    @jax.jit
    def generate(p, ids, mask, k):
        out = rollout.generate(policy, p, ids, mask, key=k, num_samples=num_samples, **sampler)
        return out.tokens, out.mask.astype(np.int32)

    n = len(prompts["ids"])
    if n == 0:
        raise ValueError("sample_responses: no prompts")
    outputs = []
    starts = range(0, n, batch_size)
    with ProgressBar(len(starts), desc=desc) as progress:
        for i, start in enumerate(starts):
            rows = np.minimum(np.arange(start, start + batch_size), n - 1)
            ids, mask = prompts["ids"][rows], prompts["mask"][rows]
            if mesh is not None:
                ids, mask = sharding.put_global((ids, mask), mesh)
            outputs.append(jax.block_until_ready(
                generate(params, ids, mask, jax.random.fold_in(key, start))))
            progress.update(i + 1, {"prompts": min(start + batch_size, n)})
    tokens, masks = (np.concatenate(x)[:n * num_samples]
                     for x in zip(*distributed.global_to_host(outputs)))
    shape = (n, num_samples, tokens.shape[-1])
    return tokens.reshape(shape).astype(np.int32), masks.reshape(shape).astype(np.int32)


def best_of_k(prompts: dict, ids, mask, gold) -> dict:
    """`TaskData.sft` arrays: each prompt with its highest-gold response (the first on ties).

    prompts `[N, P]`; ids, mask `[N, k, R]`; gold `[N, k]`.
    """
    gold = np.asarray(gold)
    _check_shapes(prompts, ids, mask, gold)
    best = np.argmax(gold, axis=1)
    rows = np.arange(len(best))
    return dict(prompt_ids=prompts["ids"], prompt_mask=prompts["mask"],
                response_ids=ids[rows, best], response_mask=mask[rows, best])


def labelled_pairs(prompts: dict, ids, mask, gold, *, temperature: float, rng,
                   pairs_per_prompt: int = 0) -> dict:
    """`TaskData.rm` arrays of pairs of responses to the same prompt, labelled by a noisy
    Bradley-Terry annotator.

    Pairs whose responses are the same tokens or have the same gold are left out (no
    preference to learn). With `pairs_per_prompt` > 0 at most that many pairs of each prompt
    are kept, picked at random.

    Args:
      prompts `[N, P]`; ids, mask `[N, k, R]`; gold `[N, k]`.
      temperature: the annotator's noise; 0 labels by the gold alone.
      rng: a `numpy.random.Generator` (the pairs picked and the labels drawn).
    Returns the pairs' prompt / chosen / rejected arrays and `a_index`, `b_index`, `prompt_index`
    and `gold_agrees` (whether the chosen response has the higher gold) `[M]`.
    """
    gold = np.asarray(gold, np.float64)
    _check_shapes(prompts, ids, mask, gold)
    if temperature < 0:
        raise ValueError(f"annotator temperature={temperature} must be >= 0")
    n, k = gold.shape
    chosen, rejected, agrees, where = [], [], [], []
    for i in range(n):
        pairs = [(a, b) for a in range(k) for b in range(a + 1, k)
                 if gold[i, a] != gold[i, b] and not _same_tokens(ids[i], mask[i], a, b)]
        if pairs_per_prompt and len(pairs) > pairs_per_prompt:
            pick = rng.choice(len(pairs), size=pairs_per_prompt, replace=False)
            pairs = [pairs[j] for j in sorted(pick)]
        for a, b in pairs:
            diff = gold[i, a] - gold[i, b]
            if temperature == 0:
                a_wins = diff > 0
            else:
                a_wins = rng.random() < 1.0 / (1.0 + np.exp(-diff / temperature))
            win, lose = (a, b) if a_wins else (b, a)
            chosen.append((i, win))
            rejected.append((i, lose))
            agrees.append(bool(gold[i, win] > gold[i, lose]))
            where.append((i, a, b))
    if not chosen:
        raise ValueError("labelled_pairs: every pair of responses ties on the gold or repeats "
                         "the same tokens; no preference pair to make")
    c, r = np.asarray(chosen), np.asarray(rejected)
    where = np.asarray(where)
    return dict(prompt_ids=prompts["ids"][c[:, 0]], prompt_mask=prompts["mask"][c[:, 0]],
                chosen_ids=ids[c[:, 0], c[:, 1]], chosen_mask=mask[c[:, 0], c[:, 1]],
                rejected_ids=ids[r[:, 0], r[:, 1]], rejected_mask=mask[r[:, 0], r[:, 1]],
                prompt_index=where[:, 0], a_index=where[:, 1], b_index=where[:, 2],
                gold_agrees=np.asarray(agrees))


def _same_tokens(ids, mask, a, b) -> bool:
    return bool(np.array_equal(mask[a], mask[b]) and np.array_equal(ids[a] * mask[a],
                                                                    ids[b] * mask[b]))


def _check_shapes(prompts, ids, mask, gold):
    ids, mask = np.asarray(ids), np.asarray(mask)
    n = len(prompts["ids"])
    if ids.ndim != 3 or ids.shape != mask.shape or ids.shape[0] != n or gold.shape != ids.shape[:2]:
        raise ValueError(f"sampled responses: ids {ids.shape} and mask {mask.shape} must be "
                         f"[N={n}, k, R] and gold {gold.shape} [N, k]")


# ---- the samples on disk -------------------------------------------------------------------
def model_identity(path: str) -> str:
    """The model in the samples' settings: its name and the sizes of its files, not where it
    lies (the same GGUF file in another environment is the same model)."""
    path = os.path.abspath(str(path))
    if os.path.isdir(path):
        sizes = sorted((name, os.path.getsize(os.path.join(path, name)))
                       for name in os.listdir(path)
                       if name.endswith((".safetensors", ".bin", ".gguf", "config.json")))
        return f"{os.path.basename(path)} {sizes}"
    if os.path.isfile(path):
        return f"{os.path.basename(path)} ({os.path.getsize(path)} bytes)"
    return path


def sample_path(workdir: str, part: str) -> str:
    return os.path.join(workdir, SAMPLED_DIR, f"{part}.npz")


def load_samples(workdir: str, part: str, settings: dict):
    """(ids, mask, gold) of `part` written by `save_samples`, or None when absent.

    Raises ValueError when they were made with other `settings`.
    """
    path = sample_path(workdir, part)
    if not os.path.exists(path):
        return None
    with np.load(path) as f:
        saved = json.loads(str(f["settings"]))
        if saved != json.loads(json.dumps(settings)):
            changed = sorted(k for k in set(saved) | set(settings)
                             if saved.get(k) != json.loads(json.dumps(settings)).get(k))
            raise ValueError(f"{path} holds samples made with other settings ({changed}: "
                             f"{[saved.get(k) for k in changed]} there, "
                             f"{[settings.get(k) for k in changed]} now); use a new workdir "
                             "or delete that directory to sample again")
        return f["ids"], f["mask"], f["gold"]


def save_samples(workdir: str, part: str, settings: dict, ids, mask, gold, texts) -> None:
    """Writes the samples of `part` (process 0 only): `<part>.npz` whole or not at all, and the
    decoded texts with their gold in `<part>.jsonl` beside it, for reading."""
    if jax.process_index() != 0:
        return
    path = sample_path(workdir, part)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    n, k = np.shape(gold)
    with open(path[:-len(".npz")] + ".jsonl", "w") as f:
        for i in range(n):
            for j in range(k):
                f.write(json.dumps(dict(prompt=i, sample=j, gold=float(gold[i, j]),
                                        text=texts[i * k + j])) + "\n")
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=ids, mask=mask, gold=np.asarray(gold, np.float64),
             settings=json.dumps(settings))
    os.replace(tmp, path)
