"""Writes a study's results section of a page and its JSON from the reports of experiment runs.

    python experiments/readme_results.py RUN_DIR [CONFIRM_DIR ...] [--readme README.md]
        [--results docs/results.json] [--curves docs/synthetic_curves.png] [--command CMD]
        [--marker results] [--paired]

RUN_DIR and every CONFIRM_DIR hold the report.json of one run of the same experiment command
(`--command`, as the section shows it) on different seeds. A claim is a paired difference
between two arms whose 95% bootstrap interval over seeds excludes 0 (`marl_jax.eval.report.claims`);
only the claims every given run makes, in the same direction, are kept. They go to the JSON
(`--results`, with every run's key numbers), and the section of the page (`--readme`) between
the lines `<!-- MARKER:start -->` and `<!-- MARKER:end -->` (`--marker`, default `results`: the
synthetic study in the README; `real-text-study`: the real-text study) is replaced by: the
command and seeds of each run, RUN_DIR's per-arm table, with `--paired` each run's table of
paired differences (every arm against the baseline and every macro arm against its matched
control), the resolution of each run (PPO's gain against the widest paired interval), RUN_DIR's
curves, one sentence per kept claim, and for every macro arm against token PPO and against its
matched control each difference that was not distinguishable or not replicated. Nothing else
in the page changes.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from marl_jax.eval import report as report_lib  # noqa: E402

MARKER = "results"


def markers(name: str = MARKER) -> tuple[str, str]:
    """The lines that delimit a generated section: `<!-- name:start -->`, `<!-- name:end -->`."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def load_report(run_dir: str) -> dict:
    path = os.path.join(run_dir, "report.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: run the experiment into {run_dir} "
                                "first")
    with open(path) as f:
        report = json.load(f)
    if "comparisons" not in report or "seeds" not in report:
        raise ValueError(f"{path} is not the report of one experiment with paired comparisons "
                         "(a combined report of several horizons? pass one horizon_<n> folder)")
    return report


def _key(claim) -> tuple:
    return claim["arm"], claim["versus"], claim["metric"], claim["direction"]


def replicated_claims(reports) -> list[dict]:
    """The claims of the first report that every other report makes too (same arm, versus,
    metric and direction), in the first report's order."""
    kept = report_lib.claims(reports[0])
    for other in reports[1:]:
        theirs = {_key(c) for c in report_lib.claims(other)}
        kept = [c for c in kept if _key(c) in theirs]
    return kept


def comparison(report: dict, arm: str, versus: str, metric: str) -> dict | None:
    """The paired comparison arm - versus of `metric` in a report, None if it was not made."""
    c = report["comparisons"].get(arm)
    for key in ("versus_ppo", "versus_control"):
        if c and c[key] and c[key][metric]["versus"] == versus:
            return c[key][metric]
    return None


def _across_runs(runs, arm, versus, metric) -> str:
    parts = []
    for _, report in runs:
        cmp = comparison(report, arm, versus, metric)
        seeds = report_lib.format_seeds(report["seeds"])
        parts.append(f"not run on seeds {seeds}" if cmp is None
                     else f"{report_lib.format_difference(cmp)} on seeds {seeds}")
    return ", ".join(parts)


def _versus(report, arm, versus) -> str:
    c = report["comparisons"].get(arm) or {}
    return f"`{versus}` (its matched control)" if c.get("control") == versus else f"`{versus}`"


def claim_sentence(runs, claim) -> str:
    """"ma_ppo has lower J than ppo: -0.41 [-0.55, -0.30] on seeds 0-7, ... on seeds 100-107"."""
    arm, versus, metric = claim["arm"], claim["versus"], claim["metric"]
    word = "higher" if claim["direction"] > 0 else "lower"
    return (f"`{arm}` has {word} {report_lib.METRIC_WORDS[metric]} than "
            f"{_versus(runs[0][1], arm, versus)}: {_across_runs(runs, arm, versus, metric)}.")


def open_lines(runs, claims) -> list[str]:
    """For every macro arm of the first run against the baseline and against its control, each
    metric without a kept claim: "not distinguishable" when no run separates the two, else "no
    difference that holds on every run"."""
    claimed = {c[:3] for c in map(_key, claims)}
    lines = []
    for arm, c in runs[0][1]["comparisons"].items():
        if not c["macro"]:
            continue
        for versus in (runs[0][1]["baseline"], c["control"]):
            for metric in report_lib.METRICS:
                if versus is None or (arm, versus, metric) in claimed:
                    continue
                made = [comparison(r, arm, versus, metric) for _, r in runs]
                word = ("not distinguishable" if all(m and m["direction"] == 0 for m in made)
                        else "no difference that holds on every run")
                lines.append(f"`{arm}` vs {_versus(runs[0][1], arm, versus)}, "
                             f"{report_lib.METRIC_WORDS[metric]}: {word}: "
                             f"{_across_runs(runs, arm, versus, metric)}.")
    return lines


def results_section(runs, claims, *, command: str, curves_link: str,
                    generated_by: str, paired: bool = False) -> str:
    """The generated section (without its marker lines). runs: [(dir, report)], the first one's
    table and curves shown; with `paired`, every run's paired-difference table too."""
    (first_dir, first), confirm = runs[0], runs[1:]
    where = f"`{command}` on seeds {report_lib.format_seeds(first['seeds'])} (`{first_dir}`)"
    if confirm:
        where += ", repeated on " + ", ".join(
            f"seeds {report_lib.format_seeds(r['seeds'])} (`{d}`)" for d, r in confirm)
    plan = first.get("plan", {})
    if plan.get("steps") and plan.get("eval_every"):
        where += (f". {plan['steps']} PPO steps per run, evaluated every {plan['eval_every']} "
                  f"steps on {plan.get('num_eval_prompts', 'the')} held-out prompts")
        if plan.get("eval_samples_per_prompt", 1) > 1:
            where += f" ({plan['eval_samples_per_prompt']} responses each)"
    lines = [
        f"<!-- generated by `{generated_by}`; do not edit by hand -->", "",
        f"{where}. Every arm of a seed sees the same prompts and sampling keys, so "
        "arms are compared by paired differences per seed. Means over seeds with 95% "
        f"bootstrap intervals over seeds; J = gold - {first['beta']} x KL for every arm; SFT "
        f"gold = {first['sft_gold']:.3f}. Table: seeds {report_lib.format_seeds(first['seeds'])}.",
        "",
    ]
    lines += report_lib.arm_table(first)
    lines += [""]
    if paired:
        for _, r in runs:
            lines += [f"Paired differences arm - versus, seeds "
                      f"{report_lib.format_seeds(r['seeds'])} (mean over seeds, 95% bootstrap "
                      "interval):", ""]
            lines += report_lib.comparison_table(r)
            lines += [""]
    lines += [f"Resolution, seeds {report_lib.format_seeds(r['seeds'])}: "
              f"{report_lib.resolution_line(r)}" for _, r in runs]
    lines += ["", f"![gold, J and RM score over PPO steps]({curves_link})", "",
              "What it shows (only differences whose 95% interval excludes 0 on every run; "
              "`docs/results.json` lists them):", ""]
    lines += [f"- {claim_sentence(runs, c)}" for c in claims] or [
        "- No difference between two arms has an interval excluding 0 on every run."]
    rest = open_lines(runs, claims)
    if rest:
        lines += ["", "Macro arms against token PPO and their matched controls, where no "
                  "difference held:", ""]
        lines += [f"- {line}" for line in rest]
    return "\n".join(lines)


def replace_section(text: str, section: str, path: str, marker: str = MARKER) -> str:
    """`text` with everything between the marker lines of `marker` replaced by `section`."""
    start, end = markers(marker)
    starts, ends = text.count(start), text.count(end)
    if starts != 1 or ends != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{path}: needs exactly one {start!r} and, after it, one {end!r}; "
                         f"found {starts} and {ends}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{section}\n{end}{tail}"


def _estimate(entry: dict) -> dict:
    return {"mean": entry["mean"], "ci": entry["ci"]}


def run_numbers(report: dict) -> dict:
    """The key numbers of one run's report: per arm, the mean and interval of every arm metric;
    every paired comparison with its per-seed differences; PPO's gain over SFT and the
    resolution."""
    arms = {arm: {m: _estimate(e[m]) for m in report_lib.ARM_METRICS}
            for arm, e in report["arms"].items()}
    paired = {}
    for arm, _, metric, cmp in report_lib.paired_comparisons(report):
        paired.setdefault(f"{arm} - {cmp['versus']}", {})[metric] = dict(
            _estimate(cmp), differences=cmp["differences"])
    res = report["resolution"]
    return {"seeds": report["seeds"], "sft_gold": report["sft_gold"],
            "ppo_gain": _estimate(report["ppo_gain"]), "arms": arms, "paired": paired,
            "resolution": {"max_half_width": res["max_half_width"],
                           "gain_over_max_half_width": res["gain_over_max_half_width"]}}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="readme_results.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("confirm_dirs", nargs="*")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--results", default="docs/results.json")
    parser.add_argument("--curves", default="docs/synthetic_curves.png")
    parser.add_argument("--command", default="python experiments/run.py",
                        help="the experiment command the runs come from, as the README shows it")
    parser.add_argument("--marker", default=MARKER,
                        help="the section replaced: between <!-- MARKER:start --> and "
                             "<!-- MARKER:end -->")
    parser.add_argument("--paired", action="store_true",
                        help="also show every run's table of paired differences")
    args = parser.parse_args(argv)
    try:
        dirs = [args.run_dir, *args.confirm_dirs]
        runs = [(d, load_report(d)) for d in dirs]
        curves_src = os.path.join(args.run_dir, "curves.png")
        if not os.path.exists(curves_src):
            raise FileNotFoundError(f"{curves_src} does not exist")
        with open(args.readme) as f:
            readme = f.read()
        claims = replicated_claims([r for _, r in runs])
        generated_by = " ".join(["experiments/readme_results.py", *argv])
        link = os.path.relpath(os.path.abspath(args.curves),
                               os.path.dirname(os.path.abspath(args.readme)))
        section = results_section(runs, claims, command=args.command,
                                  curves_link=pathlib.PurePath(link).as_posix(),
                                  generated_by=generated_by, paired=args.paired)
        new_readme = replace_section(readme, section, args.readme, args.marker)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in (args.results, args.curves):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"claims": claims,
                   "runs": [{"dir": d, "seeds": r["seeds"]} for d, r in runs],
                   "numbers": [run_numbers(r) for _, r in runs],
                   "generated_by": generated_by}, f, indent=2)
        f.write("\n")
    shutil.copyfile(curves_src, args.curves)
    with open(args.readme, "w") as f:
        f.write(new_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
