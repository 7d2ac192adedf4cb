"""Does a credit probe's ground truth hold up: Monte Carlo values of a probe's states, drawn again
from fresh continuations of the same policy, against the values the probe saved
(`experiments/credit_revalue.py`). Pure numpy and scipy.

Two estimates of one state's value, each with its standard error, differ by
z = (new - saved) / sqrt(se_new^2 + se_saved^2), about standard normal when both estimate the
same value; over S states sum z^2 is then about chi-square with S degrees of freedom. A pair
with both standard errors 0 (a terminal state, or one whose every continuation is the same)
carries no test when the two agree (z NaN, left out of the sum) and is a contradiction when they
differ (z infinite, p 0); 0 and agree are up to float32 rounding (`RESOLUTION`).
"""
from __future__ import annotations

import numpy as np
from scipy import stats

# Below this p-value of sum z^2, the saved values and the new ones disagree.
MIN_P_VALUE = 1e-3
# Standard errors and differences this small are 0: float32 rewards summed over a response,
# computed twice, differ by about 1e-6.
RESOLUTION = 1e-5


def z_scores(saved_mean, saved_se, new_mean, new_se, *,
             resolution: float = RESOLUTION) -> np.ndarray:
    """z `[S]` of each pair of estimates `[S]` (see the module): NaN where both standard errors
    are 0 and the means are equal, +-inf where both are 0 and the means differ (0 and equal:
    within `resolution`)."""
    saved_mean, saved_se, new_mean, new_se = (np.asarray(x, np.float64) for x in (
        saved_mean, saved_se, new_mean, new_se))
    shapes = {x.shape for x in (saved_mean, saved_se, new_mean, new_se)}
    if len(shapes) != 1 or saved_mean.ndim != 1:
        raise ValueError(f"means and standard errors must be 1-D arrays of one shape, got shapes "
                         f"{sorted(shapes)}")
    if np.any(saved_se < 0) or np.any(new_se < 0):
        raise ValueError("standard errors must be >= 0")
    diff = new_mean - saved_mean
    scale = np.sqrt(saved_se ** 2 + new_se ** 2)
    exact = scale <= resolution
    z = diff / np.where(exact, 1.0, scale)
    z[exact] = np.where(np.abs(diff[exact]) <= resolution, np.nan,
                        np.where(diff[exact] > 0, np.inf, -np.inf))
    return z


def compare_values(saved_mean, saved_se, new_mean, new_se, *,
                   min_p_value: float = MIN_P_VALUE) -> dict:
    """The agreement of two sets of estimates `[S]` of the same values: {"z": z `[S]` (list;
    None where untested), "tested": pairs with a z, "chi2": sum z^2, "p_value": P(chi-square
    with `tested` degrees of freedom >= chi2), "mean_z2", "frac_within_2": the fraction of
    tested pairs with |z| < 2, "consistent": p_value >= min_p_value}."""
    z = z_scores(saved_mean, saved_se, new_mean, new_se)
    tested = z[~np.isnan(z)]
    if tested.size == 0:
        chi2, p_value, mean_z2, within = 0.0, 1.0, 0.0, 1.0
    else:
        chi2 = float(np.sum(tested ** 2))
        p_value = 0.0 if not np.isfinite(chi2) else float(stats.chi2.sf(chi2, tested.size))
        mean_z2, within = chi2 / tested.size, float(np.mean(np.abs(tested) < 2))
    return {"z": [None if np.isnan(x) else float(x) for x in z], "tested": int(tested.size),
            "chi2": chi2, "p_value": p_value, "mean_z2": mean_z2, "frac_within_2": within,
            "consistent": bool(p_value >= min_p_value)}


def pick_tokens(response_mask, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`num` distinct response tokens drawn uniformly (numpy generator `seed`) among the valid
    tokens of `response_mask [B, R]` (all of them when there are fewer): rows, positions `[n]`,
    sorted by row then position."""
    mask = np.asarray(response_mask)
    lengths = np.cumprod(mask != 0, axis=1).sum(axis=1)
    rows = np.repeat(np.arange(lengths.size), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths]) if rows.size else rows
    if num < 1:
        raise ValueError(f"the number of tokens to pick must be >= 1, got {num}")
    chosen = np.sort(np.random.default_rng(seed).choice(rows.size, min(num, rows.size),
                                                        replace=False))
    return rows[chosen].astype(np.int64), positions[chosen].astype(np.int64)
