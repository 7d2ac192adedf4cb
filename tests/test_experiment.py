"""The default experiment: report arithmetic by hand, and a shortened run of the default command
whose report is recomputed here from metrics.jsonl."""
import json
import os

import numpy as np
import pytest

from marl_jax import experiment
from marl_jax.eval import report as report_lib
from marl_jax.train.metrics import read_metrics

from train_util import tiny_config


def _eval(arm, seed, step, gold, kl, rm=0.0):
    return dict(stage="eval", arm=arm, seed=seed, step=step, gold=gold, kl=kl, rm_score=rm)


def _hand_rows():
    rows = []
    for seed in (0, 1):
        for step, g in zip((0, 10, 20, 30), (0.5, 0.6, 0.7, 0.8)):
            rows.append(_eval("ppo", seed, step, g, 2.0 if step == 30 else 1.0))
        for step, g in zip((0, 10, 20, 30), (0.5, 0.7, 0.8, 0.8)):
            rows.append(_eval("ma_ppo", seed, step, g, 4.0 if step == 30 else 1.0))
    rows += [
        dict(stage="final", arm="ppo", seed=0, gold_per_prompt=[0.1, 0.5, 0.9],
             rm_score_per_prompt=[0, 0, 0]),
        dict(stage="final", arm="ma_ppo", seed=0, gold_per_prompt=[0.2, 0.5, 0.3],
             rm_score_per_prompt=[0, 0, 0]),
        dict(stage="final", arm="ppo", seed=1, gold_per_prompt=[0.0, 0.0],
             rm_score_per_prompt=[0, 0]),
        dict(stage="final", arm="ma_ppo", seed=1, gold_per_prompt=[1.0, 1.0],
             rm_score_per_prompt=[0, 0]),
    ]
    return rows


def test_report_numbers_by_hand():
    r = report_lib.compute_report(_hand_rows(), beta=0.05, smoothing=1, baseline="ppo",
                                  arms=("ppo", "ma_ppo"))
    ppo, ma = r["arms"]["ppo"], r["arms"]["ma_ppo"]
    assert r["sft_gold"] == pytest.approx(0.5) and r["gain"] == pytest.approx(0.3)
    assert (ppo["steps_to_50"], ppo["steps_to_90"], ppo["steps_to_parity"]) == (20, 30, 30)
    assert (ma["steps_to_50"], ma["steps_to_90"], ma["steps_to_parity"]) == (10, 20, 20)
    assert ppo["speedup_to_parity"] == pytest.approx(1.0)
    assert ma["speedup_to_parity"] == pytest.approx(1.5)
    assert r["speedup_to_parity"] == pytest.approx(1.5)
    assert ppo["J"][0] == pytest.approx(0.8 - 0.05 * 2.0)
    assert ma["J"][0] == pytest.approx(0.8 - 0.05 * 4.0)
    # win, tie, loss on seed 0; two wins on seed 1.
    assert r["win_rate_ma_vs_ppo"] == pytest.approx((1 + 0.5 + 0 + 1 + 1) / 5)
    assert ppo["win_rate_vs_ppo"] == pytest.approx(0.5)
    # Same final gold on both seeds: indistinguishable; J lower on both seeds: worse.
    assert "ma_ppo is not distinguishable from ppo on gold" in r["verdict"][0]
    assert "ma_ppo is worse than ppo on J" in r["verdict"][1]


def test_report_smoothing_moves_the_step_counts():
    r = report_lib.compute_report(_hand_rows(), beta=0.05, smoothing=2, baseline="ppo",
                                  arms=("ppo", "ma_ppo"))
    # Smoothed baseline: 0.5, 0.55, 0.65, 0.75; MA-PPO: 0.5, 0.6, 0.75, 0.8.
    assert r["baseline_final_gold"] == pytest.approx(0.75)
    ma = r["arms"]["ma_ppo"]
    assert (ma["steps_to_50"], ma["steps_to_90"], ma["steps_to_parity"]) == (20, 20, 20)
    assert ma["speedup_to_parity"] == pytest.approx(30 / 20)


def test_unknown_arm_is_named():
    cfg = tiny_config()
    cfg.experiment.arms = ("ppo", "reinforce")
    with pytest.raises(ValueError, match="reinforce"):
        experiment.plan_runs(cfg)


def test_matched_control_uses_the_implied_hyper_parameters():
    cfg = tiny_config()
    runs = {(r.arm, r.seed): r.ppo for r in experiment.plan_runs(cfg)}
    matched, ma = runs[("ppo_matched", 0)], runs[("ma_ppo", 0)]
    assert matched["ngram"] == 1 and ma["ngram"] == cfg.ppo.ngram == 5
    assert matched["lam"] == pytest.approx(0.95 ** (1 / 5))
    assert matched["kl_coef"] == pytest.approx(0.05 / 5)
    smdp = runs[("ma_ppo_smdp", 1)]
    assert (smdp["value_weighting"], smdp["reward_aggregation"]) == ("first", "sum")


def _recompute(rows, beta, smoothing):
    """An independent recomputation of the report's headline numbers from metrics rows."""
    evals = [r for r in rows if r["stage"] == "eval"]
    arms = sorted({r["arm"] for r in evals})
    steps = sorted({r["step"] for r in evals})
    curve, final = {}, {}
    for arm in arms:
        mean = []
        for t in steps:
            g = [r["gold"] for r in evals if r["arm"] == arm and r["step"] == t]
            mean.append(sum(g) / len(g))
        smooth = [np.mean(mean[max(0, i - smoothing + 1):i + 1]) for i in range(len(mean))]
        curve[arm] = smooth
        last = [r for r in evals if r["arm"] == arm and r["step"] == steps[-1]]
        final[arm] = np.mean([r["gold"] - beta * r["kl"] for r in last])
    sft = np.mean([r["gold"] for r in evals if r["arm"] == "ppo" and r["step"] == 0])
    target = curve["ppo"][-1]

    def first(arm, level):
        for t, v in zip(steps, curve[arm]):
            if v >= level - 1e-12:
                return t
        return None

    out = {}
    for arm in arms:
        gain = target - sft
        out[arm] = dict(J=final[arm], s50=first(arm, sft + 0.5 * gain) if gain > 0 else None,
                        s90=first(arm, sft + 0.9 * gain) if gain > 0 else None,
                        parity=first(arm, target) if gain > 0 else None)
    return out, first("ppo", target) if target > sft else None


def test_shortened_default_experiment(tmp_path):
    cfg = tiny_config()
    cfg.stage = "experiment"
    cfg.ppo.steps = 4
    cfg.ppo.eval_every = 2
    workdir = str(tmp_path)
    report = experiment.run_experiment(cfg, workdir)
    for name in ("report.md", "report.json", "curves.png", "rm_hist.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0
    with open(os.path.join(workdir, "report.json")) as f:
        on_disk = json.load(f)
    assert set(on_disk["arms"]) == {"ppo", "ma_ppo", "ppo_matched", "ma_ppo_smdp"}
    assert on_disk["beta"] == cfg.ppo.kl_coef

    rows = read_metrics(workdir)
    # One training row per arm, seed and step; evaluation rows at 0, 2, 4.
    train = [r for r in rows if r["stage"] == "ppo"]
    assert len(train) == 4 * 2 * 4
    assert {(r["arm"], r["seed"], r["step"]) for r in train} == {
        (a, s, t) for a in on_disk["arms"] for s in (0, 1) for t in (1, 2, 3, 4)}
    assert {r["step"] for r in rows if r["stage"] == "eval"} == {0, 2, 4}
    assert all("critic/explained_variance" in r for r in train)

    expected, ppo_parity = _recompute(rows, cfg.ppo.kl_coef, cfg.experiment.smoothing)
    for arm, e in expected.items():
        got = on_disk["arms"][arm]
        assert got["J"][0] == pytest.approx(e["J"], abs=1e-9)
        assert got["steps_to_50"] == e["s50"] and got["steps_to_90"] == e["s90"]
        if e["parity"] and ppo_parity is not None:
            assert got["speedup_to_parity"] == pytest.approx(ppo_parity / e["parity"])
        else:
            assert got["speedup_to_parity"] is None
    text = open(os.path.join(workdir, "report.md")).read()
    assert "## Verdict" in text and "ma_ppo" in text.split("## Verdict")[1]
    # Every arm of a seed starts from the same SFT policy: identical step-0 evaluations.
    step0 = [r for r in rows if r["stage"] == "eval" and r["step"] == 0 and r["seed"] == 0]
    assert len({round(r["gold"], 9) for r in step0}) == 1
    assert report["win_rate_ma_vs_ppo"] == on_disk["win_rate_ma_vs_ppo"]
