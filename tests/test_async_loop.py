"""The asynchronous loop on a tiny run (k = 2, chunks of 4 of a 12-token budget, groups of two,
a token limit of 2 versions): every token's version against the schedule worked out by hand
from each row's history (a row first sampled in batch s0 has its token at position p from
version max(0, s0 - k + p // D)), groups carried over whole with their tokens, finished rows of a
carried group sampled again once all their tokens expire, the token accounting of every
iteration against a count of the batches, and a second run with the same seed giving the same
metrics and batches bit for bit. Then `stage=ppo` with that schedule, stopped by a preemption
notice (SIGTERM, in this process) or killed (SIGKILL, `experiments/run.py` in a process of its
own) and run again: the rows of the run that was not stopped."""
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import stages
from marl_jax.config_check import validate_config
from marl_jax.train import async_schedule, metrics as metrics_lib, preemption, programs, sharding
from marl_jax.train import build, phases, ppo as ppo_lib
from marl_jax.train.async_step import AsyncStep

from train_util import ROOT, tiny_config, tiny_flags, trained_tiny_pipeline

K, CHUNK, LIMIT, GROUP, ITERATIONS = 2, 4, 2, 2, 7
RESPONSE = 12
ROLLOUT = {"rollout.max_staleness": K, "rollout.chunk_tokens": CHUNK,
           "rollout.max_token_staleness": LIMIT}


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("async"))


def _run(tiny_pipe, sampler=None, copies=None, weights=None):
    """`ITERATIONS` iterations of the loop from a fresh start, the trainer on devices 0 and 1
    and the sampler there too or on the devices `sampler`: per iteration, the batch trained
    (host arrays, before its update), the metrics and the batches in flight after it. With
    `copies` (a list), per iteration (the sampler's weights equal the new actor's, the devices
    of the sampler's weights and batches, those of the trainer's state); with `weights` (a
    list), the actor's weights at each iteration's start: version t's."""
    pipe, sft, rm, stats = tiny_pipe
    cfg = tiny_config(**{"stage": "ppo", "ppo.group_size": GROUP, "ppo.batch_size": 16,
                         "ppo.response_length": RESPONSE, **ROLLOUT})
    validate_config(cfg)
    static = ppo_lib.static_from_config(cfg, pipe.task.tokenizer)
    mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model,
                               pipe.task.gold_fn)
    critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, jax.random.key(1), stats)
    devices = jax.devices()
    mesh = sharding.make_mesh(cfg.mesh, devices[:2])
    sampler_mesh = None if sampler is None else sharding.make_mesh(
        cfg.mesh, [devices[i] for i in sampler])
    state_sh = ppo_lib.state_shardings(mods, mesh, sft, critic)
    frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, rm)
    frozen = jax.device_put(ppo_lib.frozen_models(mods, sft, rm, stats), frozen_sh)
    # A state of its own buffers (on part of the pipeline's devices a device_put shares them).
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=state_sh)(
        jax.device_put(ppo_lib.initial_state(cfg, mods, sft, critic, cfg.seed), state_sh))
    hparams = jax.device_put(ppo_lib.hparams_from_config(cfg.ppo), sharding.replicated(mesh))
    trace = []
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            pipe.policy.config))):
        loop = AsyncStep(cfg, pipe.task, static, mods, state_sh, frozen_sh, mesh,
                         async_schedule.Schedule.from_config(cfg), timed=False,
                         sampler_mesh=sampler_mesh)
        state = loop.initial_state(state, frozen)
        for step in range(ITERATIONS):
            if weights is not None:
                weights.append(jax.device_get(state.ppo.actor_params))
            trained = jax.device_get(state.batches[0])
            state, metrics = loop(state, frozen, hparams, step)
            trace.append((trained, jax.device_get(metrics), jax.device_get(state.batches)))
            if copies is not None:
                ids = lambda tree: {d.id for x in jax.tree.leaves(tree)  # noqa: E731
                                    for d in x.sharding.device_set}
                copies.append((all(np.array_equal(a, b) for a, b in zip(
                    jax.tree.leaves(loop.weights), jax.tree.leaves(state.ppo.actor_params))),
                    ids((loop.weights, state.batches)), ids(state.ppo)))
    return trace


@pytest.fixture(scope="module")
def run(tiny_pipe):
    """(the trace of `_run`, the weights of versions 0 .. ITERATIONS - 1)."""
    weights = []
    return _run(tiny_pipe, weights=weights), weights


@pytest.fixture(scope="module")
def trace(run):
    return run[0]


def _lengths(batch):
    return np.asarray(batch.mask).sum(axis=1)


def _finished(batch, eos):
    lengths = _lengths(batch)
    last = np.asarray(batch.tokens)[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    return (lengths > 0) & np.isin(last, np.atleast_1d(eos)) | (lengths >= RESPONSE)


def _history(trace, eos):
    """By hand, from the batches as they were trained: per batch s and row, whether it came
    from batch s - k (its group unfinished there), whether it was cleared (a finished row of
    such a group, all of whose tokens are more than LIMIT versions old at update s), and the
    batch where its response began."""
    carried, cleared, origin = {}, {}, {}
    for s, (batch, _, _) in enumerate(trace):
        rows = len(_lengths(batch))
        if s < K:
            carried[s], cleared[s], origin[s] = (np.zeros(rows, bool), np.zeros(rows, bool),
                                                 np.full(rows, s))
            continue
        before = trace[s - K][0]
        going = ~_finished(before, eos)
        carried[s] = np.repeat(going.reshape(-1, GROUP).any(axis=1), GROUP)
        newest = np.asarray(before.versions).max(axis=1)
        cleared[s] = carried[s] & ~going & (s - newest > LIMIT)
        origin[s] = np.where(carried[s] & ~cleared[s], origin[s - K], s)
    return carried, cleared, origin


def test_every_tokens_version_is_the_schedules(run, tiny_pipe):
    """The stamps against the rule, and each token's sampler logprob against the one its
    version's weights give it in a full forward pass (the next version's give others)."""
    trace, weights = run
    pipe = tiny_pipe[0]
    eos = pipe.task.tokenizer.eos_token_id
    logprobs = jax.jit(lambda p, *a: phases.score.token_logprobs(pipe.policy, p, *a,
                                                                  pipe.config.ppo.temperature)[0])
    carried, cleared, origin = _history(trace, eos)
    spans = []
    for s, (batch, _, _) in enumerate(trace):
        positions = np.arange(RESPONSE)[None]
        mask = np.asarray(batch.mask) != 0
        want = np.where(mask, np.maximum(0, origin[s][:, None] - K + positions // CHUNK), -1)
        np.testing.assert_array_equal(np.asarray(batch.versions), want, err_msg=f"batch {s}")
        args = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask)
        for version in np.unique(want[mask]):
            tokens = mask & (want == version)
            np.testing.assert_allclose(np.asarray(logprobs(weights[version], *args))[tokens],
                                       np.asarray(batch.logprobs)[tokens], atol=1e-4)
            other = np.asarray(logprobs(weights[version + 1], *args))[tokens]
            assert np.abs(other - np.asarray(batch.logprobs)[tokens]).max() > 1e-3
        if s >= K:
            before = trace[s - K][0]
            kept = carried[s] & ~cleared[s]
            # A carried response goes on from where it stopped, with its prompt.
            for row in np.flatnonzero(kept):
                n = _lengths(before)[row]
                np.testing.assert_array_equal(np.asarray(batch.tokens)[row, :n],
                                              np.asarray(before.tokens)[row, :n])
                np.testing.assert_array_equal(np.asarray(batch.prompt_ids)[row],
                                              np.asarray(before.prompt_ids)[row])
        done = ~np.repeat((~_finished(batch, eos)).reshape(-1, GROUP).any(axis=1), GROUP)
        versions = np.where(mask, np.asarray(batch.versions), -1)
        spans += list((versions.max(axis=1) - np.where(mask, versions, 10 ** 6).min(axis=1))[
            done & mask.any(axis=1)])
    # The run has what the schedule is for: responses spanning two versions, groups carried
    # over, finished rows sampled again.
    assert max(spans) >= 1
    assert sum(c.sum() for c in carried.values()) > 0
    assert sum(c.sum() for c in cleared.values()) > 0


def test_the_accounting_adds_up_on_every_iteration(trace, tiny_pipe):
    eos = tiny_pipe[0].task.tokenizer.eos_token_id
    trained_total = stale_total = 0
    for s, (batch, metrics, in_flight) in enumerate(trace):
        mask = np.asarray(batch.mask) != 0
        trained = ~np.repeat((~_finished(batch, eos)).reshape(-1, GROUP).any(axis=1), GROUP)
        old = (s - np.asarray(batch.versions)) > LIMIT
        trained_total += int((mask & trained[:, None] & ~old).sum())
        stale_total += int((mask & trained[:, None] & old).sum())
        # Iteration s forms batch s + k, where the finished rows of batch s's carried groups
        # whose tokens would all be too old are cleared.
        going = ~_finished(batch, eos)
        moving = np.repeat(going.reshape(-1, GROUP).any(axis=1), GROUP)
        newest = np.asarray(batch.versions).max(axis=1)
        stale_total += int(_lengths(batch)[moving & ~going & (s + K - newest > LIMIT)].sum())
        got = {k: int(metrics[f"async/tokens_{k}"]) for k in ("generated", "trained", "stale",
                                                                "in_flight")}
        assert got["trained"] == trained_total and got["stale"] == stale_total, (s, got)
        assert got["in_flight"] == sum(int(np.asarray(b.mask).sum()) for b in in_flight)
        assert got["generated"] == got["trained"] + got["stale"] + got["in_flight"], (s, got)
        # The staleness of the batch: each trained response's oldest token, token-weighted.
        lengths = (mask & trained[:, None]).sum(axis=1)
        oldest = np.where(mask, np.asarray(batch.versions), 10 ** 6).min(axis=1)
        want = (lengths * (s - oldest))[lengths > 0].sum() / max(lengths.sum(), 1)
        np.testing.assert_allclose(float(metrics["async/staleness_avg"]), want, rtol=1e-6)
    assert stale_total > 0


def _assert_same(trace, again):
    assert len(trace) == len(again) == ITERATIONS
    for (batch, metrics, in_flight), (batch2, metrics2, in_flight2) in zip(trace, again):
        assert sorted(metrics) == sorted(metrics2)
        for a, b in zip(jax.tree.leaves((batch, in_flight, metrics)),
                        jax.tree.leaves((batch2, in_flight2, metrics2))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_runs_with_the_same_seed_give_the_same_metrics_and_batches(trace, tiny_pipe):
    _assert_same(trace, _run(tiny_pipe))


def test_the_sampler_on_devices_of_its_own_gives_the_same_run(trace, tiny_pipe):
    """The sampler on devices 2 and 3, the trainer on 0 and 1 (what `rollout.sampler_devices`
    makes): the same metrics and batches as both on devices 0 and 1, the batches and the
    sampler's weights on its devices only, and after every update its weights are the new
    actor's, copied."""
    copies = []
    _assert_same(trace, _run(tiny_pipe, sampler=(2, 3), copies=copies))
    assert copies == [(True, {2, 3}, {0, 1})] * ITERATIONS


# stage=ppo: 4 steps, checkpoints every 2, evaluations every 2.
STAGE = {"stage": "ppo", "ppo.steps": 4, "ppo.eval_every": 2, "checkpoint_every": 2,
         "ppo.group_size": GROUP, "ppo.batch_size": 16, "ppo.response_length": RESPONSE,
         **ROLLOUT}
TIMING = ("timing/", "perf/")


def _stage_ppo(tiny_pipe, workdir):
    """`stage=ppo` in `workdir`, a copy of the tiny pipeline's workdir (SFT and RM done) unless
    it exists; returns its rows without the fields that measure time."""
    if not workdir.exists():
        shutil.copytree(tiny_pipe[0].workdir, workdir)
    stages.run(tiny_config(**STAGE), str(workdir))
    return _rows(workdir)


def _rows(workdir):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)}
            for r in metrics_lib.read_metrics(str(workdir))]


@pytest.fixture(scope="module")
def whole(tiny_pipe, tmp_path_factory):
    return _stage_ppo(tiny_pipe, tmp_path_factory.mktemp("whole") / "run")


def _stopping_at(step, stop):
    """`AsyncStep.__call__` that calls `stop()` inside iteration `step` (after its work)."""
    call = AsyncStep.__call__

    def stopping(self, state, frozen, hparams, at):
        out = call(self, state, frozen, hparams, at)
        if at == step:
            stop()
        return out

    return stopping


def test_a_preempted_run_resumes_with_the_uninterrupted_runs_rows(tiny_pipe, whole, tmp_path,
                                                                   monkeypatch):
    """SIGTERM in step 1 (0-based 0): the step is finished and checkpointed with the batches in
    flight, the run stops (exit status 75 from run.py); the same command resumes there."""
    workdir = tmp_path / "run"
    monkeypatch.setattr(AsyncStep, "__call__", _stopping_at(
        0, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    with pytest.raises(preemption.Preempted) as stopped:
        _stage_ppo(tiny_pipe, workdir)
    assert (stopped.value.stage, stopped.value.step) == ("ppo", 1)
    monkeypatch.undo()
    assert _stage_ppo(tiny_pipe, workdir) == whole
    assert [r["step"] for r in whole if r.get("stage") == "ppo"] == [1, 2, 3, 4]


def test_a_killed_run_resumes_from_its_last_checkpoint_with_the_uninterrupted_runs_rows(
        tiny_pipe, whole, tmp_path):
    """`experiments/run.py` killed (SIGKILL) as soon as its step-2 checkpoint (the trainer's
    state with the batches in flight) is whole, in step 3; the same command then resumes from
    that checkpoint, drops what step 3 logged, and writes the rows of the run never stopped."""
    workdir = tmp_path / "run"
    shutil.copytree(tiny_pipe[0].workdir, workdir)
    command = [sys.executable, str(ROOT / "experiments" / "run.py"), *tiny_flags(**STAGE),
               f"--workdir={workdir}"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if (workdir / "checkpoints" / "ppo" / "2").is_dir():
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert not (workdir / "checkpoints" / "ppo" / "4").exists()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rows(workdir) == whole
