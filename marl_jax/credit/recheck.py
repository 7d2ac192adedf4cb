"""Does a credit probe's ground truth hold up: Monte Carlo values of a probe's states, drawn again
from fresh continuations of the same policy, against the values the probe saved
(`experiments/credit_revalue.py`). Pure numpy.

The test. State s has K1 saved continuation returns (the probe's, `state_returns`) and K2 fresh
ones. When the probe is right, all K1 + K2 are independent draws of one return distribution, so
which K1 of the pooled returns are the saved ones is a uniformly random split, whatever that
distribution is (skewed, discrete, with ties). The statistic is

    T = sum_s z_s^2,   z_s = (mean_saved - mean_new) / sqrt(v_s (1 / K1 + 1 / K2)),

v_s the variance (ddof 1) of state s's pooled returns: the variance under the null, the same
for every split of the state, so z_s^2 has mean 1 over the splits. Its null distribution is
drawn by splitting every state's pooled returns at random, states independently
(`permutations` splits, numpy generator `seed`): p = (1 + #{T_split >= T}) / (1 + permutations),
a valid p-value at every K1, K2 and return distribution (exact for the Monte Carlo test, not
an approximation). A state whose pooled returns lie within `RESOLUTION` of each other (a
terminal state, a deterministic one) has no variance to test and is left out; float32 rewards
summed twice differ by about 1e-6.

Why not z with the two estimates' own standard errors against chi-square (what this module did
before): a standard error from K = 4 or 8 continuations is itself noisy, and 0 where every
continuation agreed, so that statistic's null distribution is far from chi-square at small K
(docs/credit.md, "Checking the ground truth": its false alarms against the split test's,
printed by experiments/credit_recheck_calibration.py).
"""
from __future__ import annotations

import numpy as np

# Below this p-value the saved values and the new ones disagree.
MIN_P_VALUE = 1e-3
# Pooled returns this close together are one value: no variance to test.
RESOLUTION = 1e-5
# Random splits drawn for the null distribution (p-values down to 1e-4).
PERMUTATIONS = 9999
# Splits drawn at once: bounds the memory of the masks [block, S, K1 + K2].
_BLOCK = 512


def _returns(x, name: str) -> np.ndarray:
    a = np.asarray(x, np.float64)
    if a.ndim < 2 or a.shape[-1] < 1:
        raise ValueError(f"{name} must be continuation returns per state, shape [..., S, K]; "
                         f"got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds non-finite returns")
    return a


def null_variance(pooled, *, resolution: float = RESOLUTION) -> np.ndarray:
    """`[..., S]`: the variance (ddof 1) of each state's pooled returns `[..., S, N]`, 0 where
    they lie within `resolution` of each other (nothing to test)."""
    pooled = np.asarray(pooled, np.float64)
    spread = pooled.max(axis=-1) - pooled.min(axis=-1)
    return np.where(spread > resolution, pooled.var(axis=-1, ddof=1), 0.0)


def split_statistic(pooled, splits, k_saved: int, variance) -> np.ndarray:
    """T = sum_s z_s^2 (see the module), `[C, ...]`, of pooled returns `[..., S, N]` under each
    of C splits `[C, S, N]` (0 / 1, K1 = `k_saved` ones per state: the returns taken as the
    saved ones; every split applies to every leading index), with the states' null variances
    `[..., S]` (0: left out)."""
    pooled = np.asarray(pooled, np.float64)
    lead, (states, n) = pooled.shape[:-2], pooled.shape[-2:]
    k_new = n - k_saved
    flat = pooled.reshape((-1, states, n))
    # [S, C, N] @ [S, N, rows]: one matrix product per state over every split and row.
    saved_sum = np.matmul(np.swapaxes(splits, 0, 1), flat.transpose(1, 2, 0)).transpose(1, 2, 0)
    saved_sum = saved_sum.reshape((splits.shape[0],) + lead + (states,))
    diff = saved_sum / k_saved - (pooled.sum(axis=-1) - saved_sum) / k_new
    scale = np.asarray(variance) * (1.0 / k_saved + 1.0 / k_new)
    return np.where(scale > 0, diff * diff / np.where(scale > 0, scale, 1.0), 0.0).sum(axis=-1)


def random_splits(rng: np.random.Generator, count: int, states: int, k_saved: int,
                  k_new: int) -> np.ndarray:
    """`[count, S, K1 + K2]` float 0 / 1: uniformly random splits of each state's pooled
    returns, K1 ones (the side taken as saved) per state, states and splits independent."""
    keys = rng.random((count, states, k_saved + k_new))
    cut = np.partition(keys, k_saved - 1, axis=-1)[..., k_saved - 1:k_saved]
    return (keys <= cut).astype(np.float64)


def null_z(diff, variance, k_saved: int, k_new: int) -> np.ndarray:
    """`[S]` z of differences `diff [S]` between a mean of K1 returns and one of K2, with
    the null variances `variance [S]` of one return (NaN where 0: untested)."""
    scale = np.sqrt(np.asarray(variance, np.float64) * (1.0 / k_saved + 1.0 / k_new))
    return np.where(scale > 0, np.asarray(diff, np.float64) / np.where(scale > 0, scale, 1.0),
                    np.nan)


def z_summary(z) -> dict:
    """{"z": list (None where untested), "tested", "mean_z2", "frac_within_2": the share of
    tested entries with |z| < 2} of z `[S]` (NaN: untested)."""
    z = np.asarray(z, np.float64)
    tested = z[~np.isnan(z)]
    return {"z": [None if np.isnan(v) else float(v) for v in z], "tested": int(tested.size),
            "mean_z2": float(np.mean(tested ** 2)) if tested.size else 0.0,
            "frac_within_2": float(np.mean(np.abs(tested) < 2)) if tested.size else 1.0}


def split_p_values(saved_returns, new_returns, *, permutations: int = PERMUTATIONS,
                   seed: int = 0, resolution: float = RESOLUTION) -> tuple:
    """(T `[...]`, p-value `[...]`, the states' null variances `[..., S]`) of the split test of
    saved against new continuation returns `[..., S, K1]`, `[..., S, K2]` (see the module;
    leading axes are independent comparisons, e.g. simulated trials, which share the random
    splits: each one's p-value is valid for any splits drawn independently of its returns)."""
    saved, new = _returns(saved_returns, "saved returns"), _returns(new_returns, "new returns")
    if saved.shape[:-1] != new.shape[:-1]:
        raise ValueError(f"saved returns {saved.shape} and new returns {new.shape}: one row per "
                         "state in both")
    if not isinstance(permutations, (int, np.integer)) or permutations < 1:
        raise ValueError(f"permutations must be an int >= 1, got {permutations!r}")
    k_saved, k_new = saved.shape[-1], new.shape[-1]
    pooled = np.concatenate([saved, new], axis=-1)
    variance = null_variance(pooled, resolution=resolution)
    observed = np.zeros((1,) + pooled.shape[-2:])
    observed[..., :k_saved] = 1.0
    statistic = split_statistic(pooled, observed, k_saved, variance)[0]
    rng = np.random.default_rng(seed)
    exceed = np.zeros(statistic.shape, np.int64)
    for lo in range(0, permutations, _BLOCK):
        splits = random_splits(rng, min(_BLOCK, permutations - lo), saved.shape[-2], k_saved,
                               k_new)
        # Ties with the observed split count as exceeding it (float summation order aside).
        exceed += (split_statistic(pooled, splits, k_saved, variance)
                   >= statistic * (1 - 1e-12)).sum(axis=0)
    return statistic, (1 + exceed) / (1 + int(permutations)), variance


def split_test(saved_returns, new_returns, *, permutations: int = PERMUTATIONS, seed: int = 0,
               resolution: float = RESOLUTION) -> dict:
    """The split test of one probe's saved against new continuation returns `[S, K1]`,
    `[S, K2]` (`split_p_values`): {"statistic": T, "p_value", "permutations", "variance": the
    states' null variances `[S]`, and `z_summary` of each state's z}."""
    saved, new = _returns(saved_returns, "saved returns"), _returns(new_returns, "new returns")
    if saved.ndim != 2:
        raise ValueError(f"saved returns must be [S, K1], got shape {saved.shape}")
    statistic, p_value, variance = split_p_values(saved, new, permutations=permutations,
                                                  seed=seed, resolution=resolution)
    z = null_z(saved.mean(axis=1) - new.mean(axis=1), variance, saved.shape[1], new.shape[1])
    return {"statistic": float(statistic), "p_value": float(p_value),
            "permutations": int(permutations), "variance": variance.tolist(), **z_summary(z)}


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
