"""The estimators' statistics over rows count the valid rows alone (`rows`, the trajectories whose
environment did not fail): each group estimator equals, on a group's valid rows, the same
estimator on a group made of those rows only (computed here by hand in numpy), an invalid row
gets 0, a group left with one valid row gets 0, and with every row valid the advantages are
those without `rows`, to the bit."""
import numpy as np
import pytest

from marl_jax import estimators

K = 4
SCORES = np.array([1.0, -0.5, 2.0, 0.25,    # group 0: row 1 invalid
                   3.0, 3.0, -1.0, 0.5,     # group 1: every row valid
                   0.7, 9.0, 4.0, -2.0],    # group 2: row 8 alone valid
                  np.float32)
ROWS = np.array([1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], bool)


def _by_hand(scores, method):
    """One group's advantages, every row of it counting (float64)."""
    x = np.asarray(scores, np.float64)
    n = len(x)
    if n == 1:
        return np.zeros(1)
    if method == "rloo":
        return x - (x.sum() - x) / (n - 1)
    deviation = x - x.mean()
    if method == "dr_grpo":
        return deviation
    return deviation / (np.sqrt(np.sum(deviation ** 2) / (n - 1)) + estimators.GROUP_STD_EPS)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_count_the_valid_rows_alone(method):
    got = np.asarray(estimators.group_advantages(SCORES, K, method=method, rows=ROWS))
    expected = np.zeros(len(SCORES))
    for g in range(len(SCORES) // K):
        idx = np.arange(g * K, (g + 1) * K)
        valid = idx[ROWS[idx]]
        expected[valid] = _by_hand(SCORES[valid], method)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.all(got[~ROWS] == 0) and got[8] == 0
    every = np.asarray(estimators.group_advantages(SCORES, K, method=method))
    assert np.array_equal(np.asarray(estimators.group_advantages(
        SCORES, K, method=method, rows=np.ones_like(ROWS))), every)


def test_turn_estimators_and_reinforce_pp_count_the_valid_rows_alone():
    """Two turns a row: a row's per-turn leave-one-out baseline and its turn-index
    normalisation are those of its group's valid rows, and REINFORCE++ normalises over their
    tokens; each equals the estimator on the batch of valid rows alone."""
    rng = np.random.default_rng(0)
    b, t = len(SCORES), 6
    action_mask = np.tile(np.array([1, 1, 0, 1, 1, 0], np.int32), (b, 1))
    turn_ids = np.tile(np.array([0, 0, 0, 1, 1, 1], np.int32), (b, 1))
    turn_rewards = np.where(action_mask != 0, rng.normal(size=(b, t)), 0).astype(np.float32)
    calls = {
        "turn_rloo": lambda r, m, i, rows=None: estimators.turn_rloo_advantages(
            r, m, i, K, rows=rows),
        "turn_grpo": lambda r, m, i, rows=None: estimators.turn_index_normalised_advantages(
            r, m, i, K, rows=rows),
    }
    for name, call in calls.items():
        got = np.asarray(call(turn_rewards, action_mask, turn_ids, rows=ROWS))
        assert np.all(got[~ROWS] == 0), name
        # Group 1 (every row valid) is what the estimator gives without `rows`.
        np.testing.assert_array_equal(got[4:8], np.asarray(call(turn_rewards, action_mask,
                                                                turn_ids))[4:8])
        # Group 0's three valid rows, as a group of 3 of their own.
        valid = np.flatnonzero(ROWS[:4])
        own = {"turn_rloo": estimators.turn_rloo_advantages,
               "turn_grpo": estimators.turn_index_normalised_advantages}[name](
            turn_rewards[valid], action_mask[valid], turn_ids[valid], 3)
        np.testing.assert_allclose(got[valid], np.asarray(own), rtol=1e-5, atol=1e-6)
        assert np.all(got[8] == 0), name
    got = np.asarray(estimators.reinforce_pp_advantages(turn_rewards, action_mask, ROWS))
    own = np.asarray(estimators.reinforce_pp_advantages(turn_rewards[ROWS], action_mask[ROWS]))
    np.testing.assert_allclose(got[ROWS], own, rtol=1e-5, atol=1e-6)
    assert np.all(got[~ROWS] == 0)


def test_rows_that_are_not_a_row_mask_get_one_line():
    with pytest.raises(ValueError, match="rows has shape"):
        estimators.group_advantages(SCORES, K, method="grpo", rows=ROWS[:-1])
    with pytest.raises(ValueError, match="boolean"):
        estimators.group_advantages(SCORES, K, method="grpo", rows=np.full(len(SCORES), 2))
