"""The study report: intervals over seeds, paired differences, mean gold over training, steps to
50% / 90% of PPO's gain, reward-hacking flags and claims, checked against numbers worked out by
hand or by independent loops; the report recomputed from metrics.jsonl alone; and the results
page and the README's headline written from several runs."""
import importlib.util
import json
import math
import os
import pathlib
import shlex

import numpy as np
import pytest

from marl_jax.eval import report as report_lib
from marl_jax.eval import study_stats as st

ROOT = pathlib.Path(__file__).resolve().parent.parent
T_975_7 = 2.364624251592784  # Student's t, 0.975 quantile, 7 degrees of freedom (tables)
# Paired final-gold offsets of ma_ppo (E) and of its control (F) from ppo, per seed: mean 0.
E = [0.02, -0.02, 0.01, -0.01, 0.03, -0.03, 0.005, -0.005]
F = E[::-1]
STEPS = (0, 10, 20, 30)


def _eval(arm, seed, step, gold, kl, rm=0.0):
    return dict(stage="eval", arm=arm, seed=seed, step=step, gold=gold, kl=kl, rm_score=rm)


def _hand_rows():
    rows = []
    for seed in (0, 1):
        for step, g in zip(STEPS, (0.5, 0.6, 0.7, 0.8)):
            rows.append(_eval("ppo", seed, step, g, 2.0 if step == 30 else 1.0))
        for step, g in zip(STEPS, (0.5, 0.7, 0.8, 0.8)):
            rows.append(_eval("ma_ppo", seed, step, g, 4.0 if step == 30 else 1.0))
    rows += [
        dict(stage="final", arm="ppo", seed=0, step=30, gold_per_prompt=[0.1, 0.5, 0.9],
             rm_score_per_prompt=[0, 0, 0]),
        dict(stage="final", arm="ma_ppo", seed=0, step=30, gold_per_prompt=[0.2, 0.5, 0.3],
             rm_score_per_prompt=[0, 0, 0]),
        dict(stage="final", arm="ppo", seed=1, step=30, gold_per_prompt=[0.0, 0.0],
             rm_score_per_prompt=[0, 0]),
        dict(stage="final", arm="ma_ppo", seed=1, step=30, gold_per_prompt=[1.0, 1.0],
             rm_score_per_prompt=[0, 0]),
    ]
    return rows


def _study_rows(seeds=tuple(range(8)), ma_mid=(0.15, 0.25), plan=True):
    """8 seeds of ppo, ma_ppo, its control ma_ppo_ctrl and ppo_lam1 at steps 0, 10, 20, 30.

    Gold = SFT (0.5 + 0.01 i for the i-th seed) + an offset: ppo 0, .1, .2, .3; ma_ppo
    0, ma_mid, .3 + E_i with KL 4 at the end (ppo: 2); the control 0, .1, .2, .3 + F_i;
    ppo_lam1 like ppo except its first four seeds, 0, .2, .1, -.05 while its RM score climbs
    (reward hacking).
    """
    rows = []
    if plan:
        rows.append(dict(stage="plan", step=0, arms=["ppo", "ma_ppo", "ma_ppo_ctrl", "ppo_lam1"],
                         seeds=list(seeds), baseline="ppo", beta=0.05,
                         controls={"ma_ppo": "ma_ppo_ctrl"}, macro_arms=["ma_ppo"],
                         runs={"ppo": {"lam": 0.95, "ngram": 1}}, eval_every=10, steps=30,
                         num_eval_prompts=4))
    for i, seed in enumerate(seeds):
        sft = 0.5 + 0.01 * i
        curves = {
            "ppo": ((0, 0.1, 0.2, 0.3), (0, 1, 2, 2), (0, 0.3, 0.6, 0.9)),
            "ma_ppo": ((0, *ma_mid, 0.3 + E[i]), (0, 2, 4, 4), (0, 0.3, 0.6, 0.9)),
            "ma_ppo_ctrl": ((0, 0.1, 0.2, 0.3 + F[i]), (0, 1, 2, 2), (0, 0.3, 0.6, 0.9)),
            "ppo_lam1": ((0, 0.2, 0.1, -0.05) if i < 4 else (0, 0.1, 0.2, 0.3), (0, 1, 2, 2),
                         (0, 0.5, 1.0, 1.5)),
        }
        for arm, (gold, kl, rm) in curves.items():
            for k, step in enumerate(STEPS):
                rows.append(_eval(arm, seed, step, sft + gold[k], kl[k], rm[k]))
            rows.append(dict(stage="final", arm=arm, seed=seed, step=30,
                             gold_per_prompt=[sft + gold[-1]] * 4, rm_score_per_prompt=[rm[-1]] * 4,
                             kl_per_prompt=[kl[-1]] * 4))
    return rows


def _write_metrics(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _percentile_by_sorting(x, q):
    """numpy's default ("linear") percentile, written out: interpolate the sorted values at
    position q / 100 * (n - 1)."""
    x = np.sort(x)
    pos = q / 100 * (len(x) - 1)
    lo = int(math.floor(pos))
    return x[lo] + (pos - lo) * (x[min(lo + 1, len(x) - 1)] - x[lo])


def _bootstrap_by_hand(d, resamples=st.RESAMPLES, rng_seed=st.RNG_SEED):
    d = np.asarray(d, float)
    idx = np.random.default_rng(rng_seed).integers(0, len(d), size=(resamples, len(d)))
    means = np.array([d[row].sum() / len(d) for row in idx])
    return [_percentile_by_sorting(means, 2.5), _percentile_by_sorting(means, 97.5)]


# ---- statistics ----------------------------------------------------------------------------------
def test_interval_mean_t_and_bootstrap_by_hand():
    d = [0.1, 0.2, 0.3, 0.4, 0.1, 0.2, 0.3, 0.4]
    out = st.interval(d)
    # Deviations from 0.25: +-0.15 and +-0.05, each four times: s^2 = 0.1 / 7.
    s = math.sqrt(0.1 / 7)
    assert out["n"] == 8 and out["mean"] == pytest.approx(0.25)
    assert out["std"] == pytest.approx(s)
    half = T_975_7 * s / math.sqrt(8)
    assert out["ci_t"] == pytest.approx([0.25 - half, 0.25 + half])
    assert out["ci"] == pytest.approx(_bootstrap_by_hand(d), abs=1e-12)
    # The bootstrap interval of a mean lies inside the values' range and, for 8 seeds, near the
    # t interval.
    assert 0.1 < out["ci"][0] < 0.25 < out["ci"][1] < 0.4
    assert out["ci"] == pytest.approx(out["ci_t"], abs=0.03)
    assert st.direction(out["ci"]) == 1
    assert st.direction(st.interval([-x for x in d])["ci"]) == -1


def test_interval_covering_zero_and_one_seed():
    d = [0.1, -0.1, 0.2, -0.2, 0.05, -0.05, 0.3, -0.3]
    out = st.interval(d)
    assert out["mean"] == pytest.approx(0.0, abs=1e-15)
    assert out["ci"][0] < 0 < out["ci"][1] and st.direction(out["ci"]) == 0
    assert out["ci"] == pytest.approx(_bootstrap_by_hand(d), abs=1e-12)
    one = st.interval([0.4])
    assert one["mean"] == 0.4 and one["ci"] is None and one["ci_t"] is None
    assert st.direction(one["ci"]) == 0
    # An interval touching 0 does not exclude it.
    assert st.direction([0.0, 0.3]) == 0 and st.direction([-0.3, 0.0]) == 0
    with pytest.raises(ValueError, match="per-seed values contains NaN"):
        st.interval([0.1, float("nan")])


def test_mean_gold_over_training_by_hand():
    assert st.trapezoid_mean((0, 10, 20, 30), (0.5, 0.6, 0.8, 0.8)) == pytest.approx(
        (0.55 * 10 + 0.7 * 10 + 0.8 * 10) / 30)
    # Uneven steps weigh each segment by its length.
    assert st.trapezoid_mean((0, 10, 30), (0.5, 0.7, 0.9)) == pytest.approx(
        (0.6 * 10 + 0.8 * 20) / 30)
    np.testing.assert_allclose(st.trapezoid_mean((0, 10), [[0.0, 1.0], [1.0, 1.0]]), [0.5, 1.0])
    with pytest.raises(ValueError, match="increasing"):
        st.trapezoid_mean((0, 10, 10), (0.5, 0.6, 0.7))


def _good_and_bad_seeds():
    """Baseline: every seed 0.5, 0.6, 0.7, 0.8 (gain 0.3). Arm: six seeds 0.5, 0.7, 0.9, 0.9,
    two stuck at 0.5."""
    base = np.tile([0.5, 0.6, 0.7, 0.8], (8, 1))
    arm = np.array([[0.5, 0.7, 0.9, 0.9]] * 6 + [[0.5, 0.5, 0.5, 0.5]] * 2)
    return base, arm


def test_steps_to_50_and_90_by_hand():
    base, arm = _good_and_bad_seeds()
    # Identical baseline seeds: every resample is the same curve, the interval is the point.
    assert st.steps_to_fraction(STEPS, base, base, 0.5) == {"step": 20, "ci": [20, 20]}
    assert st.steps_to_fraction(STEPS, base, base, 0.9) == {"step": 30, "ci": [30, 30]}
    # With k good seeds in a resample the arm's curve is 0.5 + 0.025 k at step 10 and
    # 0.5 + 0.05 k at steps 20, 30. 50% (0.65): step 10 needs k >= 6, step 20 k >= 3; the full
    # sample has k = 6. P(k <= 5) = 0.32 for k ~ Binomial(8, 3/4), P(k <= 2) = 0.0004.
    assert st.steps_to_fraction(STEPS, arm, base, 0.5) == {"step": 10, "ci": [10, 20]}
    # 90% (0.77): never at step 10, at step 20 when k >= 6; a third of the resamples never get
    # there, so the upper end is beyond the last step.
    ninety = st.steps_to_fraction(STEPS, arm, base, 0.9)
    assert ninety == {"step": 20, "ci": [20, None]}
    assert report_lib.format_steps(ninety, 30) == "20 [20, >30]"
    # Never reached on the full sample either.
    flat = np.tile([0.5, 0.55, 0.6, 0.62], (8, 1))
    never = st.steps_to_fraction(STEPS, flat, base, 0.5)
    assert never == {"step": None, "ci": [None, None]}
    assert report_lib.format_steps(never, 30) == ">30 [>30, >30]"
    # A baseline that gained nothing leaves nothing to reach.
    assert st.steps_to_fraction(STEPS, arm, flat[:, ::-1], 0.5) is None
    assert report_lib.format_steps(None, 30) == "n/a"


def test_steps_to_interval_matches_a_reference_loop():
    rng = np.random.default_rng(3)
    base = 0.5 + np.cumsum(rng.uniform(0, 0.1, size=(8, 6)), axis=1) - 0.05
    arm = 0.5 + np.cumsum(rng.uniform(0, 0.12, size=(8, 6)), axis=1) - 0.06
    base[:, 0] = arm[:, 0] = 0.5
    steps = np.arange(6) * 5
    smoothing, resamples = 2, 400

    def smooth(curve):
        return [np.mean(curve[max(0, k - smoothing + 1):k + 1]) for k in range(len(curve))]

    def crossing(arm_rows, base_rows):
        b, a = smooth(base_rows.mean(axis=0)), smooth(arm_rows.mean(axis=0))
        gain = b[-1] - b[0]
        if gain <= 0:
            return math.inf
        return next((t for t, v in zip(steps, a) if v >= b[0] + 0.9 * gain - 1e-12), math.inf)

    idx = np.random.default_rng(0).integers(0, 8, size=(resamples, 8))
    draws = sorted(crossing(arm[row], base[row]) for row in idx)
    # The inverted-CDF quantile q is the ceil(q * n)-th smallest value.
    lo, hi = draws[math.ceil(0.025 * resamples) - 1], draws[math.ceil(0.975 * resamples) - 1]
    got = st.steps_to_fraction(steps, arm, base, 0.9, smoothing=smoothing, resamples=resamples,
                               rng_seed=0)
    assert got["step"] == crossing(arm, base)
    assert got["ci"] == [None if math.isinf(x) else x for x in (lo, hi)]
    assert lo < hi  # the case separates the two ends


def test_reward_hacking_rules_on_hand_made_curves():
    # RM score up and gold below SFT, and gold 0.15 off its peak while RM ends at its maximum.
    assert st.hacking_rules([0.6, 0.7, 0.55], [0.1, 0.5, 0.9]) == [
        "rm_up_gold_down", "gold_off_peak_rm_at_max"]
    # Still above SFT, but 0.15 below the peak while RM keeps rising.
    assert st.hacking_rules([0.5, 0.8, 0.65], [0.0, 0.5, 0.7]) == ["gold_off_peak_rm_at_max"]
    # 0.05 below the peak is within the allowed drop.
    assert st.hacking_rules([0.5, 0.8, 0.75], [0.0, 0.5, 0.7]) == []
    # Gold falls but so does the RM score: not hacking the RM.
    assert st.hacking_rules([0.6, 0.7, 0.5], [0.5, 0.9, 0.4]) == []
    # A drop of 0.05 below SFT is within a noise of 0.06 (0.15 off the peak is still beyond
    # max(0.1, 0.06)); beyond a noise of 0.04 it counts; off the peak by 0.15, a noise of 0.2
    # replaces the fixed 0.1.
    assert st.hacking_rules([0.6, 0.7, 0.55], [0.1, 0.5, 0.9], noise=0.06) == [
        "gold_off_peak_rm_at_max"]
    assert st.hacking_rules([0.6, 0.6, 0.55], [0.1, 0.5, 0.9], noise=0.04) == [
        "rm_up_gold_down"]
    assert st.hacking_rules([0.5, 0.8, 0.65], [0.0, 0.5, 0.7], noise=0.2) == []


def test_drop_noise_is_the_t_half_width_of_per_prompt_changes():
    final, start = [0.5, 0.7, 0.4, 0.9], [0.4, 0.4, 0.5, 0.6]
    d = [0.1, 0.3, -0.1, 0.3]  # mean 0.15; squared deviations 0.0025, 0.0225, 0.0625, 0.0225
    t_975_3 = 3.182446305284263  # Student's t, 0.975 quantile, 3 degrees of freedom (tables)
    s = math.sqrt(0.11 / 3)
    assert sum(d) / 4 == pytest.approx(0.15)
    assert st.drop_noise(final, start) == pytest.approx(t_975_3 * s / 2)
    assert st.drop_noise([0.5], [0.4]) is None and st.drop_noise([0.5, 0.1], [0.4]) is None


# ---- the report ----------------------------------------------------------------------------------
def test_report_numbers_by_hand():
    r = report_lib.compute_report(_hand_rows(), beta=0.05, smoothing=1, baseline="ppo",
                                  arms=("ppo", "ma_ppo"))
    ppo, ma = r["arms"]["ppo"], r["arms"]["ma_ppo"]
    assert r["sft_gold"] == pytest.approx(0.5) and r["ppo_gain"]["mean"] == pytest.approx(0.3)
    assert (ppo["steps_to_50"]["step"], ppo["steps_to_90"]["step"]) == (20, 30)
    assert (ma["steps_to_50"]["step"], ma["steps_to_90"]["step"]) == (10, 20)
    assert ppo["J"]["mean"] == pytest.approx(0.8 - 0.05 * 2.0)
    assert ma["J"]["mean"] == pytest.approx(0.8 - 0.05 * 4.0)
    assert ma["auc_gold"]["mean"] == pytest.approx((0.6 * 10 + 0.75 * 10 + 0.8 * 10) / 30)
    # win, tie, loss on seed 0; two wins on seed 1.
    assert ma["win_rate_vs_baseline"] == pytest.approx((1 + 0.5 + 0 + 1 + 1) / 5)
    assert ppo["win_rate_vs_baseline"] == pytest.approx(0.5)
    # Same final gold on both seeds: indistinguishable; J lower by 0.1 on both seeds: lower.
    assert r["verdict"][0] == ("ma_ppo vs ppo, final gold: +0.000, 95% CI [+0.000, +0.000]: "
                               "not distinguishable")
    assert r["verdict"][1] == "ma_ppo vs ppo, J: -0.100, 95% CI [-0.100, -0.100]: lower"
    # No plan row and no controls given: ma_ppo is compared with ppo only.
    assert r["comparisons"]["ma_ppo"]["versus_control"] is None
    assert r["plan"]["source"] == "report arguments"


def test_report_smoothing_moves_the_step_counts():
    r = report_lib.compute_report(_hand_rows(), beta=0.05, smoothing=2, baseline="ppo",
                                  arms=("ppo", "ma_ppo"))
    # Smoothed ppo: 0.5, 0.55, 0.65, 0.75 (gain 0.25, 50% at 0.625, 90% at 0.725);
    # ma_ppo: 0.5, 0.6, 0.75, 0.8.
    ppo, ma = r["arms"]["ppo"], r["arms"]["ma_ppo"]
    assert (ppo["steps_to_50"]["step"], ppo["steps_to_90"]["step"]) == (20, 30)
    assert (ma["steps_to_50"]["step"], ma["steps_to_90"]["step"]) == (20, 20)
    # Final gold itself is never smoothed.
    assert ppo["final_gold"]["mean"] == pytest.approx(0.8)


def _expected_claims():
    """ma_ppo: the same final gold as ppo (E has mean 0), J lower by 0.05 x (4 - 2) KL, mean gold
    over training higher ((1 + 5 E_i) / 30), KL higher by 2, the same RM score; the same
    against its control; the control: the same as ppo on all five; ppo_lam1: four seeds far
    lower, four equal, the same KL, RM score higher by 0.6."""
    return [
        {"arm": "ma_ppo", "versus": "ppo", "metric": "J", "direction": -1},
        {"arm": "ma_ppo", "versus": "ppo", "metric": "auc_gold", "direction": 1},
        {"arm": "ma_ppo", "versus": "ppo", "metric": "kl", "direction": 1},
        {"arm": "ma_ppo", "versus": "ma_ppo_ctrl", "metric": "J", "direction": -1},
        {"arm": "ma_ppo", "versus": "ma_ppo_ctrl", "metric": "auc_gold", "direction": 1},
        {"arm": "ma_ppo", "versus": "ma_ppo_ctrl", "metric": "kl", "direction": 1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "final_gold", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "J", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "auc_gold", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "rm_score", "direction": 1},
    ]


def test_claims_are_exactly_the_comparisons_excluding_zero():
    rows = _study_rows()
    report = report_lib.compute_report(rows)
    assert report_lib.claims(report) == _expected_claims() == report["claims"]
    assert report_lib.claims(report, metrics=("J",)) == [
        c for c in _expected_claims() if c["metric"] == "J"]
    # Independently: every comparison's per-seed differences from the rows, its bootstrap
    # interval by hand, and whether it excludes 0.
    gold = {(r["arm"], r["seed"], r["step"]): (r["gold"], r["kl"]) for r in rows
            if r["stage"] == "eval"}
    rm = {(r["arm"], r["seed"]): r["rm_score"] for r in rows
          if r["stage"] == "eval" and r["step"] == 30}

    def metric(arm, seed, name):
        g = [gold[arm, seed, t][0] for t in STEPS]
        return {"final_gold": g[-1], "J": g[-1] - 0.05 * gold[arm, seed, 30][1],
                "auc_gold": sum((g[k] + g[k + 1]) / 2 * 10 for k in range(3)) / 30,
                "kl": gold[arm, seed, 30][1], "rm_score": rm[arm, seed]}[name]

    found = []
    for arm, versus in (("ma_ppo", "ppo"), ("ma_ppo", "ma_ppo_ctrl"), ("ma_ppo_ctrl", "ppo"),
                        ("ppo_lam1", "ppo")):
        for name in ("final_gold", "J", "auc_gold", "kl", "rm_score"):
            d = [metric(arm, s, name) - metric(versus, s, name) for s in range(8)]
            lo, hi = _bootstrap_by_hand(d)
            if lo > 0 or hi < 0:
                found.append({"arm": arm, "versus": versus, "metric": name,
                              "direction": 1 if lo > 0 else -1})
    assert found == _expected_claims()


def test_report_recomputed_from_metrics_jsonl_alone(tmp_path):
    rows = _study_rows()
    _write_metrics(tmp_path, rows)
    # The plan row decides beta (0.05), not a disagreeing argument.
    returned = report_lib.write_report(str(tmp_path), beta=0.5)
    for name in ("report.json", "report.md", "curves.png", "rm_hist.png"):
        assert os.path.getsize(tmp_path / name) > 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["claims"] == returned["claims"] == _expected_claims()
    assert report["beta"] == 0.05 and report["baseline"] == "ppo"
    assert report["seeds"] == list(range(8)) and report["steps"] == list(STEPS)
    assert report["bootstrap"] == {"method": "percentile", "level": 0.95, "resamples": 10000,
                                   "rng_seed": 0}
    assert report["plan"]["controls"] == {"ma_ppo": "ma_ppo_ctrl"}
    assert "auc_gold" in report["definitions"] and "bootstrap" in report["definitions"]

    sft = np.array([0.5 + 0.01 * i for i in range(8)])
    ppo = report["arms"]["ppo"]
    assert report["sft_gold"] == pytest.approx(sft.mean())
    assert ppo["final_gold"]["mean"] == pytest.approx(sft.mean() + 0.3)
    assert ppo["J"]["mean"] == pytest.approx(sft.mean() + 0.3 - 0.05 * 2)
    assert ppo["rm_score"]["mean"] == pytest.approx(0.9)
    assert ppo["auc_gold"]["mean"] == pytest.approx(sft.mean() + (0.05 + 0.15 + 0.25) * 10 / 30)
    assert ppo["ppo"] == {"lam": 0.95, "ngram": 1}
    # ppo's curve: SFT + 0, .1, .2, .3 (50% of its 0.3 gain at 20, 90% at 30); ma_ppo's mean
    # reaches SFT + .15 at step 10; ppo_lam1's mean offsets 0, .15, .15, .125 never reach .27.
    assert ppo["steps_to_50"]["step"] == 20 and ppo["steps_to_90"]["step"] == 30
    assert report["arms"]["ma_ppo"]["steps_to_50"]["step"] == 10
    assert report["arms"]["ppo_lam1"]["steps_to_90"] == {"step": None, "ci": [None, None]}

    ma = report["comparisons"]["ma_ppo"]
    assert ma["macro"] and ma["control"] == "ma_ppo_ctrl"
    j = ma["versus_ppo"]["J"]
    assert j["seeds"] == list(range(8))
    np.testing.assert_allclose(j["differences"], np.array(E) - 0.05 * 2, atol=1e-12)
    s = math.sqrt(sum(e * e for e in E) / 7)  # E has mean 0
    half = T_975_7 * s / math.sqrt(8)
    assert j["mean"] == pytest.approx(-0.1)
    assert j["ci_t"] == pytest.approx([-0.1 - half, -0.1 + half])
    assert j["ci"] == pytest.approx(_bootstrap_by_hand(np.array(E) - 0.1), abs=1e-12)
    assert ma["versus_control"]["final_gold"]["differences"] == pytest.approx(
        np.array(E) - np.array(F))
    # Token arms other than ppo are compared with ppo only.
    assert report["comparisons"]["ppo_lam1"]["versus_control"] is None
    assert not report["comparisons"]["ppo_lam1"]["macro"]

    res = report["resolution"]
    assert res["ppo_gain"] == pytest.approx(0.3) and res["ppo_gain_ci"] == pytest.approx([0.3, 0.3])
    halves = {f"ma_ppo vs {v}": (c["final_gold"]["ci"][1] - c["final_gold"]["ci"][0]) / 2
              for v, c in (("ppo", ma["versus_ppo"]), ("ma_ppo_ctrl", ma["versus_control"]))}
    assert res["half_widths"] == pytest.approx(halves)
    assert res["gain_over_max_half_width"] == pytest.approx(0.3 / max(halves.values()))

    hack = report["arms"]["ppo_lam1"]["reward_hacking"]
    assert hack["seeds"] == [0, 1, 2, 3] and hack["count"] == 4
    assert hack["rules"]["0"] == ["rm_up_gold_down", "gold_off_peak_rm_at_max"]
    assert report["arms"]["ppo"]["reward_hacking"]["count"] == 0

    text = (tmp_path / "report.md").read_text()
    assert "hacks RM in 4/8 seeds" in text
    assert "- ma_ppo vs ppo, J: -0.100, 95% CI [" in text
    assert "| `ma_ppo` | `ma_ppo_ctrl` (control) |" in text
    lines = report_lib.summary_text(report).splitlines()
    assert lines[0].split() == ["arm", "gold", "J", "RM", "score", "to", "50%", "to", "90%"]
    assert any(line.startswith("ppo_lam1") and "hacks RM in 4/8 seeds" in line
               for line in lines)


def test_report_without_plan_row_uses_the_arguments():
    rows = _study_rows(plan=False)
    with pytest.raises(ValueError, match="beta"):
        report_lib.compute_report(rows)
    r = report_lib.compute_report(rows, beta=0.05, controls={"ma_ppo": "ma_ppo_ctrl"})
    assert list(r["arms"]) == ["ppo", "ma_ppo", "ma_ppo_ctrl", "ppo_lam1"]
    assert r["claims"] == _expected_claims()


def test_report_names_bad_input():
    rows = [r for r in _study_rows() if not (r["stage"] == "eval" and r["arm"] == "ma_ppo"
                                             and r["seed"] == 3 and r["step"] == 20)]
    with pytest.raises(ValueError, match="ma_ppo/seed 3"):
        report_lib.compute_report(rows)
    rows = _study_rows()
    next(r for r in rows if r["stage"] == "eval" and r["arm"] == "ppo_lam1")["kl"] = math.nan
    with pytest.raises(ValueError, match=r"'ppo_lam1': non-finite kl at .* \[\(0, 0\)\]"):
        report_lib.compute_report(rows)
    rows = _study_rows()
    rows[0]["controls"] = {"ma_ppo": "ppo_matched"}
    with pytest.raises(ValueError, match="control 'ppo_matched'"):
        report_lib.compute_report(rows)


def test_combined_report_links_each_experiment(tmp_path):
    reports = {}
    for name, seeds in (("horizon_2", range(8)), ("horizon_8", range(10, 18))):
        _write_metrics(tmp_path / name, _study_rows(seeds=tuple(seeds)))
        reports[name] = report_lib.write_report(str(tmp_path / name))
    report_lib.write_combined(str(tmp_path), reports)
    combined = json.loads((tmp_path / "report.json").read_text())
    assert combined["horizon_8"]["seeds"] == list(range(10, 18))
    assert combined["horizon_2"]["claims"] == _expected_claims()
    text = (tmp_path / "report.md").read_text()
    assert "](horizon_2/curves.png)" in text and "](horizon_8/rm_hist.png)" in text
    assert text.index("## horizon_2") < text.index("Seeds 0-7") < text.index("## horizon_8") \
        < text.index("Seeds 10-17")


def test_format_seeds():
    assert report_lib.format_seeds([3, 0, 1, 2]) == "0-3"
    assert report_lib.format_seeds([907, 911, 919]) == "907, 911, 919"


# ---- the results page and the README's headline ----------------------------------------------
def _readme_results():
    spec = importlib.util.spec_from_file_location(
        "readme_results", ROOT / "experiments" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGE = """# Results of the default experiment

Intro text.

<!-- results:start -->
old table and old claims
<!-- results:end -->

Tail text.
"""

README = """# Title

## The default experiment

<!-- headline:start -->
old headline
<!-- headline:end -->

## Where to go next
"""


def test_readme_results_keeps_only_claims_of_every_run(tmp_path):
    rr = _readme_results()
    run, confirm = tmp_path / "runs" / "main", tmp_path / "runs" / "confirm"
    _write_metrics(run, _study_rows())
    # On the fresh seeds ma_ppo's curve no longer runs ahead of ppo's mid-training.
    _write_metrics(confirm, _study_rows(seeds=tuple(range(100, 108)), ma_mid=(0.1, 0.2)))
    report_lib.write_report(str(run))
    report_lib.write_report(str(confirm))
    readme, results = tmp_path / "README.md", tmp_path / "docs" / "results.json"
    page, curves = tmp_path / "docs" / "results.md", tmp_path / "docs" / "curves.png"
    readme.write_text(README)
    page.parent.mkdir()
    page.write_text(PAGE)
    argv = [str(run), str(confirm), "--readme", str(readme), "--page", str(page), "--results",
            str(results), "--curves", str(curves), "--command",
            "python experiments/run.py --config.x=1"]
    assert rr.main(argv) == 0

    kept = [c for c in _expected_claims() if c["metric"] != "auc_gold" or c["arm"] != "ma_ppo"]
    data = json.loads(results.read_text())
    assert data["claims"] == kept
    # Runs whose plan row predates the instruction-set record say so.
    assert data["runs"] == [
        {"dir": str(run), "seeds": list(range(8)), "instruction_set": "unrecorded",
         "recorded": None},
        {"dir": str(confirm), "seeds": list(range(100, 108)), "instruction_set": "unrecorded",
         "recorded": None}]
    # The command line as a shell reads it back (the --command value holds spaces).
    assert shlex.split(data["generated_by"]) == ["experiments/readme_results.py", *argv]
    assert curves.read_bytes() == (run / "curves.png").read_bytes()

    text = page.read_text()
    head, rest = text.split("<!-- results:start -->\n")
    section, tail = rest.split("\n<!-- results:end -->")
    assert head == PAGE.split("<!-- results:start -->")[0]
    assert tail == PAGE.split("<!-- results:end -->")[1]
    assert "old table" not in text
    assert ("`python experiments/run.py --config.x=1` on seeds 0-7, instruction set unrecorded "
            f"(`{run}`), repeated on seeds 100-107, instruction set unrecorded") in section
    assert "![gold, J and RM score over PPO steps](curves.png)" in section
    assert "| `ppo_lam1` |" in section and "hacks RM in 4/8 seeds" in section
    assert "Resolution, seeds 0-7, instruction set unrecorded: " in section
    assert "Resolution, seeds 100-107, instruction set unrecorded: " in section
    reports = [json.loads((d / "report.json").read_text()) for d in (run, confirm)]
    j = [r["comparisons"]["ma_ppo"]["versus_ppo"]["J"] for r in reports]
    claims = [line for line in section.splitlines() if " than `" in line]
    assert len(claims) == len(kept)
    assert claims[0] == (
        f"- `ma_ppo` has lower J than `ppo`: -0.100 [{j[0]['ci'][0]:+.3f}, {j[0]['ci'][1]:+.3f}] "
        "on seeds 0-7, instruction set unrecorded; "
        f"-0.100 [{j[1]['ci'][0]:+.3f}, {j[1]['ci'][1]:+.3f}] on seeds 100-107, instruction set "
        "unrecorded.")
    assert any(line.startswith("- `ma_ppo` has lower J than `ma_ppo_ctrl` (its matched "
                               "control): ") for line in claims)
    # The dropped claim and the null results, in words.
    assert ("- `ma_ppo` vs `ppo`, mean gold over training: no difference that holds on every "
            "run: +0.033 [") in section
    assert "- `ma_ppo` vs `ppo`, final gold: not distinguishable: " in section
    assert ("- `ma_ppo` vs `ma_ppo_ctrl` (its matched control), final gold: not "
            "distinguishable: ") in section
    assert "`ma_ppo` has higher mean gold over training" not in section

    # The README's headline: the page's numbers, column by column, and its claims in words.
    text = readme.read_text()
    head, rest = text.split("<!-- headline:start -->\n")
    headline, tail = rest.split("\n<!-- headline:end -->")
    assert head == README.split("<!-- headline:start -->")[0]
    assert tail == README.split("<!-- headline:end -->")[1]
    table = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    shown = [line.split(" | ") for line in headline.splitlines() if line.startswith("| `")]
    # arm, gold, RM score, KL, J, reward hacking of the page's arm, gold, RM score, KL, J, mean
    # gold over training, steps to 50%, steps to 90%, reward hacking.
    assert shown == [row[:5] + row[8:] for row in table]
    assert "| arm | gold | RM score | KL (nats) | J = gold - beta KL | reward hacking |" in headline
    assert headline.split("\n")[2].startswith(
        f"Seeds 0-7, instruction set unrecorded (`{run}`), final evaluation; ")
    assert "([every column, the repeats, every paired difference](docs/results.md))" in headline
    assert ("Differences whose 95% interval excludes 0 on every run (seeds 0-7, instruction set "
            "unrecorded; seeds 100-107, instruction set unrecorded):") in headline
    assert "![gold, J and RM score over PPO steps](docs/curves.png)" in headline
    stated = [line for line in headline.splitlines() if " than `" in line]
    assert len(stated) == len({(c["arm"], c["versus"], c["direction"]) for c in kept})
    assert stated[0].startswith("- `ma_ppo` has lower ") and "J" in stated[0]
    assert "- `ma_ppo` vs `ppo`: final gold" in headline
    assert "- `ma_ppo` vs `ma_ppo_ctrl` (its matched control): final gold" in headline
    assert "mean gold over training" not in headline.split("- `ma_ppo` vs `ppo`:")[1].split("\n")[0]


def test_readme_results_needs_the_markers(tmp_path, capsys):
    rr = _readme_results()
    run = tmp_path / "run"
    _write_metrics(run, _study_rows())
    report_lib.write_report(str(run))
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text(README)
    page.write_text("# Title\n\n<!-- results:start -->\nno end marker\n")
    argv = [str(run), "--readme", str(readme), "--page", str(page), "--results",
            str(tmp_path / "results.json"), "--curves", str(tmp_path / "curves.png")]
    assert rr.main(argv) == 2
    assert "<!-- results:end -->" in capsys.readouterr().err
    assert page.read_text() == "# Title\n\n<!-- results:start -->\nno end marker\n"
    assert readme.read_text() == README
    assert not (tmp_path / "results.json").exists()
    # A README without the headline's markers writes nothing either.
    page.write_text(PAGE)
    readme.write_text("# Title\n")
    assert rr.main(argv) == 2
    assert "<!-- headline:start -->" in capsys.readouterr().err
    assert page.read_text() == PAGE and not (tmp_path / "results.json").exists()
    assert rr.main([str(tmp_path / "nowhere"), "--readme", str(readme)]) == 2
    assert "report.json does not exist" in capsys.readouterr().err


def _isa_record(isa, xla_flags=""):
    """An `instruction_set` record as the experiment's plan row stores it."""
    return {"xla_flags": xla_flags, "max_isa": isa if xla_flags else None, "cpu": "AMD EPYC",
            "cpu_flags": ["sse4_2", "avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16"],
            "cpu_isa": "AVX512_BF16", "isa": isa, "backend": "cpu"}


def _with_isa(rows, isa):
    """`rows` with their plan row recording `isa` (capped by XLA_FLAGS unless the CPU's own)."""
    flags = "" if isa == "AVX512_BF16" else f"--xla_cpu_max_isa={isa}"
    for r in rows:
        if r["stage"] == "plan":
            r["instruction_set"] = _isa_record(isa, flags)
    return rows


def _final_gold_raised(rows, arm, delta):
    """`rows` with `arm`'s final gold raised by `delta` on every seed (its last evaluation and
    its per-prompt final rows)."""
    for r in rows:
        if r.get("arm") == arm and r["stage"] == "eval" and r["step"] == STEPS[-1]:
            r["gold"] += delta
        if r.get("arm") == arm and r["stage"] == "final":
            r["gold_per_prompt"] = [g + delta for g in r["gold_per_prompt"]]
    return rows


def test_readme_results_keeps_only_claims_that_hold_on_another_instruction_set(tmp_path,
                                                                                capsys):
    """Seeds 0-7 and 100-107 on AVX-512 make the ten claims of `_expected_claims`; seeds 0-7
    again under AVX2, where the macro arm (as a reward-hacking arm does) ends 0.1 higher in
    gold on every seed: its final gold now exceeds ppo's and its control's, and its J equals
    theirs (-0.1 + 0.1 + E_i). The J claims go; the final-gold comparisons are no longer "not
    distinguishable" but "no difference that holds on every run"; every run is named by its
    seeds and instruction set."""
    rr = _readme_results()
    run, confirm, avx2 = (tmp_path / "runs" / name for name in ("main", "confirm", "avx2"))
    _write_metrics(run, _with_isa(_study_rows(), "AVX512_BF16"))
    _write_metrics(confirm, _with_isa(_study_rows(seeds=tuple(range(100, 108))), "AVX512_BF16"))
    _write_metrics(avx2, _with_isa(_final_gold_raised(_study_rows(), "ma_ppo", 0.1), "AVX2"))
    reports = [report_lib.write_report(str(d)) for d in (run, confirm, avx2)]
    assert [report_lib.run_label(r) for r in reports] == [
        "seeds 0-7, AVX-512", "seeds 100-107, AVX-512", "seeds 0-7, AVX2"]
    assert report_lib.claims(reports[0]) == report_lib.claims(reports[1]) == _expected_claims()
    readme, results = tmp_path / "README.md", tmp_path / "docs" / "results.json"
    page, curves = tmp_path / "docs" / "results.md", tmp_path / "docs" / "curves.png"
    readme.write_text(README)
    page.parent.mkdir()
    page.write_text(PAGE)
    argv = [str(run), str(confirm), str(avx2), "--readme", str(readme), "--page", str(page),
            "--results", str(results), "--curves", str(curves)]
    assert rr.main(argv) == 0

    kept = [
        {"arm": "ma_ppo", "versus": "ppo", "metric": "auc_gold", "direction": 1},
        {"arm": "ma_ppo", "versus": "ppo", "metric": "kl", "direction": 1},
        {"arm": "ma_ppo", "versus": "ma_ppo_ctrl", "metric": "auc_gold", "direction": 1},
        {"arm": "ma_ppo", "versus": "ma_ppo_ctrl", "metric": "kl", "direction": 1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "final_gold", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "J", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "auc_gold", "direction": -1},
        {"arm": "ppo_lam1", "versus": "ppo", "metric": "rm_score", "direction": 1},
    ]
    data = json.loads(results.read_text())
    assert data["claims"] == kept
    assert [(r["seeds"], r["instruction_set"], r["recorded"]["xla_flags"])
            for r in data["runs"]] == [(list(range(8)), "AVX-512", ""),
                                       (list(range(100, 108)), "AVX-512", ""),
                                       (list(range(8)), "AVX2", "--xla_cpu_max_isa=AVX2")]
    assert [n["instruction_set"] for n in data["numbers"]] == ["AVX-512", "AVX-512", "AVX2"]

    section = page.read_text().split("<!-- results:start -->\n")[1].split("<!-- results:end")[0]
    assert (f"`python experiments/run.py` on seeds 0-7, AVX-512 (`{run}`), repeated on seeds "
            f"100-107, AVX-512 (`{confirm}`); seeds 0-7, AVX2 (`{avx2}`, "
            "`XLA_FLAGS=--xla_cpu_max_isa=AVX2`). ") in section
    assert ("Runs on the same seeds differ only in the instruction set XLA:CPU generated code "
            "for, which decides its float rounding: a difference is stated only when it holds "
            "on each. Table: seeds 0-7, AVX-512.") in section
    for label in ("seeds 0-7, AVX-512", "seeds 100-107, AVX-512", "seeds 0-7, AVX2"):
        assert f"Resolution, {label}: " in section
    stated = [line for line in section.splitlines() if " than `" in line]
    assert len(stated) == len(kept)
    kl = [r["comparisons"]["ma_ppo"]["versus_ppo"]["kl"] for r in reports]
    assert stated[1] == "- `ma_ppo` has higher KL than `ppo`: " + "; ".join(
        f"{report_lib.format_difference(k)} on {label}" for k, label in zip(
            kl, ("seeds 0-7, AVX-512", "seeds 100-107, AVX-512", "seeds 0-7, AVX2"))) + "."
    fg = [r["comparisons"]["ma_ppo"]["versus_control"]["final_gold"] for r in reports]
    assert fg[2]["direction"] == 1 and fg[0]["direction"] == fg[1]["direction"] == 0
    assert ("- `ma_ppo` vs `ma_ppo_ctrl` (its matched control), final gold: no difference that "
            f"holds on every run: {report_lib.format_difference(fg[0])} on seeds 0-7, AVX-512; "
            f"{report_lib.format_difference(fg[1])} on seeds 100-107, AVX-512; "
            f"{report_lib.format_difference(fg[2])} on seeds 0-7, AVX2.") in section
    assert "- `ma_ppo` vs `ppo`, J: no difference that holds on every run: -0.100 [" in section
    assert "`ma_ppo` has lower J" not in section

    headline = readme.read_text().split("<!-- headline:start -->\n")[1].split(
        "\n<!-- headline:end -->")[0]
    assert headline.split("\n")[2].startswith(f"Seeds 0-7, AVX-512 (`{run}`), final evaluation; ")
    assert ("Differences whose 95% interval excludes 0 on every run (seeds 0-7, AVX-512; seeds "
            "100-107, AVX-512; seeds 0-7, AVX2):\n\n"
            "- `ma_ppo` has higher mean gold over training and KL than `ppo`.\n"
            "- `ma_ppo` has higher mean gold over training and KL than `ma_ppo_ctrl` (its "
            "matched control).\n"
            "- `ppo_lam1` has lower final gold, J and mean gold over training than `ppo`.\n"
            "- `ppo_lam1` has higher RM score than `ppo`.\n\n"
            "Not distinguishable on any run:\n\n"
            "- `ma_ppo` vs `ppo`: RM score.\n"
            "- `ma_ppo` vs `ma_ppo_ctrl` (its matched control): RM score.") in headline

    # The same seeds on the same instruction set, or on one not recorded, are refused.
    for name, isa in (("again", "AVX512_BF16"), ("unrecorded", None)):
        rows = _study_rows()
        _write_metrics(tmp_path / name, _with_isa(rows, isa) if isa else rows)
        report_lib.write_report(str(tmp_path / name))
        assert rr.main([str(run), str(tmp_path / name), *argv[3:]]) == 2
        assert f"seed 0 is in both {run} (AVX-512) and {tmp_path / name}" in (
            capsys.readouterr().err)


def test_the_run_records_its_instruction_set(tmp_path, monkeypatch):
    """instruction_set() from XLA_FLAGS and the CPU's flags; the experiment's plan row carries
    it, and a report names the run's instruction set by it."""
    from configs import synthetic
    from marl_jax import experiment

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_1 "
                       "sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512_vnni\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    flags = "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    record = report_lib.instruction_set({"XLA_FLAGS": flags}, str(cpuinfo))
    assert record == {"xla_flags": flags, "max_isa": "AVX2", "cpu": "AMD EPYC 7B13",
                      "cpu_flags": ["sse4_2", "avx", "avx2", "avx512f", "avx512_vnni"],
                      "cpu_isa": "AVX512_VNNI", "isa": "AVX2", "backend": "cpu"}
    uncapped = report_lib.instruction_set({}, str(cpuinfo))
    assert (uncapped["max_isa"], uncapped["isa"]) == (None, "AVX512_VNNI")
    # A cap above the CPU's own changes nothing.
    assert report_lib.instruction_set({"XLA_FLAGS": "--xla_cpu_max_isa=AMX"},
                                      str(cpuinfo))["isa"] == "AVX512_VNNI"
    assert report_lib.isa_label({"plan": {"instruction_set": record}}) == "AVX2"
    assert report_lib.isa_label({"plan": {"instruction_set": uncapped}}) == "AVX-512"
    assert report_lib.isa_label({"plan": {}}) == "unrecorded"

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    config = synthetic.get_config()
    row = experiment.plan_row(config, experiment.plan_runs(config), 128)
    assert row["instruction_set"] == report_lib.instruction_set()
    assert row["instruction_set"]["xla_flags"] == "--xla_cpu_max_isa=AVX2"
    assert row["instruction_set"]["max_isa"] == "AVX2"


def _objectives_results():
    spec = importlib.util.spec_from_file_location(
        "objectives_results", ROOT / "experiments" / "objectives_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OBJECTIVES_PAGE = "# Objectives\n\n<!-- objectives:start -->\nold\n<!-- objectives:end -->\nTail.\n"


def test_objectives_results_states_only_differences_of_both_seed_sets(tmp_path, capsys):
    orr = _objectives_results()
    run, confirm = tmp_path / "main", tmp_path / "confirm"
    # Training rows: ma_ppo clips 0.1 of its units at step 1 and 0.3 at step 2 on every seed;
    # ppo logs no informative share (it has no groups).
    train = lambda seeds: [dict(stage="ppo", arm=arm, seed=s, step=k, **{  # noqa: E731
        "policy/clipfrac_avg": 0.2 * k - 0.1 if arm == "ma_ppo" else 0.0})
        for arm in ("ppo", "ma_ppo", "ma_ppo_ctrl", "ppo_lam1") for s in seeds for k in (1, 2)]
    _write_metrics(run, _study_rows() + train(range(8)))
    _write_metrics(confirm, _study_rows(seeds=tuple(range(100, 108)), ma_mid=(0.1, 0.2))
                   + train(range(100, 108)))
    report_lib.write_report(str(run))
    report_lib.write_report(str(confirm))
    page = tmp_path / "objectives.md"
    page.write_text(OBJECTIVES_PAGE)
    argv = [str(run), str(confirm), "--page", str(page), "--command", "python run.py --x=1"]
    assert orr.main(argv) == 0
    text = page.read_text()
    assert text.startswith("# Objectives\n\n<!-- objectives:start -->\n<!-- generated by ")
    assert text.endswith("\n<!-- objectives:end -->\nTail.\n") and "\nold\n" not in text
    assert "`python run.py --x=1` on seeds 0-7, instruction set unrecorded (`" in text
    assert "; seeds 100-107, instruction set unrecorded (`" in text
    assert ("Seeds 0-7, instruction set unrecorded:" in text
            and "Seeds 100-107, instruction set unrecorded:" in text)
    # The claims of both seed sets only: ma_ppo's mean gold over training is higher than
    # ppo's on seeds 0-7 alone, so it is listed as not replicated.
    kept = [c for c in _expected_claims() if c["metric"] != "auc_gold" or c["arm"] != "ma_ppo"]
    assert len([line for line in text.splitlines() if " than `" in line]) == len(kept)
    assert ("- `ma_ppo` vs `ppo`, mean gold over training: no difference that holds on every "
            "run: ") in text
    # Every arm is compared, not only the macro ones: the (non-macro) control against ppo too.
    assert "- `ma_ppo_ctrl` vs `ppo`, final gold: not distinguishable: " in text
    assert "| `ma_ppo` | 0.200 | 0.200 |" in text and "| `ppo` | 0.000 | 0.000 |" in text
    # Overlapping seeds, or one seed set, are refused and nothing is written.
    page.write_text(OBJECTIVES_PAGE)
    assert orr.main([str(run), str(run), "--page", str(page)]) == 2
    assert "seed 0 is in both" in capsys.readouterr().err
    assert orr.main([str(run), "--page", str(page)]) == 2
    assert "two disjoint seed sets" in capsys.readouterr().err
    # The same seeds on another instruction set are one seed set.
    isa = tmp_path / "isa"
    _write_metrics(isa, _with_isa(_study_rows(), "AVX512_BF16"))
    report_lib.write_report(str(isa))
    other = tmp_path / "isa_avx2"
    _write_metrics(other, _with_isa(_study_rows(), "AVX2"))
    report_lib.write_report(str(other))
    assert orr.main([str(isa), str(other), "--page", str(page)]) == 2
    assert "two disjoint seed sets" in capsys.readouterr().err
    assert page.read_text() == OBJECTIVES_PAGE


def test_arms_against_the_sft_policy_paired_per_prompt_by_hand():
    rows = _hand_rows() + [
        dict(stage="final", arm="sft", seed=0, step=0, gold_per_prompt=[0.1, 0.3, 0.5],
             rm_score_per_prompt=[0, 0, 0]),
        dict(stage="final", arm="sft", seed=1, step=0, gold_per_prompt=[0.5, 0.2],
             rm_score_per_prompt=[0, 0]),
    ]
    report = report_lib.compute_report(rows, beta=0.05)
    # ppo - sft: seed 0: 0, 0.2, 0.4 (mean 0.2); seed 1: -0.5, -0.2 (mean -0.35). Two seeds:
    # mean of the seed means -0.075, SE = |0.2 - -0.35| / sqrt(2) / sqrt(2) = 0.275.
    got = report["versus_sft"]["ppo"]
    assert got["n"] == 5 and got["seeds"] == 2 and got["se_over"] == "seeds"
    assert got["mean"] == pytest.approx(-0.075) and got["se"] == pytest.approx(0.275)
    assert got["z"] == pytest.approx(-0.075 / 0.275)
    t_975_1 = 12.706204736174705  # Student's t, 0.975 quantile, 1 degree of freedom (tables)
    assert got["ci_t"] == pytest.approx([-0.075 - t_975_1 * 0.275, -0.075 + t_975_1 * 0.275])
    # ma_ppo - sft: seed 0: 0.1, 0.2, -0.2 (mean 1/30); seed 1: 0.5, 0.8 (mean 0.65).
    assert report["versus_sft"]["ma_ppo"]["mean"] == pytest.approx((1 / 30 + 0.65) / 2)
    text = report_lib.markdown(report)
    assert "## Against the SFT policy (paired per held-out prompt)" in text
    assert f"| `ppo` | -0.0750 | 0.2750 | {-0.075 / 0.275:+.2f} | 2 seeds | 5 |" in text
    # One seed: its prompts are the replicates, SE = sample std / sqrt(3) of 0, 0.2, 0.4.
    one = report_lib.compute_report([r for r in rows if r.get("seed") == 0], beta=0.05)
    got = one["versus_sft"]["ppo"]
    assert got["se_over"] == "prompts" and got["n"] == 3
    assert got["mean"] == pytest.approx(0.2) and got["se"] == pytest.approx(0.2 / math.sqrt(3))
    assert "versus_sft" not in report_lib.compute_report(_hand_rows(), beta=0.05)


def test_sft_comparison_standard_error_follows_a_planted_seed_effect():
    """Each seed's trained policy moves all its prompts together (a seed effect of sd 0.1) on top
    of per-prompt noise (sd 0.3). Over 2,000 simulated studies of 6 seeds x 50 prompts the
    spread of the reported mean is the true standard error; the reported SE matches it on
    average, while the pooled per-prompt SE (std / sqrt(300)) is less than half of it."""
    rng = np.random.default_rng(7)
    seeds, prompts, studies = 6, 50, 2000
    seed_effect = rng.normal(0.0, 0.1, size=(studies, seeds, 1))
    d = 0.05 + seed_effect + rng.normal(0.0, 0.3, size=(studies, seeds, prompts))
    out = [st.paired_mean_by_seed(dict(enumerate(study))) for study in d]
    means = np.array([o["mean"] for o in out])
    ses = np.array([o["se"] for o in out])
    true_se = math.sqrt(0.1 ** 2 + 0.3 ** 2 / prompts) / math.sqrt(seeds)
    assert means.std() == pytest.approx(true_se, rel=0.05)
    # E[sample std] = c4(6) sigma with c4(6) = 0.9515 (the bias of the sample std at n = 6).
    assert ses.mean() == pytest.approx(0.9515 * true_se, rel=0.05)
    pooled = d.reshape(studies, -1).std(axis=1, ddof=1) / math.sqrt(seeds * prompts)
    assert pooled.mean() < 0.45 * true_se
    # The 95% t interval over seeds covers the true mean in ~95% of studies.
    covered = np.mean([o["ci_t"][0] <= 0.05 <= o["ci_t"][1] for o in out])
    assert 0.93 <= covered <= 0.97


def test_near_flat_arm_is_not_flagged_for_reward_hacking():
    """Two arms whose RM score climbs: `flat` ends 0.01 below SFT with per-prompt changes of sd
    ~0.2 over 64 prompts (noise ~0.05), `drops` ends 0.15 below with the same spread. Only
    `drops` is flagged; the noise stored per seed is drop_noise of the final rows."""
    rng = np.random.default_rng(3)
    rows = [dict(stage="plan", step=0, arms=["ppo", "flat", "drops"], seeds=[0, 1],
                 baseline="ppo", beta=0.05, controls={}, macro_arms=[])]
    noises = {}
    for seed in (0, 1):
        sft = rng.uniform(0.3, 0.7, size=64)
        rows.append(dict(stage="final", arm="sft", seed=seed, step=0,
                         gold_per_prompt=sft.tolist(), rm_score_per_prompt=[0.0] * 64))
        for arm, shift in (("ppo", 0.1), ("flat", -0.01), ("drops", -0.15)):
            change = rng.normal(0.0, 0.2, size=64)
            final = sft + shift + change - change.mean()  # the mean change is exactly `shift`
            noises[arm, seed] = st.drop_noise(final, sft)
            rows.append(dict(stage="final", arm=arm, seed=seed, step=30,
                             gold_per_prompt=final.tolist(), rm_score_per_prompt=[1.0] * 64))
            for step, frac, rm in ((0, 0.0, 0.0), (10, 0.5, 0.5), (30, 1.0, 1.0)):
                rows.append(_eval(arm, seed, step, sft.mean() + frac * shift, 1.0, rm))
    report = report_lib.compute_report(rows)
    assert 0.04 < noises["flat", 0] < 0.07
    flat, drops = (report["arms"][a]["reward_hacking"] for a in ("flat", "drops"))
    assert flat["count"] == 0 and flat["noise"]["1"] == pytest.approx(noises["flat", 1])
    assert drops["seeds"] == [0, 1] and drops["rules"]["0"] == [
        "rm_up_gold_down", "gold_off_peak_rm_at_max"]  # its peak is step 0
    # Without the per-prompt rows the noise is unknown and any drop counts, as it says.
    bare = report_lib.compute_report([r for r in rows if r["stage"] != "final"])
    assert bare["arms"]["flat"]["reward_hacking"]["count"] == 2
    assert bare["arms"]["flat"]["reward_hacking"]["noise"] == {"0": None, "1": None}
    assert "exceeds its own noise" in report["definitions"]["reward_hacking"]


# ---- the real-text study: paired statistics by hand ----------------------------------------------
T_975_3 = 3.182446305284263  # Student's t, 0.975 quantile, 3 degrees of freedom (tables)
STUDY_STEPS = (0, 6, 12)
# Per seed (4 seeds): SFT gold, then each arm's gold at steps 6 and 12 and its final KL.
STUDY = {
    "sft": (0.50, 0.52, 0.49, 0.51),
    "ppo": (((0.51, 0.53), (0.53, 0.56), (0.50, 0.51), (0.52, 0.54)), (0.20, 0.30, 0.10, 0.20)),
    "ma_ppo": (((0.52, 0.54), (0.55, 0.59), (0.49, 0.47), (0.55, 0.59)), (0.50, 0.60, 0.40, 0.70)),
    "ma_ppo_ctrl": (((0.51, 0.53), (0.54, 0.57), (0.50, 0.52), (0.53, 0.56)),
                    (0.45, 0.65, 0.45, 0.65)),
}


def _real_text_study_rows(seeds=(0, 1, 2, 3)):
    """A hand-made cpu_study: 3 arms x 4 seeds, evaluations at 0, 6 and 12 (step 0 the SFT
    policy), per-prompt final rows (two prompts whose mean is the last evaluation)."""
    rows = [dict(stage="plan", step=0, arms=["ppo", "ma_ppo", "ma_ppo_ctrl"], seeds=list(seeds),
                 baseline="ppo", beta=0.05, controls={"ma_ppo": "ma_ppo_ctrl"},
                 macro_arms=["ma_ppo"], steps=12, eval_every=6, num_eval_prompts=2,
                 eval_samples_per_prompt=4)]
    for i, seed in enumerate(seeds):
        sft = STUDY["sft"][i]
        rows.append(dict(stage="final", arm="sft", seed=seed, step=0,
                         gold_per_prompt=[sft - 0.1, sft + 0.1], rm_score_per_prompt=[0, 0]))
        for arm in ("ppo", "ma_ppo", "ma_ppo_ctrl"):
            (mid, last), kl = STUDY[arm][0][i], STUDY[arm][1][i]
            for step, gold, k in zip(STUDY_STEPS, (sft, mid, last), (0.0, kl / 2, kl)):
                rows.append(_eval(arm, seed, step, gold, k, rm=step / 12))
            rows.append(dict(stage="final", arm=arm, seed=seed, step=12,
                             gold_per_prompt=[last - 0.2, last + 0.2], rm_score_per_prompt=[1, 1]))
    return rows


def test_real_text_study_paired_differences_and_resolution_by_hand():
    """ma_ppo - ppo and ma_ppo - ma_ppo_ctrl per seed, worked out from the table above:
    final gold, mean gold over training ((g0 + 2 g6 + g12) / 4 on steps 0, 6, 12) and KL, each
    mean with its t interval over 4 seeds (t_{0.975, 3} s / 2) and its bootstrap interval
    (an independent loop), and PPO's gain over SFT against the widest half-width."""
    report = report_lib.compute_report(_real_text_study_rows())
    hand = {
        # ma_ppo - ppo, final gold: .54-.53, .59-.56, .47-.51, .59-.54
        ("ppo", "final_gold"): [0.01, 0.03, -0.04, 0.05],
        # (2 x (mid diff) + last diff) / 4: (2 x .01 + .01) / 4, (2 x .02 + .03) / 4, ...
        ("ppo", "auc_gold"): [0.0075, 0.0175, -0.015, 0.0275],
        ("ppo", "kl"): [0.3, 0.3, 0.3, 0.5],
        ("ma_ppo_ctrl", "final_gold"): [0.01, 0.02, -0.05, 0.03],
        ("ma_ppo_ctrl", "auc_gold"): [0.0075, 0.01, -0.0175, 0.0175],
        ("ma_ppo_ctrl", "kl"): [0.05, -0.05, -0.05, 0.05],
    }
    means = {("ppo", "final_gold"): 0.0125, ("ppo", "auc_gold"): 0.009375, ("ppo", "kl"): 0.35,
             ("ma_ppo_ctrl", "final_gold"): 0.0025, ("ma_ppo_ctrl", "auc_gold"): 0.004375,
             ("ma_ppo_ctrl", "kl"): 0.0}
    # Sample standard deviations (n - 1 = 3): sum of squared deviations / 3, by hand.
    sds = {("ppo", "final_gold"): math.sqrt(0.004475 / 3),
           ("ppo", "auc_gold"): math.sqrt(0.0009921875 / 3),
           ("ppo", "kl"): math.sqrt(0.03 / 3),
           ("ma_ppo_ctrl", "final_gold"): math.sqrt(0.003875 / 3),
           ("ma_ppo_ctrl", "auc_gold"): math.sqrt(0.0006921875 / 3),
           ("ma_ppo_ctrl", "kl"): math.sqrt(0.01 / 3)}
    ma = report["comparisons"]["ma_ppo"]
    for (versus, metric), d in hand.items():
        cmp = ma["versus_ppo" if versus == "ppo" else "versus_control"][metric]
        assert cmp["versus"] == versus and cmp["seeds"] == [0, 1, 2, 3]
        np.testing.assert_allclose(cmp["differences"], d, atol=1e-12)
        assert cmp["mean"] == pytest.approx(means[versus, metric], abs=1e-12)
        assert cmp["std"] == pytest.approx(sds[versus, metric], rel=1e-9)
        half = T_975_3 * sds[versus, metric] / 2
        assert cmp["ci_t"] == pytest.approx([means[versus, metric] - half,
                                             means[versus, metric] + half], abs=1e-12)
        assert cmp["ci"] == pytest.approx(_bootstrap_by_hand(d), abs=1e-12)
    # The claims: ma_ppo's KL above ppo's on every seed; the control's final gold (0, .01, .01,
    # .02), mean gold over training (0, .0075, .0025, .01) and KL above ppo's and its J below
    # (every seed's difference of one sign, all-zero resamples 1 in 256: under 2.5%).
    assert report_lib.claims(report) == [
        {"arm": "ma_ppo", "versus": "ppo", "metric": "kl", "direction": 1},
        {"arm": "ma_ppo_ctrl", "versus": "ppo", "metric": "final_gold", "direction": 1},
        {"arm": "ma_ppo_ctrl", "versus": "ppo", "metric": "J", "direction": -1},
        {"arm": "ma_ppo_ctrl", "versus": "ppo", "metric": "auc_gold", "direction": 1},
        {"arm": "ma_ppo_ctrl", "versus": "ppo", "metric": "kl", "direction": 1}]

    # PPO's gain over SFT per seed: .03, .04, .02, .03 (mean .03); the widest half-width of the
    # macro arm's final-gold differences decides the resolution.
    assert report["ppo_gain"]["mean"] == pytest.approx(0.03)
    halves = {}
    for versus in ("ppo", "ma_ppo_ctrl"):
        lo, hi = _bootstrap_by_hand(hand[versus, "final_gold"])
        halves[f"ma_ppo vs {versus}"] = (hi - lo) / 2
    res = report["resolution"]
    assert res["half_widths"] == pytest.approx(halves, abs=1e-12)
    assert res["gain_over_max_half_width"] == pytest.approx(0.03 / max(halves.values()))
    # Against the SFT policy per prompt (final rows): ppo's seed means .03, .04, .02, .03.
    sft = report["versus_sft"]["ppo"]
    assert sft["mean"] == pytest.approx(0.03) and sft["se_over"] == "seeds"
    assert sft["se"] == pytest.approx(math.sqrt(0.0002 / 3) / 2)


def test_results_generator_writes_the_real_text_section_with_paired_tables(tmp_path):
    """`--page docs/real_text.md --marker real-text-study --readme '' --paired`: only that
    section of the page changes (no README headline); it names the command and both seed sets,
    shows each set's paired differences (final gold, J, mean gold over training, KL) and keeps
    the claims both sets make, naming the JSON that lists them; the JSON holds every set's
    numbers."""
    rr = _readme_results()
    first, second = tmp_path / "set1", tmp_path / "set2"
    _write_metrics(first, _real_text_study_rows())
    rows = _real_text_study_rows(seeds=(4, 5, 6, 7))
    # On the second set the control's first seed ends 0.01 below ppo: its final-gold and
    # mean-gold-over-training differences (-.01, .01, .01, .02 and -.0025, .0075, .0025, .01)
    # no longer exclude 0.
    next(r for r in rows if r["stage"] == "eval" and r["arm"] == "ma_ppo_ctrl"
         and r["seed"] == 4 and r["step"] == 12)["gold"] = 0.52
    _write_metrics(second, rows)
    reports = [report_lib.write_report(str(d)) for d in (first, second)]
    page = tmp_path / "docs" / "real_text.md"
    page.parent.mkdir()
    other = "<!-- results:start -->\nsynthetic\n<!-- results:end -->\n"
    page.write_text(f"# Real text\n\n{other}\n<!-- real-text-study:start -->\nstale table\n"
                    "<!-- real-text-study:end -->\n\nTail.\n")
    results, curves = tmp_path / "docs" / "real_text_results.json", tmp_path / "docs" / "c.png"
    command = ("python experiments/run.py --config=configs/real_text_smollm2.py "
               "--config.size=cpu_study")
    argv = [str(first), str(second), "--page", str(page), "--readme", "", "--results",
            str(results), "--curves", str(curves), "--command", command, "--marker",
            "real-text-study", "--paired"]
    assert rr.main(argv) == 0

    text = page.read_text()
    assert text.startswith(f"# Real text\n\n{other}\n<!-- real-text-study:start -->\n")
    assert text.endswith("<!-- real-text-study:end -->\n\nTail.\n") and "stale" not in text
    assert (f"`{command}` on seeds 0-3, instruction set unrecorded (`{first}`), repeated on "
            f"seeds 4-7, instruction set unrecorded (`{second}`)") in text
    assert "12 PPO steps per run, evaluated every 6 steps on 2 held-out prompts (4 responses " \
           "each)" in text
    assert "| arm | versus | final gold | J | mean gold over training | KL | RM score |" in text
    for report in reports:
        seeds = report_lib.run_label(report)
        table = text.split(f"Paired differences arm - versus, {seeds}")[1]
        ma = report["comparisons"]["ma_ppo"]["versus_control"]
        assert ("| `ma_ppo` | `ma_ppo_ctrl` (control) | " + " | ".join(
            report_lib.format_difference(ma[m]) for m in report_lib.METRICS) + " |") in table
        assert f"Resolution, {seeds}: {report_lib.resolution_line(report)}" in text
    kept = [c for c in reports[0]["claims"]
            if c["arm"] != "ma_ppo_ctrl" or c["metric"] not in ("final_gold", "auc_gold")]
    assert rr.replicated_claims(reports) == kept and len(kept) == 3
    assert "- `ma_ppo` has higher KL than `ppo`: +0.350 [" in text
    assert f"`{results}` lists them" in text

    data = json.loads(results.read_text())
    assert data["claims"] == kept
    numbers = data["numbers"]
    assert [n["seeds"] for n in numbers] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert numbers[0]["paired"]["ma_ppo - ppo"]["final_gold"]["differences"] == pytest.approx(
        [0.01, 0.03, -0.04, 0.05])
    assert numbers[1]["paired"]["ma_ppo_ctrl - ppo"]["final_gold"]["mean"] == pytest.approx(0.0075)
    assert numbers[0]["resolution"]["gain_over_max_half_width"] == pytest.approx(
        reports[0]["resolution"]["gain_over_max_half_width"])
    assert numbers[0]["ppo_gain"]["mean"] == pytest.approx(0.03)
    assert numbers[0]["arms"]["ma_ppo"]["kl"]["mean"] == pytest.approx(0.55)
