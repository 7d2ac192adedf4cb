"""Ground-truth advantages from Monte Carlo continuations (`credit/truth.py`) and their scores
(`credit/estimator_scores.py`): on a tabular problem (a random 4-token model, 4-token responses,
temperature 1) every state's value follows exactly by enumerating all continuations with the
model's probabilities, and the Monte Carlo values and A* agree with it within their standard
errors; the continuations of a state are fresh samples from its prefix with its keys (a
full-forward reference sampler draws the same tokens, and from the empty prefix `generate` with
the same keys); the scorer against numpy / scipy and an explicit resampling loop, correlation 1
for the exact advantages, the known correlation, sign agreement and variance of a noisy
estimator, the noise ceiling of pure noise and of a known reliability; bad input."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import marl_jax.models as M
from marl_jax.credit import estimator_scores as cs
from marl_jax.credit import truth as ct
from marl_jax.eval import study_stats as st
from marl_jax.rollout import generate

VOCAB, RESPONSE, EOS, PAD = 4, 4, 2, 0
GAMMA = 0.5
K = 256
CHUNK = 7
# Per-token rewards of the ids; at the last token a score of the whole response (and of the
# prompt's last token), -1 when it ended without EOS: a reward model and the missing-EOS penalty.
TOKEN_REWARD = (0.5, -0.3, 0.0, 0.2)


def reward_fn(prompt_ids, prompt_mask, ids, mask):
    valid = mask != 0
    last = valid & (jnp.arange(ids.shape[1])[None, :] == valid.sum(axis=1, keepdims=True) - 1)
    score = ((valid & (ids == 0)).sum(axis=1) - 0.5 * (valid & (ids == 1)).sum(axis=1)
             - 1.0 * ~(valid & (ids == EOS)).any(axis=1) + 0.3 * prompt_ids[:, -1])
    return jnp.where(valid, jnp.asarray(TOKEN_REWARD)[ids] + jnp.where(last, score[:, None], 0.0), 0.0)


def token_reward(prompt_last: int, prefix: tuple, token: int) -> float:
    """The reward of `token` after `prefix`, by the rules above, one token at a time."""
    seq = prefix + (token,)
    reward = TOKEN_REWARD[token]
    if token == EOS or len(seq) == RESPONSE:
        reward += seq.count(0) - 0.5 * seq.count(1) - (token != EOS) + 0.3 * prompt_last
    return reward


@pytest.fixture(scope="module")
def tabular():
    config = M.ModelConfig.for_family("llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                                      max_position_embeddings=16, initializer_range=0.1)
    model = M.CausalLM(config)
    params = M.init_params(model, jax.random.key(4))
    rng = np.random.default_rng(0)
    prompt_ids = jnp.asarray(np.repeat(rng.integers(0, VOCAB, size=(3, 4)), 2, axis=0), jnp.int32)
    prompt_mask = jnp.asarray(np.repeat([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], 2, axis=0), jnp.int32)
    # Two responses per prompt (every token string has positive probability at temperature 1):
    # ended by EOS after 1, 2, 3 and 4 tokens, and two cut at the budget without one.
    response_ids = jnp.asarray([[2, 0, 0, 0], [1, 3, 0, 1], [0, 2, 0, 0], [3, 1, 2, 0], [0, 1, 3, 2], [1, 0, 3, 3]],
                               jnp.int32)
    response_mask = jnp.asarray([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
                                jnp.int32)
    return model, params, prompt_ids, prompt_mask, response_ids, response_mask


@functools.lru_cache(maxsize=1)
def _forward(model):
    return jax.jit(lambda params, ids, mask: M.forward_logits(model, params, ids, mask))


def exact_values(model, params, prompt_ids, prompt_mask) -> list[dict]:
    """Per prompt row, V(prefix) for every response prefix by enumeration: one forward pass over
    all VOCAB^RESPONSE token strings gives the next-token distribution after each of their
    prefixes (the model is causal), then the expected discounted reward-to-go by recursion."""
    strings = np.array(list(itertools.product(range(VOCAB), repeat=RESPONSE)), np.int32)
    values = []
    for row in range(prompt_ids.shape[0]):
        ids = np.concatenate([np.repeat(np.asarray(prompt_ids[row:row + 1]), len(strings), 0), strings], 1)
        mask = np.concatenate([np.repeat(np.asarray(prompt_mask[row:row + 1]), len(strings), 0),
                               np.ones_like(strings)], 1)
        logits = np.asarray(_forward(model)(params, ids, mask), np.float64)[:, -RESPONSE - 1:-1]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        values.append(_value_function(probs / probs.sum(-1, keepdims=True), int(prompt_ids[row, -1])))
    return values


def _value_function(probs, prompt_last: int):
    """V(prefix) from the next-token probabilities `[VOCAB^RESPONSE, RESPONSE, VOCAB]` of every
    token string."""

    @functools.lru_cache(maxsize=None)
    def value(prefix: tuple) -> float:
        if len(prefix) == RESPONSE or (prefix and prefix[-1] == EOS):
            return 0.0
        string = prefix + (0,) * (RESPONSE - len(prefix))
        p = probs[int(np.ravel_multi_index(string, (VOCAB,) * RESPONSE)), len(prefix)]
        return sum(p[a] * (token_reward(prompt_last, prefix, a) + GAMMA * value(prefix + (a,)))
                   for a in range(VOCAB))

    return value


def exact_advantage(value, prompt_last, response, start, end) -> float:
    own = sum(GAMMA ** (u - start) * token_reward(prompt_last, tuple(response[:u]), response[u])
              for u in range(start, end))
    return own + GAMMA ** (end - start) * value(tuple(response[:end])) - value(tuple(response[:start]))


@pytest.fixture(scope="module")
def truth(tabular):
    """Every token of every response, its 2-token macros and the whole response, K = 256
    continuations per state in chunks of CHUNK = 7 states; the exact values and A* beside them,
    and the (states valued, total) of every progress call."""
    model, params, prompt_ids, prompt_mask, response_ids, response_mask = tabular
    lengths = ct.valid_lengths(response_mask)
    token_rows = np.repeat(np.arange(6), lengths)
    token_starts = np.concatenate([np.arange(n) for n in lengths])
    macro_rows, macro_starts, macro_ends = ct.segment_spans(np.arange(RESPONSE)[None, :].repeat(6, 0) // 2,
                                                            response_mask)
    rows = np.r_[token_rows, macro_rows, np.arange(6)]
    starts = np.r_[token_starts, macro_starts, np.zeros(6, int)]
    ends = np.r_[token_starts + 1, macro_ends, lengths]
    calls = []
    got = ct.advantage_truth(model, params, prompt_ids, prompt_mask, response_ids, response_mask, rows, starts,
                             ends, reward_fn=reward_fn, key=jax.random.key(7), num_continuations=K,
                             temperature=1.0, eos_id=EOS, pad_id=PAD, gamma=GAMMA, chunk_states=CHUNK,
                             progress=lambda done, total: calls.append((done, total)))
    values = exact_values(model, params, prompt_ids, prompt_mask)
    responses = [tuple(int(x) for x in r[:n]) for r, n in zip(np.asarray(response_ids), lengths)]
    prompt_last = np.asarray(prompt_ids[:, -1]).tolist()
    exact_v = np.array([values[b](responses[b][:t]) for b, t in zip(got.states.rows, got.states.positions)])
    exact_a = np.array([exact_advantage(values[b], prompt_last[b], responses[b], s, e)
                        for b, s, e in zip(rows, starts, ends)])
    return got, exact_v, exact_a, values, responses, calls


def test_segment_spans_of_hand_made_segments():
    seg = np.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 0, 0], [0, 0, 0, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    rows, starts, ends = ct.segment_spans(seg, mask)
    assert list(zip(rows.tolist(), starts.tolist(), ends.tolist())) == [
        (0, 0, 2), (0, 2, 5), (0, 5, 6), (1, 0, 1), (1, 1, 3), (1, 3, 4), (2, 0, 1)]


def _assert_chi2_mean(squares):
    """The mean of n squared z-scores lies inside the central 99.9% of chi2(n) / n."""
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], squares.size) / squares.size
    assert lo < np.mean(squares) < hi, (lo, np.mean(squares), hi)


def test_monte_carlo_values_and_advantages_agree_with_enumeration(truth, tabular):
    got, exact_v, exact_a, values, responses, progress = truth
    states = got.states
    # One progress call per chunk of CHUNK states, counting up to all of them.
    m = len(states.rows)
    assert m > 2 * CHUNK and progress == [(min(lo + CHUNK, m), m) for lo in range(0, m, CHUNK)]
    lengths = ct.valid_lengths(tabular[5])
    assert states.returns.shape == (len(states.rows), K)
    terminal = states.positions == lengths[states.rows]
    assert terminal.any() and np.all(states.mean[terminal] == 0) and np.all(states.se[terminal] == 0)
    z_v = (states.mean - exact_v)[~terminal] / states.se[~terminal]
    z_a = (got.value - exact_a) / got.se
    for z in (z_v, z_a):
        assert np.abs(z).max() < 4, z
        _assert_chi2_mean(z ** 2)
    # The check has power: the same estimates are far from the value one token later, and from
    # advantages that discount the end state's value by one power of gamma too few.
    shifted = np.array([values[b](responses[b][:min(t + 1, lengths[b])])
                        for b, t in zip(states.rows, states.positions)])
    assert np.mean(((states.mean - shifted)[~terminal] / states.se[~terminal]) ** 2) > 10
    end_values = np.array([values[b](responses[b][:e]) for b, e in zip(got.rows, got.ends)])
    short = exact_a + (1 - GAMMA) * GAMMA ** (got.ends - got.starts - 1) * end_values
    assert np.mean(((got.value - short) / got.se) ** 2) > 5
    # The standard errors are those of K samples (the start's and the discounted end's for a
    # span), the halves average to the whole.
    np.testing.assert_allclose(states.se, states.returns.std(axis=1, ddof=1) / np.sqrt(K))
    start_var, end_var = (states.returns[[np.flatnonzero((states.rows == b) & (states.positions == t))[0]
                                          for b, t in zip(got.rows, at)]].var(axis=1, ddof=1) / K
                          for at in (got.starts, got.ends))
    np.testing.assert_allclose(got.se, np.sqrt(start_var + GAMMA ** (2 * (got.ends - got.starts)) * end_var))
    np.testing.assert_allclose(got.halves.mean(axis=1), got.value, atol=1e-12)
    # Independent halves of K / 2: their difference has variance 4 se^2.
    _assert_chi2_mean((got.halves[:, 0] - got.halves[:, 1]) ** 2 / (4 * got.se ** 2))
    assert np.corrcoef(got.halves.T)[0, 1] > 0.5, "the halves measure the same advantages"


def _reference_continuations(model, params, prompt_ids, prompt_mask, response_ids, positions, keys):
    """Fresh sampling after prompt + response[:t] `[N, ...]` with full forward passes (no cache):
    the token at response position u >= t drawn as categorical(fold_in(key, u), logits), none
    after EOS. Returns tokens `[N, RESPONSE]` (PAD after the end)."""
    tokens = np.where(np.arange(RESPONSE)[None, :] < positions[:, None], np.asarray(response_ids), PAD)
    done = np.array([t > 0 and tokens[i, t - 1] == EOS for i, t in enumerate(positions)])
    draw = jax.vmap(lambda key, u, logits: jax.random.categorical(jax.random.fold_in(key, u), logits))
    width = prompt_ids.shape[1]
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(tokens)], axis=1)
    for u in range(RESPONSE):
        logits = _forward(model)(params, jnp.concatenate([prompt_ids, jnp.asarray(tokens)], axis=1), mask)
        drawn = np.asarray(draw(keys, jnp.full(len(keys), u), logits[:, width - 1 + u]))
        sample = (u >= positions) & ~done
        tokens[:, u] = np.where(sample, drawn, tokens[:, u])
        done |= sample & (drawn == EOS)
    return tokens


def test_continuations_are_fresh_samples_from_the_prefix_with_their_keys(tabular, truth):
    model, params, prompt_ids, prompt_mask, response_ids, response_mask = tabular
    states = truth[0].states
    keys = ct.continuation_keys(jax.random.key(7), len(states.rows), K)
    # As many states as a chunk of the values (the same program), in another order, one terminal.
    chosen = np.array([20, 3, 0, 11, 1, 16, 22])
    assert states.rows[chosen].tolist() == [5, 1, 0, 3, 0, 4, 5]
    assert states.positions[chosen].tolist() == [1, 1, 0, 1, 1, 2, 3]
    out = ct.continue_states(model, params, prompt_ids, prompt_mask, response_ids, response_mask,
                             states.rows[chosen], states.positions[chosen], keys[chosen], temperature=1.0,
                             eos_id=EOS, pad_id=PAD)
    rep = np.repeat(states.rows[chosen], K)
    positions = np.repeat(states.positions[chosen], K)
    expected = _reference_continuations(model, params, prompt_ids[rep], prompt_mask[rep], response_ids[rep],
                                        positions, keys[chosen].reshape(-1))
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    # From the empty prefix they are what the sampler draws for the prompt with the same keys.
    fresh = generate(model, params, prompt_ids[:1], prompt_mask[:1], row_keys=keys[0], num_samples=K,
                     max_new_tokens=RESPONSE, temperature=1.0, eos_id=EOS, pad_id=PAD)
    np.testing.assert_array_equal(np.asarray(out.tokens)[2 * K:3 * K], np.asarray(fresh.tokens))
    # The chunked values used exactly these continuations (state i, continuation j: keys[i, j]).
    rewards = np.asarray(reward_fn(prompt_ids[rep], prompt_mask[rep], out.tokens, out.mask), np.float64)
    u = np.arange(RESPONSE)[None, :] - positions[:, None]
    returns = np.where(u >= 0, rewards * GAMMA ** np.maximum(u, 0), 0.0).sum(axis=1)
    np.testing.assert_allclose(states.returns[chosen].ravel(), returns, rtol=1e-6, atol=1e-6)


# Scores ---------------------------------------------------------------------------------------------

def _explicit_bootstrap(estimate, truth, prompts, resamples, rng_seed=0):
    """Percentile intervals from resamples built as concatenated samples of whole prompts."""
    labels = np.unique(prompts)
    members = [np.flatnonzero(prompts == label) for label in labels]
    out = {"pearson": [], "spearman": [], "sign_agreement": [], "variance": []}
    for draw in st.bootstrap_indices(len(labels), resamples=resamples, rng_seed=rng_seed):
        take = np.concatenate([members[j] for j in draw])
        x, y = estimate[take], truth[take]
        out["pearson"].append(np.corrcoef(x, y)[0, 1])
        out["spearman"].append(stats.spearmanr(x, y).statistic)
        out["sign_agreement"].append(np.mean(np.sign(x) == np.sign(y)))
        out["variance"].append(np.var(x))
    return {name: np.nanpercentile(v, [2.5, 97.5]) for name, v in out.items()}


def test_scores_equal_numpy_scipy_and_explicit_resampling_with_ties():
    rng = np.random.default_rng(3)
    prompts = np.repeat(np.arange(12), rng.integers(1, 6, size=12))
    truth = np.round(rng.normal(size=prompts.size), 1)
    # Constant within a prompt (one advantage per response, as GRPO), rounded: many ties.
    estimate = np.round(rng.normal(size=12), 1)[prompts] + 0.3 * truth
    got = cs.score_advantages(estimate, truth, prompts, resamples=300)
    assert got["states"] == prompts.size and got["prompts"] == 12
    assert got["pearson"]["value"] == pytest.approx(np.corrcoef(estimate, truth)[0, 1], abs=1e-12)
    assert got["spearman"]["value"] == pytest.approx(stats.spearmanr(estimate, truth).statistic, abs=1e-12)
    assert got["sign_agreement"]["value"] == pytest.approx(np.mean(np.sign(estimate) == np.sign(truth)))
    assert got["variance"]["value"] == pytest.approx(np.var(estimate))
    assert got["truth_variance"]["value"] == pytest.approx(np.var(truth))
    for name, ci in _explicit_bootstrap(estimate, truth, prompts, 300).items():
        np.testing.assert_allclose(got[name]["ci"], ci, atol=1e-10, err_msg=name)


def test_paired_differences_equal_numpy_on_the_same_resamples():
    rng = np.random.default_rng(4)
    prompts = np.repeat(np.arange(9), rng.integers(2, 5, size=9))
    truth = rng.normal(size=prompts.size)
    estimates = {"a": truth + rng.normal(size=truth.size), "b": truth + 2 * rng.normal(size=truth.size),
                 "c": rng.normal(size=truth.size)}
    got = cs.paired_differences(estimates, truth, prompts, [("a", "b"), ("c", "a")], resamples=200)
    members = [np.flatnonzero(prompts == label) for label in range(9)]
    for a, b in (("a", "b"), ("c", "a")):
        r = lambda x, y: np.corrcoef(x, y)[0, 1]
        assert got[(a, b)]["value"] == pytest.approx(r(estimates[a], truth) - r(estimates[b], truth),
                                                     abs=1e-12)
        # Both correlations of a resample on the same concatenated states.
        diffs = []
        for draw in st.bootstrap_indices(9, resamples=200):
            take = np.concatenate([members[j] for j in draw])
            diffs.append(r(estimates[a][take], truth[take]) - r(estimates[b][take], truth[take]))
        np.testing.assert_allclose(got[(a, b)]["ci"], np.percentile(diffs, [2.5, 97.5]), atol=1e-10)
    # Paired, the interval of a - b is narrower than a's and b's intervals side by side.
    alone = [cs.score_advantages(estimates[n], truth, prompts, resamples=200)["pearson"]["ci"]
             for n in ("a", "b")]
    lo, hi = got[("a", "b")]["ci"]
    assert hi - lo < (alone[0][1] - alone[0][0]) + (alone[1][1] - alone[1][0])


def test_exact_advantages_score_one(truth):
    got, _, exact_a, _, _, _ = truth
    scores = cs.score_advantages(exact_a, exact_a, got.rows // 2, resamples=500)
    for name in ("pearson", "spearman", "sign_agreement"):
        assert scores[name]["value"] == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(scores[name]["ci"], [1.0, 1.0], atol=1e-12)
    assert scores["variance"]["value"] == pytest.approx(np.var(exact_a)) == scores["truth_variance"]["value"]
    # The Monte Carlo truth is close to exact but not equal: a high, lower correlation.
    mc = cs.score_advantages(got.value, exact_a, got.rows // 2, resamples=500)
    assert 0.9 < mc["pearson"]["value"] < 1.0


def test_a_noisy_estimator_scores_its_known_correlation_sign_agreement_and_variance():
    rng = np.random.default_rng(5)
    prompts = np.repeat(np.arange(300), 4)
    truth = rng.normal(size=prompts.size) * 0.5 + rng.normal(size=300)[prompts] * 0.5
    sigma = 0.6
    estimate = truth + sigma * rng.normal(size=truth.size)
    got = cs.score_advantages(estimate, truth, prompts, resamples=2000)
    rho = truth.std() / np.sqrt(truth.var() + sigma ** 2)
    expected = {"pearson": rho, "spearman": 6 / np.pi * np.arcsin(rho / 2),
                "sign_agreement": 0.5 + np.arcsin(rho) / np.pi, "variance": truth.var() + sigma ** 2}
    for name, value in expected.items():
        lo, hi = got[name]["ci"]
        assert lo < value < hi, (name, value, got[name])
    assert got["pearson"]["ci"][1] - got["pearson"]["ci"][0] < 0.1
    # The interval excludes the correlation of twice the noise.
    assert truth.std() / np.sqrt(truth.var() + (2 * sigma) ** 2) < got["pearson"]["ci"][0]


def test_noise_ceiling_of_pure_noise_and_of_a_known_reliability():
    rng = np.random.default_rng(8)
    prompts = np.repeat(np.arange(200), 4)
    noise = cs.noise_ceiling(rng.normal(size=(800, 2)), prompts, resamples=2000)
    assert abs(noise["halves_pearson"]["value"]) < 0.1
    assert noise["halves_pearson"]["ci"][0] < 0 < noise["halves_pearson"]["ci"][1]
    assert noise["reliability"]["ci"][0] < 0 < noise["reliability"]["ci"][1]
    assert noise["ceiling"]["ci"][0] == 0.0 and noise["ceiling"]["value"] < 0.35

    # Halves = A + independent noise of sd 1 each; the K-continuation truth is their mean (noise
    # sd 1 / sqrt 2), whose reliability is var(A) / (var(A) + 1 / 2), and an exact estimator
    # correlates with it at the square root of that.
    advantages = rng.normal(size=800)
    halves = advantages[:, None] + rng.normal(size=(800, 2))
    got = cs.noise_ceiling(halves, prompts, resamples=2000)
    var = advantages.var()
    assert got["halves_pearson"]["ci"][0] < var / (var + 1) < got["halves_pearson"]["ci"][1]
    assert got["reliability"]["ci"][0] < var / (var + 0.5) < got["reliability"]["ci"][1]
    r = got["halves_pearson"]["value"]
    assert got["reliability"]["value"] == pytest.approx(2 * r / (1 + r))
    observed = np.corrcoef(advantages, halves.mean(axis=1))[0, 1]
    assert got["ceiling"]["ci"][0] < observed < got["ceiling"]["ci"][1]


# Bad input ------------------------------------------------------------------------------------------

def test_bad_input_is_one_line(tabular):
    model, params, prompt_ids, prompt_mask, response_ids, response_mask = tabular
    lengths = ct.valid_lengths(response_mask)
    settings = dict(reward_fn=reward_fn, key=jax.random.key(0), temperature=1.0, eos_id=EOS, pad_id=PAD)

    def spans(rows, starts, ends, k=4, **changes):
        return ct.advantage_truth(model, params, prompt_ids, prompt_mask, response_ids, response_mask,
                                  np.asarray(rows, int), np.asarray(starts, int), np.asarray(ends, int),
                                  num_continuations=k, **{**settings, **changes})

    cases = [
        (lambda: spans([0], [0], [1], k=1), r"num_continuations must be an int >= 2.*got 1"),
        (lambda: spans([], [], []), "rows is empty: no states to score"),
        (lambda: spans([0], [0], [lengths[0] + 1]), r"spans \[start, end\) must be non-empty and lie inside"),
        (lambda: spans([1], [2], [2]), r"1 do not, e.g. row 1 span \[2, 2\)"),
        (lambda: spans([6], [0], [1]), r"rows must index the 6 responses; entries \[0\] are \[6\]"),
        (lambda: spans([0], [0], [1], gamma=0.0), r"gamma must be a number in \(0, 1\]"),
        (lambda: spans([0], [0], [1], key=0), "key must be one typed key"),
        (lambda: ct.state_values(model, params, prompt_ids, prompt_mask, response_ids, response_mask, [0, 1],
                                 [0, int(lengths[1]) + 1], num_continuations=2, **settings),
         r"state positions must lie in \[0, valid length\].*row 1 position"),
        (lambda: cs.score_advantages([], [], []), "truth: no states to score"),
        (lambda: cs.score_advantages([1.0, 2.0], [1.0, 2.0, 3.0], [0, 0, 1]), "estimate has 2 states but the truth has 3"),
        (lambda: cs.score_advantages([1.0, np.nan], [1.0, 2.0], [0, 1]), r"estimate holds non-finite values at states \[1\]"),
        (lambda: cs.noise_ceiling(np.zeros((3, 3)), [0, 1, 2]), r"halves must be .* shape \[S, 2\]"),
        (lambda: cs.score_advantages([1.0, 2.0], [1.0, 2.0], [0]), r"prompts must label each of the 2 states"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
