"""Multi-turn trajectories: the observation spans between turns are holes in the action mask,
and a hole takes no GAE step. Inserting observation spans of random lengths at random places
between action segments leaves every action token's advantage and return unchanged (token GAE,
macro GAE under each weighting and aggregation, REINFORCE++, the group estimators) and gives the
observation tokens zero; turn-level GAE is AReaL's formula, computed here by hand (numpy)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import estimators
from marl_jax.macro import advantage, steps, termination


def _batch(seed, rows=4, width=13):
    """A single-turn batch: left-aligned responses (one empty), values, rewards."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, width + 1, rows - 1), [0]])
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    values = rng.normal(size=(rows, width)).astype(np.float32)
    rewards = rng.normal(0, 0.1, size=(rows, width)).astype(np.float32)
    return mask, values, rewards


def _insert_spans(seed, arrays, mask, segments, *, anywhere=False):
    """Every array of `arrays` `[B, T]` with observation spans inserted (1-4 tokens, at random
    boundaries between the action segments, or between any two action tokens with `anywhere`),
    the spans filled with noise: (new arrays, new action mask, the action tokens' positions)."""
    rng = np.random.default_rng(seed)
    rows, width = mask.shape
    out_rows, places = [], []
    for b in range(rows):
        length = int(mask[b].sum())
        cuts = [t for t in range(1, length) if anywhere or segments[b, t] != segments[b, t - 1]]
        chosen = set(rng.choice(cuts, size=min(len(cuts), 3), replace=False).tolist()) \
            if cuts else set()
        if length and rng.random() < 0.5:
            chosen.add(length)  # an observation after the last action (the environment's reply)
        tokens, where = [], []
        for t in range(width):
            if t in chosen:
                tokens += [None] * int(rng.integers(1, 5))
            where.append(len(tokens))
            tokens.append(t)
        out_rows.append((tokens, where))
        places.append(where)
    new_width = max(len(tokens) for tokens, _ in out_rows)
    new_mask = np.zeros((rows, new_width), np.int32)
    new_arrays = [rng.normal(size=(rows, new_width)).astype(a.dtype) if a.dtype.kind == "f"
                  else rng.integers(0, new_width, size=(rows, new_width)).astype(a.dtype)
                  for a in arrays]
    for b, (tokens, where) in enumerate(out_rows):
        for t, position in enumerate(where):
            new_mask[b, position] = mask[b, t]
            for new, old in zip(new_arrays, arrays):
                new[b, position] = old[b, t]
    return new_arrays, new_mask, np.asarray(places)


def _on_actions(new, places):
    return np.take_along_axis(np.asarray(new), places, axis=1)


def _observations(new, new_mask):
    return np.asarray(new)[new_mask == 0]


@pytest.mark.parametrize("weighting, aggregation", list(itertools.product(
    advantage.VALUE_WEIGHTINGS, advantage.REWARD_AGGREGATIONS)))
def test_observation_spans_between_macros_take_no_step(weighting, aggregation):
    for seed in range(3):
        mask, values, rewards = _batch(seed)
        segments = np.asarray(termination.fixed_ngram(mask, 3))
        before = advantage.macro_gae(values, rewards, mask, segments, gamma=0.97, lam=0.9,
                                     value_weighting=weighting, reward_aggregation=aggregation)
        (v, r, s), new_mask, places = _insert_spans(seed, [values, rewards, segments], mask,
                                                    segments)
        after = advantage.macro_gae(v, r, new_mask, s, gamma=0.97, lam=0.9,
                                    value_weighting=weighting, reward_aggregation=aggregation)
        assert new_mask.shape[1] > mask.shape[1]
        for old, new in zip(before, after):
            np.testing.assert_array_equal(_on_actions(new, places) * mask, np.asarray(old))
            np.testing.assert_array_equal(_observations(new, new_mask), 0.0)


def test_token_gae_and_reinforce_pp_step_over_spans_anywhere():
    for seed in range(3):
        mask, values, rewards = _batch(seed)
        tokens = np.asarray(advantage.action_ranks(mask))
        (v, r), new_mask, places = _insert_spans(seed, [values, rewards], mask, tokens,
                                                 anywhere=True)
        for old, new in zip(advantage.gae(values, rewards, mask, gamma=0.97, lam=0.9),
                            advantage.gae(v, r, new_mask, gamma=0.97, lam=0.9)):
            np.testing.assert_array_equal(_on_actions(new, places) * mask, np.asarray(old))
            np.testing.assert_array_equal(_observations(new, new_mask), 0.0)
        old = estimators.reinforce_pp_advantages(rewards, mask)
        new = estimators.reinforce_pp_advantages(r, new_mask)
        np.testing.assert_allclose(_on_actions(new, places) * mask, np.asarray(old), rtol=1e-6)
        np.testing.assert_array_equal(_observations(new, new_mask), 0.0)
        group = estimators.sequence_advantages_to_tokens(jnp.arange(4.0), new_mask)
        np.testing.assert_array_equal(_observations(group, new_mask), 0.0)
        np.testing.assert_array_equal(_on_actions(group, places) * mask,
                                      np.arange(4.0)[:, None] * mask)


def test_turn_gae_is_areal_formula_by_hand():
    """Three turns of 3, 2 and 4 action tokens with observations of 2 and 3 tokens between
    them, and a second row of one turn: a turn's value is the critic's at its first action token,
    its reward the sum of its tokens' (a per-turn reward on its last action token, the score on
    the last one), GAE over turns, the advantage broadcast to the turn's tokens."""
    gamma, lam = 0.9, 0.8
    kinds = "aaaooaaoooaaaa"  # a: action, o: observation
    turn = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    mask = np.array([[k == "a" for k in kinds], [1] * 4 + [0] * 10], np.int32)
    turn_ids = np.array([turn, [0] * 14], np.int32)
    rng = np.random.default_rng(7)
    values = rng.normal(size=mask.shape).astype(np.float32)
    kl = rng.normal(0, 0.05, size=mask.shape).astype(np.float32)
    rewards = np.where(mask != 0, -kl, 0).astype(np.float32)
    rewards[0, 2] += 0.3   # turn 0's reward, on its last action token
    rewards[0, 6] -= 0.2   # turn 1's
    rewards[0, 13] += 1.0  # the final score
    rewards[1, 3] += 0.5
    segments = np.asarray(termination.turns(turn_ids, mask))
    np.testing.assert_array_equal(segments[0], [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(segments[1], [0] * 14)
    adv, ret = advantage.macro_gae(values, rewards, mask, segments, gamma=gamma, lam=lam,
                                   value_weighting="first", reward_aggregation="sum")
    for b in range(2):
        spans = [np.nonzero((mask[b] != 0) & (turn_ids[b] == k))[0] for k in range(3)]
        spans = [s for s in spans if len(s)]
        v = [values[b, s[0]] for s in spans] + [0.0]
        r = [rewards[b, s].sum() for s in spans]
        a = 0.0
        for k in reversed(range(len(spans))):
            a = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * a
            np.testing.assert_allclose(np.asarray(adv)[b, spans[k]], a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(ret)[b, spans[k]], a + v[k], rtol=1e-5,
                                       atol=1e-6)
        np.testing.assert_array_equal(np.asarray(adv)[b, mask[b] == 0], 0.0)


def test_one_action_token_per_macro_over_holes_is_token_gae():
    kinds = "aaoaaooaa"
    mask = np.array([[k == "a" for k in kinds]], np.int32)
    rng = np.random.default_rng(3)
    values, rewards = (rng.normal(size=mask.shape).astype(np.float32) for _ in range(2))
    for weighting in advantage.VALUE_WEIGHTINGS:
        got = advantage.macro_gae(values, rewards, mask, advantage.action_ranks(mask),
                                  value_weighting=weighting)
        for a, b in zip(got, advantage.gae(values, rewards, mask)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # By hand: the next state of the action before a hole is the action after it.
    actions = np.nonzero(mask[0])[0]
    a, want = 0.0, {}
    for i in reversed(range(len(actions))):
        t = actions[i]
        following = values[0, actions[i + 1]] if i + 1 < len(actions) else 0.0
        a = rewards[0, t] + following - values[0, t] + 0.95 * a
        want[t] = a
    got = np.asarray(advantage.gae(values, rewards, mask)[0])[0]
    np.testing.assert_allclose([got[t] for t in actions], [want[t] for t in actions], rtol=1e-5)


def test_segment_ids_that_skip_a_macro_across_a_hole_are_refused():
    mask = np.array([[1, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match="rise by 0 or 1 from one action token to the next"):
        advantage.macro_gae(np.zeros((1, 5)), np.zeros((1, 5)), mask,
                            np.array([[0, 0, 1, 2, 2]]))
    # The hole's own id is not read.
    advantage.macro_gae(np.zeros((1, 5)), np.zeros((1, 5)), mask, np.array([[0, 0, 9, 1, 1]]))


def _trajectory(seed, rows=3, turns=3, width=30):
    """Random multi-turn trajectories: per row, turns of 1-5 action tokens, observation spans
    of 1-3 tokens between them; (action mask, turn ids, ref logprobs, entropies)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, width), np.int32)
    turn_ids = np.zeros((rows, width), np.int32)
    for b in range(rows):
        t = 0
        for k in range(turns):
            actions = int(rng.integers(1, 6))
            mask[b, t:t + actions] = 1
            turn_ids[b, t:] = k
            t += actions + (int(rng.integers(1, 4)) if k < turns - 1 else 0)
    return (mask, turn_ids, rng.normal(-2, 1, (rows, width)).astype(np.float32),
            rng.random((rows, width)).astype(np.float32))


# The step rule's vocabulary: token texts with and without delimiters, and ids drawn from it.
STEP_TABLE = steps.table_of_texts(["", "a", ".", " b", "\n", ". c", "d!"], ("\n", ". "))


def _step_tokens(mask):
    return np.random.default_rng(7).integers(0, 7, np.shape(mask))


def _within(strategy, mask, turn_ids, logp, entropy, **kw):
    return np.asarray(termination.segment(
        strategy, mask, turn_ids=turn_ids, key=jax.random.key(0), ref_logprobs=logp,
        entropies=entropy, logprobs=logp, n=kw.pop("n", 3), token_ids=_step_tokens(mask),
        step_table=STEP_TABLE, **kw))


@pytest.mark.parametrize("strategy", termination.STRATEGIES)
def test_a_turn_boundary_always_ends_a_macro(strategy):
    for seed in range(4):
        mask, turn_ids, logp, entropy = _trajectory(seed)
        ids = _within(strategy, mask, turn_ids, logp, entropy)
        advantage._check_segment_ids(ids, mask)  # contiguous over the action tokens
        for b in range(mask.shape[0]):
            on = mask[b] != 0
            for macro in np.unique(ids[b, on]):
                assert len(np.unique(turn_ids[b, on][ids[b, on] == macro])) == 1
            # Each turn's last action token is a macro of its own.
            last = [np.nonzero(on & (turn_ids[b] == k))[0][-1]
                    for k in np.unique(turn_ids[b, on])]
            assert all(np.sum(ids[b, on] == ids[b, t]) == 1 for t in last)


@pytest.mark.parametrize("strategy", termination.STRATEGIES)
def test_one_turn_without_holes_is_the_single_response_strategy(strategy):
    mask, values, _ = _batch(5, rows=4, width=17)
    logp = np.random.default_rng(5).normal(-2, 1, mask.shape).astype(np.float32)
    entropy = np.random.default_rng(6).random(mask.shape).astype(np.float32)
    plain = np.asarray(termination.segment(strategy, mask, key=jax.random.key(0),
                                           ref_logprobs=logp, entropies=entropy, logprobs=logp,
                                           n=3, token_ids=_step_tokens(mask),
                                           step_table=STEP_TABLE))
    np.testing.assert_array_equal(
        _within(strategy, mask, np.zeros_like(mask), logp, entropy), plain)


def test_fixed_ngrams_restart_at_every_turn_by_hand():
    """Turns of 3, 2 and 4 action tokens, n = 2, each turn's last token alone:
    [0 1][2] | [3][4] | [5 6][7][8]."""
    kinds, turn = "aaaooaaoooaaaa", [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    mask = np.array([[k == "a" for k in kinds]], np.int32)
    ids = _within("fixed", mask, np.array([turn]), None, None, n=2)
    np.testing.assert_array_equal(ids[0][mask[0] != 0], [0, 0, 1, 2, 3, 4, 4, 5, 6])
    # n = 1 within turns is one macro per action token: token GAE over the holes.
    np.testing.assert_array_equal(_within("fixed", mask, np.array([turn]), None, None, n=1),
                                  np.asarray(advantage.action_ranks(mask)))
