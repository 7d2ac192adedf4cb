"""The critic-free estimators inside the PPO step: no critic, group advantages recomputed by hand
from the experience, Monte Carlo values that are unbiased against an exactly enumerated value
function, the sampling budget, and an estimator experiment whose budget report is recomputed
from metrics.jsonl."""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import experiment
from marl_jax.train import ppo as ppo_lib, phases, ppo_core as core, ppo_types
from marl_jax.train.metrics import read_metrics

from train_util import ppo_setup, tiny_config, trained_tiny_pipeline


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("tiny"))


def test_group_estimators_train_without_a_critic(tiny_pipe):
    pipe = tiny_pipe[0]
    cfg, static, mods, state, frozen = ppo_setup(tiny_pipe, estimator="grpo", group_size=4,
                                                 batch_size=8)
    assert state.critic_params == {} and static.prompts_per_step == 2
    # A reference other than the actor, so the responses' KL is not 0.
    frozen = frozen.replace(ref_params=jax.tree.map(lambda x: x * 1.05, frozen.ref_params))
    ids, mask = pipe.task.rl["ids"][:2], pipe.task.rl["mask"][:2]
    exp, roll = jax.jit(functools.partial(core.rollout_phase, static, mods))(state, frozen, ids,
                                                                             mask)
    # Rows of a group share their prompt.
    np.testing.assert_array_equal(np.asarray(exp.prompt_ids), np.repeat(ids, 4, axis=0))
    # By hand: GRPO and Dr. GRPO normalise the clipped score alone (their KL is a loss term),
    # RLOO the clipped score minus beta x the response's summed k1 KL.
    m = np.asarray(exp.response_mask, np.float64)
    ret = np.clip(np.asarray(exp.scores, np.float64), -cfg.ppo.reward_clip, cfg.ppo.reward_clip)
    kl = ((np.asarray(exp.old_logprobs, np.float64) - np.asarray(exp.ref_logprobs)) * m).sum(1)
    assert np.abs(cfg.ppo.kl_coef * kl).max() > 1e-2
    for method in ("grpo", "rloo", "dr_grpo"):
        rewards = ret - cfg.ppo.kl_coef * kl if method == "rloo" else ret
        adv, _, extra = phases.advantages.critic_free_advantages(
            dataclasses.replace(static, estimator=method), mods, state, frozen,
            ppo_lib.hparams_from_config(cfg.ppo), exp, {}, jax.random.key(1))
        assert extra == {}
        want = []
        for g in rewards.reshape(2, 4):
            if method == "grpo":
                want += list((g - g.mean()) / (g.std(ddof=1) + 1e-4))
            elif method == "dr_grpo":
                want += list(g - g.mean())
            else:
                want += [g[i] - np.delete(g, i).mean() for i in range(4)]
        np.testing.assert_allclose(np.asarray(adv), np.asarray(want)[:, None] * m, atol=1e-4,
                                   err_msg=method)

    new, metrics = jax.jit(functools.partial(core.ppo_step, static, mods))(
        state, frozen, ppo_lib.hparams_from_config(cfg.ppo), ids, mask)
    assert new.critic_params == {}
    assert "loss/value_avg" not in metrics and "critic/explained_variance" not in metrics
    np.testing.assert_allclose(metrics["budget/generated_tokens"], m.sum())
    # Each prompt is prefilled once for its 4 samples.
    np.testing.assert_allclose(metrics["budget/prefill_tokens"], np.asarray(mask).sum())
    np.testing.assert_allclose(new.generated_tokens, m.sum())
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree.leaves(new.actor_params), jax.tree.leaves(state.actor_params)))
    assert moved > 1e-6


def test_gae_step_counts_its_budget(tiny_pipe):
    pipe = tiny_pipe[0]
    cfg, static, mods, state, frozen = ppo_setup(tiny_pipe)
    ids, mask = pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8]
    step = jax.jit(functools.partial(core.ppo_step, static, mods))
    new, metrics = step(state, frozen, ppo_lib.hparams_from_config(cfg.ppo), ids, mask)
    exp, _ = jax.jit(functools.partial(core.rollout_phase, static, mods))(state, frozen, ids, mask)
    np.testing.assert_allclose(metrics["budget/generated_tokens"],
                               np.asarray(exp.response_mask).sum())
    np.testing.assert_allclose(metrics["budget/prefill_tokens"], np.asarray(mask).sum())
    assert "loss/value_avg" in metrics


def _enumerated_value(policy, params, ref_params, prompt_ids, tokens, remaining, eos, score,
                      temperature, beta):
    """E[score(tokens + continuation) - beta x the continuation's summed KL (k1) to the
    reference] under the policy: every continuation of up to `remaining` tokens (stopping after
    EOS) enumerated, with next-token probabilities from full forward passes of prompt + tokens."""
    if remaining == 0 or (tokens and tokens[-1] == eos):
        return score(tokens)
    seq = jnp.asarray(np.concatenate([prompt_ids, np.asarray(tokens, np.int32)])[None])

    def log_probs(p):
        logits = np.asarray(policy.apply({"params": p}, seq, jnp.ones_like(seq)),
                            np.float64)[0, -1] / temperature
        return logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    logp, ref_logp = log_probs(params), log_probs(ref_params)
    return sum(np.exp(logp[a]) * (-beta * (logp[a] - ref_logp[a]) + _enumerated_value(
        policy, params, ref_params, prompt_ids, tokens + [a], remaining - 1, eos, score,
        temperature, beta)) for a in range(len(logp)))


def test_monte_carlo_values_are_unbiased_kl_regularised_values(tmp_path):
    """The mean return of continuations from a branch point converges to the exact
    KL-regularised value of that state (score - beta x the KL still to come), enumerated over
    every continuation of a tiny policy against a different reference."""
    from marl_jax import models
    from marl_jax.models.config import ModelConfig

    vocab, eos, temperature, beta = 5, 4, 1.0, 0.5
    cfg = ModelConfig(family="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=32, tie_word_embeddings=True)
    policy = models.CausalLM(cfg)
    ref_params = models.init_params(policy, jax.random.key(3))
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, ref_params)  # sharper policy
    weights = np.array([0.3, -0.2, 0.9, 0.1, 0.0])

    def gold(documents, ids, mask):
        return (jnp.asarray(weights, jnp.float32)[ids] * mask).sum(axis=1)

    static = ppo_types.PPOStatic(batch_size=1, response_length=3, eos_id=eos, pad_id=0,
                            temperature=temperature, top_k=0, reward_source="gold",
                            estimator="macro_mc", mc_rollouts=4000, reward_clip=10.0)
    mods = ppo_types.Models(policy=policy, critic=None, reward=None, actor_optimizer=None,
                       critic_optimizer=None, gold_fn=gold)
    frozen = ppo_types.Frozen(ref_params, None, jnp.float32(0.0), jnp.float32(1.0))
    prompt = np.array([1, 2, 3], np.int32)
    response = np.array([[2, 1, 3]], np.int32)
    z = jnp.zeros((1, 3))
    exp = ppo_types.Experience(jnp.asarray(prompt[None]), jnp.ones((1, 3), jnp.int32),
                          jnp.asarray(response), jnp.ones((1, 3), jnp.int32), z, z, z, z,
                          jnp.zeros(1), z, jnp.zeros(1, bool))
    starts = jnp.array([[0, 1, 2]], jnp.int32)
    valid = jnp.ones((1, 3), bool)
    returns, budget = jax.jit(functools.partial(phases.advantages.monte_carlo_returns, static, mods))(
        params, frozen, exp, starts, valid, jax.random.key(5), jnp.float32(beta))
    returns = np.asarray(returns)[0]  # [3 points, 4000 rollouts]

    def score(tokens):
        return float(sum(weights[t] for t in tokens))

    for j, t in enumerate([0, 1, 2]):
        exact = _enumerated_value(policy, params, ref_params, prompt, response[0, :t].tolist(),
                                  3 - t, eos, score, temperature, beta)
        unregularised = _enumerated_value(policy, params, ref_params, prompt,
                                          response[0, :t].tolist(), 3 - t, eos, score,
                                          temperature, 0.0)
        se = returns[j].std() / np.sqrt(returns.shape[1])
        assert abs(returns[j].mean() - exact) < 4 * se + 1e-6, (t, returns[j].mean(), exact, se)
        # The KL still to come moves the value by far more than the noise: the check can fail.
        assert abs(unregularised - exact) > 10 * se, (t, unregularised, exact, se)
    assert float(budget["budget/branch_generated_tokens"]) > 0


def test_estimator_experiment_reports_gold_per_generated_token(tmp_path):
    """Groups with different static fields run one after the other; every arm's budget in the
    report is recomputed here from the evaluation and training rows of metrics.jsonl."""
    cfg = tiny_config(**{"stage": "experiment", "ppo.steps": 2, "ppo.eval_every": 1,
                         "ppo.mc_rollouts": 2, "ppo.mc_branch_points": 2, "seeds": (0, 1)})
    cfg.experiment.arms = ("ppo", "macro_mc_n5")
    cfg.ppo.arm_overrides = {"macro_mc_n5": {"batch_size": 8}}
    workdir = str(tmp_path)
    report = experiment.run_experiment(cfg, workdir)
    rows = read_metrics(workdir)
    plan = [r for r in rows if r["stage"] == "plan"][-1]
    assert plan["runs"]["macro_mc_n5"]["estimator"] == "macro_mc"
    assert plan["runs"]["macro_mc_n5"]["batch_size"] == 8
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "experiment_1"))
    budget = report["budget"]["arms"]
    for arm in ("ppo", "macro_mc_n5"):
        for seed in (0, 1):
            train = [r for r in rows if r["stage"] == "ppo" and r["arm"] == arm
                     and r["seed"] == seed]
            evals = sorted((r for r in rows if r["stage"] == "eval" and r["arm"] == arm
                            and r["seed"] == seed), key=lambda r: r["step"])
            assert [r["step"] for r in train] == [1, 2]
            # The cumulative count in the eval rows is the sum of the per-step counts.
            np.testing.assert_allclose(
                evals[-1]["generated_tokens"],
                sum(r["budget/generated_tokens"] for r in train), rtol=1e-6)
            assert evals[0]["generated_tokens"] == 0
            want = (evals[-1]["gold"] - evals[0]["gold"]) / (evals[-1]["generated_tokens"] / 100000)
            assert budget[arm]["gold_per_100k_tokens"]["per_seed"][str(seed)] == pytest.approx(want)
        per_step = [r["budget/generated_tokens"] for r in rows
                    if r["stage"] == "ppo" and r["arm"] == arm]
        assert min(per_step) > 0
    # Monte Carlo branches generate more than the 8 responses of a step could alone.
    mc = [r for r in rows if r["stage"] == "ppo" and r["arm"] == "macro_mc_n5"]
    assert all(r["budget/generated_tokens"] > 8 * cfg.ppo.response_length for r in mc) or all(
        r["mc/branch_points_avg"] > 1 for r in mc)
    assert "loss/value_avg" not in mc[0] and "loss/value_avg" in [
        r for r in rows if r["stage"] == "ppo" and r["arm"] == "ppo"][0]
    text = open(os.path.join(workdir, "report.md")).read()
    assert "Gold per generated token" in text and os.path.exists(
        os.path.join(workdir, "budget.png"))
    json.dumps(report, allow_nan=False)


def test_budget_statistics_on_hand_made_rows():
    from marl_jax.eval import budget as budget_lib

    def rows(arm, seed, tokens, gold):
        return [dict(stage="eval", arm=arm, seed=seed, step=5 * i, gold=g, kl=0.0, rm_score=0.0,
                     generated_tokens=t, prefill_tokens=0.0, train_s=float(i))
                for i, (t, g) in enumerate(zip(tokens, gold))]

    data = (rows("ppo", 0, [0, 100, 200], [0.5, 0.6, 0.7])
            + rows("ppo", 1, [0, 110, 220], [0.5, 0.55, 0.65])
            + rows("mc", 0, [0, 300, 600], [0.5, 0.7, 0.8])
            + rows("mc", 1, [0, 320, 640], [0.5, 0.66, 0.7]))
    out = budget_lib.compute_budget(data, ["ppo", "mc"], "ppo", resamples=200)
    # Target: ppo's final seed-mean gold 0.675. ppo's mean curve (0.5, 0.575, 0.675) reaches it
    # at its last point, mean tokens 210; mc's (0.5, 0.68, 0.75) at its second, 310.
    assert out["target_gold"] == pytest.approx(0.675)
    assert out["arms"]["ppo"]["tokens_to_baseline_final"]["tokens"] == pytest.approx(210)
    assert out["arms"]["mc"]["tokens_to_baseline_final"]["tokens"] == pytest.approx(310)
    assert out["arms"]["mc"]["tokens_ratio_to_baseline"]["ratio"] == pytest.approx(310 / 210)
    per_seed = out["arms"]["mc"]["gold_per_100k_tokens"]["per_seed"]
    assert per_seed == pytest.approx({"0": 30 / 0.6, "1": 20 / 0.64})
    diff = out["arms"]["mc"]["gold_per_100k_tokens_vs_baseline"]["differences"]
    assert diff == pytest.approx([30 / 0.6 - 20 / 0.2, 20 / 0.64 - 15 / 0.22])
    assert out["fewest_tokens_to_baseline_final"] == "mc"
    lines = budget_lib.markdown_lines(out)
    assert any(line.startswith("| `mc` |") for line in lines)
    # One seed: a ratio, but no interval over seeds and so no claim either way.
    fast = (rows("ppo", 0, [0, 100, 200], [0.5, 0.6, 0.7])
            + rows("mc", 0, [0, 90, 180], [0.5, 0.7, 0.8]))
    one = budget_lib.compute_budget(fast, ["ppo", "mc"], "ppo", resamples=200)
    ratio = one["arms"]["mc"]["tokens_ratio_to_baseline"]
    assert ratio["ratio"] == pytest.approx(90 / 200) and ratio["ci"] is None
    assert one["arms"]["mc"]["tokens_to_baseline_final"]["ci"] is None
    assert budget_lib.markdown_lines(one)[-1] == (
        "Fewest generated tokens to `ppo`'s final gold: `mc` (0.45x `ppo`'s tokens); one seed, "
        "so no interval and no claim.")
