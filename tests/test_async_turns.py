"""Asynchronous PPO on the calculator task (k = 2: turns 0-1 of batch s by version s - 2, turns
2-3 by version s - 1, each batch's episodes played in a thread of their own): every action
token's version against that rule, and each token's sampler logprob against the logprob that
its version's weights (the actor's at that step, recorded) give it in a full forward pass, so the
turns of one trajectory were played by different versions; two runs give the same trajectories
and metrics; `stage=ppo` stopped by a preemption notice and run again gives the uninterrupted
run's rows (the batches in flight played again from their start)."""
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from marl_jax import stages
from marl_jax.pipeline import Pipeline
from marl_jax.rollout import turns
from marl_jax.train import async_schedule, build, metrics as metrics_lib, phases, preemption
from marl_jax.train import programs, sharding
from marl_jax.train import ppo as ppo_lib
from marl_jax.train.async_turns import AsyncTurnsStep

from test_multiturn_task import tiny_calculator_config

K, ITERATIONS = 2, 4
SETTINGS = {"stage": "ppo", "ppo.batch_size": 8, "ppo.steps": 4, "ppo.eval_every": 2,
            "checkpoint_every": 2, "rollout.max_staleness": K}


def _config():
    config = tiny_calculator_config(max_turns=4)
    for dotted, value in SETTINGS.items():
        section, _, name = dotted.rpartition(".")
        (config[section] if section else config)[name] = value
    return config


@pytest.fixture(scope="module")
def sft_pipe(tmp_path_factory):
    config = _config()
    pipe = Pipeline(config, str(tmp_path_factory.mktemp("async_turns")),
                    run_earlier_stages=True)
    yield config, pipe, pipe.sft()
    pipe.close()


def _run(sft_pipe):
    """`ITERATIONS` iterations from a fresh start: per iteration the trained batch's trajectory
    arrays, its prompts, the metrics, and the actor's weights at the iteration's start."""
    config, pipe, sft = sft_pipe
    static = ppo_lib.static_from_config(config, pipe.task.tokenizer)
    mods = ppo_lib.make_models(config, pipe.policy, pipe.critic, pipe.reward_model)
    critic = ppo_lib.initial_critic_params(config, pipe.critic, sft, None, jax.random.key(1))
    mesh = pipe.mesh
    state_sh = ppo_lib.state_shardings(mods, mesh, sft, critic)
    frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, None)
    # A reference other than the actor: the KL in the rewards makes every update move the
    # weights (the policy earns no reward yet), so the versions' weights differ.
    reference = jax.tree.map(lambda x: x * 1.05, sft)
    frozen = jax.device_put(ppo_lib.frozen_models(mods, reference, None,
                                                  {"mean": 0.0, "std": 1.0}), frozen_sh)
    state = jax.device_put(ppo_lib.initial_state(config, mods, sft, critic, config.seed),
                           state_sh, may_alias=False)
    hparams = jax.device_put(ppo_lib.hparams_from_config(config.ppo), sharding.replicated(mesh))
    played, trace = {}, []
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            pipe.policy.config))):
        loop = AsyncTurnsStep(config, pipe.task, static, mods, state_sh, frozen_sh, mesh,
                              async_schedule.Schedule.from_config(config), timed=False)
        arrays = loop.trajectory_arrays
        loop.trajectory_arrays = lambda b: played.setdefault(b, arrays(b))
        state = loop.initial_state(state, frozen)
        try:
            for step in range(ITERATIONS):
                weights = jax.device_get(state.ppo.actor_params)
                state, metrics = loop(state, frozen, hparams, step)
                trace.append((played[step], jax.device_get(metrics), weights))
        finally:
            loop.close()
    return trace, static, mods


@pytest.fixture(scope="module")
def trace(sft_pipe):
    return _run(sft_pipe)


def test_every_turn_is_played_by_its_version(trace, sft_pipe):
    config, pipe, _ = sft_pipe
    runs, static, mods = trace
    task = pipe.task
    weights = [w for _, _, w in runs]
    logprobs = jax.jit(lambda p, *a: phases.score.token_logprobs(mods.policy, p, *a,
                                                                  static.temperature)[0])
    mixed = 0
    for s, (arrays, metrics, _) in enumerate(runs):
        actions = arrays["kinds"] == turns.ACTION
        # By hand: turns 0 and 1 by version s - 2, turns 2 and 3 by s - 1 (never below 0).
        want = np.maximum(0, s - K + np.minimum(arrays["turn_ids"] // 2, K - 1))
        np.testing.assert_array_equal(arrays["versions"], np.where(actions, want, -1))
        # The sampler's logprob of each action token is what its version's weights give it.
        rows = _rows(config, task, s)
        args = (task.rl["ids"][rows], task.rl["mask"][rows], arrays["tokens"],
                (arrays["kinds"] != turns.PAD).astype(np.int32))
        for version in np.unique(arrays["versions"][actions]):
            tokens = actions & (arrays["versions"] == version)
            np.testing.assert_allclose(np.asarray(logprobs(weights[version], *args))[tokens],
                                       arrays["logprobs"][tokens], atol=1e-4,
                                       err_msg=f"batch {s}, version {version}")
            if version + 1 <= s:  # the next version's weights give them other logprobs
                other = np.asarray(logprobs(weights[version + 1], *args))[tokens]
                assert np.abs(other - arrays["logprobs"][tokens]).max() > 1e-3
        spans = np.array([len(set(arrays["versions"][b][actions[b]])) for b in range(len(rows))])
        mixed += int((spans >= 2).sum())
        assert int(metrics["async/tokens_generated"]) == int(metrics["async/tokens_trained"]) + int(
            metrics["async/tokens_stale"]) + int(metrics["async/tokens_in_flight"])
    assert mixed > 0  # trajectories whose turns two versions played


def _rows(config, task, batch):
    from marl_jax.data import batches

    return batches.batch_indices(len(task.rl["ids"]), config.ppo.batch_size, config.seed + 2,
                                 batch)


def test_two_runs_play_the_same_trajectories(trace, sft_pipe):
    again, _, _ = _run(sft_pipe)
    assert len(again) == len(trace[0]) == ITERATIONS
    for (arrays, metrics, _), (arrays2, metrics2, _) in zip(trace[0], again):
        for key in arrays:
            np.testing.assert_array_equal(arrays[key], arrays2[key], err_msg=key)
        assert sorted(metrics) == sorted(metrics2)
        for key in metrics:
            np.testing.assert_array_equal(np.asarray(metrics[key]), np.asarray(metrics2[key]))


def _rows_of(workdir):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))}
            for r in metrics_lib.read_metrics(str(workdir))]


def test_a_preempted_run_resumes_with_the_uninterrupted_runs_rows(sft_pipe, tmp_path,
                                                                   monkeypatch):
    config, pipe, _ = sft_pipe
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for workdir in (whole, stopped):
        shutil.copytree(pipe.workdir, workdir)
    stages.run(_config(), str(whole))
    call = AsyncTurnsStep.__call__

    def signalled(self, state, frozen, hparams, step):
        out = call(self, state, frozen, hparams, step)
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(AsyncTurnsStep, "__call__", signalled)
    with pytest.raises(preemption.Preempted) as stop:
        stages.run(_config(), str(stopped))
    assert stop.value.step == 1
    monkeypatch.undo()
    stages.run(_config(), str(stopped))
    rows = _rows_of(whole)
    assert [r["step"] for r in rows if r.get("stage") == "ppo"] == [1, 2, 3, 4]
    assert _rows_of(stopped) == rows
