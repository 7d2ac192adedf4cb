"""Optimizers: schedules count optimizer updates, gradient accumulation equals the whole batch,
no weight decay on norm scales and biases."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from marl_jax.config import optimizer_config
from marl_jax.train import build, optim, ppo as ppo_lib, supervised


def test_weight_decay_skips_norm_scales_and_biases():
    params = {"layer": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((3,))},
              "norm": {"scale": jnp.ones((4,))}, "stacked_norm": {"scale": jnp.ones((2, 4))},
              "embed": {"embedding": jnp.ones((5, 2))}}
    cfg = optimizer_config(lr=0.1, steps=10, batch_size=1)
    cfg.update(dict(schedule="constant", warmup_ratio=0.0, weight_decay=0.5, grad_clip=0.0))
    opt = optim.make_optimizer(cfg, 10)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    # With zero gradients, AdamW's update is -lr * weight_decay * param where decay applies.
    np.testing.assert_allclose(updates["layer"]["kernel"], -0.05 * np.ones((2, 3)))
    np.testing.assert_allclose(updates["embed"]["embedding"], -0.05 * np.ones((5, 2)))
    for leaf in (updates["layer"]["bias"], updates["norm"]["scale"],
                 updates["stacked_norm"]["scale"]):
        np.testing.assert_array_equal(leaf, 0.0)


def test_lora_adapters_get_their_own_weight_decay():
    """A LoRA stage decays its adapters at `model.lora.weight_decay` (default 0, as PEFT / TRL)
    and its head at the stage's `weight_decay`: with zero gradients AdamW's update is
    -lr x decay x param, leaf by leaf. The PPO optimizers of a LoRA config do the same."""
    from train_util import tiny_config

    params = {"backbone": {"layers_0": {"attn": {"q": {"lora_a": jnp.ones((4, 2)),
                                                       "lora_b": jnp.full((2, 3), 2.0)}}}},
              "head": {"kernel": jnp.ones((4, 1)), "bias": jnp.ones((1,))}}
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    cfg = optimizer_config(lr=0.1, steps=10, batch_size=1)
    cfg.update(dict(schedule="constant", warmup_ratio=0.0, weight_decay=0.5, grad_clip=0.0))

    def update(optimizer):
        updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
        q = updates["backbone"]["layers_0"]["attn"]["q"]
        return (np.asarray(q["lora_a"]), np.asarray(q["lora_b"]),
                np.asarray(updates["head"]["kernel"]), np.asarray(updates["head"]["bias"]))

    for decay in (0.0, 0.3):
        a, b, kernel, bias = update(optim.make_optimizer(cfg, 10, lora_weight_decay=decay))
        np.testing.assert_allclose(a, -0.1 * decay * np.ones((4, 2)), atol=1e-7)
        np.testing.assert_allclose(b, -0.1 * decay * np.full((2, 3), 2.0), atol=1e-7)
        np.testing.assert_allclose(kernel, -0.05 * np.ones((4, 1)), rtol=1e-6)
        np.testing.assert_array_equal(bias, 0.0)
    # The config: 0 unless set, None (the stage's decay everywhere) without LoRA.
    config = tiny_config(**{"model.lora.rank": 4})
    assert optim.adapter_weight_decay(config) == 0.0
    assert optim.adapter_weight_decay(tiny_config()) is None
    config.ppo.update(dict(schedule="constant", warmup_ratio=0.0, weight_decay=0.5,
                           grad_clip=0.0, learning_rate=0.1, critic_learning_rate=0.1))
    mods = ppo_lib.make_models(config, None, None, None, lambda *a: None)
    for optimizer in (mods.actor_optimizer, mods.critic_optimizer):
        a, _, kernel, _ = update(optimizer)
        np.testing.assert_array_equal(a, 0.0)
        np.testing.assert_allclose(kernel, -0.05 * np.ones((4, 1)), rtol=1e-6)


def test_ppo_schedule_counts_updates_not_steps():
    p = optimizer_config(lr=1.0, steps=10, batch_size=8)
    p.update(dict(schedule="linear", warmup_ratio=0.1, ppo_epochs=2, num_minibatches=4,
                  critic_learning_rate=0.5))
    assert ppo_lib.ppo_updates(p) == 80
    schedule = optim.stage_schedule(p, ppo_lib.ppo_updates(p))
    # 8 warmup updates (10% of 80), then linear decay to 0 at update 80.
    np.testing.assert_allclose(schedule(4), 0.5)
    np.testing.assert_allclose(schedule(8), 1.0)
    last_step_first_update = 9 * 2 * 4
    np.testing.assert_allclose(schedule(last_step_first_update), 1.0 * (80 - 72) / 72)
    critic = optim.stage_schedule(p, 80, learning_rate=p.critic_learning_rate)
    np.testing.assert_allclose(critic(8), 0.5)


def test_logged_lr_follows_the_updates_applied_not_the_steps():
    cfg = optimizer_config(lr=1.0, steps=10, batch_size=1)
    cfg.update(dict(schedule="linear", warmup_ratio=0.0, grad_clip=0.0))
    optimizer = optim.make_optimizer(cfg, 10)
    params = {"w": jnp.ones((3,))}

    def loss_fn(p, batch):  # a non-finite loss where the batch says so: that update is skipped
        return jnp.sum(p["w"] ** 2) * batch["scale"], {}

    step = jax.jit(supervised.make_train_step(loss_fn, optimizer,
                                              schedule=optim.stage_schedule(cfg, 10)))
    state = build.TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                             skipped_updates=jnp.zeros(()))
    logged = []
    for scale in (1.0, np.nan, 1.0, 1.0):
        state, metrics = step(state, {"scale": jnp.float32(scale)})
        logged.append(float(metrics["lr"]))
    # Linear decay from 1.0 over 10 updates: 1 - n / 10 at the n-th applied update. The planted
    # non-finite step applies nothing, so the two steps after it take updates 1 and 2 at the
    # rates of updates 1 and 2, not of steps 2 and 3.
    np.testing.assert_allclose(logged, [1.0, 0.9, 0.9, 0.8], rtol=1e-6)
    assert float(metrics["skipped_updates"]) == 1.0 and int(state.step) == 4
    assert int(optim.applied_updates(state.opt_state)) == 3


@pytest.mark.parametrize("num_micro", [2, 4])
def test_accumulated_gradients_equal_the_whole_batch(num_micro):
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
             "mask": jnp.asarray(rng.random((8, 5)) < 0.6, jnp.float32)}
    batch["mask"] = batch["mask"].at[3].set(0.0)  # a row without tokens
    params = {"w": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}

    def token_mean_loss(p, b):
        per_token = jnp.tanh(b["x"] * p["w"]) ** 2
        loss = jnp.sum(per_token * b["mask"]) / jnp.maximum(b["mask"].sum(), 1.0)
        return loss, {"tokens": b["mask"].sum()}

    (loss, _), grads = optim.accumulate_gradients(
        token_mean_loss, params, batch, num_micro, lambda b: b["mask"].sum())
    (want, _), want_grads = jax.value_and_grad(token_mean_loss, has_aux=True)(params, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5, atol=1e-7)
    # Equal weights would not be exact here: micro-batches hold different token counts.
    (equal, _), _ = optim.accumulate_gradients(token_mean_loss, params, batch, num_micro,
                                               lambda b: jnp.float32(1.0))
    assert abs(float(equal) - float(want)) > 1e-4


def test_accumulation_rejects_an_uneven_split():
    with pytest.raises(ValueError, match="6 rows does not split into 4"):
        optim.accumulate_gradients(lambda p, b: (jnp.sum(p * b), {}), jnp.ones(()),
                                   jnp.ones((6,)), 4, lambda b: 1.0)


def test_schedule_config_is_unchanged_by_a_critic_override():
    cfg = ml_collections.ConfigDict(dict(learning_rate=1.0, warmup_ratio=0.0,
                                         schedule="constant"))
    optim.stage_schedule(cfg, 10, learning_rate=0.25)
    assert cfg.learning_rate == 1.0


def _tiny_reward_model(num_layers=3, scan_layers=False):
    from marl_jax import models

    cfg = models.ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_layers=num_layers, num_heads=2, num_kv_heads=2, head_dim=8,
                             max_position_embeddings=16, eos_token_id=(1,), pad_token_id=0,
                             scan_layers=scan_layers)
    module = models.ScalarHeadModel(cfg)
    return module, models.init_params(module, jax.random.key(0))


def test_num_layers_unfrozen_trains_the_top_layers_with_the_full_models_gradients():
    from marl_jax.models import last_token_score

    module, params = _tiny_reward_model()
    mask = optim.trainable_mask(params, 1)
    flat = {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    trained = sorted(k for k, v in flat.items() if v)
    assert trained and all(k.startswith(("backbone/layers_2/", "backbone/final_norm/", "head/"))
                           for k in trained)
    assert any(k.startswith("backbone/layers_2/") for k in trained)
    assert not any(v for k, v in flat.items() if k.startswith(("backbone/embed", "backbone/layers_0",
                                                                "backbone/layers_1")))
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 32, (4, 8)), jnp.int32)
    mask_ids = jnp.ones_like(ids)

    def loss(p, batch):
        scores = last_token_score(module.apply({"params": p}, batch, mask_ids), mask_ids)
        return jnp.mean((scores - jnp.arange(4.0)) ** 2), {}

    (_, _), full = jax.value_and_grad(loss, has_aux=True)(params, ids)
    (_, _), frozen = optim.accumulate_gradients(loss, params, ids, 1, lambda b: 1.0,
                                                num_layers_unfrozen=1)
    for (path, g_full), g in zip(jax.tree_util.tree_flatten_with_path(full)[0],
                                 jax.tree.leaves(frozen)):
        name = "/".join(str(k.key) for k in path)
        if flat[name]:  # the top layer's gradient is the full model's
            np.testing.assert_allclose(g, g_full, rtol=1e-5, atol=1e-7, err_msg=name)
        else:
            assert not np.any(np.asarray(g)), name

    cfg = optimizer_config(lr=1e-2, steps=10, batch_size=4)
    cfg.num_layers_unfrozen = 1
    tx = optim.make_optimizer(cfg, 10)
    state = tx.init(params)
    # Adam moments exist for the trained leaves only.
    moments = [x for x in jax.tree.leaves(state) if np.ndim(x) > 0]
    assert sum(np.size(x) for x in moments) == 2 * sum(
        np.size(v) for v, t in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if t)
    updates, _ = tx.update(full, state, params)
    # The trained leaves move as plain AdamW moves them on the gradients of the trained leaves
    # alone (clipping included: the frozen leaves add nothing to the global norm).
    cfg.num_layers_unfrozen = -1
    plain = optim.make_optimizer(cfg, 10)
    masked = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), full, mask)
    want, _ = plain.update(masked, plain.init(params), params)
    for u, w, t in zip(jax.tree.leaves(updates), jax.tree.leaves(want), jax.tree.leaves(mask)):
        np.testing.assert_allclose(u, w if t else np.zeros_like(w), rtol=1e-6, atol=1e-9)
    assert any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    with pytest.raises(ValueError, match="the model has 3 layers"):
        optim.trainable_mask(params, 4)
    _, scanned = _tiny_reward_model(scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers=False"):
        optim.trainable_mask(scanned, 1)
