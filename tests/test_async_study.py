"""The asynchronous-PPO study (`stage=async_study`, marl_jax/async_study.py) on a tiny config:
every (arm, variant, seed) a stage=ppo run from one SFT policy and reward model, the study's rows
recomputed from each run's own metrics, and bad variants named at plan time."""
import json
import os
import re

import ml_collections
import numpy as np
import pytest

from marl_jax import async_study
from marl_jax.eval import report as report_lib
from marl_jax.train.metrics import read_metrics

from train_util import ROOT, tiny_config  # noqa: F401  (ROOT puts configs on sys.path)
from configs import async_synthetic  # noqa: E402


def _study_config(**variants):
    cfg = tiny_config(**{"ppo.steps": 2, "ppo.eval_every": 1, "seeds": (3, 4),
                         "ppo.group_size": 2, "ppo.batch_size": 16})
    cfg.stage = "async_study"
    cfg.async_study = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo"), baseline="k0",
        variants=variants or dict(k0={}, k1_macro=dict(rollout=dict(max_staleness=1),
                                                       ppo=dict(rollout_correction="macro"))),
        only=dict(k1_macro=("ma_ppo",))))
    return cfg


def test_the_shipped_study_plans_every_arm_under_its_variants():
    runs = async_study.plan(async_synthetic.get_config())
    names = {(r.arm, r.variant) for r in runs}
    assert len(runs) == 13 * 4 and ("ppo", "k2_macro") not in names
    by_name = {(r.arm, r.variant, r.seed): r.config for r in runs}
    k2w = by_name[("ma_ppo", "k2_whole", 0)]
    assert (k2w.rollout.max_staleness, k2w.rollout.chunk_tokens) == (2, k2w.ppo.response_length)
    assert (k2w.ppo.termination, k2w.ppo.ngram, k2w.ppo.rollout_correction) == ("fixed", 5,
                                                                                "token")
    k0 = by_name[("ppo", "k0", 3)]
    assert (k0.stage, k0.seed, k0.rollout.max_staleness, k0.ppo.ngram) == ("ppo", 3, 0, 1)


@pytest.mark.parametrize("variants, message", [
    (dict(k0={}, k1=dict(rollout=dict(max_staleness=1, max_token_staleness=0))),
     "async_study variant 'k1' of arm 'ppo': config.rollout.max_token_staleness=0: must be an "
     "integer >= rollout.max_staleness=1"),
    (dict(k0={}, k1=dict(rollout=dict(max_stalenes=1))),
     "config.async_study.variants.k1.rollout.max_stalenes: no such field of the config"),
    (dict(sync={}), "config.async_study.baseline='k0': not among the variants ['sync']"),
])
def test_a_variant_that_cannot_run_is_named_before_anything_runs(variants, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        async_study.plan(_study_config(**variants))


def test_a_tiny_study_runs_every_variant_and_reports_them_against_k0(tmp_path):
    cfg = _study_config()
    report = async_study.run_async_study(cfg, str(tmp_path))
    names = ["ppo_k0", "ma_ppo_k0", "ma_ppo_k1_macro"]
    assert list(report["arms"]) == names
    assert os.path.getsize(tmp_path / "curves_time.png") > 0
    rows = read_metrics(str(tmp_path))
    plan = next(r for r in rows if r["stage"] == "plan")
    assert plan["controls"] == {"ma_ppo_k1_macro": "ma_ppo_k0"}
    # The report names the instruction set the runs' floats were rounded by.
    assert plan["instruction_set"]["isa"] == report_lib.instruction_set()["isa"]
    assert report_lib.isa_label(report) not in ("unrecorded", "")
    study = {(r["arm"], r["seed"], r["step"]): r for r in rows if r["stage"] == "eval"}
    assert len(study) == len(names) * 2 * 3
    for name in names:
        for seed in (3, 4):
            run_rows = read_metrics(str(tmp_path / "runs" / name / f"seed_{seed}"))
            step_s = {r["step"]: r["perf/step_s"] for r in run_rows if r["stage"] == "ppo"}
            assert sorted(step_s) == [1, 2]
            for r in (r for r in run_rows if r["stage"] == "eval"):
                mine = study[(name, seed, r["step"])]
                assert mine["gold"] == r["gold"] and mine["kl"] == r["kl"]
                assert mine["train_s"] == pytest.approx(sum(v for k, v in step_s.items()
                                                            if k <= r["step"]))
            # Only the asynchronous runs sample ahead: their rows carry the staleness.
            ppo_rows = [r for r in run_rows if r["stage"] == "ppo"]
            assert ("async/staleness_avg" in ppo_rows[0]) == ("k1" in name)
    # Every run of a seed starts from the one SFT policy: the same step-0 evaluation.
    for seed in (3, 4):
        assert len({study[(n, seed, 0)]["gold"] for n in names}) == 1
    # The report's paired difference of a variant is its per-seed final gold minus k0's.
    cmp = report["comparisons"]["ma_ppo_k1_macro"]["versus_control"]["final_gold"]
    d = [study[("ma_ppo_k1_macro", s, 2)]["gold"] - study[("ma_ppo_k0", s, 2)]["gold"]
         for s in (3, 4)]
    assert cmp["mean"] == pytest.approx(np.mean(d), abs=1e-9)
    with open(tmp_path / "report.json") as f:
        assert json.load(f)["arms"].keys() == report["arms"].keys()
    with open(tmp_path / "divergence.json") as f:
        assert json.load(f) == async_study.early_divergence(rows)
    # Run again: every run is finished, read and not run again; the same rows and report.
    assert async_study.run_async_study(cfg, str(tmp_path))["arms"] == report["arms"]


def test_early_divergence_counts_the_first_evaluation_only():
    """A seed counts when its first evaluation after step 0 is more than the drop below its
    step-0 gold; a later fall (reward hacking) and a fall of exactly the drop do not."""
    def row(arm, seed, step, gold, kl=1.0):
        return dict(stage="eval", arm=arm, seed=seed, step=step, gold=gold, kl=kl)

    rows = [dict(stage="plan", step=0),
            row("a", 1, 0, 0.5), row("a", 1, 20, 0.45), row("a", 1, 40, 0.2),
            row("a", 0, 20, 0.35, kl=80.0), row("a", 0, 0, 0.5), row("a", 0, 40, 0.5),
            row("b", 0, 0, 0.5), row("b", 0, 20, 0.375)]
    out = async_study.early_divergence(rows, drop=0.125)
    assert out == {
        "a": dict(seeds=[0], of=2, runs=[dict(seed=0, step=20, gold_step0=0.5, gold=0.35,
                                              kl=80.0)]),
        "b": dict(seeds=[], of=1, runs=[])}
    text = async_study.divergence_text(out, drop=0.125)
    assert "  a: 1/2: seed 0 (gold 0.35, KL 80)" in text and "  b: 0/1" in text
