"""Macro GAE: hand-computed cases, the per-sample loop oracle, properties, bad input."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import macro_oracle as oracle
from marl_jax.macro.advantage import REWARD_AGGREGATIONS, VALUE_WEIGHTINGS, gae, macro_gae, whiten
from marl_jax.macro.termination import fixed_ngram, perplexity, randomized_ngram

COMBINATIONS = list(itertools.product(VALUE_WEIGHTINGS, REWARD_AGGREGATIONS))
B, T = 6, 16  # shape shared by the property tests, so each combination compiles once


def mask_from_lengths(lengths, width):
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


# ---------------------------------------------------------------- by hand
# Row 0: six tokens, n = 2 -> macros {0, 1}, {2, 3}, {4}, {5}. Row 1: three tokens -> {0, 1}, {2}.
# Row 2: empty. gamma = 1, lam = 0.5.
# Macro values / rewards of the two-token macros (values 1,2 | 3,4 | row 1: 2,4; rewards
# .1,.2 | .3,.4 | row 1: .5,-.5), with sigma: equal (1/2, 1/2), unit (0, 1), first (1, 0),
# position (1/3, 2/3) since 1/(2-0) : 1/(2-1) = 1 : 2.
#   equal:    V = 1.5, 3.5 | 3;     weighted R = .15, .35 | 0
#   unit:     V = 2, 4     | 4;     weighted R = .2, .4   | -.5
#   first:    V = 1, 3     | 2;     weighted R = .1, .3   | .5
#   position: V = 5/3, 11/3 | 10/3; weighted R = 1/6, 11/30 | -1/6
#   summed R = .3, .7 | 0 for every weighting.
# Single-token macros: row 0 {4}: V 5, R .5; {5}: V 6, R 1 -> A = -5, then 1.5 - 2.5 = -1.
# Row 1 {2}: V 1, R 2 -> A = 1.
# Then delta = R + V_next - V, A = delta + .5 A_next, G = A + V, e.g. equal / weighted:
#   A1 = (.35 + 5 - 3.5) + .5 * -1 = 1.35, A0 = (.15 + 3.5 - 1.5) + .5 * 1.35 = 2.825.
# Per macro (row 0 A, row 0 G, row 1 A, row 1 G):
HAND = {
    ("equal", "weighted"): ([2.825, 1.35, -1, -5], [4.325, 4.85, 4, 1], [-1.5, 1], [1.5, 2]),
    ("equal", "sum"): ([3.15, 1.7, -1, -5], [4.65, 5.2, 4, 1], [-1.5, 1], [1.5, 2]),
    ("unit", "weighted"): ([2.65, 0.9, -1, -5], [4.65, 4.9, 4, 1], [-3.0, 1], [1.0, 2]),
    ("unit", "sum"): ([2.9, 1.2, -1, -5], [4.9, 5.2, 4, 1], [-2.5, 1], [1.5, 2]),
    ("first", "weighted"): ([3.0, 1.8, -1, -5], [4.0, 4.8, 4, 1], [0.0, 1], [2.0, 2]),
    ("first", "sum"): ([3.4, 2.2, -1, -5], [4.4, 5.2, 4, 1], [-0.5, 1], [1.5, 2]),
    ("position", "weighted"): ([83 / 30, 1.2, -1, -5], [133 / 30, 14.6 / 3, 4, 1],
                               [-2.0, 1], [4 / 3, 2]),
    ("position", "sum"): ([46 / 15, 23 / 15, -1, -5], [71 / 15, 5.2, 4, 1],
                          [-11 / 6, 1], [1.5, 2]),
}
HAND_VALUES = np.array([[1, 2, 3, 4, 5, 6], [2, 4, 1, 0, 0, 0], [0] * 6], np.float32)
HAND_REWARDS = np.array([[.1, .2, .3, .4, .5, 1.], [.5, -.5, 2., 0, 0, 0], [0] * 6], np.float32)
HAND_MASK = mask_from_lengths([6, 3, 0], 6)


@pytest.mark.smoke
@pytest.mark.parametrize("weighting,aggregation", COMBINATIONS)
def test_hand_computed_macro_gae(weighting, aggregation):
    ids = fixed_ngram(HAND_MASK, 2)
    np.testing.assert_array_equal(ids, [[0, 0, 1, 1, 2, 3], [0, 0, 1, 0, 0, 0], [0] * 6])
    advantages, returns = macro_gae(HAND_VALUES, HAND_REWARDS, HAND_MASK, ids, gamma=1.0,
                                    lam=0.5, value_weighting=weighting,
                                    reward_aggregation=aggregation)
    a0, g0, a1, g1 = HAND[(weighting, aggregation)]
    to_tokens = [0, 0, 1, 1, 2, 3]
    expected_a = [[a0[k] for k in to_tokens], [a1[0], a1[0], a1[1], 0, 0, 0], [0] * 6]
    expected_g = [[g0[k] for k in to_tokens], [g1[0], g1[0], g1[1], 0, 0, 0], [0] * 6]
    np.testing.assert_allclose(advantages, expected_a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(returns, expected_g, rtol=1e-6, atol=1e-6)


def test_hand_computed_token_gae():
    # Row 1 of the hand case with gamma = .9, lam = .5, one token per step:
    # delta2 = 2 - 1 = 1; delta1 = -.5 + .9 * 1 - 4 = -3.6; delta0 = .5 + .9 * 4 - 2 = 2.1
    # A2 = 1; A1 = -3.6 + .45 = -3.15; A0 = 2.1 + .45 * -3.15 = .6825
    advantages, returns = gae(HAND_VALUES, HAND_REWARDS, HAND_MASK, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(advantages[1], [0.6825, -3.15, 1, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(returns[1], [2.6825, 0.85, 2, 0, 0, 0], atol=1e-6)
    np.testing.assert_array_equal(advantages[2], np.zeros(6))


# ---------------------------------------------------------------- oracle

def _random_batch(seed, batch=24, width=T):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, width + 1, batch)
    lengths[:3] = [0, 1, width]
    mask = mask_from_lengths(lengths, width)
    values = (rng.normal(size=(batch, width)) * mask).astype(np.float32)
    rewards = (rng.normal(size=(batch, width)) * mask).astype(np.float32)
    return values, rewards, mask


@pytest.mark.parametrize("weighting,aggregation", COMBINATIONS)
def test_matches_oracle_on_random_batches(weighting, aggregation):
    values, rewards, mask = _random_batch(0)
    ref_logprobs = np.random.default_rng(1).normal(size=mask.shape).astype(np.float32)
    segmentations = [fixed_ngram(mask, n) for n in (1, 2, 5, 10)]
    segmentations += [fixed_ngram(mask, 3, isolate_last=False),
                      randomized_ngram(jax.random.key(0), mask, lengths=(1, 2, 3, 5, 10)),
                      perplexity(ref_logprobs, mask)]
    for ids in segmentations:
        for gamma, lam in ((1.0, 0.95), (0.9, 0.7)):
            advantages, returns = macro_gae(values, rewards, mask, ids, gamma=gamma, lam=lam,
                                            value_weighting=weighting,
                                            reward_aggregation=aggregation)
            expected_a, expected_g = oracle.macro_gae(values, rewards, mask, np.asarray(ids),
                                                      gamma, lam, weighting, aggregation)
            np.testing.assert_allclose(advantages, expected_a, atol=1e-5)
            np.testing.assert_allclose(returns, expected_g, atol=1e-5)


def test_token_gae_matches_oracle():
    values, rewards, mask = _random_batch(2)
    advantages, returns = gae(values, rewards, mask, gamma=0.99, lam=0.9)
    expected_a, expected_g = oracle.gae(values, rewards, mask, 0.99, 0.9)
    np.testing.assert_allclose(advantages, expected_a, atol=1e-5)
    np.testing.assert_allclose(returns, expected_g, atol=1e-5)


def test_gamma_and_lam_can_be_vmapped_arms():
    values, rewards, mask = _random_batch(3)
    ids = fixed_ngram(mask, 5)
    gammas = jnp.array([1.0, 0.9, 0.5])
    lams = jnp.array([0.95, 0.8, 0.0])
    arms = jax.vmap(lambda g, l: macro_gae(values, rewards, mask, ids, gamma=g, lam=l))(gammas,
                                                                                      lams)
    for k in range(3):
        expected_a, _ = oracle.macro_gae(values, rewards, mask, np.asarray(ids),
                                         float(gammas[k]), float(lams[k]))
        np.testing.assert_allclose(arms[0][k], expected_a, atol=1e-5)


# ---------------------------------------------------------------- properties

lengths_strategy = st.lists(st.integers(1, T), min_size=B, max_size=B)


def _inputs(lengths, seed):
    rng = np.random.default_rng(seed)
    mask = mask_from_lengths(lengths, T)
    values = rng.normal(size=(B, T)).astype(np.float32)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    return values, rewards, mask


@pytest.mark.smoke
@settings(max_examples=15, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**16))
def test_one_token_macros_equal_token_gae_exactly(lengths, seed):
    values, rewards, mask = _inputs(lengths, seed)
    expected = gae(values, rewards, mask, gamma=0.97, lam=0.9)
    for weighting, aggregation in COMBINATIONS:
        got = macro_gae(values, rewards, mask, fixed_ngram(mask, 1), gamma=0.97, lam=0.9,
                        value_weighting=weighting, reward_aggregation=aggregation)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**16))
def test_n_at_least_t_gives_one_macro_and_the_last_token(lengths, seed):
    values, rewards, mask = _inputs(lengths, seed)
    ids = np.asarray(fixed_ngram(mask, T))
    advantages, returns = macro_gae(values, rewards, mask, ids, gamma=1.0, lam=0.95)
    for b, length in enumerate(lengths):
        assert np.array_equal(ids[b, :length], [0] * (length - 1) + [min(length - 1, 1)])
        if length >= 2:
            body = slice(0, length - 1)
            mean_value = values[b, body].mean()
            last_a = rewards[b, length - 1] - values[b, length - 1]
            body_a = rewards[b, body].mean() + values[b, length - 1] - mean_value + 0.95 * last_a
            np.testing.assert_allclose(advantages[b, body], body_a, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(returns[b, body], body_a + mean_value, rtol=1e-5,
                                       atol=1e-5)
            np.testing.assert_allclose(advantages[b, length - 1], last_a, rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**16), n=st.sampled_from([2, 3, 5]))
def test_rows_are_independent(lengths, seed, n):
    values, rewards, mask = _inputs(lengths, seed)
    ids = fixed_ngram(mask, n)
    permutation = np.random.default_rng(seed).permutation(B)
    for weighting, aggregation in (("equal", "weighted"), ("position", "sum")):
        kwargs = dict(value_weighting=weighting, reward_aggregation=aggregation)
        whole = macro_gae(values, rewards, mask, ids, **kwargs)
        permuted = macro_gae(values[permutation], rewards[permutation], mask[permutation],
                             np.asarray(ids)[permutation], **kwargs)
        np.testing.assert_allclose(permuted[0], np.asarray(whole[0])[permutation], atol=1e-5)
        np.testing.assert_allclose(permuted[1], np.asarray(whole[1])[permutation], atol=1e-5)


@pytest.fixture(scope="module")
def jitted_macro_gae():
    return jax.jit(macro_gae, static_argnames=("value_weighting", "reward_aggregation"))


@settings(max_examples=10, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**16), n=st.sampled_from([1, 2, 5, 10]))
def test_jit_and_eager_agree(jitted_macro_gae, lengths, seed, n):
    values, rewards, mask = _inputs(lengths, seed)
    ids = fixed_ngram(mask, n)
    eager = macro_gae(values, rewards, mask, ids, value_weighting="unit")
    jitted = jitted_macro_gae(values, rewards, mask, ids, value_weighting="unit")
    np.testing.assert_allclose(eager[0], jitted[0], atol=1e-5)
    np.testing.assert_allclose(eager[1], jitted[1], atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**16), n=st.sampled_from([1, 2, 5, 10]))
def test_float32_and_float64_agree(lengths, seed, n):
    values, rewards, mask = _inputs(lengths, seed)
    ids = np.asarray(fixed_ngram(mask, n))
    single = macro_gae(values, rewards, mask, ids, value_weighting="position", gamma=0.99)
    with jax.enable_x64(True):
        double = macro_gae(values.astype(np.float64), rewards.astype(np.float64), mask, ids,
                           value_weighting="position", gamma=0.99)
        assert double[0].dtype == jnp.float64
        double = [np.asarray(x) for x in double]
    assert single[0].dtype == jnp.float32
    np.testing.assert_allclose(single[0], double[0], atol=1e-5)
    np.testing.assert_allclose(single[1], double[1], atol=1e-5)


def test_empty_rows_give_zeros_not_nan():
    mask = np.zeros((3, 5), np.int32)
    values = np.full((3, 5), np.nan, np.float32)  # padding content must never leak
    for weighting, aggregation in COMBINATIONS:
        out = macro_gae(values, values, mask, np.zeros((3, 5), np.int32),
                        value_weighting=weighting, reward_aggregation=aggregation)
        np.testing.assert_array_equal(out[0], np.zeros((3, 5)))
        np.testing.assert_array_equal(out[1], np.zeros((3, 5)))
    np.testing.assert_array_equal(whiten(values, mask), np.zeros((3, 5)))


def test_advantages_are_targets_without_gradient():
    values, rewards, mask = _random_batch(5)
    ids = fixed_ngram(mask, 3)

    def total(v):
        advantages, returns = macro_gae(v, rewards, mask, ids)
        return jnp.sum(advantages) + jnp.sum(returns)

    np.testing.assert_array_equal(jax.jit(jax.grad(total))(values), np.zeros_like(values))


# ---------------------------------------------------------------- whiten

def test_whiten_matches_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(3.0, 2.0, (4, 7)).astype(np.float32)
    mask = mask_from_lengths([7, 3, 0, 5], 7)
    inside = x[mask == 1]
    expected = (x - inside.mean()) / np.sqrt(inside.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(whiten(x, mask), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whiten(x, mask, shift_mean=False),
                               (expected + inside.mean()) * mask, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    values, rewards, mask = _inputs([3, 4, 1, 2, 6, 16], 0)
    ids = fixed_ngram(mask, 2)
    with pytest.raises(ValueError, match="rewards"):
        macro_gae(values, rewards[:, :5], mask, ids)
    with pytest.raises(ValueError, match="segment_ids"):
        macro_gae(values, rewards, mask, np.asarray(ids)[:, :5])
    with pytest.raises(ValueError, match="value_weighting"):
        macro_gae(values, rewards, mask, ids, value_weighting="mean")
    with pytest.raises(ValueError, match="reward_aggregation"):
        macro_gae(values, rewards, mask, ids, reward_aggregation="mean")
    with pytest.raises(ValueError, match="response_mask"):
        macro_gae(values, rewards, mask * 2, ids)
    # A mask with holes (a multi-turn trajectory's observation spans) is an action mask; ids
    # that do not start at 0 on its first action token are refused.
    shifted = np.roll(mask, 1, axis=1)
    with pytest.raises(ValueError, match="segment_ids must start at 0"):
        macro_gae(values, rewards, shifted, np.asarray(ids) + 1)
    with pytest.raises(ValueError, match="segment_ids"):
        macro_gae(values, rewards, mask, np.asarray(ids) * 2)
    with pytest.raises(ValueError, match="segment_ids"):
        macro_gae(values, rewards, mask, np.asarray(ids) + 1)
    with pytest.raises(ValueError, match="segment_ids"):
        macro_gae(values, rewards, mask, np.asarray(ids, np.float32))
    with pytest.raises(ValueError, match="gamma"):
        macro_gae(values, rewards, mask, ids, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        gae(values, rewards, mask, lam=-0.1)
    with pytest.raises(ValueError, match="values"):
        gae(values[0], rewards[0], mask[0])
    with pytest.raises(ValueError, match="mask"):
        whiten(values, mask[:, :3])
