"""The pipeline over several JAX processes: the same numbers as one process, checkpoints that
resume elsewhere, one writer; and the multi-slice mesh, the global-array helpers and the
accelerator dtype default.

The two-process run starts `experiments/run.py` twice (4 fake CPU devices each, gloo
collectives, a coordinator on a free localhost port) with the `train_util.tiny_config` sizes,
SFT -> RM -> 2 PPO steps on one 8-device `fsdp=8` mesh. A single process with 8 fake devices and
the same flags runs the reference (3 PPO steps), then resumes a copy of the two-process workdir
from its step-2 checkpoint to step 3. Both single-process runs share a JAX compilation cache
(compiling the same programs, they differ only in where the state comes from). XLA's CPU backend
optimisations are switched off in every process alike, which makes compiling several times
faster and changes no number beyond float tolerance.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file

from marl_jax import distributed
from marl_jax.data import batches
from marl_jax.train import build, sharding
from marl_jax.train.metrics import read_metrics

import process_util
from train_util import ROOT, tiny_config, tiny_flags

RUN_PY = str(ROOT / "experiments" / "run.py")
TWO_PROCESS_TIMEOUT_S = 240
SINGLE_PROCESS_TIMEOUT_S = 150
RTOL = 2e-3


def _env(devices, **extra):
    return process_util.cpu_env(devices, **extra)


def _run_two_processes(workdir, logdir, flags):
    port = process_util.free_port()
    return process_util.run_processes(
        [[sys.executable, RUN_PY, f"--workdir={workdir}", *flags,
          f"--config.distributed.coordinator=localhost:{port}",
          "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"]
         for i in range(2)], _env(4), logdir, TWO_PROCESS_TIMEOUT_S)


def _run_single(workdir, flags, cache):
    proc = subprocess.run([sys.executable, RUN_PY, f"--workdir={workdir}", *flags],
                          env=_env(8, JAX_COMPILATION_CACHE_DIR=str(cache),
                                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=SINGLE_PROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(two-process workdir, its logs, reference workdir, resumed copy of the two-process one)."""
    root = tmp_path_factory.mktemp("multihost")
    flags = tiny_flags(**{"mesh.fsdp": 8, "checkpoint_every": 1000})
    two, reference, resumed = root / "two", root / "reference", root / "resumed"
    logs = _run_two_processes(two, root, flags + ["--config.ppo.steps=2"])
    shutil.copytree(two, resumed)
    cache = root / "compilation_cache"
    _run_single(reference, flags + ["--config.ppo.steps=3"], cache)
    _run_single(resumed, flags + ["--config.ppo.steps=3"], cache)
    return two, logs, reference, resumed


def _assert_rows_close(got, want):
    assert [(r["stage"], r["step"]) for r in got] == [(r["stage"], r["step"]) for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), (g["stage"], g["step"])
        for key in w:
            if key.startswith(("timing/", "perf/")) or key == "stage":
                continue
            np.testing.assert_allclose(g[key], w[key], rtol=RTOL, atol=RTOL * 1e-2,
                                       err_msg=f"{g['stage']} step {g['step']} {key}")


def test_two_processes_log_the_single_process_metrics_once(runs):
    two, logs, reference, _ = runs
    rows, want = read_metrics(two), read_metrics(reference)
    # Process 0 alone writes: each (stage, step) once, in the single-process order.
    keys = [(r["stage"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert [k for k in keys if k[0] == "ppo"] == [("ppo", 1), ("ppo", 2)]
    assert [k for k in keys if k[0] == "eval"] == [("eval", 0), ("eval", 2)]
    _assert_rows_close(rows, [r for r in want if (r["stage"], r["step"]) in set(keys)])
    # Both processes ran all three stages; only process 0 prints the closing summary.
    assert "[ppo]" in logs[0] and "[ppo]" not in logs[1]


def test_exports_and_reward_stats_are_gathered_from_both_processes(runs):
    two, _, reference, _ = runs
    for name in ("sft", "rm"):
        got = load_file(str(two / "models" / name / "model.safetensors"))
        want = load_file(str(reference / "models" / name / "model.safetensors"))
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=1e-4, err_msg=key)
    stats = [json.loads((w / "models" / "rm" / "reward_stats.json").read_text())
             for w in (two, reference)]
    assert stats[0]["std"] > 0
    np.testing.assert_allclose([stats[0]["mean"], stats[0]["std"]],
                               [stats[1]["mean"], stats[1]["std"]], rtol=RTOL)
    assert (two / "models" / "policy" / "model.safetensors").exists()


def test_two_process_checkpoint_resumes_in_one_process(runs):
    two, _, reference, resumed = runs
    assert sorted(os.listdir(two / "checkpoints" / "ppo")) == ["2"]
    rows = read_metrics(resumed)
    # Steps 1-2 come from the two processes, step 3 from the single process that restored
    # their checkpoint: together the same run as the straight single-process one.
    assert [r["step"] for r in rows if r["stage"] == "ppo"] == [1, 2, 3]
    assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 2, 3]
    _assert_rows_close(rows, read_metrics(reference))
    assert sorted(os.listdir(resumed / "checkpoints" / "ppo")) == ["2", "3"]


# ---- multi-slice meshes ------------------------------------------------------------------------
class FakeDevice:
    """What mesh construction reads from a device: id, platform, kind, process and slice."""

    platform = device_kind = "cpu"

    def __init__(self, id, slice_index, process_index):
        self.id, self.slice_index, self.process_index = id, slice_index, process_index

    def __repr__(self):
        return f"FakeDevice({self.id}, slice={self.slice_index})"


def _fake_slices(slices, per_slice):
    """Devices of `slices` slices, listed interleaved across slices (as no runtime orders them)."""
    devices = [FakeDevice(s * per_slice + i, s, s * 2 + i * 2 // per_slice)
               for i in range(per_slice) for s in range(slices)]
    return devices


@pytest.mark.parametrize("slices, per_slice, shape", [
    (2, 4, (2, 2, 2)), (2, 4, (4, 2, 1)), (2, 4, (8, 1, 1)), (4, 4, (8, 2, 1)), (4, 2, (4, 1, 2)),
])
def test_hybrid_grid_puts_data_across_slices(slices, per_slice, shape):
    devices = _fake_slices(slices, per_slice)
    grid = sharding.hybrid_device_grid(shape, devices)
    assert grid.shape == shape
    assert sorted(d.id for d in grid.flat) == list(range(slices * per_slice))
    per_data = shape[0] // slices
    for data_index in range(shape[0]):
        # Every fsdp x tensor block lies in one slice; data index i in slice i // (data/slices).
        assert {d.slice_index for d in grid[data_index].flat} == {data_index // per_data}


def test_hybrid_grid_errors_and_single_slice():
    devices = _fake_slices(2, 4)
    with pytest.raises(ValueError, match=r"config\.mesh\.data=1 must be a multiple of the 2 slices"):
        sharding.hybrid_device_grid((1, 8, 1), devices)
    assert sharding.num_slices(devices) == 2
    one_slice = [FakeDevice(i, 0, 0) for i in range(8)]
    assert sharding.hybrid_device_grid((2, 2, 2), one_slice) is None
    # Real CPU devices have no slice index: one slice, the plain topology-ordered mesh.
    assert sharding.num_slices(jax.devices()) == 1
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    assert mesh.devices.shape == (2, 4, 1) and mesh.axis_names == sharding.MESH_AXES


# ---- global arrays from host data, and back ------------------------------------------------------
def test_put_global_splits_the_batch_axis_or_replicates():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    ids = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
    odd = np.arange(10, dtype=np.float32)
    runs = np.arange(2 * 8 * 3, dtype=np.int32).reshape(2, 8, 3)
    placed = sharding.put_global({"ids": ids, "odd": odd, "runs": runs}, mesh)
    assert placed["ids"].sharding.spec == PartitionSpec(("data", "fsdp"))
    assert placed["odd"].sharding.is_fully_replicated
    assert placed["runs"].sharding.is_fully_replicated  # 2 rows do not split 8 ways
    on_axis1 = sharding.put_global(runs, mesh, axis=1)
    assert on_axis1.sharding.spec == PartitionSpec(None, ("data", "fsdp"))
    assert sharding.put_global(ids, mesh, axis=None).sharding.is_fully_replicated
    back = distributed.global_to_host({"ids": placed["ids"], "odd": placed["odd"],
                                       "runs": on_axis1})
    np.testing.assert_array_equal(back["ids"], ids)
    np.testing.assert_array_equal(back["odd"], odd)
    np.testing.assert_array_equal(back["runs"], runs)
    assert sharding.shard_batch({"x": runs}, mesh, axis=1)["x"].sharding.spec == (
        PartitionSpec(None, ("data", "fsdp")))
    assert distributed.main_process_value(True) is True
    assert distributed.main_process_value(7) == 7


def test_process_rows_follow_the_batch_sharding():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    indices = np.array([5, 3, 9, 1, 0, 7, 2, 8])
    # One process holds every shard: all rows, in batch order.
    np.testing.assert_array_equal(
        batches.process_rows(indices, sharding.batch_sharding(mesh)), indices)
    np.testing.assert_array_equal(distributed.local_batch_rows(8, sharding.batch_sharding(mesh)),
                                  np.arange(8))
    with pytest.raises(ValueError, match="global_batch_size=6"):
        distributed.local_batch_rows(6, sharding.batch_sharding(mesh))


# ---- accelerator defaults --------------------------------------------------------------------
class _Vocabulary:
    eos_token_id, pad_token_id, bos_token_id = 1, 0, 2

    def __len__(self):
        return 32


@pytest.mark.parametrize("backend, expected", [
    ("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_auto_dtype_is_bfloat16_on_accelerators(monkeypatch, backend, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    config = tiny_config(**{"model.dtype": "auto"})
    cfg = build.model_config(config, _Vocabulary())
    assert cfg.dtype == expected and cfg.param_dtype == "float32"
    explicit = build.model_config(tiny_config(**{"model.dtype": "bfloat16"}), _Vocabulary())
    assert explicit.dtype == "bfloat16"



# ---- the device benchmark --------------------------------------------------------------------
def test_peak_table_matches_the_most_specific_device_kind():
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_device

    assert bench_device.table_peak("TPU v5 lite") == 197e12
    assert bench_device.table_peak("TPU v5") == 459e12
    assert bench_device.table_peak("TPU v6 lite") == 918e12
    assert bench_device.table_peak("TPU v4") == 275e12
    assert bench_device.table_peak("NVIDIA H100 PCIe") == 756e12
    assert bench_device.table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bench_device.table_peak("NVIDIA GH200 480GB") == 989e12
    assert bench_device.table_peak("cpu") is None
    # float32 runs as TF32 at the default precision and as FP32 at the highest (dense rates).
    assert bench_device.table_peak("NVIDIA H100 80GB HBM3", "float32", "default") == 494.5e12
    assert bench_device.table_peak("NVIDIA H100 80GB HBM3", "float32", "highest") == 67e12
    assert bench_device.table_peak("TPU v4", "float32", "highest") is None


def test_bench_device_small_on_cpu():
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench.py"), "device",
                           "--small"], env=_env(1), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["backend"] == "cpu" and result["devices"] == 1
    assert result["dtype"] == "float32"  # "auto" on a CPU
    # The small llama by hand: tied 512 x 64 embedding; per layer q, k, v, o (64 x 64 each, 2
    # heads of 32), gate / up / down (64 x 192) and two norms; a final norm.
    per_layer = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert result["params"] == 512 * 64 + 2 * per_layer + 64
    for key in ("train_tokens_per_s", "peak_flops_per_device", "mfu", "sample_tokens_per_s",
                "train_step_s", "sample_s"):
        assert result[key] > 0, key
    assert result["train_tokens_per_s"] == pytest.approx(
        result["train_batch"] * result["train_length"] / result["train_step_s"])
    assert result["mfu"] == pytest.approx(6 * result["params"] * result["train_tokens_per_s"]
                                          / result["peak_flops_per_device"])
    assert result["peak_source"].startswith("best timed 512^3 float32 matmul")
    assert result["sample_tokens"] % result["sample_batch"] == 0
    assert 0 < result["sample_tokens"] <= result["sample_batch"] * result["new"]
    text = "\n".join(lines[:-1])
    assert f"{result['train_tokens_per_s']:,.0f} tokens/s" in text
    assert f"MFU (6 * params * tokens/s / peak of all 1 device(s)): {100 * result['mfu']:.2f}%" in text


def test_bench_device_suite_small_on_cpu():
    """Every row of the suite, training and rollout, on the smoke-test model; each number
    checked against the others it is derived from."""
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench.py"), "device", "--suite",
                           "--small"], env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_device

    assert tuple(result["rows"]) == bench_device.SUITE_ROWS
    assert not [name for name, row in result["rows"].items() if "error" in row]
    peak = result["bounds"]["flops"]
    for name in [n for n in bench_device.SUITE_ROWS if n.startswith("train_")]:
        row = result["rows"][name]
        assert row["tokens_per_s"] == pytest.approx(row["batch_per_device"] * row["length"] / row["step_s"])
        assert row["mfu"] == pytest.approx(6 * row["params"] * row["tokens_per_s"] / peak)
        assert row["mfu_with_attention"] > row["mfu"]
    assert result["rows"]["train_smollm2_8x1024_before"]["attention"] == "reference"
    assert not result["rows"]["train_smollm2_8x1024_percast"]["weights_cast_once"]
    assert result["rows"]["train_smollm2_8x1024_xla"]["attention"] == "xla"
    compile_s = result["rows"]["sampler_compile"]["compile_s"]
    assert set(compile_s) == {f"{layout}_{new}" for layout in ("train", "fused") for new in (16, 64)}
    assert min(compile_s.values()) > 0
    parts = result["rows"]["decode_parts_b256"]["ms_per_step"]
    assert set(parts) == {"model", "top_k_50", "top_k_16", "no_filter", "lax_top_k_50", "blocked_top_k_50",
                          "blocked16_top_k_50"} and min(parts.values()) > 0
    decode = {name: result["rows"][name] for name in bench_device.SUITE_ROWS
              if name.startswith("decode_b")}
    assert {name: row["layout"] for name, row in decode.items()} == {
        "decode_b32": "fused", "decode_b32_unrolled": "unrolled", "decode_b32_scan": "train", "decode_b256": "fused",
        "decode_b256_scan": "train"}
    for row in decode.values():
        assert row["new"] == 32  # prescribed lengths: every row decodes the whole budget
        assert 0 < row["share_of_bound"] == pytest.approx(row["bound_s"] / row["seconds"])
    # Fusing q / k / v and gate / up leaves fewer ops in a decode step.
    assert 0 < decode["decode_b32"]["ops_per_step"] < decode["decode_b32_unrolled"]["ops_per_step"]
    for name in ("slots_chat_b32_s8", "slots_chat_b256_s64"):
        row = result["rows"][name]
        # On a CPU the slots draw the static batch's tokens exactly.
        assert row["agreement"] == 1.0 and row["same_tokens"]
        assert row["same_memory_speedup"] == pytest.approx(row["static_chunks_s"] / row["slots_s"])
        assert row["slot_iterations"] <= row["chunk_steps"]
    assert result["rows"]["mismatch_f32"]["precision"] == "highest"
    for name in ("ppo_w1", "ppo_w2"):
        row = result["rows"][name]
        # Every row decodes its whole budget; tokens/s are the iteration's prompt and response
        # tokens over its seconds.
        assert row["full_lengths"] and row["generated_tokens"] == row["prompts"] * row["new"]
        assert row["tokens_per_s"] * row["iteration_s"] == pytest.approx(
            row["prompts"] * (row["prompt"] + row["new"]))
        assert row["tflops_per_s"] * row["iteration_s"] * 1e12 == pytest.approx(
            row["flops"]["total"])
        assert row["last_line"].startswith(f"iteration_s={row['iteration_s']:.4g} ")
    # The asynchronous row: the synchronous loop and k = 1 (--small), timed iterations each.
    row = result["rows"]["ppo_async_w1"]
    assert row["staleness"] == [1] and row["sync"]["iterations"] == row["k1"]["iterations"] == 3
    # W2 chose its micro-batches by the compiler's memory analysis.
    assert set(result["rows"]["ppo_w2"]["compiled_peak_bytes"]) == {"update", "rollout", "score"}
    assert result["rows"]["mismatch_f32"]["diff_max"] < 1e-4
