"""The recheck of a credit probe's ground truth (`credit/recheck.py`): the split test's
p-value is the share of the states' splits whose statistic reaches the observed one (enumerated
here by itertools); on simulated null data (saved and fresh returns from one distribution,
Gaussian or a rare large reward) at K = 4 and 8 continuations it raises at most its nominal
rate of false alarms, and it catches saved values two standard errors off; picked tokens."""
import itertools

import numpy as np
import pytest

from marl_jax.credit import recheck as credit_recheck


def test_the_p_value_is_the_share_of_splits_that_reach_the_observed_statistic():
    saved = np.array([[0.0, 1.0], [1.0, 1.0], [4.0, 4.0], [5.0, 2.0]])
    new = np.array([[2.0, 3.0, 2.5], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [3.0, 4.0, 6.0]])
    out = credit_recheck.split_test(saved, new, permutations=40_000, seed=3)
    # State 1's returns are all equal: nothing to test. State 2 has two exact values that
    # differ: a variance like any other, no contradiction of its own.
    assert out["z"][1] is None and out["tested"] == 3
    pooled = np.concatenate([saved, new], axis=1)
    variance = pooled.var(axis=1, ddof=1)
    tested = [0, 2, 3]
    z = (saved.mean(axis=1) - new.mean(axis=1))[tested] / np.sqrt(variance[tested] * (1 / 2 + 1 / 3))
    np.testing.assert_allclose([out["z"][i] for i in tested], z, rtol=1e-12)
    assert out["statistic"] == pytest.approx(np.sum(z ** 2), rel=1e-12)
    # Every split of every tested state's five returns into two saved and three new.
    per_state = []
    for s in tested:
        z2 = []
        for chosen in itertools.combinations(range(5), 2):
            rest = [i for i in range(5) if i not in chosen]
            d = pooled[s, list(chosen)].mean() - pooled[s, rest].mean()
            z2.append(d * d / (variance[s] * (1 / 2 + 1 / 3)))
        per_state.append(z2)
    splits = np.array([sum(c) for c in itertools.product(*per_state)])
    exact = np.mean(splits >= out["statistic"] * (1 - 1e-12))
    assert 0.01 < exact < 0.99
    assert out["p_value"] == pytest.approx(exact, abs=4 * np.sqrt(exact * (1 - exact) / 40_000))


def _null_returns(rng, distribution, trials, states, k):
    """Saved and fresh returns `[trials, S, K]` of one distribution per state (a Gaussian, or a
    reward of 10 with probability 2-10% plus small per-token terms), and each state's sd."""
    if distribution == "gaussian":
        mean, sd = rng.normal(size=(trials, states, 1)), rng.uniform(0.2, 1.0, size=(trials, states, 1))
        return [mean + sd * rng.normal(size=(trials, states, k)) for _ in range(2)], sd
    p = rng.uniform(0.02, 0.1, size=(trials, states, 1))
    draws = [10.0 * (rng.random((trials, states, k)) < p) + 0.05 * rng.normal(size=(trials, states, k))
             for _ in range(2)]
    return draws, np.sqrt(100 * p * (1 - p) + 0.05 ** 2)


@pytest.mark.parametrize("distribution", ["gaussian", "skewed"])
@pytest.mark.parametrize("k", [4, 8])
def test_false_alarms_on_null_data_stay_at_the_nominal_rate_and_a_shift_is_caught(distribution, k):
    trials, states = 1000, 16
    rng = np.random.default_rng([k, len(distribution)])
    (saved, new), sd = _null_returns(rng, distribution, trials, states, k)
    p = np.concatenate([credit_recheck.split_p_values(saved[lo:lo + 250], new[lo:lo + 250],
                                                      permutations=999, seed=lo)[1]
                        for lo in range(0, trials, 250)])
    # Nominal 0.1% (the command's level) and 5%: at most 1 and 50 of 1000 expected; the
    # bounds lie 4 binomial standard deviations above.
    assert np.sum(p <= credit_recheck.MIN_P_VALUE) <= 5
    assert np.sum(p <= 0.05) <= 50 + 4 * np.sqrt(1000 * 0.05 * 0.95)
    # A broken probe: every saved value two of its standard errors off.
    shifted = saved[:250] + 2 * sd[:250] / np.sqrt(k)
    _, p_shifted, _ = credit_recheck.split_p_values(shifted, new[:250], permutations=999, seed=1)
    assert np.mean(p_shifted <= credit_recheck.MIN_P_VALUE) > 0.5


def test_picked_tokens_are_distinct_valid_and_seeded():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    rows, positions = credit_recheck.pick_tokens(mask, 3, seed=7)
    assert len(set(zip(rows, positions))) == 3
    assert all(mask[b, t] for b, t in zip(rows, positions))
    again = credit_recheck.pick_tokens(mask, 3, seed=7)
    assert rows.tolist() == again[0].tolist() and positions.tolist() == again[1].tolist()
    rows, positions = credit_recheck.pick_tokens(mask, 10, seed=0)
    assert list(zip(rows, positions)) == [(0, 0), (0, 1), (0, 2), (1, 0)]
