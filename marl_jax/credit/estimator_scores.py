"""How right an estimator's advantages are: scores against ground-truth advantages.

Pure numpy over per-state arrays `[S]` (one entry per scored token or macro; the ground truth
comes from `marl_jax.credit.truth`, the estimates from any estimator at the same
states):

- `score_advantages(estimate [S], truth [S], prompts [S], *, level, resamples, rng_seed) -> dict`
  {"states", "prompts", "pearson", "spearman", "sign_agreement", "variance",
  "truth_variance"}, each score a {"value": float | None, "ci": [lo, hi] | None}.
  Spearman ranks ties by their average rank; sign agreement is the share of states where
  `np.sign(estimate) == np.sign(truth)` (0 is a sign of its own); the variances are over
  states (ddof 0). A correlation with a constant side is undefined (value None).
- `paired_differences(estimates {name: [S]}, truth [S], prompts [S], pairs, ...) -> dict`
  {(a, b): {"value": Pearson(a, truth) - Pearson(b, truth), "ci": [lo, hi] | None}}: both
  correlations of each resample on the same resampled states, so the interval is that of the
  paired difference (what "a beats b" needs), not of two separate intervals.
- `noise_ceiling(halves [S, 2], prompts [S], ...) -> dict` {"states", "prompts",
  "halves_pearson", "reliability", "ceiling"}, same entries. `halves` are the A* of two
  independent halves of the K continuations of every state. Their Pearson correlation r is the
  reliability of a K/2-continuation A*; the scores compare estimators with the A* of all K, so
  the reliability is Spearman-Brown-corrected to K: 2r / (1 + r) (the halves are parallel
  measurements of the same states: equal size, independent continuations; exactly so for even
  K). An estimator equal to the true advantage would correlate with the K-continuation A* at
  sqrt(reliability): that is the ceiling (0 where the reliability is negative), the highest
  Pearson correlation an estimator can be expected to reach against that truth.

Bootstrap over prompts: `prompts [S]` labels the prompt each state belongs to (states of one
prompt, of all its sampled responses, are not independent). The labels are numbered in sorted
order, `study_stats.bootstrap_indices(n_prompts, resamples, rng_seed)` draws the resamples, and
a resample holds each drawn prompt with all its states, as often as it was drawn; its statistic
is computed as the count-weighted statistic over the original states (the same number as over
the concatenated sample, without building it). Percentile intervals at `level`, resamples where
a statistic is undefined left out; with one prompt there is no interval (None).
"""
from __future__ import annotations

import numpy as np

from marl_jax.eval import study_stats as st

# Resample rows processed at once times states: bounds the memory of the weights.
_BLOCK_ENTRIES = 4_000_000


def _as_states(x, name: str, size: int | None = None) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one value per state, shape [S]; got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name}: no states to score")
    if size is not None and a.size != size:
        raise ValueError(f"{name} has {a.size} states but the truth has {size}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds non-finite values at states "
                         f"{np.flatnonzero(~np.isfinite(a))[:10].tolist()}")
    return a


def _prompt_index(prompts, size: int) -> tuple[np.ndarray, int]:
    p = np.asarray(prompts)
    if p.shape != (size,):
        raise ValueError(f"prompts must label each of the {size} states, shape ({size},); "
                         f"got shape {p.shape}")
    labels, index = np.unique(p, return_inverse=True)
    return index.reshape(-1), labels.size


def _weight_blocks(index: np.ndarray, n_prompts: int, resamples: int, rng_seed: int):
    """Count weights `[block, S]` of the bootstrap resamples, a block of rows at a time."""
    idx = st.bootstrap_indices(n_prompts, resamples=resamples, rng_seed=rng_seed)
    flat = idx + n_prompts * np.arange(resamples)[:, None]
    counts = np.bincount(flat.ravel(), minlength=resamples * n_prompts).reshape(resamples, n_prompts)
    block = max(1, _BLOCK_ENTRIES // index.size)
    for lo in range(0, resamples, block):
        yield counts[lo:lo + block][:, index].astype(np.float64)


def _mean(w, x):
    """Weighted means `[rows]` of x `[S]` or `[rows, S]` under weights `[rows, S]`."""
    return (w * x).sum(axis=1) / w.sum(axis=1)


def _variance(w, x):
    d = x - _mean(w, x)[:, None]
    return (w * d * d).sum(axis=1) / w.sum(axis=1)


def _pearson(w, x, y):
    dx = x - _mean(w, x)[:, None]
    dy = y - _mean(w, y)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (w * dx * dy).sum(axis=1) / np.sqrt((w * dx * dx).sum(axis=1) * (w * dy * dy).sum(axis=1))


def _ranks(w, x):
    """Average ranks `[rows, S]` (1-based) of every state in the sample that weights `w`
    `[rows, S]` describe: a value group with weight W after B units of smaller values holds
    ranks B + 1 .. B + W, on average B + (W + 1) / 2."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new = np.r_[True, xs[1:] != xs[:-1]]
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], xs.size]
    cum = np.cumsum(w[:, order], axis=1)
    before = np.where(starts > 0, cum[:, np.maximum(starts - 1, 0)], 0.0)
    total = cum[:, ends - 1] - before
    ranks = np.empty_like(cum)
    ranks[:, order] = (before + (total + 1) / 2)[:, np.cumsum(new) - 1]
    return ranks


def _spearman(w, x, y):
    return _pearson(w, _ranks(w, x), _ranks(w, y))


def _sign_agreement(w, x, y):
    return _mean(w, (np.sign(x) == np.sign(y)).astype(np.float64))


def _reliability(r):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(r > -1, 2 * r / (1 + r), np.nan)


def _bootstrapped(statistics: dict, size: int, index, n_prompts, *, level, resamples,
                  rng_seed) -> dict:
    """{name: {"value", "ci"}} for `statistics` {name: weights [rows, S] -> [rows]}."""
    ones = np.ones((1, size))
    points = {name: float(f(ones)[0]) for name, f in statistics.items()}
    samples = {name: [] for name in statistics}
    if n_prompts >= 2:
        for w in _weight_blocks(index, n_prompts, resamples, rng_seed):
            for name, f in statistics.items():
                samples[name].append(f(w))
    return {name: _summary(point, samples[name], level) for name, point in points.items()}


def _summary(point: float, samples: list, level: float) -> dict:
    """{"value", "ci"} of a statistic's point estimate and its resampled values (blocks of
    `[rows]`): the percentile interval over the resamples where it is defined; value None
    where the point estimate is undefined, ci None without a defined resample."""
    if not np.isfinite(point):
        return {"value": None, "ci": None}
    values = np.concatenate(samples) if samples else np.empty(0)
    values = values[np.isfinite(values)]
    ci = [float(v) for v in np.percentile(values, st._tails(level))] if values.size else None
    return {"value": point, "ci": ci}


def score_advantages(estimate, truth, prompts, *, level: float = st.LEVEL,
                     resamples: int = st.RESAMPLES, rng_seed: int = st.RNG_SEED) -> dict:
    """Pearson and Spearman correlation, sign agreement and variance of an estimator's
    advantages `estimate [S]` against the ground truth `truth [S]` at the same states (and the
    truth's variance), each with a bootstrap interval over `prompts [S]` (see the module
    docstring)."""
    y = _as_states(truth, "truth")
    x = _as_states(estimate, "estimate", y.size)
    index, n_prompts = _prompt_index(prompts, y.size)
    statistics = {
        "pearson": lambda w: _pearson(w, x, y),
        "spearman": lambda w: _spearman(w, x, y),
        "sign_agreement": lambda w: _sign_agreement(w, x, y),
        "variance": lambda w: _variance(w, x),
        "truth_variance": lambda w: _variance(w, y),
    }
    return {"states": int(y.size), "prompts": n_prompts,
            **_bootstrapped(statistics, y.size, index, n_prompts, level=level,
                            resamples=resamples, rng_seed=rng_seed)}


def paired_differences(estimates: dict, truth, prompts, pairs, *, level: float = st.LEVEL,
                       resamples: int = st.RESAMPLES, rng_seed: int = st.RNG_SEED) -> dict:
    """{(a, b): {"value", "ci"}} of Pearson(estimates[a], truth) - Pearson(estimates[b], truth)
    for every pair `(a, b)` of `pairs`, `estimates` {name: advantages `[S]`} at the states of
    `truth [S]`, with bootstrap intervals over `prompts [S]` (the module docstring's
    resamples: every pair and `score_advantages` see the same). A difference where either
    correlation is undefined is undefined (value None)."""
    y = _as_states(truth, "truth")
    names = sorted({name for pair in pairs for name in pair})
    x = {name: _as_states(estimates[name], f"estimate {name}", y.size) for name in names}
    index, n_prompts = _prompt_index(prompts, y.size)

    def differences(w):
        # Each estimator's correlation once per block of resamples; every pair reuses it.
        r = {name: _pearson(w, x[name], y) for name in names}
        return {(a, b): r[a] - r[b] for a, b in pairs}

    points = {pair: float(d[0]) for pair, d in differences(np.ones((1, y.size))).items()}
    samples = {pair: [] for pair in pairs}
    if n_prompts >= 2:
        for w in _weight_blocks(index, n_prompts, resamples, rng_seed):
            for pair, d in differences(w).items():
                samples[pair].append(d)
    return {pair: _summary(points[pair], samples[pair], level) for pair in pairs}


def noise_ceiling(halves, prompts, *, level: float = st.LEVEL, resamples: int = st.RESAMPLES,
                  rng_seed: int = st.RNG_SEED) -> dict:
    """The halves' Pearson correlation, its Spearman-Brown reliability at K and the ceiling
    sqrt(max(reliability, 0)) for `halves [S, 2]` (the A* of two independent halves of the
    continuations), each with a bootstrap interval over `prompts [S]`."""
    h = np.asarray(halves, dtype=np.float64)
    if h.ndim != 2 or h.shape[1] != 2:
        raise ValueError(f"halves must be the A* of two halves per state, shape [S, 2]; got shape {h.shape}")
    a = _as_states(h[:, 0], "halves[:, 0]")
    b = _as_states(h[:, 1], "halves[:, 1]")
    index, n_prompts = _prompt_index(prompts, a.size)

    def reliability(w):
        return _reliability(_pearson(w, a, b))

    statistics = {
        "halves_pearson": lambda w: _pearson(w, a, b),
        "reliability": reliability,
        "ceiling": lambda w: np.sqrt(np.maximum(reliability(w), 0.0)),
    }
    return {"states": int(a.size), "prompts": n_prompts,
            **_bootstrapped(statistics, a.size, index, n_prompts, level=level,
                            resamples=resamples, rng_seed=rng_seed)}
