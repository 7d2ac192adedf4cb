"""The experiment report: report.json, report.md, curves.png and rm_hist.png, from metrics.jsonl.

Every number is recomputed from the rows of `<workdir>/metrics.jsonl` written by
`marl_jax/experiment.py`, with these definitions (also stored in report.json):

- final gold / KL / RM score of a run: its evaluation row at the last step; per arm, the mean
  and the sample standard deviation (ddof=1) over seeds. J = gold - beta * KL with the base
  `config.ppo.kl_coef` as beta for every arm (the objective PPO optimises).
- curve of an arm: the mean over seeds of its evaluation gold at each evaluation step, smoothed
  by a trailing moving average over `smoothing` evaluation points (fewer at the start).
- SFT gold: the baseline arm's step-0 gold, averaged over seeds. Baseline final: the last point
  of the baseline's smoothed curve. Gain = baseline final - SFT gold.
- steps to 50% / 90%: the first evaluation step at which an arm's smoothed curve reaches
  SFT gold + 0.5 / 0.9 x gain (null when never reached or when gain <= 0).
- speedup_to_parity: the baseline's steps to reach its own final smoothed gold divided by the
  arm's steps to reach it (null when the arm never reaches it or when gain <= 0).
- win rate against the baseline: over every (seed, held-out prompt) pair, 1 when the arm's final
  response has higher gold than the baseline's response for the same prompt and seed, 0.5 on a
  tie (|difference| <= 1e-6), 0 otherwise; averaged.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np

from marl_jax.train.metrics import read_metrics

TIE = 1e-6
DEFINITIONS = {
    "final": "eval row at the last step per seed; mean and sample std (ddof=1) over seeds",
    "J": "gold - beta * kl with beta = config.ppo.kl_coef for every arm",
    "curve": "mean over seeds of eval gold per step, trailing moving average over `smoothing` "
             "eval points",
    "steps_to_50": "first eval step where the curve >= sft_gold + 0.5 * (baseline_final - "
                   "sft_gold)",
    "steps_to_90": "same with 0.9",
    "speedup_to_parity": "baseline steps_to_parity / arm steps_to_parity, where steps_to_parity "
                         "is the first eval step where the curve >= baseline_final",
    "win_rate_vs_baseline": "mean over (seed, prompt) of 1 win / 0.5 tie / 0 loss on final gold",
}


def trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    window = max(int(window), 1)
    c = np.cumsum(np.insert(np.asarray(x, float), 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def first_step_reaching(steps, curve, target):
    hit = np.nonzero(np.asarray(curve) >= target - 1e-12)[0]
    return int(steps[hit[0]]) if len(hit) else None


def _mean_std(values):
    v = np.asarray(values, float)
    std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return float(v.mean()), std


def compute_report(rows, *, beta: float, smoothing: int, baseline: str, arms) -> dict:
    """The report dict from metrics rows (see the module docstring for every definition)."""
    evals = defaultdict(lambda: defaultdict(dict))  # arm -> seed -> step -> row
    finals = defaultdict(dict)  # arm -> seed -> row
    for r in rows:
        if r.get("stage") == "eval" and "arm" in r:
            evals[r["arm"]][r["seed"]][int(r["step"])] = r
        elif r.get("stage") == "final" and "arm" in r:
            finals[r["arm"]][r["seed"]] = r
    arms = [a for a in arms if a in evals]
    if baseline not in evals:
        raise ValueError(f"no evaluation rows for the baseline arm {baseline!r}")

    def curves(arm, key):
        seeds = sorted(evals[arm])
        steps = sorted(set.intersection(*(set(evals[arm][s]) for s in seeds)))
        per_seed = np.array([[evals[arm][s][t][key] for t in steps] for s in seeds], float)
        return np.array(steps), seeds, per_seed

    b_steps, _, b_gold = curves(baseline, "gold")
    sft_gold = float(b_gold[:, 0].mean()) if b_steps[0] == 0 else float("nan")
    b_curve = trailing_mean(b_gold.mean(axis=0), smoothing)
    baseline_final = float(b_curve[-1])
    gain = baseline_final - sft_gold
    b_parity = first_step_reaching(b_steps, b_curve, baseline_final)

    out = {}
    for arm in arms:
        steps, seeds, gold = curves(arm, "gold")
        _, _, kl = curves(arm, "kl")
        _, _, rm = curves(arm, "rm_score")
        curve = trailing_mean(gold.mean(axis=0), smoothing)
        j_final = gold[:, -1] - beta * kl[:, -1]
        entry = {
            "seeds": [int(s) for s in seeds],
            "final_step": int(steps[-1]),
            "gold": _mean_std(gold[:, -1]),
            "kl": _mean_std(kl[:, -1]),
            "J": _mean_std(j_final),
            "rm_score": _mean_std(rm[:, -1]),
            "steps_to_50": None, "steps_to_90": None, "steps_to_parity": None,
            "speedup_to_parity": None,
        }
        if gain > 0:
            entry["steps_to_50"] = first_step_reaching(steps, curve, sft_gold + 0.5 * gain)
            entry["steps_to_90"] = first_step_reaching(steps, curve, sft_gold + 0.9 * gain)
            parity = first_step_reaching(steps, curve, baseline_final)
            entry["steps_to_parity"] = parity
            if parity and b_parity is not None:
                entry["speedup_to_parity"] = b_parity / parity
        entry["win_rate_vs_" + baseline] = _win_rate(finals.get(arm, {}), finals.get(baseline,
                                                                                      {}))
        entry["per_seed"] = {str(s): {"gold": float(gold[i, -1]), "kl": float(kl[i, -1]),
                                      "J": float(j_final[i]), "rm_score": float(rm[i, -1])}
                             for i, s in enumerate(seeds)}
        out[arm] = entry
    report = {
        "arms": out, "beta": beta, "baseline": baseline, "smoothing": smoothing,
        "sft_gold": sft_gold, "baseline_final_gold": baseline_final, "gain": gain,
        "definitions": DEFINITIONS,
    }
    ma = out.get("ma_ppo", {})
    report["speedup_to_parity"] = ma.get("speedup_to_parity")
    report["win_rate_ma_vs_ppo"] = ma.get("win_rate_vs_" + baseline)
    report["verdict"] = verdicts(out, baseline)
    return report


def _win_rate(arm_finals, base_finals):
    wins = []
    for seed, row in arm_finals.items():
        base = base_finals.get(seed)
        if base is None or "gold_per_prompt" not in row:
            continue
        a, b = np.asarray(row["gold_per_prompt"]), np.asarray(base["gold_per_prompt"])
        wins.append(np.where(np.abs(a - b) <= TIE, 0.5, (a > b).astype(float)))
    return float(np.concatenate(wins).mean()) if wins else None


def paired_difference(arms: dict, a: str, b: str, key: str):
    """Mean and standard error over seeds of the per-seed difference a - b of a final metric."""
    seeds = sorted(set(arms[a]["per_seed"]) & set(arms[b]["per_seed"]))
    d = np.array([arms[a]["per_seed"][s][key] - arms[b]["per_seed"][s][key] for s in seeds])
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("inf")
    return float(d.mean()), se


def compare(arms: dict, a: str, b: str, key: str) -> str:
    mean, se = paired_difference(arms, a, b, key)
    if mean - 2 * se > 0:
        word = "beats"
    elif mean + 2 * se < 0:
        word = "is worse than"
    else:
        word = "is not distinguishable from"
    return f"{a} {word} {b} on {key} (paired difference {mean:+.3f} +/- {se:.3f} s.e.)"


def verdicts(arms: dict, baseline: str) -> list[str]:
    lines = []
    if "ma_ppo" not in arms:
        return lines
    for other in (baseline, "ppo_matched"):
        if other in arms:
            lines.append(compare(arms, "ma_ppo", other, "gold"))
            lines.append(compare(arms, "ma_ppo", other, "J"))
    return lines


# ---- files ---------------------------------------------------------------------------------------
def write_report(workdir: str, *, beta: float, smoothing: int, baseline: str, arms) -> dict:
    rows = read_metrics(workdir)
    report = compute_report(rows, beta=beta, smoothing=smoothing, baseline=baseline, arms=arms)
    _atomic_write(os.path.join(workdir, "report.json"), json.dumps(report, indent=2))
    plot_curves(rows, report, os.path.join(workdir, "curves.png"))
    plot_rm_histogram(rows, report, os.path.join(workdir, "rm_hist.png"))
    _atomic_write(os.path.join(workdir, "report.md"), markdown(report))
    return report


def _atomic_write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fmt(ms):
    return f"{ms[0]:.3f} ± {ms[1]:.3f}"


def _opt(x, fmt="{}"):
    return "—" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    b = report["baseline"]
    lines = [
        "# MA-PPO vs PPO: report", "",
        f"beta = {report['beta']}, SFT gold = {report['sft_gold']:.3f}, {b} final gold "
        f"(smoothed) = {report['baseline_final_gold']:.3f}; mean ± std over seeds.", "",
        f"| arm | gold | KL (nats) | J = gold - beta KL | RM score | steps to 50% | "
        f"steps to 90% | speedup to parity | win rate vs {b} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, e in report["arms"].items():
        lines.append(
            f"| {arm} | {_fmt(e['gold'])} | {_fmt(e['kl'])} | {_fmt(e['J'])} | "
            f"{_fmt(e['rm_score'])} | {_opt(e['steps_to_50'])} | {_opt(e['steps_to_90'])} | "
            f"{_opt(e['speedup_to_parity'], '{:.2f}x')} | "
            f"{_opt(e['win_rate_vs_' + b], '{:.3f}')} |")
    lines += ["", "![curves](curves.png)", "", "![RM scores](rm_hist.png)", "",
              "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in report["definitions"].items()]
    lines += ["", "## Verdict", ""]
    lines += [f"- {v}" for v in report["verdict"]] or ["- (needs the ma_ppo arm)"]
    return "\n".join(lines) + "\n"


def summary_text(report: dict) -> str:
    out = [f"{'arm':<20}{'gold':>16}{'KL':>16}{'J':>16}{'50%':>7}{'90%':>7}{'parity':>9}"]
    for arm, e in report["arms"].items():
        out.append(f"{arm:<20}{_fmt(e['gold']):>16}{_fmt(e['kl']):>16}{_fmt(e['J']):>16}"
                   f"{_opt(e['steps_to_50']):>7}{_opt(e['steps_to_90']):>7}"
                   f"{_opt(e['speedup_to_parity'], '{:.2f}x'):>9}")
    out += [""] + report["verdict"]
    return "\n".join(out)


def plot_curves(rows, report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beta = report["beta"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in report["arms"]:
        by_seed = defaultdict(dict)
        for r in rows:
            if r.get("stage") == "eval" and r.get("arm") == arm:
                by_seed[r["seed"]][int(r["step"])] = r
        steps = sorted(set.intersection(*(set(v) for v in by_seed.values())))
        gold = np.array([[by_seed[s][t]["gold"] for t in steps] for s in by_seed])
        j = np.array([[by_seed[s][t]["gold"] - beta * by_seed[s][t]["kl"] for t in steps]
                      for s in by_seed])
        for ax, values in zip(axes, (gold, j)):
            line, = ax.plot(steps, values.mean(axis=0), label=arm)
            ax.fill_between(steps, values.min(axis=0), values.max(axis=0),
                            color=line.get_color(), alpha=0.15)
    axes[0].set_title("gold reward (held-out prompts)")
    axes[1].set_title(f"J = gold - {beta} x KL")
    for ax in axes:
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rm_histogram(rows, report, path):
    from marl_jax.eval.scores import plot_score_histogram

    scores = defaultdict(list)
    for r in rows:
        if r.get("stage") == "final" and r.get("arm") in report["arms"]:
            scores[r["arm"]] += list(r["rm_score_per_prompt"])
    plot_score_histogram({k: np.asarray(v) for k, v in scores.items()}, path)


def write_combined(workdir: str, reports: dict) -> None:
    """report.json / report.md gathering several experiments (e.g. one per horizon)."""
    _atomic_write(os.path.join(workdir, "report.json"), json.dumps(reports, indent=2))
    parts = ["# Experiments", ""]
    for name, report in reports.items():
        body = markdown(report).replace("](curves.png)", f"]({name}/curves.png)").replace(
            "](rm_hist.png)", f"]({name}/rm_hist.png)")
        parts += [f"## {name}", "", body.split("\n", 1)[1]]
    _atomic_write(os.path.join(workdir, "report.md"), "\n".join(parts))
