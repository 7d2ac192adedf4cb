"""Gold against the sampling budget: what each estimator buys per generated token.

From the evaluation rows of an experiment (`generated_tokens`: the run's cumulative response
tokens sampled so far, every group sample and Monte Carlo branch included; `prefill_tokens`:
prompt and prefix tokens prefilled; `train_s`: the run's share of its group's training time),
per arm:

- `gold_per_100k_tokens`: (final gold - step-0 gold) / (final generated tokens / 100000), per seed,
  its mean with the bootstrap interval of `study_stats.interval`, and paired with the baseline;
- `tokens_to_baseline_final`: on the seed-mean curves (generated tokens, gold), the first
  evaluation point whose gold reaches the baseline's final seed-mean gold; the bootstrap
  resamples seeds once for both arms (same indices as every other interval) and a resample that
  never reaches counts as +inf; inverted-CDF percentile interval (null: not reached);
- `tokens_ratio_to_baseline`: that number over the baseline's own, with the interval of the
  resampled ratios.

Pure numpy over the rows; `marl_jax/eval/report.py` adds it to report.json when the rows carry
`generated_tokens`.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from marl_jax.eval import study_stats as st

DEFINITIONS = {
    "generated_tokens": "cumulative response tokens a run sampled up to an evaluation step: "
                        "every sample of a group and every Monte Carlo continuation (only the "
                        "tokens after its prefix) counted",
    "gold_per_100k_tokens": "(final gold - step-0 gold) / (final generated_tokens / 100000) per "
                          "seed; mean with a 95% bootstrap interval over seeds",
    "tokens_to_baseline_final": "first evaluation point of the seed-mean (generated_tokens, "
                                "gold) curve whose gold >= the baseline's final seed-mean "
                                "gold; bootstrap over seeds (resampled jointly with the "
                                "baseline, +inf when not reached), inverted-CDF percentiles",
    "tokens_ratio_to_baseline": "tokens_to_baseline_final of the arm / the baseline's, with the "
                                "percentile interval of the same resamples",
}


def has_budget(rows) -> bool:
    return any(r.get("stage") == "eval" and "generated_tokens" in r for r in rows)


def budget_curves(rows, arms) -> dict:
    """arm -> {"seeds", "steps", "tokens", "prefill", "train_s", "gold"} with `[seeds, K]` curves."""
    table = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("stage") == "eval" and "generated_tokens" in r:
            table[r["arm"]][int(r["seed"])][int(r["step"])] = r
    out = {}
    for arm in arms:
        if arm not in table:
            raise ValueError(f"no evaluation rows with generated_tokens for arm {arm!r}")
        seeds = sorted(table[arm])
        steps = sorted(table[arm][seeds[0]])
        for s in seeds:
            if sorted(table[arm][s]) != steps:
                raise ValueError(f"arm {arm!r}: seed {s} evaluated at other steps than seed "
                                 f"{seeds[0]}")

        def curve(key, default=None):
            return np.array([[table[arm][s][t].get(key, default) for t in steps] for s in seeds],
                            float)
        out[arm] = dict(seeds=seeds, steps=steps, tokens=curve("generated_tokens"),
                        prefill=curve("prefill_tokens", 0.0), train_s=curve("train_s", 0.0),
                        gold=curve("gold"))
    return out


def _crossing(tokens, gold, target):
    """First token count of the curves `[..., K]` where gold >= target (+inf: never)."""
    reached = gold >= np.asarray(target)[..., None] - st.REACH_TOL
    first = np.argmax(reached, axis=-1)
    value = np.take_along_axis(tokens, first[..., None], axis=-1)[..., 0]
    return np.where(reached.any(axis=-1), value, np.inf)


def _finite(x):
    return float(x) if np.isfinite(x) else None


def compute_budget(rows, arms, baseline: str, *, resamples: int = st.RESAMPLES,
                   rng_seed: int = st.RNG_SEED) -> dict:
    """The budget section of the report (`DEFINITIONS`)."""
    curves = budget_curves(rows, arms)
    boot = dict(resamples=resamples, rng_seed=rng_seed)
    base = curves[baseline]
    per_arm = {}
    per_seed = {}
    for arm in arms:
        c = curves[arm]
        final_tokens = c["tokens"][:, -1]
        if np.any(final_tokens <= 0):
            raise ValueError(f"arm {arm!r}: a run generated no tokens")
        eff = (c["gold"][:, -1] - c["gold"][:, 0]) / (final_tokens / 100000.0)
        per_seed[arm] = dict(zip(c["seeds"], eff.tolist()))
        per_arm[arm] = {
            "generated_tokens": st.interval(final_tokens.tolist(), **boot),
            "prefill_tokens": st.interval(c["prefill"][:, -1].tolist(), **boot),
            "train_s": st.interval(c["train_s"][:, -1].tolist(), **boot),
            "gold_per_100k_tokens": {**st.interval(eff.tolist(), **boot),
                                   "per_seed": {str(s): v for s, v in per_seed[arm].items()}},
        }
    for arm in arms:
        c = curves[arm]
        common = sorted(set(c["seeds"]) & set(base["seeds"]))
        ia = [c["seeds"].index(s) for s in common]
        ib = [base["seeds"].index(s) for s in common]
        a_tok, a_gold = c["tokens"][ia], c["gold"][ia]
        b_tok, b_gold = base["tokens"][ib], base["gold"][ib]
        target = b_gold[:, -1].mean()
        point = _crossing(a_tok.mean(0), a_gold.mean(0), target)
        base_point = _crossing(b_tok.mean(0), b_gold.mean(0), target)
        idx = st.bootstrap_indices(len(common), **boot)
        targets = b_gold[idx][:, :, -1].mean(axis=1)
        resampled = _crossing(a_tok[idx].mean(1), a_gold[idx].mean(1), targets)
        base_resampled = _crossing(b_tok[idx].mean(1), b_gold[idx].mean(1), targets)
        tails = np.asarray(st._tails(st.LEVEL)) / 100
        ci = np.quantile(resampled, tails, method="inverted_cdf")
        # A ratio needs a baseline that took tokens to get there (it reaches its own final gold
        # at step 0 when it did not improve); such resamples are left out.
        usable = base_resampled > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.where(np.isfinite(resampled), resampled / np.where(usable,
                                                                           base_resampled, 1),
                              np.inf)[usable]
        ratio_ci = (np.quantile(ratios, tails, method="inverted_cdf")
                    if usable.mean() >= 0.5 else [np.nan, np.nan])
        # An interval over seeds needs two of them: one seed's resamples are all that seed.
        enough = len(common) >= 2
        d = [per_seed[arm][s] - per_seed[baseline][s] for s in common]
        diff = {"seeds": common, "differences": d, **st.interval(d, **boot)}
        diff["direction"] = st.direction(diff["ci"])
        per_arm[arm].update({
            "tokens_to_baseline_final": {"tokens": _finite(point),
                                         "ci": [_finite(x) for x in ci] if enough else None},
            "tokens_ratio_to_baseline": {
                "ratio": _finite(point / base_point) if np.isfinite(point) and base_point > 0
                else None,
                "ci": None if not enough or np.isnan(ratio_ci[0])
                else [_finite(x) for x in ratio_ci]},
            "gold_per_100k_tokens_vs_baseline": diff,
        })
    reached = {a: e["tokens_to_baseline_final"]["tokens"] for a, e in per_arm.items()
               if a != baseline and e["tokens_to_baseline_final"]["tokens"] is not None}
    fewest = min(reached, key=reached.get) if reached else None
    return {"baseline": baseline, "arms": per_arm, "fewest_tokens_to_baseline_final": fewest,
            "target_gold": float(base["gold"][:, -1].mean()), "definitions": DEFINITIONS}


def markdown_lines(budget: dict) -> list[str]:
    """The budget table and its reading, in words a reader can check against the intervals."""
    base = budget["baseline"]
    lines = [f"Generated tokens to reach `{base}`'s final gold ({budget['target_gold']:.3f}); "
             "intervals are 95% bootstrap intervals over seeds.", "",
             "| arm | generated tokens (total) | gold gain per 100k tokens | vs baseline | "
             f"tokens to {base}'s final gold | ratio to {base} |",
             "|---|---|---|---|---|---|"]

    def ci(e, fmt):
        if not e or e.get("ci") is None:
            return "—"
        lo, hi = e["ci"]
        return "[" + ", ".join("∞" if x is None else fmt.format(x) for x in (lo, hi)) + "]"

    for arm, e in budget["arms"].items():
        tok = e["tokens_to_baseline_final"]
        ratio = e["tokens_ratio_to_baseline"]
        vs = e["gold_per_100k_tokens_vs_baseline"]
        lines.append(
            f"| `{arm}` | {e['generated_tokens']['mean']:.0f} | "
            f"{e['gold_per_100k_tokens']['mean']:.4f} {ci(e['gold_per_100k_tokens'], '{:.4f}')} | "
            + ("—" if arm == base else f"{vs['mean']:+.4f} {ci(vs, '{:+.4f}')}") + " | "
            + ("not reached" if tok["tokens"] is None else f"{tok['tokens']:.0f}")
            + f" {ci(tok, '{:.0f}')} | "
            + ("—" if ratio["ratio"] is None else f"{ratio['ratio']:.2f}")
            + f" {ci(ratio, '{:.2f}')} |")
    fewest = budget["fewest_tokens_to_baseline_final"]
    lines.append("")
    if fewest is None:
        lines.append(f"No arm other than `{base}` reached `{base}`'s final gold.")
    else:
        r = budget["arms"][fewest]["tokens_ratio_to_baseline"]
        seeds = len(budget["arms"][fewest]["gold_per_100k_tokens_vs_baseline"]["seeds"])
        if r["ratio"] is not None and seeds < 2:
            lines.append(f"Fewest generated tokens to `{base}`'s final gold: `{fewest}` "
                         f"({r['ratio']:.2f}x `{base}`'s tokens); one seed, so no interval and "
                         "no claim.")
        elif r["ratio"] is None or r["ci"] is None:
            lines.append(f"Fewest generated tokens to `{base}`'s final gold: `{fewest}`; `{base}` "
                         "reached its own final gold at step 0, so there is no ratio.")
        else:
            sure = r["ci"][1] is not None and r["ci"][1] < 1
            lines.append(f"Fewest generated tokens to `{base}`'s final gold: `{fewest}` "
                         f"({r['ratio']:.2f}x `{base}`'s tokens, interval "
                         f"{ci(r, '{:.2f}')}): " + ("fewer than the baseline at 95%." if sure
                                                   else "not distinguishable from the "
                                                   "baseline."))
    return lines


def plot(budget_rows_curves: dict, path: str, baseline: str) -> None:
    """Seed-mean gold against generated tokens and against training time, one line per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, c in budget_rows_curves.items():
        style = dict(lw=2.2) if arm == baseline else dict(lw=1.4)
        axes[0].plot(c["tokens"].mean(0) / 1000, c["gold"].mean(0), label=arm, **style)
        axes[1].plot(c["train_s"].mean(0), c["gold"].mean(0), label=arm, **style)
    axes[0].set_xlabel("generated tokens per run (thousands)")
    axes[1].set_xlabel("training time per run (s, the group's time / its runs)")
    for ax in axes:
        ax.set_ylabel("gold (held-out, seed mean)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
