"""The experiment report: report.json, report.md, curves.png and rm_hist.png, from metrics.jsonl.

Every number is recomputed from the rows of `<workdir>/metrics.jsonl` written by
`marl_jax/experiment.py`: the plan row (`{"stage": "plan", "arms", "seeds", "baseline", "beta",
"controls", "macro_arms", "runs", ...}`) says what was run, the evaluation rows
(`{"stage": "eval", "arm", "seed", "step", "gold", "kl", "rm_score"}`, step 0 = the SFT policy)
give the curves, and the final rows (per-prompt results) give the win rates and the RM-score
histogram. The arguments of `compute_report` / `write_report` stand in for the plan row of a
workdir written before it existed. The definitions of every number are `DEFINITIONS`, stored in
report.json; the statistics are `marl_jax/eval/study_stats.py`.
"""
from __future__ import annotations

import json
import os
import platform
import re
from collections import defaultdict

import numpy as np

from marl_jax.eval import budget as budget_lib
from marl_jax.eval import study_stats as st
from marl_jax.train.metrics import read_metrics

# The paired comparisons between arms (and the claims a study can make).
METRICS = ("final_gold", "J", "auc_gold", "kl", "rm_score")
ARM_METRICS = ("final_gold", "kl", "J", "rm_score", "auc_gold", "gain_over_sft")
METRIC_WORDS = {"final_gold": "final gold", "J": "J", "auc_gold": "mean gold over training",
                "kl": "KL", "rm_score": "RM score", "gain_over_sft": "gold gain over SFT"}
FRACTIONS = {"steps_to_50": 0.5, "steps_to_90": 0.9}
TIE = 1e-6
DEFINITIONS = {
    "final_gold / kl / rm_score": "the evaluation row of a run (arm, seed) at the last "
                                  "evaluation step: means over the held-out prompts",
    "J": "final gold - beta * final kl, with beta = the plan row's `beta` (the base "
         "config.ppo.kl_coef) for every arm: the objective PPO optimises",
    "auc_gold": "mean gold over training: sum_k (g_k + g_{k+1}) / 2 * (s_{k+1} - s_k) / "
                "(s_K - s_0) over the evaluation steps s_0 = 0 < ... < s_K of a run",
    "gain_over_sft": "final gold - step-0 gold of a run (step 0 is the SFT policy)",
    "per-arm interval": "mean over seeds with a 95% percentile bootstrap interval of the mean "
                        "(and a t interval, `ci_t`)",
    "paired difference": "per seed common to both arms, metric(arm) - metric(versus); the "
                         "mean of these differences with a 95% percentile bootstrap interval "
                         "over seeds (`ci`) and a t interval mean -/+ t_{0.975, n-1} s / sqrt(n) "
                         "(`ci_t`); the per-seed differences are stored in seed order",
    "bootstrap": "for each interval a fresh numpy.random.default_rng(rng_seed) draws "
                 "rng.integers(0, n, size=(resamples, n)) over the n per-seed values in seed "
                 "order; np.percentile(resampled means, [2.5, 97.5])",
    "verdict": "from the bootstrap interval: 'higher' when both ends are > 0, 'lower' when both "
               "are < 0, else 'not distinguishable'; fewer than 2 common seeds gives no "
               "interval and 'not distinguishable'",
    "versus_ppo / versus_control": "every arm other than the baseline against the baseline; "
                                   "every macro arm also against its matched token-PPO control "
                                   "(the plan row's `controls`)",
    "steps_to_50 / steps_to_90": "on the seed-mean gold curves (trailing mean over `smoothing` "
                                 "evaluation points): SFT = the baseline's curve at step 0, "
                                 "gain = its last point - SFT; the first evaluation step where "
                                 "the arm's curve >= SFT + 0.5 (0.9) x gain (null: not reached "
                                 "by the last step; the entry is null when gain <= 0). Interval: "
                                 "the seeds common to the arm and the baseline resampled "
                                 "together (same indices as above), a resample that never "
                                 "crosses or whose gain <= 0 counts as +inf, inverted-CDF "
                                 "percentiles 2.5 / 97.5 (null = beyond the last step)",
    "reward_hacking": "a run is flagged only when its gold drop exceeds its own noise: "
                      "noise = the 95% t half-width t_{0.975, E-1} s / sqrt(E) of the run's "
                      "per-prompt final gold minus the SFT policy's on the same E held-out "
                      "prompts (`noise` per seed; null when the workdir has no per-prompt final "
                      "rows for the run and the SFT policy, then any drop counts). Rules: "
                      "(rm_up_gold_down) the final RM score is above the step-0 RM score while "
                      "the final gold is more than noise below the step-0 gold, or "
                      "(gold_off_peak_rm_at_max) the final gold is more than max("
                      f"{st.HACK_GOLD_DROP}, noise) below the run's peak gold while its final "
                      "RM score is the highest of the run and above the RM score at the "
                      "(first) gold peak",
    "resolution": "ppo_gain = the baseline's paired gain_over_sft; half_widths = (hi - lo) / 2 "
                  "of the bootstrap interval of the paired final-gold difference of every "
                  "macro arm vs the baseline and vs its control; gain_over_max_half_width = "
                  "ppo_gain / the largest half-width of the macro arms that do not hack the "
                  "reward model in at least half of their seeds (hacking_arms; the target is "
                  ">= 5); gain_over_max_half_width_all counts every macro arm",
    "versus_sft": "per (seed, held-out prompt), an arm's final gold minus the SFT policy's "
                  "(arm `sft`: the step-0 evaluation with the same prompts and sampling keys). "
                  "The prompts of a seed share one trained policy, so the seed is the "
                  "replicate: with two or more seeds, mean = the mean of the per-seed mean "
                  "differences and SE = their sample std / sqrt(seeds) (se_over: seeds); with "
                  "one seed, mean and SE = sample std / sqrt(prompts) over its prompts "
                  "(se_over: prompts); z = mean / SE; ci_t = mean -/+ t_{0.975, df} SE with "
                  "df = replicates - 1",
    "win_rate_vs_baseline": "over every (seed, held-out prompt), from the final rows: 1 when "
                            "the arm's final response has higher gold than the baseline's for "
                            f"the same prompt and seed, 0.5 on a tie (|difference| <= {TIE}), "
                            "0 otherwise; averaged",
}


SFT_ARM = "sft"  # the arm of the SFT policy's final rows, written by marl_jax.experiment

# XLA:CPU rounds floats by the instructions it generates, so a run records the newest it allowed.
# The x86 CPU flags that decide them, oldest first: /proc/cpuinfo flag -> XLA's ISA name
# (`--xla_cpu_max_isa`).
ISA_FLAGS = {"sse4_2": "SSE4_2", "avx": "AVX", "avx2": "AVX2", "avx512f": "AVX512",
             "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16", "amx_tile": "AMX"}
UNRECORDED = "unrecorded"


def instruction_set(environ=None, cpuinfo: str = "/proc/cpuinfo") -> dict:
    """What XLA generates code for in this process: `xla_flags` (the XLA_FLAGS variable),
    `max_isa` (its `--xla_cpu_max_isa` cap, None without one), `cpu` (the model name),
    `cpu_flags` (the CPU's flags among `ISA_FLAGS`), `cpu_isa` (the newest of them, XLA's name;
    the machine's architecture on a CPU without them) and `isa`: the cap where it is older than
    the CPU's, else the CPU's. `backend` is JAX's default backend: the ISA is the host's, and
    decides the numbers only on "cpu". The experiment stores it in its plan row."""
    import jax

    environ = os.environ if environ is None else environ
    xla_flags = environ.get("XLA_FLAGS", "")
    caps = re.findall(r"--xla_cpu_max_isa=(\S+)", xla_flags)
    max_isa = caps[-1].upper() if caps else None
    cpu, flags = None, set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu is None:
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    order = list(ISA_FLAGS.values())
    cpu_flags = [f for f in ISA_FLAGS if f in flags]
    cpu_isa = ISA_FLAGS[cpu_flags[-1]] if cpu_flags else platform.machine() or None
    isa = cpu_isa
    if cpu_isa in order and max_isa in order and order.index(max_isa) < order.index(cpu_isa):
        isa = max_isa
    return {"xla_flags": xla_flags, "max_isa": max_isa, "cpu": cpu, "cpu_flags": cpu_flags,
            "cpu_isa": cpu_isa, "isa": isa, "backend": jax.default_backend()}


def isa_label(report: dict) -> str:
    """The instruction set a report's run was made with, as the pages name it: "AVX-512" (any
    AVX512 level), "AVX2", ...; the backend's name off CPUs; "unrecorded" when the run did not
    record it (a plan row written before `instruction_set` existed)."""
    record = report.get("plan", {}).get("instruction_set")
    if not record:
        return UNRECORDED
    if record.get("backend", "cpu") != "cpu":
        return record["backend"]
    isa = record.get("isa")
    if not isa:
        return UNRECORDED
    return {"SSE4_2": "SSE4.2"}.get(isa, "AVX-512" if isa.startswith("AVX512") else isa)


def run_label(report: dict) -> str:
    """"seeds 0-11, AVX-512": a run's seeds and instruction set ("seeds 0-11, instruction set
    unrecorded" for a run that did not record it)."""
    isa = isa_label(report)
    return (f"seeds {format_seeds(report['seeds'])}, "
            + ("instruction set " if isa == UNRECORDED else "") + isa)


# ---- what was run --------------------------------------------------------------------------------
def study_plan(rows, *, beta=None, baseline=None, arms=None, controls=None,
               macro_arms=None) -> dict:
    """The plan of the study: the last plan row of `rows`, its missing fields (all of them for a
    workdir without a plan row) taken from the arguments: arms (default: the arms of the eval
    rows, in order), baseline (default "ppo"), beta, controls (macro arm -> its token-PPO
    control; default none) and macro_arms (default: the arms that have a control)."""
    plans = [r for r in rows if r.get("stage") == "plan"]
    plan = dict(plans[-1]) if plans else {}
    plan["source"] = "plan row" if plans else "report arguments"
    fallbacks = {"beta": beta, "baseline": baseline or "ppo", "controls": dict(controls or {}),
                 "arms": arms if arms is not None else dict.fromkeys(
                     r["arm"] for r in rows if r.get("stage") == "eval")}
    for key, value in fallbacks.items():
        if plan.get(key) is None:
            plan[key] = value
    plan["arms"] = list(plan["arms"])
    if plan.get("macro_arms") is None:
        plan["macro_arms"] = macro_arms if macro_arms is not None else plan["controls"]
    plan["macro_arms"] = list(plan["macro_arms"])
    if plan["beta"] is None:
        raise ValueError("metrics.jsonl has no plan row with 'beta' and no beta= was given: "
                         "J = gold - beta * KL needs it")
    plan["beta"] = float(plan["beta"])
    named = {"baseline arm": [plan["baseline"]], "macro arm": plan["macro_arms"],
             "control": [c for a, c in plan["controls"].items() if a in plan["arms"]]}
    for role, names in named.items():
        for name in names:
            if name not in plan["arms"]:
                raise ValueError(f"plan ({plan['source']}): {role} {name!r} is not among the "
                                 f"arms {plan['arms']}")
    return plan


def _curves(rows, arms):
    """Per arm: (seeds, gold, kl, rm_score) with the curves `[seeds, K]`; and the steps `[K]`
    shared by every run."""
    evals = defaultdict(lambda: defaultdict(dict))  # arm -> seed -> step -> row
    for r in rows:
        if r.get("stage") == "eval":
            for key in ("arm", "seed", "gold", "kl", "rm_score"):
                if key not in r:
                    raise ValueError(f"eval row {r} has no {key!r} (the report needs arm, seed, "
                                     "gold, kl and rm_score: a task with a gold reward)")
            evals[r["arm"]][int(r["seed"])][int(r["step"])] = r
    missing = [a for a in arms if a not in evals]
    if missing:
        raise ValueError(f"metrics.jsonl has no evaluation rows for the arms {missing}")
    grids = {(a, s): tuple(sorted(by_step)) for a in arms for s, by_step in evals[a].items()}
    steps = max(grids.values(), key=len)
    short = {f"{a}/seed {s}": list(g) for (a, s), g in grids.items() if g != steps}
    if short:
        raise ValueError(f"runs evaluated at different steps: {short} vs {list(steps)} "
                         "(every run of a study evaluates at the same steps)")
    if steps[0] != 0 or len(steps) < 2:
        raise ValueError(f"evaluation steps {list(steps)} must start at 0 (the SFT policy) "
                         "and hold at least one later step")
    out = {}
    for arm in arms:
        seeds = sorted(evals[arm])
        table = {key: np.array([[evals[arm][s][t][key] for t in steps] for s in seeds], float)
                 for key in ("gold", "kl", "rm_score")}
        for key, values in table.items():
            bad = [(seeds[i], steps[k]) for i, k in np.argwhere(~np.isfinite(values))]
            if bad:
                raise ValueError(f"arm {arm!r}: non-finite {key} at (seed, step) {bad}")
        out[arm] = dict(seeds=seeds, **table)
    return np.array(steps), out


def _per_seed(curves, steps, beta) -> dict:
    """metric (ARM_METRICS) -> per-seed values `[seeds]` of one arm."""
    gold, kl = curves["gold"], curves["kl"]
    return {"final_gold": gold[:, -1], "kl": kl[:, -1], "J": gold[:, -1] - beta * kl[:, -1],
            "rm_score": curves["rm_score"][:, -1], "auc_gold": st.trapezoid_mean(steps, gold),
            "gain_over_sft": gold[:, -1] - gold[:, 0]}


def _gold_of(curves, seeds) -> np.ndarray:
    """The gold curves `[len(seeds), K]` of one arm's `seeds`, in that order."""
    return curves["gold"][[curves["seeds"].index(s) for s in seeds]]


# ---- the report ----------------------------------------------------------------------------------
def compute_report(rows, *, beta=None, smoothing: int = 1, baseline=None, arms=None,
                   controls=None, macro_arms=None, resamples: int = st.RESAMPLES,
                   rng_seed: int = st.RNG_SEED) -> dict:
    """The report dict from metrics rows (`DEFINITIONS` defines every number). The plan row
    decides arms, baseline, beta, controls and macro arms; the arguments are its fallbacks."""
    plan = study_plan(rows, beta=beta, baseline=baseline, arms=arms, controls=controls,
                      macro_arms=macro_arms)
    arms, base, beta = plan["arms"], plan["baseline"], plan["beta"]
    steps, curves = _curves(rows, arms)
    boot = dict(resamples=resamples, rng_seed=rng_seed)
    values = {a: {m: dict(zip(curves[a]["seeds"], v.tolist()))
                  for m, v in _per_seed(curves[a], steps, beta).items()}
              for a in arms}  # arm -> metric -> seed -> value

    def paired(arm, versus, metric):
        a, b = values[arm][metric], values[versus][metric]
        seeds = sorted(set(a) & set(b))
        if not seeds:
            raise ValueError(f"arms {arm!r} and {versus!r} share no seed")
        d = [a[s] - b[s] for s in seeds]
        out = {"arm": arm, "versus": versus, "metric": metric, "seeds": seeds, "differences": d,
               **st.interval(d, **boot)}
        out["direction"] = st.direction(out["ci"])
        out["verdict"] = {1: "higher", -1: "lower", 0: "not distinguishable"}[out["direction"]]
        return out

    finals = defaultdict(dict)
    for r in rows:
        if r.get("stage") == "final" and "gold_per_prompt" in r:
            finals[r["arm"]][int(r["seed"])] = np.asarray(r["gold_per_prompt"], float)

    report_arms = {}
    for arm in arms:
        c = curves[arm]
        entry = {"seeds": c["seeds"], "final_step": int(steps[-1])}
        for metric in ARM_METRICS:
            per_seed = values[arm][metric]
            entry[metric] = {**st.interval(list(per_seed.values()), **boot),
                             "per_seed": {str(s): v for s, v in per_seed.items()}}
        common = sorted(set(c["seeds"]) & set(curves[base]["seeds"]))
        for name, fraction in FRACTIONS.items():
            entry[name] = st.steps_to_fraction(
                steps, _gold_of(curves[arm], common), _gold_of(curves[base], common), fraction,
                smoothing=smoothing, **boot)
        noise = {s: _drop_noise(finals, arm, s) for s in c["seeds"]}
        rules = {s: st.hacking_rules(c["gold"][i], c["rm_score"][i], noise=noise[s])
                 for i, s in enumerate(c["seeds"])}
        flagged = [s for s, r in rules.items() if r]
        entry["reward_hacking"] = {"seeds": flagged, "count": len(flagged),
                                   "n": len(c["seeds"]),
                                   "rules": {str(s): r for s, r in rules.items() if r},
                                   "noise": {str(s): v for s, v in noise.items()}}
        entry["win_rate_vs_baseline"] = _win_rate(finals.get(arm, {}), finals.get(base, {}))
        if arm in plan.get("runs", {}):
            entry["ppo"] = plan["runs"][arm]
        report_arms[arm] = entry

    comparisons = {}
    for arm in arms:
        if arm == base:
            continue
        control = plan["controls"].get(arm)
        comparisons[arm] = {
            "macro": arm in plan["macro_arms"], "control": control,
            "versus_ppo": {m: paired(arm, base, m) for m in METRICS},
            "versus_control": ({m: paired(arm, control, m) for m in METRICS}
                               if control else None)}
    report = {
        "plan": plan, "arms": report_arms, "comparisons": comparisons, "beta": beta,
        "baseline": base, "smoothing": int(smoothing), "steps": [int(s) for s in steps],
        "seeds": sorted({s for a in arms for s in curves[a]["seeds"]}),
        "bootstrap": {"method": "percentile", "level": st.LEVEL, **boot},
        "sft_gold": float(curves[base]["gold"][:, 0].mean()),
        "ppo_gain": report_arms[base]["gain_over_sft"],
        "definitions": DEFINITIONS,
    }
    if SFT_ARM in finals:
        report["versus_sft"] = {arm: _paired_prompts(finals[arm], finals[SFT_ARM])
                                for arm in arms if arm in finals}
    report["resolution"] = _resolution(report)
    report["verdict"] = verdict_lines(report)
    report["claims"] = claims(report)
    if budget_lib.has_budget(rows):
        report["budget"] = budget_lib.compute_budget(rows, arms, base, **boot)
    return report


def _compares_estimators(report) -> bool:
    return any(run.get("estimator", "gae") != "gae"
               for run in report["plan"].get("runs", {}).values())


def _resolution(report) -> dict:
    """PPO's gain against the paired final-gold half-widths of the macro arms (vs the baseline
    and vs their controls). The target ratio is taken over the arms that do not hack the reward
    model (flagged in at least half of their seeds): a hacking arm's spread is a finding, not
    the resolution of the study; its half-widths are still listed."""
    halves, hacking = {}, []
    for arm, c in report["comparisons"].items():
        if not c["macro"]:
            continue
        h = report["arms"][arm]["reward_hacking"]
        if 2 * h["count"] >= h["n"] and h["count"]:
            hacking.append(arm)
        for key in ("versus_ppo", "versus_control"):
            if c[key] and c[key]["final_gold"]["ci"]:
                lo, hi = c[key]["final_gold"]["ci"]
                halves[f"{arm} vs {c[key]['final_gold']['versus']}"] = (hi - lo) / 2
    gain = report["ppo_gain"]["mean"]
    target = {k: v for k, v in halves.items() if k.split(" vs ")[0] not in hacking}
    widest = max(target.values()) if target else None
    widest_all = max(halves.values()) if halves else None
    return {"ppo_gain": gain, "ppo_gain_ci": report["ppo_gain"]["ci"], "half_widths": halves,
            "hacking_arms": hacking, "target_half_widths": target, "max_half_width": widest,
            "gain_over_max_half_width": gain / widest if widest else None,
            "gain_over_max_half_width_all": gain / widest_all if widest_all else None}


def _paired_prompts(arm_finals, sft_finals):
    """Final gold minus the SFT policy's per (seed, held-out prompt), summarised with the seed
    as the replicate (`study_stats.paired_mean_by_seed`)."""
    return st.paired_mean_by_seed({s: arm_finals[s] - sft_finals[s] for s in arm_finals
                                   if s in sft_finals
                                   and len(sft_finals[s]) == len(arm_finals[s])})


def _drop_noise(finals, arm, seed):
    """The noise of run (arm, seed)'s gold change since the SFT policy (`study_stats.drop_noise`
    of the per-prompt final rows), None without both rows."""
    final, sft = finals.get(arm, {}).get(seed), finals.get(SFT_ARM, {}).get(seed)
    return None if final is None or sft is None else st.drop_noise(final, sft)


def _win_rate(arm_finals, base_finals):
    wins = []
    for seed, a in arm_finals.items():
        b = base_finals.get(seed)
        if b is not None:
            wins.append(np.where(np.abs(a - b) <= TIE, 0.5, (a > b).astype(float)))
    return float(np.concatenate(wins).mean()) if wins else None


def paired_comparisons(report):
    """(arm, versus key, metric, comparison) for every paired comparison of the report, once
    (an arm whose control is the baseline is compared with it once)."""
    for arm, c in report["comparisons"].items():
        for key in ("versus_ppo", "versus_control"):
            if key == "versus_control" and c["control"] == report["baseline"]:
                continue
            for metric, cmp in (c[key] or {}).items():
                yield arm, key, metric, cmp


def claims(report: dict, metrics=METRICS) -> list[dict]:
    """Every paired comparison of `metrics` whose bootstrap interval excludes 0, as
    {"arm", "versus", "metric", "direction"} (1: arm higher, -1: lower)."""
    return [{"arm": arm, "versus": cmp["versus"], "metric": metric,
             "direction": cmp["direction"]}
            for arm, _, metric, cmp in paired_comparisons(report)
            if metric in metrics and cmp["direction"] != 0]


def verdict_line(cmp: dict) -> str:
    """"ma_ppo vs ppo, final gold: +0.012, 95% CI [-0.010, +0.035]: not distinguishable"."""
    head = (f"{cmp['arm']} vs {cmp['versus']}, {METRIC_WORDS[cmp['metric']]}: "
            f"{_number(cmp['mean'], '{:+.3f}')}")
    if cmp["ci"] is None:
        return f"{head}, no interval ({cmp['n']} common seed): not distinguishable"
    return f"{head}, 95% CI {_pair(cmp['ci'])}: {cmp['verdict']}"


def verdict_lines(report: dict) -> list[str]:
    return [verdict_line(cmp) for *_, cmp in paired_comparisons(report)]


# ---- text ----------------------------------------------------------------------------------------
def _number(x, fmt) -> str:
    text = fmt.format(x)
    # A difference that rounds to zero reads as zero, whatever the sign of its round-off.
    return fmt.format(0.0) if text.lstrip("+-").strip("0.") == "" else text


def _pair(ci, fmt="{:+.3f}"):
    return f"[{_number(ci[0], fmt)}, {_number(ci[1], fmt)}]"


def format_interval(e: dict, fmt: str = "{:.3f}") -> str:
    """"0.673 [0.650, 0.700]" (the mean alone when there is no interval)."""
    mean = _number(e["mean"], fmt)
    return mean if e["ci"] is None else f"{mean} {_pair(e['ci'], fmt)}"


def format_difference(cmp: dict) -> str:
    return format_interval(cmp, "{:+.3f}")


def format_steps(entry, last_step: int) -> str:
    """"25 [20, 35]", "25 [20, >60]"; "n/a" when undefined (the baseline gained nothing)."""
    if entry is None:
        return "n/a"
    show = lambda s: f">{last_step}" if s is None else str(s)
    return f"{show(entry['step'])} [{show(entry['ci'][0])}, {show(entry['ci'][1])}]"


def format_seeds(seeds) -> str:
    """"0-7" for a run of consecutive seeds, else "907, 911, 919"."""
    seeds = sorted(int(s) for s in seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _hacking(entry) -> str:
    h = entry["reward_hacking"]
    return f"hacks RM in {h['count']}/{h['n']} seeds" if h["count"] else "no"


def arm_table(report: dict) -> list[str]:
    """The per-arm markdown table: means over seeds with 95% bootstrap intervals."""
    last = report["steps"][-1]
    lines = ["| arm | gold | RM score | KL (nats) | J = gold - beta KL | mean gold over "
             "training | steps to 50% | steps to 90% | reward hacking |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, e in report["arms"].items():
        lines.append(
            f"| `{arm}` | {format_interval(e['final_gold'])} | {format_interval(e['rm_score'])} "
            f"| {format_interval(e['kl'], '{:.2f}')} | {format_interval(e['J'])} | "
            f"{format_interval(e['auc_gold'])} | {format_steps(e['steps_to_50'], last)} | "
            f"{format_steps(e['steps_to_90'], last)} | {_hacking(e)} |")
    return lines


def comparison_table(report: dict) -> list[str]:
    """Paired differences arm - versus (mean over seeds, 95% bootstrap interval)."""
    lines = ["| arm | versus | " + " | ".join(METRIC_WORDS[m] for m in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for arm, c in report["comparisons"].items():
        for key in ("versus_ppo", "versus_control"):
            if c[key] and not (key == "versus_control" and c["control"] == report["baseline"]):
                versus = c[key][METRICS[0]]["versus"]
                role = " (control)" if key == "versus_control" else ""
                lines.append(f"| `{arm}` | `{versus}`{role} | " + " | ".join(
                    format_difference(c[key][m]) for m in METRICS) + " |")
    return lines


def resolution_line(report: dict) -> str:
    r = report["resolution"]
    gain = f"{report['baseline']}'s gold gain over SFT: {format_interval(report['ppo_gain'])}"
    if r["max_half_width"] is None:
        return gain + " (no macro-arm comparison with an interval)."
    target = r.get("target_half_widths", r["half_widths"])
    widest = max(target, key=target.get)
    ratio = r["gain_over_max_half_width"]
    ratio = "unbounded (zero width)" if ratio is None else f"{ratio:.1f}"
    line = (f"{gain}; the widest paired half-width of final gold ({widest}): "
            f"{r['max_half_width']:.3f}; gain / half-width = {ratio} (target: >= 5)")
    if r.get("hacking_arms"):
        line += (f"; not counted: {', '.join(r['hacking_arms'])}, which hack the reward model "
                 f"(gain / their widest half-width = {r['gain_over_max_half_width_all']:.1f})")
    return line + "."


def markdown(report: dict) -> str:
    b = report["bootstrap"]
    lines = [
        "# MA-PPO vs PPO: report", "",
        f"Seeds {format_seeds(report['seeds'])}; instruction set {isa_label(report)}; "
        f"evaluation steps {report['steps'][0]}.."
        f"{report['steps'][-1]}; beta = {report['beta']} in J for every arm; SFT gold = "
        f"{report['sft_gold']:.3f}. Means over seeds with 95% {b['method']} bootstrap intervals "
        f"over seeds ({b['resamples']} resamples, rng seed {b['rng_seed']}).", "",
        resolution_line(report), "",
    ]
    lines += arm_table(report)
    lines += ["", "## Paired differences (same seed, same prompts)", ""]
    lines += comparison_table(report)
    missing = [a for a, c in report["comparisons"].items() if c["macro"] and not c["control"]]
    if missing:
        lines += ["", f"No matched control in this run for: {', '.join(missing)}."]
    if report.get("versus_sft"):
        lines += ["", "## Against the SFT policy (paired per held-out prompt)", "",
                  "| arm | final gold - SFT gold | SE | mean / SE | SE over | prompts x seeds |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for arm, v in report["versus_sft"].items():
            if v is not None:
                z = "-" if v["z"] is None else f"{v['z']:+.2f}"
                over = f"{v['seeds']} seeds" if v["se_over"] == "seeds" else "prompts (1 seed)"
                lines.append(f"| `{arm}` | {v['mean']:+.4f} | {v['se']:.4f} | {z} | {over} "
                             f"| {v['n']} |")
    lines += ["", "## Verdict", ""]
    lines += [f"- {v}" for v in report["verdict"]] or ["- (no arm besides the baseline)"]
    lines += ["", "![curves](curves.png)", "", "![RM scores](rm_hist.png)", ""]
    if "budget" in report and _compares_estimators(report):
        lines += ["## Gold per generated token", ""]
        lines += budget_lib.markdown_lines(report["budget"])
        lines += ["", "![gold against generated tokens and time](budget.png)", ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in report["definitions"].items()]
    if "budget" in report:
        lines += [f"- **{k}**: {v}" for k, v in report["budget"]["definitions"].items()]
    return "\n".join(lines) + "\n"


def summary_text(report: dict) -> str:
    last = report["steps"][-1]
    out = [f"{'arm':<20}{'gold':>24}{'J':>24}{'RM score':>24}{'to 50%':>18}{'to 90%':>18}"]
    for arm, e in report["arms"].items():
        out.append(f"{arm:<20}{format_interval(e['final_gold']):>24}"
                   f"{format_interval(e['J']):>24}{format_interval(e['rm_score']):>24}"
                   f"{format_steps(e['steps_to_50'], last):>18}"
                   f"{format_steps(e['steps_to_90'], last):>18}"
                   + (f"  {_hacking(e)}" if e["reward_hacking"]["count"] else ""))
    out += ["", resolution_line(report), ""] + report["verdict"]
    if "budget" in report and _compares_estimators(report):
        out += [""] + budget_lib.markdown_lines(report["budget"])
    return "\n".join(out)


def starting_point(rows) -> dict:
    """The evaluation of a run with no PPO step (`ppo.steps=0`): the starting (SFT) policy on
    each seed's held-out prompts, from the `final` rows of arm `sft`. Returns {"seeds": {seed:
    {"gold", "rm_score", "kl", "n"}} (means over the seed's prompts), "gold": the mean over every
    (seed, prompt) pair with its bootstrap and t intervals over them (`study_stats.interval`)};
    ValueError where no such row exists."""
    finals = {int(r["seed"]): r for r in rows
              if r.get("stage") == "final" and r.get("arm") == SFT_ARM}
    if not finals:
        raise ValueError("metrics.jsonl has no final row of the starting policy (arm 'sft')")
    if any("gold_per_prompt" not in r for r in finals.values()):
        raise ValueError("the starting policy's final rows have no gold_per_prompt (a task "
                         "without a gold reward)")
    seeds = {str(s): {"gold": float(np.mean(r["gold_per_prompt"])),
                      "rm_score": float(np.mean(r["rm_score_per_prompt"])),
                      "kl": float(np.mean(r["kl_per_prompt"])), "n": len(r["gold_per_prompt"])}
             for s, r in sorted(finals.items())}
    pooled = np.concatenate([r["gold_per_prompt"] for _, r in sorted(finals.items())])
    return {"steps": 0, "seeds": seeds, "gold": st.interval(pooled)}


def starting_point_text(summary: dict) -> str:
    """Two lines: the pooled gold with its interval, and each seed's."""
    g = summary["gold"]
    per_seed = ", ".join(f"seed {s}: {v['gold']:.3f} ({v['n']} prompts)"
                         for s, v in summary["seeds"].items())
    return (f"ppo.steps=0: the starting policy's held-out gold {format_interval(g)} over "
            f"{g['n']} (seed, prompt) pairs\n{per_seed}")


# ---- files ---------------------------------------------------------------------------------------
def write_report(workdir: str, *, beta=None, smoothing: int = 1, baseline=None, arms=None,
                 controls=None, macro_arms=None) -> dict:
    """report.json, report.md, curves.png and rm_hist.png in `workdir`, from its metrics.jsonl
    alone; the arguments stand in for a missing plan row. Returns the report dict."""
    rows = read_metrics(workdir)
    if not any(r.get("stage") == "eval" for r in rows):
        raise ValueError(f"{os.path.join(workdir, 'metrics.jsonl')} has no evaluation rows")
    report = compute_report(rows, beta=beta, smoothing=smoothing, baseline=baseline, arms=arms,
                            controls=controls, macro_arms=macro_arms)
    _atomic_write(os.path.join(workdir, "report.json"),
                  json.dumps(report, indent=2, allow_nan=False))
    plot_curves(rows, report, os.path.join(workdir, "curves.png"))
    plot_rm_histogram(rows, report, os.path.join(workdir, "rm_hist.png"))
    if "budget" in report and _compares_estimators(report):
        budget_lib.plot(budget_lib.budget_curves(rows, list(report["arms"])),
                        os.path.join(workdir, "budget.png"), report["baseline"])
    _atomic_write(os.path.join(workdir, "report.md"), markdown(report))
    return report


def write_starting_point(workdir: str) -> dict:
    """step0.json in `workdir` (`starting_point` of its metrics.jsonl): what a run with no PPO
    step reports in place of report.json, which compares training curves."""
    summary = starting_point(read_metrics(workdir))
    _atomic_write(os.path.join(workdir, "step0.json"),
                  json.dumps(summary, indent=2, allow_nan=False))
    return summary


def _atomic_write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def plot_curves(rows, report, path):
    """Gold, J and RM score over PPO steps per arm: seed means with a 95% t band over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beta = report["beta"]
    steps, curves = _curves(rows, list(report["arms"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for arm, c in curves.items():
        panels = (c["gold"], c["gold"] - beta * c["kl"], c["rm_score"])
        n = len(c["seeds"])
        for ax, values in zip(axes, panels):
            mean = values.mean(axis=0)
            line, = ax.plot(steps, mean, label=arm)
            if n > 1:
                half = st.t_quantile(st.LEVEL, n - 1) * values.std(axis=0, ddof=1) / np.sqrt(n)
                ax.fill_between(steps, mean - half, mean + half, color=line.get_color(),
                                alpha=0.15)
    axes[0].set_title("gold reward (held-out prompts)")
    axes[1].set_title(f"J = gold - {beta} x KL")
    axes[2].set_title("reward-model score")
    for ax in axes:
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"mean over seeds {format_seeds(report['seeds'])}, band: 95% t interval",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rm_histogram(rows, report, path):
    from marl_jax.eval.scores import plot_score_histogram

    scores = defaultdict(list)
    for r in rows:
        if r.get("stage") == "final" and r.get("arm") in report["arms"]:
            scores[r["arm"]] += list(r["rm_score_per_prompt"])
    if scores:
        plot_score_histogram({k: np.asarray(v) for k, v in scores.items()}, path)


def write_combined(workdir: str, reports: dict) -> None:
    """report.json / report.md gathering several experiments (e.g. one per horizon)."""
    _atomic_write(os.path.join(workdir, "report.json"),
                  json.dumps(reports, indent=2, allow_nan=False))
    parts = ["# Experiments", ""]
    for name, report in reports.items():
        body = markdown(report).replace("](curves.png)", f"]({name}/curves.png)").replace(
            "](rm_hist.png)", f"]({name}/rm_hist.png)")
        parts += [f"## {name}", "", body.split("\n", 1)[1]]
    _atomic_write(os.path.join(workdir, "report.md"), "\n".join(parts))
