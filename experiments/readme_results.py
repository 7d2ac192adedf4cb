"""Writes a study's results page, the README's headline and the study's JSON from its runs.

    python experiments/readme_results.py RUN_DIR [CONFIRM_DIR ...] [--readme README.md]
        [--page docs/synthetic_results.md] [--marker results] [--results docs/results.json]
        [--curves docs/synthetic_curves.png] [--command CMD] [--paired]

The defaults write the default experiment's (the synthetic study's); the real-text study's
section of docs/real_text.md is `--page docs/real_text.md --marker real-text-study --readme ''
--paired --results docs/real_text_results.json --curves docs/real_text_curves.png`.

RUN_DIR and every CONFIRM_DIR hold the report.json of one run of the same experiment command
(`--command`, as the section shows it) on other seeds, or on the same seeds under another
instruction set (XLA:CPU rounds floats by the instructions it generates; a run made with
`XLA_FLAGS=--xla_cpu_max_isa=AVX2` runs the code XLA generates for a CPU without AVX-512);
every run names its seeds and the instruction set it recorded (`report.run_label`: "seeds 0-11,
AVX2"; "unrecorded" for a run that did not record it), and two runs share a seed only when both
recorded instruction sets and they differ (`check_seed_sets`). A claim is a paired difference
between two arms whose 95% bootstrap interval over seeds excludes 0 (`marl_jax.eval.report.claims`);
only the claims every given run makes, in the same direction, are kept. They go to the JSON
(`--results`, with every run's key numbers: per-arm means, paired differences per seed,
resolution). The page's section between the lines `<!-- MARKER:start -->` and
`<!-- MARKER:end -->` (`--marker`, default `results`) is replaced by: the command, seeds and
instruction set of each run, RUN_DIR's per-arm table, with `--paired` each run's table of paired
differences (every arm against the baseline, every macro arm against its matched control), the
resolution of each run (PPO's gain against the widest paired interval), RUN_DIR's curves, one
sentence per kept claim, and for every macro arm against token PPO and against its matched
control each difference that was not distinguishable or not replicated. The README's section between
`<!-- headline:start -->` and `<!-- headline:end -->` (`--readme`; '' for none) is replaced by
the headline: columns of the same table, the curves, the kept claims and the differences no run
could tell apart, in words, with a link to the page. Nothing else in either file changes.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from marl_jax.eval import report as report_lib  # noqa: E402

MARKER = "results"


def markers(name: str = MARKER) -> tuple[str, str]:
    """The lines that delimit a generated section: `<!-- name:start -->`, `<!-- name:end -->`."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


START, END = markers()
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
HEADLINE_COLUMNS = ("arm", "gold", "RM score", "KL (nats)", "J = gold - beta KL",
                    "reward hacking")


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


def check_seed_sets(runs) -> None:
    """Raises ValueError when two runs share a seed but not a pair of recorded, different
    instruction sets: the same seeds on the same instructions repeat a run bit for bit."""
    seen = {}
    for run_dir, report in runs:
        isa = report_lib.isa_label(report)
        for seed in report["seeds"]:
            for other_dir, other_isa in seen.get(seed, []):
                if report_lib.UNRECORDED in (isa, other_isa) or isa == other_isa:
                    raise ValueError(
                        f"seed {seed} is in both {other_dir} ({other_isa}) and {run_dir} "
                        f"({isa}): runs share seeds only on two recorded, different "
                        "instruction sets")
            seen.setdefault(seed, []).append((run_dir, isa))


def seed_sets(runs) -> int:
    """How many disjoint seed sets the runs hold (runs on the same seeds count once)."""
    return len({tuple(sorted(r["seeds"])) for _, r in runs})


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
        label = report_lib.run_label(report)
        parts.append(f"not run on {label}" if cmp is None
                     else f"{report_lib.format_difference(cmp)} on {label}")
    return "; ".join(parts)


def run_list(runs) -> str:
    """"seeds 0-11, AVX-512; seeds 0-11, AVX2": every run's label."""
    return "; ".join(report_lib.run_label(r) for _, r in runs)


def _versus(report, arm, versus) -> str:
    c = report["comparisons"].get(arm) or {}
    return f"`{versus}` (its matched control)" if c.get("control") == versus else f"`{versus}`"


def claim_sentence(runs, claim) -> str:
    """"ma_ppo has lower J than ppo: -0.41 [-0.55, -0.30] on seeds 0-7, AVX-512; ... on seeds
    100-107, AVX-512"."""
    arm, versus, metric = claim["arm"], claim["versus"], claim["metric"]
    word = "higher" if claim["direction"] > 0 else "lower"
    return (f"`{arm}` has {word} {report_lib.METRIC_WORDS[metric]} than "
            f"{_versus(runs[0][1], arm, versus)}: {_across_runs(runs, arm, versus, metric)}.")


def open_comparisons(runs, claims, arms=None) -> list[tuple[str, str, str, bool]]:
    """(arm, versus, metric, separated) for every macro arm of the first run (or every arm of
    `arms`) against the baseline and against its control, each metric without a kept claim;
    separated is False when no run separates the two."""
    claimed = {c[:3] for c in map(_key, claims)}
    found = []
    for arm, c in runs[0][1]["comparisons"].items():
        if not c["macro"] if arms is None else arm not in arms:
            continue
        for versus in dict.fromkeys((runs[0][1]["baseline"], c["control"])):
            for metric in report_lib.METRICS:
                if versus is None or (arm, versus, metric) in claimed:
                    continue
                made = [comparison(r, arm, versus, metric) for _, r in runs]
                separated = not all(m and m["direction"] == 0 for m in made)
                found.append((arm, versus, metric, separated))
    return found


def open_lines(runs, claims, arms=None) -> list[str]:
    """Each open comparison (`open_comparisons`) with its numbers: "not distinguishable" when no
    run separates the two, else "no difference that holds on every run"."""
    return [f"`{arm}` vs {_versus(runs[0][1], arm, versus)}, "
            f"{report_lib.METRIC_WORDS[metric]}: "
            f"{'no difference that holds on every run' if separated else 'not distinguishable'}: "
            f"{_across_runs(runs, arm, versus, metric)}."
            for arm, versus, metric, separated in open_comparisons(runs, claims, arms)]


def _metric_list(metrics) -> str:
    words = [report_lib.METRIC_WORDS[m] for m in metrics]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _grouped(items) -> list[tuple[tuple, list[str]]]:
    """[(key, metrics)] from (key, metric) pairs, keys in order of first appearance."""
    groups: dict[tuple, list[str]] = {}
    for key, metric in items:
        groups.setdefault(key, []).append(metric)
    return list(groups.items())


def claim_headlines(claims, report: dict) -> list[str]:
    """The kept claims in words, one line per arm, versus and direction: "`ma_ppo` has lower
    final gold and J than `ppo`."."""
    return [f"`{arm}` has {'higher' if direction > 0 else 'lower'} {_metric_list(metrics)} than "
            f"{_versus(report, arm, versus)}."
            for (arm, versus, direction), metrics in _grouped(
                ((c["arm"], c["versus"], c["direction"]), c["metric"]) for c in claims)]


def headline_table(table: list[str]) -> list[str]:
    """The columns HEADLINE_COLUMNS of a per-arm table (`report_lib.arm_table`'s lines)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table]
    keep = [rows[0].index(name) for name in HEADLINE_COLUMNS]
    return ["| " + " | ".join(row[i] for i in keep) + " |" if n != 1
            else "|" + "---|" * len(keep) for n, row in enumerate(rows)]


def headline_section(runs, claims, *, page_link: str, curves_link: str,
                     generated_by: str) -> str:
    """The README's headline (without its marker lines): columns of the first run's table, its
    curves, the claims of every run and the comparisons no run separates, in words."""
    (first_dir, first), confirm = runs[0], runs[1:]
    repeats = "the repeats, " if confirm else ""
    label = report_lib.run_label(first)
    lines = [
        f"<!-- generated by `{generated_by}`; do not edit by hand -->", "",
        f"{label[0].upper()}{label[1:]} (`{first_dir}`), final evaluation; "
        f"means over seeds with 95% bootstrap intervals; SFT gold = {first['sft_gold']:.3f} "
        f"([every column, {repeats}every paired difference]({page_link})):", "",
    ]
    lines += headline_table(report_lib.arm_table(first))
    lines += ["", f"![gold, J and RM score over PPO steps]({curves_link})", ""]
    runs_word = f"every run ({run_list(runs)})" if confirm else "this run"
    lines += [f"Differences whose 95% interval excludes 0 on {runs_word}:", ""]
    lines += [f"- {line}" for line in claim_headlines(claims, first)] or ["- none."]
    unseparated = _grouped(((arm, versus), metric) for arm, versus, metric, separated
                           in open_comparisons(runs, claims) if not separated)
    if unseparated:
        lines += ["", f"Not distinguishable on {'any run' if confirm else 'this run'}:", ""]
        lines += [f"- `{arm}` vs {_versus(first, arm, versus)}: {_metric_list(metrics)}."
                  for (arm, versus), metrics in unseparated]
    return "\n".join(lines)


def run_where(run_dir: str, report: dict) -> str:
    """"seeds 0-11, AVX2 (`runs/x`, `XLA_FLAGS=--xla_cpu_max_isa=AVX2`)": a run, its folder and
    the XLA flags it ran with."""
    flags = (report.get("plan", {}).get("instruction_set") or {}).get("xla_flags")
    return (f"{report_lib.run_label(report)} (`{run_dir}`"
            + (f", `XLA_FLAGS={flags}`" if flags else "") + ")")


def same_seeds_note(runs) -> str:
    """A sentence when two runs share their seeds: they differ in the instruction set alone."""
    if seed_sets(runs) == len(runs):
        return ""
    return (" Runs on the same seeds differ only in the instruction set XLA:CPU generated code "
            "for, which decides its float rounding: a difference is stated only when it holds "
            "on each.")


def results_section(runs, claims, *, command: str, curves_link: str, generated_by: str,
                    paired: bool = False, results_name: str = "docs/results.json") -> str:
    """The generated results page section (without its marker lines). runs: [(dir, report)], the
    first one's table and curves shown; with `paired`, every run's paired-difference table;
    `results_name`: the JSON file named as listing the claims."""
    (first_dir, first), confirm = runs[0], runs[1:]
    where = f"`{command}` on {run_where(first_dir, first)}"
    if confirm:
        where += ", repeated on " + "; ".join(run_where(d, r) for d, r in confirm)
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
        f"gold = {first['sft_gold']:.3f}.{same_seeds_note(runs)} Table: "
        f"{report_lib.run_label(first)}.", "",
    ]
    lines += report_lib.arm_table(first)
    lines += [""]
    if paired:
        for _, r in runs:
            lines += [f"Paired differences arm - versus, {report_lib.run_label(r)} (mean over "
                      "seeds, 95% bootstrap interval):", ""]
            lines += report_lib.comparison_table(r)
            lines += [""]
    lines += [f"Resolution, {report_lib.run_label(r)}: {report_lib.resolution_line(r)}"
              for _, r in runs]
    lines += ["", f"![gold, J and RM score over PPO steps]({curves_link})", "",
              "What it shows (only differences whose 95% interval excludes 0 on every run; "
              f"`{results_name}` lists them):", ""]
    lines += [f"- {claim_sentence(runs, c)}" for c in claims] or [
        "- No difference between two arms has an interval excluding 0 on every run."]
    rest = open_lines(runs, claims)
    if rest:
        lines += ["", "Macro arms against token PPO and their matched controls, where no "
                  "difference held:", ""]
        lines += [f"- {line}" for line in rest]
    return "\n".join(lines)


def replace_section(text: str, section: str, path: str, start: str = START,
                    end: str = END) -> str:
    """`text` with everything between the marker lines `start` and `end` replaced by
    `section`."""
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
    return {"seeds": report["seeds"], "instruction_set": report_lib.isa_label(report),
            "sft_gold": report["sft_gold"],
            "ppo_gain": _estimate(report["ppo_gain"]), "arms": arms, "paired": paired,
            "resolution": {"max_half_width": res["max_half_width"],
                           "gain_over_max_half_width": res["gain_over_max_half_width"]}}


def _link(target: str, document: str) -> str:
    """`target` relative to the folder of `document`, as a markdown link writes it."""
    link = os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(document)))
    return pathlib.PurePath(link).as_posix()


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="readme_results.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("confirm_dirs", nargs="*")
    parser.add_argument("--readme", default="README.md",
                        help="the file whose headline section is replaced ('': none)")
    parser.add_argument("--page", default="docs/synthetic_results.md",
                        help="the file whose results section is replaced")
    parser.add_argument("--marker", default=MARKER,
                        help="the page's section replaced: between <!-- MARKER:start --> and "
                             "<!-- MARKER:end -->")
    parser.add_argument("--paired", action="store_true",
                        help="also show every run's table of paired differences")
    parser.add_argument("--results", default="docs/results.json")
    parser.add_argument("--curves", default="docs/synthetic_curves.png")
    parser.add_argument("--command", default="python experiments/run.py",
                        help="the experiment command the runs come from, as the page shows it")
    args = parser.parse_args(argv)
    try:
        dirs = [args.run_dir, *args.confirm_dirs]
        runs = [(d, load_report(d)) for d in dirs]
        check_seed_sets(runs)
        curves_src = os.path.join(args.run_dir, "curves.png")
        if not os.path.exists(curves_src):
            raise FileNotFoundError(f"{curves_src} does not exist")
        with open(args.page) as f:
            page = f.read()
        claims = replicated_claims([r for _, r in runs])
        generated_by = shlex.join(["experiments/readme_results.py", *argv])
        section = results_section(runs, claims, command=args.command,
                                  curves_link=_link(args.curves, args.page),
                                  generated_by=generated_by, paired=args.paired,
                                  results_name=args.results)
        new_page = replace_section(page, section, args.page, *markers(args.marker))
        new_readme = None
        if args.readme:
            with open(args.readme) as f:
                readme = f.read()
            headline = headline_section(runs, claims, page_link=_link(args.page, args.readme),
                                        curves_link=_link(args.curves, args.readme),
                                        generated_by=generated_by)
            new_readme = replace_section(readme, headline, args.readme, HEADLINE_START,
                                         HEADLINE_END)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in (args.results, args.curves):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"claims": claims,
                   "runs": [{"dir": d, "seeds": r["seeds"],
                             "instruction_set": report_lib.isa_label(r),
                             "recorded": r.get("plan", {}).get("instruction_set")}
                            for d, r in runs],
                   "numbers": [run_numbers(r) for _, r in runs],
                   "generated_by": generated_by}, f, indent=2)
        f.write("\n")
    shutil.copyfile(curves_src, args.curves)
    with open(args.page, "w") as f:
        f.write(new_page)
    if new_readme is not None:
        with open(args.readme, "w") as f:
            f.write(new_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
