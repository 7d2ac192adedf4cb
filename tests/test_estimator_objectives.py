"""Each estimator's published objective: GRPO and Dr. GRPO normalise the score alone and carry the
KL as a loss term, RLOO puts the summed KL in the reward before its baseline; loss aggregations
per estimator, overridable per arm."""
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from marl_jax import experiment, losses
from marl_jax.train import ppo as ppo_lib
from marl_jax.train import phases, ppo_types

from train_util import tiny_config


def _group_experience(scores, kl_per_row, length=3):
    """Four responses of one prompt: equal lengths, summed k1 KL `kl_per_row` spread evenly."""
    batch = len(scores)
    mask = jnp.ones((batch, length), jnp.int32)
    ref = jnp.full((batch, length), -2.0)
    old = ref + jnp.asarray(kl_per_row)[:, None] / length
    rewards, _ = losses.assemble_rewards(old, ref, jnp.asarray(scores), mask, kl_coef=0.05)
    z = jnp.zeros((batch, length))
    return ppo_types.Experience(jnp.zeros((batch, 2), jnp.int32), jnp.ones((batch, 2), jnp.int32),
                           jnp.ones((batch, length), jnp.int32), mask, old, ref, ref, z,
                           jnp.asarray(scores, jnp.float32), rewards, jnp.ones(batch, bool))


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_equal_scores_with_unequal_kl(method):
    """Four samples with equal scores 0.7 and summed KL [0.8, 1.2, 1.0, 0.6], beta 0.05, through
    the step's estimator path: GRPO and Dr. GRPO normalise the score alone (their KL is a loss
    term), so every advantage is exactly 0; RLOO subtracts beta x the summed KL from the score
    before the leave-one-out baseline: [+0.0067, -0.0200, -0.0067, +0.0200] (rewards
    [0.66, 0.64, 0.65, 0.67], each minus the mean of the other three)."""
    exp = _group_experience([0.7] * 4, [0.8, 1.2, 1.0, 0.6])
    static = ppo_types.PPOStatic(batch_size=4, response_length=3, eos_id=1, pad_id=0,
                            estimator=method, group_size=4)
    hp = ppo_types.RunHparams(lam=jnp.float32(1.0), gamma=jnp.float32(1.0), ngram=jnp.int32(1),
                         variant=jnp.int32(0))
    state = types.SimpleNamespace(kl_coef=jnp.float32(0.05))
    adv, _, _ = phases.advantages.critic_free_advantages(static, None, state, None, hp, exp, {}, None)
    want = [0.02 / 3, -0.02, -0.02 / 3, 0.02] if method == "rloo" else [0.0] * 4
    np.testing.assert_allclose(np.asarray(adv), np.asarray(want)[:, None] * np.ones((1, 3)),
                               atol=1e-6)
    if method != "rloo":
        assert np.all(np.asarray(adv) == 0.0)
    assert static.kl_in_loss == (method != "rloo")
    # Unequal scores move them the same way for every method.
    exp = _group_experience([0.0, 1.0, 0.0, 1.0], [0.8, 1.2, 1.0, 0.6])
    adv, _, _ = phases.advantages.critic_free_advantages(static, None, state, None, hp, exp, {}, None)
    assert np.all(np.asarray(adv)[[1, 3]] > 0) and np.all(np.asarray(adv)[[0, 2]] < 0)


def test_kl_loss_term_gradient_by_hand():
    """beta x k3 per token, each sequence's mean then the mean over sequences (GRPO):
    d/dlogp_t = beta (1 - exp(ref_t - logp_t)) / (L_b x number of sequences)."""
    logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -1.5, 0.0]])
    ref = jnp.array([[-1.2, -1.0, -0.5], [-0.1, -2.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    beta = 0.05
    loss_fn = lambda lp: losses.kl_penalty_loss(lp, ref, mask, kl_coef=beta,
                                                aggregation="sequence_mean")
    grad = np.asarray(jax.grad(loss_fn)(logp))
    lengths = np.array([[3.0], [2.0]])
    want = beta * (1 - np.exp(np.asarray(ref - logp))) / (lengths * 2) * np.asarray(mask)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
    k3 = np.exp(np.asarray(ref - logp)) - 1 - np.asarray(ref - logp)
    value = beta * np.mean([k3[0].mean(), k3[1, :2].mean()])
    np.testing.assert_allclose(float(loss_fn(logp)), value, rtol=1e-5)
    # With zero advantages the policy term has no gradient: the KL term is all that trains.
    policy_grad = jax.grad(lambda lp: losses.ppo_policy_loss(
        lp, jax.lax.stop_gradient(lp), jnp.zeros_like(lp), mask,
        aggregation="sequence_mean")[0])(logp)
    assert float(jnp.abs(policy_grad).max()) == 0.0


def test_each_estimator_defaults_to_its_papers_aggregation_and_arms_override_it():
    def resolved(**fields):
        cfg = tiny_config(**{f"ppo.{k}": v for k, v in fields.items()})
        return ppo_lib.loss_aggregation(cfg.ppo)
    assert resolved(estimator="gae") == "token_mean"
    assert resolved(estimator="grpo", group_size=2) == "sequence_mean"
    assert resolved(estimator="dr_grpo", group_size=2) == "token_sum"
    assert resolved(estimator="rloo", group_size=2) == "token_mean"
    assert resolved(estimator="reinforce_pp") == "token_mean"
    assert resolved(estimator="grpo", group_size=2, loss_aggregation="token_mean") == "token_mean"

    cfg = tiny_config()
    cfg.experiment.arms = ("ppo", "grpo")
    cfg.ppo.arm_overrides = ml_collections.ConfigDict(dict(
        grpo=dict(group_size=2, loss_aggregation="token_sum")))
    runs = experiment.plan_runs(cfg)
    by_arm = {r.arm: r for r in runs}
    assert by_arm["grpo"].ppo["loss_aggregation"] == "token_sum"
    assert by_arm["ppo"].ppo["loss_aggregation"] == "auto"
    group = experiment.group_config(cfg, by_arm["grpo"])
    assert ppo_lib.loss_aggregation(group.ppo) == "token_sum"
