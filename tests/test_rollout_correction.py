"""Rollout-correction weights and loss aggregations against hand computations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import losses

# Two rows: 4 valid tokens (macros {0, 1}, {2}, {3}) and 2 valid tokens (one macro), padded.
TRAINER = np.array([[-1.0, -2.0, -0.5, -3.0, 7.0],
                    [-0.2, -0.4, 9.0, 9.0, 9.0]], np.float32)
SAMPLER = np.array([[-1.1, -1.8, -0.9, -2.0, -5.0],
                    [-0.5, -0.6, 0.0, 0.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], np.int32)
SEGMENTS = np.array([[0, 0, 1, 2, 0], [0, 0, 0, 0, 0]], np.int32)


def _weights(level, cap=2.0):
    return np.asarray(losses.rollout_correction_weights(
        TRAINER, SAMPLER, MASK, level=level, cap=cap, segment_ids=SEGMENTS))


def test_token_weights_are_capped_ratios_and_zero_on_padding():
    # exp(t - s): e^0.1, e^-0.2, e^0.4, e^-1.0 | e^0.3, e^0.2; none above 2 here.
    want = np.array([[np.exp(0.1), np.exp(-0.2), np.exp(0.4), np.exp(-1.0), 0],
                     [np.exp(0.3), np.exp(0.2), 0, 0, 0]])
    got = _weights("token")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # cap 1.2 truncates e^0.4 = 1.49 and e^0.3 = 1.35 (and nothing on padding).
    np.testing.assert_allclose(_weights("token", cap=1.2),
                               np.minimum(want, 1.2) * (MASK != 0), rtol=1e-5)


def test_sequence_weights_are_the_whole_response_ratio_on_every_valid_token():
    row0 = np.exp(0.1 - 0.2 + 0.4 - 1.0)  # e^-0.7
    row1 = min(np.exp(0.5), 1.5)  # e^0.5 = 1.65, capped
    want = np.array([[row0] * 4 + [0], [row1] * 2 + [0] * 3])
    np.testing.assert_allclose(_weights("sequence", cap=1.5), want, rtol=1e-5)


def test_macro_weights_use_each_macros_product_including_one_token_macros():
    # row 0: macro {0, 1} e^(0.1 - 0.2), one-token macros e^0.4 and e^-1.0; row 1: one macro.
    want = np.array([[np.exp(-0.1), np.exp(-0.1), np.exp(0.4), np.exp(-1.0), 0],
                     [np.exp(0.5), np.exp(0.5), 0, 0, 0]])
    np.testing.assert_allclose(_weights("macro"), want, rtol=1e-5)
    # macro of one token each == token level
    one_token = np.where(MASK != 0, np.arange(5)[None], 0).astype(np.int32)
    np.testing.assert_allclose(
        losses.rollout_correction_weights(TRAINER, SAMPLER, MASK, level="macro", cap=2.0,
                                          segment_ids=one_token), _weights("token"), rtol=1e-6)


def test_a_huge_log_ratio_is_capped_not_infinite():
    trainer = np.array([[500.0, 0.0]], np.float32)
    sampler = np.zeros((1, 2), np.float32)
    got = losses.rollout_correction_weights(trainer, sampler, np.ones((1, 2)), level="sequence",
                                            cap=3.0)
    np.testing.assert_allclose(got, [[3.0, 3.0]], rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "macro"])
def test_no_gradient_flows_through_the_weights(level):
    def total(trainer, sampler):
        return losses.rollout_correction_weights(trainer, sampler, MASK, level=level, cap=2.0,
                                                 segment_ids=SEGMENTS).sum()
    g_trainer, g_sampler = jax.grad(total, argnums=(0, 1))(jnp.asarray(TRAINER),
                                                           jnp.asarray(SAMPLER))
    assert float(jnp.abs(g_trainer).max()) == 0.0 and float(jnp.abs(g_sampler).max()) == 0.0


def test_bad_level_cap_and_missing_segments_are_refused():
    with pytest.raises(ValueError, match="level"):
        losses.rollout_correction_weights(TRAINER, SAMPLER, MASK, level="row", cap=2.0)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        losses.rollout_correction_weights(TRAINER, SAMPLER, MASK, level="token", cap=0.5)
    with pytest.raises(ValueError, match="segment_ids"):
        losses.rollout_correction_weights(TRAINER, SAMPLER, MASK, level="macro", cap=2.0)


def test_weights_multiply_each_tokens_policy_term():
    logprobs = np.log(np.array([[1.5, 1.1, 1.0]], np.float32))
    advantages = np.array([[2.0, 3.0, -1.0]], np.float32)
    mask = np.ones((1, 3), np.int32)
    weights = np.array([[0.5, 2.0, 1.0]], np.float32)
    loss, _ = losses.ppo_policy_loss(logprobs, np.zeros_like(logprobs), advantages, mask,
                                     cliprange=0.2, is_weights=weights)
    # clipped 1.2 * 2 at weight 0.5, 1.1 * 3 at weight 2, 1 * -1 at weight 1.
    np.testing.assert_allclose(loss, np.mean([-0.5 * 2.4, -2.0 * 3.3, 1.0]), rtol=1e-6)


def test_aggregations_by_hand():
    per_token = np.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert float(losses.aggregate_tokens(per_token, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(losses.aggregate_tokens(per_token, mask, "sequence_mean")) == pytest.approx(
        (2.0 + 4.0) / 2)
    # Dr. GRPO: each row's sum over the constant width 4, then the mean over rows.
    assert float(losses.aggregate_tokens(per_token, mask, "token_sum")) == pytest.approx(
        (6 / 4 + 4 / 4) / 2)


def test_weights_reach_the_loss_and_its_gradient_inside_the_update():
    """`ppo_core.update` with rollout-correction weights w: at ratio 1 (the old logprobs are the
    actor's own) its policy loss is the weighted objective -sum(w A m) / sum(m), and one SGD
    step of rate 1 moves the params by minus that objective's gradient, computed here from the
    actor's logprobs alone. Doubling one response's weights and zeroing another's moves the loss
    and the step exactly as the reweighted objective says."""
    import optax

    from marl_jax import models as M
    from marl_jax.train import phases, ppo_types

    cfg = M.ModelConfig(family="llama", vocab_size=11, hidden_size=16, intermediate_size=32,
                        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                        max_position_embeddings=32)
    policy = M.CausalLM(cfg)
    params = M.init_params(policy, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt_ids = jnp.asarray(rng.integers(2, 11, (3, 3)), jnp.int32)
    prompt_mask = jnp.ones((3, 3), jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], jnp.int32)
    response_ids = jnp.asarray(rng.integers(2, 11, (3, 4)), jnp.int32) * mask
    args = (prompt_ids, prompt_mask, response_ids, mask)
    logp = lambda p: phases.score.token_logprobs(policy, p, *args, 1.0)[0]
    old = logp(params)
    zeros = jnp.zeros((3, 4))
    exp = ppo_types.Experience(*args, old, old, old, zeros, jnp.zeros(3), zeros, jnp.zeros(3, bool))
    advantages = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32) * mask
    sgd = optax.sgd(1.0)
    models = ppo_types.Models(policy=policy, critic=None, reward=None, actor_optimizer=sgd,
                         critic_optimizer=sgd)
    static = ppo_types.PPOStatic(batch_size=3, response_length=4, eos_id=1, pad_id=0,
                            temperature=1.0, estimator="reinforce_pp", rollout_correction="token")
    state = ppo_types.PPOState(step=jnp.zeros((), jnp.int32), actor_params=params,
                          actor_opt_state=sgd.init(params), critic_params={},
                          critic_opt_state=sgd.init({}),
                          key=jax.random.key_data(jax.random.key(1)), kl_coef=jnp.float32(0.05),
                          skipped_updates=jnp.zeros(()), generated_tokens=jnp.zeros(()),
                          prefill_tokens=jnp.zeros(()))
    m = mask.astype(jnp.float32)
    base = jnp.asarray(rng.uniform(0.3, 1.0, (3, 4)), jnp.float32) * m
    perturbed = base * jnp.asarray([[2.0], [0.0], [1.0]])
    steps = []
    for weights in (base, perturbed):
        new, metrics = jax.jit(lambda s, w: phases.update.update(
            static, models, s, exp, phases.advantages.Advantages(advantages, None, w, mask),
            jax.random.key(2)))(state, weights)
        objective = lambda p: -(weights * advantages * logp(p) * m).sum() / m.sum()
        np.testing.assert_allclose(float(metrics["loss/policy_avg"]),
                                   float(-(weights * advantages * m).sum() / m.sum()), rtol=1e-5)
        grad = jax.grad(objective)(params)
        step = jax.tree.map(lambda a, b: a - b, new.actor_params, params)
        for got, want in zip(jax.tree.leaves(step), jax.tree.leaves(grad)):
            np.testing.assert_allclose(np.asarray(got), -np.asarray(want), rtol=1e-4, atol=1e-6)
        steps.append(step)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(steps[0]),
                                                           jax.tree.leaves(steps[1])))
    assert moved > 1e-3


def test_products_of_truncated_weights_warn_once_at_config_time(capsys):
    """Under top-k / top-p every sampler probability is renormalised, so each token's weight is
    at most 1: a response's (or a long macro's) product shrinks geometrically. One warning line
    with the expected shrink, once; token level, short macros and no truncation stay silent."""
    from train_util import ROOT  # noqa: F401 (puts the repository root, `configs`, on sys.path)
    from configs import synthetic
    from marl_jax import config_check

    def warnings(**ppo):
        config = synthetic.get_config()
        config.ppo.update(ppo)
        config_check._warned.clear()
        config_check.validate_config(config)
        config_check.validate_config(config)
        return capsys.readouterr().err.splitlines()

    lines = warnings(rollout_correction="sequence", top_k=50, response_length=512)
    assert len(lines) == 1 and lines[0].startswith(
        "warning: config.ppo.rollout_correction='sequence' under top_k=50, top_p=1.0: ")
    assert "up to 512 tokens" in lines[0] and f"gives {0.99 ** 512:.2g})" in lines[0]
    assert "(0.99 kept per token gives 0.0058)" in lines[0]
    assert len(warnings(rollout_correction="macro", ngram=64, top_p=0.9)) == 1
    assert warnings(rollout_correction="macro", ngram=5, top_k=50) == []
    assert warnings(rollout_correction="token", top_k=50) == []
    assert warnings(rollout_correction="sequence", top_k=0, top_p=1.0) == []


# Decoupled PPO: behaviour (the versions that sampled), proximal (the actor before the update),
# current -------------------------------------------------------------------------------------

def test_turn_weights_use_each_turns_product_over_its_action_tokens():
    # One trajectory: turn 0 = actions 0, 1 (then an observation at 2), turn 1 = actions 3, 4.
    trainer = np.array([[-1.0, -2.0, 5.0, -0.5, -3.0]], np.float32)
    sampler = np.array([[-1.1, -1.8, -9.0, -0.9, -2.0]], np.float32)
    actions = np.array([[1, 1, 0, 1, 1]], np.int32)
    turns = np.array([[0, 0, 0, 1, 1]], np.int32)
    got = losses.rollout_correction_weights(trainer, sampler, actions, level="turn", cap=2.0,
                                            segment_ids=turns)
    # turn 0: e^(0.1 - 0.2); turn 1: e^(0.4 - 1.0); the observation weighs nothing.
    np.testing.assert_allclose(got, [[np.exp(-0.1), np.exp(-0.1), 0, np.exp(-0.6),
                                      np.exp(-0.6)]], rtol=1e-5)


def _decoupled_reference(current, proximal, behaviour, advantages, units, mask, cap, clip):
    """The decoupled objective by a loop over units: ratio r_u = exp(sum (current - proximal)),
    weight w_u = min(exp(sum (proximal - behaviour)), cap), both over the unit's valid tokens,
    loss -mean_u w_u min(r_u A_u, clip(r_u) A_u) with A_u the unit's mean advantage."""
    terms = []
    for b in range(current.shape[0]):
        for u in np.unique(units[b][mask[b] != 0]):
            tokens = (units[b] == u) & (mask[b] != 0)
            r = np.exp((current[b] - proximal[b])[tokens].sum())
            w = min(np.exp((proximal[b] - behaviour[b])[tokens].sum()), cap)
            a = advantages[b][tokens].mean()
            terms.append(-w * min(r * a, np.clip(r, 1 - clip, 1 + clip) * a))
    return np.mean(terms)


@pytest.mark.parametrize("level", ["token", "macro", "turn", "sequence"])
def test_the_decoupled_loss_against_a_loop_over_units(level):
    """Responses whose tokens three versions sampled (their behaviour logprobs differ by
    version), the proximal policy's and the current policy's logprobs: the clip is taken
    against the proximal policy, the behaviour -> proximal weight per unit of the level (a
    macro and a turn spanning versions), as a plain loop over units computes them."""
    rng = np.random.default_rng(3)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.int32)
    versions = np.array([[3, 3, 4, 4, 5, 5], [4, 4, 5, 5, -1, -1]])
    # Each version's policy: the proximal logprobs plus a drift that grows with the staleness.
    proximal = rng.normal(-1.5, 0.5, mask.shape).astype(np.float32)
    behaviour = (proximal + 0.15 * (6 - versions) * rng.normal(size=mask.shape)).astype(
        np.float32)
    current = (proximal + 0.3 * rng.normal(size=mask.shape)).astype(np.float32)
    advantages = rng.normal(size=mask.shape).astype(np.float32)
    units = {"token": np.tile(np.arange(6), (2, 1)),
             "macro": np.array([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 0, 0]]),  # macros span versions
             "turn": np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]),
             "sequence": np.zeros((2, 6), int)}[level]
    cap = 1.3
    weights = losses.rollout_correction_weights(
        proximal, behaviour, mask, level=level, cap=cap,
        segment_ids=units if level in ("macro", "turn") else None)
    ratio_level = {"token": "token", "sequence": "sequence"}.get(level, "macro")
    loss, _ = losses.ppo_policy_loss(current, proximal, advantages, mask, cliprange=0.2,
                                     is_weights=weights, ratio_level=ratio_level,
                                     segment_ids=units if ratio_level == "macro" else None)
    want = _decoupled_reference(current, proximal, behaviour, advantages, units, mask, cap, 0.2)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(jnp.max(weights)) == pytest.approx(cap)  # the truncation bites


# Unbiasedness by enumeration: a tabular policy over two actions of 3 tokens each. The first
# action was sampled by an older version (behaviour), the second by the current one (a response
# that spans two versions); the proximal policy is the current one (the update's first step).
V = 3


def _policy(theta):
    """(log pi(a1) `[V]`, log pi(a2 | a1) `[V, V]`) of the tabular policy."""
    return jax.nn.log_softmax(theta["first"]), jax.nn.log_softmax(theta["second"], axis=-1)


def _enumerated(theta, theta_old, reward, layout):
    """Every (a1, a2): its token logprobs under the current policy `[N, T]`, the behaviour's
    (a1 from the old version, a2 from the current), its probability under the behaviour `[N]`,
    the action mask `[N, T]` and the turn ids: "response" is [a1, a2]; "trajectory" is
    [a1, observation, a2], the observation echoing a1 and the second turn starting after it."""
    first, second = _policy(theta)
    old_first, _ = _policy(theta_old)
    a1, a2 = np.divmod(np.arange(V * V), V)
    current = jnp.stack([first[a1], second[a1, a2]], axis=1)
    behaviour = jnp.stack([old_first[a1], second[a1, a2]], axis=1)
    mu = jnp.exp(behaviour.sum(axis=1))
    if layout == "response":
        return current, behaviour, mu, np.ones((V * V, 2), np.int32), np.zeros((V * V, 2), int)
    gap = jnp.zeros((V * V, 1))
    return (jnp.concatenate([current[:, :1], gap, current[:, 1:]], axis=1),
            jnp.concatenate([behaviour[:, :1], gap, behaviour[:, 1:]], axis=1), mu,
            np.tile([1, 0, 1], (V * V, 1)).astype(np.int32), np.tile([0, 0, 1], (V * V, 1)))


def _expected_gradient(theta, theta_old, reward, level, cap, layout):
    """The gradient of E_behaviour[corrected loss of one response] at the proximal policy,
    times minus the number of action tokens (the loss is a token mean): the policy-gradient
    estimate the corrected objective makes. level None: no correction."""
    def expected_loss(params):
        current, behaviour, mu, mask, turns = _enumerated(params, theta_old, reward, layout)
        proximal = jax.lax.stop_gradient(current)
        total = 0.0
        for y in range(V * V):
            row = lambda x: x[y:y + 1]  # noqa: E731
            weights = None if level is None else losses.rollout_correction_weights(
                row(proximal), row(jax.lax.stop_gradient(behaviour)), row(mask), level=level,
                cap=cap, segment_ids=row(turns) if level in ("turn", "macro") else None)
            advantage = jnp.full(mask[y:y + 1].shape, reward[y], jnp.float32)
            loss, _ = losses.ppo_policy_loss(row(current), row(proximal), advantage, row(mask),
                                             is_weights=weights)
            total = total + jax.lax.stop_gradient(mu[y]) * loss
        return total

    return jax.tree.map(lambda g: -2.0 * g, jax.grad(expected_loss)(theta))


def _flat(tree):
    return np.concatenate([np.asarray(tree[k]).ravel() for k in ("first", "second")])


@pytest.fixture(scope="module")
def tabular():
    rng = np.random.default_rng(7)
    theta = {"first": jnp.asarray(rng.normal(size=V), jnp.float32),
             "second": jnp.asarray(rng.normal(size=(V, V)), jnp.float32)}
    theta_old = {"first": theta["first"] + jnp.asarray(rng.normal(size=V), jnp.float32),
                 "second": theta["second"]}
    reward = rng.normal(size=V * V).astype(np.float32)
    # The on-policy gradient of the current policy, from the exact objective sum_y pi(y) R(y).
    on_policy = jax.grad(lambda t: jnp.sum(jnp.exp(
        _enumerated(t, t, reward, "response")[0].sum(axis=1)) * reward))(theta)
    return theta, theta_old, reward, _flat(on_policy)


@pytest.mark.parametrize("level, layout", [("sequence", "response"), ("macro", "response"),
                                           ("sequence", "trajectory")])
def test_the_corrected_gradient_is_the_on_policy_gradient_the_uncorrected_is_not(
        tabular, level, layout):
    """With the whole response as the unit (its sequence, or one macro spanning both
    versions; a trajectory's whole episode) and no truncation, the expected corrected gradient
    under the behaviour policy is the current policy's on-policy gradient; without the
    correction it is not."""
    theta, theta_old, reward, on_policy = tabular
    corrected = _flat(_expected_gradient(theta, theta_old, reward, level, 1e6, layout))
    np.testing.assert_allclose(corrected, on_policy, rtol=1e-4, atol=1e-5)
    uncorrected = _flat(_expected_gradient(theta, theta_old, reward, None, 1e6, layout))
    assert np.abs(uncorrected - on_policy).max() > 0.05 * np.abs(on_policy).max()


def _score_function(theta, a1, a2):
    """d log pi(a1) and d log pi(a2 | a1) with respect to the tabular params, flattened."""
    p1 = np.asarray(jax.nn.softmax(theta["first"]))
    p2 = np.asarray(jax.nn.softmax(theta["second"], axis=-1))
    g1 = np.zeros(V + V * V)
    g1[:V] = np.eye(V)[a1] - p1
    g2 = np.zeros(V + V * V)
    g2[V + a1 * V: V + (a1 + 1) * V] = np.eye(V)[a2] - p2[a1]
    return g1, g2


@pytest.mark.parametrize("level, layout", [("sequence", "response"), ("token", "response"),
                                           ("turn", "trajectory")])
def test_truncated_and_per_unit_corrections_have_their_closed_forms(tabular, level, layout):
    """Under truncation at c, or with one weight per token or per turn (each unit's ratio
    alone, without the ratios of the units before it), the expected gradient is the closed form
    sum_y mu(y) sum_u min(rho_u(y), c) R(y) d log pi(y_u), computed here from the softmax's
    score function: it differs from the on-policy gradient, by the truncation or by the
    earlier units' missing ratios."""
    theta, theta_old, reward, on_policy = tabular
    cap = 1.3 if level == "sequence" else 1e6
    got = _flat(_expected_gradient(theta, theta_old, reward, level, cap, layout))
    p1 = np.asarray(jax.nn.softmax(theta["first"]), np.float64)
    q1 = np.asarray(jax.nn.softmax(theta_old["first"]), np.float64)
    p2 = np.asarray(jax.nn.softmax(theta["second"], axis=-1), np.float64)
    want = np.zeros(V + V * V)
    for y in range(V * V):
        a1, a2 = divmod(y, V)
        mu = q1[a1] * p2[a1, a2]
        g1, g2 = _score_function(theta, a1, a2)
        rho1 = p1[a1] / q1[a1]  # the second action's ratio is 1: the current version sampled it
        if level == "sequence":
            want += mu * min(rho1, cap) * reward[y] * (g1 + g2)
        else:
            want += mu * reward[y] * (min(rho1, cap) * g1 + g2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(want - on_policy).max() > 0.01 * np.abs(on_policy).max()
