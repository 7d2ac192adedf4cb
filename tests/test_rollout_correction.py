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
