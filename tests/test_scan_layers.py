"""Layers as one scan (`ModelConfig.scan_layers`): the same numbers as the unrolled decoder for every
family (forward, gradients with and without remat, KV-cache decoding through the sampler), stacked
params from and to transformers checkpoints, the "layers" logical axis, and a program whose size
does not grow with depth."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

import marl_jax.models as M
from marl_jax.models.heads import CausalLM
from marl_jax.rollout import generate
from marl_jax.train import sharding
import models_util
from models_util import CASES, hf_logits, padded_batch, random_hf_model, write_checkpoint, write_gguf

models_util.use_one_torch_thread()

# One case per family shape; Gemma-2's has three layers, sliding windows on layers 0 and 2 only,
# soft-caps; Gemma 3's a local rope base on its sliding layers and per-head q/k norms. (OLMo-2's
# post norms run scanned in the sharded train step below.)
FAMILY_CASES = {"llama": "llama_gqa_llama3_untied", "gemma": "gemma_mqa_head_dim",
                "gemma2": "gemma2_softcap_window", "qwen2": "qwen2_bias", "gpt2": "gpt2",
                "gemma3": "gemma3_local_global"}


def _is_spec(x):
    return isinstance(x, P)


def _assert_trees_equal(a, b, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        if atol:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _models(name):
    """(unrolled CausalLM, its params with every leaf perturbed, scanned CausalLM, stacked params)."""
    config = M.ModelConfig.from_hf(CASES[name])
    unrolled = M.CausalLM(config)
    params = M.init_params(unrolled, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), params)
    scanned = M.CausalLM(config.replace(scan_layers=True))
    return unrolled, params, scanned, M.stack_layers(params, config.num_layers)


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def family(request):
    return request.param, *_models(FAMILY_CASES[request.param])


# Numbers ---------------------------------------------------------------------------------------------

def test_gemma2_case_mixes_window_and_full_layers():
    config = M.ModelConfig.from_hf(CASES[FAMILY_CASES["gemma2"]])
    assert config.num_layers == 3 and config.sliding_layers == (0, 2) and config.sliding_window == 4
    assert config.attn_logit_softcap and config.final_logit_softcap


def test_scanned_logits_equal_unrolled(family):
    _, unrolled, params, scanned, stacked = family
    ids, mask = padded_batch([5, 9, 3, 12], 12, seed=2, right_pad=[2, 0, 4, 0])
    expected = np.asarray(M.forward_logits(unrolled, params, jnp.asarray(ids), jnp.asarray(mask)))
    got = np.asarray(M.forward_logits(scanned, stacked, jnp.asarray(ids), jnp.asarray(mask)))
    assert got.dtype == np.float32 and got.shape == expected.shape
    # float32 rounding accumulated through the layers: the two programs order their operations
    # differently (up to 1.5e-6 on logits of magnitude ~1 with XLA's CPU optimisations off).
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)


def test_scanned_params_match_a_fresh_scanned_init(family):
    _, _, _, scanned, stacked = family
    fresh = M.init_params(scanned, jax.random.key(3))
    assert jax.tree.structure(fresh) == jax.tree.structure(stacked)
    assert [x.shape for x in jax.tree.leaves(fresh)] == [x.shape for x in jax.tree.leaves(stacked)]
    layers = fresh["backbone"]["layers"]
    kernels = np.asarray(layers["mlp"]["down"]["kernel"])
    assert not np.array_equal(kernels[0], kernels[1]), "every layer needs its own random init"


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_gradients_equal_unrolled(family, remat):
    _, unrolled, params, scanned, stacked = family
    scanned = M.CausalLM(scanned.config.replace(remat=remat))
    ids, mask = padded_batch([6, 8], 8, seed=11, right_pad=[1, 0])
    weights = jnp.asarray(mask, jnp.float32)[..., None]

    def loss(model, p):
        logits = model.apply({"params": p}, jnp.asarray(ids), jnp.asarray(mask))
        return jnp.sum(weights * jax.nn.log_softmax(logits) ** 2) / jnp.sum(weights)

    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p)))(params)
    scanned_value, scanned_grads = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(stacked)
    np.testing.assert_allclose(scanned_value, value, rtol=1e-6)
    # Llama and Qwen2 come out bit-equal; elsewhere XLA fuses the loop body differently from the
    # unrolled layers, which moves float32 rounding (measured: at most 1.0e-6 of the largest gradient).
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    _assert_trees_equal(M.unstack_layers(scanned_grads), grads, atol=4e-6 * scale)


def _primitives(jaxpr):
    """(primitive name, params) of every equation, nested jaxprs (scan bodies, remat) included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, eqn.params
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _primitives(inner)


def test_program_size_does_not_grow_with_depth():
    """The point of scanning: one layer in the traced program, whatever `num_layers`."""
    base = M.ModelConfig.from_hf(CASES["gemma2_softcap_window"])
    ids = jnp.ones((2, 8), jnp.int32)

    def equations(**fields):
        model = M.CausalLM(base.replace(**fields))
        params = jax.eval_shape(lambda: M.init_params(model, jax.random.key(0)))
        grad = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids, ids)))
        return len(list(_primitives(jax.make_jaxpr(grad)(params).jaxpr)))

    deep = dict(num_layers=6, sliding_layers=(0, 2, 4))
    assert equations(scan_layers=True) == equations(scan_layers=True, **deep)
    assert equations(**deep) > 1.5 * equations()  # unrolled: 3 -> 6 layers


@pytest.mark.parametrize("remat", [False, True])
def test_remat_inside_the_scan_saves_nothing(remat):
    config = M.ModelConfig.from_hf(CASES["llama_gqa_llama3_untied"]).replace(scan_layers=True, remat=remat)
    model = M.CausalLM(config)
    params = M.init_params(model, jax.random.key(0))
    ids = jnp.ones((2, 4), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids, ids))))(params).jaxpr
    remats = [params for name, params in _primitives(jaxpr) if name in ("remat2", "checkpoint")]
    assert len(remats) == (1 if remat else 0)
    if remat:
        assert remats[0]["policy"] is jax.checkpoint_policies.nothing_saveable
        assert remats[0]["prevent_cse"] is False


# KV-cache decoding -----------------------------------------------------------------------------------

def test_stacked_cache_layout_and_prefill_equal_unrolled(family):
    _, unrolled, params, scanned, stacked = family
    config = scanned.config
    cache = M.init_cache(config, 3, 10)
    assert set(cache) == {"k", "v"}
    assert cache["k"].shape == (config.num_layers, 3, config.num_kv_heads, 10, config.head_dim)
    assert isinstance(M.init_cache(unrolled.config, 3, 10), list)
    ids, mask = padded_batch([2, 6, 4], 6, seed=8)
    kv_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((3, 4), jnp.int32)], axis=1)
    positions = M.positions_from_mask(jnp.asarray(mask))

    def prefill(model, p):
        return jax.jit(lambda p: model.apply({"params": p}, jnp.asarray(ids), kv_mask, positions,
                                             M.init_cache(model.config, 3, 10), 0, method=CausalLM.decode))(p)

    logits, layer_caches = prefill(unrolled, params)
    scanned_logits, scanned_cache = prefill(scanned, stacked)
    np.testing.assert_allclose(scanned_logits, logits, atol=1e-6, rtol=0)
    for name in ("k", "v"):
        # Keys of deeper layers carry the float32 rounding of the layers below, which the
        # normalisation of q/k norms (Gemma 3) scales up to ~1e-6 between the two compiled programs.
        np.testing.assert_allclose(scanned_cache[name], np.stack([c[name] for c in layer_caches]), atol=1e-5,
                                   rtol=0)
        np.testing.assert_array_equal(np.asarray(scanned_cache[name])[:, :, :, 6:], 0.0)


def test_decode_step_updates_the_stacked_cache_in_place():
    """A compiled decode step (one token, donated cache) holds no copy of the whole stacked cache:
    the layer scan writes the new slots into the carried stack instead."""
    config = M.ModelConfig.from_hf(CASES["llama_gqa_llama3_untied"]).replace(scan_layers=True, num_layers=4)
    model = M.CausalLM(config)
    params = M.init_params(model, jax.random.key(0))
    cache = M.init_cache(config, 4, 40)

    def step(params, cache, token, index):
        return model.apply({"params": params}, token, jnp.ones((4, 40), jnp.int32), jnp.full((4, 1), index),
                           cache, index, method=CausalLM.decode)

    hlo = jax.jit(step, donate_argnums=1).lower(params, cache, jnp.ones((4, 1), jnp.int32), 7).compile().as_text()
    stack = "f32[4,4,2,40,8]"
    assert stack in hlo
    assert not [line for line in hlo.splitlines() if " copy(" in line and stack in line]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.95)])
def test_sampling_from_scanned_model_equals_unrolled(family, sampling):
    _, unrolled, params, scanned, stacked = family
    ids, mask = (jnp.asarray(x) for x in padded_batch([2, 6, 4], 6, seed=8))
    kwargs = dict(key=jax.random.key(4), max_new_tokens=7, eos_id=95, pad_id=0, **sampling)
    expected = generate(unrolled, params, ids, mask, **kwargs)
    got = generate(scanned, stacked, ids, mask, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(expected.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-6, rtol=0)
    if sampling["temperature"]:
        assert len(set(np.asarray(got.tokens).ravel().tolist())) > 5, "sampling should not be degenerate"


def test_cache_of_the_other_layout_is_refused(family):
    _, unrolled, params, scanned, stacked = family
    ids = jnp.ones((1, 2), jnp.int32)
    for model, p, other in ((scanned, stacked, unrolled.config), (unrolled, params, scanned.config)):
        with pytest.raises(ValueError, match=rf"cache layout does not match config.scan_layers="
                                             rf"{model.config.scan_layers}; build the cache with init_cache"):
            model.apply({"params": p}, ids, jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                        M.init_cache(other, 1, 4), 0, method=CausalLM.decode)


# Stacking --------------------------------------------------------------------------------------------

def test_stack_unstack_round_trip_by_hand():
    config = M.ModelConfig.from_hf(CASES["llama_gqa_llama3_untied"])
    for model in (M.CausalLM(config), M.ScalarHeadModel(config, 0.5)):
        params = M.init_params(model, jax.random.key(2))
        stacked = M.stack_layers(params, config.num_layers)
        assert set(stacked) == set(params) and len(params) == 2
        assert sorted(stacked["backbone"]) == ["embed", "final_norm", "layers"]
        q = np.asarray(stacked["backbone"]["layers"]["attn"]["q"]["kernel"])
        assert q.shape == (2, 32, 4, 8)
        for i in range(2):
            np.testing.assert_array_equal(q[i], params["backbone"][f"layers_{i}"]["attn"]["q"]["kernel"])
        _assert_trees_equal(M.unstack_layers(stacked), params)
        _assert_trees_equal(jax.jit(M.unstack_layers)(jax.jit(M.stack_layers, static_argnums=1)(params, 2)), params)
        for key in set(params) - {"backbone"}:
            assert stacked[key] is params[key]


def test_stacking_errors_name_the_problem():
    config = M.ModelConfig.from_hf(CASES["gpt2"])
    params = M.init_params(M.CausalLM(config), jax.random.key(0))
    with pytest.raises(ValueError, match=r"must hold layers_0 \.\. layers_2 \(num_layers=3\), got \[0, 1\]"):
        M.stack_layers(params, 3)
    with pytest.raises(ValueError, match="got a stacked layers entry"):
        M.stack_layers(M.stack_layers(params, 2), 2)
    with pytest.raises(ValueError, match="has no stacked 'layers' entry"):
        M.unstack_layers(params)
    with pytest.raises(ValueError, match="a dict with 'backbone'"):
        M.stack_layers(params["backbone"], 2)


# Loading and saving ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def checkpoint(request, tmp_path_factory):
    hf = random_hf_model(FAMILY_CASES[request.param], seed=1)
    return hf, write_checkpoint(hf, tmp_path_factory.mktemp(request.param))


def test_load_pretrained_scanned_matches_transformers(checkpoint):
    hf, path = checkpoint
    model, params = M.load_pretrained(path, scan_layers=True)
    assert model.config.scan_layers and "layers" in params["backbone"]
    _, unrolled = M.load_pretrained(path)
    _assert_trees_equal(params, M.stack_layers(unrolled, model.config.num_layers))
    ids, mask = padded_batch([5, 9, 12], 12, seed=2, right_pad=[2, 0, 0])
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


def test_load_pretrained_scanned_in_bfloat16(checkpoint):
    _, path = checkpoint
    model, params = M.load_pretrained(path, dtype=jnp.bfloat16, scan_layers=True)
    _, unrolled = M.load_pretrained(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    _assert_trees_equal(params, M.stack_layers(unrolled, model.config.num_layers))


def test_save_pretrained_from_scanned_params(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    _, path = checkpoint
    model, params = M.load_pretrained(path, scan_layers=True)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
    perturbed = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), params)
    M.save_pretrained(model, perturbed, tmp_path / "scanned")
    unrolled_model = M.CausalLM(model.config.replace(scan_layers=False))
    M.save_pretrained(unrolled_model, M.unstack_layers(perturbed), tmp_path / "unrolled")
    scanned_state = safetensors.numpy.load_file(str(tmp_path / "scanned" / "model.safetensors"))
    unrolled_state = safetensors.numpy.load_file(str(tmp_path / "unrolled" / "model.safetensors"))
    assert sorted(scanned_state) == sorted(unrolled_state)
    for name, tensor in unrolled_state.items():
        np.testing.assert_array_equal(scanned_state[name], tensor)
    saved_config = json.loads((tmp_path / "scanned" / "config.json").read_text())
    assert saved_config == json.loads((tmp_path / "unrolled" / "config.json").read_text())
    assert "scan_layers" not in saved_config
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "scanned", attn_implementation="eager").eval()
    ids, mask = padded_batch([6, 9], 9, seed=8, right_pad=[1, 0])
    ours = np.asarray(M.forward_logits(model, perturbed, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2_bias", "gpt2"])  # GGUF metadata carries all of their config
def test_gguf_loads_scanned(name, tmp_path):
    hf = random_hf_model(name, seed=5)
    path = write_gguf(hf, tmp_path / "model.gguf")
    model, params = M.load_pretrained(path, scan_layers=True)
    _, unrolled = M.load_pretrained(path)
    _assert_trees_equal(params, M.stack_layers(unrolled, model.config.num_layers))
    ids, mask = padded_batch([4, 7], 7, seed=3)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


def test_scalar_head_scanned_load_and_save(tmp_path):
    from transformers import AutoModelForSequenceClassification

    hf = random_hf_model("qwen2_bias", seed=3, head="scalar")
    write_checkpoint(hf, tmp_path / "rm")
    model, params = M.load_pretrained(tmp_path / "rm", head="scalar", scan_layers=True)
    assert isinstance(model, M.ScalarHeadModel) and "layers" in params["backbone"] and "head" in params
    ids, mask = padded_batch([4, 8, 6], 10, seed=9, right_pad=[2, 0, 1])
    ids[mask == 0] = hf.config.pad_token_id
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)

    def reference(torch_model):
        with torch.no_grad():
            return torch_model(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                               position_ids=torch.as_tensor(positions)).logits[:, 0].numpy()

    scores = M.last_token_score(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)),
                                jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(scores), reference(hf), atol=1e-4)
    M.save_pretrained(model, params, tmp_path / "saved")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved",
                                                                  attn_implementation="eager").eval()
    np.testing.assert_allclose(reference(reloaded), reference(hf), atol=1e-6)


# Logical axes and sharding ---------------------------------------------------------------------------

def _mesh():
    return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def test_logical_axes_put_layers_first(family):
    _, unrolled, _, scanned, stacked = family
    axes = M.logical_axes(scanned)
    unrolled_axes = M.logical_axes(unrolled)
    assert jax.tree.structure(axes, is_leaf=_is_spec) == jax.tree.structure(stacked)
    layer_specs = jax.tree.leaves(axes["backbone"]["layers"], is_leaf=_is_spec)
    first_layer = jax.tree.leaves(unrolled_axes["backbone"]["layers_0"], is_leaf=_is_spec)
    assert len(layer_specs) == len(first_layer) > 0
    for spec, unrolled_spec in zip(layer_specs, first_layer):
        assert spec == P("layers", *unrolled_spec)
    for leaf, spec in zip(jax.tree.leaves(stacked), jax.tree.leaves(axes, is_leaf=_is_spec)):
        assert len(spec) == leaf.ndim
    others = {k: v for k, v in axes["backbone"].items() if k != "layers"}
    assert "layers" not in {name for spec in jax.tree.leaves(others, is_leaf=_is_spec) for name in spec}


def test_layers_axis_is_replicated_on_the_mesh(family):
    _, unrolled, _, scanned, stacked = family
    mesh = _mesh()
    assert sharding.logical_to_mesh_spec(P("layers", "embed"), mesh, (8, 32)) == P(None, "fsdp")
    shardings = sharding.logical_to_sharding(M.logical_axes(scanned), mesh, shapes=stacked)
    unrolled_shardings = sharding.logical_to_sharding(M.logical_axes(unrolled), mesh,
                                                      shapes=M.unstack_layers(stacked))
    layer = jax.tree.leaves(shardings["backbone"]["layers"])
    first = jax.tree.leaves(unrolled_shardings["backbone"]["layers_0"])
    for stacked_sharding, layer_sharding in zip(layer, first):
        spec = tuple(stacked_sharding.spec) + (None,) * 8
        assert spec[0] is None and spec[1:1 + len(layer_sharding.spec)] == tuple(layer_sharding.spec)
    assert any(not s.is_fully_replicated for s in layer), "some layer weights should be sharded"


@pytest.mark.parametrize("name", ["gemma2_softcap_window", "llama_gqa_llama3_untied"])
def test_sharded_scanned_forward_and_sampling(name):
    _, _, scanned, stacked = _models(name)
    mesh = _mesh()
    config = scanned.config
    shardings = sharding.logical_to_sharding(M.logical_axes(scanned), mesh, shapes=stacked)
    sharded = jax.device_put(stacked, shardings)
    ids, mask = (jnp.asarray(x) for x in padded_batch([2, 6, 4, 5], 6, seed=8))
    batch = NamedSharding(mesh, P(sharding.BATCH_AXES))
    kwargs = dict(key=jax.random.key(2), max_new_tokens=5, temperature=0.0, eos_id=95, pad_id=0)
    expected_logits = M.forward_logits(scanned, stacked, ids, mask)
    expected = generate(scanned, stacked, ids, mask, **kwargs)
    dims = {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "vocab": config.vocab_size,
            "mlp": config.intermediate_size, "embed": config.hidden_size}
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, dims)):
        logits = jax.jit(lambda p, i, m: scanned.apply({"params": p}, i, m))(
            sharded, jax.device_put(ids, batch), jax.device_put(mask, batch))
        sample = jax.jit(lambda p, i, m: generate(scanned, p, i, m, **kwargs))
        got = sample(sharded, jax.device_put(ids, batch), jax.device_put(mask, batch))
        hlo = sample.lower(sharded, ids, mask).as_text()
    assert "sharding_constraint" in hlo, name
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected_logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-5)


# Between them every part of the decoder the new families added: q/k norms per head and over the
# projection, norms after attention and MLP only, sliding windows with a local rope (Qwen3, Mistral
# and Phi-3 differ from these only in the key map or in which layers slide).
@pytest.mark.parametrize("name", ["gemma3_local_global", "olmo2_post_norms"])
def test_families_train_step_sharded_equals_single_device(name):
    """One remat-ed, scanned SGD step on a (data 2, fsdp 2, tensor 2) mesh of fake devices gives the
    single-device loss and parameters: q/k norms, post norms, windows and local ropes all shard."""
    _, _, scanned, stacked = _models(name)
    model = M.CausalLM(scanned.config.replace(remat=True))
    config = model.config
    ids, mask = (jnp.asarray(x) for x in padded_batch([9, 12, 5, 12], 12, seed=14))

    def step(params, ids, mask):
        def loss(p):
            logits = model.apply({"params": p}, ids, mask)[:, :-1]
            logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
            return -jnp.sum(logprobs * mask[:, 1:]) / jnp.sum(mask[:, 1:])

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    want_loss, want_params = jax.jit(step)(stacked, ids, mask)
    mesh = _mesh()
    shardings = sharding.logical_to_sharding(M.logical_axes(model), mesh, shapes=stacked)
    batch = NamedSharding(mesh, P(sharding.BATCH_AXES))
    dims = {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "vocab": config.vocab_size,
            "mlp": config.intermediate_size, "embed": config.hidden_size}
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, dims)):
        sharded_step = jax.jit(step, in_shardings=(shardings, batch, batch),
                               out_shardings=(sharding.replicated(mesh), shardings))
        loss, params = sharded_step(jax.device_put(stacked, shardings), jax.device_put(ids, batch),
                                    jax.device_put(mask, batch))
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
    np.testing.assert_allclose(float(loss), float(want_loss), atol=1e-5, rtol=0)
    assert float(jax.jit(step)(want_params, ids, mask)[0]) < float(want_loss)  # the step learns
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
