"""Continuous batching over decode slots (`generate(..., decode_slots=S)`, `continue_responses`): the
same outputs as the static sampler on a random model (greedy, sampled, top-k / top-p, groups,
continuations, scanned layers, a mesh of fake devices), the row-wise batch draw bit for bit against
`jax.random.categorical`, a PPO step and evaluation with and without slots, bad input."""
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import marl_jax.models as M
from marl_jax.rollout.draws import categorical_rows
from marl_jax.config_check import validate_config
from marl_jax.rollout import continue_responses, generate
from marl_jax.train import ppo as ppo_lib
from marl_jax.train import ppo_core as core, ppo_types
from marl_jax.train import sharding
import test_sampling
from models_util import padded_batch, random_hf_model, write_checkpoint
from test_sampling_groups import EOS, _assert_same_samples
from train_util import tiny_config

tiny = test_sampling.tiny  # the random Llama of test_sampling.py

STEPS = 12


@pytest.fixture(scope="module")
def prompts():
    """Ten left-padded prompts of lengths 1..7: over 3 slots some slot takes at least 4 rows."""
    ids, mask = padded_batch([3, 7, 5, 1, 2, 6, 4, 7, 3, 5], 7, seed=3)
    return jnp.asarray(ids), jnp.asarray(mask)


def _sample(model, params, ids, mask, **kwargs):
    return generate(model, params, ids, mask, **{"eos_id": EOS, "pad_id": 0, "max_new_tokens": STEPS, **kwargs})


@pytest.mark.smoke
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


def test_sliding_window_layers_over_slots_give_the_static_samples(prompts, tmp_path):
    """Gemma-2 with a 4-token window: each slot's window mask follows its own cache column."""
    model, params = M.load_pretrained(write_checkpoint(random_hf_model("gemma2_softcap_window", seed=4), tmp_path))
    ids, mask = prompts
    settings = dict(key=jax.random.key(9), temperature=1.0, eos_id=(3, 7, 11, 19, 23), max_new_tokens=10)
    static = _sample(model, params, ids, mask, **settings)
    _assert_same_samples(_sample(model, params, ids, mask, decode_slots=3, **settings), static)
    lengths = np.asarray(static.mask).sum(1)
    assert lengths.min() < 5 and lengths.max() == 10, lengths


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


# PPO and evaluation -------------------------------------------------------------------------------

def test_a_ppo_step_over_decode_slots_equals_the_static_step():
    import test_shared_trunk

    _, config, mods, static, sft, rm, critic_params = test_shared_trunk._setup(num_layers_unfrozen=-1)
    # Ids the random policy emits often, so that responses end at different steps.
    static = dataclasses.replace(static, batch_size=8, group_size=2, response_length=10, eos_id=(1, 5, 9, 17))
    frozen = ppo_types.Frozen(sft, rm, jnp.float32(0.1), jnp.float32(2.0))
    hp = ppo_lib.hparams_from_config(config.ppo)
    prompts = jnp.asarray(np.random.default_rng(1).integers(2, 32, (4, 5)), jnp.int32)
    prompt_mask = jnp.asarray(np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1] * 5, [0, 0, 0, 1, 1]]), jnp.int32)
    out = {}
    for slots in (0, 2):
        s = dataclasses.replace(static, decode_slots=slots)
        state = ppo_lib.initial_state(config, mods, sft, critic_params, seed=0)
        state, metrics = jax.jit(functools.partial(core.ppo_step, s, mods))(state, frozen, hp, prompts, prompt_mask)
        evaluation = ppo_lib.evaluate(s, mods, state.actor_params, frozen, prompts, prompt_mask, None,
                                      jax.random.key(5), samples_per_prompt=2)
        out[slots] = metrics, evaluation
    (m_static, e_static), (m_slots, e_slots) = out[0], out[2]
    assert set(m_static) == set(m_slots)
    for key in m_static:
        np.testing.assert_allclose(m_slots[key], m_static[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in e_static:
        np.testing.assert_allclose(e_slots[key], e_static[key], rtol=1e-5, atol=1e-6, err_msg=key)
    lengths = np.asarray(e_static["response_mask"]).sum(1)
    assert lengths.min() < lengths.max() == 10, lengths


def test_ppo_decode_slots_config_is_checked():
    config = tiny_config()
    config.ppo.decode_slots = -1
    with pytest.raises(ValueError, match=r"config.ppo.decode_slots=-1: must be an integer >= 0"):
        validate_config(config)
    config.ppo.update(dict(decode_slots=6, batch_size=16))
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"config.ppo.decode_slots=6 is not divisible by the 4 data-parallel"):
        ppo_lib.validate_decode_slots(config, mesh)
    config.ppo.decode_slots = 16  # not below the batch: the static batch, nothing to split
    ppo_lib.validate_decode_slots(config, mesh)


def test_the_rollout_bench_counts_first_in_first_out_decode_steps():
    import sys
    from train_util import ROOT
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_rollout import fifo_steps

    # Two slots: rows 0 (5 tokens) and 1 (1) start at once; 2 and 3 take slot 1 after 1 and 2
    # iterations; slot 0 ends last, at 5.
    assert fifo_steps([5, 1, 1, 1], 2) == 5
    # Row 3 waits for the first slot to free (step 2, slot 0) and ends at 2 + 4 = 6.
    assert fifo_steps([2, 3, 3, 4], 3) == 6
    # As many slots as rows: the longest row; one slot: the sum.
    assert fifo_steps([7, 2, 9], 3) == 9
    assert fifo_steps([7, 2, 9], 1) == 18
