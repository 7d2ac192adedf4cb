"""The paper's split of training rows into SFT / reward-model / RL parts (20 / 40 / 40, seed 1234).

The official code takes it from DeepSpeed-Chat (`data_split "2,4,4"`, `get_raw_dataset_split_index`)
and `paper_split` reproduces that rule exactly, so the same rows land in the same part:

1. fractions are normalised to sum to one; part boundaries are the running sums of
   `round(fraction * n)` (Python's round, half to even), all shifted down by however much the
   last boundary overshoots `n`;
2. `order` is `np.arange(n, dtype=uint32)` shuffled in place by `np.random.RandomState(seed)`;
3. part k is `records[order[i]]` for i in `[boundary_k, boundary_{k+1})`, in that shuffled order.

The parts are disjoint and together hold every record once. Apply it to the loaded records of a
single file split (e.g. `load_preference_pairs("tldr")`); the official code splits the raw hub rows,
so its parts match these only when no row was skipped or dropped while loading.
"""
from __future__ import annotations

import numpy as np

PART_NAMES = ("sft", "rm", "rl")


def split_boundaries(size, fractions):
    """Start offsets of each part and the end, `[0, b_1, ..., size]` (DeepSpeed-Chat's rule)."""
    total = float(sum(fractions))
    boundaries = [0]
    for fraction in fractions:
        boundaries.append(boundaries[-1] + int(round(fraction / total * float(size))))
    overshoot = boundaries[-1] - size
    return [boundaries[0]] + [b - overshoot for b in boundaries[1:]]


def shuffled_order(size, seed):
    """A permutation of `range(size)`: `np.random.RandomState(seed)` shuffling `arange`."""
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    order = np.arange(size, dtype=dtype)
    np.random.RandomState(seed=seed).shuffle(order)
    return order


def paper_split(records, seed=1234, fractions=(0.2, 0.4, 0.4)):
    """`{"sft": [...], "rm": [...], "rl": [...]}`: a deterministic disjoint split of `records`.

    Args:
      records: a sequence of records (e.g. a loader's result).
      seed: shuffling seed (the paper: 1234).
      fractions: three non-negative part sizes (normalised), SFT / RM / RL.
    """
    fractions = tuple(fractions)
    if len(fractions) != len(PART_NAMES):
        raise ValueError(f"fractions must have {len(PART_NAMES)} entries (sft, rm, rl), "
                         f"got {fractions}")
    if any(not np.isfinite(f) or f < 0 for f in fractions) or sum(fractions) <= 0:
        raise ValueError(f"fractions must be non-negative with a positive sum, got {fractions}")
    boundaries = split_boundaries(len(records), fractions)
    order = shuffled_order(len(records), seed)
    return {
        part: [records[int(i)] for i in order[start:end]]
        for part, start, end in zip(PART_NAMES, boundaries[:-1], boundaries[1:])
    }
