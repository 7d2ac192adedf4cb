"""marl_jax.distributed: settings validation, TPU host detection, and a real two-process JAX run.

The two-process test starts this file as a script twice (4 fake CPU devices each, gloo
collectives, a coordinator on a free localhost port); together they form one 8-device mesh, feed
their own rows of a global batch, run jitted global reductions, and write one orbax checkpoint
that this (single) pytest process, with 8 fake devices, restores.
"""
import json
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from marl_jax import distributed

import process_util

GLOBAL_BATCH = 16
FEATURES = 6
HIDDEN = 4
BATCH_SPEC = PartitionSpec(("data", "fsdp"))
WORKER_TIMEOUT_S = 90


def global_inputs():
    """The global batch `[16, 6]` and a weight `[6, 4]`, the same on every process."""
    x = (np.arange(GLOBAL_BATCH * FEATURES, dtype=np.float32).reshape(GLOBAL_BATCH, FEATURES)
         / 10.0 - 3.0)
    w = np.sin(np.arange(FEATURES * HIDDEN, dtype=np.float32)).reshape(FEATURES, HIDDEN)
    return x, w


def run_worker(process_id, port, checkpoint_path, out_path):
    """One process of the two-process run; writes what it observed as JSON to `out_path`."""
    import orbax.checkpoint as ocp

    from marl_jax.train import sharding

    settings = {"coordinator": f"localhost:{port}", "num_processes": 2, "process_id": process_id}
    first = distributed.initialize(ml_collections.ConfigDict(settings))
    second = distributed.initialize(settings)
    try:
        distributed.initialize({**settings, "coordinator": f"localhost:{port + 1}"})
        reinit_error = ""
    except RuntimeError as err:
        reinit_error = str(err)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    batch_sharding = sharding.batch_sharding(mesh)
    rows = distributed.local_batch_slice(GLOBAL_BATCH, sharding=batch_sharding)
    x, w = global_inputs()
    batch = distributed.host_local_to_global({"x": x[rows]}, mesh, BATCH_SPEC)
    weight = distributed.host_local_to_global(w, mesh, PartitionSpec(None, "tensor"))

    total = jax.jit(lambda b: jnp.sum(b["x"]))(batch)

    def shard_mean(block):
        return jax.lax.psum(jnp.sum(block), ("data", "fsdp")) / (GLOBAL_BATCH * FEATURES)

    psum_mean = jax.jit(jax.shard_map(shard_mean, mesh=mesh, in_specs=BATCH_SPEC,
                                      out_specs=PartitionSpec()))(batch["x"])
    hidden = jax.jit(lambda b, k: jnp.tanh(b["x"] @ k))(batch, weight)
    hidden_mean = jax.jit(jnp.mean)(hidden)
    local_hidden = distributed.global_to_host_local(hidden)
    local_scalars = distributed.global_to_host_local({"total": total, "mean": psum_mean})

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(checkpoint_path, {"x": batch["x"], "hidden": hidden, "w": weight})
    checkpointer.wait_until_finished()
    distributed.sync("checkpoint_written")

    report = {
        "initialize": [first, second],
        "reinit_error": reinit_error,
        "process_index": distributed.process_index(),
        "process_count": distributed.process_count(),
        "is_main_process": distributed.is_main_process(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "rows": [rows.start, rows.stop],
        "even_rows": [distributed.local_batch_slice(GLOBAL_BATCH).start,
                      distributed.local_batch_slice(GLOBAL_BATCH).stop],
        "global_shape": list(batch["x"].shape),
        "sum": float(np.asarray(total)),
        "psum_mean": float(np.asarray(psum_mean)),
        "hidden_mean": float(np.asarray(hidden_mean)),
        "local_hidden": local_hidden.tolist(),
        "local_scalars": {k: float(v) for k, v in local_scalars.items()},
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Runs the two workers to completion; returns (reports by process id, checkpoint path)."""
    root = tmp_path_factory.mktemp("two_process")
    checkpoint_path = root / "checkpoint"
    port = process_util.free_port()
    process_util.run_processes(
        [[sys.executable, __file__, "--worker", str(i), str(port), str(checkpoint_path),
          str(root / f"report{i}.json")] for i in range(2)],
        process_util.cpu_env(4), root, WORKER_TIMEOUT_S)
    reports = [json.loads((root / f"report{i}.json").read_text()) for i in range(2)]
    return reports, checkpoint_path


def test_two_processes_form_one_mesh(two_process_run):
    reports, _ = two_process_run
    for i, report in enumerate(reports):
        assert report["initialize"] == [True, True]
        assert "already initialised" in report["reinit_error"]
        assert report["process_index"] == i
        assert report["process_count"] == 2
        assert report["is_main_process"] == (i == 0)
        assert report["device_count"] == 8
        assert report["local_device_count"] == 4
        assert report["global_shape"] == [GLOBAL_BATCH, FEATURES]
    # make_mesh orders devices by process, so each process owns one half of the batch.
    assert reports[0]["rows"] == [0, 8] and reports[1]["rows"] == [8, 16]
    assert [r["even_rows"] for r in reports] == [[0, 8], [8, 16]]


def test_global_reductions_match_single_process_numbers(two_process_run):
    reports, _ = two_process_run
    x, w = global_inputs()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    hidden = np.tanh(x64 @ w64)
    for report in reports:
        np.testing.assert_allclose(report["sum"], x64.sum(), rtol=1e-6)
        np.testing.assert_allclose(report["psum_mean"], x64.mean(), rtol=1e-6)
        np.testing.assert_allclose(report["hidden_mean"], hidden.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(report["local_scalars"]["total"], x64.sum(), rtol=1e-6)
        np.testing.assert_allclose(report["local_scalars"]["mean"], x64.mean(), rtol=1e-6)
        start, stop = report["rows"]
        np.testing.assert_allclose(np.array(report["local_hidden"]), hidden[start:stop],
                                   rtol=1e-5, atol=1e-6)


def test_two_process_checkpoint_restores_in_one_process(two_process_run):
    _, checkpoint_path = two_process_run
    import orbax.checkpoint as ocp

    assert jax.process_count() == 1 and jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("rows", "cols"))
    x, w = global_inputs()
    target = {
        "x": jax.ShapeDtypeStruct(x.shape, np.float32, sharding=NamedSharding(mesh, PartitionSpec("rows", "cols"))),
        "hidden": jax.ShapeDtypeStruct((GLOBAL_BATCH, HIDDEN), np.float32,
                                       sharding=NamedSharding(mesh, PartitionSpec(("rows", "cols")))),
        "w": jax.ShapeDtypeStruct(w.shape, np.float32, sharding=NamedSharding(mesh, PartitionSpec())),
    }
    restored = ocp.StandardCheckpointer().restore(checkpoint_path, target)
    np.testing.assert_array_equal(np.asarray(restored["x"]), x)
    np.testing.assert_array_equal(np.asarray(restored["w"]), w)
    np.testing.assert_allclose(np.asarray(restored["hidden"]),
                               np.tanh(x.astype(np.float64) @ w.astype(np.float64)),
                               rtol=1e-5, atol=1e-6)
    assert restored["x"].sharding.spec == PartitionSpec("rows", "cols")


@pytest.mark.parametrize("settings, field", [
    ({"coordinator": "localhost:1234"}, "config.distributed.num_processes"),
    ({"coordinator": "localhost:1234", "num_processes": 2}, "config.distributed.process_id"),
    ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": 2},
     "config.distributed.process_id"),
    ({"coordinator": "localhost:1234", "num_processes": 0, "process_id": 0},
     "config.distributed.num_processes"),
    ({"num_processes": 2, "process_id": 0}, "config.distributed.coordinator"),
    ({"process_id": 1}, "config.distributed.coordinator"),
    ({"coordinator": "localhost", "num_processes": 2, "process_id": 0},
     "config.distributed.coordinator"),
    ({"coordinator": "localhost:70000", "num_processes": 2, "process_id": 0},
     "config.distributed.coordinator"),
    ({"coordinator": 1234}, "config.distributed.coordinator"),
    ({"num_processes": -1}, "config.distributed.num_processes"),
    ({"coordinator": "h:1", "num_processes": 2.0, "process_id": 0},
     "config.distributed.num_processes"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": True}, "config.distributed.process_id"),
    ({"num_process": 2}, "num_process"),
])
def test_invalid_settings_name_the_field(settings, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        distributed.parse_settings(settings)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        distributed.initialize(settings)


def test_settings_from_configdict_and_mapping():
    config = ml_collections.ConfigDict(
        {"coordinator": "10.0.0.2:8476", "num_processes": 4, "process_id": 3})
    assert distributed.parse_settings(config) == distributed.DistributedSettings("10.0.0.2:8476", 4, 3)
    assert distributed.parse_settings({"coordinator": "", "num_processes": 0, "process_id": -1}) == (
        distributed.DistributedSettings())
    assert distributed.parse_settings(None) == distributed.DistributedSettings()
    assert not distributed.parse_settings(None).explicit
    with pytest.raises(TypeError, match="config.distributed"):
        distributed.parse_settings(["localhost:1234", 2, 0])


def test_auto_mode_off_tpu_does_nothing(monkeypatch):
    monkeypatch.setattr(distributed, "_initialized", None)
    # A stray hostname list alone must not start a runtime on a machine without TPU chips.
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "worker-0,worker-1")
    assert distributed.tpu_process_count() == 1
    assert distributed.initialize() is False
    assert distributed.initialize(ml_collections.ConfigDict(
        {"coordinator": "", "num_processes": 0, "process_id": -1})) is False
    assert not jax.distributed.is_initialized()
    assert distributed.process_count() == 1 and distributed.process_index() == 0
    assert distributed.is_main_process()
    distributed.sync("single_process_is_a_no_op")


def test_explicit_settings_after_jax_started_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(distributed, "_initialized", None)
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        distributed.initialize({"coordinator": f"localhost:{process_util.free_port()}", "num_processes": 1,
                                "process_id": 0})
    assert not jax.distributed.is_initialized()


def _metadata(values):
    def read(key):
        return values.get(key)
    return read


def _no_metadata(key):
    raise AssertionError(f"metadata server queried for {key!r}")


@pytest.mark.parametrize("environ, chips, metadata, expected", [
    ({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, 0, _no_metadata, 1),
    ({}, 4, _metadata({"worker-network-endpoints": "t1v-n-0-w-0"}), 1),
    ({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, 4, _no_metadata, 4),
    ({"TPU_PROCESS_ADDRESSES": "a:8471,b:8471", "TPU_WORKER_HOSTNAMES": "a,b,c,d"}, 4,
     _no_metadata, 2),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "MEGASCALE_NUM_SLICES": "2"}, 4, _no_metadata, 4),
    ({"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "2"}, 4, _no_metadata, 2),
    ({}, 4, _metadata({"worker-network-endpoints": "x:y:10.0.0.1,x:y:10.0.0.2",
                       "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\nMEGASCALE_NUM_SLICES: '3'\n"}), 6),
    ({}, 4, _metadata({"worker-network-endpoints": "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4"}), 4),
    ({"TPU_SKIP_MDS_QUERY": "1"}, 4, _no_metadata, 1),
])
def test_tpu_process_count(environ, chips, metadata, expected):
    assert distributed.tpu_process_count(environ, tpu_chips=chips, metadata=metadata) == expected


def test_tpu_chips_are_counted_on_the_pci_bus(tmp_path):
    """Four v4 chips and a v5e chip count; a Google network card, another vendor's device with
    a TPU's device id, and a device whose files cannot be read do not."""
    devices = {"0000:00:04.0": ("0x1ae0", "0x005e"), "0000:00:05.0": ("0x1ae0", "0x005e"),
               "0000:00:06.0": ("0x1ae0", "0x005e"), "0000:00:07.0": ("0x1ae0", "0x005e"),
               "0000:00:08.0": ("0x1ae0", "0x0063"), "0000:00:03.0": ("0x1ae0", "0x0042"),
               "0000:00:09.0": ("0x10de", "0x005e")}
    for name, (vendor, device) in devices.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    (tmp_path / "0000:00:0a.0").mkdir()
    assert distributed._local_tpu_chip_count(str(tmp_path)) == 5
    assert distributed._local_tpu_chip_count(str(tmp_path / "absent")) == 0


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_local_batch_slice_single_process(mesh8):
    assert distributed.local_batch_slice(12) == slice(0, 12)
    assert distributed.local_batch_slice(
        8, sharding=NamedSharding(mesh8, PartitionSpec(("data", "fsdp"), None))) == slice(0, 8)
    with pytest.raises(ValueError, match="global_batch_size=6"):
        distributed.local_batch_slice(6, sharding=NamedSharding(mesh8, PartitionSpec(("data", "fsdp"))))
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="global_batch_size"):
            distributed.local_batch_slice(bad)


def test_host_local_round_trip_single_process(mesh8):
    tree = {"ids": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
            "mask": (np.arange(8 * 4 * 2) % 3 == 0).reshape(8, 4, 2),
            "score": np.float32(2.5)}
    specs = {"ids": PartitionSpec(("data", "fsdp")), "mask": PartitionSpec("data", "tensor"),
             "score": PartitionSpec()}
    global_tree = distributed.host_local_to_global(tree, mesh8, specs)
    assert global_tree["ids"].sharding.spec == specs["ids"]
    assert global_tree["mask"].sharding.spec == specs["mask"]
    back = distributed.global_to_host_local(global_tree)
    for key, value in tree.items():
        assert back[key].dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(back[key], value)
    one_spec = distributed.host_local_to_global({"a": tree["ids"], "b": tree["ids"] + 1}, mesh8,
                                                PartitionSpec("fsdp"))
    np.testing.assert_array_equal(np.asarray(one_spec["b"]), tree["ids"] + 1)
    with pytest.raises(ValueError, match="pspec"):
        distributed.host_local_to_global(tree, mesh8, {"ids": PartitionSpec()})


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    run_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
