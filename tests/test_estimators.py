"""Critic-free estimators: hand cases, independent numpy / per-row loop references, properties."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marl_jax.estimators import (
    ESTIMATORS,
    GROUP_METHODS,
    choose_branch_points,
    flatten_branches,
    group_advantages,
    macro_mc_advantages,
    reinforce_pp_advantages,
    sequence_advantages,
    sequence_advantages_to_tokens,
)
from marl_jax.macro.termination import fixed_ngram, segment_ids_from_starts

from test_termination import B, T, mask_from_lengths


# ---------------------------------------------------------------- group baselines

def reference_group_advantages(scores, k, method):
    """The formulas, one group and one sample at a time, in float64."""
    scores = np.asarray(scores, np.float64)
    out = np.zeros_like(scores)
    for g in range(len(scores) // k):
        group = scores[g * k:(g + 1) * k]
        for i in range(k):
            if method == "grpo":
                out[g * k + i] = (group[i] - group.mean()) / (np.std(group, ddof=1) + 1e-4)
            elif method == "dr_grpo":
                out[g * k + i] = group[i] - group.mean()
            else:
                out[g * k + i] = group[i] - np.delete(group, i).mean()
    return out


def test_group_advantages_hand_cases():
    scores = np.array([1.0, 2.0, 3.0, 4.0, 4.0, 4.0], np.float32)
    # Group 0: mean 2, unbiased std 1; group 1: identical scores.
    np.testing.assert_allclose(group_advantages(scores, 3, method="grpo"),
                               [-1 / 1.0001, 0, 1 / 1.0001, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(scores, 3, method="dr_grpo"),
                               [-1, 0, 1, 0, 0, 0], rtol=1e-6)
    # rloo: 1 - mean(2, 3), 2 - mean(1, 3), 3 - mean(1, 2).
    np.testing.assert_allclose(group_advantages(scores, 3, method="rloo"),
                               [-1.5, 0, 1.5, 0, 0, 0], rtol=1e-6)
    # rloo with two samples is the difference of the two scores.
    np.testing.assert_allclose(group_advantages(np.array([1.0, 5.0, -2.0, 0.5]), 2,
                                                method="rloo"), [-4, 4, -2.5, 2.5], rtol=1e-6)


def test_rloo_puts_the_kl_in_the_reward_before_the_baseline():
    """Four samples with equal scores 0.7 and summed KL [0.8, 1.2, 1.0, 0.6] at beta 0.05:
    RLOO's rewards are 0.7 - 0.05 KL = [0.66, 0.64, 0.65, 0.67], each minus the mean of the
    other three (Ahmadian et al., 2024; TRL's RLOOTrainer); GRPO and Dr. GRPO see the scores
    alone (their KL is a loss term), so theirs are zeros."""
    scores = np.full(4, 0.7, np.float32)
    kl_sums = np.array([0.8, 1.2, 1.0, 0.6], np.float32)
    got = sequence_advantages(scores, kl_sums, method="rloo", group_size=4, beta=0.05)
    np.testing.assert_allclose(got, [0.02 / 3, -0.02, -0.02 / 3, 0.02], atol=1e-7)
    rewards = [0.66, 0.64, 0.65, 0.67]
    np.testing.assert_allclose(got, [r - np.mean(np.delete(rewards, i))
                                     for i, r in enumerate(rewards)], atol=1e-7)
    for method in ("grpo", "dr_grpo"):
        assert ESTIMATORS[method].kl_in_loss and not ESTIMATORS["rloo"].kl_in_loss
        np.testing.assert_array_equal(sequence_advantages(scores, kl_sums, method=method,
                                                          group_size=4, beta=0.05), np.zeros(4))
    # Unequal scores: GRPO and Dr. GRPO as before, the KL ignored.
    scores = np.array([1.0, 2.0, 3.0, 4.0, 4.0, 4.0], np.float32)
    kl_sums = np.arange(6, dtype=np.float32)
    np.testing.assert_allclose(sequence_advantages(scores, kl_sums, method="dr_grpo",
                                                   group_size=3, beta=0.05),
                               [-1, 0, 1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(sequence_advantages(scores, kl_sums, method="grpo",
                                                   group_size=3, beta=0.05),
                               [-1 / 1.0001, 0, 1 / 1.0001, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("method", GROUP_METHODS)
def test_identical_scores_give_exact_zeros(method):
    # 1000.1 is not exactly representable: a mean computed from the raw scores would not cancel,
    # and grpo would divide that rounding error by 1e-4.
    scores = np.array([1000.1] * 4 + [-3.3] * 4 + [0.0] * 4, np.float32)
    advantages = np.asarray(group_advantages(scores, 4, method=method))
    assert not np.any(np.isnan(advantages))
    np.testing.assert_array_equal(advantages, np.zeros(12))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), method=st.sampled_from(GROUP_METHODS))
def test_group_advantages_match_the_numpy_reference(data, method):
    k = data.draw(st.integers(2, 6), label="group_size")
    groups = data.draw(st.integers(1, 4), label="groups")
    scores = np.asarray(data.draw(st.lists(st.one_of(st.sampled_from([-1.0, 0.0, 0.5, 2.0]),
                                                     st.floats(-10, 10, width=32)),
                                           min_size=k * groups, max_size=k * groups)),
                        np.float32)
    expected = reference_group_advantages(scores, k, method)
    np.testing.assert_allclose(group_advantages(scores, k, method=method), expected,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(group_advantages(jnp.asarray(scores), k, method=method), expected,
                               rtol=1e-4, atol=1e-4)


def test_group_advantages_under_jit_with_static_options():
    scores = np.random.default_rng(0).normal(size=12).astype(np.float32)
    jitted = jax.jit(group_advantages, static_argnums=1, static_argnames="method")
    for method in GROUP_METHODS:
        np.testing.assert_allclose(jitted(scores, 3, method=method),
                                   reference_group_advantages(scores, 3, method), rtol=1e-5,
                                   atol=1e-5)


def test_group_advantages_bad_input():
    scores = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match=r"method.*grpo.*dr_grpo.*rloo"):
        group_advantages(scores, 3, method="ppo")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(scores, 4, method="grpo")
    # One sample per prompt is its own baseline (every advantage 0): refused by every method.
    for method in GROUP_METHODS:
        with pytest.raises(ValueError, match=rf"^group_size must be >= 2 for method '{method}'"):
            group_advantages(scores, 1, method=method)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(scores, 2.0, method="dr_grpo")
    with pytest.raises(ValueError, match="kl_sums"):
        sequence_advantages(scores, np.zeros(5), method="rloo", group_size=3, beta=0.1)
    with pytest.raises(ValueError, match="scores"):
        group_advantages(np.zeros((2, 3)), 3, method="grpo")


def test_sequence_advantages_to_tokens():
    mask = mask_from_lengths([3, 0, 1], 4)
    np.testing.assert_array_equal(
        sequence_advantages_to_tokens(np.array([2.0, -1.0, 0.5]), mask),
        [[2, 2, 2, 0], [0, 0, 0, 0], [0.5, 0, 0, 0]])
    with pytest.raises(ValueError, match="advantages"):
        sequence_advantages_to_tokens(np.zeros(2), mask)
    with pytest.raises(ValueError, match="response_mask"):
        sequence_advantages_to_tokens(np.zeros(3), np.zeros(3))


# ---------------------------------------------------------------- REINFORCE++

def reference_reinforce_pp(rewards, mask):
    """Return-to-go by a loop over tokens, then (x - mean) / sqrt(max(var, 1e-8)) over tokens."""
    returns, flat = np.zeros(rewards.shape), []
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum())
        total = 0.0
        for t in reversed(range(length)):
            total += float(rewards[b, t])
            returns[b, t] = total
        flat.extend(returns[b, :length])
    if not flat:
        return returns
    mean, var = np.mean(flat), np.var(flat)
    out = (returns - mean) / np.sqrt(max(var, 1e-8))
    return np.where(mask != 0, out, 0)


def test_reinforce_pp_hand_case():
    rewards = np.array([[1.0, 0.0, 2.0], [3.0, 7.0, 7.0]], np.float32)
    mask = mask_from_lengths([3, 1], 3)
    # Returns 3, 2, 2 | 3: mean 2.5, variance 0.25.
    np.testing.assert_allclose(reinforce_pp_advantages(rewards, mask),
                               [[1, -1, -1], [1, 0, 0]], rtol=1e-5)
    # Equal returns: the variance floor keeps them at 0; no valid token: zeros.
    np.testing.assert_array_equal(
        reinforce_pp_advantages(np.array([[0.0, 2.0], [2.0, 0.0]]), mask_from_lengths([2, 1], 2)),
        np.zeros((2, 2)))
    np.testing.assert_array_equal(reinforce_pp_advantages(rewards, np.zeros((2, 3))),
                                  np.zeros((2, 3)))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, T), min_size=B, max_size=B), seed=st.integers(0, 2**16))
def test_reinforce_pp_matches_the_loop(lengths, seed):
    rng = np.random.default_rng(seed)
    mask = mask_from_lengths(lengths, T)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    np.testing.assert_allclose(reinforce_pp_advantages(rewards, mask),
                               reference_reinforce_pp(rewards, mask), rtol=1e-4, atol=1e-4)


def test_reinforce_pp_bad_input():
    with pytest.raises(ValueError, match="rewards"):
        reinforce_pp_advantages(np.zeros((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        reinforce_pp_advantages(np.zeros((1, 3)), np.array([[0, 2, 1]]))


# ---------------------------------------------------------------- branch points

def random_segment_ids(rng, lengths, width, start_probability):
    mask = mask_from_lengths(lengths, width)
    starts = rng.random((len(lengths), width)) < start_probability
    return np.asarray(segment_ids_from_starts(starts, mask)), mask


def macro_starts(ids, mask):
    """Each row's macro start positions, by a loop."""
    rows = []
    for row, mask_row in zip(ids, mask):
        length = int(mask_row.sum())
        rows.append([t for t in range(length) if t == 0 or row[t] != row[t - 1]])
    return rows


def test_choose_branch_points_hand_case():
    ids = np.array([[0, 0, 1, 1, 2, 3, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1], [0] * 8], np.int32)
    mask = mask_from_lengths([6, 8, 0], 8)
    starts, valid = choose_branch_points(None, ids, mask, 0)
    assert starts.shape == (3, 8) and starts.dtype == jnp.int32 and valid.dtype == jnp.bool_
    np.testing.assert_array_equal(starts, [[0, 2, 4, 5, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0],
                                           [0] * 8])
    np.testing.assert_array_equal(valid.sum(axis=1), [4, 2, 0])
    # Room for every start: the key does not matter.
    for seed in range(3):
        starts, valid = choose_branch_points(jax.random.key(seed), ids, mask, 5)
        np.testing.assert_array_equal(starts, [[0, 2, 4, 5, 0], [0, 1, 0, 0, 0], [0] * 5])
        np.testing.assert_array_equal(valid, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0] * 5])
    # One point: position 0 only.
    starts, valid = choose_branch_points(jax.random.key(0), ids, mask, 1)
    np.testing.assert_array_equal(starts, [[0], [0], [0]])
    np.testing.assert_array_equal(valid, [[True], [True], [False]])


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, T), min_size=B, max_size=B), seed=st.integers(0, 2**16),
       max_points=st.sampled_from([0, 1, 3, 6, T + 3]), density=st.sampled_from([0.2, 0.6, 1.0]))
def test_branch_point_properties(lengths, seed, max_points, density):
    rng = np.random.default_rng(seed)
    ids, mask = random_segment_ids(rng, lengths, T, density)
    starts, valid = choose_branch_points(jax.random.key(seed), ids, mask, max_points)
    starts, valid = np.asarray(starts), np.asarray(valid)
    points = max_points or T
    assert starts.shape == valid.shape == (B, points)
    for row_starts, row_valid, all_starts in zip(starts, valid, macro_starts(ids, mask)):
        count = int(row_valid.sum())
        assert count == min(points, len(all_starts))
        assert np.all(row_valid[:count]) and np.all(row_starts[count:] == 0)
        chosen = row_starts[:count].tolist()
        assert chosen == sorted(set(chosen))          # sorted, distinct
        assert set(chosen) <= set(all_starts)         # macro starts only
        if all_starts:
            assert chosen[0] == 0
        if max_points == 0:
            assert chosen == all_starts


def test_branch_points_come_from_the_key_uniformly():
    ids = np.arange(T, dtype=np.int32)[None] // 2  # starts 0, 2, ..., 14
    mask = np.ones((1, T), np.int32)
    first, _ = choose_branch_points(jax.random.key(1), ids, mask, 4)
    again, _ = choose_branch_points(jax.random.key(1), ids, mask, 4)
    np.testing.assert_array_equal(first, again)
    draws = jax.vmap(lambda key: choose_branch_points(key, ids, mask, 4)[0][0])(
        jax.random.split(jax.random.key(2), 4000))
    draws = np.asarray(draws)
    assert np.all(draws[:, 0] == 0) and np.all(np.diff(draws, axis=1) > 0)
    assert len({tuple(row) for row in draws}) == 35  # every 3-subset of the 7 other starts
    frequency = np.array([np.mean(np.any(draws == s, axis=1)) for s in range(2, T, 2)])
    np.testing.assert_allclose(frequency, 3 / 7, atol=0.04)


def test_flatten_branches():
    starts = np.array([[0, 3, 0], [0, 0, 0]], np.int32)
    valid = np.array([[True, True, False], [True, False, False]])
    rows, prefixes, flat_valid = flatten_branches(starts, valid)
    np.testing.assert_array_equal(rows, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(prefixes, [0, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(flat_valid, [1, 1, 0, 1, 0, 0])
    assert rows.dtype == prefixes.dtype == jnp.int32


def test_choose_branch_points_bad_input():
    ids, mask = np.zeros((2, 4), np.int32), mask_from_lengths([3, 2], 4)
    with pytest.raises(ValueError, match="max_points"):
        choose_branch_points(jax.random.key(0), ids, mask, -1)
    with pytest.raises(ValueError, match="max_points"):
        choose_branch_points(jax.random.key(0), ids, mask, 2.0)
    with pytest.raises(ValueError, match="key"):
        choose_branch_points(None, ids, mask, 2)
    with pytest.raises(ValueError, match="segment_ids"):
        choose_branch_points(None, np.zeros((2, 4)), mask, 0)
    with pytest.raises(ValueError, match="segment_ids"):
        choose_branch_points(None, np.array([[0, 2, 2, 0], [0, 0, 0, 0]]), mask, 0)
    with pytest.raises(ValueError, match="response_mask"):
        choose_branch_points(None, ids, np.array([[0, 1, 0, 0], [1, 0, 0, 0]]), 0)


# ---------------------------------------------------------------- Monte Carlo macro advantages

def reference_macro_mc(starts, valid, start_values, scores, kl_rewards, mask):
    """Per row: the used starts in order, then each token's span by a loop."""
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        pairs = sorted((int(s), float(v)) for s, v, u in zip(starts[b], start_values[b], valid[b])
                       if u)
        bounds = [s for s, _ in pairs] + [length]
        values = [v for _, v in pairs] + [float(scores[b])]
        for j in range(len(pairs)):
            span = range(bounds[j], bounds[j + 1])
            advantage = values[j + 1] - values[j] + sum(float(kl_rewards[b, t]) for t in span)
            for t in span:
                out[b, t] = advantage
    return out


def test_macro_mc_advantages_hand_case():
    # Row 0 (6 tokens): spans [0, 2), [2, 5), [5, 6) with V = 1, 3, 2 and score 10.
    # Row 1 (3 tokens): one span, V(0) = 0.5, score -1. Row 2: empty.
    starts = np.array([[0, 2, 5], [0, 0, 0], [0, 0, 0]], np.int32)
    valid = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    start_values = np.array([[1.0, 3.0, 2.0], [0.5, 9.0, 9.0], [9.0, 9.0, 9.0]], np.float32)
    scores = np.array([10.0, -1.0, 4.0], np.float32)
    kl = np.array([[-0.1, -0.2, 0.0, -0.3, -0.1, -0.5],
                   [-0.1, -0.1, -0.1, 0.0, 0.0, 0.0],
                   [0.0] * 6], np.float32)
    mask = mask_from_lengths([6, 3, 0], 6)
    expected = [[3 - 1 - 0.3] * 2 + [2 - 3 - 0.4] * 3 + [10 - 2 - 0.5],
                [-1 - 0.5 - 0.3] * 3 + [0] * 3,
                [0] * 6]
    got = macro_mc_advantages(starts, valid, start_values, scores, kl, mask)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # The slots may come in any order.
    order = [2, 0, 1]
    np.testing.assert_allclose(
        macro_mc_advantages(starts[:, order], valid[:, order], start_values[:, order], scores, kl,
                            mask), expected, rtol=1e-6, atol=1e-6)


def _mc_inputs(lengths, seed, max_points, density):
    rng = np.random.default_rng(seed)
    ids, mask = random_segment_ids(rng, lengths, T, density)
    starts, valid = choose_branch_points(jax.random.key(seed), ids, mask, max_points)
    points = starts.shape[1]
    start_values = rng.normal(size=(B, points)).astype(np.float32)
    scores = rng.normal(size=B).astype(np.float32)
    kl = -np.abs(rng.normal(scale=0.1, size=(B, T))).astype(np.float32)
    return ids, mask, np.asarray(starts), np.asarray(valid), start_values, scores, kl


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, T), min_size=B, max_size=B), seed=st.integers(0, 2**16),
       max_points=st.sampled_from([0, 1, 3, 6]), density=st.sampled_from([0.2, 0.6, 1.0]))
def test_macro_mc_advantages_match_the_loop(lengths, seed, max_points, density):
    _, mask, starts, valid, start_values, scores, kl = _mc_inputs(lengths, seed, max_points,
                                                                  density)
    got = macro_mc_advantages(starts, valid, start_values, scores, kl, mask)
    np.testing.assert_allclose(got, reference_macro_mc(starts, valid, start_values, scores, kl,
                                                       mask), rtol=1e-5, atol=1e-5)
    # Device arrays from choose_branch_points go straight in.
    np.testing.assert_allclose(
        macro_mc_advantages(jnp.asarray(starts), jnp.asarray(valid), start_values, scores, kl,
                            mask), got, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, T), min_size=B, max_size=B), seed=st.integers(0, 2**16),
       density=st.sampled_from([0.2, 0.6, 1.0]))
def test_all_macro_starts_give_one_advantage_per_macro_that_telescopes(lengths, seed, density):
    ids, mask, starts, valid, start_values, scores, _ = _mc_inputs(lengths, seed, 0, density)
    got = np.asarray(macro_mc_advantages(starts, valid, start_values, scores, np.zeros((B, T)),
                                         mask))
    for b, length in enumerate(lengths):
        # one value per macro
        for macro in np.unique(ids[b, :length]):
            assert len(np.unique(got[b, :length][ids[b, :length] == macro])) == 1
        # summed over spans (one token each), the value differences telescope
        span_total = got[b, starts[b][valid[b]]].sum()
        np.testing.assert_allclose(span_total, scores[b] - start_values[b, 0], rtol=1e-5,
                                   atol=1e-5)


def test_macro_mc_with_every_token_a_branch_point():
    # Token-level spans with kl 0: A_t = V(t + 1) - V(t), the last one score - V(L - 1).
    mask = mask_from_lengths([4], 4)
    starts, valid = choose_branch_points(None, fixed_ngram(mask, 1), mask, 0)
    values = np.array([[0.5, 1.0, 0.0, 2.0]], np.float32)
    got = macro_mc_advantages(starts, valid, values, np.array([3.0]), np.zeros((1, 4)), mask)
    np.testing.assert_allclose(got, [[0.5, -1.0, 2.0, 1.0]])


def test_macro_mc_advantages_bad_input():
    mask = mask_from_lengths([4, 2], 4)
    good = dict(starts=np.array([[0, 2], [0, 1]], np.int32), valid=np.ones((2, 2), bool),
                start_values=np.zeros((2, 2)), scores=np.zeros(2), kl_rewards=np.zeros((2, 4)),
                response_mask=mask)
    macro_mc_advantages(**good)
    for name, value, match in [
        ("starts", np.array([[1, 2], [0, 1]]), "rows \\[0\\]"),     # no branch point at 0
        ("starts", np.array([[0, 0], [0, 1]]), "rows \\[0\\]"),     # repeated start
        ("starts", np.array([[0, 2], [0, 2]]), "rows \\[1\\]"),     # start on padding
        ("starts", np.array([[0.0, 2.0], [0.0, 1.0]]), "starts"),
        ("valid", np.array([[1, 2], [1, 1]]), "valid"),
        ("start_values", np.zeros((2, 3)), "start_values"),
        ("scores", np.zeros(3), "scores"),
        ("kl_rewards", np.zeros((2, 5)), "kl_rewards"),
    ]:
        with pytest.raises(ValueError, match=match):
            macro_mc_advantages(**dict(good, **{name: value}))
    # An unused slot may hold anything.
    macro_mc_advantages(**dict(good, starts=np.array([[0, 7], [0, 1]]),
                               valid=np.array([[True, False], [True, True]])))
