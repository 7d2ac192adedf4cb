"""The real Gemma-3-270M (base, Q4_K_M GGUF; 18 layers, a 512-token window on five of every six,
a 262k vocabulary): logits and greedy decoding against transformers loading the same file, and
sampling scored back through the lean (chunked LM head) path."""
import jax
import jax.numpy as jnp
import numpy as np
import torch

import marl_jax.models as M
from marl_jax.models.heads import token_scores
from marl_jax.rollout import generate
import models_util
from models_util import hf_logits

models_util.use_one_torch_thread()

PROMPTS = ["The capital of France is", "Once upon a time, in a land far, far away, there lived a",
           "def fibonacci(n):", "Water boils at"]


def _batch(tokenizer):
    batch = tokenizer(PROMPTS, padding=True, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    assert mask[:, 0].min() == 0 and mask[:, -1].all()  # left padding
    return ids, mask


def test_config_is_gemma3_with_local_and_global_layers(gemma3_270m):
    model, params, hf, _ = gemma3_270m
    cfg = model.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == ("gemma3_text", 18, 640, 4, 1, 256, 262144)
    full = [i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17] and sorted(set(range(18)) - set(cfg.sliding_layers)) == full
    assert cfg.sliding_window == hf.config.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4) and cfg.qk_norm == "head"
    assert sum(x.size for x in jax.tree.leaves(params)) == sum(p.numel() for p in hf.parameters())


def test_tokenizer_matches_transformers_on_the_same_file(gemma3_270m, gemma3_270m_gguf):
    """Ours (built with the `tokenizers` library) against transformers' own GGUF tokenizer of the
    same file (a sentencepiece vocabulary of 262k tokens, merges rebuilt from it) on 1,000
    strings."""
    from transformers import AutoTokenizer

    path = gemma3_270m_gguf
    with models_util.transformers_reads_gguf_fast():
        reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    models_util.assert_same_tokenizer(gemma3_270m[3], reference, models_util.tokenizer_probe_texts())


def test_logits_match_transformers_on_the_same_file(gemma3_270m):
    model, params, hf, tokenizer = gemma3_270m
    ids, mask = _batch(tokenizer)
    ours = np.asarray(M.forward_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    reference = hf_logits(hf, ids, mask)
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - reference[valid]).max() < 2e-2
    assert (ours[valid].argmax(-1) == reference[valid].argmax(-1)).mean() > 0.99


def test_greedy_tokens_match_transformers_generate(gemma3_270m):
    model, params, hf, tokenizer = gemma3_270m
    ids, mask = _batch(tokenizer)
    steps, eos, pad = 20, tokenizer.eos_token_id, tokenizer.pad_token_id
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), key=jax.random.key(0), max_new_tokens=steps,
                   temperature=0.0, eos_id=eos, pad_id=pad)
    with torch.no_grad():
        reference = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                                attention_mask=torch.as_tensor(mask, dtype=torch.long), max_new_tokens=steps,
                                do_sample=False, eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:].numpy()
    reference = np.pad(reference, ((0, 0), (0, steps - reference.shape[1])), constant_values=pad)
    assert (np.asarray(out.tokens) == reference).mean() >= 0.9


def test_samples_score_back_through_the_lean_path(gemma3_270m):
    """Temperature samples over the 262k vocabulary: the sampler's logprobs equal those the lean
    scoring path (LM head in chunks, never `[B, T, V]` at once) gives the same tokens."""
    model, params, _, tokenizer = gemma3_270m
    ids, mask = _batch(tokenizer)
    temperature = 0.8
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), key=jax.random.key(1), max_new_tokens=8,
                   temperature=temperature, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    full_ids = jnp.concatenate([jnp.asarray(ids), out.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(mask), out.mask], axis=1)
    hidden = model.apply({"params": params}, full_ids, full_mask, method=M.CausalLM.hidden_states)
    prompt_len = ids.shape[1]
    scores = token_scores(model.config, params, hidden[:, prompt_len - 1:-1], out.tokens, temperature, chunk=3)
    valid = np.asarray(out.mask).astype(bool)
    np.testing.assert_allclose(np.asarray(scores.logprobs)[valid], np.asarray(out.logprobs)[valid], atol=2e-3)
    assert len(set(np.asarray(out.tokens)[valid].tolist())) > 8  # sampled, not one repeated token
