"""Entropy termination: hand cases, the top-quantile rule by a per-row loop, invariants, errors."""
import fractions

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_termination import assert_valid_segment_ids, mask_from_lengths
from train_util import tiny_config

from marl_jax.config import base_config
from marl_jax.config_check import validate_config
from marl_jax.macro import termination
from marl_jax.macro.termination import entropy_spans, fixed_ngram, segment

B, T = 6, 16  # shape shared by the property tests, so each function compiles once
QUANTILES = (0.05, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.7, 0.9, 1.0)


def expected_starts(entropies, mask, quantile, isolate_last):
    """Per row: the k = ceil(quantile * L) largest entropies (ties with the k-th included), token
    0, and with `isolate_last` the last token; k in exact rational arithmetic."""
    q = fractions.Fraction(quantile).limit_denominator(1000)
    starts = np.zeros(mask.shape, bool)
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        if length == 0:
            continue
        k = max(1, -(-q.numerator * length // q.denominator))
        threshold = sorted(entropies[b, :length].tolist(), reverse=True)[k - 1]
        for t in range(length):
            starts[b, t] = (entropies[b, t] >= threshold or t == 0
                            or (isolate_last and t == length - 1))
    return starts


def starts_of(ids, mask):
    """bool `[B, T]`: the tokens where a macro begins."""
    ids = np.asarray(ids)
    previous = np.concatenate([np.full((ids.shape[0], 1), -1), ids[:, :-1]], axis=1)
    return (mask != 0) & (ids != previous)


def test_entropy_spans_hand_cases():
    entropies = np.array([[0.1, 0.9, 0.2, 0.8, 0.3, 0.0, 5.0, 5.0],
                          [1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0],
                          [2.0, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0]], np.float32)
    mask = mask_from_lengths([6, 5, 4], 8)
    # Row 0, quantile 0.34: k = ceil(2.04) = 3, the entropies .9, .8, .3 start macros (the 5s
    # sit on padding). Row 1: all tied, all start. Row 2: k = 2, threshold .5, a tie: 1 and 2.
    np.testing.assert_array_equal(entropy_spans(entropies, mask, quantile=0.34), [
        [0, 1, 1, 2, 3, 4, 0, 0],
        [0, 1, 2, 3, 4, 0, 0, 0],
        [0, 1, 2, 3, 0, 0, 0, 0],
    ])
    np.testing.assert_array_equal(entropy_spans(entropies, mask, quantile=0.34,
                                                isolate_last=False), [
        [0, 1, 1, 2, 3, 3, 0, 0],
        [0, 1, 2, 3, 4, 0, 0, 0],
        [0, 1, 2, 2, 0, 0, 0, 0],
    ])
    # quantile 0.2: k = ceil(1.2) = 2 in row 0 (.9 and .8); k = 1 in rows 1 and 2.
    np.testing.assert_array_equal(entropy_spans(entropies, mask, quantile=0.2,
                                                isolate_last=False), [
        [0, 1, 1, 2, 2, 2, 0, 0],
        [0, 1, 2, 3, 4, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ])


def test_an_integer_product_is_not_rounded_up():
    # 0.2 * 5 = 1 (1.0000000298 in float32) and 0.7 * 10 = 7 (7.000000000000001 in float64):
    # one and seven tokens, not two and eight.
    entropies = np.array([[1.0, 5.0, 4.0, 3.0, 2.0] + [0.0] * 5], np.float32)
    np.testing.assert_array_equal(
        entropy_spans(entropies, mask_from_lengths([5], 10), quantile=0.2, isolate_last=False),
        [[0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
    entropies = np.arange(10, dtype=np.float32)[None]  # the top 7 are tokens 3..9
    np.testing.assert_array_equal(
        entropy_spans(entropies, np.ones((1, 10), np.int32), quantile=0.7, isolate_last=False),
        [[0, 0, 0, 1, 2, 3, 4, 5, 6, 7]])


def test_quantile_one_is_token_level_and_padding_is_ignored():
    rng = np.random.default_rng(0)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    entropies = rng.random((B, T)).astype(np.float32)
    np.testing.assert_array_equal(entropy_spans(entropies, mask, quantile=1.0),
                                  fixed_ngram(mask, 1))
    padded = np.where(mask != 0, entropies, 100.0).astype(np.float32)
    for quantile in (0.1, 0.5):
        np.testing.assert_array_equal(entropy_spans(padded, mask, quantile=quantile),
                                      entropy_spans(entropies, mask, quantile=quantile))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, T), min_size=B, max_size=B), seed=st.integers(0, 2**16),
       quantile=st.sampled_from(QUANTILES), isolate_last=st.booleans(), ties=st.booleans())
def test_entropy_spans_invariants(lengths, seed, quantile, isolate_last, ties):
    rng = np.random.default_rng(seed)
    mask = mask_from_lengths(lengths, T)
    entropies = rng.gamma(2.0, 1.0, (B, T)).astype(np.float32)
    if ties:
        entropies = np.round(entropies, 0)
    ids = entropy_spans(entropies, mask, quantile=quantile, isolate_last=isolate_last)
    assert ids.shape == (B, T)
    assert_valid_segment_ids(ids, mask, isolate_last)
    starts = starts_of(ids, mask)
    np.testing.assert_array_equal(starts, expected_starts(entropies, mask, quantile,
                                                          isolate_last))
    q = fractions.Fraction(quantile).limit_denominator(1000)
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        k = max(1, -(-q.numerator * length // q.denominator))
        threshold = np.sort(entropies[b, :length])[::-1][k - 1]
        top = entropies[b, :length] >= threshold
        forced = np.zeros(length, bool)
        forced[0] = True
        forced[length - 1] |= isolate_last
        # starts are exactly the top-quantile tokens plus the forced ones
        assert np.sum(starts[b, :length] & ~forced) == np.sum(top & ~forced)
        assert np.sum(starts[b]) == np.sum(top | forced)
        assert np.sum(top) >= k
        if not ties and len(np.unique(entropies[b, :length])) == length:
            assert np.sum(top) == k


def test_entropy_spans_under_jit_with_a_traced_quantile():
    rng = np.random.default_rng(3)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    entropies = rng.random((B, T)).astype(np.float32)
    jitted = jax.jit(lambda e, m, q: entropy_spans(e, m, quantile=q))
    for quantile in (0.2, 0.5):
        np.testing.assert_array_equal(jitted(entropies, mask, quantile),
                                      entropy_spans(entropies, mask, quantile=quantile))


def test_segment_dispatches_to_entropy():
    assert "entropy" in termination.STRATEGIES
    rng = np.random.default_rng(4)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    entropies = rng.random((B, T)).astype(np.float32)
    np.testing.assert_array_equal(
        segment("entropy", mask, entropies=entropies, entropy_quantile=0.3, isolate_last=False),
        entropy_spans(entropies, mask, quantile=0.3, isolate_last=False))
    np.testing.assert_array_equal(segment("entropy", mask, entropies=entropies),
                                  entropy_spans(entropies, mask, quantile=0.2))


def test_entropy_bad_input_names_the_argument():
    mask = mask_from_lengths([3, 2], 4)
    entropies = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="entropies"):
        segment("entropy", mask)
    for quantile in (0.0, -0.1, 1.5, np.array([0.2, 0.3])):
        with pytest.raises(ValueError, match="quantile"):
            entropy_spans(entropies, mask, quantile=quantile)
    with pytest.raises(ValueError, match="entropies"):
        entropy_spans(np.zeros((2, 5)), mask, quantile=0.2)
    with pytest.raises(ValueError, match="entropies"):
        entropy_spans(np.zeros(4), mask, quantile=0.2)
    with pytest.raises(ValueError, match="response_mask"):
        entropy_spans(entropies, np.array([[1, 0, 1, 0], [1, 1, 0, 0]]), quantile=0.2)


def test_config_accepts_entropy_and_checks_its_quantile():
    assert base_config().ppo.entropy_quantile == 0.2
    config = tiny_config(**{"ppo.termination": "entropy"})
    validate_config(config)
    for bad in (0.0, 1.2):
        config.ppo.entropy_quantile = bad
        with pytest.raises(ValueError, match="config.ppo.entropy_quantile"):
            validate_config(config)
