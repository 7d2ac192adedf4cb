"""The advantage-quality probe of a PPO run (`config.credit`, marl_jax/train/credit.py) and the
study's report (experiments/credit_report.py), on the tests' tiny pipeline: what a probe saves
is scored as numpy computes it by hand."""
import json
import sys

import numpy as np
import pytest

from marl_jax import stages
from marl_jax.config_check import validate_config
from marl_jax.train.metrics import read_metrics

from train_util import ROOT, tiny_config

sys.path.insert(0, str(ROOT / "experiments"))
import credit_report  # noqa: E402

CREDIT = {"credit.every": 1, "credit.prompts": 3, "credit.group_size": 2,
          "credit.continuations": 4, "credit.chunk_states": 64,
          "credit.rules": ("fixed", "low_probability"), "credit.weightings": ("equal",),
          "credit.mc_rollouts": 2}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A one-step PPO run probed at steps 0 and 1: (workdir, credit rows by step)."""
    workdir = tmp_path_factory.mktemp("credit") / "run"
    cfg = tiny_config(**{"ppo.steps": 1, "ppo.eval_every": 0, **CREDIT})
    stages.run(cfg, str(workdir))
    rows = {r["step"]: r for r in read_metrics(str(workdir)) if r["stage"] == "credit"}
    return workdir, rows


def _load(workdir, step):
    return dict(np.load(workdir / "credit" / f"step_{step}.npz"))


def _gae(values, rewards, length, gamma, lam):
    """Token GAE of one response by the textbook backward loop (V after the last token 0)."""
    adv, running = np.zeros(length), 0.0
    for t in reversed(range(length)):
        following = values[t + 1] if t + 1 < length else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lam * running
        adv[t] = running
    return adv


def test_probe_scores_equal_numpy_on_its_saved_inputs(probed):
    workdir, rows = probed
    assert sorted(rows) == [0, 1]
    for step, row in rows.items():
        x = _load(workdir, step)
        mask = x["response_mask"]
        lengths = np.cumprod(mask != 0, axis=1).sum(axis=1)
        # Every state of every response was valued: positions 0..L_b, the terminal one 0.
        states = {(int(b), int(t)): i for i, (b, t) in enumerate(zip(x["state_rows"],
                                                                     x["state_positions"]))}
        assert sorted(states) == sorted((b, t) for b in range(mask.shape[0])
                                        for t in range(lengths[b] + 1) if lengths[b])
        v = x["state_mean"]
        terminal = [states[(b, int(lengths[b]))] for b in range(mask.shape[0]) if lengths[b]]
        assert np.all(v[terminal] == 0) and np.all(x["state_se"][terminal] == 0)
        gamma, lam = float(x["gamma"]), float(x["lam"])
        truth, token_gae, control = [], [], []
        num_macros = sum(len(np.unique(x["segments/fixed"][b, :lengths[b]]))
                         for b in range(mask.shape[0]))
        macro_length = mask.sum() / num_macros
        for b in range(mask.shape[0]):
            n = int(lengths[b])
            truth += [x["rewards"][b, t] + gamma * v[states[(b, t + 1)]] - v[states[(b, t)]]
                      for t in range(n)]
            token_gae.append(_gae(x["values"][b], x["rewards"][b], n, gamma, lam))
            control.append(_gae(x["values"][b], x["rewards"][b], n, gamma,
                                lam ** (1 / macro_length)))
            # The estimators' advantages as the probe saved them.
            np.testing.assert_allclose(x["advantages/token_gae"][b, :n], token_gae[-1],
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(x["advantages/control/fixed"][b, :n], control[-1],
                                       rtol=1e-4, atol=1e-5)
        truth = np.array(truth)
        for name in ("token_gae", "control/fixed", "macro_gae/fixed/equal", "grpo", "rloo",
                     "macro_mc/fixed", "macro_gae/low_probability/equal"):
            estimate = np.concatenate([x[f"advantages/{name}"][b, :lengths[b]]
                                       for b in range(mask.shape[0])])
            assert row[f"credit/token/{name}/pearson"] == pytest.approx(
                np.corrcoef(estimate, truth)[0, 1], abs=1e-9), (step, name)
            assert row[f"credit/token/{name}/sign_agreement"] == pytest.approx(
                np.mean(np.sign(estimate) == np.sign(truth)), abs=1e-9), (step, name)
        # GRPO: one advantage per response, the group's normalised terminal rewards.
        grpo = x["advantages/grpo"][:, 0].reshape(-1, 2)
        assert np.allclose(grpo.sum(axis=1), 0, atol=1e-5)


def test_report_pools_seed_sets_and_states_differences_that_hold_on_every_set(probed, tmp_path):
    workdir, _ = probed
    page = tmp_path / "credit.md"
    page.write_text("# credit\n<!-- credit-study:start -->\n<!-- credit-study:end -->\nafter\n")
    results, plot = tmp_path / "results.json", tmp_path / "credit.png"
    # Steps 0, 1 and 1 as start, middle and end: a run of two probes pooled with itself.
    assert credit_report.main([f"{workdir},{workdir}", str(workdir), "--page", str(page),
                               "--results", str(results), "--plot", str(plot)]) == 0
    out = json.loads(results.read_text())["results"]
    x = _load(workdir, 1)
    lengths = np.cumprod(x["response_mask"] != 0, axis=1).sum(axis=1)
    # A run pooled with itself: twice the states and prompts, the same point estimates.
    pooled, single = out[0]["end"]["scores"]["token"], out[1]["end"]["scores"]["token"]
    assert pooled["token_gae"]["states"] == 2 * single["token_gae"]["states"] == 2 * lengths.sum()
    assert pooled["grpo"]["prompts"] == 2 * single["grpo"]["prompts"] == 2 * 3
    for name, entry in single.items():
        assert pooled[name]["pearson"]["value"] == pytest.approx(entry["pearson"]["value"])
    text = page.read_text()
    assert text.startswith("# credit\n") and text.endswith("after\n") and plot.stat().st_size
    for phase in credit_report.PHASES:
        for name, diff in out[0][phase]["vs_token_gae"].items():
            stated = f"- {name} at the {phase}:" in text
            holds = all(0 not in (credit_report.st.direction(r[phase]["vs_token_gae"][name]["ci"]),)
                        for r in out) and len({credit_report.st.direction(
                            r[phase]["vs_token_gae"][name]["ci"]) for r in out}) == 1
            assert stated == holds, (phase, name)


@pytest.mark.parametrize("field, value, words", [
    ("credit.continuations", 1, "compares two halves"),
    ("credit.rules", ("fixed", "parsing"), "rules cut on the device"),
    ("ppo.estimator", "grpo", "scores the run's critic"),
])
def test_bad_probe_settings_are_one_line(field, value, words):
    cfg = tiny_config(**{**CREDIT, field: value})
    with pytest.raises(ValueError, match=words) as error:
        validate_config(cfg)
    assert "\n" not in str(error.value)
