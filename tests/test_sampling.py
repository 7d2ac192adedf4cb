"""Sampler: greedy parity with transformers on SmolLM2, the sampled distribution under temperature /
top-k / top-p, logprobs against a separate forward pass, EOS handling, jit / sharding, bad input."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.sharding import NamedSharding, PartitionSpec

import marl_jax.models as M
from marl_jax.rollout import SampleOutput, generate
import models_util
from models_util import padded_batch, random_hf_model, write_checkpoint


def reference_filtered_logprobs(logits, temperature, top_k, top_p):
    """Log-probabilities of the filtered next-token distribution, written independently of the
    sampler: scale, keep the top_k largest, then the smallest prefix (by descending probability)
    whose mass reaches top_p. logits `[V]` -> `[V]` (-inf where filtered)."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.shape, bool)
    keep[order[:top_k] if top_k else order] = True
    kept = order[keep[order]]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep[:] = False
    keep[kept[mass_before < top_p]] = True
    out = np.full(scaled.shape, -np.inf)
    z = scaled[keep].max() + np.log(np.exp(scaled[keep] - scaled[keep].max()).sum())
    out[keep] = scaled[keep] - z
    return out


# Tiny models ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama (GQA, vocab 96) with prompts of different lengths, left-padded."""
    model, params = M.load_pretrained(write_checkpoint(random_hf_model("llama_gqa_llama3_untied", seed=2),
                                                       tmp_path_factory.mktemp("tiny")))
    ids, mask = padded_batch([3, 7, 5, 1], 7, seed=3)
    return model, params, jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def eight_token_model():
    """A random model over an 8-token vocabulary with a spread-out next-token distribution."""
    config = M.ModelConfig.for_family("llama", vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1,
                                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=16,
                                      initializer_range=0.2)
    model = M.CausalLM(config)
    return model, M.init_params(model, jax.random.key(4))


def _filtered_reference(model, params, ids, mask, out, temperature, top_k, top_p):
    """Per generated token, the reference filtered log-probabilities from one forward pass over
    prompt + response. Returns `[B, N, V]`."""
    full_ids = jnp.concatenate([ids, out.tokens], axis=1)
    full_mask = jnp.concatenate([mask, out.mask], axis=1)
    logits = np.asarray(M.forward_logits(model, params, full_ids, full_mask))
    prompt_len, steps = ids.shape[1], out.tokens.shape[1]
    step_logits = logits[:, prompt_len - 1: prompt_len - 1 + steps]
    if temperature == 0:
        return np.asarray(jax.nn.log_softmax(step_logits))
    return np.stack([[reference_filtered_logprobs(step_logits[b, t], temperature, top_k, top_p)
                      for t in range(steps)] for b in range(step_logits.shape[0])])


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.9, 0, 1.0), (1.3, 10, 1.0),
                                                     (0.8, 0, 0.7), (1.0, 20, 0.9)])
def test_logprobs_match_a_separate_forward_pass(tiny, temperature, top_k, top_p):
    model, params, ids, mask = tiny
    out = generate(model, params, ids, mask, key=jax.random.key(5), max_new_tokens=6, temperature=temperature,
                   top_k=top_k, top_p=top_p, eos_id=1, pad_id=0)
    assert isinstance(out, SampleOutput)
    assert out.tokens.shape == out.logprobs.shape == out.mask.shape == (4, 6)
    reference = _filtered_reference(model, params, ids, mask, out, temperature, top_k, top_p)
    valid = np.asarray(out.mask).astype(bool)
    tokens = np.asarray(out.tokens)
    chosen = np.take_along_axis(reference, tokens[..., None], axis=-1)[..., 0]
    assert np.isfinite(chosen[valid]).all(), "a sampled token lies outside the filtered set"
    np.testing.assert_allclose(np.asarray(out.logprobs)[valid], chosen[valid], atol=2e-5)
    if temperature == 0:
        np.testing.assert_array_equal(tokens[valid], reference.argmax(-1)[valid])


@pytest.mark.parametrize("name", sorted(models_util.CASES))
def test_cache_path_matches_full_forward_for_every_family(name, tmp_path):
    """Greedy decoding through the KV cache equals argmax / log-softmax of one full forward pass
    (learned positions, embedding scaling, biases, MQA/GQA all go through the cache path)."""
    model, params = M.load_pretrained(write_checkpoint(random_hf_model(name, seed=7), tmp_path))
    ids, mask = (jnp.asarray(x) for x in padded_batch([2, 6, 4], 6, seed=8))
    out = generate(model, params, ids, mask, key=jax.random.key(0), max_new_tokens=5, temperature=0.0,
                   eos_id=95, pad_id=0)
    reference = _filtered_reference(model, params, ids, mask, out, 0.0, 0, 1.0)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, reference.argmax(-1))
    chosen = np.take_along_axis(reference, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), chosen, atol=2e-5)


# Every family with a sliding window (4) or a local rope, and a Llama 3.2-style one (llama3 rope).
WINDOWED_CASES = ["gemma2_softcap_window", "gemma3_local_global", "llama_gqa_llama3_untied", "mistral_window_mqa",
                  "olmo2_post_norms", "phi3_fused_window", "qwen3_window_head_dim"]


@pytest.mark.parametrize("name", WINDOWED_CASES)
def test_greedy_matches_transformers_generate_past_the_window(name, tmp_path):
    """20 greedy tokens after left-padded prompts longer than the window equal transformers'
    `generate` (its own cache, sliding-window layers included)."""
    import torch

    hf = random_hf_model(name, seed=9)
    model, params = M.load_pretrained(write_checkpoint(hf, tmp_path))
    ids, mask = padded_batch([7, 10], 10, seed=10)
    steps, eos, pad = 20, 1, 0
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), key=jax.random.key(0),
                   max_new_tokens=steps, temperature=0.0, eos_id=eos, pad_id=pad)
    with torch.no_grad():
        reference = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                                attention_mask=torch.as_tensor(mask, dtype=torch.long), max_new_tokens=steps,
                                min_new_tokens=0, do_sample=False, eos_token_id=eos,
                                pad_token_id=pad)[:, ids.shape[1]:].numpy()
    reference = np.pad(reference, ((0, 0), (0, steps - reference.shape[1])), constant_values=pad)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)
    assert np.asarray(out.mask).sum(1).max() > 4, "decoding should run past the window"


@pytest.mark.smoke
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.6),
                                                     (1.2, 5, 0.8)])
def test_first_token_distribution(eight_token_model, temperature, top_k, top_p):
    model, params = eight_token_model
    samples = 4000
    ids = jnp.tile(jnp.asarray([[3, 5, 7]], jnp.int32), (samples, 1))
    mask = jnp.ones_like(ids)
    out = generate(model, params, ids, mask, key=jax.random.key(6), max_new_tokens=1, temperature=temperature,
                   top_k=top_k, top_p=top_p, eos_id=0, pad_id=0)
    logits = np.asarray(M.forward_logits(model, params, ids[:1], mask[:1]))[0, -1]
    expected = np.exp(reference_filtered_logprobs(logits, temperature, top_k, top_p))
    counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=8)
    kept = expected > 0
    assert 1 < kept.sum() < 8 or (top_k == 0 and top_p == 1.0), "the setting should filter something"
    assert counts[~kept].sum() == 0, "tokens outside the top-k / top-p set were sampled"
    observed, wanted = counts[kept], samples * expected[kept]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    p_value = float(scipy.special.gammaincc((kept.sum() - 1) / 2, chi2 / 2))
    assert p_value > 1e-3, (counts, wanted)
    assert 0.5 * np.abs(counts / samples - expected).sum() < 0.03


def test_eos_stops_rows_and_pads(tiny):
    model, params, ids, mask = tiny
    free = generate(model, params, ids, mask, key=jax.random.key(0), max_new_tokens=8, temperature=0.0,
                    eos_id=95, pad_id=0)
    free_tokens = np.asarray(free.tokens)
    eos = (int(free_tokens[0, 2]), int(free_tokens[1, 4]))
    out = generate(model, params, ids, mask, key=jax.random.key(0), max_new_tokens=8, temperature=0.0,
                   eos_id=eos, pad_id=0)
    tokens, logprobs, out_mask = (np.asarray(x) for x in (out.tokens, out.logprobs, out.mask))
    for row in range(4):
        hits = np.flatnonzero(np.isin(free_tokens[row], eos))
        length = hits[0] + 1 if hits.size else 8
        np.testing.assert_array_equal(tokens[row, :length], free_tokens[row, :length])
        np.testing.assert_array_equal(out_mask[row], np.arange(8) < length)
        np.testing.assert_array_equal(tokens[row, length:], 0)
        np.testing.assert_array_equal(logprobs[row, length:], 0.0)
        np.testing.assert_allclose(logprobs[row, :length], np.asarray(free.logprobs)[row, :length], atol=1e-6)
    assert out_mask[0].sum() <= 3 and out_mask[1].sum() <= 5


def test_all_rows_stopping_ends_the_loop_cleanly(tiny):
    model, params, ids, mask = tiny
    first = np.asarray(generate(model, params, ids, mask, key=jax.random.key(0), max_new_tokens=5,
                                temperature=0.0, eos_id=95, pad_id=0).tokens)[:, 0]
    out = generate(model, params, ids, mask, key=jax.random.key(0), max_new_tokens=5, temperature=0.0,
                   eos_id=tuple(int(t) for t in set(first.tolist())), pad_id=0)
    np.testing.assert_array_equal(np.asarray(out.mask), np.eye(5, dtype=np.int32)[[0] * 4])
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], first)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 1:], 0)


def test_inside_jit_with_traced_temperature(tiny):
    model, params, ids, mask = tiny

    @jax.jit
    def rollout(params, temperature, key):
        return generate(model, params, ids, mask, key=key, max_new_tokens=5, temperature=temperature, top_k=10,
                        top_p=0.9, eos_id=1, pad_id=0)

    key = jax.random.key(9)
    greedy = generate(model, params, ids, mask, key=key, max_new_tokens=5, temperature=0.0, eos_id=1, pad_id=0)
    sampled = generate(model, params, ids, mask, key=key, max_new_tokens=5, temperature=1.1, top_k=10, top_p=0.9,
                       eos_id=1, pad_id=0)
    for static, temperature in ((greedy, 0.0), (sampled, 1.1)):
        traced = rollout(params, jnp.float32(temperature), key)
        for a, b in zip(static, traced):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_sharded_params_and_batch_give_the_same_samples(tiny):
    model, params, ids, mask = tiny
    mesh, sharded = models_util.sharded_on_2x2x2(model, params)
    assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    kwargs = dict(key=jax.random.key(2), max_new_tokens=6, temperature=0.9, top_k=12, eos_id=1, pad_id=0)
    expected = generate(model, params, ids, mask, **kwargs)
    got = jax.jit(lambda p, i, m: generate(model, p, i, m, **kwargs))(
        sharded, jax.device_put(ids, batch), jax.device_put(mask, batch))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-5)
    # With a current mesh and logical rules, the model's activation constraints become real.
    with jax.set_mesh(mesh), nn.logical_axis_rules(models_util.ACTIVATION_RULES):
        constrained = jax.jit(lambda p, i, m: generate(model, p, i, m, **kwargs))(
            sharded, jax.device_put(ids, batch), jax.device_put(mask, batch))
        hlo = jax.jit(lambda p, i, m: generate(model, p, i, m, **kwargs)).lower(sharded, ids, mask).as_text()
    assert hlo.count("sharding_constraint") >= 4  # activations and KV cache are constrained
    np.testing.assert_array_equal(np.asarray(constrained.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(constrained.logprobs), np.asarray(expected.logprobs), atol=1e-5)


# SmolLM2: greedy parity with transformers ------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return models_util.smollm2(smollm2_gguf)


def test_greedy_matches_transformers_generate(smollm2):
    import torch

    model, params, hf, tokenizer = smollm2
    questions = ["What is the capital of France?", "Name three colours.",
                 "Write one sentence about the sea, then stop.", "Hi"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    batch = tokenizer(prompts, padding=True, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    assert len(set(mask.sum(1).tolist())) == 4
    steps, eos, pad = 16, tokenizer.eos_token_id, tokenizer.pad_token_id
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), key=jax.random.key(0),
                   max_new_tokens=steps, temperature=0.0, eos_id=eos, pad_id=pad)
    with torch.no_grad():
        reference = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                                attention_mask=torch.as_tensor(mask, dtype=torch.long), max_new_tokens=steps,
                                do_sample=False, eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:].numpy()
    reference = np.pad(reference, ((0, 0), (0, steps - reference.shape[1])), constant_values=pad)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)
    lengths = np.asarray(out.mask).sum(1)
    assert (lengths < steps).any(), "some row should have stopped at EOS"
    for row, length in enumerate(lengths):
        if length < steps:
            assert reference[row, length - 1] == eos


# Bad input ---------------------------------------------------------------------------------------------

def test_bad_arguments_are_named(tiny):
    model, params, ids, mask = tiny
    kwargs = dict(key=jax.random.key(0), max_new_tokens=4, temperature=1.0, eos_id=1, pad_id=0)

    def call(**changes):
        args = {**kwargs, **changes}
        return generate(model, params, args.pop("ids", ids), args.pop("mask", mask), **args)

    with pytest.raises(ValueError,
                       match=r"prompt length 7 \+ max_new_tokens 122 exceeds .*max_position_embeddings 128"):
        call(max_new_tokens=122)
    with pytest.raises(ValueError, match=r"prompt_ids holds token id 96 outside the vocabulary \[0, 96\)"):
        call(ids=ids.at[0, 6].set(96))
    with pytest.raises(ValueError, match=r"prompt_mask must be left-padded.*rows \[1\]"):
        call(mask=mask.at[1, 6].set(0))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        call(top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        call(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        call(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, vocab_size=96\]"):
        call(top_k=97)
    with pytest.raises(ValueError, match=r"eos_id \[200\] outside the vocabulary"):
        call(eos_id=(1, 200))
    with pytest.raises(ValueError, match="eos_id must be an int or a non-empty tuple"):
        call(eos_id=())
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        call(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"pad_id must be an int in \[0, 96\)"):
        call(pad_id=-1)


# ---- the blocked top-k --------------------------------------------------------------------
def _logits(kind, shape=(6, 5000)):
    rng = np.random.default_rng(3)
    if kind == "random":
        return jnp.asarray(rng.normal(size=shape), jnp.float32)
    if kind == "tied":  # five values only: thousands of ties at every rank
        return jnp.asarray(rng.integers(0, 5, size=shape), jnp.float32)
    # The largest 60 of every row in one block, some equal, and entries at -inf.
    x = rng.normal(size=shape)
    x[:, 1030:1090] = 10 + rng.integers(0, 3, size=(shape[0], 60))
    x[:, 4000:] = -np.inf
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("kind", ["random", "tied", "clustered"])
@pytest.mark.parametrize("per_block", [None, 16])
def test_blocked_top_k_equals_lax_top_k(kind, per_block):
    from marl_jax.rollout.top_k import blocked_top_k

    x = _logits(kind)
    for k in (50, 17, 5):
        want_values, want_index = jax.lax.top_k(x, k)
        got_values, got_index = jax.jit(lambda x: blocked_top_k(x, k, per_block=per_block))(x)
        np.testing.assert_array_equal(got_values, want_values)
        np.testing.assert_array_equal(got_index, want_index)


def test_sampler_on_the_gpu_top_k_draws_the_same_tokens():
    """Traced for a GPU, the sampler's top-50 goes through the blocked top-k: the same tokens,
    logprobs and entropies as with lax.top_k (on this CPU)."""
    from marl_jax.models import attention
    from marl_jax.rollout import top_k as top_k_lib

    x = _logits("random")
    with attention.target_platform("gpu"):
        jaxpr = str(jax.make_jaxpr(lambda x: top_k_lib.top_k(x, 50))(x))
    assert jaxpr.count("top_k[") == 2  # the blocks', then the candidates'
    cfg = M.ModelConfig.for_family("llama", vocab_size=5000, hidden_size=32, intermediate_size=64,
                                   num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    model = M.CausalLM(cfg)
    params = M.init_params(model, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (4, 6), 2, 5000)
    run = lambda: jax.jit(lambda p: generate(model, p, ids, jnp.ones_like(ids), key=jax.random.key(2),
                                             max_new_tokens=12, temperature=0.8, top_k=50, eos_id=1,
                                             pad_id=0))(params)
    want = run()
    with attention.target_platform("gpu"):
        got = run()
        sampler = str(jax.make_jaxpr(lambda p: generate(
            model, p, ids, jnp.ones_like(ids), key=jax.random.key(2), max_new_tokens=12,
            temperature=0.8, top_k=50, eos_id=1, pad_id=0))(params))
    # Traced for the GPU, every choice of a token (after the prefill, in the decode loop) runs
    # the blocked top-k: two top_k each.
    assert sampler.count("top_k[") >= 4 and sampler.count("top_k[") % 2 == 0
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.entropy, want.entropy)
