"""Asynchronous PPO: the schedule (which version samples which decode chunk of which batch)
worked out by hand, the config's one-line refusals, and the device split."""
import importlib

import pytest

from marl_jax.config_check import validate_config
from marl_jax.train import async_schedule


def _config(**overrides):
    """configs/synthetic.py as a stage=ppo run, with `{"section.field": value}` overrides."""
    c = importlib.import_module("configs.synthetic").get_config()
    c.stage = "ppo"
    for dotted, value in overrides.items():
        section, _, name = dotted.rpartition(".")
        (c[section] if section else c)[name] = value
    return c


def _schedule(k, chunk, length=8, limit=None):
    return async_schedule.Schedule.from_config(_config(**{
        "rollout.max_staleness": k, "rollout.chunk_tokens": chunk,
        "rollout.max_token_staleness": limit, "ppo.response_length": length}))


def test_the_schedule_by_hand():
    # k = 2, responses of 8 tokens in chunks of 3: chunk 0 is positions [0, 3), chunk 1 [3, 6),
    # and a response longer than 6 tokens carries over.
    s = _schedule(2, 3)
    assert (s.chunks, s.chunk_tokens, s.carries_over) == (2, 3, True)
    # Batch 5 is sampled by versions 3 and 4 and trained by update 5.
    assert [s.version(5, i) for i in range(2)] == [3, 4]
    # Iteration 4 (version 4): the last chunk of batch 5, the first of batch 6.
    assert s.decoded_at(4) == [(5, 1), (6, 0)]
    # The warm-up: iterations -2 and -1 start batches 0 and 1 with version 0.
    assert list(s.warm_up()) == [-2, -1]
    assert s.decoded_at(-2) == [(0, 0)] and s.decoded_at(-1) == [(0, 1), (1, 0)]
    assert [s.version(0, 0), s.version(0, 1), s.version(1, 0), s.version(1, 1)] == [0, 0, 0, 0]
    # The default chunk splits the budget over the k chunks: nothing carries over.
    even = _schedule(3, 0, length=8)
    assert (even.chunk_tokens, even.carries_over) == (3, False)
    # Synchronous: one chunk, the whole budget, the step's own version, no warm-up.
    sync = _schedule(0, 0)
    assert (sync.asynchronous, sync.chunks, sync.chunk_tokens, sync.version(7, 0),
            sync.decoded_at(7), list(sync.warm_up())) == (False, 1, 8, 7, [(7, 0)], [])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_chunk_is_decoded_once_at_its_version_and_at_most_k_versions_before_its_update(k):
    s = _schedule(k, 2, length=2 * k)
    seen = {}
    for iteration in range(-k, 12):
        for batch, chunk in s.decoded_at(iteration):
            assert (batch, chunk) not in seen
            seen[batch, chunk] = iteration
            assert s.version(batch, chunk) == max(0, iteration)
            assert 1 <= batch - iteration <= k  # sampled ahead of the update that trains it
    for batch in range(12 - k + 1):
        assert [seen[batch, chunk] for chunk in range(k)] == [batch - k + c for c in range(k)]


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.max_staleness": -1},
     "config.rollout.max_staleness=-1: must be an integer >= 0"),
    ({"rollout.max_staleness": 2, "rollout.max_token_staleness": 1},
     "config.rollout.max_token_staleness=1: must be an integer >= rollout.max_staleness=2"),
    ({"rollout.max_staleness": 1, "rollout.chunk_tokens": 100},
     "config.rollout.chunk_tokens=100: must be an integer in [0, ppo.response_length=72]"),
    ({"rollout.max_staleness": 1, "rollout.sampler_devices": (0, 1),
      "rollout.trainer_devices": (1, 2)},
     "config.rollout.sampler_devices=(0, 1): devices [1] are also in "
     "rollout.trainer_devices=(1, 2): the sampler and the trainer take disjoint sets"),
    ({"rollout.max_staleness": 1, "rollout.trainer_devices": (0,)},
     "config.rollout.trainer_devices=(0,): set rollout.sampler_devices too"),
    ({"rollout.sampler_devices": (1,)},
     "config.rollout.sampler_devices=(1,): the synchronous step (rollout.max_staleness=0) "
     "samples and trains on the same devices"),
    ({"rollout.max_staleness": 1, "stage": "experiment"},
     "config.stage='experiment': rollout.max_staleness=1: the asynchronous loop runs stage ppo "
     "or all"),
    ({"rollout.max_staleness": 2, "ppo.estimator": "dapo", "ppo.group_size": 2},
     "config.ppo.dynamic_sampling_oversample=None: rollout.max_staleness=2: dynamic sampling "
     "(m=3 under ppo.estimator='dapo') selects among a step's own samples"),
    ({"rollout.max_staleness": 1, "ppo.rollout_chunks": 2},
     "config.ppo.rollout_chunks=2: rollout.max_staleness=1: the asynchronous loop decodes"),
    ({"rollout.max_staleness": 1, "ppo.old_logprobs": "sampler"},
     "config.ppo.old_logprobs='sampler': rollout.max_staleness=1: the asynchronous loop clips "
     "against the proximal policy"),
    ({"rollout.max_staleness": 1, "ppo.reward_source": "host"},
     "config.ppo.reward_source='host': rollout.max_staleness=1: host rewards"),
    ({"ppo.rollout_correction": "turn"},
     "config.ppo.rollout_correction='turn': turn weighs each turn of a multi-turn trajectory; "
     "task 'synthetic' trains single responses (use sequence)"),
])
def test_bad_async_settings_are_one_line_at_config_time(overrides, message):
    with pytest.raises(ValueError) as error:
        validate_config(_config(**overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("field, value, message", [
    ("rollout.chunk_tokens", 8, "config.rollout.chunk_tokens=8: rollout.max_staleness=2: a "
     "multi-turn task's trajectories are split over the k chunks by turns"),
    ("rollout.sampler_devices", (1,), "config.rollout.sampler_devices=(1,): rollout."
     "max_staleness=2: a multi-turn task (task 'calculator') plays its episodes in threads"),
    ("ppo.decode_slots", 4, "config.ppo.decode_slots=4: rollout.max_staleness=2: a multi-turn "
     "task's asynchronous turns prefill"),
])
def test_what_a_multi_turn_task_cannot_serve_asynchronously(field, value, message):
    c = importlib.import_module("configs.multiturn_synthetic").get_config()
    c.stage, c.rollout.max_staleness = "ppo", 2
    validate_config(c)
    section, _, name = field.rpartition(".")
    c[section][name] = value
    with pytest.raises(ValueError) as error:
        validate_config(c)
    assert str(error.value).startswith(message)


def test_good_async_settings_pass():
    validate_config(_config(**{"rollout.max_staleness": 2, "rollout.max_token_staleness": 3,
                               "rollout.chunk_tokens": 8, "rollout.sampler_devices": (1,)}))


def test_the_device_split():
    devices = ["d0", "d1", "d2", "d3"]
    split = async_schedule.device_split
    assert split(devices, (), ()) == (devices, devices)
    assert split(devices, (3,), ()) == (["d3"], ["d0", "d1", "d2"])
    assert split(devices, (0, 1), (3,)) == (["d0", "d1"], ["d3"])
    for sampler, trainer, message in [
            ((4,), (), r"config.rollout.sampler_devices=\(4,\): devices \[4\] do not exist "
                       r"\(this run has 4: 0..3\)"),
            ((0,), (0, 1), r"config.rollout.sampler_devices=\(0,\): devices \[0\] also train"),
            ((0, 1, 2, 3), (), "takes all 4 devices, none is left to train"),
            ((), (1,), r"config.rollout.trainer_devices=\(1,\): set rollout.sampler_devices")]:
        with pytest.raises(ValueError, match=message):
            split(devices, sampler, trainer)


def test_the_meshes_of_a_split():
    """Two meshes of `config.mesh` over the sets (the trainer's first); one mesh when nothing
    is split; a set too small for the batch, or a device that does not exist, is one line."""
    import jax

    from marl_jax.train import sharding

    config = _config(**{"rollout.max_staleness": 1, "rollout.sampler_devices": (6, 7),
                        "ppo.batch_size": 16})
    mesh = sharding.make_mesh(config.mesh)
    trainer, sampler = async_schedule.meshes(config, mesh)
    assert [d.id for d in trainer.devices.flat] == list(range(6))
    assert [d.id for d in sampler.devices.flat] == [6, 7]
    config.rollout.sampler_devices = ()
    assert async_schedule.meshes(config, mesh) == (mesh, None)
    config.rollout.sampler_devices, config.ppo.batch_size, config.ppo.group_size = (5, 6, 7), 16, 1
    with pytest.raises(ValueError, match=r"^config.ppo.batch_size \(on the sampler's devices\)"
                                         r"=16 is not divisible by the 3 data-parallel shards"):
        async_schedule.meshes(config, mesh)
    config.rollout.sampler_devices = (8,)
    with pytest.raises(ValueError, match=r"devices \[8\] do not exist \(this run has 8: 0..7\)"):
        async_schedule.meshes(config, mesh)
    assert len(jax.devices()) == 8


def test_a_sampler_device_that_does_not_exist_stops_the_command_in_one_line(tmp_path):
    """Checked where the meshes are built, after the processes join and before anything
    compiles: exit status 2."""
    import os
    import subprocess
    import sys

    from train_util import ROOT

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), f"--workdir={tmp_path / 'run'}",
         "--config.stage=ppo", "--config.rollout.max_staleness=1",
         "--config.rollout.sampler_devices=(3,)"], capture_output=True, text=True, timeout=300,
        env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        "error: config.rollout.sampler_devices=(3,): devices [3] do not exist (this run has 1: "
        "0..0)")


def test_the_async_bench_refuses_a_shape_it_does_not_time():
    import sys
    import types

    from train_util import ROOT

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_async
    import bench_ppo

    with pytest.raises(bench_ppo.Refused, match=r"^--shape='w2' with --async: the asynchronous "
                                                r"loop is timed on w1"):
        bench_async.run(types.SimpleNamespace(shape="w2", small=False, dtype="auto",
                                               repeats=None))
