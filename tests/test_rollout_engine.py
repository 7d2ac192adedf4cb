"""The rollout engine at accelerator speed: the decode loop's blocked KV reads, the weights cast
once per rollout, prescribed lengths, the XLA flags set for GPUs, the refill of decode slots and
the first step's scoring pass as branches that vmap keeps, and the config refusal of slots that
cannot refill."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.rollout import engine, slots as slot_engine
from marl_jax import models, rollout, xla_flags
from marl_jax.models.config import ModelConfig
from marl_jax.train import ppo_core as core

from train_util import tiny_config

VOCAB = 64


def _model(**fields):
    cfg = ModelConfig.for_family("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                                 eos_token_id=(1,), **fields)
    return models.build_model(cfg)


@functools.lru_cache(maxsize=None)
def _params():
    return models.init_params(_model(), jax.random.key(0))


def _prompts(rows=4, width=10):
    ids = jax.random.randint(jax.random.key(1), (rows, width), 2, VOCAB)
    mask = jnp.asarray(np.arange(width)[None] >= np.array([0, 3, 6, 1][:rows])[:, None], jnp.int32)
    return ids, mask


def test_read_widths_cover_each_step_and_no_more():
    # Steps [1, 40) in blocks of 16 after a 10-slot prompt: step s attends to slots [0, 10 + s).
    assert rollout.read_widths(10, 40, 16) == [(16, 26), (32, 42), (40, 50)]
    assert rollout.read_widths(10, 16, 16) == [(16, 26)]
    assert rollout.read_widths(10, 5, 128) == [(5, 15)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_blocked_decode_reads_give_the_full_budget_tokens(temperature, scan_layers):
    model = _model(scan_layers=scan_layers)
    params = models.init_params(model, jax.random.key(0))
    ids, mask = _prompts()
    run = functools.partial(rollout.generate, model, params, ids, mask, key=jax.random.key(2), max_new_tokens=70,
                            temperature=temperature, eos_id=1, pad_id=0)
    full, blocked = run(decode_block=70), run(decode_block=8)
    np.testing.assert_array_equal(blocked.tokens, full.tokens)
    np.testing.assert_array_equal(blocked.mask, full.mask)
    np.testing.assert_allclose(blocked.logprobs, full.logprobs, atol=1e-6)
    assert int(np.asarray(full.mask).sum(1).max()) > 40  # the rows outlive several blocks


def test_the_sampler_casts_bfloat16_weights_once_not_per_step():
    """bfloat16 compute over float32 parameters: every kernel is cast before the decode loop, so
    no cast of a weight runs inside it; the logprobs are those of float32 weights at bfloat16
    tolerance."""
    model = _model(dtype="bfloat16")
    params = _params()
    ids, mask = _prompts()
    sample = lambda p: rollout.generate(model, p, ids, mask, key=jax.random.key(2), max_new_tokens=12,
                                         temperature=0.8, eos_id=1, pad_id=0)
    jaxpr = jax.make_jaxpr(sample)(params)
    kernel_shapes = {tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim >= 2}

    def casts_of_weights(eqns, inside_loop):
        found = 0
        for eqn in eqns:
            if eqn.primitive.name == "convert_element_type" and inside_loop:
                if tuple(eqn.invars[0].aval.shape) in kernel_shapes and eqn.invars[0].aval.dtype == jnp.float32:
                    found += 1
            for sub in jax.core.jaxprs_in_params(eqn.params):
                found += casts_of_weights(sub.eqns, inside_loop or eqn.primitive.name == "while")
        return found

    assert casts_of_weights(jaxpr.jaxpr.eqns, False) == 0
    out = sample(params)
    fp32 = rollout.generate(_model(), params, ids, mask, key=jax.random.key(2), max_new_tokens=12,
                             temperature=0.8, eos_id=1, pad_id=0)
    columns_alike = (np.asarray(out.tokens) == np.asarray(fp32.tokens)).all(0)
    first_difference = columns_alike.size if columns_alike.all() else int(np.argmin(columns_alike))
    assert first_difference > 0
    valid = np.asarray(fp32.mask, bool)[:, :first_difference]
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, :first_difference][valid],
                               np.asarray(fp32.logprobs)[:, :first_difference][valid], atol=5e-2)


def test_max_lengths_stop_each_row_where_prescribed_in_both_engines():
    model, params = _model(), _params()
    ids, mask = _prompts()
    lengths = jnp.asarray([5, 1, 17, 9], jnp.int32)
    for slots in (None, 2):
        out = rollout.generate(model, params, ids, mask, key=jax.random.key(3), max_new_tokens=20,
                                temperature=0.8, eos_id=1, pad_id=0,
                                decode_slots=slots, max_lengths=lengths)
        got = np.asarray(out.mask).sum(1)
        ended = np.asarray(out.tokens)[np.arange(4), got - 1] == 1
        assert np.all((got == np.asarray(lengths)) | ended), (slots, got)
    with pytest.raises(ValueError, match=r"max_lengths must be in \[1, max_new_tokens=20\]; rows \[1\]"):
        rollout.generate(model, params, ids, mask, key=jax.random.key(3), max_new_tokens=20, temperature=0.8,
                          eos_id=1, pad_id=0, max_lengths=jnp.asarray([5, 0, 3, 3]))


def test_gpu_flags_are_set_on_gpus_only_and_never_over_the_users():
    environ = {}
    assert xla_flags.apply(environ, gpu=False) == [] and "XLA_FLAGS" not in environ
    added = xla_flags.apply(environ, gpu=True)
    assert added == ["--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"]
    assert environ["XLA_FLAGS"] == added[0]
    user = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"}
    assert xla_flags.apply(user, gpu=True) == []
    assert user["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"
    other = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.apply(other, gpu=True)
    assert other["XLA_FLAGS"].startswith("--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer=")
    assert xla_flags.apply({"JAX_PLATFORMS": "cpu"}) == []  # no GPU here, and CPU asked for anyway


def test_gpu_flags_opt_out_from_the_config():
    from marl_jax.config_check import validate_config
    from train_util import tiny_config

    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_flags.apply(environ, gpu=True, mode="none") == []
    assert environ == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    validate_config(tiny_config(**{"model.xla_gpu_flags": "none"}))
    with pytest.raises(ValueError) as error:
        validate_config(tiny_config(**{"model.xla_gpu_flags": "off"}))
    assert str(error.value) == "config.model.xla_gpu_flags='off': must be one of ('auto', 'none')"


def test_refill_prefills_under_vmap_only_when_some_run_needs_them():
    """The slots' staged prefill is a branch taken at the iterations that need it; under vmap
    over runs a `lax.cond` would become a select running it at every iteration of every run."""
    calls = []

    def run(key):
        model, params = _model(), _params()
        ids, mask = _prompts(4)

        def prefill(unit_ids):
            jax.debug.callback(lambda: calls.append(1))
            return engine._prefill(model, engine.decode_fn(model, params), jnp.take(ids, unit_ids, 0),
                                     jnp.take(mask, unit_ids, 0), 16)

        choose = functools.partial(engine.choose_tokens, temperature=jnp.float32(0.8), top_p=jnp.float32(1.0), top_k=0,
                                   greedy=False, dynamic_temperature=False, use_top_p=False)
        return slot_engine.sample(
            prefill, engine.decode_fn(model, params), choose, engine._slot_draws(key, None), units=4, samples=1,
            slots=2, steps=16, context_width=10, eos_ids=(1,), pad_id=0, unit_order=jnp.arange(4, dtype=jnp.int32),
            live_units=4, offsets=jnp.zeros((4,), jnp.int32), remaining=jnp.full((4,), 16, jnp.int32), batch_axis=0,
            logits_width=VOCAB)

    keys = jax.random.split(jax.random.key(4), 2)
    singles = []
    for key in keys:
        calls.clear()
        jax.block_until_ready(jax.jit(run)(key))
        singles.append(len(calls))
    calls.clear()
    out = jax.block_until_ready(jax.jit(jax.vmap(run))(keys))
    vmapped = len(calls)
    iterations = int(np.asarray(out.mask).sum(-1).max())  # a lower bound of the loop's iterations
    print(singles, vmapped, iterations)
    assert singles == [4, 4]  # one unit staged at a time (2 slots, 1 sample): one prefill a unit
    assert vmapped <= sum(singles) and vmapped < iterations


def test_vmapped_step_keeps_the_first_steps_pass_a_branch():
    """`old_logprobs=sampler` in bfloat16 scores with the trainer at the first step only: with
    the runs' one unbatched flag the vmapped step keeps that pass a `cond`."""
    from test_rollout_mismatch import _setup

    static, mods, state, frozen, ids, mask = _setup("bfloat16", old_logprobs="sampler")
    states = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    ids2, mask2 = jnp.stack([ids, ids]), jnp.stack([mask, mask])

    def primitives(jaxpr):
        names = set()
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jax.core.jaxprs_in_params(eqn.params):
                names |= primitives(sub)
        return names

    def step(first_from_runs):
        def run(st, i, m, first):
            return core.rollout_phase(static, mods, st, frozen, i, m, None, first)[1]

        def all_runs(st, i, m):
            first = None if first_from_runs else st.step[0] == 0
            return jax.vmap(run, in_axes=(0, 0, 0, None))(st, i, m, first)

        return jax.make_jaxpr(all_runs)(states, ids2, mask2).jaxpr

    assert "cond" in primitives(step(first_from_runs=False))
    assert "cond" not in primitives(step(first_from_runs=True))  # the batched predicate: a select


def test_slots_that_cannot_refill_are_refused_at_config_time():
    from marl_jax import config_check

    config = tiny_config(**{"ppo.rollout_chunks": 4, "ppo.decode_slots": 2})
    with pytest.raises(ValueError) as error:
        config_check.validate_config(config)
    assert str(error.value) == ("config.ppo.decode_slots=2: must be below the 2 responses of one rollout chunk "
                                "(ppo.batch_size=8 / ppo.rollout_chunks=4) to refill slots; use at most 1 or 0 "
                                "(one static batch)")


def test_unrolling_the_layer_scan_changes_no_token():
    model = _model(scan_layers=True)
    params = models.init_params(model, jax.random.key(0))
    ids, mask = _prompts()
    run = lambda m: rollout.generate(m, params, ids, mask, key=jax.random.key(2), max_new_tokens=20,
                                      temperature=0.8, eos_id=1, pad_id=0)
    base, unrolled = run(model), run(_model(scan_layers=True, scan_unroll=2))
    np.testing.assert_array_equal(unrolled.tokens, base.tokens)
    np.testing.assert_allclose(unrolled.logprobs, base.logprobs, atol=1e-6)
    with pytest.raises(ValueError, match=r"ModelConfig.scan_unroll must be an int in \[1, num_layers=2\]"):
        _model(scan_unroll=3)


def _reachable(hlo_text: str, roots) -> dict:
    """{computation: its instruction lines} of `roots` and every computation they call."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    seen, todo = {}, list(roots)
    while todo:
        current = todo.pop()
        if current in seen or current not in comps:
            continue
        seen[current] = comps[current]
        for line in comps[current]:
            todo += re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += re.findall(r"%?([\w.-]+)", group)
    return seen


@pytest.mark.parametrize("scan_layers, layout", [(True, "train"), (False, "train"), (False, "fused")])
def test_decode_loop_updates_the_cache_in_place(scan_layers, layout):
    """No decode step of the sampler's compiled program copies a whole KV cache (a layer's
    `[B, K, S, H]`, or the stacked `[L, B, K, S, H]`): the loops write each new slot into the
    cache they carry."""
    model = _model(scan_layers=scan_layers, sampler_layout=layout)
    params = models.init_params(model, jax.random.key(0))
    ids, mask = _prompts()
    program = jax.jit(lambda p: rollout.generate(model, p, ids, mask, key=jax.random.key(2), max_new_tokens=20,
                                                 temperature=0.8, top_k=5, eos_id=1, pad_id=0))
    hlo = program.lower(params).compile().as_text()
    layer = "f32[4,2,30,8]"  # 4 rows, 2 KV heads, 10 prompt + 20 new slots, head_dim 8
    cache = "f32[2,4,2,30,8]" if scan_layers else layer
    assert cache in hlo
    loops = re.findall(r"\bwhile\(.*?body=%?([\w.-]+)", hlo)
    assert loops
    in_loops = [line.strip()[:160] for lines in _reachable(hlo, loops).values() for line in lines
                if re.search(r"copy\(", line) and (cache + "{") in line.split("copy(")[0]]
    assert not in_loops, in_loops
