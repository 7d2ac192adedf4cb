"""Valuing a credit probe's states again (experiments/credit_revalue.py,
marl_jax/eval/credit_recheck.py) on the tests' tiny pipeline: fresh continuations of the restored
policy agree with what the probe saved, a shifted truth is caught, and the comparison's numbers
equal hand computations."""
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from train_util import ROOT, tiny_config, tiny_flags

from marl_jax import stages
from marl_jax.eval import credit_recheck

sys.path.insert(0, str(ROOT / "experiments"))
import credit_revalue

RUN = {"ppo.steps": 1, "ppo.eval_every": 0, "checkpoint_every": 1, "max_to_keep": 3,
       "credit.every": 1, "credit.prompts": 3, "credit.group_size": 2,
       "credit.continuations": 8, "credit.chunk_states": 128, "credit.rules": ("fixed",),
       "credit.weightings": ("equal",), "credit.mc_rollouts": 2}
SIZES = {"states": 10, "continuations": 32, "seed": 7}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A one-step PPO run probed (and checkpointed) at steps 0 and 1, and the policy of its
    probe at step 1 restored: (workdir, policy, saved inputs of step 1)."""
    workdir = tmp_path_factory.mktemp("revalue") / "run"
    cfg = tiny_config(**RUN)
    stages.run(cfg, str(workdir))
    policy = credit_revalue.restore_policy(tiny_config(**RUN), str(workdir), 1)
    return workdir, policy, dict(np.load(workdir / "credit" / "step_1.npz"))


def _states(inputs):
    return {(int(b), int(t)): i for i, (b, t) in enumerate(zip(inputs["state_rows"],
                                                               inputs["state_positions"]))}


def test_fresh_values_agree_with_the_probes_and_give_its_advantages(probed):
    _, policy, inputs = probed
    report = credit_revalue.revalue(policy, inputs, **SIZES)
    tokens, states = report["tokens"], report["states"]
    pairs = list(zip(tokens["rows"], tokens["positions"]))
    assert len(set(pairs)) == SIZES["states"]
    # Both states of every drawn token, each once, with the probe's saved values beside them.
    expected = sorted({(b, t) for b, t in pairs} | {(b, t + 1) for b, t in pairs})
    assert list(zip(states["rows"], states["positions"])) == expected
    saved = _states(inputs)
    np.testing.assert_array_equal(states["saved_mean"],
                                  [inputs["state_mean"][saved[p]] for p in expected])
    # The restored policy is the probe's: its own rewards and critic values, reproduced.
    assert report["reproduced"]["ok"] and report["reproduced"]["max_reward_diff"] < 1e-4
    at = {p: i for i, p in enumerate(expected)}
    gamma, new_v, saved_v = inputs["gamma"], np.array(states["new_mean"]), inputs["state_mean"]
    for i, (b, t) in enumerate(pairs):
        assert tokens["new_reward"][i] == pytest.approx(inputs["rewards"][b, t], abs=1e-4)
        assert tokens["saved_advantage"][i] == pytest.approx(
            inputs["rewards"][b, t] + gamma * saved_v[saved[(b, t + 1)]] - saved_v[saved[(b, t)]])
        assert tokens["new_advantage"][i] == pytest.approx(
            tokens["new_reward"][i] + gamma * new_v[at[(b, t + 1)]] - new_v[at[(b, t)]])
    z = np.array([x for x in states["z"] if x is not None])
    assert report["consistent"] and states["p_value"] > 0.01 and np.all(np.abs(z) < 4)
    assert np.all(np.abs([x for x in tokens["z"] if x is not None]) < 4)
    assert credit_revalue.summary(report).endswith(": consistent")


def test_a_shifted_truth_is_inconsistent(probed):
    _, policy, inputs = probed
    corrupted = dict(inputs)
    # Every non-terminal state's saved value moved by four of its standard errors.
    corrupted["state_mean"] = inputs["state_mean"] + 4 * inputs["state_se"]
    report = credit_revalue.revalue(policy, corrupted, **SIZES)
    assert not report["consistent"] and report["states"]["p_value"] < 1e-3
    assert report["reproduced"]["ok"]
    assert "the saved values disagree with fresh ones" in credit_revalue.summary(report)


def _command(workdir, step):
    return [sys.executable, str(ROOT / "experiments" / "credit_revalue.py"), str(workdir),
            *tiny_flags(**RUN), f"--step={step}", "--states=10", "--continuations=32"]


def test_the_command_exits_1_on_a_shifted_truth_and_2_without_the_step(probed, tmp_path):
    workdir, _, inputs = probed
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    np.savez(copy / "credit" / "step_1.npz",
             **dict(inputs, state_mean=inputs["state_mean"] + 4 * inputs["state_se"]))
    result = subprocess.run(_command(copy, 1), check=False, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2].endswith("(p < 0.001)")
    result = subprocess.run(_command(copy, 5), check=False, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (f"error: {copy}: no probe was saved at step 5 (credit/step_5.npz; probes at [0, 1]); "
        "steps with a probe and its policy: [0, 1]")]


def test_compare_values_on_hand_numbers():
    out = credit_recheck.compare_values([1.0, 2.0, 0.0], [0.3, 0.4, 0.0],
                                        [1.4, 1.7, 0.0], [0.4, 0.3, 0.0])
    # z = 0.4 / 0.5 and -0.3 / 0.5; the terminal pair (both exact) is no test.
    assert out["z"][:2] == pytest.approx([0.8, -0.6]) and out["z"][2] is None
    assert out["tested"] == 2 and out["chi2"] == pytest.approx(1.0)
    # Chi-square with 2 degrees of freedom: P(X >= x) = exp(-x / 2).
    assert out["p_value"] == pytest.approx(math.exp(-0.5)) and out["consistent"]
    assert out["mean_z2"] == pytest.approx(0.5) and out["frac_within_2"] == 1.0
    # One degree of freedom: P(X >= z^2) = erfc(|z| / sqrt 2), 0.0027 at z = 3, 0.00047 at 3.5.
    for z, consistent in ((3.0, True), (3.5, False)):
        one = credit_recheck.compare_values([0.0], [0.6], [z], [0.8])  # scale 1
        assert one["p_value"] == pytest.approx(math.erfc(z / math.sqrt(2)))
        assert one["consistent"] is consistent and one["frac_within_2"] == 0.0
    # Exact values that differ contradict each other whatever the rest.
    out = credit_recheck.compare_values([0.0, 1.0], [0.0, 0.1], [0.5, 1.0], [0.0, 0.1])
    assert out["z"][0] == math.inf and out["p_value"] == 0.0 and not out["consistent"]
    # Up to float32 rounding of the rewards, exact values agree.
    out = credit_recheck.compare_values([1.0, 2.0], [0.0, 0.0], [1.0 + 1e-6, 2.0], [0.0, 1e-7])
    assert out["z"] == [None, None] and out["tested"] == 0 and out["consistent"]


def test_picked_tokens_are_distinct_valid_and_seeded():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    rows, positions = credit_recheck.pick_tokens(mask, 3, seed=7)
    assert len(set(zip(rows, positions))) == 3
    assert all(mask[b, t] for b, t in zip(rows, positions))
    again = credit_recheck.pick_tokens(mask, 3, seed=7)
    assert rows.tolist() == again[0].tolist() and positions.tolist() == again[1].tolist()
    rows, positions = credit_recheck.pick_tokens(mask, 10, seed=0)
    assert list(zip(rows, positions)) == [(0, 0), (0, 1), (0, 2), (1, 0)]
