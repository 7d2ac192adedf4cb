"""Statistics of a seeded study: intervals over seeds, curve summaries, reward-hacking flags.

Pure numpy functions of per-seed numbers; `marl_jax/eval/report.py` applies them to the rows of
an experiment. Every interval is over seeds (a seed is one independent replicate: its own
prompts order, sampling keys and critic start, shared by every arm of that seed), so paired
differences between arms of the same seed cancel what the seed alone decides.

Bootstrap: for every interval a fresh `numpy.random.default_rng(rng_seed)` draws the indices
`rng.integers(0, n, size=(resamples, n))` over the `n` per-seed values in seed order; the
interval is the percentile interval of the resampled statistic. Anyone with the same values,
`resamples` and `rng_seed` gets the same interval.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

from marl_jax.eval.scores import _as_scores

LEVEL = 0.95
RESAMPLES = 10_000
RNG_SEED = 0
# Curve values within this of a target count as reaching it (float round-off of the target).
REACH_TOL = 1e-12
# How far (in gold) a run's final gold must lie below its own peak to count as falling from it.
HACK_GOLD_DROP = 0.1


def bootstrap_indices(n: int, *, resamples: int = RESAMPLES,
                      rng_seed: int = RNG_SEED) -> np.ndarray:
    """Seed indices of the bootstrap resamples, `[resamples, n]` int."""
    return np.random.default_rng(rng_seed).integers(0, n, size=(resamples, n))


def _tails(level: float) -> tuple[float, float]:
    """The percentiles of a two-sided `level` interval: (2.5, 97.5) for 0.95, exactly (1 - 0.95
    is not 0.05 in floating point, which would move an inverted-CDF quantile by one value)."""
    return round(100 * (1 - level) / 2, 10), round(100 * (1 + level) / 2, 10)


def t_quantile(level: float, df: int) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom."""
    return float(stats.t.ppf((1 + level) / 2, df))


def interval(values, *, level: float = LEVEL, resamples: int = RESAMPLES,
             rng_seed: int = RNG_SEED) -> dict:
    """The mean of per-seed values `[n]` with a bootstrap and a t interval.

    Returns {"n", "mean", "std" (ddof=1), "ci": [lo, hi] (percentile bootstrap of the mean),
    "ci_t": [lo, hi] (mean -/+ t_{(1+level)/2, n-1} std / sqrt(n))}; with fewer than two values
    both intervals (and std) are None: one seed says nothing about the spread.
    """
    v = _as_scores(values, "per-seed values")
    out = {"n": int(v.size), "mean": float(v.mean()), "std": None, "ci": None, "ci_t": None}
    if v.size < 2:
        return out
    std = float(v.std(ddof=1))
    means = v[bootstrap_indices(v.size, resamples=resamples, rng_seed=rng_seed)].mean(axis=1)
    half_t = t_quantile(level, v.size - 1) * std / math.sqrt(v.size)
    out.update(std=std, ci=[float(x) for x in np.percentile(means, _tails(level))],
               ci_t=[out["mean"] - half_t, out["mean"] + half_t])
    return out


def direction(ci) -> int:
    """1 when the interval lies strictly above 0, -1 strictly below, 0 when it covers 0 (or is
    None)."""
    if ci is None:
        return 0
    lo, hi = ci
    return 1 if lo > 0 else -1 if hi < 0 else 0


def trapezoid_mean(steps, values) -> float:
    """The mean of a curve over its step range: trapezoid area / (steps[-1] - steps[0]).

    steps `[K]` increasing, values `[K]` (or `[..., K]`, then one mean per leading index).
    """
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if s.ndim != 1 or s.size < 2 or np.any(np.diff(s) <= 0):
        raise ValueError(f"trapezoid_mean needs at least two increasing steps, got {s.tolist()}")
    area = (0.5 * (v[..., 1:] + v[..., :-1]) * np.diff(s)).sum(axis=-1)
    return area / (s[-1] - s[0])


def trailing_mean(x, window: int) -> np.ndarray:
    """Trailing moving average over the last axis: point k is the mean of points
    max(0, k - window + 1) .. k."""
    x = np.asarray(x, dtype=np.float64)
    window = max(int(window), 1)
    c = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
    idx = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(idx - window, 0)
    return (c[..., idx] - c[..., lo]) / (idx - lo)


def first_crossing(steps, curves, targets) -> np.ndarray:
    """The first step where each curve reaches its target, +inf where it never does.

    steps `[K]`, curves `[..., K]`, targets `[...]`; returns float `[...]`.
    """
    steps = np.asarray(steps, dtype=np.float64)
    curves = np.asarray(curves, dtype=np.float64)
    reached = curves >= np.asarray(targets, dtype=np.float64)[..., None] - REACH_TOL
    first = np.argmax(reached, axis=-1)
    return np.where(reached.any(axis=-1), steps[first], np.inf)


def steps_to_fraction(steps, arm_gold, base_gold, fraction: float, *, smoothing: int = 1,
                      level: float = LEVEL, resamples: int = RESAMPLES,
                      rng_seed: int = RNG_SEED) -> dict | None:
    """Steps for an arm to reach SFT + fraction x the baseline's gain, with a bootstrap interval.

    steps `[K]` (steps[0] = 0, the SFT policy); arm_gold, base_gold `[n, K]`: per-seed gold
    curves of the arm and of the baseline on the same seeds, in the same order. The mean
    curves over seeds are smoothed by `trailing_mean(., smoothing)`; SFT = the baseline's mean
    curve at step 0, gain = its last point - SFT; the answer is the first step where the arm's
    curve >= SFT + fraction x gain. Each bootstrap resample draws the seeds once for both arms
    (the gain is the baseline's) and counts as +inf when the arm never crosses or when the
    resampled gain is <= 0. The interval is the inverted-CDF percentile interval (an observed
    step or +inf, never an interpolation).

    Returns None when the baseline's gain is <= 0 (no fraction of it to reach), else
    {"step": int | None, "ci": [lo, hi]} with None for "not reached by the last step".
    """
    arm_gold = np.asarray(arm_gold, dtype=np.float64)
    base_gold = np.asarray(base_gold, dtype=np.float64)
    if arm_gold.shape != base_gold.shape or arm_gold.shape[-1] != len(steps):
        raise ValueError(f"steps_to_fraction: arm curves {arm_gold.shape} and baseline curves "
                         f"{base_gold.shape} must both be [seeds, {len(steps)} steps]")

    def crossing(arm_mean, base_mean):
        arm_c, base_c = trailing_mean(arm_mean, smoothing), trailing_mean(base_mean, smoothing)
        gain = base_c[..., -1] - base_c[..., 0]
        step = first_crossing(steps, arm_c, base_c[..., 0] + fraction * gain)
        return np.where(gain > 0, step, np.inf), gain

    point, gain = crossing(arm_gold.mean(axis=0), base_gold.mean(axis=0))
    if gain <= 0:
        return None
    idx = bootstrap_indices(arm_gold.shape[0], resamples=resamples, rng_seed=rng_seed)
    resampled, _ = crossing(arm_gold[idx].mean(axis=1), base_gold[idx].mean(axis=1))
    ci = np.quantile(resampled, np.asarray(_tails(level)) / 100, method="inverted_cdf")
    return {"step": _finite_step(point), "ci": [_finite_step(x) for x in ci]}


def _finite_step(x) -> int | None:
    return int(x) if np.isfinite(x) else None


def paired_mean_by_seed(differences_by_seed, *, level: float = LEVEL) -> dict | None:
    """The mean of paired differences grouped by seed, with a standard error that respects the
    grouping.

    differences_by_seed: seed -> per-prompt differences `[E_s]` (arm - reference, same prompts).
    The prompts of one seed share one trained policy, so they are not independent replicates:
    with two or more seeds the mean is the mean of the per-seed means and its standard error
    the sample std of the per-seed means / sqrt(seeds) (t with seeds - 1 degrees of freedom);
    with one seed, the prompts are the only replicates and the standard error is their sample
    std / sqrt(E) (t with E - 1 degrees of freedom).

    Returns {"mean", "se", "z" (mean / se, None when se = 0), "ci_t", "se_over" ("seeds" |
    "prompts"), "seeds", "n" (pairs in all)}, or None when there are fewer than two replicates.
    """
    groups = [np.asarray(d, dtype=np.float64) for _, d in sorted(differences_by_seed.items())
              if len(d)]
    n = int(sum(g.size for g in groups))
    if len(groups) >= 2:
        replicates, over = np.array([g.mean() for g in groups]), "seeds"
    elif groups and groups[0].size >= 2:
        replicates, over = groups[0], "prompts"
    else:
        return None
    mean = float(replicates.mean())
    se = float(replicates.std(ddof=1) / math.sqrt(replicates.size))
    half = t_quantile(level, replicates.size - 1) * se
    return {"mean": mean, "se": se, "z": mean / se if se > 0 else None,
            "ci_t": [mean - half, mean + half], "se_over": over, "seeds": len(groups), "n": n}


def drop_noise(final_per_prompt, start_per_prompt, *, level: float = LEVEL) -> float | None:
    """The noise of one run's gold change between two evaluations on the same held-out prompts:
    the `level` t half-width t_{(1+level)/2, E-1} s / sqrt(E) of the per-prompt differences
    final - start `[E]` (None with fewer than two prompts or unequal lengths)."""
    a = np.asarray(final_per_prompt, dtype=np.float64)
    b = np.asarray(start_per_prompt, dtype=np.float64)
    if a.shape != b.shape or a.size < 2:
        return None
    return float(t_quantile(level, a.size - 1) * (a - b).std(ddof=1) / math.sqrt(a.size))


def hacking_rules(gold, rm_score, *, drop: float = HACK_GOLD_DROP,
                  noise: float | None = None) -> list[str]:
    """The reward-hacking rules one run's curves trigger (gold and RM score `[K]` per eval
    step, step 0 first). `noise` is the half-width a gold change of this run must exceed to
    count (`drop_noise`); None (unknown) counts every change.

    - "rm_up_gold_down": final RM score > step-0 RM score and final gold < step-0 gold - noise.
    - "gold_off_peak_rm_at_max": final gold < peak gold - max(`drop`, noise), and the final RM
      score is the run's highest and above the RM score at the (first) step of peak gold.
    """
    gold = np.asarray(gold, dtype=np.float64)
    rm = np.asarray(rm_score, dtype=np.float64)
    tolerance = 0.0 if noise is None else float(noise)
    rules = []
    if rm[-1] > rm[0] and gold[-1] < gold[0] - tolerance:
        rules.append("rm_up_gold_down")
    peak = int(np.argmax(gold))
    if (gold[-1] < gold[peak] - max(drop, tolerance) and rm[-1] >= rm.max()
            and rm[-1] > rm[peak]):
        rules.append("gold_off_peak_rm_at_max")
    return rules
