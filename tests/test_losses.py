"""Losses against hand computations and plain numpy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import losses


def numpy_log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- PPO policy loss

def test_policy_loss_hand_case_clips_on_both_sides():
    # ratios: 1.5 (A > 0: clipped to 1.2), 0.5 (A < 0: clipped to 0.8),
    #         1.5 (A < 0: unclipped is worse, kept), 1.1 (inside the range), masked token.
    old = np.zeros((1, 5), np.float32)
    logprobs = np.log(np.array([[1.5, 0.5, 1.5, 1.1, 9.0]], np.float32))
    advantages = np.array([[2.0, -1.0, -1.0, 3.0, 100.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]])
    loss, metrics = losses.ppo_policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    per_token = [-2.0 * 1.2, 1.0 * 0.8, 1.0 * 1.5, -3.0 * 1.1]
    np.testing.assert_allclose(loss, np.mean(per_token), rtol=1e-6)
    np.testing.assert_allclose(metrics["clipfrac"], 0.5)
    log_ratio = np.log([1.5, 0.5, 1.5, 1.1])
    np.testing.assert_allclose(metrics["approxkl"], 0.5 * np.mean(log_ratio ** 2), rtol=1e-5)
    np.testing.assert_allclose(metrics["policy_kl"], -np.mean(log_ratio), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], np.mean([1.5, 0.5, 1.5, 1.1]), rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_var"], np.var([1.5, 0.5, 1.5, 1.1]), rtol=1e-5)
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())


def _numpy_policy_loss(logprobs, old, advantages, mask, cliprange):
    ratio = np.exp(logprobs - old)
    per_token = np.maximum(-advantages * ratio,
                           -advantages * np.clip(ratio, 1 - cliprange, 1 + cliprange))
    return per_token, mask.astype(bool)


def test_policy_loss_matches_numpy_for_both_aggregations():
    rng = np.random.default_rng(0)
    shape = (5, 9)
    logprobs = rng.normal(-2, 0.3, shape).astype(np.float32)
    old = (logprobs + rng.normal(0, 0.3, shape)).astype(np.float32)
    advantages = rng.normal(size=shape).astype(np.float32)
    mask = (np.arange(9)[None] < np.array([9, 4, 1, 0, 6])[:, None]).astype(np.int32)
    per_token, valid = _numpy_policy_loss(logprobs, old, advantages, mask, 0.1)
    loss, _ = losses.ppo_policy_loss(logprobs, old, advantages, mask, cliprange=0.1)
    np.testing.assert_allclose(loss, per_token[valid].mean(), rtol=1e-5)
    loss, _ = losses.ppo_policy_loss(logprobs, old, advantages, mask, cliprange=0.1,
                                     aggregation="sequence_mean")
    rows = [per_token[b][valid[b]].mean() for b in range(5) if valid[b].any()]
    np.testing.assert_allclose(loss, np.mean(rows), rtol=1e-5)


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
    logprobs = jnp.log(jnp.array([[1.5, 1.1]]))
    advantages = jnp.array([[1.0, 1.0]])
    grad = jax.grad(lambda lp: losses.ppo_policy_loss(lp, jnp.zeros((1, 2)), advantages,
                                                      jnp.ones((1, 2)))[0])(logprobs)
    # d/dlogp of -A * exp(logp) / 2 = -A * ratio / 2 for the unclipped token, 0 when clipped
    np.testing.assert_allclose(grad, [[0.0, -1.1 / 2]], rtol=1e-6)


def test_zero_masks_give_zero_not_nan():
    z = jnp.zeros((2, 3))
    big = jnp.full((2, 3), 1e4)  # exp overflows on padding; it must not leak
    loss, metrics = losses.ppo_policy_loss(big, z, big, z, aggregation="sequence_mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    loss, metrics = losses.ppo_value_loss(z, z, z, z)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    loss, metrics = losses.sft_cross_entropy(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), int), z)
    assert float(loss) == 0.0 and float(metrics["accuracy"]) == 0.0


# ---------------------------------------------------------------- PPO value loss

def test_value_loss_hand_case():
    # v_old = 1, c = 0.2. Token 0: v 2 -> clipped 1.2, G 2: errors 0 / .64 -> .64 (clipped wins).
    # Token 1: v 0.5 -> clipped 0.8, G 0: errors .25 / .64 -> .64 (clipped wins).
    # Token 2: v 1.1 (inside), G 3: 3.61 both. Token 3: v 3 -> 1.2, G 5: 4 / 14.44 -> 14.44.
    values = np.array([[2.0, 0.5, 1.1, 3.0, 7.0]], np.float32)
    old = np.ones((1, 5), np.float32)
    returns = np.array([[2.0, 0.0, 3.0, 5.0, -7.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]])
    loss, metrics = losses.ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    np.testing.assert_allclose(loss, 0.5 * np.mean([0.64, 0.64, 3.61, 14.44]), rtol=1e-5)
    np.testing.assert_allclose(metrics["clipfrac"], 0.75)
    np.testing.assert_allclose(metrics["vpred"], np.mean([2.0, 0.5, 1.1, 3.0]), rtol=1e-6)
    np.testing.assert_allclose(metrics["error"], np.mean([0.0, 0.25, 3.61, 4.0]), rtol=1e-5)
    np.testing.assert_allclose(metrics["returns_mean"], 2.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["returns_var"], np.var([2.0, 0.0, 3.0, 5.0]), rtol=1e-6)


# ---------------------------------------------------------------- KL and rewards

def test_kl_estimators():
    rng = np.random.default_rng(1)
    logprobs = rng.normal(-2, 1, (4, 6)).astype(np.float32)
    ref = rng.normal(-2, 1, (4, 6)).astype(np.float32)
    np.testing.assert_allclose(losses.kl_per_token(logprobs, ref), logprobs - ref, rtol=1e-6)
    k3 = np.asarray(losses.kl_per_token(logprobs, ref, "k3"))
    r = np.exp(ref.astype(np.float64) - logprobs)
    np.testing.assert_allclose(k3, (r - 1) - np.log(r), rtol=1e-5, atol=1e-7)
    assert np.all(k3 >= 0)
    near = np.float32(-1.0)
    assert float(losses.kl_per_token(near, near + 1e-4, "k3")) >= 0


def test_assemble_rewards_hand_case():
    logprobs = np.array([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5, 5.0], [-2.0, -1.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    scores = np.array([4.0, -1.0, 3.0], np.float32)
    rewards, metrics = losses.assemble_rewards(logprobs, ref, scores, mask, kl_coef=0.1)
    # k1 = [.5, -1, 0] and [1, 0]; score 4 is clipped to 2.5 on token 2, -1 lands on token 1.
    np.testing.assert_allclose(rewards, [[-0.05, 0.1, 2.5, 0.0], [-0.1, -1.0, 0.0, 0.0],
                                         [0.0, 0.0, 0.0, 0.0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(metrics["kl"], np.mean([-0.5, 1.0]), rtol=1e-6)
    np.testing.assert_allclose(metrics["non_score_reward"], np.mean([0.05, -0.1]), rtol=1e-5)
    np.testing.assert_allclose(metrics["scores"], np.mean([2.5, -1.0]), rtol=1e-6)
    np.testing.assert_allclose(metrics["rlhf_reward"], np.mean([2.55, -1.1]), rtol=1e-5)

    rewards, _ = losses.assemble_rewards(logprobs, ref, scores, mask, kl_coef=0.1,
                                         missing_eos_penalty=1.0,
                                         ended_with_eos=np.array([False, True, False]))
    np.testing.assert_allclose(rewards[0], [-0.05, 0.1, 1.5, 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rewards[1], [-0.1, -1.0, 0.0, 0.0], rtol=1e-6, atol=1e-7)

    rewards, _ = losses.assemble_rewards(logprobs, ref, scores, mask, kl_coef=0.1,
                                         kl_estimator="k3", reward_clip=None)
    k3 = np.expm1(ref[0, :3] - logprobs[0, :3]) - (ref[0, :3] - logprobs[0, :3])
    np.testing.assert_allclose(rewards[0, :3], -0.1 * k3 + [0, 0, 4.0], rtol=1e-5, atol=1e-7)


def test_assemble_rewards_with_traced_kl_coef():
    logprobs = np.array([[-1.0, -2.0]], np.float32)
    ref = np.array([[-2.0, -2.0]], np.float32)
    mask = np.ones((1, 2), np.int32)

    def rewards_for(kl_coef):
        return losses.assemble_rewards(logprobs, ref, np.zeros(1, np.float32), mask,
                                       kl_coef=kl_coef)[0]

    swept = jax.vmap(rewards_for)(jnp.array([0.0, 0.5]))
    np.testing.assert_allclose(swept, [[[0.0, 0.0]], [[-0.5, 0.0]]], atol=1e-7)


# ---------------------------------------------------------------- BT, SFT

def test_bradley_terry():
    chosen = np.array([2.0, 0.0, 1.0, -1.0], np.float32)
    rejected = np.array([1.0, 0.5, 1.0, -3.0], np.float32)
    loss, metrics = losses.bradley_terry_loss(chosen, rejected)
    margin = chosen - rejected
    np.testing.assert_allclose(loss, np.mean(np.log1p(np.exp(-margin))), rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], 0.5)  # ties do not count as correct
    np.testing.assert_allclose(metrics["margin"], np.mean(margin), rtol=1e-6)
    np.testing.assert_allclose(metrics["chosen_mean"], 0.5)
    np.testing.assert_allclose(metrics["rejected_mean"], -0.125)


def test_weighted_bradley_terry_is_the_weighted_mean_over_pairs():
    chosen = np.array([2.0, 0.0, 1.0, -1.0], np.float32)
    rejected = np.array([1.0, 0.5, 1.0, -3.0], np.float32)
    weights = np.array([1.0, 0.0, 2.0, 1.0], np.float32)  # pair 1 is padding
    loss, metrics = losses.bradley_terry_loss(chosen, rejected, weights)
    per_pair = np.log1p(np.exp(-(chosen - rejected)))
    np.testing.assert_allclose(loss, (per_pair[0] + 2 * per_pair[2] + per_pair[3]) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], 2 / 4)  # pairs 0 and 3; the tie counts 0
    np.testing.assert_allclose(metrics["margin"], (1.0 + 0.0 + 2.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["chosen_mean"], (2.0 + 2.0 - 1.0) / 4, rtol=1e-6)
    # Unit weights are the plain mean; all-zero weights give 0, not NaN.
    plain, _ = losses.bradley_terry_loss(chosen, rejected)
    np.testing.assert_allclose(losses.bradley_terry_loss(chosen, rejected, np.ones(4))[0], plain,
                               rtol=1e-6)
    assert float(losses.bradley_terry_loss(chosen, rejected, np.zeros(4))[0]) == 0.0
    with pytest.raises(ValueError, match="weights has shape"):
        losses.bradley_terry_loss(chosen, rejected, np.ones(3))


def test_sft_cross_entropy_matches_numpy_log_softmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 4, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (3, 4))
    targets[2, 3] = -100  # outside the mask: never read
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    log_probs = numpy_log_softmax(logits.astype(np.float64))
    picked = np.take_along_axis(log_probs, np.maximum(targets, 0)[..., None], -1)[..., 0]
    expected = -picked[mask == 1].mean()
    loss, metrics = losses.sft_cross_entropy(logits, targets, mask)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["perplexity"], np.exp(expected), rtol=1e-5)
    correct = (logits.argmax(-1) == targets)[mask == 1].mean()
    np.testing.assert_allclose(metrics["accuracy"], correct)


# ---------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    x = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3))
    with pytest.raises(ValueError, match="advantages"):
        losses.ppo_policy_loss(x, x, x[:, :2], mask)
    with pytest.raises(ValueError, match="aggregation"):
        losses.ppo_policy_loss(x, x, x, mask, aggregation="mean")
    with pytest.raises(ValueError, match="cliprange"):
        losses.ppo_policy_loss(x, x, x, mask, cliprange=0.0)
    with pytest.raises(ValueError, match="mask"):
        losses.ppo_policy_loss(x, x, x, mask * 3)
    with pytest.raises(ValueError, match="returns"):
        losses.ppo_value_loss(x, x, x[0], mask)
    with pytest.raises(ValueError, match="estimator"):
        losses.kl_per_token(x, x, "k2")
    with pytest.raises(ValueError, match="scores"):
        losses.assemble_rewards(x, x, np.zeros(3), mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="ended_with_eos"):
        losses.assemble_rewards(x, x, np.zeros(2), mask, kl_coef=0.1, missing_eos_penalty=1.0)
    with pytest.raises(ValueError, match="missing_eos_penalty"):
        losses.assemble_rewards(x, x, np.zeros(2), mask, kl_coef=0.1, missing_eos_penalty=-1.0,
                                ended_with_eos=np.ones(2, bool))
    with pytest.raises(ValueError, match="kl_coef"):
        losses.assemble_rewards(x, x, np.zeros(2), mask, kl_coef=-0.1)
    with pytest.raises(ValueError, match="response_mask"):
        # Holes are a trajectory's observation spans (allowed); a mask is 0/1.
        losses.assemble_rewards(x, x, np.zeros(2), np.array([[0, 2, 1], [1, 1, 1]]),
                                kl_coef=0.1)
    with pytest.raises(ValueError, match="rejected"):
        losses.bradley_terry_loss(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="targets"):
        losses.sft_cross_entropy(np.zeros((2, 3, 4)), np.full((2, 3), 4), mask)
    with pytest.raises(ValueError, match="correct"):
        losses.token_cross_entropy(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
