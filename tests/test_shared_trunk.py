"""A frozen trunk shared by actor, reference, critic and reward model: run once, same numbers.

With `num_layers_unfrozen` = n every stage trains only the top n layers, so the four models of a
PPO step have the same embeddings and first L - n layers; a step that runs those once for all
of them (`PPOStatic.shared_trunk_layers`) must equal the step that runs each model whole.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import models
from marl_jax.config import base_config
from marl_jax.models.heads import backbone_hidden, trunk_states
from marl_jax.train import ppo as ppo_lib
from marl_jax.train import ppo_core as core, ppo_types

LAYERS, UNFROZEN = 4, 2


def _config(family="llama", **fields):
    base = dict(family=family, vocab_size=32, hidden_size=16, intermediate_size=32,
                num_layers=LAYERS, num_heads=2, num_kv_heads=2, head_dim=8,
                max_position_embeddings=32, eos_token_id=(1,), pad_token_id=0)
    return models.ModelConfig(**dict(base, **fields))


def _with_bottom_of(params, source, k=LAYERS - UNFROZEN):
    """`params` with `source`'s embeddings and first k layers."""
    backbone = dict(params["backbone"])
    for name, value in source["backbone"].items():
        if name != "final_norm" and not (name.startswith("layers_") and int(name[7:]) >= k):
            backbone[name] = value
    return dict(params, backbone=backbone)


@pytest.mark.parametrize("family, fields", [("llama", {}), ("gpt2", {}),
                                            ("gemma2", dict(sliding_window=3))])
def test_trunk_then_top_equals_the_whole_backbone(family, fields):
    cfg = _config(family, **fields)
    policy = models.CausalLM(cfg)
    params = models.init_params(policy, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, 32, (3, 9)), jnp.int32)
    mask = jnp.asarray(np.array([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1] * 9, [0, 1, 1, 1, 1, 1, 1, 1, 0]]),
                       jnp.int32)
    whole = policy.apply({"params": params}, ids, mask, method=models.CausalLM.hidden_states)
    for k in (0, 1, LAYERS):
        split = backbone_hidden(cfg, params, ids, mask, (trunk_states(cfg, params, ids, mask, k), k))
        np.testing.assert_allclose(split, whole, atol=1e-5, rtol=1e-5)


def _setup(num_layers_unfrozen=UNFROZEN):
    cfg = _config()
    policy, critic = models.CausalLM(cfg), models.ScalarHeadModel(cfg, head_bias=True)
    reward = models.ScalarHeadModel(cfg, head_init_std=models.reward_head_init_std(cfg))
    sft = models.init_params(policy, jax.random.key(0))
    rm = _with_bottom_of(models.init_params(reward, jax.random.key(1)), sft)
    critic_params = _with_bottom_of(models.init_params(critic, jax.random.key(2)), sft)
    critic_params["head"] = dict(critic_params["head"],
                                 kernel=jax.random.normal(jax.random.key(3), (16, 1)) * 0.3)
    config = base_config()
    config.ppo.update(dict(batch_size=4, response_length=6, num_minibatches=2, ppo_epochs=2,
                           num_layers_unfrozen=num_layers_unfrozen, learning_rate=1e-2,
                           critic_learning_rate=1e-2, warmup_ratio=0.0, steps=4, top_k=0))
    mods = ppo_lib.make_models(config, policy, critic, reward)
    static = ppo_types.PPOStatic(batch_size=4, response_length=6, eos_id=1, pad_id=0, top_k=0,
                            ppo_epochs=2, num_minibatches=2,
                            num_layers_unfrozen=num_layers_unfrozen)
    return cfg, config, mods, static, sft, rm, critic_params


def test_a_ppo_step_with_the_shared_trunk_equals_the_step_without():
    cfg, config, mods, static, sft, rm, critic_params = _setup()
    shared = ppo_lib.with_shared_trunk(static, LAYERS, sft, rm, [critic_params])
    assert shared.shared_trunk_layers == LAYERS - UNFROZEN
    frozen = ppo_types.Frozen(sft, rm, jnp.float32(0.1), jnp.float32(2.0))
    hp = ppo_lib.hparams_from_config(config.ppo)
    prompts = jnp.asarray(np.random.default_rng(1).integers(2, 32, (4, 5)), jnp.int32)
    prompt_mask = jnp.asarray(np.array([[0, 1, 1, 1, 1]] + [[1] * 5] * 3), jnp.int32)
    out = {}
    for name, s in (("whole", static), ("shared", shared)):
        state = ppo_lib.initial_state(config, mods, sft, critic_params, seed=0)
        step = jax.jit(functools.partial(core.ppo_step, s, mods))
        for _ in range(2):
            state, metrics = step(state, frozen, hp, prompts, prompt_mask)
        out[name] = (state, metrics)
    (whole, m_whole), (split, m_split) = out["whole"], out["shared"]
    for a, b in zip(jax.tree.leaves((whole.actor_params, whole.critic_params)),
                    jax.tree.leaves((split.actor_params, split.critic_params))):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg",
                "critic/explained_variance", "grad/actor_norm", "grad/critic_norm"):
        np.testing.assert_allclose(m_whole[key], m_split[key], rtol=1e-4, atol=1e-5,
                                   err_msg=key)
    # The held-out evaluation (reference logprobs and reward-model scores) runs the trunk once.
    evals = [ppo_lib.evaluate(s, mods, split.actor_params, frozen, prompts, prompt_mask, None,
                              jax.random.key(5)) for s in (static, shared)]
    for key in ("kl", "rm_score", "response_ids"):
        np.testing.assert_allclose(evals[0][key], evals[1][key], rtol=1e-4, atol=1e-5,
                                   err_msg=key)
    # The steps trained: the top layers moved, the shared trunk did not.
    top = lambda p, i: jax.tree.leaves(p["backbone"][f"layers_{i}"])
    assert max(float(jnp.abs(a - b).max())
               for a, b in zip(top(split.actor_params, LAYERS - 1), top(sft, LAYERS - 1))) > 1e-4
    for i in range(LAYERS - UNFROZEN):
        for a, b in zip(top(split.actor_params, i), top(sft, i)):
            np.testing.assert_array_equal(a, b)


def test_the_trunk_is_shared_only_when_every_model_has_it():
    cfg, config, mods, static, sft, rm, critic_params = _setup()
    k = LAYERS - UNFROZEN
    assert ppo_lib.with_shared_trunk(static, LAYERS, sft, rm, [critic_params]) \
        .shared_trunk_layers == k
    # A reward model whose layer k - 1 differs (it trained more layers than PPO does).
    other = jax.tree.map(lambda x: x, rm)
    other["backbone"] = dict(other["backbone"])
    other["backbone"][f"layers_{k - 1}"] = jax.tree.map(lambda x: x + 1e-3,
                                                        rm["backbone"][f"layers_{k - 1}"])
    assert ppo_lib.with_shared_trunk(static, LAYERS, sft, other, [critic_params]) is static
    # One of several critics (a cold one) differs.
    cold = models.init_params(models.ScalarHeadModel(cfg, head_bias=True), jax.random.key(9))
    assert ppo_lib.with_shared_trunk(static, LAYERS, sft, rm, [critic_params, cold]) is static
    # The reward model is not read when the gold scores: only the critic has to match.
    gold = dataclasses.replace(static, reward_source="gold")
    assert ppo_lib.with_shared_trunk(gold, LAYERS, sft, other, [critic_params]) \
        .shared_trunk_layers == k
    # Every layer trained: nothing is shared.
    every = dataclasses.replace(static, num_layers_unfrozen=-1)
    assert ppo_lib.with_shared_trunk(every, LAYERS, sft, rm, [critic_params]) is every
