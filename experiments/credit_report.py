"""The advantage-quality study's page: every estimator's correlation with Monte Carlo ground
truth at the start, middle and end of training, on two or more seed sets.

    python experiments/credit_report.py runs/credit/seed_0,runs/credit/seed_1 \
        runs/credit/seed_2,runs/credit/seed_3 --page docs/credit.md [--marker credit-study]
        [--results docs/credit_results.json] [--plot docs/credit.png]

Each positional argument is one seed set: comma-separated workdirs of runs with the credit
probe on (`config.credit`, e.g. configs/credit_synthetic.py). Their probes' inputs
(`<workdir>/credit/step_<n>.npz`) at the same step are pooled and scored by
`marl_jax.credit.probe_scores.score_probe`, with a clustered bootstrap: the runs of a set probe the
same held-out prompts, so a prompt is one unit across the runs that probe it (its states of
every run resampled together, `prompt_clusters`). Beside each estimator's
Pearson correlation with A* is its paired difference from token GAE (the same bootstrap
resamples of prompts); a difference is stated on the page only where its interval excludes 0
with the same sign on every seed set, otherwise the two are "not distinguishable". The rules
are compared with each other the same way (`ranking`): a rule is "best" only where its paired
difference from each other rule lies above 0 on every seed set, else the page names each set's
highest point estimate and the rules not distinguishable from it. The results JSON holds every
paired difference (`pairs`) and the rankings. The runs of
a page must share one kind of probe: one truth (`credit.truth`; a probe without it was valued by
the run's reward) and single- or multi-turn responses; a mix is refused in one line naming them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from marl_jax.credit import estimator_scores, probe_scores  # noqa: E402
from marl_jax.eval import study_stats as st  # noqa: E402
from readme_results import markers, replace_section  # noqa: E402

PHASES = ("start", "middle", "end")


def probe_phases(n: int) -> list[tuple[str, int]]:
    """(phase, probe index) of a run with `n` >= 2 probes: the first, middle and last, or the
    first and last of two."""
    return list(zip(PHASES, (0, n // 2, n - 1))) if n >= 3 else [("start", 0), ("end", n - 1)]


def phases_of(results: list[dict]) -> list[str]:
    """The phases every seed set's result has, in order."""
    return [p for p in PHASES if all(p in r for r in results)]
BASELINE = "token_gae"
RESAMPLES = 1000


def probe_files(workdir: str) -> list[str]:
    """The probe inputs of a run, by step."""
    files = glob.glob(os.path.join(workdir, "credit", "step_*.npz"))
    if not files:
        raise SystemExit(f"error: {workdir} has no credit/step_*.npz (run with config.credit.every > 0)")
    return sorted(files, key=lambda f: int(os.path.basename(f)[5:-4]))


def probe_kind(inputs) -> str:
    """What a probe's A* values and over which responses, from its npz arrays `inputs`:
    "<truth> truth, single-turn" or "..., multi-turn" (a multi-turn probe saves
    `action_columns`; a probe without `truth` predates the gold truth: the run's reward)."""
    truth = str(inputs["truth"]) if "truth" in inputs else "reward"
    return f"{truth} truth, {'multi-turn' if 'action_columns' in inputs else 'single-turn'}"


def check_one_kind(paths: list[str]) -> None:
    """SystemExit with one line naming the runs of each kind unless the probes `paths` share
    their truth and single- or multi-turn responses (a pooled score would mix them)."""
    runs: dict[str, list[str]] = {}
    for path in paths:
        with np.load(path) as probe:  # reads the `truth` array only
            kind = probe_kind(probe)
        run = os.path.dirname(os.path.dirname(path)) or "."
        if run not in runs.setdefault(kind, []):
            runs[kind].append(run)
    if len(runs) > 1:
        raise SystemExit("error: probes of different kinds cannot be pooled or compared: " + "; ".join(
            f"{kind}: {', '.join(names)}" for kind, names in runs.items()))


def prompt_clusters(prompt_ids, prompt_mask) -> np.ndarray:
    """`[N]` int: one label per distinct prompt (its valid tokens) of the rows `[N, P]`,
    numbered in order of first appearance. Runs that probe the same held-out prompts give a
    prompt one label across them, so the bootstrap resamples it as one unit with all its runs'
    states; runs that share no prompt keep one label per run's prompt, numbered as the rows
    come."""
    labels: dict = {}
    return np.array([labels.setdefault(tuple(ids[mask != 0].tolist()), len(labels))
                     for ids, mask in zip(np.asarray(prompt_ids), np.asarray(prompt_mask))],
                    dtype=np.int64)


def pooled(paths: list[str]) -> tuple[dict, np.ndarray]:
    """The probes of several runs as one: rows stacked, state rows offset; (inputs, prompt of
    each response row, `prompt_clusters`: a prompt that several runs probe is one bootstrap
    unit). Probes of different truths, or single- and multi-turn ones, are refused
    (SystemExit, one line). An array some runs lack (a rule probed in some runs only: its
    segments and estimators) is left out, named on stderr."""
    check_one_kind(paths)
    # Each state's continuation returns are the recheck's (credit_revalue.py), not the report's.
    parts = [{k: v for k, v in np.load(p).items() if k != "state_returns"} for p in paths]
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    left_out = sorted(set().union(*parts) - set(keys))
    if left_out:
        print(f"note: {', '.join(left_out)} left out of the pooled probes: not in every one of "
              f"{', '.join(paths)}", file=sys.stderr)
    parts = [{k: p[k] for k in keys} for p in parts]
    out, offset = {}, 0
    widths = {k: max(p[k].shape[1] for p in parts) for k in keys
              if parts[0][k].ndim == 2 and k != "state_halves"}
    for p in parts:
        rows = p["response_ids"].shape[0]
        p["state_rows"] = p["state_rows"] + offset
        offset += rows
        for key, width in widths.items():
            pad = width - p[key].shape[1]
            if pad:
                p[key] = np.pad(p[key], ((0, 0), (0, pad)) if key != "prompt_ids" and key != "prompt_mask"
                                else ((0, 0), (pad, 0)))
    for key in parts[0]:
        if parts[0][key].ndim == 0:
            out[key] = parts[0][key]
        else:
            out[key] = np.concatenate([p[key] for p in parts])
    return out, prompt_clusters(out["prompt_ids"], out["prompt_mask"])


def pair_key(a: str, b: str) -> str:
    """The results' name of the paired difference Pearson(a) - Pearson(b)."""
    return f"{a} - {b}"


def rule_candidates(names) -> list[str]:
    """The token level's rules: macro GAE of every rule and weighting."""
    return [n for n in names if n.startswith("macro_gae/")]


def level_pairs(level: str, names) -> list[tuple[str, str]]:
    """The paired differences a level's result holds: at the token level every estimator
    against token GAE and every pair of rules; at a macro level every pair of its estimators
    (the same macros' states)."""
    if level == "token":
        rules = rule_candidates(names)
        return ([(n, BASELINE) for n in names if n != BASELINE]
                + [(a, b) for i, a in enumerate(rules) for b in rules[i + 1:]])
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def seed_set_result(workdirs: list[str]) -> dict:
    """{phase: {"step", "scores", "ceilings", "pairs": {level: {pair_key: {"value", "ci"}}},
    "vs_token_gae": {name: the token level's pair (name, token GAE)}}}: every difference from
    the same bootstrap resamples as the scores (`estimator_scores.paired_differences`)."""
    runs = [probe_files(w) for w in workdirs]
    counts = {len(r) for r in runs}
    if len(counts) != 1 or counts.pop() < 2:
        raise SystemExit(f"error: the runs of a seed set need the same number (>= 2) of probes: {workdirs}")
    out = {}
    n = len(runs[0])
    for phase, i in probe_phases(n):
        inputs, prompts = pooled([r[i] for r in runs])
        scores, ceilings = probe_scores.score_probe(inputs, prompts, resamples=RESAMPLES)
        pairs = {}
        for level, states in probe_scores.level_states(inputs, prompts).items():
            names = probe_scores.level_estimators(inputs, level)
            differences = estimator_scores.paired_differences(
                probe_scores.level_advantages(inputs, states, names), states.truth, states.prompts,
                level_pairs(level, names), resamples=RESAMPLES)
            pairs[level] = {pair_key(a, b): d for (a, b), d in differences.items()}
        out[phase] = {"step": int(inputs["step"]), "scores": scores, "ceilings": ceilings,
                      "pairs": pairs,
                      "vs_token_gae": {n: pairs["token"][pair_key(n, BASELINE)]
                                       for n in scores["token"] if n != BASELINE}}
    return out


def difference(entry: dict, level: str, a: str, b: str) -> dict | None:
    """The paired difference Pearson(a) - Pearson(b) at `level` of one phase's result (the
    stored pair or its negation), or None where the result holds neither order."""
    pairs = entry["pairs"].get(level, {})
    if pair_key(a, b) in pairs:
        return pairs[pair_key(a, b)]
    d = pairs.get(pair_key(b, a))
    if d is None:
        return None
    return {"value": None if d["value"] is None else -d["value"],
            "ci": None if d["ci"] is None else [-d["ci"][1], -d["ci"][0]]}


def lies_above(entry: dict, level: str, a: str, b: str) -> bool:
    """Whether the paired difference Pearson(a) - Pearson(b) at `level` lies above 0."""
    return st.direction((difference(entry, level, a, b) or {}).get("ci")) == 1


def ranking(results: list[dict], phase: str, level: str, candidates) -> dict:
    """Which of `candidates` (estimators of one level) correlates best with A* at a phase, by
    paired differences on every seed set: {"best": the candidate whose difference from each
    other candidate lies above 0 on every set, or None; "leaders": each set's highest point
    estimate; "not_distinguishable": per set, the candidates whose difference from that set's
    leader does not lie above 0}."""
    leaders, tied = [], []
    for result in results:
        entry = result[phase]
        points = {n: entry["scores"][level][n]["pearson"]["value"] for n in candidates}
        defined = [n for n in candidates if points[n] is not None]
        leader = max(defined, key=lambda n: points[n]) if defined else None
        leaders.append(leader)
        tied.append([n for n in candidates if n != leader
                     and (leader is None or not lies_above(entry, level, leader, n))])
    same = len(set(leaders)) == 1 and leaders[0] is not None
    best = leaders[0] if same and not any(tied) else None
    return {"best": best, "leaders": leaders, "not_distinguishable": tied}


def ranking_line(rank: dict) -> str:
    """The ranking as the page states it: "best: X (above each other ...)" only where X beats
    every other candidate on every set, else "highest point estimate: X (set 1), ...; not
    distinguishable from ..."."""
    if rank["best"] is not None:
        return (f"best: {rank['best']} (its paired difference from each other one lies above 0 "
                "on every seed set)")
    sets = [f"{leader} (set {i + 1}; not distinguishable from "
            + (", ".join(tied) if tied else "none") + ")"
            for i, (leader, tied) in enumerate(zip(rank["leaders"], rank["not_distinguishable"]))]
    return "highest point estimate: " + "; ".join(sets)


def common_to_all(results: list[dict]) -> list[dict]:
    """`results` with only the levels and estimators that every seed set scored at every phase
    (a rule probed on some sets only is left out of the page, named on stderr)."""
    entries = [r[phase] for r in results for phase in phases_of(results)]
    levels = set.intersection(*(set(e["scores"]) for e in entries))
    names = {level: set.intersection(*(set(e["scores"][level]) for e in entries))
             for level in levels}
    left_out = sorted({f"{level}: {name}" for e in entries for level in e["scores"]
                       for name in e["scores"][level] if name not in names.get(level, ())})
    if left_out:
        print(f"note: not scored on every seed set and phase, left out: {'; '.join(left_out)}",
              file=sys.stderr)
    for e in entries:
        e["scores"] = {level: {n: s for n, s in by_name.items() if n in names[level]}
                       for level, by_name in e["scores"].items() if level in levels}
        e["ceilings"] = {level: c for level, c in e["ceilings"].items() if level in levels}
        e["vs_token_gae"] = {n: d for n, d in e["vs_token_gae"].items() if n in names["token"]}
        e["pairs"] = {level: {key: d for key, d in by_pair.items()
                              if set(key.split(" - ")) <= names[level]}
                      for level, by_pair in e["pairs"].items() if level in levels}
    return results


def rankings(results: list[dict]) -> dict:
    """{level: {phase: `ranking`}}: the token level's rules (macro GAE of every rule and
    weighting) and each macro level's estimators, where a level has two or more."""
    out = {}
    for level, by_name in results[0]["start"]["scores"].items():
        names = list(by_name)
        candidates = rule_candidates(names) if level == "token" else names
        if len(candidates) >= 2:
            out[level] = {phase: ranking(results, phase, level, candidates)
                          for phase in phases_of(results)}
    return out


def _cell(entry: dict) -> str:
    """"value [lo, hi]"; "undefined" where the estimator is constant over the pooled probes
    (a correlation without a value or an interval)."""
    if entry.get("ci") is None or not np.isfinite(entry["value"]):
        return "undefined"
    lo, hi = entry["ci"]
    return f"{entry['value']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def _interval(entry: dict) -> tuple[float, float]:
    return tuple(entry["ci"]) if entry.get("ci") is not None else (np.nan, np.nan)


def stated_differences(results: list[dict]) -> dict:
    """(phase, name) -> +1 / -1 where the difference from token GAE excludes 0 with the same
    sign on every seed set; absent otherwise (not distinguishable)."""
    out = {}
    for phase in phases_of(results):
        for name in results[0][phase]["vs_token_gae"]:
            signs = {st.direction(r[phase]["vs_token_gae"][name]["ci"]) for r in results}
            if len(signs) == 1 and 0 not in signs:
                out[(phase, name)] = signs.pop()
    return out


def section(sets: list[list[str]], results: list[dict], command: str, plot_link: str) -> str:
    stated = stated_differences(results)
    phases = phases_of(results)
    names = list(results[0]["start"]["scores"]["token"])
    lines = [f"Generated by `{command}` from {len(sets)} seed sets "
             + "; ".join(f"set {i + 1}: " + ", ".join(f"`{w}`" for w in s) for i, s in enumerate(sets))
             + f". Intervals: {int(st.LEVEL * 100)}% bootstrap over prompts ({RESAMPLES} resamples; "
             "a prompt that several runs probe is one unit with all their states).", ""]
    for i, result in enumerate(results):
        steps = ", ".join(f"{p} = step {result[p]['step']}" for p in phases)
        lines += [f"**Seed set {i + 1}** ({steps}): Pearson correlation of each estimator's "
                  "per-token advantage with A*_t over every response token.", "",
                  "| estimator | " + " | ".join(phases) + " |",
                  "|---|" + "---|" * len(phases)]
        lines.append("| noise ceiling (truth) | " + " | ".join(
            _cell(result[p]["ceilings"]["token"]["ceiling"]) for p in phases) + " |")
        for name in names:
            lines.append(f"| {name} | " + " | ".join(
                _cell(result[p]["scores"]["token"][name]["pearson"]) for p in phases) + " |")
        lines.append("")
        lines += ["Each rule's macro estimators against its macros' A* (advantage at a macro's "
                  "first token against the sum of its rewards plus V at its end minus V at its "
                  "start):", "", "| rule | estimator | " + " | ".join(phases) + " |",
                  "|---|---|" + "---|" * len(phases)]
        for level in (k for k in result["start"]["scores"] if k.startswith("macro/")):
            rule = level.split("/", 1)[1]
            lines.append(f"| {rule} | noise ceiling | " + " | ".join(
                _cell(result[p]["ceilings"][level]["ceiling"]) for p in phases) + " |")
            for name in result["start"]["scores"][level]:
                lines.append(f"| {rule} | {name} | " + " | ".join(
                    _cell(result[p]["scores"][level][name]["pearson"]) for p in phases) + " |")
        lines.append("")
    lines += ["Differences from token GAE's correlation that hold on every seed set (paired "
              "bootstrap; all others are not distinguishable):", ""]
    held = [f"- {name} at the {phase}: {'higher' if sign > 0 else 'lower'} ("
            + ", ".join(_cell(r[phase]["vs_token_gae"][name]) for r in results) + ")"
            for (phase, name), sign in sorted(stated.items(),
                                              key=lambda kv: (phases.index(kv[0][0]), kv[0][1]))]
    lines += held or ["- none: every estimator is not distinguishable from token GAE."]
    ranked = rankings(results)
    if "token" in ranked:
        lines += ["", "Which rule's macro GAE (every rule and weighting) correlates best with A*_t, "
                  "by paired differences between the rules on every seed set:", ""]
        lines += [f"- {phase}: {ranking_line(rank)}" for phase, rank in ranked["token"].items()]
    macro_levels = [level for level in ranked if level != "token"]
    if macro_levels:
        lines += ["", "Each rule's estimators against its own macros' A* (paired differences on "
                  "the same macros; the rules' macros are other states, so rules are not "
                  "compared here):", ""]
        lines += [f"- {level.split('/', 1)[1]} at the {phase}: {ranking_line(rank)}"
                  for level in macro_levels for phase, rank in ranked[level].items()]
    lines += ["", f"![correlation with A* by estimator and phase]({plot_link})", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["start"]["scores"]["token"])
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 0.32 * len(names) + 1.5),
                             sharey=True, squeeze=False)
    phases = phases_of(results)
    for ax, result, i in zip(axes[0], results, range(len(results))):
        for j, phase in enumerate(phases):
            y = np.arange(len(names)) + (j - (len(phases) - 1) / 2) * 0.25
            entries = [result[phase]["scores"]["token"][n]["pearson"] for n in names]
            x = np.array([e["value"] for e in entries])
            err = np.nan_to_num(np.array([[e["value"] - _interval(e)[0], _interval(e)[1] - e["value"]]
                                          for e in entries], dtype=float).T)
            ax.errorbar(x, y, xerr=err, fmt="o", ms=3, label=f"{phase} (step {result[phase]['step']})")
            ceiling = result[phase]["ceilings"]["token"]["ceiling"]["value"]
            ax.axvline(ceiling, color=f"C{j}", ls=":", lw=1)
        ax.set_yticks(np.arange(len(names)), names, fontsize=8)
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel("Pearson correlation with A* (dotted: noise ceiling)")
        ax.set_title(f"seed set {i + 1}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="credit_report.py", description=__doc__.splitlines()[0])
    parser.add_argument("sets", nargs="+", help="seed sets: comma-separated workdirs each")
    parser.add_argument("--page", default="docs/credit.md")
    parser.add_argument("--marker", default="credit-study")
    parser.add_argument("--results", default="docs/credit_results.json")
    parser.add_argument("--plot", default="docs/credit.png")
    parser.add_argument("--command", default="python experiments/credit_report.py ...")
    args = parser.parse_args(argv)
    sets = [s.split(",") for s in args.sets]
    # One page compares its seed sets: their runs too must share one kind of probe.
    check_one_kind([probe_files(w)[0] for s in sets for w in s])
    results = common_to_all([seed_set_result(s) for s in sets])
    with open(args.results, "w") as f:
        json.dump({"sets": sets, "results": results, "rankings": rankings(results)}, f, indent=1)
    plot(results, args.plot)
    page = open(args.page).read()
    link = os.path.relpath(args.plot, os.path.dirname(args.page) or ".")
    text = section(sets, results, args.command, link)
    with open(args.page, "w") as f:
        f.write(replace_section(page, text, args.page, *markers(args.marker)))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
