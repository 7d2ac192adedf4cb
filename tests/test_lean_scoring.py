"""Lean scoring: token logprobs, entropy and SFT cross-entropy from hidden states with the LM head
in chunks equal the full-logits computation, in value and in gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import losses
from marl_jax import models as M
from marl_jax.models.heads import continuation_scores, token_scores
from marl_jax.train import phases
from marl_jax.train.sft import sft_loss

jax.config.update("jax_default_matmul_precision", "highest")

CONFIGS = {
    "llama_tied": dict(family="llama", tie_word_embeddings=True),
    "llama_untied": dict(family="llama", tie_word_embeddings=False),
    "gemma2_softcap": dict(family="gemma2", final_logit_softcap=1.5, attn_logit_softcap=20.0),
}


def _model(case):
    cfg = M.ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                        **CONFIGS[case])
    model = M.CausalLM(cfg)
    params = M.init_params(model, jax.random.key(3))
    # A larger init than the default 0.02 so the distributions are far from uniform.
    params = jax.tree.map(lambda x: x * 20.0 if x.ndim > 1 else x, params)
    return model, params


def _batch(rng, b=3, p=4, r=7):
    prompt_ids = rng.integers(3, 37, (b, p)).astype(np.int32)
    prompt_mask = np.ones((b, p), np.int32)
    prompt_mask[0, :2] = 0  # left padding
    lengths = np.array([r, 3, 1])[:b]
    response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    response_ids = np.where(response_mask, rng.integers(3, 37, (b, r)), 0).astype(np.int32)
    return prompt_ids, prompt_mask, response_ids, response_mask


def _reference(model, params, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
    """The full-logits path: `[B, P + R, V]` logits, log-softmax, gather."""
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1)
    logits = model.apply({"params": params}, ids, mask)[:, prompt_ids.shape[1] - 1:-1]
    scaled = jax.nn.log_softmax(logits / temperature, axis=-1)
    base = jax.nn.log_softmax(logits, axis=-1)
    pick = lambda lp: jnp.take_along_axis(lp, response_ids[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(scaled) * scaled, axis=-1)
    m = response_mask.astype(jnp.float32)
    return pick(scaled) * m, entropy * m, pick(base) * m, logits


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_chunked_token_logprobs_and_entropy_equal_full_logits(case, chunk):
    model, params = _model(case)
    batch = _batch(np.random.default_rng(0))
    want_lp, want_ent, want_base, logits = _reference(model, params, *batch, 0.7)
    ids = jnp.concatenate([batch[0], batch[2]], axis=1)
    mask = jnp.concatenate([batch[1], batch[3]], axis=1)
    hidden = model.apply({"params": params}, ids, mask, method=M.CausalLM.hidden_states)
    out = token_scores(model.config, params, hidden[:, 3:-1], batch[2], 0.7, chunk=chunk)
    m = batch[3]
    np.testing.assert_allclose(np.asarray(out.logprobs) * m, want_lp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.entropy) * m, want_ent, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.base_logprobs) * m, want_base, atol=1e-5)
    correct = np.asarray(jnp.argmax(logits, -1) == batch[2], np.float32)
    np.testing.assert_array_equal(np.asarray(out.correct) * m, correct * m)
    # The distributions are far from uniform (a check that cannot pass by accident).
    assert float(np.min(want_ent[m == 1])) < 0.9 * np.log(37)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_token_logprobs_contract_values_and_gradient(case):
    model, params = _model(case)
    batch = tuple(jnp.asarray(x) for x in _batch(np.random.default_rng(1)))
    rng = np.random.default_rng(2)
    w_lp = jnp.asarray(rng.normal(size=batch[2].shape), jnp.float32)
    w_ent = jnp.asarray(rng.normal(size=batch[2].shape), jnp.float32)

    logprobs, entropy = phases.score.token_logprobs(model, params, *batch, 0.8)
    want_lp, want_ent, _, _ = _reference(model, params, *batch, 0.8)
    np.testing.assert_allclose(logprobs, want_lp, atol=1e-5)
    np.testing.assert_allclose(entropy, want_ent, atol=1e-5)
    assert np.all(np.asarray(logprobs)[np.asarray(batch[3]) == 0] == 0)
    assert np.all(np.asarray(entropy)[np.asarray(batch[3]) == 0] == 0)

    def lean(p):
        lp, ent = phases.score.token_logprobs(model, p, *batch, 0.8)
        return jnp.sum(w_lp * lp + w_ent * ent)

    def full(p):
        lp, ent, _, _ = _reference(model, p, *batch, 0.8)
        return jnp.sum(w_lp * lp + w_ent * ent)

    g_lean, g_full = jax.grad(lean)(params), jax.grad(full)(params)
    for path, a in jax.tree.flatten_with_path(g_lean)[0]:
        b = g_full
        for k in path:
            b = b[k.key]
        scale = float(np.max(np.abs(b))) + 1e-12
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * max(scale, 1.0),
                                   err_msg=jax.tree_util.keystr(path))
    # The head weight's gradient is not trivially zero.
    head = g_full["backbone"]["embed"]["embedding"] if model.config.tie_word_embeddings \
        else g_full["lm_head"]
    assert float(jnp.max(jnp.abs(head))) > 1e-3


def test_sft_loss_equals_full_logits_cross_entropy():
    model, params = _model("llama_untied")
    p_ids, p_mask, r_ids, r_mask = _batch(np.random.default_rng(4))
    batch = dict(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids, response_mask=r_mask)
    loss, metrics = sft_loss(model, params, batch)
    ids = np.concatenate([p_ids, r_ids], 1)
    mask = np.concatenate([p_mask, r_mask], 1)
    logits = model.apply({"params": params}, ids, mask)[:, p_ids.shape[1] - 1:-1]
    want, want_m = losses.sft_cross_entropy(logits, r_ids, r_mask)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], want_m["accuracy"], rtol=1e-6)
    g = jax.grad(lambda p: sft_loss(model, p, batch)[0])(params)
    g_want = jax.grad(lambda p: losses.sft_cross_entropy(
        model.apply({"params": p}, ids, mask)[:, p_ids.shape[1] - 1:-1], r_ids, r_mask)[0])(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_continuation_scores_of_a_row_do_not_depend_on_its_neighbours():
    model, params = _model("llama_tied")
    batch = _batch(np.random.default_rng(5))
    together = continuation_scores(model, params, *batch, 0.9)
    alone = continuation_scores(model, params, *(x[1:2] for x in batch), 0.9)
    np.testing.assert_allclose(together.logprobs[1:2], alone.logprobs, atol=1e-6)
