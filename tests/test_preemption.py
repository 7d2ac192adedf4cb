"""A preemption notice (SIGTERM) loses no step: the step in flight is finished and checkpointed,
the run ends with its line and exit status 75, and the same command resumes there with every
metrics row once.

In one process (the training loop with a toy state, a real signal sent from inside a step, real
orbax checkpoints), in two JAX processes on localhost that agree through JAX's preemption sync
point (the signal sent to one of them), and through `experiments/run.py` on the synthetic
pipeline, signalled at moments a seeded RNG draws in every stage that checkpoints. Outside a
training loop, two processes of `experiments/run.py`'s eval stage stop together at the same safe
point between evaluation batches, with nothing of the evaluation written.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.train import exports, loop, metrics, preemption

import process_util
from train_util import ROOT, tiny_config, tiny_flags

TOTAL_STEPS = 10
MULTI_PROCESS_TIMEOUT_S = 120


def _step(state, step):
    """A deterministic step with a host-side metric: w <- 0.5 w + step + 1."""
    w = state["w"] * 0.5 + (step + 1)
    return {"w": w}, {"w_sum": jnp.sum(w)}


def _reference(steps, w0):
    """(w after `steps`, [w_sum after each step]) by a plain numpy loop."""
    w, sums = np.asarray(w0, np.float64), []
    for step in range(steps):
        w = w * 0.5 + (step + 1)
        sums.append(float(w.sum()))
    return w, sums


def _run(workdir, step_fn, *, checkpoint_every=4):
    state = {"w": jnp.arange(3.0)}
    stage = loop.Stage("toy", str(workdir))
    with metrics.MetricsWriter(workdir, tensorboard=False) as writer:
        state, start = loop.run(stage, state=state, total_steps=TOTAL_STEPS, step_fn=step_fn,
                                writer=writer, metadata={}, checkpoint_every=checkpoint_every)
    stage.close()
    return state, start


def test_sigterm_in_a_step_checkpoints_that_step_and_the_rerun_continues_it(tmp_path):
    signalled_in = 5  # 0-based: the sixth step

    def step_then_signal(state, step):
        out = _step(state, step)
        if step == signalled_in:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    before = signal.getsignal(signal.SIGTERM)
    with preemption.watching() as mode:
        assert mode == preemption.SIGNAL_FLAG
        with pytest.raises(preemption.Preempted) as stopped:
            _run(tmp_path, step_then_signal)
    assert signal.getsignal(signal.SIGTERM) is before
    done = signalled_in + 1
    assert (stopped.value.stage, stopped.value.step) == ("toy", done)
    directory = tmp_path / "checkpoints" / "toy"
    assert str(stopped.value) == (
        f"preempted: toy stopped at step {done} with its checkpoint in {directory}/{done}; "
        "the same command resumes there (exit status 75)")
    # The regular checkpoint at 4 and the step in flight; nothing half-written.
    assert sorted(os.listdir(directory)) == ["4", str(done)]
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == list(range(1, done + 1))

    with preemption.watching():
        state, start = _run(tmp_path, _step)
    assert start == done
    want_w, want_sums = _reference(TOTAL_STEPS, np.arange(3.0))
    np.testing.assert_allclose(state["w"], want_w, rtol=1e-6)
    rows = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    np.testing.assert_allclose([r["w_sum"] for r in rows], want_sums, rtol=1e-6)


def test_sigterm_outside_a_training_loop_stops_at_once():
    with preemption.watching():
        with pytest.raises(preemption.Preempted) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises as soon as the interpreter runs it
    assert stopped.value.stage is None
    assert str(stopped.value) == ("preempted: stopped outside a training loop, with no step in "
                                  "flight; the same command resumes there (exit status 75)")
    assert preemption.mode() == preemption.OFF


class _SignalOnRead(list):
    """A list that sends this process SIGTERM when its item `at` is read."""

    def __init__(self, items, at):
        super().__init__(items)
        self.at = at

    def __getitem__(self, index):
        if index == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__getitem__(index)


def test_sigterm_while_the_evaluation_writes_its_samples_leaves_the_previous_file(tmp_path):
    from marl_jax.eval import run_eval

    n = 4
    results = {name: {"response_ids": np.arange(n * 3).reshape(n, 3) + k,
                      "response_mask": np.ones((n, 3), np.int32), "kl": np.full(n, 0.5 * k)}
               for k, name in enumerate(("sft", "policy"))}
    args = (np.arange(n), [f"prompt {i}" for i in range(n)])
    texts = {name: [f"{name} {i}" for i in range(n)] for name in results}
    path = tmp_path / "samples.jsonl"
    run_eval.write_samples(str(path), *args, texts, results, np.full(n, np.nan), None)
    before = path.read_text()
    assert [json.loads(line)["policy"]["response"] for line in before.splitlines()] == [
        f"policy {i}" for i in range(n)]

    texts["policy"] = _SignalOnRead([f"new {i}" for i in range(n)], at=2)
    with preemption.watching():
        with pytest.raises(preemption.Preempted):
            run_eval.write_samples(str(path), *args, texts, results, np.full(n, np.nan), None)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["samples.jsonl"]


_TWO_PROCESS_WORKER = textwrap.dedent("""
    import sys
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from marl_jax import distributed
    from marl_jax.train import exports, loop, metrics, preemption

    process_id, port, workdir, total = (int(sys.argv[1]), sys.argv[2], sys.argv[3],
                                        int(sys.argv[4]))
    distributed.initialize({"coordinator": f"localhost:{port}", "num_processes": 2,
                            "process_id": process_id})
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())
    sharding = NamedSharding(mesh, P("x"))
    w0 = np.arange(4.0, dtype=np.float32)
    state = {"w": jax.make_array_from_callback(w0.shape, sharding, lambda i: w0[i])}

    @jax.jit
    def update(w, step):
        # The mean over both processes' halves: one collective per step.
        return w * 0.5 + jnp.mean(w) + step + 1

    def step_fn(state, step):
        time.sleep(0.2)  # a step long enough for a signal to land inside one
        w = update(state["w"], step)
        return {"w": w}, {"w_sum": jnp.sum(w)}

    stage = loop.Stage("toy", workdir)
    try:
        with preemption.watching() as mode, metrics.MetricsWriter(
                workdir, tensorboard=False) as writer:
            assert mode == preemption.SYNC_POINT, mode
            state, start = loop.run(stage, state=state, total_steps=total, step_fn=step_fn,
                                    writer=writer, metadata={}, checkpoint_every=0)
    except preemption.Preempted as stop:
        print(stop, file=sys.stderr, flush=True)
        sys.exit(preemption.EXIT_STATUS)
    stage.close()
    w = distributed.global_to_host(state["w"])
    print(f"finished from {start}: " + " ".join(f"{x:.6e}" for x in w), flush=True)
""")


def _two_process_reference(steps):
    w = np.arange(4.0)
    for step in range(steps):
        w = w * 0.5 + w.mean() + step + 1
    return w


def _start_two(workdir, logdir, total, attempt):
    port = process_util.free_port()
    env = process_util.cpu_env(1, JAX_ENABLE_COMPILATION_CACHE="false")
    logs = [logdir / f"{attempt}_worker{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_WORKER, str(i), str(port),
                               str(workdir), str(total)], env=env, cwd=ROOT,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    return procs, logs


def _wait_all(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs]


def _logged_steps(workdir, stage):
    return [r["step"] for r in metrics.read_metrics(workdir, stage=stage)]


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_checkpointed_step(tmp_path):
    total = 30
    signal_after = int(np.random.default_rng(43).integers(3, 12))
    procs, logs = _start_two(tmp_path / "run", tmp_path, total, "first")
    deadline = time.monotonic() + MULTI_PROCESS_TIMEOUT_S
    try:
        while (len(_logged_steps(tmp_path / "run", "toy")) < signal_after
               and time.monotonic() < deadline and all(p.poll() is None for p in procs)):
            time.sleep(0.02)
        logged_before = len(_logged_steps(tmp_path / "run", "toy"))
        assert logged_before >= signal_after, [log.read_text()[-3000:] for log in logs]
        os.kill(procs[1].pid, signal.SIGTERM)  # the notice reaches process 1 only
    finally:
        codes = _wait_all(procs, MULTI_PROCESS_TIMEOUT_S)
    outputs = [log.read_text() for log in logs]
    assert codes == [preemption.EXIT_STATUS] * 2, [o[-3000:] for o in outputs]
    lines = [[line for line in o.splitlines() if line.startswith("preempted:")] for o in outputs]
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines
    step = int(lines[0][0].split(" at step ")[1].split()[0])
    assert logged_before < step < total
    # One checkpoint, of the step both processes named, complete; the rows stop there.
    directory = tmp_path / "run" / "checkpoints" / "toy"
    assert sorted(os.listdir(directory)) == [str(step)]
    assert _logged_steps(tmp_path / "run", "toy") == list(range(1, step + 1))

    procs, logs = _start_two(tmp_path / "run", tmp_path, total, "rerun")
    codes = _wait_all(procs, MULTI_PROCESS_TIMEOUT_S)
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], [o[-3000:] for o in outputs]
    want = _two_process_reference(total)
    for output in outputs:
        line = next(x for x in output.splitlines() if x.startswith("finished from "))
        assert line.startswith(f"finished from {step}: ")
        np.testing.assert_allclose([float(x) for x in line.split(": ")[1].split()], want,
                                   rtol=1e-5)
    assert _logged_steps(tmp_path / "run", "toy") == list(range(1, total + 1))


# The eval stage of a workdir whose policies are exported, on two processes of one device each:
# no reward model (the gold judges), 8 held-out batches of 2 prompts per model.
EVAL = {"rm.steps": 0, "eval.judge": "gold", "eval.batch_size": 2, "task.num_eval_prompts": 16}
EVAL_BATCHES = 8


def _exported_workdir(workdir):
    """`workdir` with the SFT and final policy exported, as a finished pipeline leaves them (the
    initial model as both: what is evaluated does not matter here)."""
    from marl_jax import pipeline as pipeline_lib

    pipe = pipeline_lib.Pipeline(tiny_config(**EVAL), str(workdir))
    params = pipe.initial_params()
    for name in ("sft", "policy"):
        exports.export_model(str(workdir), name, pipe.policy, params, pipe.task.tokenizer)
    pipe.close()


def _start_run_py(workdir, logdir, flags, attempt):
    """Starts `experiments/run.py` as two processes of one CPU device each."""
    port = process_util.free_port()
    env = process_util.cpu_env(1, JAX_ENABLE_COMPILATION_CACHE="false")
    logs = [logdir / f"{attempt}_worker{i}.log" for i in range(2)]
    procs = [subprocess.Popen(
        _run_py(workdir, flags) + [f"--config.distributed.coordinator=localhost:{port}",
                                   "--config.distributed.num_processes=2",
                                   f"--config.distributed.process_id={i}"],
        env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for i, log in enumerate(logs)]
    return procs, logs


def _signal_once_built(procs, logs):
    """Sends SIGTERM to process 0 once it has printed its attention line (its pipeline is built,
    after `jax.distributed.initialize`: SIGTERM is the preemption notifier's), waits for both;
    returns their `preempted:` lines after asserting that both exited with status 75."""
    deadline = time.monotonic() + MULTI_PROCESS_TIMEOUT_S
    try:
        while ("attention: " not in logs[0].read_text() and time.monotonic() < deadline
               and all(p.poll() is None for p in procs)):
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), [log.read_text()[-3000:] for log in logs]
        os.kill(procs[0].pid, signal.SIGTERM)  # the notice reaches process 0 only
    finally:
        codes = _wait_all(procs, MULTI_PROCESS_TIMEOUT_S)
    outputs = [log.read_text() for log in logs]
    assert codes == [preemption.EXIT_STATUS] * 2, [o[-3000:] for o in outputs]
    return [[line for line in o.splitlines() if line.startswith("preempted:")] for o in outputs]


def _safe_point(line):
    """The safe point a `preempted:` line names."""
    assert line.endswith(", with nothing half written; the same command resumes there "
                         "(exit status 75)"), line
    return line.split("stopped outside a training loop at a safe point (")[1].split(
        "), with nothing")[0]


def test_sigterm_to_one_of_two_processes_in_the_eval_stage_stops_both_at_one_safe_point(
        tmp_path):
    workdir = tmp_path / "run"
    _exported_workdir(workdir)
    eval_flags = tiny_flags(**EVAL, stage="eval", **{"mesh.data": 2})
    lines = _signal_once_built(*_start_run_py(workdir, tmp_path, eval_flags, "first"))
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines
    # Both stopped after the same batch of the evaluation.
    at = _safe_point(lines[0][0]).removeprefix("eval of ")
    model, batch = at.split(", held-out batch ")
    number, of = (int(x) for x in batch.split(" of "))
    assert model in ("sft", "policy") and of == EVAL_BATCHES and 1 <= number <= of, at
    # Nothing of the evaluation was written: its files and rows come whole, at its end.
    assert not (workdir / "eval").exists() or os.listdir(workdir / "eval") == []
    assert not [r for r in metrics.read_metrics(workdir) if r.get("stage") == "eval_final"]


# The safe points of `--config.stage=all` with no training steps, in their order.
STAGE_POINTS = ("after the export of {models}/sft", "after the reward model's gold agreement",
                "after the export of {models}/rm", "after the export of {models}/policy")


def test_sigterm_to_one_of_two_processes_between_stages_stops_both_with_whole_exports(
        tmp_path):
    workdir = tmp_path / "run"
    flags = tiny_flags(**{"sft.steps": 0, "rm.steps": 0, "ppo.steps": 0, "mesh.data": 2})
    lines = _signal_once_built(*_start_run_py(workdir, tmp_path, flags, "first"))
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines
    points = [p.format(models=workdir / "models") for p in STAGE_POINTS]
    at = _safe_point(lines[0][0])
    assert at in points, (at, points)
    # The exports up to the safe point are whole, the later ones absent; nothing beside them.
    done = [name for name in ("sft", "rm", "policy")
            if points.index(f"after the export of {workdir / 'models'}/{name}")
            <= points.index(at)]
    assert sorted(os.listdir(workdir / "models")) == sorted(done)
    for name in done:
        info = exports.read_export_info(str(workdir / "models" / name))
        assert info == exports.export_info(str(workdir), name), name
        assert {"config.json", "model.safetensors", exports.EXPORT_INFO} <= set(
            os.listdir(workdir / "models" / name))


# Every stage checkpoints every 4 steps (the signals fall between those checkpoints, too).
PIPELINE = {"sft.steps": 6, "rm.steps": 6, "ppo.steps": 6, "ppo.eval_every": 2,
            "checkpoint_every": 4, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
STAGES = ("sft", "rm", "ppo")
RUN_TIMEOUT_S = 300
# Fields that measure time, not results.
TIMING = ("timing/", "perf/", "train_s")
SEED = 43


def _run_py(workdir, flags):
    return [sys.executable, str(ROOT / "experiments" / "run.py"), f"--workdir={workdir}", *flags]


def _pipeline_env():
    return process_util.cpu_env(1)


def _run_to_the_end(command, log):
    with open(log, "w") as out:
        result = subprocess.run(command, cwd=ROOT, env=_pipeline_env(), stdout=out,
                                stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, log.read_text()[-4000:]


def _written_at(workdir):
    path = workdir / "metrics.jsonl"
    return path.stat().st_mtime_ns if path.exists() else None


def _run_signalled(command, workdir, stage, step, delay_s, log):
    """Runs `command`, sends SIGTERM `delay_s` after `stage`'s row of `step` is in the metrics
    and this run has written to them (so the signal never lands before the run has started),
    waits for the end; returns (exit status, output, the stage's last logged step when the
    signal had been sent)."""
    before = _written_at(workdir)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=_pipeline_env(), stdout=out,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while ((step not in _logged_steps(workdir, stage) or _written_at(workdir) == before)
                   and proc.poll() is None and time.monotonic() < deadline):
                time.sleep(0.01)
            time.sleep(delay_s)
            assert proc.poll() is None, log.read_text()[-4000:]
            os.kill(proc.pid, signal.SIGTERM)
            # The step in flight at the signal is this one or the next.
            logged = max(_logged_steps(workdir, stage), default=0)
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log.read_text(), logged


def _rows(workdir):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)}
            for r in metrics.read_metrics(workdir)]


def _checkpoint_steps(workdir, stage):
    directory = workdir / "checkpoints" / stage
    names = os.listdir(directory) if directory.exists() else []
    assert not [n for n in names if "tmp" in n], names  # complete or absent
    return sorted(int(n) for n in names)


def _assert_nothing_logged_is_lost(workdir, stages):
    """Every step with a metrics row is in its stage's latest checkpoint: the rerun runs no
    logged step again and skips none."""
    for stage in stages:
        logged = _logged_steps(workdir, stage)
        saved = _checkpoint_steps(workdir, stage)
        assert logged == list(range(1, len(logged) + 1)), (stage, logged)
        assert max(logged, default=0) == max(saved, default=0), (stage, logged, saved)


def _assert_same_exports(got, want, names):
    from safetensors.numpy import load_file

    for name in names:
        a = load_file(str(want / "models" / name / "model.safetensors"))
        b = load_file(str(got / "models" / name / "model.safetensors"))
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(b[key], a[key], err_msg=f"{name}: {key}")


def test_sigterm_at_random_moments_of_a_pipeline_then_rerun_gives_the_uninterrupted_run(
        tmp_path):
    flags = tiny_flags(**PIPELINE)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    _run_to_the_end(_run_py(whole, flags), tmp_path / "whole.log")

    rng = np.random.default_rng(SEED)
    for stage in STAGES:  # one moment in each stage: after a drawn step, plus a drawn delay
        step = int(rng.integers(1, PIPELINE[f"{stage}.steps"]))
        delay_s = float(rng.uniform(0.0, 0.05))
        code, output, logged = _run_signalled(_run_py(stopped, flags), stopped, stage, step,
                                              delay_s, tmp_path / f"{stage}.log")
        assert code == preemption.EXIT_STATUS, output[-4000:]
        [line] = [x for x in output.splitlines() if x.startswith("preempted: ")]
        if f"preempted: {stage} stopped at step " in line:
            # The boundary that ends the step in flight: the last one logged or the next.
            at = int(line.split(" at step ")[1].split()[0])
            assert logged <= at <= logged + 1, (line, logged)
            assert f"checkpoints/{stage}/{at};" in line
            assert _logged_steps(stopped, stage)[-1] == at
        _assert_nothing_logged_is_lost(stopped, STAGES)
    _run_to_the_end(_run_py(stopped, flags), tmp_path / "last.log")

    # Every row once, in the uninterrupted run's order, with its values; the same models.
    assert _rows(stopped) == _rows(whole)
    _assert_same_exports(stopped, whole, ("sft", "rm", "policy"))


def test_sigterm_in_the_experiment_runner_then_rerun_gives_the_uninterrupted_experiment(
        tmp_path):
    flags = tiny_flags(**{"stage": "experiment", "ppo.steps": 6, "ppo.eval_every": 2,
                          "checkpoint_every": 4, "mesh.data": 1, "mesh.fsdp": 1,
                          "mesh.tensor": 1}) + ["--config.seeds=(0, 1)",
                                                '--config.experiment.arms=("ppo", "ma_ppo")']
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    _run_to_the_end(_run_py(whole, flags), tmp_path / "whole.log")

    rng = np.random.default_rng(SEED + 1)
    step, delay_s = int(rng.integers(1, 6)), float(rng.uniform(0.0, 0.05))
    code, output, logged = _run_signalled(_run_py(stopped, flags), stopped, "ppo", step,
                                          delay_s, tmp_path / "stopped.log")
    assert code == preemption.EXIT_STATUS, output[-4000:]
    [line] = [x for x in output.splitlines() if x.startswith("preempted: ")]
    at = int(line.split("preempted: experiment stopped at step ")[1].split()[0])
    assert logged <= at <= logged + 1, (line, logged)
    assert _checkpoint_steps(stopped, "experiment")[-1] == at
    # Every run of the vmapped program logged the same steps, up to the checkpoint.
    runs = {(r["arm"], r["seed"]) for r in metrics.read_metrics(whole, stage="ppo")}
    assert len(runs) == 4
    for arm, seed in runs:
        assert [r["step"] for r in metrics.read_metrics(stopped, stage="ppo")
                if (r["arm"], r["seed"]) == (arm, seed)] == list(range(1, at + 1))
    _run_to_the_end(_run_py(stopped, flags), tmp_path / "last.log")

    assert _rows(stopped) == _rows(whole)
    _assert_same_exports(stopped, whole, ("sft", "rm"))
    reports = [json.loads((w / "report.json").read_text()) for w in (whole, stopped)]
    for report in reports:  # wall-clock seconds of training, not results
        for arm in ("ppo", "ma_ppo"):
            report["budget"]["arms"][arm].pop("train_s")
    assert reports[1] == reports[0]
