"""Group sampling, per-row keys and continuation from a response prefix: `generate(num_samples=k)`
against the k-fold repeated call, entropy against a full forward pass, per-row keys independent of
the batch, `continue_responses` reproducing a response from any prefix, the default draws pinned
against a full-forward reference loop, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import marl_jax.models as M
from marl_jax.rollout import SampleOutput, continue_responses, generate
import test_sampling
from test_sampling import _filtered_reference

tiny = test_sampling.tiny  # the random Llama and left-padded prompts of test_sampling.py

SETTINGS = [pytest.param(dict(temperature=0.0), id="greedy"),
            pytest.param(dict(temperature=1.1, top_k=12, top_p=0.9), id="top_k_top_p"),
            pytest.param(dict(temperature=0.8, top_p=0.7), id="top_p"),
            pytest.param(dict(temperature=1.0), id="plain")]
# Ids the tiny model emits often, so that rows stop at different steps within a few tokens.
EOS = (6, 15, 45, 58, 80)


def _settings(name: str) -> dict:
    return next(p.values[0] for p in SETTINGS if p.id == name)


def _sample(model, params, ids, mask, **kwargs):
    return generate(model, params, ids, mask, **{"eos_id": EOS, "pad_id": 0, "max_new_tokens": 8, **kwargs})


def _assert_same_samples(got: SampleOutput, expected: SampleOutput, atol=1e-5):
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(expected.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=atol, rtol=0)
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(expected.entropy), atol=atol, rtol=0)


# The default draws, pinned ----------------------------------------------------------------------------

def reference_default_draws(model, params, ids, mask, key, steps, temperature, top_k=0, top_p=1.0):
    """The sampler's default algorithm as a plain loop over full forward passes (no cache): at step
    t, the logits of the last column are scaled, filtered to the top_k largest (`lax.top_k` order)
    or sorted (`argsort(-x)`) for top-p, cut to the top-p nucleus, and one categorical over the
    whole batch is drawn with `fold_in(key, t)`. Returns tokens, logprobs, mask `[B, steps]`."""
    batch = ids.shape[0]
    tokens = np.zeros((batch, steps), np.int32)
    logprobs = np.zeros((batch, steps), np.float32)
    out_mask = np.zeros((batch, steps), np.int32)
    done = np.zeros(batch, bool)
    seq_ids, seq_mask = ids, mask
    for step in range(steps):
        logits = model.apply({"params": params}, seq_ids, seq_mask)[:, -1]
        if temperature == 0:
            token = jnp.argmax(logits, axis=-1)
            logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
        else:
            scaled, candidates = logits / temperature, None
            if top_k:
                scaled, candidates = jax.lax.top_k(scaled, top_k)
            elif top_p < 1:
                candidates = jnp.argsort(-scaled, axis=-1)
                scaled = jnp.take_along_axis(scaled, candidates, axis=-1)
            if top_p < 1:
                probs = jax.nn.softmax(scaled, axis=-1)
                scaled = jnp.where(jnp.cumsum(probs, axis=-1) - probs < top_p, scaled, -jnp.inf)
            choice = jax.random.categorical(jax.random.fold_in(key, step), scaled, axis=-1)
            logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled), choice[:, None], axis=-1)[:, 0]
            token = choice if candidates is None else jnp.take_along_axis(candidates, choice[:, None], axis=-1)[:, 0]
        alive = ~done
        tokens[:, step] = np.where(alive, np.asarray(token), 0)
        logprobs[:, step] = np.where(alive, np.asarray(logprob), 0.0)
        out_mask[:, step] = alive
        done |= alive & np.isin(tokens[:, step], EOS)
        seq_ids = jnp.concatenate([seq_ids, jnp.asarray(tokens[:, step:step + 1])], axis=1)
        seq_mask = jnp.concatenate([seq_mask, jnp.ones((batch, 1), seq_mask.dtype)], axis=1)
    return tokens, logprobs, out_mask


@pytest.mark.parametrize("settings", SETTINGS)
def test_default_draws_match_a_full_forward_reference_loop(tiny, settings):
    model, params, ids, mask = tiny
    key = jax.random.key(11)
    out = _sample(model, params, ids, mask, key=key, **settings)
    tokens, logprobs, out_mask = reference_default_draws(model, params, ids, mask, key, 8, **settings)
    np.testing.assert_array_equal(np.asarray(out.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(out.mask), out_mask)
    np.testing.assert_allclose(np.asarray(out.logprobs), logprobs, atol=2e-5, rtol=0)
    if settings["temperature"]:
        assert out_mask.sum(1).min() < 8, "some row should stop at EOS"


# num_samples ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", SETTINGS[:2])
@pytest.mark.parametrize("per_row", [False, True])
def test_num_samples_equals_the_repeated_prompts(tiny, settings, per_row):
    model, params, ids, mask = tiny
    k = 3
    keys = dict(row_keys=jax.random.split(jax.random.key(3), 4 * k)) if per_row else dict(key=jax.random.key(3))
    grouped = _sample(model, params, ids, mask, num_samples=k, **keys, **settings)
    repeated = _sample(model, params, jnp.repeat(ids, k, axis=0), jnp.repeat(mask, k, axis=0), **keys, **settings)
    assert grouped.tokens.shape == grouped.entropy.shape == (4 * k, 8)
    _assert_same_samples(grouped, repeated)
    if settings["temperature"]:
        groups = np.asarray(grouped.tokens).reshape(4, k, 8)
        assert all(len({tuple(row) for row in group}) > 1 for group in groups), "samples of a group should differ"


# Entropy ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", SETTINGS)
def test_entropy_is_that_of_the_filtered_distribution(tiny, settings):
    model, params, ids, mask = tiny
    out = _sample(model, params, ids, mask, key=jax.random.key(5), **settings)
    settings = {"top_k": 0, "top_p": 1.0, **settings}
    reference = _filtered_reference(model, params, ids, mask, out, settings["temperature"], settings["top_k"],
                                    settings["top_p"])
    probs = np.exp(reference)
    expected = -np.where(probs > 0, probs * np.where(probs > 0, reference, 0.0), 0.0).sum(-1)
    valid = np.asarray(out.mask).astype(bool)
    entropy = np.asarray(out.entropy)
    assert entropy.dtype == np.float32
    np.testing.assert_allclose(entropy[valid], expected[valid], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(entropy[~valid], 0.0)
    assert (expected[valid] > 0.1).all()


# Per-row keys -----------------------------------------------------------------------------------------

def test_row_keys_make_a_row_independent_of_its_batch(tiny):
    model, params, ids, mask = tiny
    settings = dict(temperature=1.2, top_k=30)
    row_keys = jax.random.split(jax.random.key(8), 4)
    batch = _sample(model, params, ids, mask, row_keys=row_keys, **settings)
    order = np.asarray([2, 0, 3, 1])
    shuffled = _sample(model, params, ids[order], mask[order], row_keys=row_keys[order], **settings)
    _assert_same_samples(shuffled, SampleOutput(*(x[order] for x in batch)))
    for row in range(4):
        alone = _sample(model, params, ids[row:row + 1], mask[row:row + 1], row_keys=row_keys[row:row + 1], **settings)
        _assert_same_samples(alone, SampleOutput(*(x[row:row + 1] for x in batch)))
    batch_level = _sample(model, params, ids, mask, key=row_keys[0], **settings)
    assert not np.array_equal(np.asarray(batch_level.tokens), np.asarray(batch.tokens))


# Continuation -----------------------------------------------------------------------------------------

def _prefix_lengths(out: SampleOutput, seed: int) -> np.ndarray:
    """Random t_b in [0, valid length of row b]: row 0 gets 0, row 1 its full length."""
    lengths = np.asarray(out.mask).sum(axis=1)
    t = np.random.default_rng(seed).integers(0, lengths + 1)
    t[0], t[1] = 0, lengths[1]
    return t.astype(np.int32)


@pytest.mark.parametrize("name, draws", [("greedy", "row_keys"), ("top_k_top_p", "row_keys"),
                                         ("plain", "row_keys"), ("top_k_top_p", "key")])
def test_continuation_reproduces_the_response_from_any_prefix(tiny, name, draws):
    """With the per-row keys a response was drawn with, or with the batch key (each row then
    draws its row of the batch draw at its own position), from prefixes of different lengths."""
    model, params, ids, mask = tiny
    settings = _settings(name)
    length = 10
    keys = {"row_keys": jax.random.split(jax.random.key(21), 4)} if draws == "row_keys" else {
        "key": jax.random.key(22)}
    full = _sample(model, params, ids, mask, max_new_tokens=length, **keys, **settings)
    lengths = np.asarray(full.mask).sum(1)
    if settings["temperature"]:
        assert lengths.min() < length, "some row should end with EOS"
    for seed in range(3):
        t = _prefix_lengths(full, seed)
        got = continue_responses(model, params, ids, mask, full.tokens, full.mask, jnp.asarray(t), **keys,
                                 eos_id=EOS, pad_id=0, **settings)
        assert got.tokens.shape == (4, length)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(full.tokens))
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(full.mask))
        sampled = np.arange(length)[None, :] >= t[:, None]
        for name in ("logprobs", "entropy"):
            value, expected = np.asarray(getattr(got, name)), np.asarray(getattr(full, name))
            np.testing.assert_allclose(value[sampled], expected[sampled], atol=1e-5, rtol=0)
            np.testing.assert_array_equal(value[~sampled], 0.0)


def test_sliding_windows_in_group_continuations(tmp_path):
    """Gemma 3 with a 4-token window on two of three layers (and its own local rope), prompts
    longer than the window: a group's responses continue from any prefix unchanged, though the
    continuation lays the context out in other cache slots. (The cached sampler against the
    windowed full forward: test_sampling.py, every family.)"""
    from models_util import padded_batch, random_hf_model, write_checkpoint

    model, params = M.load_pretrained(write_checkpoint(random_hf_model("gemma3_local_global", seed=4), tmp_path))
    assert model.config.sliding_window == 4 and model.config.sliding_layers == (0, 2)
    ids, mask = (jnp.asarray(x) for x in padded_batch([6, 9, 7, 5], 9, seed=5))
    settings = _settings("plain")
    row_keys = jax.random.split(jax.random.key(13), 8)
    group = _sample(model, params, ids, mask, row_keys=row_keys, num_samples=2, max_new_tokens=10, **settings)
    t = _prefix_lengths(group, seed=1)
    again = continue_responses(model, params, jnp.repeat(ids, 2, axis=0), jnp.repeat(mask, 2, axis=0), group.tokens,
                               group.mask, jnp.asarray(t), row_keys=row_keys, eos_id=EOS, pad_id=0, **settings)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(group.tokens))
    assert (np.asarray(group.mask).sum(1) - t).max() > 4, "some row should resample past the window"


def test_continuation_groups_share_the_prefix_and_stop_at_max_new_tokens(tiny):
    model, params, ids, mask = tiny
    settings = dict(temperature=1.0, top_k=40, eos_id=EOS, pad_id=0)
    full = _sample(model, params, ids, mask, key=jax.random.key(2), max_new_tokens=10, **settings)
    t = _prefix_lengths(full, 5)
    k = 3
    row_keys = jax.random.split(jax.random.key(6), 4 * k)
    grouped = continue_responses(model, params, ids, mask, full.tokens, full.mask, jnp.asarray(t), num_samples=k,
                                 row_keys=row_keys, **settings)
    inputs = (ids, mask, full.tokens, full.mask, jnp.asarray(t))
    repeated = continue_responses(model, params, *(jnp.repeat(x, k, axis=0) for x in inputs), row_keys=row_keys,
                                  **settings)
    _assert_same_samples(grouped, repeated)
    tokens = np.asarray(grouped.tokens).reshape(4, k, 10)
    for row in range(4):
        np.testing.assert_array_equal(tokens[row, :, :t[row]], np.broadcast_to(np.asarray(full.tokens)[row, :t[row]],
                                                                              (k, t[row])))
    assert len({tuple(x) for x in tokens[0]}) > 1, "continuations of a group should differ"
    capped = continue_responses(model, params, ids, mask, full.tokens, full.mask, jnp.asarray(t), num_samples=k,
                                row_keys=row_keys, max_new_tokens=2, **settings)
    keep = np.arange(10)[None, :] < np.repeat(t, k)[:, None] + 2
    np.testing.assert_array_equal(np.asarray(capped.tokens), np.where(keep, np.asarray(grouped.tokens), 0))
    np.testing.assert_array_equal(np.asarray(capped.mask), np.where(keep, np.asarray(grouped.mask), 0))


def test_groups_and_continuation_with_scanned_layers_and_inside_jit(tiny):
    model, params, ids, mask = tiny
    scanned = M.CausalLM(model.config.replace(scan_layers=True))
    stacked = M.stack_layers(params, model.config.num_layers)
    settings = dict(temperature=0.9, top_k=20, eos_id=EOS, pad_id=0)
    row_keys = jax.random.split(jax.random.key(4), 8)
    expected = generate(model, params, ids, mask, row_keys=row_keys, num_samples=2, max_new_tokens=6, **settings)
    _assert_same_samples(generate(scanned, stacked, ids, mask, row_keys=row_keys, num_samples=2, max_new_tokens=6,
                                  **settings), expected)
    t = jnp.asarray([0, 2, 6, 1], jnp.int32)
    response, response_mask = expected.tokens[::2], expected.mask[::2]
    unrolled = continue_responses(model, params, ids, mask, response, response_mask, t, num_samples=2,
                                  row_keys=row_keys, **settings)
    _assert_same_samples(continue_responses(scanned, stacked, ids, mask, response, response_mask, t, num_samples=2,
                                            row_keys=row_keys, **settings), unrolled)
    jitted = jax.jit(lambda p, t, keys: continue_responses(model, p, ids, mask, response, response_mask, t,
                                                           num_samples=2, row_keys=keys, **settings))
    _assert_same_samples(jitted(params, t, row_keys), unrolled)


# Bad input --------------------------------------------------------------------------------------------

def test_bad_group_arguments_are_named(tiny):
    model, params, ids, mask = tiny
    settings = dict(max_new_tokens=4, temperature=1.0, eos_id=1, pad_id=0)
    keys = jax.random.split(jax.random.key(0), 8)
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        generate(model, params, ids, mask, key=keys[0], num_samples=0, **settings)
    with pytest.raises(ValueError, match=r"row_keys must have shape \(8,\) = \[batch \* num_samples\], got \(4,\)"):
        generate(model, params, ids, mask, row_keys=keys[:4], num_samples=2, **settings)
    with pytest.raises(ValueError, match="row_keys must be a typed key array"):
        generate(model, params, ids, mask, row_keys=jax.random.key_data(keys[:4]), **settings)
    with pytest.raises(ValueError, match="exactly one of key .* and row_keys .*, got both"):
        generate(model, params, ids, mask, key=keys[0], row_keys=keys[:4], **settings)
    with pytest.raises(ValueError, match="exactly one of key .* and row_keys .*, got neither"):
        generate(model, params, ids, mask, **settings)

    response = generate(model, params, ids, mask, key=keys[0], **settings)
    settings.pop("max_new_tokens")

    def resume(t, **changes):
        args = {"row_keys": keys[:4], **settings, **changes}
        return continue_responses(model, params, ids, mask, response.tokens, response.mask,
                                  jnp.asarray(t, jnp.int32), **args)

    lengths = np.asarray(response.mask).sum(1)
    with pytest.raises(ValueError, match=r"prefix_lengths must be in \[0, valid length.*rows \[2\]"):
        resume(np.where(np.arange(4) == 2, lengths + 1, 0))
    with pytest.raises(ValueError, match=r"prefix_lengths must be in \[0, valid length.*rows \[0\]"):
        resume([-1, 0, 0, 0])
    with pytest.raises(ValueError, match=r"prefix_lengths must be an int array of shape \(4,\)"):
        resume([0, 0, 0])
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        resume([0, 0, 0, 0], num_samples=0)
    with pytest.raises(ValueError, match=r"row_keys must have shape \(8,\)"):
        resume([0, 0, 0, 0], num_samples=2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int or None"):
        resume([0, 0, 0, 0], max_new_tokens=0)
