"""Continuous batching over decode slots (`generate(..., decode_slots=S)`, `continue_responses`): the
same outputs as the static sampler on a random model (greedy, sampled, top-k / top-p, groups,
continuations, scanned layers, a mesh of fake devices), the row-wise batch draw bit for bit against
`jax.random.categorical`, bad input."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import marl_jax.models as M
from marl_jax.batch_draws import categorical_rows
from marl_jax.sampling import continue_responses, generate
from marl_jax.train import sharding
import test_sampling
from models_util import padded_batch
from test_sampling_groups import EOS, _assert_same_samples

tiny = test_sampling.tiny  # the random Llama of test_sampling.py

STEPS = 12


@pytest.fixture(scope="module")
def prompts():
    """Ten left-padded prompts of lengths 1..7: over 3 slots some slot takes at least 4 rows."""
    ids, mask = padded_batch([3, 7, 5, 1, 2, 6, 4, 7, 3, 5], 7, seed=3)
    return jnp.asarray(ids), jnp.asarray(mask)


def _sample(model, params, ids, mask, **kwargs):
    return generate(model, params, ids, mask, **{"eos_id": EOS, "pad_id": 0, "max_new_tokens": STEPS, **kwargs})


@pytest.mark.parametrize("batch,width,seed", [(4, 96, 0), (7, 12, 1), (3, 49152, 2)])
def test_row_draws_equal_the_batch_categorical_bit_for_bit(batch, width, seed):
    step_key = jax.random.fold_in(jax.random.key(seed), 5)
    logits = 3 * jax.random.normal(jax.random.key(seed + 10), (batch, width))
    logits = logits.at[0, : width // 2].set(-jnp.inf)  # filtered candidates, as top-p leaves them
    rows = jnp.arange(batch)[::-1]
    got = jax.jit(categorical_rows)(jnp.stack([step_key] * batch), logits[rows], rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.random.categorical(step_key, logits))[::-1])


@pytest.mark.parametrize("settings,per_row", [(dict(temperature=0.0), False),
                                              (dict(temperature=1.1, top_k=12, top_p=0.9), False),
                                              (dict(temperature=1.0), True),
                                              (dict(temperature=0.8, top_p=0.7), True)])
def test_slots_give_the_static_samples(tiny, prompts, settings, per_row):
    model, params, _, _ = tiny
    ids, mask = prompts
    keys = dict(row_keys=jax.random.split(jax.random.key(3), 10)) if per_row else dict(key=jax.random.key(3))
    static = _sample(model, params, ids, mask, **keys, **settings)
    slots = _sample(model, params, ids, mask, decode_slots=3, **keys, **settings)
    _assert_same_samples(slots, static)
    lengths = np.asarray(static.mask).sum(1)
    assert lengths.min() <= 2 and lengths.max() == STEPS, lengths  # rows end at very different steps


def test_groups_and_scanned_layers_give_the_static_samples(tiny, prompts):
    model, params, _, _ = tiny
    ids, mask = prompts
    scanned = M.CausalLM(model.config.replace(scan_layers=True))
    stacked = M.stack_layers(params, model.config.num_layers)
    settings = dict(key=jax.random.key(7), temperature=1.2, top_k=30, num_samples=3)
    static = _sample(model, params, ids[:5], mask[:5], **settings)
    _assert_same_samples(_sample(model, params, ids[:5], mask[:5], decode_slots=4, **settings), static)
    _assert_same_samples(_sample(scanned, stacked, ids[:5], mask[:5], decode_slots=4, **settings), static)
    assert len(set(np.asarray(static.mask).sum(1).tolist())) > 4


def test_continuations_over_slots_give_the_static_continuations(tiny, prompts):
    model, params, _, _ = tiny
    ids, mask = prompts
    settings = dict(temperature=1.0, top_k=40, eos_id=EOS, pad_id=0)
    row_keys = jax.random.split(jax.random.key(6), 20)
    full = _sample(model, params, ids, mask, row_keys=row_keys[::2], **settings)
    lengths = np.asarray(full.mask).sum(1)
    t = np.random.default_rng(5).integers(0, lengths + 1).astype(np.int32)
    t[0], t[1] = 0, lengths[1]  # row 1 samples nothing: its prefix is the whole response
    args = (model, params, ids, mask, full.tokens, full.mask, jnp.asarray(t))
    static = continue_responses(*args, num_samples=2, row_keys=row_keys, **settings)
    got = continue_responses(*args, num_samples=2, row_keys=row_keys, decode_slots=3, **settings)
    _assert_same_samples(got, static)


def test_slots_split_over_the_data_axes_of_a_mesh(tiny, prompts):
    model, params, _, _ = tiny
    ids, mask = prompts
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    shardings = sharding.logical_to_sharding(M.logical_axes(model), mesh, params)
    sharded = jax.device_put(params, shardings)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    ids8, mask8 = ids[:8], mask[:8]
    settings = dict(key=jax.random.key(2), temperature=0.9, top_k=12)
    expected = _sample(model, params, ids8, mask8, **settings)
    with sharding.mesh_context(mesh):
        run = jax.jit(lambda p, i, m: _sample(model, p, i, m, decode_slots=4, **settings))
        got = run(sharded, jax.device_put(ids8, rows), jax.device_put(mask8, rows))
        hlo = run.lower(sharded, ids8, mask8).as_text()
        with pytest.raises(ValueError, match=r"decode_slots=6 is not divisible by the 4 data-parallel shards"):
            jax.jit(lambda p, i, m: _sample(model, p, i, m, decode_slots=6, **settings)).lower(sharded, ids8, mask8)
    assert "sharding_constraint" in hlo
    _assert_same_samples(got, expected)


def test_bad_decode_slots(tiny, prompts):
    model, params, _, _ = tiny
    ids, mask = prompts
    settings = dict(key=jax.random.key(0), temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="decode_slots must be None or a non-negative int, got -1"):
        _sample(model, params, ids, mask, decode_slots=-1, **settings)
    with pytest.raises(ValueError, match="decode_slots must be None or a non-negative int, got 2.0"):
        _sample(model, params, ids, mask, decode_slots=2.0, **settings)
    static = _sample(model, params, ids[:2], mask[:2], **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        above = _sample(model, params, ids[:2], mask[:2], decode_slots=5, **settings)
    assert [str(w.message) for w in caught] == [
        "decode_slots=5 is not below the 2 rows to sample: they are sampled as one static batch"]
    _assert_same_samples(above, static, atol=0)
    with pytest.raises(ValueError, match="decode_slots with key= needs a threefry key"):
        _sample(model, params, ids, mask, decode_slots=2, **{**settings, "key": jax.random.key(0, impl="rbg")})
