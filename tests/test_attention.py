"""Whole-sequence attention through `attention.attend`: every fused path equals the reference
einsums (outputs and gradients, float32 and bfloat16), the choice of path and its refusals, the
remat policies, and the matmul precision every dot is lowered with."""
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import config_check
from marl_jax import models, rollout
from marl_jax.models import attention, splash
from marl_jax.models.config import ModelConfig
from marl_jax.train import phases, ppo_types

from train_util import tiny_config

B, T, N, K, H = 2, 128, 4, 2, 32


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)) * 0.3, dtype)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    valid = np.ones((B, T), bool)
    valid[0, :37] = False  # left padding
    valid[1, -20:] = False  # right padding
    return q, k, v, jnp.asarray(valid)


def _mask(valid, window):
    slot = jnp.arange(T)
    distance = slot[:, None] - slot[None, :]
    mask = (distance >= 0)[None] & valid[:, None, :]
    return mask & (distance < window)[None] if window else mask


def _fused(implementation, q, k, v, valid, window, softcap):
    if implementation == "splash":
        return splash.attend(q, k, v, valid, softcap=softcap, window=window, interpret=True)
    config = ModelConfig.for_family("llama", vocab_size=8, hidden_size=N * H, intermediate_size=8, num_layers=1,
                                    num_heads=N, num_kv_heads=K, head_dim=H, max_position_embeddings=T,
                                    attention="xla", dtype=q.dtype.name)
    return attention.attend(q, k, v, _mask(valid, window), valid=valid, config=config, window=window)


def _reference(q, k, v, valid, window, softcap):
    return attention.reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), _mask(valid, window), softcap)


@pytest.mark.parametrize("implementation,window,softcap", [
    ("xla", None, None), ("xla", 48, None), ("splash", None, None), ("splash", 48, None), ("splash", None, 5.0)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_attention_equals_the_reference_on_valid_rows(implementation, window, softcap, dtype):
    q, k, v, valid = _inputs(jnp.dtype(dtype))
    rows = np.asarray(valid)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, N, H)), jnp.float32) * rows

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, valid, window, softcap).astype(jnp.float32) * weights)

    fused = functools.partial(_fused, implementation)
    out, ref = fused(q, k, v, valid, window, softcap), _reference(q, k, v, valid, window, softcap)
    grads = jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, _reference), argnums=(0, 1, 2))(q, k, v)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32) * rows, np.asarray(ref, np.float32) * rows, **tol)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **(tol if dtype == "float32" else dict(atol=1e-1, rtol=5e-2)))
    # The window and the cap are applied, not ignored: without them the reference differs.
    if window or softcap:
        plain = _reference(q, k, v, valid, None, None)
        assert float(jnp.abs((plain - ref).astype(jnp.float32) * rows).max()) > 1e-2


def _gqa_window_model(**fields):
    cfg = ModelConfig.for_family("mistral", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                                 sliding_window=6, sliding_layers=(0, 1), **fields)
    return models.build_model(cfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_forward_logits_take_the_same_values_through_xla_attention(dtype, scan_layers):
    """A GQA checkpoint whose sliding window (6) is shorter than its rows, left-padded: the
    logits of valid positions agree between the reference einsums and the fused XLA path."""
    reference = _gqa_window_model(dtype=dtype, attention="reference", scan_layers=scan_layers)
    fused = _gqa_window_model(dtype=dtype, attention="xla", scan_layers=scan_layers)
    params = models.init_params(reference, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (3, 20), 0, 64)
    mask = jnp.asarray(np.arange(20)[None] >= np.array([0, 5, 11])[:, None], jnp.int32)
    want = models.forward_logits(reference, params, ids, mask)
    got = models.forward_logits(fused, params, ids, mask)
    rows = np.asarray(mask, bool)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], **tol)
    # The window bites: a model without it gives other logits on the long rows.
    full = models.build_model(reference.config.replace(sliding_layers=(), sliding_window=None))
    assert np.abs(np.asarray(models.forward_logits(full, params, ids, mask))[rows]
                  - np.asarray(want)[rows]).max() > 1e-3


def test_attention_choice_per_backend_and_refusals():
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=32, max_position_embeddings=16)
    bf16 = ModelConfig.for_family("llama", dtype="bfloat16", **base)
    fp32 = ModelConfig.for_family("llama", dtype="float32", **base)
    assert attention.resolve(bf16, "cpu") == "reference"
    assert attention.resolve(bf16, "gpu") == "cudnn"
    assert attention.resolve(bf16, "tpu") == "splash"
    assert attention.resolve(fp32, "gpu") == "reference"  # float32 keeps the reference at its precision
    assert attention.resolve(fp32, "tpu") == "reference"
    capped = bf16.replace(attn_logit_softcap=30.0)
    assert attention.resolve(capped, "gpu") == "reference"  # cuDNN has no soft-cap
    assert attention.resolve(capped, "tpu") == "splash"  # splash has
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: .*float16"):
        attention.resolve(fp32.replace(attention="cudnn"), "gpu")
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: it needs an NVIDIA GPU"):
        attention.resolve(bf16.replace(attention="cudnn"), "cpu")
    with pytest.raises(ValueError, match=r"model.attention='splash' cannot run here: it needs a TPU"):
        attention.resolve(bf16.replace(attention="splash"), "cpu")
    with pytest.raises(ValueError, match=r"model.attention='xla' cannot run here: .*soft-capping"):
        attention.resolve(capped.replace(attention="xla"), "cpu")
    with attention.target_platform("gpu"):
        assert attention.resolve(bf16) == "cudnn"
        assert attention.describe(bf16).startswith("attention: cudnn (auto on gpu, bfloat16)")
    assert attention.describe(fp32, "cpu") == ("attention: reference (auto on cpu); matmul precision highest; "
                                               "remat none")
    with pytest.raises(ValueError, match="ModelConfig.remat: 'some' is not one of"):
        fp32.replace(remat="some")
    assert fp32.replace(remat=True).remat == "full" and fp32.replace(remat=False).remat == "none"
    with pytest.raises(ValueError, match="ModelConfig.matmul_precision"):
        fp32.replace(matmul_precision="tf32")
    assert bf16.precision == "default" and fp32.precision == "highest"
    assert fp32.replace(matmul_precision="high").precision == "high"


@pytest.mark.parametrize("field,value,needle", [
    ("model.remat", "sometimes", "must be one of ('none', 'full', 'dots', 'dots_no_batch') (True means full, False none)"),
    ("model.attention", "flash", "must be one of ('auto', 'reference', 'xla', 'cudnn', 'splash')"),
    ("model.matmul_precision", "tf32", "must be one of ('auto', 'default', 'high', 'highest')"),
])
def test_bad_numerics_settings_get_one_line(field, value, needle):
    section, name = field.split(".")
    config = tiny_config()
    config[section][name] = value
    with pytest.raises(ValueError) as error:
        config_check.validate_config(config)
    assert str(error.value) == f"config.{field}={value!r}: {needle}"


def test_cudnn_in_float32_is_refused_before_compiling():
    config = tiny_config()
    config.model.update(attention="cudnn", dtype="float32")
    with pytest.raises(ValueError, match=r"config.model.attention='cudnn': cuDNN's flash attention computes in "
                                         r"bfloat16 or float16 only"):
        config_check.validate_config(config)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(scan_layers):
    def loss_and_grads(remat):
        model = _gqa_window_model(remat=remat, scan_layers=scan_layers)
        params = models.init_params(_gqa_window_model(scan_layers=scan_layers), jax.random.key(0))
        ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
        mask = jnp.ones_like(ids).at[0, :3].set(0)

        def loss(p):
            logits = model.apply({"params": p}, ids, mask)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5] * mask)

        return jax.value_and_grad(loss)(params)

    want_loss, want_grads = loss_and_grads("none")
    for remat in ("full", "dots", "dots_no_batch"):
        got_loss, got_grads = loss_and_grads(remat)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


# ---- precision ----------------------------------------------------------------------------------
def _dot_precisions(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert lines, "no dot_general in the program"
    return [re.search(r"precision = \[(\w+), (\w+)\]", line).group(1) if "precision" in line else "DEFAULT"
            for line in lines]


def _programs(model, params):
    ids = jnp.ones((2, 8), jnp.int32)
    mask = jnp.ones_like(ids)
    cfg = model.config
    yield "forward_logits", jax.jit(functools.partial(models.forward_logits, model)).lower(params, ids, mask)
    sample = functools.partial(rollout.generate, model, max_new_tokens=4, temperature=0.8, eos_id=1, pad_id=0)
    yield "sampler", jax.jit(lambda p, i, m: sample(p, i, m, key=jax.random.key(0))).lower(params, ids, mask)
    score = lambda p: phases.score.token_logprobs(model, p, ids, mask, ids, mask, 0.8)[0]
    yield "token_logprobs", jax.jit(score).lower(params)
    assert cfg.precision in ("highest", "default")


def test_a_float32_model_lowers_every_dot_at_highest_precision():
    model = models.build_model(ModelConfig.for_family(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=64, eos_token_id=(1,)))
    params = models.init_params(model, jax.random.key(0))
    for name, lowered in _programs(model, params):
        precisions = _dot_precisions(lowered.as_text())
        assert set(precisions) == {"HIGHEST"}, (name, precisions)
    bf16 = models.build_model(model.config.replace(dtype="bfloat16"))
    for name, lowered in _programs(bf16, params):
        assert "HIGHEST" not in set(_dot_precisions(lowered.as_text())), name


def test_load_pretrained_defaults_to_highest_in_float32(tmp_path):
    from models_util import random_hf_model, write_checkpoint

    path = write_checkpoint(random_hf_model("llama_linear_tied"), tmp_path / "ckpt")
    model, _ = models.load_pretrained(path)
    assert model.config.precision == "highest" and model.config.attention == "auto"
    model, _ = models.load_pretrained(path, compute_dtype=jnp.bfloat16, attention="reference", remat=True)
    assert (model.config.precision, model.config.attention, model.config.remat) == ("default", "reference", "full")


def test_the_tpu_compiler_compiles_the_highest_precision_forward():
    """libtpu compiles (without running) the float32 forward at HIGHEST for a v5e chip."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                          chips_per_host_bounds=(1, 1, 1)).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    model = models.build_model(ModelConfig.for_family(
        "llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, max_position_embeddings=128))
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.key(0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params)
    ids = jax.ShapeDtypeStruct((4, 128), jnp.int32, sharding=sharding)
    lowered = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m)).lower(params, ids, ids)
    assert set(_dot_precisions(lowered.as_text())) == {"HIGHEST"}
    compiled = lowered.compile()
    # Highest precision on a TPU is several bfloat16 passes per float32 product: more work than
    # the default's single pass, as the compiler counts it.
    flops = compiled.cost_analysis()
    flops = flops[0] if isinstance(flops, list) else flops
    assert flops["flops"] > 0


def test_old_logprobs_auto_reuses_the_sampler_only_at_highest_float32():
    base = dict(batch_size=8, response_length=4, eos_id=0, pad_id=0, top_k=0)
    assert ppo_types.PPOStatic(**base).reuses_sampler_logprobs
    for precision in ("default", "high"):
        assert not ppo_types.PPOStatic(**base, matmul_precision=precision).reuses_sampler_logprobs
    assert ppo_types.PPOStatic(**base, matmul_precision="default", old_logprobs="sampler").reuses_sampler_logprobs
