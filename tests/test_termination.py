"""Termination conditions: hand cases, the per-sample loop oracle, invariants, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import macro_oracle as oracle
from marl_jax.macro import termination
from marl_jax.macro.termination import (
    fixed_ngram,
    perplexity,
    randomized_ngram,
    segment,
    segment_ids_from_starts,
)

B, T = 6, 16  # shape shared by the property tests, so each function compiles once


def mask_from_lengths(lengths, width):
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def assert_valid_segment_ids(ids, mask, isolate_last):
    """Contiguous, non-decreasing, 0 on the first token and on padding, last token alone."""
    ids = np.asarray(ids)
    assert ids.dtype == np.int32
    for row, mask_row in zip(ids, mask):
        length = int(mask_row.sum())
        assert np.all(row[length:] == 0)
        if length == 0:
            continue
        assert row[0] == 0
        steps = np.diff(row[:length])
        assert set(steps.tolist()) <= {0, 1}
        if isolate_last and length >= 2:
            assert row[length - 1] == row[length - 2] + 1


# ---------------------------------------------------------------- fixed n-gram, by hand

@pytest.mark.smoke
def test_fixed_ngram_hand_cases():
    mask = mask_from_lengths([6, 7, 1, 0, 8], 8)
    np.testing.assert_array_equal(fixed_ngram(mask, 2), [
        [0, 0, 1, 1, 2, 3, 0, 0],   # tokens 0..4 by t // 2, token 5 alone
        [0, 0, 1, 1, 2, 2, 3, 0],   # (L - 1) % n == 0: no empty macro before the last token
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 2, 2, 3, 4],
    ])
    np.testing.assert_array_equal(fixed_ngram(mask, 2, isolate_last=False), [
        [0, 0, 1, 1, 2, 2, 0, 0],
        [0, 0, 1, 1, 2, 2, 3, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 2, 2, 3, 3],
    ])
    np.testing.assert_array_equal(fixed_ngram(mask, 3)[1], [0, 0, 0, 1, 1, 1, 2, 0])
    np.testing.assert_array_equal(fixed_ngram(mask, 1)[4], np.arange(8))
    # n >= T: one macro, then the last token.
    np.testing.assert_array_equal(fixed_ngram(mask, 100)[4], [0, 0, 0, 0, 0, 0, 0, 1])


def test_fixed_ngram_traced_n_under_jit_and_vmap():
    mask = mask_from_lengths([1, 5, 9, 16, 0, 12], T)
    by_n = jax.vmap(lambda n: fixed_ngram(mask, n))(jnp.array([1, 2, 5, 10], jnp.int32))
    for k, n in enumerate([1, 2, 5, 10]):
        np.testing.assert_array_equal(by_n[k], oracle.fixed_ngram(mask, n))
    jitted = jax.jit(lambda m, n: fixed_ngram(m, n))
    np.testing.assert_array_equal(jitted(mask, jnp.int32(3)), oracle.fixed_ngram(mask, 3))


@pytest.mark.parametrize("isolate_last", [True, False])
def test_fixed_ngram_matches_oracle(isolate_last):
    rng = np.random.default_rng(0)
    mask = mask_from_lengths(rng.integers(0, T + 1, 32), T)
    for n in (1, 2, 3, 5, 10, 16, 40):
        np.testing.assert_array_equal(fixed_ngram(mask, n, isolate_last=isolate_last),
                                      oracle.fixed_ngram(mask, n, isolate_last))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, T), min_size=B, max_size=B), n=st.integers(1, T + 4),
       isolate_last=st.booleans())
def test_fixed_ngram_invariants(lengths, n, isolate_last):
    mask = mask_from_lengths(lengths, T)
    ids = np.asarray(fixed_ngram(mask, n, isolate_last=isolate_last))
    assert_valid_segment_ids(ids, mask, isolate_last)
    for row, length in zip(ids, lengths):
        body = length - 1 if isolate_last else length
        sizes = np.bincount(row[:length])
        assert sizes.min() >= 1
        # every macro of the body has n tokens except possibly its last one
        body_sizes = sizes[:-1] if (isolate_last and length >= 2) else sizes
        if body > 0:
            assert np.all(body_sizes[:-1] == n) and 1 <= body_sizes[-1] <= n
    permutation = np.random.default_rng(n).permutation(B)
    np.testing.assert_array_equal(fixed_ngram(mask[permutation], n, isolate_last=isolate_last),
                                  ids[permutation])


# ---------------------------------------------------------------- randomized n-gram

LENGTHS, REPEATS = (2, 3, 5, 10), 3
POOL = sum(LENGTHS) * REPEATS  # 60 tokens before the list runs out


def _orders(key, batch):
    """Each row's shuffled length list, read off a response long enough to use all of it."""
    width = POOL + 2
    ids = np.asarray(randomized_ngram(key, np.ones((batch, width), np.int32)))
    orders = []
    for row in ids:
        sizes = np.bincount(row)
        assert sizes[-1] == 1 and sizes[-2] == 1  # the remainder macro, then the last token
        orders.append(tuple(sizes[:-2].tolist()))
    return orders


def test_randomized_ngram_uses_each_rows_own_shuffle():
    orders = _orders(jax.random.key(0), 8)
    for order in orders:
        assert sorted(order) == sorted(LENGTHS * REPEATS)
    assert len(set(orders)) == 8  # rows are shuffled independently


def test_randomized_ngram_is_deterministic_per_key():
    mask = mask_from_lengths([70, 30, 1, 0, 62, 61, 12, 5], POOL + 10)
    first = randomized_ngram(jax.random.key(3), mask)
    np.testing.assert_array_equal(first, randomized_ngram(jax.random.key(3), mask))
    assert not np.array_equal(first, randomized_ngram(jax.random.key(4), mask))


@pytest.mark.parametrize("isolate_last", [True, False])
def test_randomized_ngram_matches_oracle_on_short_rows(isolate_last):
    key = jax.random.key(7)
    orders = _orders(key, 8)
    width = POOL + 2
    lengths = [0, 1, 2, 7, 33, 60, 61, 62]
    ids = randomized_ngram(key, mask_from_lengths(lengths, width), isolate_last=isolate_last)
    assert_valid_segment_ids(ids, mask_from_lengths(lengths, width), isolate_last)
    for row, length, order in zip(np.asarray(ids), lengths, orders):
        expected = oracle.ids_from_segments(oracle.list_segments(length, order, isolate_last),
                                            width)
        np.testing.assert_array_equal(row, expected)


# ---------------------------------------------------------------- perplexity

def test_perplexity_boundary_is_at_the_rising_token():
    # ppl = exp(1), exp(2), exp(.5), exp(.5), exp(3), exp(1): rises into tokens 1 and 4.
    ref_logprobs = np.array([[-1.0, -2.0, -0.5, -0.5, -3.0, -1.0, 0.0, 0.0]], np.float32)
    mask = mask_from_lengths([6], 8)
    np.testing.assert_array_equal(perplexity(ref_logprobs, mask), [[0, 1, 1, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(perplexity(ref_logprobs, mask, isolate_last=False),
                                  [[0, 1, 1, 1, 2, 2, 0, 0]])


@pytest.mark.parametrize("isolate_last", [True, False])
def test_perplexity_ids_have_the_mask_shape_at_every_width(isolate_last):
    # Width 1: one token or none, a single macro 0 (the ids were once [B, 0] here).
    ids = perplexity(np.array([[-0.3], [0.0]], np.float32), mask_from_lengths([1, 0], 1),
                     isolate_last=isolate_last)
    assert ids.shape == (2, 1) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [[0], [0]])
    # Width 2: a rise into token 1; no rise (token 1 is alone only as the isolated last token);
    # a single token; an empty row.
    ids = perplexity(np.array([[-1, -2], [-2, -1], [-2, -1], [-5, -5]], np.float32),
                     mask_from_lengths([2, 2, 1, 0], 2), isolate_last=isolate_last)
    assert ids.shape == (4, 2)
    np.testing.assert_array_equal(
        ids, [[0, 1], [0, 1] if isolate_last else [0, 0], [0, 0], [0, 0]])
    # Width 6: rises into token 2 (row 0, a tie at 3 continues the macro) and tokens 1, 2 (row 1);
    # the log-probabilities on padding are ignored.
    ref_logprobs = np.array([[-1.0, -0.5, -1.5, -1.5, -0.2, 9.0],
                             [-3.0, -4.0, -5.0, 0.0, -9.0, 0.0]], np.float32)
    ids = perplexity(ref_logprobs, mask_from_lengths([5, 3], 6), isolate_last=isolate_last)
    np.testing.assert_array_equal(
        ids, [[0, 0, 1, 1, 2 if isolate_last else 1, 0], [0, 1, 2, 0, 0, 0]])


def test_perplexity_does_not_overflow():
    ref_logprobs = np.array([[-200.0, -300.0, -100.0, -400.0]], np.float32)  # exp overflows
    np.testing.assert_array_equal(perplexity(ref_logprobs, np.ones((1, 4), np.int32)),
                                  [[0, 1, 1, 2]])


@pytest.mark.parametrize("isolate_last", [True, False])
def test_perplexity_matches_oracle(isolate_last):
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, T + 1, 32)
    mask = mask_from_lengths(lengths, T)
    ref_logprobs = np.round(rng.normal(-2, 1, (32, T)), 1).astype(np.float32)  # with ties
    ids = perplexity(ref_logprobs, mask, isolate_last=isolate_last)
    assert_valid_segment_ids(ids, mask, isolate_last)
    for row, lp, length in zip(np.asarray(ids), ref_logprobs, lengths):
        segments = oracle.perplexity_segments(lp, length, isolate_last)
        np.testing.assert_array_equal(row, oracle.ids_from_segments(segments, T))


# ---------------------------------------------------------------- starts -> ids, dispatcher

def test_segment_ids_from_starts_numpy_and_jax():
    starts = np.array([[False, False, True, False, True, True],
                       [False, True, True, False, False, True],
                       [True, True, True, True, True, True]])
    mask = mask_from_lengths([5, 3, 0], 6)
    expected = [[0, 0, 1, 1, 2, 0],   # token 0 always starts a macro; starts on padding ignored
                [0, 1, 2, 0, 0, 0],
                [0, 0, 0, 0, 0, 0]]
    host = segment_ids_from_starts(starts, mask)
    assert isinstance(host, np.ndarray) and host.dtype == np.int32
    np.testing.assert_array_equal(host, expected)
    device = segment_ids_from_starts(jnp.asarray(starts), jnp.asarray(mask))
    assert isinstance(device, jax.Array) and device.dtype == jnp.int32
    np.testing.assert_array_equal(device, expected)


def test_segment_dispatches_to_each_strategy():
    mask = mask_from_lengths([9, 4, 16, 1, 0, 13], T)
    key = jax.random.key(1)
    ref_logprobs = np.random.default_rng(2).normal(size=(B, T)).astype(np.float32)
    np.testing.assert_array_equal(segment("fixed", mask, n=3), fixed_ngram(mask, 3))
    np.testing.assert_array_equal(segment("randomized", mask, key=key, lengths=(1, 4), repeats=2),
                                  randomized_ngram(key, mask, lengths=(1, 4), repeats=2))
    np.testing.assert_array_equal(segment("perplexity", mask, ref_logprobs=ref_logprobs),
                                  perplexity(ref_logprobs, mask))
    assert termination.STRATEGIES == ("fixed", "randomized", "perplexity", "entropy",
                                      "low_probability", "step")


# ---------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    mask = mask_from_lengths([3, 2], 4)
    with pytest.raises(ValueError, match=r"\bn\b"):
        fixed_ngram(mask, 0)
    with pytest.raises(ValueError, match=r"\bn\b"):
        fixed_ngram(mask, 2.5)
    with pytest.raises(ValueError, match="response_mask"):
        fixed_ngram(np.array([[1, 2, 0, 0]]), 2)
    with pytest.raises(ValueError, match="response_mask"):
        fixed_ngram(np.array([[1, 0, 1, 0]]), 2)
    with pytest.raises(ValueError, match="response_mask"):
        fixed_ngram(np.ones(4), 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        perplexity(np.zeros((2, 5)), mask)
    with pytest.raises(ValueError, match="strategy"):
        segment("parse", mask)
    with pytest.raises(ValueError, match="key"):
        segment("randomized", mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        segment("perplexity", mask)
    with pytest.raises(ValueError, match="lengths"):
        randomized_ngram(jax.random.key(0), mask, lengths=(2, 0))
    with pytest.raises(ValueError, match="repeats"):
        randomized_ngram(jax.random.key(0), mask, repeats=0)
    with pytest.raises(ValueError, match="starts"):
        segment_ids_from_starts(np.zeros((2, 3), bool), mask)


def test_only_static_checks_apply_under_jit():
    mask = mask_from_lengths([3, 2], 4)
    with pytest.raises(ValueError, match="response_mask"):
        jax.jit(lambda m: fixed_ngram(m, 2))(mask[0])
    # a traced n below 1 cannot be checked; it is treated as 1
    np.testing.assert_array_equal(jax.jit(lambda n: fixed_ngram(mask, n))(jnp.int32(0)),
                                  oracle.fixed_ngram(mask, 1))


def test_mean_macro_length_counts_each_rows_macros_over_its_valid_tokens():
    # A response of 7 tokens and an empty row, and a trajectory whose action tokens (1) have an
    # observation hole: macros within turns, the hole's ids 0 as every termination writes them.
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0], [0] * 8])
    seg = np.asarray(termination.fixed_ngram(mask, 3))
    actions = np.array([[1, 1, 1, 0, 0, 1, 1, 1]])
    turn_ids = np.array([[0, 0, 0, 0, 0, 1, 1, 1]])
    within = np.asarray(termination.segment("fixed", actions, n=2, turn_ids=turn_ids))
    for s, m in ((seg, mask), (within, actions)):
        macros = [len(np.unique(s[b][m[b] != 0])) for b in range(len(m))]
        np.testing.assert_array_equal(termination.macros_per_row(s, m), macros)
        assert float(termination.mean_macro_length(s, m)) == pytest.approx(m.sum() / sum(macros))
    assert float(termination.mean_macro_length(seg, np.zeros_like(mask))) == 0.0
