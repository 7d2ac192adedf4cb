"""Model layer: logits parity with transformers for every family, GGUF loading (SmolLM2),
save/load round trips through transformers, param-tree contracts, bad input."""
import json
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import marl_jax.models as M
from marl_jax.models.config import CAUSAL_LM_ARCHITECTURES
import models_util
import process_util
from models_util import CASES, VOCAB, hf_logits, padded_batch, random_hf_model, write_checkpoint, write_gguf

LOGICAL_PARAM_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", None}


def _valid(mask):
    return np.asarray(mask).astype(bool)


# Parity with transformers on tiny random checkpoints ---------------------------------------------

@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(case name, torch model, checkpoint dir, our model, our params)."""
    hf = random_hf_model(request.param, seed=1)
    path = write_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    model, params = M.load_pretrained(path)
    return request.param, hf, path, model, params


def test_logits_match_transformers_with_mixed_padding(case):
    name, hf, _, model, params = case
    # Rows: left-padded prompt + right-padded response, left-only, right-only, unpadded.
    ids, mask = padded_batch([5, 9, 3, 12], 12, seed=2, right_pad=[2, 0, 4, 0])
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    reference = hf_logits(hf, ids, mask)
    assert ours.dtype == np.float32 and ours.shape == (4, 12, VOCAB)
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], reference[valid], atol=1e-4, rtol=0)
    assert np.isfinite(ours).all(), f"{name}: padded query rows produced non-finite logits"


def test_fully_padded_row_is_finite_and_does_not_touch_other_rows(case):
    _, _, _, model, params = case
    ids, mask = padded_batch([4, 6], 6, seed=3)
    mask[0] = 0
    logits = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    alone = np.asarray(M.forward_logits(model, params, jnp.asarray(ids[1:]), jnp.asarray(mask[1:])))
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits[1], alone[0], atol=1e-5)


@pytest.mark.parametrize("options", [
    dict(beta_fast=8, beta_slow=2, truncate=False),
    dict(mscale=0.7, mscale_all_dim=1.3),
    dict(attention_factor=1.7),
])
def test_yarn_options_match_transformers(options, tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 16, **options}
    hf = random_hf_model("qwen2_yarn", seed=3, rope_parameters=rope, max_position_embeddings=128)
    model, params = M.load_pretrained(write_checkpoint(hf, tmp_path))
    ids, mask = padded_batch([30, 17], 30, seed=5)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,feature", [
    ("llama_gqa_llama3_untied", dict(rope_scaling=None)), ("llama_linear_tied", dict(rope_scaling=None)),
    ("qwen2_yarn", dict(rope_scaling=None)),
    ("gemma2_softcap_window", dict(sliding_layers=())), ("gemma2_softcap_window", dict(attn_logit_softcap=None)),
    ("gemma2_softcap_window", dict(final_logit_softcap=None)),
    ("gemma2_softcap_window", dict(query_pre_attn_scalar=None)),
    ("qwen3_window_head_dim", dict(sliding_layers=())), ("qwen3_window_head_dim", dict(qk_norm=None)),
    ("gemma3_local_global", dict(local_rope_theta=None)), ("gemma3_local_global", dict(sliding_layers=())),
    ("mistral_window_mqa", dict(sliding_layers=())), ("phi3_fused_window", dict(sliding_layers=())),
    ("olmo2_post_norms", dict(qk_norm=None))])
def test_each_feature_changes_logits_so_parity_covers_it(name, feature, tmp_path):
    model, params = M.load_pretrained(write_checkpoint(random_hf_model(name, seed=1), tmp_path))
    assert all(getattr(model.config, field) != value for field, value in feature.items())
    without = M.CausalLM(model.config.replace(**feature))
    ids, mask = padded_batch([12], 12, seed=4)
    a = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    b = np.asarray(M.forward_logits(without, params, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(a - b).max() > 1e-3


def test_bfloat16_compute_is_close_and_returns_float32(case):
    name, hf, path, _, _ = case
    model, params = M.load_pretrained(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    ids, mask = padded_batch([7, 10], 10, seed=5)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    reference = hf_logits(hf, ids, mask)
    assert ours.dtype == np.float32
    valid = _valid(mask)
    assert np.abs(ours[valid] - reference[valid]).mean() < 0.05, name


def test_rmsnorm_in_bfloat16_rounds_as_transformers_does():
    """In bfloat16, OLMo-2's RMSNorm multiplies by its weight in float32 and casts once; Llama's
    casts the normalised input, then multiplies in bfloat16. Each equals its transformers
    module bit for bit (the OLMo-2 q/k norms and post norms are this module too), and OLMo-2
    computed the Llama way is off by a bfloat16 rounding on a share of the outputs."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from marl_jax.models.decoder import Norm

    width = 96
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 9, width)) * 3.0, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(width,)), jnp.bfloat16)
    as_torch = lambda a: torch.tensor(np.asarray(a.astype(jnp.float32))).to(torch.bfloat16)
    for family, reference in (("olmo2", Olmo2RMSNorm), ("llama", LlamaRMSNorm)):
        cfg = M.ModelConfig.for_family(family, vocab_size=VOCAB, hidden_size=width,
                                       intermediate_size=64, num_layers=1, num_heads=4,
                                       num_kv_heads=2, head_dim=24, max_position_embeddings=64,
                                       dtype="bfloat16", param_dtype="bfloat16")
        ours = Norm(cfg).apply({"params": {"scale": w}}, x)
        assert ours.dtype == jnp.bfloat16
        norm = reference(width, eps=cfg.norm_eps).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(as_torch(w))
            theirs = norm(as_torch(x)).float().numpy()
        np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), theirs,
                                      err_msg=family)
        if family == "olmo2":
            llama_way = Norm(cfg.replace(norm_scale_in_float32=False)).apply(
                {"params": {"scale": w}}, x)
            assert np.mean(np.asarray(llama_way.astype(jnp.float32)) != theirs) > 0.05


def test_config_round_trips_through_hf_dict(case):
    _, hf, _, model, _ = case
    config = model.config
    assert M.ModelConfig.from_hf(config.to_hf()) == config
    from transformers import AutoConfig

    rebuilt = AutoConfig.for_model(**config.to_hf())
    assert M.ModelConfig.from_hf(rebuilt.to_dict()) == config
    assert rebuilt.to_dict().get("rope_parameters") == hf.config.to_dict().get("rope_parameters")


def test_save_pretrained_round_trip_through_transformers(case, tmp_path):
    name, _, _, model, params = case
    from transformers import AutoModelForCausalLM

    perturbed = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(7), x.shape, x.dtype), params)
    M.save_pretrained(model, perturbed, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [CAUSAL_LM_ARCHITECTURES[model.config.family]]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = padded_batch([6, 9], 9, seed=8, right_pad=[1, 0])
    ours = np.asarray(M.forward_logits(model, perturbed, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)
    _, reloaded = M.load_pretrained(tmp_path)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), perturbed, reloaded)


# Scalar heads ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "qwen2_bias"])
def test_scalar_head_reads_sequence_classification_checkpoint(name, tmp_path):
    import torch

    hf = random_hf_model(name, seed=3, head="scalar")
    write_checkpoint(hf, tmp_path)
    model, params = M.load_pretrained(tmp_path, head="scalar")
    assert isinstance(model, M.ScalarHeadModel)
    ids, mask = padded_batch([4, 8, 6], 10, seed=9, right_pad=[2, 0, 1])
    ids[mask == 0] = hf.config.pad_token_id  # transformers finds the last token through pad ids
    scores = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    ours = np.asarray(M.last_token_score(scores, jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        reference = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                       position_ids=torch.as_tensor(positions)).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4)


def test_scalar_head_save_round_trip_through_transformers(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    models_util.use_one_torch_thread()
    config = M.ModelConfig.from_hf(json.loads(json.dumps(CASES["llama_gqa_llama3_untied"])))
    model = M.ScalarHeadModel(config, M.reward_head_init_std(config))
    params = M.init_params(model, jax.random.key(0))
    M.save_pretrained(model, params, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and saved["num_labels"] == 1
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = padded_batch([5, 7], 9, seed=10, right_pad=[2, 0])
    ids[mask == 0] = config.pad_token_id
    ours = np.asarray(M.last_token_score(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)),
                                         jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        reference = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                       position_ids=torch.as_tensor(positions)).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    assert np.abs(ours).max() > 1e-2  # the reward-head init is not degenerate


def test_scalar_head_initialised_when_checkpoint_has_no_score(case):
    _, _, path, lm_model, lm_params = case
    model, params = M.load_pretrained(path, head="scalar", head_key=jax.random.key(3))
    std = 1 / np.sqrt(model.config.hidden_size + 1)
    assert model.head_init_std == pytest.approx(std)
    assert 0.3 * std < float(np.std(np.asarray(params["head"]["kernel"]))) < 3 * std
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params["backbone"], lm_params["backbone"])


def test_last_token_score_by_hand():
    scores = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    mask = jnp.asarray([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    np.testing.assert_array_equal(np.asarray(M.last_token_score(scores, mask)), [2.0, 7.0, 10.0])


# Checkpoint formats ---------------------------------------------------------------------------------

def test_sharded_checkpoint_with_index(tmp_path):
    hf = random_hf_model("qwen2_bias", seed=4)
    write_checkpoint(hf, tmp_path / "single")
    write_checkpoint(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    _, single = M.load_pretrained(tmp_path / "single")
    _, sharded = M.load_pretrained(tmp_path / "sharded")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, sharded)


def test_gemma3_attention_softcap_is_ignored_as_transformers_does(tmp_path):
    hf = random_hf_model("gemma3_local_global", seed=2, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    with pytest.warns(UserWarning, match=r"attn_logit_softcapping=2\.0 is ignored for gemma3_text"):
        model, params = M.load_pretrained(write_checkpoint(hf, tmp_path))
    assert model.config.attn_logit_softcap is None and model.config.final_logit_softcap == 3.0
    ids, mask = padded_batch([7, 12], 12, seed=3)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


def test_image_text_gemma3_checkpoint_reads_as_its_text_decoder(tmp_path):
    """Gemma 3 from 4B up is published as `Gemma3ForConditionalGeneration`: its language model
    loads (vision weights dropped, config completed with transformers' defaults) and gives the
    logits transformers gets from the whole model on text."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    models_util.use_one_torch_thread()
    torch.manual_seed(0)
    text = {k: v for k, v in CASES["gemma3_local_global"].items() if k != "model_type"}
    config = Gemma3Config(text_config=text, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14), mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94)
    config._attn_implementation = "eager"
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.1 * torch.randn_like(param))
    hf.save_pretrained(tmp_path)
    model, params = M.load_pretrained(tmp_path)
    assert model.config.family == "gemma3_text" and model.config.sliding_layers == (0, 2)
    ids, mask = padded_batch([7, 12], 12, seed=3)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return models_util.smollm2(smollm2_gguf)


def test_smollm2_gguf_config(smollm2):
    model, params, hf, _ = smollm2
    cfg = model.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert cfg.rope_theta == hf.config.rope_parameters["rope_theta"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert n_params == sum(p.numel() for p in hf.parameters())


def test_smollm2_gguf_logits_match_transformers(smollm2):
    model, params, hf, tokenizer = smollm2
    prompts = ["The capital of France is", "Once upon a time, in a land far, far away, there lived a",
               "def fibonacci(n):"]
    batch = tokenizer(prompts, padding=True, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    assert mask[:, 0].min() == 0 and mask[:, -1].all()  # left padding
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    reference = hf_logits(hf, ids, mask)
    valid = _valid(mask)
    assert np.abs(ours[valid] - reference[valid]).max() < 2e-3
    assert (ours[valid].argmax(-1) == reference[valid].argmax(-1)).mean() > 0.99


@pytest.mark.parametrize("name", ["qwen2_bias", "llama_gqa_llama3_untied"])
def test_tiny_gguf_reads_like_transformers(name, tmp_path):
    """A GGUF written in llama.cpp's layout (Llama q/k permuted) reads to the logits transformers
    gets from the same file."""
    from transformers import AutoModelForCausalLM

    write_gguf(random_hf_model(name, seed=3), tmp_path / "tiny.gguf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                     attn_implementation="eager").eval()
    model, params = M.load_pretrained(tmp_path / "tiny.gguf")
    ids, mask = padded_batch([5, 9], 10, seed=1, right_pad=[2, 0])
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(reference, ids, mask)[valid], atol=1e-4, rtol=0)
    # The metadata alone (what `bench.py memory` sizes a model by) gives the same config.
    from marl_jax.models.loading import gguf_config, read_gguf

    assert M.ModelConfig.from_hf(gguf_config(tmp_path / "tiny.gguf")) == model.config
    assert gguf_config(tmp_path / "tiny.gguf") == read_gguf(tmp_path / "tiny.gguf")[0]


# What a GGUF cannot say is llama.cpp's fixed choice, which these checkpoints then make too:
# Gemma 3's global layer every sixth, local rope base 10,000; Gemma-2 and 3's query scale
# head_dim ** -0.5; no sliding window for Qwen3.
GGUF_AS_LLAMA_CPP = {
    "gpt2": {}, "gemma_mqa_head_dim": {}, "olmo2_post_norms": {}, "phi3_fused_window": {},
    "gemma2_softcap_window": dict(query_pre_attn_scalar=8),
    "qwen3_window_head_dim": dict(use_sliding_window=False),
    "gemma3_local_global": dict(num_hidden_layers=7, layer_types=None, sliding_window_pattern=6, query_pre_attn_scalar=12,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 10000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("name", sorted(GGUF_AS_LLAMA_CPP))
def test_gguf_reads_back_the_original_weights(name, tmp_path):
    """transformers reads neither Gemma-1 GGUFs, GPT-2 GGUFs of non-default context length nor
    OLMo-2 GGUFs, and gives Qwen3 and Gemma 3 files fixed head sizes, so the reference here is the
    checkpoint the file was written from, in llama.cpp's layout (GPT-2's Conv1D weights as
    [out, in], Gemma's RMSNorm weights as 1 + w, Phi-3's fused projections, windows on every
    sixth-but-one Gemma 3 layer)."""
    original = random_hf_model(name, seed=3, **GGUF_AS_LLAMA_CPP[name])
    model, params = M.load_pretrained(write_gguf(original, tmp_path / "tiny.gguf"))
    ids, mask = padded_batch([5, 9], 10, seed=1, right_pad=[2, 0])
    assert model.config.family == original.config.model_type
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(original, ids, mask)[valid], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def smollm2_reference_tokenizer(smollm2_gguf):
    """transformers' own tokenizer of the SmolLM2 GGUF (its GGUF reader needs torch)."""
    from transformers import AutoTokenizer

    with models_util.transformers_reads_gguf_fast():
        return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_gguf_metadata_and_tensors_read_as_the_gguf_package_reads_them(smollm2_gguf):
    """The tokenizer's metadata reader and the plain-array reader the loader opens files with
    against the `gguf` package's own reader of the real SmolLM2 file."""
    import gguf

    from marl_jax.models.loading import gguf_reader
    from marl_jax.models.tokenizer import _gguf_metadata

    package, plain = gguf.GGUFReader(str(smollm2_gguf)), gguf_reader(smollm2_gguf)
    assert type(plain.data) is np.ndarray and isinstance(package.data, np.memmap)
    contents = {key: field.contents() for key, field in package.fields.items()}
    assert {key: field.contents() for key, field in plain.fields.items()} == contents
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in plain.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in package.tensors]
    for ours, theirs in zip(plain.tensors, package.tensors):
        np.testing.assert_array_equal(ours.data, theirs.data)
    want = {key: value for key, value in contents.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}
    assert len(want["tokenizer.ggml.tokens"]) == 49152 and "tokenizer.chat_template" in want
    assert _gguf_metadata(smollm2_gguf) == want


def test_gguf_tokenizer_matches_transformers(smollm2, smollm2_reference_tokenizer):
    """Ours (built with the `tokenizers` library) against transformers' own GGUF tokenizer of the
    same file, on 1,000 strings; the chat template and special tokens as the file gives them."""
    ours, reference = smollm2[3], smollm2_reference_tokenizer
    models_util.assert_same_tokenizer(ours, reference, models_util.tokenizer_probe_texts())
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (2, 2, 1)
    assert ours.padding_side == "left"


# A chat prompt of SmolLM2-135M-Instruct (Q4_1 GGUF) as transformers tokenizes it, and the five
# largest logits transformers computes at two of its positions from the same file
# (test_recorded_smollm2_numbers_are_transformers recomputes them).
SMOLLM2_CHAT = [{"role": "user", "content": "Name a colour of the sky."}]
SMOLLM2_CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                    411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 5820, 253, 7302, 282, 260, 6376, 30,
                    2, 198, 1, 520, 9531, 198]
SMOLLM2_TOP_LOGITS = {
    5: ([7952, 33011, 5356, 3269, 12833], [13.9545, 13.8096, 13.3615, 13.2007, 13.0122]),
    36: ([504, 49, 788, 57, 2122], [31.6584, 29.9516, 28.8227, 28.3008, 27.9665]),
}


def _assert_smollm2_numbers(tokenizer, logits_of):
    ids = tokenizer(tokenizer.apply_chat_template(SMOLLM2_CHAT, add_generation_prompt=True,
                                                  tokenize=False))["input_ids"]
    assert ids == SMOLLM2_CHAT_IDS
    assert tokenizer.decode(ids).endswith("Name a colour of the sky.<|im_end|>\n<|im_start|>assistant\n")
    logits = logits_of(np.asarray([ids], np.int32))[0]
    for position, (top_ids, top_values) in SMOLLM2_TOP_LOGITS.items():
        assert np.argsort(-logits[position])[:5].tolist() == top_ids
        np.testing.assert_allclose(logits[position, top_ids], top_values, atol=2e-3)


NO_TORCH_SCRIPT = """
import sys
sys.modules["torch"] = None  # `import torch` fails
import jax, jax.numpy as jnp, numpy as np
import marl_jax.models as M
from marl_jax import rollout
import test_models

def logits_of(model, params):
    return lambda ids: np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))

gguf, export = sys.argv[1], sys.argv[2]
tokenizer = M.load_tokenizer(gguf)
model, params = M.load_pretrained(gguf)
test_models._assert_smollm2_numbers(tokenizer, logits_of(model, params))
M.save_pretrained(model, params, export)
tokenizer.save_pretrained(export)
model, params = M.load_pretrained(export)
test_models._assert_smollm2_numbers(M.load_tokenizer(export), logits_of(model, params))
ids = jnp.asarray([test_models.SMOLLM2_CHAT_IDS], jnp.int32)
out = rollout.generate(model, params, ids, jnp.ones_like(ids), key=jax.random.key(0), max_new_tokens=3,
                       temperature=0.0, eos_id=2, pad_id=2)
assert np.asarray(out.tokens)[0, 0] == test_models.SMOLLM2_TOP_LOGITS[36][0][0]
print("ok")
"""


@pytest.mark.smoke
def test_smollm2_gguf_and_its_hf_export_load_with_their_tokenizers_without_torch(smollm2_gguf, tmp_path):
    """With torch unimportable: the GGUF file, then the transformers directory exported from it
    (safetensors + tokenizer files), each with its tokenizer, give transformers' token ids and
    logits; the sampler's greedy first token is the top logit."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {process_util.FAST_XLA}",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parent), *filter(None, [
               os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(smollm2_gguf), str(tmp_path / "export")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_recorded_smollm2_numbers_are_transformers(smollm2, smollm2_reference_tokenizer):
    _assert_smollm2_numbers(smollm2_reference_tokenizer,
                            lambda ids: hf_logits(smollm2[2], ids, np.ones_like(ids)))


# Param-tree contracts --------------------------------------------------------------------------------

def _structure(tree):
    return jax.tree_util.tree_structure(tree)


def test_param_trees_and_logical_axes(case):
    _, _, _, model, params = case
    fresh = M.init_params(model, jax.random.key(0))
    assert not any(isinstance(x, nn.meta.AxisMetadata) for x in
                   jax.tree.leaves(fresh, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))
    assert _structure(fresh) == _structure(params)
    axes = M.logical_axes(model)
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert jax.tree_util.tree_structure(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == \
        _structure(params)
    for spec, leaf in zip(specs, jax.tree.leaves(params)):
        assert len(spec) == leaf.ndim and set(spec) <= LOGICAL_PARAM_NAMES
    assert ("lm_head" in params) == (not model.config.tie_word_embeddings)
    scalar = M.ScalarHeadModel(model.config, 0.0)
    scalar_params = M.init_params(scalar, jax.random.key(1))
    assert set(scalar_params) == {"backbone", "head"}
    assert _structure(scalar_params["backbone"]) == _structure(params["backbone"])
    values = scalar.apply({"params": scalar_params}, jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32))
    np.testing.assert_array_equal(np.asarray(values), 0.0)  # value head starts at exactly zero


@pytest.mark.parametrize("name", ["gpt2", "gemma2_softcap_window"])
def test_remat_gives_same_loss_and_gradients(name):
    model = M.CausalLM(M.ModelConfig.from_hf(CASES[name]))
    params = M.init_params(model, jax.random.key(0))
    ids, mask = padded_batch([6, 8], 8, seed=11)
    remat_model = M.CausalLM(model.config.replace(remat=True))

    def loss(m, p):
        return jnp.mean(m.apply({"params": p}, jnp.asarray(ids), jnp.asarray(mask)) ** 2)

    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(model, p)))(params)
    remat_value, remat_grads = jax.jit(jax.value_and_grad(lambda p: loss(remat_model, p)))(params)
    np.testing.assert_allclose(value, remat_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, remat_grads)


# Bad input -------------------------------------------------------------------------------------------

def _copy_checkpoint(source, target: pathlib.Path, *, edit_state=None, edit_config=None):
    target.mkdir()
    config = json.loads((pathlib.Path(source) / "config.json").read_text())
    state = safetensors.numpy.load_file(str(pathlib.Path(source) / "model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_state:
        edit_state(state)
    (target / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(state, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return write_checkpoint(random_hf_model("llama_gqa_llama3_untied", seed=6), tmp_path_factory.mktemp("llama"))


def test_unsupported_architecture_lists_families(llama_checkpoint, tmp_path):
    path = _copy_checkpoint(llama_checkpoint, tmp_path / "x", edit_config=lambda c: c.update(model_type="falcon"))
    with pytest.raises(ValueError, match=r"'falcon'.*supported families.*gpt2.*llama.*gemma.*qwen3.*phi3"):
        M.load_pretrained(path)
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported; supported: .*gemma3"):
        M.load_pretrained(tmp_path / "mamba.gguf")
    with pytest.raises(ValueError, match="supported families"):
        M.ModelConfig.for_family("mamba", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                                 num_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=8)


@pytest.mark.parametrize("name,fields,message", [
    ("qwen3_window_head_dim", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     r"rope type 'dynamic' is not supported; supported: \('default', 'linear', 'llama3', 'yarn'\)"),
    ("gemma3_local_global", dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types has 2 entries for num_hidden_layers=3; one per layer is supported"),
    ("gemma3_local_global", dict(layer_types=None, sliding_window_pattern=0),
     r"sliding_window_pattern=0 is not supported: a positive int"),
    ("gemma3_local_global", dict(layer_types=["chunked_attention"] * 3),
     r"layer_types \['chunked_attention'\] are not supported; supported: \('full_attention', 'sliding_attention'\)"),
    ("gemma3_local_global", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     r"sliding_attention rope type 'linear' is not supported; supported: \('default',\)"),
    ("gemma3_local_global", dict(use_bidirectional_attention=True),
     r"use_bidirectional_attention=True is not supported: bidirectional attention"),
    ("phi3_fused_window", dict(partial_rotary_factor=0.5),
     r"partial_rotary_factor=0.5 is not supported: rotary embeddings cover the whole head"),
    ("phi3_fused_window", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 6,
                                                "long_factor": [2.0] * 6}),
     r"rope type 'longrope' is not supported; supported:"),
])
def test_config_fields_the_decoder_cannot_honour_are_named(name, fields, message, llama_checkpoint, tmp_path):
    """One line naming the checkpoint, the field and what is supported (never wrong logits)."""
    def replace(config):
        config.clear()
        config.update({**CASES[name], **fields})

    path = _copy_checkpoint(llama_checkpoint, tmp_path / "bad", edit_config=replace)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: config\.json .*{message}") as raised:
        M.load_pretrained(path)
    assert "\n" not in str(raised.value)


def test_missing_weight_is_named(llama_checkpoint, tmp_path):
    path = _copy_checkpoint(llama_checkpoint, tmp_path / "x",
                            edit_state=lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        M.load_pretrained(path)
    path = _copy_checkpoint(llama_checkpoint, tmp_path / "y", edit_state=lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing weights: lm_head\.weight"):
        M.load_pretrained(path)


def test_unexpected_weight_is_named(llama_checkpoint, tmp_path):
    def add(state):
        state["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)

    path = _copy_checkpoint(llama_checkpoint, tmp_path / "x", edit_state=add)
    with pytest.raises(ValueError, match=r"unexpected weights: model\.layers\.0\.self_attn\.q_norm\.weight"):
        M.load_pretrained(path)


def test_wrong_shape_is_named(llama_checkpoint, tmp_path):
    path = _copy_checkpoint(llama_checkpoint, tmp_path / "x", edit_config=lambda c: c.update(intermediate_size=40))
    with pytest.raises(ValueError, match=r"wrong shape: backbone/layers_0/mlp/\w+/kernel"):
        M.load_pretrained(path)


def test_bad_paths_and_arguments(llama_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model directory nor a .gguf"):
        M.load_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        M.load_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="head must be one of"):
        M.load_pretrained(llama_checkpoint, head="value")
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        M.ModelConfig.for_family("llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                                 num_heads=6, num_kv_heads=4, head_dim=8, max_position_embeddings=8)
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        M.ModelConfig.from_hf({**CASES["llama_linear_tied"], "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"rope scaling 'yarn' misses \['original_max_position_embeddings'\]"):
        M.ModelConfig.from_hf({**CASES["llama_linear_tied"], "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


def test_token_ids_outside_vocabulary(case):
    _, _, _, model, params = case
    ids = np.full((1, 3), 1, np.int32)
    ids[0, 1] = VOCAB
    with pytest.raises(ValueError, match=rf"input_ids holds token id {VOCAB} outside the vocabulary \[0, {VOCAB}\)"):
        M.forward_logits(model, params, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids)))
    with pytest.raises(ValueError, match="attention_mask shape"):
        M.forward_logits(model, params, jnp.ones((1, 3), jnp.int32), jnp.ones((1, 4), jnp.int32))


@pytest.mark.parametrize("name,token_ids,expected", [
    # Some published Llama configs say pad_token_id=-1 (torch's embedding takes a negative padding
    # index); ids past the vocabulary load in transformers with a warning too.
    ("llama_linear_tied", dict(bos_token_id=70, eos_token_id=[2, 99], pad_token_id=-1),
     dict(bos_token_id=None, eos_token_id=(2,), pad_token_id=None)),
    ("gpt2", dict(bos_token_id=3, eos_token_id=100, pad_token_id=100),
     dict(bos_token_id=3, eos_token_id=(), pad_token_id=None)),
])
def test_checkpoint_token_ids_outside_vocabulary_load_unset(name, token_ids, expected, tmp_path):
    hf = random_hf_model(name, seed=12, vocab_size=64, **token_ids)
    path = write_checkpoint(hf, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == token_ids["pad_token_id"]
    with pytest.warns(UserWarning) as record:
        model, params = M.load_pretrained(path)
    messages = sorted(str(w.message) for w in record if str(w.message).startswith("config.json"))
    wanted = {
        "llama_linear_tied": [
            "config.json bos_token_id=70 lies outside the vocabulary [0, 64); bos_token_id is left unset",
            "config.json eos_token_id=99 lies outside the vocabulary [0, 64); 99 is dropped from eos_token_id",
            "config.json pad_token_id=-1 lies outside the vocabulary [0, 64); pad_token_id is left unset"],
        "gpt2": [
            "config.json eos_token_id=100 lies outside the vocabulary [0, 64); 100 is dropped from eos_token_id",
            "config.json pad_token_id=100 lies outside the vocabulary [0, 64); pad_token_id is left unset"],
    }[name]
    assert messages == wanted
    assert {field: getattr(model.config, field) for field in expected} == expected
    ids, mask = padded_batch([5, 8], 8, seed=13, vocab=64)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = _valid(mask)
    np.testing.assert_allclose(ours[valid], hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"token id 100 is outside the vocabulary \[0, 64\)"):
        model.config.replace(pad_token_id=100)  # a config built in code is still checked strictly
