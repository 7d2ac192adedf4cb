"""LoRA: adapters beside the frozen base (init equals the base, only adapters and heads train,
merging), the PEFT export read by transformers + peft, resume on the same base only, config
errors."""
import importlib
import json
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import marl_jax.models as M
from marl_jax.config import base_config
from marl_jax.config_check import validate_config
from marl_jax.models import lora, peft_export
from marl_jax.train import build, checkpoint, metrics, supervised
from marl_jax.train.reward import rm_loss
from models_util import hf_logits, padded_batch, random_hf_model, use_one_torch_thread, write_checkpoint

use_one_torch_thread()

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, max_position_embeddings=64, eos_token_id=(1,),
            pad_token_id=0)


def _config(**fields):
    return M.ModelConfig.for_family("gemma2", **{**TINY, "sliding_window": 4,
                                                 "sliding_layers": (0,), **fields})


def _randomised_adapters(params, seed=3):
    """Adapters with B != 0 (trained-looking), so the adapter path changes the outputs."""
    leaves, treedef = jax.tree.flatten(lora.adapters(params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [0.05 * jax.random.normal(k, x.shape, x.dtype)
                                        for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("scan_layers", [False, True])
def test_adapted_model_equals_its_base_at_init_in_bfloat16(scan_layers):
    cfg = _config(dtype="bfloat16", param_dtype="bfloat16", scan_layers=scan_layers,
                  remat=scan_layers)
    params = M.init_params(M.CausalLM(cfg.replace(lora_rank=4)), jax.random.key(0))
    base = lora.without_adapters(params)
    ids, mask = padded_batch([5, 8], 8, seed=0, vocab=64)
    adapted = M.CausalLM(cfg.replace(lora_rank=4)).apply({"params": params}, ids, mask)
    plain = M.CausalLM(cfg).apply({"params": base}, ids, mask)
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))
    for leaf in jax.tree.leaves(lora.adapters(params)):
        assert leaf.dtype == jnp.float32  # adapters in float32 whatever the base's dtype
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(base))
    # A low-rank path that is not trivially zero: B = 0, A random.
    b_leaves = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if p[-1].key == "lora_b"]
    assert b_leaves and all(not np.asarray(x).any() for x in b_leaves)


def test_merged_forward_equals_base_plus_adapter_by_hand():
    cfg = _config(lora_rank=4, lora_alpha=8.0, lora_targets=("q", "o", "down"))
    model = M.CausalLM(cfg)
    params = M.init_params(model, jax.random.key(1))
    params = lora.attach(lora.without_adapters(params), _randomised_adapters(params))
    ids, mask = padded_batch([6, 8], 8, seed=1, vocab=64)
    adapted = np.asarray(model.apply({"params": params}, ids, mask))
    merged_params = lora.merge(params, lora.settings(cfg), precision=cfg.precision)
    assert not lora.has_adapters(merged_params)
    merged = np.asarray(M.CausalLM(cfg.replace(lora_rank=0)).apply({"params": merged_params},
                                                                    ids, mask))
    np.testing.assert_allclose(merged, adapted, atol=2e-5)
    # The merged o kernel by hand: W [N, H, D] + (alpha / r) * A [N, H, r] . B [r, D].
    o = params["backbone"]["layers_0"]["attn"]["o"]
    want = np.asarray(o["kernel"]) + 2.0 * np.einsum("nhr,rd->nhd", np.asarray(o["lora_a"]),
                                                     np.asarray(o["lora_b"]))
    np.testing.assert_allclose(np.asarray(merged_params["backbone"]["layers_0"]["attn"]["o"]
                                          ["kernel"]), want, rtol=1e-6, atol=1e-6)
    # Untargeted projections have no adapter.
    assert set(lora.adapters(params)["backbone"]["layers_0"]["mlp"]) == {"down"}


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_merge_multiplies_the_adapters_at_the_model_precision(precision):
    cfg = _config(lora_rank=4, lora_targets=("q",), matmul_precision=precision)
    params = M.init_params(M.CausalLM(cfg), jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda p: lora.merge(p, lora.settings(cfg),
                                                precision=cfg.precision))(params)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == cfg.num_layers
    want = jax.lax.Precision(precision)
    assert [e.params["precision"] for e in dots] == [(want, want)] * cfg.num_layers


def test_adapter_dropout_drops_inputs_of_the_low_rank_path_only():
    """W = 2I, A = B = I, alpha / r = 1: each output is 2x (input dropped) or 2x + x / (1 - p)
    (kept), a quarter dropped; without a dropout rng (sampling, scoring) exactly 3x."""
    from marl_jax.models.decoder import Dense

    width, rate = 16, 0.25
    dense = Dense(features=(width,), kernel_axes=("embed", "mlp"), name="up",
                  lora=lora.LoraSettings(width, float(width), ("up",), rate))
    eye = jnp.eye(width, dtype=jnp.float32)
    params = {"kernel": 2.0 * eye, "lora_a": eye, "lora_b": eye}
    x = jax.random.uniform(jax.random.key(0), (64, 4, width), minval=0.5, maxval=1.5)
    plain = np.asarray(dense.apply({"params": params}, x))
    np.testing.assert_allclose(plain, 3.0 * np.asarray(x), rtol=1e-6)
    out = np.asarray(dense.apply({"params": params}, x, rngs={"dropout": jax.random.key(1)}))
    xs = np.asarray(x)
    dropped = np.isclose(out, 2.0 * xs, rtol=1e-6)
    kept = np.isclose(out, 2.0 * xs + xs / (1.0 - rate), rtol=1e-6)
    assert np.all(dropped ^ kept)
    assert abs(dropped.mean() - rate) < 0.03  # 4096 draws: 5 standard deviations
    again = dense.apply({"params": params}, x, rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(np.asarray(again), out)
    # In bfloat16 compute (accelerators): the same two values, to bfloat16's precision.
    bf16 = dense.clone(dtype=jnp.bfloat16)
    low = np.asarray(bf16.apply({"params": params}, x.astype(jnp.bfloat16),
                                rngs={"dropout": jax.random.key(2)}), np.float32)
    xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
    dropped = np.isclose(low, 2.0 * xb, rtol=2e-2)
    kept = np.isclose(low, 2.0 * xb + xb / (1.0 - rate), rtol=2e-2)
    assert np.all(dropped ^ kept) and abs(dropped.mean() - rate) < 0.03


def test_remat_of_the_layer_scan_recomputes_the_same_dropout_masks():
    """Loss and gradients of a scanned model with adapter dropout are the same with and
    without rematerialisation, up to float32 rounding (remat changes how XLA fuses the
    backward): the backward pass redraws the masks the forward drew. Other masks move the
    gradients by far more than that tolerance (3e-2 measured)."""
    results = []
    for remat in (False, True):
        model = M.CausalLM(_config(lora_rank=4, lora_dropout=0.5, scan_layers=True, remat=remat))
        params = M.init_params(model, jax.random.key(0))
        params = lora.attach(lora.without_adapters(params), _randomised_adapters(params))
        ids, mask = padded_batch([4, 6], 6, seed=1, vocab=64)

        def loss(p, seed=1):
            logits = model.apply({"params": p}, ids, mask, rngs={"dropout": jax.random.key(seed)})
            return jnp.mean(jnp.square(logits))

        results.append(jax.value_and_grad(loss)(params))
        without = jnp.mean(jnp.square(model.apply({"params": params}, ids, mask)))
        assert abs(float(results[-1][0]) - float(without)) > 1e-6  # the masks act
    (loss_a, grad_a), (loss_b, grad_b) = results
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    other_masks = jax.grad(loss)(params, seed=2)
    assert max(float(jnp.abs(a - c).max())
               for a, c in zip(jax.tree.leaves(grad_a), jax.tree.leaves(other_masks))) > 1e-5


def test_sft_step_draws_dropout_masks_from_its_seed_and_step():
    """A LoRA SFT step with adapter dropout reports the loss of the forward with the dropout
    rng fold_in(fold_in(key(seed), 1), step), folded with the micro-batch: computed here with
    `sft_loss`, and not the loss without dropout."""
    from marl_jax.train.sft import sft_loss

    cfg = _config(lora_rank=4, lora_dropout=0.5)
    policy = M.CausalLM(cfg)
    params = M.init_params(policy, jax.random.key(1))
    base = lora.frozen_base(params)
    trained = lora.trainable(lora.attach(base, _randomised_adapters(params)))
    optimizer = build_optimizer(base_config().sft)
    state = build.TrainState(step=jnp.asarray(3, jnp.int32), params=trained,
                             opt_state=optimizer.init(trained),
                             skipped_updates=jnp.zeros((), jnp.float32))
    ids, mask = padded_batch([4, 6], 6, seed=2, vocab=64)
    resp, resp_mask = padded_batch([5, 3], 5, seed=3, vocab=64)
    batch = dict(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=resp_mask)
    step = jax.jit(supervised.make_lora_train_step(
        lambda p, b, rngs=None: sft_loss(policy, p, b, rngs), optimizer, dropout_seed=7))
    _, got = step(state, batch, base)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 1), 3), 0)
    full = lora.attach(base, trained)
    want = sft_loss(policy, full, batch, {"dropout": key})[0]
    np.testing.assert_allclose(float(got["loss"]), float(want), rtol=1e-6)
    assert abs(float(want) - float(sft_loss(policy, full, batch)[0])) > 1e-3


def test_adapters_that_miss_their_projections_raise_and_adapters_off_is_explicit():
    """A scanned model's adapters attached to an unrolled base give no adapter to any unrolled
    projection: the adapted model raises naming the first one (it used to run as the base, bit
    for bit). The base runs through the explicit switch `adapters_off`, which equals the model
    built without LoRA."""
    cfg = _config(lora_rank=2, lora_targets=("q", "down"))
    unrolled = M.init_params(M.CausalLM(cfg), jax.random.key(0))
    scanned = M.init_params(M.CausalLM(cfg.replace(scan_layers=True)), jax.random.key(0))
    misplaced = lora.attach(lora.without_adapters(unrolled), _randomised_adapters(scanned))
    assert lora.has_adapters(misplaced)
    ids, mask = padded_batch([5, 8], 8, seed=0, vocab=64)
    message = (r"^LoRA: the targeted projection backbone/layers_0/attn/q has no adapter "
               r"\(lora_a, lora_b\) in the params")
    with pytest.raises(ValueError, match=message) as error:
        M.CausalLM(cfg).apply({"params": misplaced}, ids, mask)
    assert "\n" not in str(error.value)
    base = lora.without_adapters(unrolled)
    with pytest.raises(ValueError, match="backbone/layers_0/attn/q has no adapter"):
        M.CausalLM(cfg).apply({"params": base}, ids, mask)
    off = lora.adapters_off(M.CausalLM(cfg))
    assert off.config.lora_rank == 0 and lora.adapters_off(off) is off
    np.testing.assert_array_equal(
        np.asarray(off.apply({"params": base}, ids, mask)),
        np.asarray(M.CausalLM(cfg.replace(lora_rank=0)).apply({"params": base}, ids, mask)))


def test_the_roles_of_a_task_without_a_reward_model():
    """An environment's task (multi-turn) has no reward model: its LoRA PPO run holds none, the
    actor and the critic their adapters (and the critic its head) on the SFT model's base."""
    from marl_jax.train import ppo

    cfg = _config(lora_rank=2)
    policy, critic = build.policy_module(cfg), build.critic_module(cfg)
    sft = M.init_params(policy, jax.random.key(0))
    critic_params = M.init_params(critic, jax.random.key(1))
    base, reference, actor, rm_params, critic_trained = ppo.lora_roles(
        policy, critic, sft, None, critic_params, jax.random.key(2))
    assert rm_params is None
    assert _leaves_equal(base, lora.frozen_base(sft)) and _leaves_equal(reference,
                                                                        lora.adapters(sft))
    assert _leaves_equal(actor, lora.trainable(sft))
    assert _leaves_equal(critic_trained, lora.trainable(critic_params))


def _leaves_equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_only_adapters_and_the_head_train():
    cfg = _config(lora_rank=2)
    reward_model = build.reward_module(cfg)
    params = M.init_params(reward_model, jax.random.key(2))
    base, trained = lora.frozen_base(params), lora.trainable(params)
    names = {p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(trained)[0]}
    assert names == {"lora_a", "lora_b", "kernel"} and set(trained) == {"backbone", "head"}
    section = base_config().rm
    optimizer = build_optimizer(section)
    state = build.TrainState(step=jnp.zeros((), jnp.int32), params=trained,
                             opt_state=optimizer.init(trained),
                             skipped_updates=jnp.zeros((), jnp.float32))
    step = jax.jit(supervised.make_lora_train_step(lambda p, b: rm_loss(reward_model, p, b),
                                                   optimizer))
    ids, mask = padded_batch([4, 6], 6, seed=2, vocab=64)
    r1, m1 = padded_batch([3, 5], 5, seed=3, vocab=64)
    r2, m2 = padded_batch([5, 2], 5, seed=4, vocab=64)
    batch = dict(prompt_ids=ids, prompt_mask=mask, chosen_ids=r1, chosen_mask=m1,
                 rejected_ids=r2, rejected_mask=m2)
    new, _ = step(state, batch, base)
    # Adam moments exist for the trained leaves only: two per leaf, none for the base.
    moments = [x for x in jax.tree.leaves(new.opt_state) if x.ndim > 0]
    assert len(moments) == 2 * len(jax.tree.leaves(trained))
    # The full model's gradient, independently: B and the head get it; the step moved them.
    full_grad = jax.grad(lambda p: rm_loss(reward_model, p, batch)[0])(lora.attach(base, trained))
    b_grad = full_grad["backbone"]["layers_1"]["mlp"]["down"]["lora_b"]
    a_grad = full_grad["backbone"]["layers_1"]["mlp"]["down"]["lora_a"]
    # B = 0 at init: A gets no gradient yet, B does.
    assert np.abs(np.asarray(a_grad)).max() == 0.0 < np.abs(np.asarray(b_grad)).max()
    head_moved = np.abs(np.asarray(new.params["head"]["kernel"] - trained["head"]["kernel"]))
    assert head_moved.max() > 0
    b_moved = np.asarray(new.params["backbone"]["layers_1"]["mlp"]["down"]["lora_b"])
    assert np.abs(b_moved).max() > 0


def build_optimizer(section):
    from marl_jax.train.optim import make_optimizer

    section = section.copy_and_resolve_references()
    section.learning_rate = 1e-2
    section.warmup_ratio = 0.0
    return make_optimizer(section, 10)


ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.parametrize("case, targets", [
    ("llama_gqa_llama3_untied", ALL_TARGETS),
    ("gemma_mqa_head_dim", ALL_TARGETS),
    ("qwen2_bias", ALL_TARGETS),
    ("gemma2_softcap_window", ALL_TARGETS),
    ("qwen3_window_head_dim", ALL_TARGETS),
    ("gemma3_local_global", ALL_TARGETS),
    ("mistral_window_mqa", ALL_TARGETS),
    ("olmo2_post_norms", ALL_TARGETS),
    ("phi3_fused_window", ALL_TARGETS),
    # Fused modules with parts left out: k of qkv_proj, up of gate_up_proj.
    ("phi3_fused_window", ("q", "v", "gate", "down")),
])
def test_peft_export_gives_the_adapted_models_logits_in_transformers(tmp_path, case, targets):
    """Every family that exports adapters: PEFT's model of the exported adapter on the base
    gives the adapted model's logits (Phi-3's fused qkv_proj and gate_up_proj included, which
    PEFT would otherwise load without a warning and leave unadapted)."""
    import torch
    from peft import PeftModel

    hf = random_hf_model(case, seed=4)
    base_dir = write_checkpoint(hf, tmp_path / "base")
    model, params = M.load_pretrained(base_dir)
    cfg = model.config.replace(lora_rank=4, lora_alpha=8.0, lora_targets=targets)
    adapted = M.CausalLM(cfg)
    params = lora.with_adapters(adapted, params, jax.random.key(0))
    params = lora.attach(lora.without_adapters(params), _randomised_adapters(params))
    peft_export.save_adapter(cfg, params, tmp_path / "adapter", base_dir)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base_dir and config["r"] == 4
    ids, mask = padded_batch([7, 9], 9, seed=5)
    ours = np.asarray(adapted.apply({"params": params}, ids, mask))
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(random_hf_model(case, seed=4),
                                               str(tmp_path / "adapter")).eval()
    adapted_modules = {name.rsplit(".", 2)[-2] for name, _ in peft_model.named_modules()
                       if name.endswith(".lora_A")}
    assert adapted_modules == set(config["target_modules"])
    theirs = hf_logits(peft_model, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(theirs[valid], ours[valid], atol=2e-4)
    assert np.abs(theirs[valid] - hf_logits(hf, ids, mask)[valid]).max() > 1e-2


def test_reward_model_peft_export_gives_its_scores_in_transformers(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    hf = random_hf_model("qwen2_bias", seed=6)
    base_dir = write_checkpoint(hf, tmp_path / "base")
    model, params = M.load_pretrained(base_dir)
    cfg = model.config.replace(lora_rank=2, lora_targets=("q", "v", "down"))
    reward_model = build.reward_module(cfg)
    fresh = M.init_params(reward_model, jax.random.key(1))
    params = lora.attach(dict(fresh, backbone=params["backbone"]), _randomised_adapters(fresh))
    peft_export.save_adapter(cfg, params, tmp_path / "adapter", base_dir)
    ids, mask = padded_batch([9, 9], 9, seed=7)
    ours = np.asarray(M.last_token_score(reward_model.apply({"params": params}, ids, mask), mask))
    seq_cls = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(seq_cls, str(tmp_path / "adapter")).eval()
        theirs = peft_model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4)


def test_peft_export_of_gpt2_is_refused_in_one_line():
    cfg = M.ModelConfig.for_family("gpt2", **{**TINY, "num_kv_heads": 4}, lora_rank=2,
                                   lora_targets=("q",))
    with pytest.raises(ValueError, match="^PEFT export: gpt2 fuses q, k and v"):
        peft_export.adapter_state_dict(cfg, {})


@pytest.mark.parametrize("field, value, message", [
    ("rank", 20, r"config.model.lora.rank=20: above the k projection's smaller dimension 16"),
    ("targets", ("q", "proj"), r"config.model.lora.targets: unknown \['proj'\]"),
    ("dropout", 1.0, r"config.model.lora.dropout=1.0: must be in \[0, 1\)"),
    ("weight_decay", -0.1, r"config.model.lora.weight_decay=-0.1: must be a number >= 0"),
])
def test_bad_lora_settings_fail_in_one_line_before_compiling(field, value, message):
    config = importlib.import_module("configs.synthetic").get_config()
    config.model.config = ml_collections.ConfigDict(TINY)
    config.stage = "sft"
    config.model.lora.rank = 4
    config.model.lora[field] = value
    with pytest.raises(ValueError, match=message) as error:
        validate_config(config)
        build.with_lora(M.ModelConfig.for_family("llama", **TINY), config)
    assert "\n" not in str(error.value)


def _sft_run(workdir, base, steps):
    """A LoRA SFT stage of the tiny model on fixed data (constant learning rate, checkpoints
    every 2 steps): its returned params (base with the trained adapters)."""
    from marl_jax.train import sharding
    from marl_jax.train.sft import sft_loss

    # With adapter dropout: a resumed run must draw the masks the uninterrupted one drew.
    policy = M.CausalLM(_config(lora_rank=2, lora_dropout=0.1))
    section = base_config().sft
    section.update(steps=steps, batch_size=8, learning_rate=1e-2, warmup_ratio=0.0,
                   schedule="constant")
    rng = np.random.default_rng(0)
    data = dict(prompt_ids=rng.integers(2, 64, (16, 4)).astype(np.int32),
                prompt_mask=np.ones((16, 4), np.int32),
                response_ids=rng.integers(2, 64, (16, 5)).astype(np.int32),
                response_mask=np.ones((16, 5), np.int32))
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)))
    with metrics.MetricsWriter(str(workdir)) as writer:
        return supervised.train(
            name="sft", cfg=section, seed=0, module=policy, init_params=base,
            loss_fn=lambda p, b, rngs=None: sft_loss(policy, p, b, rngs), data=data, mesh=mesh,
            writer=writer,
            workdir=str(workdir), checkpoint_every=2, log_every=1, max_to_keep=5,
            metadata=dict(stage="sft"))


def test_resume_is_exact_and_needs_the_same_base(tmp_path):
    base = M.init_params(M.CausalLM(_config()), jax.random.key(5))
    straight = _sft_run(tmp_path / "straight", base, 4)
    _sft_run(tmp_path / "resumed", base, 2)
    resumed = _sft_run(tmp_path / "resumed", base, 4)
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert lora.has_adapters(resumed)
    assert np.abs(np.asarray(resumed["backbone"]["layers_0"]["attn"]["q"]["lora_b"])).max() > 0
    # The checkpoints hold the adapters (and their optimizer state) and the base's identity,
    # not the base.
    ckpt = tmp_path / "resumed" / "checkpoints" / "sft"
    with checkpoint.Checkpointer(ckpt) as saved:
        state, meta = saved.restore(4)
    names = {p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    assert names == {"lora_a", "lora_b"}
    assert meta["base"] == checkpoint.lora_identity(base)
    metrics_file = tmp_path / "resumed" / "metrics.jsonl"
    before = metrics_file.read_bytes(), sorted(p.name for p in ckpt.iterdir())
    other = jax.tree.map(lambda x: x * 1.01, base)
    with pytest.raises(ValueError, match=r"^checkpoints/sft: its adapters were trained on a "
                                         r"base with hash \w{12}, this run's base has hash") as error:
        _sft_run(tmp_path / "resumed", other, 6)
    assert "\n" not in str(error.value)
    assert (metrics_file.read_bytes(), sorted(p.name for p in ckpt.iterdir())) == before


def test_ppo_resume_refuses_a_changed_sft_adapter_kept_apart_from_the_base(tmp_path):
    """With `merge_sft=False` the reference is the pretrained base with the SFT adapter: SFT
    trained further changes the reference but not the base, and PPO's resume refuses it."""
    from marl_jax import stages
    from train_util import tiny_config

    workdir = str(tmp_path)
    run = lambda sft_steps, ppo_steps: stages.run(tiny_config(**{
        "model.lora.rank": 4, "model.lora.merge_sft": False, "sft.steps": sft_steps,
        "ppo.steps": ppo_steps, "ppo.eval_every": 0, "checkpoint_every": 1}), workdir)
    run(2, 1)
    ppo_dir = tmp_path / "checkpoints" / "ppo"
    with checkpoint.Checkpointer(ppo_dir) as saved:
        _, meta = saved.restore(1)
    assert len(meta["reference"]["hash"]) == 64
    before = sorted(p.name for p in ppo_dir.iterdir())
    with pytest.raises(ValueError, match=r"^checkpoints/ppo: its adapters were trained against "
                                         r"the reference SFT adapter with hash \w{12}, this "
                                         r"run's SFT adapter has hash \w{12}") as error:
        run(3, 2)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in ppo_dir.iterdir()) == before


def test_lora_ppo_step_on_eight_devices_with_the_base_sharded_fsdp(monkeypatch):
    """One MA-PPO step of the synthetic task's model with LoRA over an fsdp=8 mesh: the state
    holds adapters and heads only, the one base (the reference) is sharded over fsdp, the
    reference logprobs are the base's (computed here on one device), the actor starts equal to
    it (KL 0), and the step moves the adapters. With adapter dropout, the actor's and the
    critic's training forwards get a dropout rng and the scoring passes none."""
    from marl_jax.models.heads import continuation_scores
    from marl_jax.train import aot, ppo, sharding
    from marl_jax.train import phases, ppo_types

    config = importlib.import_module("configs.synthetic").get_config()
    config.stage = "ppo"
    config.model.lora.rank = 4
    config.model.lora.dropout = 0.1
    config.mesh.update(dict(data=1, fsdp=8, tensor=1))
    config.ppo.update(dict(batch_size=8, response_length=8, rollout_chunks=2))
    cfg = build.with_lora(M.ModelConfig(**dict(config.model.config), vocab_size=39,
                                        eos_token_id=(2,), pad_token_id=0), config)
    policy, critic, reward_model = (build.policy_module(cfg), build.critic_module(cfg),
                                    build.reward_module(cfg))
    mesh = sharding.make_mesh(config.mesh)
    tokens = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    forwards = []  # (which, the rngs it got) of every policy and critic forward traced

    def recording(which, fn, rngs_position):
        def wrapped(*args, **kwargs):
            rngs = kwargs.get("rngs", args[rngs_position] if len(args) > rngs_position else None)
            forwards.append((which, None if rngs is None else tuple(rngs)))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(phases.score, "token_logprobs",
                        recording("policy", phases.score.token_logprobs, 8))
    monkeypatch.setattr(phases.score, "critic_outputs",
                        recording("critic", phases.score.critic_outputs, 7))
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(cfg))):
        programs = aot.ppo_programs(config, tokens, policy, critic, reward_model, mesh)
    step, (state_abs, frozen_abs, _, prompt_abs, _, docs_abs) = programs["ppo_step"]
    rollout = programs["rollout"][0]
    assert step.in_shardings[1].ref_params["backbone"]["layers_0"]["mlp"]["up"][
        "kernel"].spec[0] == "fsdp"

    params = M.init_params(policy, jax.random.key(0))
    base, actor = lora.frozen_base(params), lora.trainable(params)
    rm_params = lora.trainable(M.init_params(reward_model, jax.random.key(1)))
    critic_params = lora.trainable(M.init_params(critic, jax.random.key(2)))
    mods = ppo.make_models(config, policy, critic, reward_model, lambda d, i, m: m.sum(1) * 0.0)
    state = jax.device_put(ppo.initial_state(config, mods, actor, critic_params, 0),
                           step.in_shardings[0])
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
        lambda x: (x.shape, x.dtype), state_abs)
    frozen = jax.device_put(ppo_types.Frozen(ref_params=base, rm_params=rm_params,
                                        reward_mean=jnp.float32(0), reward_std=jnp.float32(1)),
                            step.in_shardings[1])
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 39, prompt_abs.shape).astype(np.int32)
    docs = rng.integers(0, 8, docs_abs.shape).astype(np.int32)
    batch_sh = sharding.batch_sharding(mesh)
    args = [jax.device_put(x, batch_sh) for x in (prompts, np.ones_like(prompts), docs)]
    hparams = jax.device_put(ppo.hparams_from_config(config.ppo), sharding.replicated(mesh))
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(cfg))):
        exp, roll = rollout.fn(state, frozen, *args)
        new_state, metrics = step.fn(jax.tree.map(jnp.copy, state), frozen, hparams, *args)
    # The update's forwards have a dropout rng, the rollout's values none.
    assert ("policy", ("dropout",)) in forwards and ("critic", ("dropout",)) in forwards
    assert ("critic", None) in forwards
    ref = continuation_scores(lora.adapters_off(policy), base, prompts, np.ones_like(prompts),
                              np.asarray(exp.response_ids), np.asarray(exp.response_mask),
                              config.ppo.temperature)
    np.testing.assert_allclose(np.asarray(exp.ref_logprobs), np.asarray(ref.logprobs), atol=1e-5)
    assert abs(float(roll["objective/kl"])) < 1e-4
    assert float(metrics["train/skipped_updates"]) == 0.0
    moved = new_state.actor_params["backbone"]["layers_1"]["attn"]["v"]["lora_b"]
    assert np.abs(np.asarray(moved)).max() > 0
    assert set(jax.tree_util.keystr(p)[-9:] for p, _ in jax.tree_util.tree_flatten_with_path(
        new_state.actor_params)[0]) == {"'lora_a']", "'lora_b']"}


def test_chunked_scoring_equals_the_whole_batch():
    """`rollout_chunks` only changes memory: scoring the rows in 2 interleaved chunks gives the
    whole batch's experience (logprobs, values, scores, rewards)."""
    from marl_jax.train import ppo
    from marl_jax.train import phases, ppo_types

    config = importlib.import_module("configs.synthetic").get_config()
    config.ppo.update(dict(batch_size=4, response_length=6))
    cfg = M.ModelConfig(**dict(config.model.config), vocab_size=39, eos_token_id=(2,),
                        pad_token_id=0)
    policy, critic, reward_model = (build.policy_module(cfg), build.critic_module(cfg),
                                    build.reward_module(cfg))
    mods = ppo.make_models(config, policy, critic, reward_model, None)
    actor = M.init_params(policy, jax.random.key(0))
    state = ppo.initial_state(config, mods, actor, M.init_params(critic, jax.random.key(1)), 0)
    frozen = ppo_types.Frozen(ref_params=jax.tree.map(lambda x: x * 1.05, actor),
                         rm_params=M.init_params(reward_model, jax.random.key(2)),
                         reward_mean=jnp.float32(0.1), reward_std=jnp.float32(2.0))
    prompt_ids, prompt_mask = padded_batch([5, 3, 4, 5], 5, seed=8, vocab=39)
    response_ids, response_mask = padded_batch([6, 2, 4, 0], 6, seed=9, vocab=39,
                                               right_pad=[0, 4, 2, 6])
    response_ids = np.where(response_mask > 0, response_ids, 0)  # left-aligned, pad 0
    tokens = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    out = {}
    for chunks in (1, 2):
        config.ppo.rollout_chunks = chunks
        static = ppo.static_from_config(config, tokens)
        out[chunks], _ = jax.jit(lambda *a: phases.score.score(static, mods, state, frozen, *a))(
            prompt_ids, prompt_mask, response_ids, response_mask)
    for name in ("old_logprobs", "ref_logprobs", "values", "scores", "rewards"):
        np.testing.assert_allclose(np.asarray(getattr(out[2], name)),
                                   np.asarray(getattr(out[1], name)), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("merge_sft", [True, False], ids=["merged_sft", "sft_adapter_apart"])
def test_lora_pipeline_exports_peft_adapters_of_one_base(tmp_path, merge_sft):
    """SFT -> reward model -> PPO with LoRA, evaluating every step: each export's PEFT adapter,
    applied with peft to the base it names (the SFT model when SFT merged its adapter, else the
    pretrained base), gives that export's merged model (and differs from the base: it trained);
    PPO's checkpoints hold adapters and heads plus the base's identity, not the base; the
    evaluation rows of steps 0, 1 and 2 are logged. The reference is the SFT policy either way:
    the first step's KL is 0 to float32 rounding (with the SFT adapter kept apart, the pretrained
    base as the reference was 0.43 nats from the SFT policy at step 0)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from marl_jax import stages
    from train_util import tiny_config

    workdir = tmp_path / "run"
    config = tiny_config(**{"model.lora.rank": 4, "sft.steps": 10, "sft.learning_rate": 3e-2,
                            "ppo.eval_every": 1, "ppo.learning_rate": 3e-2,
                            "model.lora.merge_sft": merge_sft})
    stages.run(config, str(workdir))
    models_dir = workdir / "models"
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, 20, (2, 9)), dtype=torch.long)

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.numpy()

    for name, loader in (("sft", AutoModelForCausalLM), ("policy", AutoModelForCausalLM),
                         ("rm", AutoModelForSequenceClassification)):
        adapter = models_dir / name / "adapter"
        base_dir = json.loads((adapter / "adapter_config.json").read_text())[
            "base_model_name_or_path"]
        assert base_dir == str(models_dir / ("sft" if merge_sft and name != "sft" else "base"))
        extra = {"num_labels": 1} if name == "rm" else {}
        base = loader.from_pretrained(base_dir, **extra).eval()
        base_logits = logits(base)
        adapted = logits(PeftModel.from_pretrained(base, str(adapter)).eval())
        merged = logits(loader.from_pretrained(models_dir / name).eval())
        np.testing.assert_allclose(adapted, merged, atol=1e-3, err_msg=name)
        if name != "rm":  # the reward model's base has an untrained score head
            assert np.abs(adapted - base_logits).max() > 1e-3, name
    with checkpoint.Checkpointer(workdir / "checkpoints" / "ppo") as saved:
        state, meta = saved.restore()
    assert len(meta["base"]["hash"]) == 64
    names = {p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(state["actor_params"])[0]}
    assert names == {"lora_a", "lora_b"}
    rows = metrics.read_metrics(str(workdir))
    evals = [r for r in rows if r["stage"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert abs(evals[0]["kl"]) < 1e-4 and all(np.isfinite(r["rm_score"]) for r in evals)
    first = [r for r in rows if r["stage"] == "ppo"][0]
    assert first["step"] == 1 and abs(first["objective/kl"]) < 1e-6
