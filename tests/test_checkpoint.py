"""Checkpointer: round trip of a sharded training state across meshes, resume, atomicity under SIGKILL."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from marl_jax.train import checkpoint, metrics, sharding
import process_util
import train_infra_util as util

KILL_TIMEOUT_S = 120


def _mesh(data, fsdp, tensor):
    return sharding.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor})


def _state_shardings(mesh, logical, params, optimizer):
    param_shardings = sharding.logical_to_sharding(logical, mesh, shapes=params)
    return {
        "params": param_shardings,
        "opt_state": sharding.opt_state_shardings(optimizer, param_shardings, mesh, params=params),
        "rng": sharding.replicated(mesh),
        "data_position": None,
        "epoch": None,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state trained one step on fsdp=4 x tensor=2, saved at step 7."""
    model, params, logical, ids = util.init_model()
    optimizer = util.make_optimizer()
    mesh = _mesh(1, 4, 2)
    shardings = _state_shardings(mesh, logical, params, optimizer)
    params = sharding.shard_pytree(params, shardings["params"])
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    params, opt_state, _ = jax.jit(util.make_train_step(model, optimizer))(params, opt_state, ids)
    key = jax.random.fold_in(jax.random.key(3), 11)
    state = {
        "params": params,
        "opt_state": opt_state,
        "rng": sharding.shard_pytree(jax.random.key_data(key), sharding.replicated(mesh)),
        "data_position": 2**40 + 5,
        "epoch": np.int32(2),
    }
    metadata = {"stage": "sft", "config": {"seed": 3, "mesh": {"data": 1, "fsdp": 4, "tensor": 2}},
                "data_position": 2**40 + 5, "lr": 1e-2}
    directory = checkpoint.checkpoint_dir(tmp_path_factory.mktemp("run"), "sft")
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, state, metadata) is True
        ckpt.wait()
    host_state = jax.device_get(state)
    return dict(directory=directory, state=state, host=host_state, metadata=metadata, key=key,
                logical=logical, optimizer=optimizer, params_shape=jax.eval_shape(lambda: params))


def _assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_dir_layout(tmp_path):
    assert checkpoint.checkpoint_dir(tmp_path, "ppo") == os.path.join(tmp_path, "checkpoints", "ppo")
    assert checkpoint.checkpoint_dir("gs://bucket/run/", "rm") == "gs://bucket/run/checkpoints/rm"


def test_restore_onto_a_different_mesh(saved):
    mesh = _mesh(2, 2, 2)
    abstract = {
        "params": saved["params_shape"],
        "opt_state": jax.eval_shape(saved["optimizer"].init, saved["params_shape"]),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "data_position": 0,
        "epoch": np.int32(0),
    }
    shardings = _state_shardings(mesh, saved["logical"], saved["params_shape"], saved["optimizer"])
    with checkpoint.Checkpointer(saved["directory"]) as ckpt:
        assert ckpt.latest_step() == 7
        state, metadata = ckpt.restore(abstract_state=abstract, shardings=shardings)
    assert metadata == saved["metadata"]
    _assert_tree_equal(state, saved["host"])
    assert type(state["data_position"]) is int and state["data_position"] == 2**40 + 5
    assert type(state["epoch"]) is np.int32
    kernel = state["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert {s.data.shape for s in kernel.addressable_shards} == {(util.EMBED // 2, util.MLP // 2)}
    assert state["opt_state"][1][0].nu["Dense_1"]["kernel"].sharding == NamedSharding(
        mesh, P("tensor", "fsdp"))
    assert int(state["opt_state"][1][0].count) == 1
    # The restored key data continues the same random stream.
    key = jax.random.wrap_key_data(state["rng"])
    np.testing.assert_array_equal(jax.random.uniform(key, (4,)),
                                  jax.random.uniform(saved["key"], (4,)))


def test_restore_with_sharded_abstract_leaves_and_as_saved(saved):
    single = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single),
                            {"params": saved["params_shape"]})
    abstract.update(opt_state=jax.eval_shape(saved["optimizer"].init, saved["params_shape"]),
                    rng=jnp.zeros(2, jnp.uint32), data_position=0, epoch=np.int32(0))
    with checkpoint.Checkpointer(saved["directory"]) as ckpt:
        state, _ = ckpt.restore(7, abstract_state=abstract)
        as_saved, metadata = ckpt.restore()
    _assert_tree_equal(state, saved["host"])
    assert state["params"]["embedding"].sharding == single
    assert metadata == saved["metadata"]
    np.testing.assert_array_equal(as_saved["params"]["Dense_0"]["kernel"],
                                  saved["host"]["params"]["Dense_0"]["kernel"])
    assert as_saved["params"]["Dense_0"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_errors(tmp_path, saved):
    with checkpoint.Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpt.restore()
        with pytest.raises(ValueError, match="metadata is not JSON-serialisable"):
            ckpt.save(1, {"x": jnp.zeros(2)}, {"bad": object()})
        with pytest.raises(ValueError, match="metadata is not JSON-serialisable"):
            ckpt.save(1, {"x": jnp.zeros(2)}, {"bad": float("nan")})
        with pytest.raises(ValueError, match=r"state\['rng'\] is a typed PRNG key"):
            ckpt.save(1, {"rng": jax.random.key(0)}, {})
        with pytest.raises(ValueError, match="step=-1"):
            ckpt.save(-1, {"x": jnp.zeros(2)}, {})
        assert ckpt.latest_step() is None
    with checkpoint.Checkpointer(saved["directory"]) as ckpt:
        with pytest.raises(FileNotFoundError, match=r"step=3 .*available: \[7\]"):
            ckpt.restore(3)
        with pytest.raises(ValueError, match="shardings needs abstract_state"):
            ckpt.restore(shardings={"x": sharding.replicated(_mesh(1, 4, 2))})
    with pytest.raises(ValueError, match="max_to_keep=0"):
        checkpoint.Checkpointer(tmp_path / "x", max_to_keep=0)


def test_max_to_keep_and_existing_steps(tmp_path):
    directory = tmp_path / "ckpt"
    with checkpoint.Checkpointer(directory, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, {"w": jnp.full((3,), float(step))}, {"step": step})
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.save(3, {"w": jnp.zeros(3)}, {"step": -1}) is False
    assert sorted(os.listdir(directory)) == ["2", "3"]
    with checkpoint.Checkpointer(directory, max_to_keep=2) as ckpt:
        state, metadata = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
        assert metadata == {"step": 3}
        np.testing.assert_array_equal(state["w"], [3.0, 3.0, 3.0])
        state, metadata = ckpt.restore(2, abstract_state={"w": jnp.zeros(3)})
        np.testing.assert_array_equal(state["w"], [2.0, 2.0, 2.0])


@pytest.mark.parametrize("step, every, final, expected", [
    (0, 10, 100, False), (10, 10, 100, True), (15, 10, 100, False), (100, 10, 100, True),
    (7, 0, 7, True), (5, 0, 7, False), (3, 3, 4, True), (4, 3, 4, True),
])
def test_should_save(step, every, final, expected):
    assert checkpoint.should_save(step, every, final) is expected


def test_should_save_rejects_negative_interval():
    with pytest.raises(ValueError, match="every=-1"):
        checkpoint.should_save(3, -1, 10)


_KILLED_WRITER = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    import numpy as np
    from marl_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, {"w": jnp.arange(4.0)}, {"step": 1})
    ckpt.wait()
    big = jnp.asarray(np.random.default_rng(0).random(12 * 1024 * 1024, dtype=np.float32))
    print("step 1 saved", flush=True)
    ckpt.save(2, {"w": big}, {"step": 2})
    ckpt.wait()
    print("step 2 saved", flush=True)
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = process_util.cpu_env(1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(directory)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "step 1 saved\n", proc.stderr.read()[-3000:]
        deadline = time.monotonic() + KILL_TIMEOUT_S
        tmp_dirs = []
        while not tmp_dirs and time.monotonic() < deadline and proc.poll() is None:
            tmp_dirs = [n for n in os.listdir(directory) if n.startswith("2.orbax-checkpoint-tmp")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=KILL_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    # The kill landed during the write: the step is still in its temporary directory.
    names = os.listdir(directory)
    assert "2" not in names and "1" in names
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names

    with checkpoint.Checkpointer(directory, read_only=True) as view:
        assert view.latest_step() == 1
        with pytest.raises(ValueError, match="read_only"):
            view.save(3, {"w": jnp.ones(4)}, {})
    assert sorted(os.listdir(directory)) == sorted(names)  # a read-only view cleans nothing

    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        state, metadata = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
        np.testing.assert_array_equal(state["w"], np.arange(4.0))
        assert metadata == {"step": 1}
        assert not any("tmp" in n for n in os.listdir(directory))
        assert ckpt.save(2, {"w": jnp.ones(4)}, {"step": 2})
        assert ckpt.latest_step() == 2


def test_arrays_may_be_donated_right_after_save(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        w = jnp.arange(100_000, dtype=jnp.float32)
        ckpt.save(1, {"w": w}, {})
        w.delete()  # what donating the state to the next train step does
        state, _ = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((100_000,), jnp.float32)})
    np.testing.assert_array_equal(state["w"], np.arange(100_000, dtype=np.float32))


_TWO_PROCESS_WORKER = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id, port, directory, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    from marl_jax.train import checkpoint, metrics, sharding

    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 2})
    full = np.arange(32, dtype=np.float32).reshape(8, 4)
    spec = NamedSharding(mesh, P("fsdp", "tensor"))
    w = jax.make_array_from_callback(full.shape, spec, lambda index: full[index])
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.save(5, {"w": w, "position": 123}, {"stage": "sft", "position": 123})
        ckpt.wait()
        other = NamedSharding(mesh, P("tensor", "fsdp"))
        state, meta = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct(full.shape, np.float32),
                                                   "position": 0},
                                   shardings={"w": other, "position": None})
    assert meta == {"stage": "sft", "position": 123} and state["position"] == 123
    for shard in state["w"].addressable_shards:
        np.testing.assert_array_equal(shard.data, full[shard.index])
    with metrics.MetricsWriter(workdir) as writer:
        writer.write({"stage": "sft", "step": 5, "process": process_id})
    print("worker ok", flush=True)
""")


def test_two_processes_save_one_checkpoint_and_one_metrics_row(tmp_path):
    directory, workdir = tmp_path / "ckpt", tmp_path / "run"
    port = process_util.free_port()
    env = process_util.cpu_env(4)
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_WORKER, str(i), str(port),
                               str(directory), str(workdir)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=KILL_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, proc in enumerate(procs):
        assert proc.returncode == 0 and "worker ok" in outputs[i], outputs[i][-3000:]
    assert metrics.read_metrics(workdir) == [{"stage": "sft", "step": 5, "process": 0}]

    mesh = _mesh(2, 2, 2)
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [5]
        state, meta = ckpt.restore(
            abstract_state={"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "position": 0},
            shardings={"w": NamedSharding(mesh, P(("data", "fsdp"))), "position": None})
    np.testing.assert_array_equal(state["w"], np.arange(32, dtype=np.float32).reshape(8, 4))
    assert state["position"] == 123 and meta["position"] == 123
