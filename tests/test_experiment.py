"""The default experiment: arms and their matched controls, and a shortened run of the default
command whose report is recomputed here from metrics.jsonl."""
import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

from marl_jax import experiment
from marl_jax.train.metrics import read_metrics

from train_util import tiny_config


def test_unknown_arm_is_named():
    cfg = tiny_config()
    cfg.experiment.arms = ("ppo", "reinforce")
    with pytest.raises(ValueError, match="reinforce"):
        experiment.plan_runs(cfg)


@pytest.mark.parametrize("termination, ngram, aggregation, length", [
    ("fixed", 5, "weighted", 5.0),
    ("fixed", 5, "sum", 5.0),
    ("fixed", 3, "weighted", 3.0),
    ("fixed", 10, "sum", 10.0),
    ("randomized", 5, "weighted", None),
    ("perplexity", 5, "sum", None),
    ("step", 5, "weighted", None),
])
def test_matched_control_derivation(termination, ngram, aggregation, length):
    cfg = tiny_config(**{"ppo.termination": termination, "ppo.ngram": ngram,
                         "ppo.reward_aggregation": aggregation, "ppo.lam": 0.9,
                         "ppo.kl_coef": 0.2, "ppo.critic_init": "random"})
    cfg.experiment.arms = ("n3", "n3_ctrl") if ngram == 3 else ("agg_" + aggregation,
                                                                "agg_" + aggregation + "_ctrl")
    if ngram == 10:
        cfg.experiment.arms = ("n10", "n10_ctrl")
    arm, ctrl = cfg.experiment.arms
    runs = {(r.arm, r.seed): r for r in experiment.plan_runs(cfg)}
    base, control = runs[(arm, 0)].ppo, runs[(ctrl, 0)]
    assert control.control_of == arm
    assert base["mean_macro_length"] == length
    # Token PPO in every macro field, the arm's other settings (critic start, gamma) kept.
    assert (control.ppo["termination"], control.ppo["ngram"]) == ("fixed", 1)
    assert control.ppo["critic_init"] == "random" and control.ppo["gamma"] == base["gamma"]
    if length is None:  # measured on the arm's own step-0 rollouts
        assert control.ppo["mean_macro_length"] is None
        measured = experiment._with_measured_lengths(cfg, list(runs.values()), [
            2.5 if r.arm == arm else 1.0 for r in runs.values()])
        control = next(r for r in measured if r.arm == ctrl and r.seed == 0)
        length = 2.5
    assert control.ppo["lam"] == pytest.approx(0.9 ** (1 / length))
    want_kl = 0.2 / length if aggregation == "weighted" else 0.2
    assert control.ppo["kl_coef"] == pytest.approx(want_kl)


@pytest.mark.parametrize("termination", ["randomized", "perplexity", "fixed"])
def test_token_ppo_arms_ignore_the_base_macro_settings(termination):
    cfg = tiny_config(**{"ppo.termination": termination, "ppo.ngram": 7,
                         "ppo.value_weighting": "first", "ppo.reward_aggregation": "sum"})
    cfg.experiment.arms = ("ppo", "ppo_lam1", "ppo_cold_critic", "randomized")
    runs = {r.arm: r.ppo for r in experiment.plan_runs(cfg) if r.seed == 0}
    for arm in ("ppo", "ppo_lam1", "ppo_cold_critic"):
        assert (runs[arm]["termination"], runs[arm]["ngram"], runs[arm]["value_weighting"],
                runs[arm]["reward_aggregation"]) == ("fixed", 1, "equal", "weighted"), arm
    assert runs["randomized"]["termination"] == "randomized"


def test_controls_are_added_for_macro_arms_and_refused_for_token_arms():
    cfg = tiny_config()
    cfg.experiment.arms = ("ppo", "ma_ppo", "n3", "ppo_lam1")
    cfg.experiment.add_controls = True
    assert experiment.experiment_arms(cfg) == ("ppo", "ma_ppo", "ma_ppo_ctrl", "n3", "n3_ctrl",
                                               "ppo_lam1")
    cfg.experiment.add_controls = False
    cfg.experiment.arms = ("ppo", "ppo_ctrl")
    with pytest.raises(ValueError, match="'ppo_ctrl' is the control of 'ppo'"):
        experiment.plan_runs(cfg)


def test_a_critic_free_estimator_leaves_out_the_controls_of_macro_arms(capsys, monkeypatch):
    """Under dapo (group baselines, no GAE) a macro arm has no lam or per-token KL to match: its
    listed control is left out with one line; a control of token PPO is still refused."""
    monkeypatch.setattr(experiment, "_DROPPED_CONTROLS", set())  # the line is said once a run
    cfg = tiny_config()
    cfg.ppo.update(dict(estimator="dapo", group_size=2))
    cfg.experiment.arms = ("ppo", "ma_ppo", "ma_ppo_ctrl")
    assert experiment.experiment_arms(cfg) == ("ppo", "ma_ppo")
    assert "ma_ppo_ctrl left out: ma_ppo is not macro GAE with ppo.estimator='dapo'" in \
        capsys.readouterr().out
    assert [r.arm for r in experiment.plan_runs(cfg) if r.seed == cfg.seeds[0]] == ["ppo",
                                                                                   "ma_ppo"]
    cfg.experiment.arms = ("ppo", "ppo_ctrl")
    with pytest.raises(ValueError, match="'ppo_ctrl' is the control of 'ppo'"):
        experiment.plan_runs(cfg)


def test_explicit_controls_reach_the_plan_row_and_bad_pairs_are_named():
    import ml_collections
    cfg = tiny_config()
    cfg.experiment.arms = ("ppo", "macro_mc_n5_all", "macro_mc_n1")
    cfg.experiment.controls = ml_collections.ConfigDict(dict(macro_mc_n5_all="macro_mc_n1"))
    runs = experiment.plan_runs(cfg)
    by_arm = {r.arm: r.ppo for r in runs if r.seed == 0}
    # Every 5-gram start of a response fits in the arm's ceil(R / 5) branch slots.
    r = cfg.ppo.response_length
    assert by_arm["macro_mc_n5_all"]["mc_branch_points"] == (r + 4) // 5
    assert by_arm["macro_mc_n5_all"]["ngram"] == 5 and by_arm["macro_mc_n1"]["ngram"] == 1
    assert experiment.plan_row(cfg, runs, 4)["controls"] == {"macro_mc_n5_all": "macro_mc_n1"}
    # A pair whose arms are not both run is not reported; an unknown name is an error.
    cfg.experiment.controls = ml_collections.ConfigDict(dict(macro_mc_n5_all="rloo"))
    assert experiment.plan_row(cfg, experiment.plan_runs(cfg), 4)["controls"] == {}
    for pair, message in ((dict(macro_mc_n5_all="rlo"), "unknown control 'rlo'"),
                          (dict(gpro="ppo"), "unknown arm 'gpro'"),
                          (dict(ppo="ppo"), "its own control")):
        cfg.experiment.controls = ml_collections.ConfigDict(pair)
        with pytest.raises(ValueError, match=message):
            experiment.plan_runs(cfg)
    # Overrides of arms that are not run are ignored (a subset of a config's arms can be run
    # from the command line), of unknown arms refused.
    cfg.experiment.controls = ml_collections.ConfigDict()
    cfg.ppo.arm_overrides = ml_collections.ConfigDict(dict(grpo=dict(group_size=4),
                                                           macro_mc_n1=dict(batch_size=2)))
    assert {r.arm: r.ppo["batch_size"] for r in experiment.plan_runs(cfg)}["macro_mc_n1"] == 2
    cfg.ppo.arm_overrides = ml_collections.ConfigDict(dict(grpoo=dict(group_size=4)))
    with pytest.raises(ValueError, match="arm_overrides: unknown arm 'grpoo'"):
        experiment.plan_runs(cfg)
    cfg.ppo.arm_overrides = ml_collections.ConfigDict()
    cfg.experiment.arms = ("ppo", "ma_ppo", "ma_ppo_ctrl")
    cfg.experiment.controls = ml_collections.ConfigDict(dict(ma_ppo="ppo"))
    with pytest.raises(ValueError, match="already has the control 'ma_ppo_ctrl'"):
        experiment.plan_runs(cfg)


def _paired_t(rows, arm, versus, beta, metric):
    """An independent recomputation of a paired difference of final gold or J from eval rows:
    mean and t interval over seeds."""
    from scipy import stats

    evals = [r for r in rows if r["stage"] == "eval"]
    last = max(r["step"] for r in evals)

    def value(a, seed):
        r = next(r for r in evals if r["arm"] == a and r["seed"] == seed and r["step"] == last)
        return r["gold"] - beta * r["kl"] if metric == "J" else r["gold"]

    seeds = sorted({r["seed"] for r in evals})
    d = np.array([value(arm, s) - value(versus, s) for s in seeds])
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return d.mean(), [d.mean() - half, d.mean() + half]


def test_runs_per_program_cuts_each_group_in_arm_order():
    config = tiny_config(**{"experiment.arms": ("ppo", "ma_ppo", "grpo"), "seeds": (0, 1, 2),
                            "ppo.arm_overrides": {"grpo": {"group_size": 2}}})
    runs = experiment.plan_runs(config)
    names = lambda groups: [[(r.arm, r.seed) for r in g] for g in groups]
    whole = experiment.run_groups(runs)
    assert names(whole) == [[(a, s) for a in ("ppo", "ma_ppo") for s in (0, 1, 2)],
                            [("grpo", s) for s in (0, 1, 2)]]
    assert names(experiment.run_groups(runs, 4)) == [
        [("ppo", 0), ("ppo", 1), ("ppo", 2), ("ma_ppo", 0)],
        [("ma_ppo", 1), ("ma_ppo", 2)], [("grpo", 0), ("grpo", 1), ("grpo", 2)]]
    assert names(experiment.run_groups(runs, 1)) == [[(r.arm, r.seed)] for r in runs]
    with pytest.raises(ValueError, match="runs_per_program=-1"):
        experiment.run_groups(runs, -1)


def test_shortened_default_experiment(tmp_path):
    cfg = tiny_config()
    cfg.stage = "experiment"
    cfg.ppo.steps = 4
    cfg.ppo.eval_every = 2
    cfg.seeds = (3, 5, 8)
    # The default arms, plus a termination whose control needs its measured macro length.
    cfg.experiment.arms = tuple(cfg.experiment.arms) + ("randomized", "randomized_ctrl")
    workdir = str(tmp_path)
    experiment.run_experiment(cfg, workdir)
    for name in ("report.md", "report.json", "curves.png", "rm_hist.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0
    with open(os.path.join(workdir, "report.json")) as f:
        on_disk = json.load(f)
    arms = ["ppo", "ma_ppo", "ma_ppo_ctrl", "ma_ppo_smdp", "ma_ppo_smdp_ctrl", "ppo_lam1",
            "randomized", "randomized_ctrl"]
    assert list(on_disk["arms"]) == arms
    assert on_disk["beta"] == cfg.ppo.kl_coef

    rows = read_metrics(workdir)
    plan = next(r for r in rows if r["stage"] == "plan")
    assert plan["controls"] == {"ma_ppo": "ma_ppo_ctrl", "ma_ppo_smdp": "ma_ppo_smdp_ctrl",
                                "randomized": "randomized_ctrl"}
    # One training row per arm, seed and step; evaluation rows at 0, 2, 4.
    train = [r for r in rows if r["stage"] == "ppo"]
    assert {(r["arm"], r["seed"], r["step"]) for r in train} == {
        (a, s, t) for a in arms for s in cfg.seeds for t in (1, 2, 3, 4)}
    assert len(train) == len(arms) * 3 * 4
    assert {r["step"] for r in rows if r["stage"] == "eval"} == {0, 2, 4}
    # A training row's perf and phase timing fields are its group's vmapped step's, the same on
    # every run's row of the group: its tokens are all its runs' prompts and responses
    # (group_size 1); its phases, waited on one after the other, sit inside the step.
    phases = [f"timing/{p}_s" for p in ("rollout", "score", "advantages", "update")]
    for step in (1, 2, 3, 4):
        groups = {}
        for r in train:
            if r["step"] == step:
                groups.setdefault(r["perf/step_s"], []).append(r)
        assert 1 <= len(groups) < len(arms) * 3
        for group in groups.values():
            tokens = sum(r["budget/prefill_tokens"] + r["budget/generated_tokens"] for r in group)
            assert group[0]["perf/tokens_per_s"] * group[0]["perf/step_s"] == pytest.approx(tokens)
            assert len({(r["perf/tokens_per_s"], r["perf/tflops_per_s"]) for r in group}) == 1
            assert len({tuple(r[k] for k in phases) for r in group}) == 1
            assert 0 < min(group[0][k] for k in phases)
            assert sum(group[0][k] for k in phases) <= group[0]["perf/step_s"]
    # The randomized arm's control uses the macro length of the arm's own first rollout (the
    # one its step-1 row reports), per seed: lam^(1/L) and kl_coef / L (weighted rewards).
    for seed in cfg.seeds:
        first = next(r for r in train if (r["arm"], r["seed"], r["step"]) == ("randomized",
                                                                             seed, 1))
        ctrl = next(r for r in plan["per_run"] if (r["arm"], r["seed"]) == ("randomized_ctrl",
                                                                           seed))
        length = first["macro/len_avg"]
        assert length > 1.5
        assert ctrl["mean_macro_length"] == pytest.approx(length, rel=1e-6)
        assert ctrl["lam"] == pytest.approx(cfg.ppo.lam ** (1 / length), rel=1e-6)
        assert ctrl["kl_coef"] == pytest.approx(cfg.ppo.kl_coef / length, rel=1e-6)
        ctrl_first = next(r for r in train if (r["arm"], r["seed"], r["step"]) == (
            "randomized_ctrl", seed, 1))
        assert ctrl_first["objective/kl_coef"] == pytest.approx(cfg.ppo.kl_coef / length,
                                                                rel=1e-6)

    # Every macro arm is compared with ppo and with its control, and the report's intervals are
    # what the eval rows give.
    for arm, control in plan["controls"].items():
        cmp = on_disk["comparisons"][arm]
        assert cmp["macro"] and cmp["control"] == control
        for key, versus in (("versus_ppo", "ppo"), ("versus_control", control)):
            for metric in ("final_gold", "J"):
                mean, ci_t = _paired_t(rows, arm, versus, cfg.ppo.kl_coef,
                                       "J" if metric == "J" else "gold")
                assert cmp[key][metric]["mean"] == pytest.approx(mean, abs=1e-9)
                np.testing.assert_allclose(cmp[key][metric]["ci_t"], ci_t, atol=1e-9)
    text = open(os.path.join(workdir, "report.md")).read()
    assert "## Verdict" in text and "ma_ppo_smdp" in text.split("## Verdict")[1]
    # Every arm of a seed starts from the same SFT policy: identical step-0 evaluations.
    step0 = [r for r in rows if r["stage"] == "eval" and r["step"] == 0 and r["seed"] == 3]
    assert len({round(r["gold"], 9) for r in step0}) == 1


class _CompiledOnce:
    """A jitted program compiled at its first call, where the caller calls it (under the
    caller's mesh and logical rules), its optimized HLO kept in `texts`."""

    def __init__(self, fn, texts):
        self.fn, self.texts, self.compiled = fn, texts, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = self.fn.lower(*args).compile()
            self.texts.append(self.compiled.as_text())
        return self.compiled(*args)


def test_programs_of_one_run_share_the_sft_evaluation_and_write_one_sft_row(tmp_path,
                                                                            monkeypatch):
    cfg = tiny_config(**{"stage": "experiment", "experiment.arms": ("ppo", "ma_ppo"),
                         "seeds": (3, 4), "ppo.steps": 1, "ppo.eval_every": 1,
                         "experiment.runs_per_program": 1})
    texts, phase_programs = [], experiment.programs.experiment_phase_programs

    def recording(*args, **kwargs):
        out = phase_programs(*args, **kwargs)
        out["update"] = dataclasses.replace(out["update"],
                                            fn=_CompiledOnce(out["update"].fn, texts))
        return out

    monkeypatch.setattr(experiment.programs, "experiment_phase_programs", recording)
    workdir = str(tmp_path)
    report = experiment.run_experiment(cfg, workdir)
    rows = read_metrics(workdir)
    # A program of one run is data-parallel over the 8 devices: each device's update computes
    # the token scores `[runs, rows, R, V]` (and every other per-token activation) of its
    # B / 8 rows, never of the whole batch.
    per_device = cfg.ppo.batch_size // len(jax.devices())
    assert len(texts) == 4 and per_device == 1
    for text in texts:
        rows_seen = {int(m) for m in re.findall(
            rf"f32\[1,(\d+),{cfg.ppo.response_length},\d+\]", text)}
        assert rows_seen == {per_device}, rows_seen
    sft = {r["seed"]: r for r in rows if r["stage"] == "final" and r["arm"] == "sft"}
    assert sorted(sft) == [3, 4] and len([r for r in rows if r.get("arm") == "sft"]) == 2
    for seed in (3, 4):
        step0 = [r for r in rows if r["stage"] == "eval" and r["step"] == 0 and r["seed"] == seed]
        assert sorted(r["arm"] for r in step0) == ["ma_ppo", "ppo"]
        for r in step0:  # every program's step 0 is the SFT policy's evaluation of the seed
            assert r["gold"] == pytest.approx(np.mean(sft[seed]["gold_per_prompt"]), abs=1e-6)
            assert r["rm_score"] == pytest.approx(np.mean(sft[seed]["rm_score_per_prompt"]),
                                                  abs=1e-6)
    finals = {(r["arm"], r["seed"]): r for r in rows if r["stage"] == "final"}
    d = np.concatenate([np.subtract(finals[("ppo", s)]["gold_per_prompt"],
                                    sft[s]["gold_per_prompt"]) for s in (3, 4)])
    assert report["versus_sft"]["ppo"]["mean"] == pytest.approx(d.mean())
    assert report["versus_sft"]["ppo"]["n"] == 2 * cfg.task.num_eval_prompts




def test_zero_steps_reports_the_starting_policy(tmp_path):
    """`ppo.steps=0` evaluates the SFT policy and stops: step0.json holds its held-out gold per
    seed and pooled over (seed, prompt) pairs with a t interval, in place of the training
    report (which needs a later evaluation step)."""
    from scipy import stats

    cfg = tiny_config(**{"stage": "experiment", "experiment.arms": ("ppo",), "seeds": (3, 4),
                         "ppo.steps": 0, "ppo.eval_every": 1})
    summary = experiment.run_experiment(cfg, str(tmp_path))
    assert not os.path.exists(tmp_path / "report.json")
    with open(tmp_path / "step0.json") as f:
        assert json.load(f) == json.loads(json.dumps(summary))
    rows = read_metrics(str(tmp_path))
    evals = {r["seed"]: r for r in rows if r["stage"] == "eval"}
    assert sorted(evals) == [3, 4] and {r["step"] for r in evals.values()} == {0}
    pooled = []
    for seed in (3, 4):
        sft = next(r for r in rows if r["stage"] == "final" and r["arm"] == "sft"
                   and r["seed"] == seed)
        assert summary["seeds"][str(seed)]["gold"] == pytest.approx(evals[seed]["gold"],
                                                                     abs=1e-6)
        assert summary["seeds"][str(seed)]["n"] == cfg.task.num_eval_prompts
        pooled += sft["gold_per_prompt"]
    g = summary["gold"]
    half = stats.t.ppf(0.975, len(pooled) - 1) * np.std(pooled, ddof=1) / np.sqrt(len(pooled))
    assert g["n"] == 2 * cfg.task.num_eval_prompts
    np.testing.assert_allclose(g["ci_t"], [np.mean(pooled) - half, np.mean(pooled) + half],
                               atol=1e-9)
