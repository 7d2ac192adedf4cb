"""Multi-turn PPO end to end on the calculator task (configs/multiturn_synthetic.py): the
trajectories the policy plays replay through a fresh environment and equal the chat template of
their conversations; a vmapped experiment measures each macro arm's mean macro length on the
trajectories its first step trains on and gives its control lam^(1/L); a run killed with SIGKILL
during its PPO steps and started again gives the uninterrupted run's rows; bad multi-turn
settings are one line before anything compiles."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from marl_jax import envs, stages
from marl_jax.config_check import validate_config
from marl_jax.envs.chat_turns import end_of_turn_ids
from marl_jax.pipeline import Pipeline
from marl_jax.rollout import turns
from marl_jax.train import ppo as ppo_lib, turn_step
from marl_jax.train.metrics import read_metrics

import real_util
from test_multiturn_task import tiny_calculator_config
from train_util import ROOT, tiny_config


@pytest.fixture(scope="module")
def sft_pipe(tmp_path_factory):
    config = tiny_calculator_config()
    config.sft.steps = 100
    pipe = Pipeline(config, str(tmp_path_factory.mktemp("multiturn")))
    yield config, pipe, pipe.sft()
    pipe.close()


def _template(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


def test_played_trajectories_replay_through_a_fresh_environment(sft_pipe):
    """Every turn's actions, stepped through a fresh environment by hand, give the rewards the
    trajectory holds on that turn's last action token and end where it ends; a trajectory that
    ended cleanly is, after its prompt, the chat template of its whole conversation."""
    config, pipe, params = sft_pipe
    task, tok = pipe.task, pipe.task.tokenizer
    static = ppo_lib.static_from_config(config, tok)
    player = turn_step.TrajectoryPlayer(config, task, static, pipe.policy)
    rows = task.info["rl_rows"][:8]
    seeds = turn_step.episode_seeds(0, 0, range(len(rows)))
    traj = player.play(params, task.rl["ids"][:8], task.rl["mask"][:8], rows, seeds,
                       jax.random.key(3))
    env = envs.environment(task.environment["name"], **task.environment["kwargs"])
    end = end_of_turn_ids(tok)[0]
    played_turns, clean = 0, 0
    for b, row in enumerate(rows):
        state, messages = env.reset_row(row, np.random.default_rng(seeds[b]))
        conversation, closed = list(messages), True
        kinds, ids = traj.kinds[b], traj.turn_ids[b]
        total = 0.0
        for t in range(int(traj.num_turns[b])):
            positions = np.flatnonzero((kinds == turns.ACTION) & (ids == t))
            action = traj.tokens[b, positions].tolist()
            if traj.truncated[b] and t == traj.num_turns[b] - 1:
                break  # the budget cut this turn: it was not stepped
            text = tok.decode(action, skip_special_tokens=True)
            state, observation, reward, done = env.step_row(state, text, action)
            played_turns += 1
            assert traj.turn_rewards[b, positions[-1]] == np.float32(reward), (b, t)
            total += reward
            closed &= action[-1] == end
            conversation.append({"role": "assistant", "content": text})
            if done:
                assert t == traj.num_turns[b] - 1 and not traj.truncated[b], (b, t)
                break
            conversation.append({"role": env.observation_role, "content": observation})
        np.testing.assert_allclose(traj.turn_rewards[b].sum(), total, rtol=1e-6)
        if closed and not traj.truncated[b] and not traj.failed[b]:
            clean += 1
            prompt = task.rl["ids"][b][task.rl["mask"][b] == 1].tolist()
            assert prompt + traj.tokens[b][kinds != turns.PAD].tolist() == _template(
                tok, conversation), b
    assert played_turns > len(rows) and clean > 0


def _experiment_config(tmp_path):
    config = tiny_calculator_config()
    config.stage = "experiment"
    config.seeds = (0,)
    config.sft.steps = 20
    config.ppo.update(dict(steps=2, eval_every=2, batch_size=16, num_minibatches=2))
    config.task.num_eval_prompts = 4
    config.experiment.update(dict(arms=("ppo", "ma_ppo_turn", "ma_ppo"), add_controls=True))
    return config


def test_a_multi_turn_experiment_measures_macro_lengths_on_its_trajectories(tmp_path):
    config = _experiment_config(tmp_path)
    stages.run(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    plan = next(r for r in rows if r["stage"] == "plan")
    runs = {r["arm"]: r for r in plan["per_run"]}
    assert set(runs) == {"ppo", "ma_ppo_turn", "ma_ppo_turn_ctrl", "ma_ppo", "ma_ppo_ctrl"}
    first = {r["arm"]: r for r in rows if r["stage"] == "ppo" and r["step"] == 1}
    for arm in ("ma_ppo_turn", "ma_ppo"):
        length = runs[arm]["mean_macro_length"]
        # Measured on the trajectories of the arm's first step: its macro lengths there.
        np.testing.assert_allclose(length, first[arm]["macro/len_avg"], rtol=1e-6)
        control = runs[arm + "_ctrl"]
        np.testing.assert_allclose(control["lam"], runs[arm]["lam"] ** (1 / length), rtol=1e-6)
    # A turn macro is a whole turn: action tokens over turns.
    turn = first["ma_ppo_turn"]
    np.testing.assert_allclose(turn["macro/num_macros_avg"], turn["multiturn/turns_avg"],
                               rtol=1e-6)
    # Every run of the seed plays the same first step (the SFT policy, the same keys).
    generated = {first[a]["budget/generated_tokens"] for a in runs}
    assert len(generated) == 1
    evals = [r for r in rows if r["stage"] == "eval" and r["step"] == 2]
    assert {r["arm"] for r in evals} == set(runs)
    for r in evals:
        assert 0 <= r["gold"] <= 1 and r["rm_score"] == r["gold"] and r["length"] > 0
    assert {r["arm"] for r in rows if r["stage"] == "final"} >= set(runs)


# Every step checkpoints, so the kill lands between (or inside) checkpoints of the PPO stage.
KILL_FLAGS = {
    "stage": "all", "sft.steps": 20, "ppo.steps": 3, "ppo.eval_every": 3, "ppo.batch_size": 8,
    "task.num_eval_prompts": 4, "task.num_sft": 64, "task.num_rl_prompts": 16,
    "model.config.num_layers": 1, "checkpoint_every": 1,
    "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
}
TIMING = ("timing/", "perf/", "train_s", "steps/s")


def _command(workdir):
    return [sys.executable, str(ROOT / "experiments" / "run.py"),
            f"--config={ROOT / 'configs' / 'multiturn_synthetic.py'}", f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in KILL_FLAGS.items())]


def _rows(workdir):
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_sigkill_during_multi_turn_ppo_then_rerun_gives_the_same_run(tmp_path):
    env = real_util.one_device_run_env()
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(_command(whole), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=log)
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if list((killed / "checkpoints" / "ppo").glob("1*")):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-4000:]
    again = subprocess.run(_command(killed), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "[sft]" not in again.stderr  # resumed from the PPO checkpoint, SFT done
    want, got = _rows(whole), _rows(killed)
    assert [(r["stage"], r.get("step")) for r in got] == [(r["stage"], r.get("step"))
                                                          for r in want]
    assert got == want
    assert any("multiturn/turns_avg" in r for r in want)


@pytest.mark.parametrize("overrides, message", [
    ({"task.max_turns": 0}, "config.task.max_turns=0: must be an integer >= 1"),
    ({"task.max_observation_tokens": -1}, "config.task.max_observation_tokens=-1: must be"),
    ({"ppo.reward_source": "rm"}, "config.ppo.reward_source='rm': task 'calculator' is an "
                                  "environment"),
    ({"ppo.critic_init": "rm"}, "config.ppo.critic_init='rm': task 'calculator' has no reward "
                                "model"),
    ({"stage": "eval"}, "config.stage='eval': task 'calculator' is evaluated by its ppo stage"),
    ({"ppo.termination": "parsing"}, "config.ppo.termination='parsing': parsing reads single "
                                     "responses"),
    ({"ppo.eval_samples_per_prompt": 4}, "config.ppo.eval_samples_per_prompt=4: task "
                                         "'calculator' is evaluated by one episode per "
                                         "held-out prompt"),
])
def test_bad_multi_turn_settings_are_one_line(overrides, message):
    config = tiny_calculator_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value


def test_the_environments_reward_needs_an_environment():
    config = tiny_config(**{"ppo.reward_source": "env"})
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith("config.ppo.reward_source='env': env (an environment's "
                                       "rewards) needs a multi-turn task")
