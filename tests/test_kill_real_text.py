"""SIGKILL at any moment of the real-text pipeline, then the same command: the same results.

A tiny random model with SmolLM2's tokenizer and chat template goes through every stage of
configs/real_text_smollm2.py (best-of-k sampling scored by the review gold, SFT, the grouped
reward model, PPO with the shared trunk, the held-out evaluation) twice: once uninterrupted, and
once killed with SIGKILL during the sampling, the reward model and a PPO step, each time started
again with the same command. Both must end with the same sampled files, metrics and report.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import real_util

ROOT = pathlib.Path(__file__).resolve().parent.parent


# Every stage checkpoints after every step; the top layer alone trains in every stage, so the
# actor, reference, critic and reward model share the bottom one (`ppo.with_shared_trunk`).
FLAGS = {
    "size": "cpu", "model.scan_layers": False, "seeds": "(3,)", "experiment.arms": '("ppo",)',
    "task.num_eval_prompts": 2, "task.num_rm_eval": 2, "task.num_sft": 4, "task.num_pairs": 4,
    "task.num_rl_prompts": 8, "task.samples_per_prompt": 2, "task.sample_batch_size": 2,
    "sft.steps": 3, "sft.batch_size": 2, "sft.num_layers_unfrozen": 1,
    "rm.steps": 3, "rm.batch_size": 2, "rm.num_layers_unfrozen": 1,
    "ppo.steps": 3, "ppo.batch_size": 2, "ppo.num_minibatches": 1, "ppo.response_length": 8,
    "ppo.eval_every": 3, "ppo.num_layers_unfrozen": 1,
    "checkpoint_every": 1, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
}
# The run is killed as soon as a file matching each of these appears in its workdir: while it
# samples the second of the three parts, while it trains the reward model (grouped by prompt)
# and during the PPO steps (possibly while a checkpoint is being written).
KILL_WHEN = ("sampled/rm_eval.npz", "checkpoints/rm/*", "checkpoints/experiment/*")
# Fields that measure time, not results.
TIMING = ("timing/", "perf/", "train_s", "steps/s")


def _command(tmp_path, smollm2_gguf, workdir):
    config = real_util.tiny_real_text_config(tmp_path, smollm2_gguf)
    return [sys.executable, str(ROOT / "experiments" / "run.py"), f"--config={config}",
            f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in FLAGS.items())]


def _run_killed_when(command, workdir, pattern, log_path):
    """Runs `command` and SIGKILLs it as soon as `workdir` holds a path matching `pattern`;
    returns whether it was killed (False: it ended first). Its stderr goes to `log_path`."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=real_util.one_device_run_env(),
                                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 900
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if list(workdir.glob(pattern)):
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.005)
        finally:
            if proc.poll() is None and time.monotonic() >= deadline:
                proc.kill()
            proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0, log_path.read_text()[-5000:]
    return killed


def _rows(workdir):
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_sigkill_during_sampling_reward_model_and_ppo_then_rerun_gives_the_same_run(
        tmp_path, smollm2_gguf):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = subprocess.run(_command(tmp_path, smollm2_gguf, whole), cwd=ROOT,
                            env=real_util.one_device_run_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "share their bottom 1 layer(s)" in result.stderr, result.stderr[-3000:]

    command = _command(tmp_path, smollm2_gguf, killed)
    for i, pattern in enumerate(KILL_WHEN):
        assert _run_killed_when(command, killed, pattern, tmp_path / f"killed{i}.log"), \
            f"the run ended before {pattern} appeared"
        for path in (killed / "sampled").glob("*.npz"):  # complete or absent
            with np.load(path) as f:
                assert f["gold"].shape == f["ids"].shape[:2]
    assert not _run_killed_when(command, killed, "no such file", tmp_path / "last.log")
    resumed = (tmp_path / "last.log").read_text()
    # The last run restarted from the PPO checkpoint: no sampling, SFT or RM step again.
    assert "[sample" not in resumed and "[sft]" not in resumed and "[rm]" not in resumed, resumed

    for part in ("rm_eval", "sft", "rm"):
        with np.load(whole / "sampled" / f"{part}.npz") as a, \
                np.load(killed / "sampled" / f"{part}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for name in a.files:
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"{part}: {name}")
        assert (whole / "sampled" / f"{part}.jsonl").read_text() == \
            (killed / "sampled" / f"{part}.jsonl").read_text()
    assert not list((killed / "sampled").glob("*tmp*"))

    # Every metrics row once, in order, with the same values (the training rows of every stage,
    # the reward model's gold agreement, the evaluations and the final rows).
    want, got = _rows(whole), _rows(killed)
    assert [(r["stage"], r.get("step"), r.get("arm")) for r in got] == \
        [(r["stage"], r.get("step"), r.get("arm")) for r in want]
    assert got == want
    assert {r["stage"] for r in want} >= {"sft", "rm", "ppo", "eval", "final"}
    want, got = (json.loads((w / "report.json").read_text()) for w in (whole, killed))
    for report in (want, got):  # wall-clock seconds of training, not results
        assert report["budget"]["arms"]["ppo"].pop("train_s")["n"] == 1
    assert got == want
