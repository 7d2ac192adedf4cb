"""Per-turn credit without a critic: each action token's reward-to-go from its turn, the
leave-one-out baseline per turn index (a sample that stopped earlier counts 0) and the
per-turn-index normalisation over the samples that reached the turn (MT-GRPO style).

Hand cases of each function; observation spans inserted anywhere between action tokens change
no action token's advantage and get 0; one turn is RLOO. A "continue or stop" chain where the
policy decides when to stop, enumerated exactly over every group of k trajectories: the
leave-one-out estimator's expected gradient is the true gradient (jax.grad of the exact J),
the per-turn-index normalisation's is not (its bias, a wrong sign at the first turn, and
without the division by the standard deviation turn t's true gradient times
E[1 - 1 / n_t], by the binomial law of n_t); Monte Carlo groups drawn with a fixed seed agree
with both expectations within 4 standard errors."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import estimators

EPS = estimators.GROUP_STD_EPS


def _rows(*specs):
    """Rows from (kinds, turn ids, {position: reward}): kinds a (action), o (observation),
    p (padding); (rewards, action mask, turn ids) `[B, T]`."""
    width = len(specs[0][0])
    rewards = np.zeros((len(specs), width), np.float32)
    for b, (_, _, placed) in enumerate(specs):
        for position, value in placed.items():
            rewards[b, position] = value
    mask = np.array([[k == "a" for k in kinds] for kinds, _, _ in specs], np.int32)
    turn_ids = np.array([turns for _, turns, _ in specs], np.int32)
    return rewards, mask, turn_ids


def _hand_group():
    """k = 3 samples of one prompt. Row 0: three turns with rewards 1 (0.25 + 0.75 on two
    action tokens), -1, 3, so G = (3, 2, 3); row 1: two turns, 2 and 1, G = (3, 1); row 2: one
    turn, 0, G = (0). Rewards on observation and padding tokens are ignored."""
    return _rows(
        ("aaoaooaaop", [0, 0, 0, 1, 1, 1, 2, 2, 2, 2], {0: 0.25, 1: 0.75, 3: -1.0, 7: 3.0,
                                                       8: 100.0}),
        ("aoaaoppppp", [0, 0, 1, 1, 1, 1, 1, 1, 1, 1], {0: 2.0, 1: -7.0, 3: 1.0, 9: 50.0}),
        ("aaaopppppp", [0] * 10, {3: 9.0}),
    )


def test_turn_returns_by_hand():
    rewards, mask, turn_ids = _hand_group()
    np.testing.assert_array_equal(np.asarray(estimators.turn_returns(rewards, mask, turn_ids)), [
        [3, 3, 0, 2, 0, 0, 3, 3, 0, 0],
        [3, 0, 1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])


def test_turn_rloo_by_hand():
    """Turn 0: G = (3, 3, 0), baselines (1.5, 1.5, 3); turn 1: G = (2, 1, 0) with row 2's 0
    (it stopped), baselines (0.5, 1); turn 2: G = (3, 0, 0), row 0's baseline 0."""
    rewards, mask, turn_ids = _hand_group()
    got = np.asarray(estimators.turn_rloo_advantages(rewards, mask, turn_ids, 3))
    np.testing.assert_allclose(got, [
        [1.5, 1.5, 0, 1.5, 0, 0, 3, 3, 0, 0],
        [1.5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [-3, -3, -3, 0, 0, 0, 0, 0, 0, 0]], atol=1e-6)


def test_turn_index_normalisation_by_hand():
    """Turn 0, all three reached: G = (3, 3, 0), mean 2, std sqrt(3); turn 1, rows 0 and 1:
    G = (2, 1), mean 1.5, std sqrt(0.5); turn 2, row 0 alone: 0."""
    rewards, mask, turn_ids = _hand_group()
    s0, s1 = np.sqrt(3.0) + EPS, np.sqrt(0.5) + EPS
    got = np.asarray(estimators.turn_index_normalised_advantages(rewards, mask, turn_ids, 3))
    np.testing.assert_allclose(got, [
        [1 / s0, 1 / s0, 0, 0.5 / s1, 0, 0, 0, 0, 0, 0],
        [1 / s0, 0, -0.5 / s1, -0.5 / s1, 0, 0, 0, 0, 0, 0],
        [-2 / s0, -2 / s0, -2 / s0, 0, 0, 0, 0, 0, 0, 0]], rtol=1e-6)
    centred = np.asarray(estimators.turn_index_normalised_advantages(
        rewards, mask, turn_ids, 3, divide_by_std=False))
    np.testing.assert_allclose(centred, [
        [1, 1, 0, 0.5, 0, 0, 0, 0, 0, 0],
        [1, 0, -0.5, -0.5, 0, 0, 0, 0, 0, 0],
        [-2, -2, -2, 0, 0, 0, 0, 0, 0, 0]], atol=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda r, m, t: estimators.turn_rloo_advantages(r, m, t, 2),
     "group_size=2 must divide the number of rows 3"),
    (lambda r, m, t: estimators.turn_index_normalised_advantages(r, m, t, 1),
     "group_size must be >= 2"),
    (lambda r, m, t: estimators.turn_rloo_advantages(r, m, t, 3.0),
     "group_size must be a Python int"),
    (lambda r, m, t: estimators.turn_returns(r, m, t[:, ::-1]),
     "turn_ids must be non-decreasing along each row"),
    (lambda r, m, t: estimators.turn_returns(r, m, t + 8),
     r"turn_ids must lie in \[0, 10\)"),
    (lambda r, m, t: estimators.turn_returns(r, m, t.astype(np.float32)),
     "turn_ids must be integers"),
    (lambda r, m, t: estimators.turn_returns(r[:, :9], m, t),
     r"turn_rewards has shape \(3, 9\) but action_mask has shape \(3, 10\)"),
    (lambda r, m, t: estimators.turn_returns(r, m * 2, t),
     "action_mask must contain only 0 and 1"),
])
def test_bad_input_is_one_line(call, message):
    rewards, mask, turn_ids = _hand_group()
    with pytest.raises(ValueError, match=message) as error:
        call(rewards, mask, turn_ids)
    assert "\n" not in str(error.value)


# ---- observation spans -----------------------------------------------------------------------
def _random_turns(rng, rows, max_turns=4):
    """Rows of 1..max_turns turns of 1-4 action tokens each, a reward on every action token
    (the turn's on its last, a small per-token one on the others): per row, a list of
    (turn id, reward) per action token."""
    out = []
    for _ in range(rows):
        tokens = []
        for turn in range(int(rng.integers(1, max_turns + 1))):
            size = int(rng.integers(1, 5))
            tokens += [(turn, float(rng.normal(0, 0.1)) if i < size - 1 else float(rng.normal()))
                       for i in range(size)]
        out.append(tokens)
    return out


def _lay_out(rows, rng=None):
    """The rows' action tokens in order, with (when `rng` is given) observation spans of 1-3
    tokens at random between any two action tokens and after the last, carrying the turn id of
    the action token before them and noise as rewards; padding after. (rewards, mask, turn
    ids, the action tokens' positions)."""
    laid, places = [], []
    for tokens in rows:
        row, where = [], []
        for i, (turn, reward) in enumerate(tokens):
            where.append(len(row))
            row.append((1, turn, reward))
            if rng is not None and (i == len(tokens) - 1 or rng.random() < 0.5):
                row += [(0, turn, float(rng.normal(0, 10)))] * int(rng.integers(1, 4))
        laid.append(row)
        places.append(where)
    width = max(len(row) for row in laid) + 2
    rewards = np.zeros((len(rows), width), np.float32)
    mask = np.zeros((len(rows), width), np.int32)
    turn_ids = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(laid):
        for t, (action, turn, reward) in enumerate(row):
            mask[b, t], turn_ids[b, t], rewards[b, t] = action, turn, reward
        turn_ids[b, len(row):] = row[-1][1]
        rewards[b, len(row):] = 33.0  # padding: ignored
    return rewards, mask, turn_ids, places


@pytest.mark.parametrize("name", ["turn_returns", "turn_rloo_advantages",
                                  "turn_index_normalised_advantages"])
def test_observation_spans_change_no_action_token(name):
    rng = np.random.default_rng(11)
    call = getattr(estimators, name)
    extra = () if name == "turn_returns" else (3,)
    for _ in range(3):
        rows = _random_turns(rng, 6)
        plain = _lay_out(rows)
        spaced = _lay_out(rows, rng)
        before = np.asarray(call(*plain[:3], *extra))
        after = np.asarray(call(*spaced[:3], *extra))
        assert spaced[0].shape[1] > plain[0].shape[1]
        for b in range(len(rows)):
            np.testing.assert_allclose(after[b, spaced[3][b]], before[b, plain[3][b]],
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(after[spaced[1] == 0], 0.0)


def test_one_turn_is_rloo_of_the_score():
    """One turn, the score on the last action token, responses of any length (one empty, its
    score 0): every action token gets RLOO's leave-one-out advantage of its row's score."""
    rng = np.random.default_rng(4)
    k, rows, width = 4, 8, 9
    lengths = np.concatenate([rng.integers(1, width + 1, rows - 1), [0]])
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    scores = np.where(lengths > 0, rng.normal(size=rows), 0).astype(np.float32)
    rewards = np.zeros((rows, width), np.float32)
    rewards[np.arange(rows - 1), lengths[:-1] - 1] = scores[:-1]
    got = estimators.turn_rloo_advantages(rewards, mask, np.zeros_like(mask), k)
    rloo = estimators.group_advantages(scores, k, method="rloo")
    loo = scores - (scores.reshape(-1, k).sum(1, keepdims=True) - scores.reshape(-1, k)
                    ).reshape(-1) / (k - 1)
    np.testing.assert_allclose(np.asarray(rloo), loo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(
        estimators.sequence_advantages_to_tokens(rloo, mask)), rtol=1e-6, atol=1e-7)


# ---- the "continue or stop" chain -------------------------------------------------------------
# At turn t = 1..H the policy continues with probability sigmoid(theta_t) and earns r_t, or
# stops (earning nothing, the episode ends); after turn H the episode ends. Outcome s in 0..H-1
# is "stopped at turn s + 1" (turns 1..s + 1, the last a stop), s = H "continued through H".
# Turn 1 costs, the later turns pay: continuing at turn 1 is right (its true gradient is
# positive).
H, K = 3, 3
THETA = np.zeros(H, np.float32)
TURN_REWARDS = np.array([-0.5, 0.5, 2.0], np.float32)


def _outcome_probabilities(theta):
    """P(outcome s) for s = 0..H, from the stop / continue probabilities turn by turn."""
    go = jax.nn.sigmoid(theta)
    reach = jnp.concatenate([jnp.ones(1), jnp.cumprod(go)])
    return reach * jnp.concatenate([1 - go, jnp.ones(1)])


def _expected_return(theta):
    """J(theta) = sum over the H + 1 outcomes of P(outcome) x its return."""
    returns = jnp.asarray([TURN_REWARDS[:s].sum() for s in range(H + 1)])
    return jnp.sum(_outcome_probabilities(theta) * returns)


def _outcome_rows():
    """One trajectory row per outcome: each turn's one action token (its reward r_t if it
    continues, 0 if it stops), a one-token observation after every turn but the last; and the
    score grad_theta log pi of each turn's action, float `[H + 1, H]`."""
    go = 1 / (1 + np.exp(-THETA.astype(np.float64)))
    width = 2 * H
    rewards = np.zeros((H + 1, width), np.float32)
    mask = np.zeros((H + 1, width), np.int32)
    turn_ids = np.zeros((H + 1, width), np.int32)
    score = np.zeros((H + 1, H))
    for s in range(H + 1):
        for t in range(min(s + 1, H)):
            mask[s, 2 * t] = 1
            turn_ids[s, 2 * t:] = t
            rewards[s, 2 * t] = TURN_REWARDS[t] if t < s else 0.0
            score[s, t] = 1 - go[t] if t < s else -go[t]
    return rewards, mask, turn_ids, score


def _group_gradients(outcomes, advantages):
    """Each group's gradient estimate (1 / k) sum_i sum_t A_t^i grad log pi(a_t^i), `[G, H]`,
    for outcomes int `[G, k]` under an advantage function of (rewards, mask, turn ids, k)."""
    rewards, mask, turn_ids, score = _outcome_rows()
    flat = outcomes.reshape(-1)
    per_token = np.asarray(advantages(rewards[flat], mask[flat], turn_ids[flat], K))
    per_turn = per_token[:, 0::2]  # each turn's one action token
    return (per_turn * score[flat]).reshape(-1, K, H).mean(axis=1)


CHAIN_ESTIMATORS = {
    "turn_rloo": estimators.turn_rloo_advantages,
    "turn_index": estimators.turn_index_normalised_advantages,
    "turn_index_centred": lambda *a: estimators.turn_index_normalised_advantages(
        *a, divide_by_std=False),
}


def chain_expectations():
    """The true gradient and each estimator's exact expected gradient, by enumerating every
    group of k outcomes with its probability ((H + 1)^k groups)."""
    true = np.asarray(jax.grad(_expected_return)(jnp.asarray(THETA)), np.float64)
    probabilities = np.asarray(_outcome_probabilities(jnp.asarray(THETA)), np.float64)
    groups = np.array(list(itertools.product(range(H + 1), repeat=K)))
    weights = np.prod(probabilities[groups], axis=1)
    assert np.isclose(weights.sum(), 1.0)
    expected = {name: weights @ _group_gradients(groups, fn)
                for name, fn in CHAIN_ESTIMATORS.items()}
    return true, expected


def test_chain_turn_rloo_is_unbiased_and_turn_index_normalisation_is_not():
    true, expected = chain_expectations()
    # The true gradient by hand: dJ/dtheta_t = sigmoid'(theta_t) x (the return from turn t on,
    # given turn t is reached, continuing there), with sigmoid = 1/2, sigmoid' = 1/4.
    np.testing.assert_allclose(true, [0.25 * (-0.5 + 0.5 * 0.5 + 0.25 * 2.0),
                                      0.5 * 0.25 * (0.5 + 0.5 * 2.0),
                                      0.25 * 0.25 * 2.0], rtol=1e-6)
    # (b) The leave-one-out baseline: the true gradient exactly, no scale factor.
    np.testing.assert_allclose(expected["turn_rloo"], true, atol=1e-6)
    # (a) The per-turn-index normalisation: biased by more than a third of the gradient's
    # largest component, and no positive multiple of the true gradient: at turn 1 it pushes
    # towards stopping where continuing is right.
    bias = expected["turn_index"] - true
    assert np.max(np.abs(bias)) > 0.3 * np.max(np.abs(true))
    assert expected["turn_index"][0] < -0.03 and true[0] > 0.03
    # Without the division: turn t's true gradient times c_t = E[1 - 1 / n_t | reached t],
    # n_t = 1 + Binomial(k - 1, P(reach t)), a factor that falls with t (fewer samples reach
    # the later turns), so the direction is still wrong.
    reach = np.cumprod(np.concatenate([[1.0], 1 / (1 + np.exp(-THETA[:-1].astype(float)))]))
    c = np.array([sum(math.comb(K - 1, j) * q ** j * (1 - q) ** (K - 1 - j) * (1 - 1 / (1 + j))
                      for j in range(K)) for q in reach])
    np.testing.assert_allclose(expected["turn_index_centred"], c * true, atol=1e-6)
    assert c[0] - c[-1] > 0.4


def monte_carlo(groups=20000, seed=0):
    """Errors of each estimator over `groups` sampled groups: (mean error, its standard error)
    per estimator, `[H]` each."""
    probabilities = np.asarray(_outcome_probabilities(jnp.asarray(THETA)), np.float64)
    outcomes = np.random.default_rng(seed).choice(H + 1, size=(groups, K), p=probabilities)
    true = np.asarray(jax.grad(_expected_return)(jnp.asarray(THETA)), np.float64)
    out = {}
    for name, fn in CHAIN_ESTIMATORS.items():
        errors = _group_gradients(outcomes, fn) - true
        out[name] = errors.mean(axis=0), errors.std(axis=0, ddof=1) / np.sqrt(groups)
    return out


def test_monte_carlo_agrees_with_the_enumeration():
    """(c) Sampled groups: the per-turn-index normalisation's mean error is its exact bias,
    the leave-one-out estimator's is 0, each within 4 standard errors; the bias is beyond 4
    standard errors of 0, so the sampling sees it."""
    true, expected = chain_expectations()
    sampled = monte_carlo()
    for name in CHAIN_ESTIMATORS:
        mean, error = sampled[name]
        bias = expected[name] - true
        assert np.all(np.abs(mean - bias) < 4 * error), (name, mean, bias, error)
    mean, error = sampled["turn_index"]
    assert np.any(np.abs(mean) > 4 * error)
    np.testing.assert_array_less(np.abs(sampled["turn_rloo"][0]), 4 * sampled["turn_rloo"][1])


def test_the_turn_records_on_one_response():
    """Through the estimator records (what the step calls): on a single response (one turn,
    the KL penalty on every token and the score on the last) `turn_rloo` is RLOO's advantage,
    and `turn_grpo` is GRPO's normalisation of the KL-regularised return."""
    rng = np.random.default_rng(3)
    lengths = np.array([5, 3, 6, 6, 2, 4])
    mask = (np.arange(6)[None] < lengths[:, None]).astype(np.int32)
    kl = rng.normal(0, 0.3, (6, 6)) * mask
    scores, beta = rng.normal(size=6), 0.1
    rewards = -beta * kl
    rewards[np.arange(6), lengths - 1] += scores
    inputs = estimators.AdvantageInputs(
        scores=jnp.asarray(scores, jnp.float32), kl=jnp.asarray(kl, jnp.float32),
        kl_coef=jnp.float32(beta), rewards=jnp.asarray(rewards, jnp.float32),
        response_mask=jnp.asarray(mask), group_size=3)
    rloo = estimators.ESTIMATORS["rloo"].advantages(inputs)
    turn = estimators.ESTIMATORS["turn_rloo"].advantages(inputs)
    np.testing.assert_allclose(np.asarray(turn), np.asarray(rloo), rtol=1e-5, atol=1e-6)
    returns = (scores - beta * kl.sum(axis=1)).reshape(2, 3)
    normalised = (returns - returns.mean(axis=1, keepdims=True)) / (
        returns.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    want = normalised.reshape(6)[:, None] * mask
    got = estimators.ESTIMATORS["turn_grpo"].advantages(inputs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
