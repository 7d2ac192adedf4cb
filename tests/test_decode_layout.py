"""The sampler's decode layout (`models.decode_layout`): the layers unrolled and q / k / v, gate / up
fused into one matmul each, built once per rollout; the same numbers as the training layout, the
matmul count of a decode step by hand, the automatic choice per backend, and the refusals."""
import collections
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import models, rollout
from marl_jax.models import attention, decode_layout, lora, params as params_lib
from marl_jax.models.config import SAMPLER_LAYOUTS, ModelConfig

import models_util
from train_util import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

VOCAB = 97
# Families whose projections differ: GQA with q / k / v biases (Qwen2), multi-head attention with
# biases everywhere and an ungated MLP (GPT-2), norms over the whole q / k projections (OLMo-2),
# per-head q / k norms and sliding windows (Gemma 3).
FAMILIES = {
    "qwen2": {},
    "gpt2": dict(num_kv_heads=4),
    "olmo2": {},
    "gemma3_text": dict(sliding_window=6, sliding_layers=(0, 2), query_pre_attn_scalar=16),
}


def _config(family="llama", **fields):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=128, eos_token_id=(1,), pad_token_id=0)
    return ModelConfig.for_family(family, **{**base, **FAMILIES.get(family, {}), **fields})


@functools.lru_cache(maxsize=None)
def _params(config):
    params = models.init_params(models.CausalLM(config), jax.random.key(0))
    # Nonzero biases and norm scales away from their init, so every leaf matters.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def _prompts(rows=4, width=9):
    ids = jax.random.randint(jax.random.key(2), (rows, width), 2, VOCAB)
    mask = jnp.asarray(np.arange(width)[None] >= np.array([0, 3, 5, 1][:rows])[:, None], jnp.int32)
    return ids, mask


def test_fused_params_hold_each_kv_groups_query_heads_then_its_key_and_value():
    config = _config("qwen2")
    params = _params(config)
    fused = params_lib.fuse_projections(params, config)
    layer, fused_layer = params["backbone"]["layers_1"], fused["backbone"]["layers_1"]
    assert set(fused_layer["attn"]) == {"qkv", "o"} and set(fused_layer["mlp"]) == {"gate_up", "down"}
    qkv = np.asarray(fused_layer["attn"]["qkv"]["kernel"])  # [D, K, G + 2, H]
    assert qkv.shape == (64, 2, 4, 16)
    q = np.asarray(layer["attn"]["q"]["kernel"])  # [D, N, H]: head n belongs to KV head n // G
    for head in range(4):
        np.testing.assert_array_equal(qkv[:, head // 2, head % 2], q[:, head])
    for kv_head in range(2):
        np.testing.assert_array_equal(qkv[:, kv_head, 2], layer["attn"]["k"]["kernel"][:, kv_head])
        np.testing.assert_array_equal(qkv[:, kv_head, 3], layer["attn"]["v"]["kernel"][:, kv_head])
        np.testing.assert_array_equal(fused_layer["attn"]["qkv"]["bias"][kv_head, 3], layer["attn"]["v"]["bias"][kv_head])
    np.testing.assert_array_equal(fused_layer["mlp"]["gate_up"]["kernel"][:, 0], layer["mlp"]["gate"]["kernel"])
    np.testing.assert_array_equal(fused_layer["mlp"]["gate_up"]["kernel"][:, 1], layer["mlp"]["up"]["kernel"])
    with pytest.raises(ValueError, match="fused already"):
        params_lib.fuse_projections(fused, config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_projections_compute_the_separate_ones_forward(family):
    ids, mask = _prompts()
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 2e-2)):
        config = _config(family, dtype=dtype)
        params = _params(config.replace(dtype="float32"))
        expected = models.CausalLM(config).apply({"params": params}, ids, mask)
        fused = models.CausalLM(config.replace(fused_projections=True)).apply(
            {"params": params_lib.fuse_projections(params, config)}, ids, mask)
        valid = np.asarray(mask, bool)
        np.testing.assert_allclose(np.asarray(fused)[valid], np.asarray(expected)[valid], atol=tolerance,
                                   rtol=tolerance)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("slots", [0, 2])
def test_every_layout_samples_the_training_layouts_tokens(temperature, slots):
    config = _config("qwen2", scan_layers=True)
    params = _params(config)
    ids, mask = _prompts()
    run = lambda layout: rollout.generate(models.CausalLM(config.replace(sampler_layout=layout)), params, ids, mask,
                                          row_keys=jax.random.split(jax.random.key(3), 4), max_new_tokens=24,
                                          temperature=temperature, eos_id=1, pad_id=0, decode_slots=slots)
    base = run("train")
    assert int(np.asarray(base.mask).sum(1).max()) > 12
    for layout in ("unrolled", "fused"):
        out = run(layout)
        np.testing.assert_array_equal(out.tokens, base.tokens)
        np.testing.assert_array_equal(out.mask, base.mask)
        np.testing.assert_allclose(out.logprobs, base.logprobs, atol=1e-6)


def test_bfloat16_fused_sampler_logprobs_within_bfloat16_of_the_training_layout():
    config = _config("llama", dtype="bfloat16", scan_layers=True)
    params = _params(config.replace(dtype="float32"))
    ids, mask = _prompts()
    run = lambda layout: rollout.generate(models.CausalLM(config.replace(sampler_layout=layout)), params, ids, mask,
                                          key=jax.random.key(3), max_new_tokens=16, temperature=0.0, eos_id=1,
                                          pad_id=0)
    base, fused = run("train"), run("fused")
    np.testing.assert_array_equal(fused.tokens, base.tokens)
    np.testing.assert_allclose(fused.logprobs, base.logprobs, atol=2e-2)


def _decode_step_text(config, batch=2, width=16):
    sampler_config, prepared = decode_layout.for_decoding(config, _params(config.replace(sampler_layout="auto")))
    sampler = models.CausalLM(sampler_config)
    step = jax.jit(lambda p, cache, tokens: sampler.apply(
        {"params": p}, tokens, jnp.ones((batch, width), jnp.int32), jnp.full((batch, 1), 3, jnp.int32), cache,
        jnp.int32(3), method=models.CausalLM.decode))
    return step.lower(prepared, models.init_cache(sampler_config, batch, width),
                      jnp.zeros((batch, 1), jnp.int32)).as_text()


def test_a_fused_decode_step_runs_four_projections_per_layer_and_no_layer_loop():
    # Per layer: q, k, v, o, gate, up, down and attention's two einsums; plus the LM head.
    config = _config("llama", scan_layers=True)
    scanned = _decode_step_text(config.replace(sampler_layout="train"))
    assert scanned.count("stablehlo.dot_general") == 9 + 1 and "stablehlo.while" in scanned
    unrolled = _decode_step_text(config.replace(sampler_layout="unrolled"))
    assert unrolled.count("stablehlo.dot_general") == 9 * 3 + 1 and "stablehlo.while" not in unrolled
    # qkv, o, gate_up, down and the two einsums.
    fused = _decode_step_text(config.replace(sampler_layout="fused"))
    assert fused.count("stablehlo.dot_general") == 6 * 3 + 1 and "stablehlo.while" not in fused


def test_auto_fuses_on_gpus_only_and_keeps_adapters_separate():
    config = _config("llama", scan_layers=True)
    assert decode_layout.resolve(config) == "train"  # this CPU
    with attention.target_platform("gpu"):
        assert decode_layout.resolve(config) == "fused"
        assert decode_layout.resolve(config.replace(lora_rank=4)) == "unrolled"
        assert decode_layout.resolve(config.replace(sampler_layout="train")) == "train"
    with attention.target_platform("tpu"):
        assert decode_layout.resolve(config) == "train"
        sampler_config, _ = decode_layout.for_decoding(config, _params(config))
        assert sampler_config is config
    with attention.target_platform("gpu"):
        sampler_config, prepared = decode_layout.for_decoding(config, _params(config))
    assert sampler_config == config.replace(scan_layers=False, fused_projections=True, sampler_layout="train")
    assert "layers_2" in prepared["backbone"] and "qkv" in prepared["backbone"]["layers_2"]["attn"]


def test_fused_layout_of_lora_params_with_the_adapters_off_samples_the_base_tokens():
    # A LoRA model built from its config: its params hold adapters (B nonzero: applied, they
    # change the tokens), and the policy with its adapters off, 4 query heads over 2 KV heads,
    # samples the base.
    config = _config("llama", lora_rank=4, scan_layers=True)
    params = _params(config)
    policy = lora.adapters_off(models.CausalLM(config))
    ids, mask = _prompts()
    kwargs = dict(row_keys=jax.random.split(jax.random.key(3), 4), max_new_tokens=16, temperature=0.8,
                  eos_id=1, pad_id=0)
    base_model = models.CausalLM(config.replace(lora_rank=0, sampler_layout="train"))
    expected = rollout.generate(base_model, lora.without_adapters(params), ids, mask, **kwargs)
    adapted = rollout.generate(models.CausalLM(config), params, ids, mask, **kwargs)
    assert not np.array_equal(adapted.tokens, expected.tokens)
    with attention.target_platform("gpu"):
        assert decode_layout.resolve(policy.config) == "fused"
        got = rollout.generate(policy, params, ids, mask, **kwargs)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-6)


def test_a_sampler_traced_for_the_host_takes_the_gpus_layout_inside_target_platform(monkeypatch):
    # The layouts each trace of the sampler chose, in order.
    chosen, resolve = [], decode_layout.resolve
    monkeypatch.setattr(decode_layout, "resolve", lambda config: chosen.append(resolve(config)) or chosen[-1])
    config = _config("llama", num_layers=1)
    params = _params(config)
    ids, mask = _prompts()
    run = lambda: rollout.generate(models.CausalLM(config), params, ids, mask, key=jax.random.key(5),
                                   max_new_tokens=4, temperature=0.7, eos_id=1, pad_id=0).tokens
    host = run()
    with attention.target_platform("gpu"):
        gpu = run()
    again = run()
    assert chosen == ["train", "fused"]  # the host's trace is reused by the host only
    np.testing.assert_array_equal(gpu, host)
    np.testing.assert_array_equal(again, host)


def _collectives(hlo_text):
    """The collective instructions of a compiled program, by kind."""
    return collections.Counter(re.findall(
        r"= [^=]*\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(", hlo_text))


def test_auto_on_a_gpu_keeps_the_projections_apart_where_kv_heads_do_not_divide_the_tensor_axis():
    import ml_collections

    from marl_jax.train import build, sharding

    # 8 query heads over 2 KV heads on a tensor axis of 4: the query heads split over it, the KV
    # heads do not.
    config = _config("llama", num_heads=8, num_kv_heads=2, head_dim=8, num_layers=2)
    params = models.init_params(models.CausalLM(config), jax.random.key(0))
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=1, tensor=4)))
    rules = sharding.logical_rules(mesh, build.model_dims(config))
    params = jax.device_put(params, build.param_shardings(models.CausalLM(config), mesh, build.abstract(params)))
    ids, mask = (jax.device_put(x, sharding.batch_sharding(mesh)) for x in _prompts())

    def collectives(layout):
        model = models.CausalLM(config.replace(sampler_layout=layout))
        sample = jax.jit(lambda p, i, m: rollout.generate(model, p, i, m, key=jax.random.key(3), max_new_tokens=6,
                                                          temperature=0.9, eos_id=1, pad_id=0).tokens)
        with sharding.mesh_context(mesh, rules), attention.target_platform("gpu"):
            return _collectives(sample.lower(params, ids, mask).compile().as_text())

    with attention.target_platform("gpu"):
        assert decode_layout.resolve(config, rules) == "unrolled"
        divisible = sharding.logical_rules(mesh, build.model_dims(config.replace(num_kv_heads=4)))
        assert decode_layout.resolve(config.replace(num_kv_heads=4), divisible) == "fused"
    training = collectives("train")
    assert training["all-reduce"] > 0
    assert collectives("auto") == training


def test_fused_layout_with_adapters_or_an_unknown_layout_is_one_line():
    from marl_jax import config_check

    assert config_check.SAMPLER_LAYOUTS == SAMPLER_LAYOUTS
    with pytest.raises(ValueError, match="ModelConfig.sampler_layout: fused projections take no LoRA adapters"):
        _config("llama", lora_rank=4, sampler_layout="fused")
    with pytest.raises(ValueError, match=r"ModelConfig.sampler_layout: 'fast' is not one of"):
        _config("llama", sampler_layout="fast")
    config = tiny_config(**{"model.sampler_layout": "fused", "model.lora.rank": 4})
    with pytest.raises(ValueError) as error:
        config_check.validate_config(config)
    assert str(error.value) == ("config.model.sampler_layout='fused': fused projections take no LoRA adapters: use "
                                "unrolled (or auto) with model.lora.rank > 0")


def test_compiled_ops_count_a_loop_body_per_trip():
    import bench_device

    text = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%f
  %add.2 = s32[] add(%i, %i)
  ROOT %t = (s32[], f32[4]{0}) tuple(%add.2, %fusion.1)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %custom-call.3 = f32[4]{0} custom-call(%a), custom_call_target="__cublas$gemm"
  %t0 = (s32[], f32[4]{0}) tuple(%a, %custom-call.3)
  %while.4 = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %r = f32[4]{0} get-tuple-element(%while.4), index=1
}
"""
    # The library call, then 7 trips of a fusion and an add.
    assert bench_device.compiled_ops(text) == 1 + 7 * 2


def test_fused_layout_of_sharded_scanned_params_samples_the_same_tokens():
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    config = _config("qwen2", scan_layers=True)
    params = _params(config)
    model = models.CausalLM(config)
    mesh, sharded = models_util.sharded_on_2x2x2(model, params)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
    ids, mask = _prompts()
    batch = NamedSharding(mesh, PartitionSpec("data"))
    kwargs = dict(key=jax.random.key(3), max_new_tokens=12, temperature=0.9, top_k=20, eos_id=1, pad_id=0)
    expected = rollout.generate(model, params, ids, mask, **kwargs)
    fused = models.CausalLM(config.replace(sampler_layout="fused"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(models_util.ACTIVATION_RULES):
        got = jax.jit(lambda p, i, m: rollout.generate(fused, p, i, m, **kwargs))(
            sharded, jax.device_put(ids, batch), jax.device_put(mask, batch))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-5)
