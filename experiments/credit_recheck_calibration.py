"""How often the credit recheck (marl_jax/credit/recheck.py) calls a correct probe
inconsistent: false alarms on simulated null data (the saved and the fresh continuation returns
of every state drawn from one distribution) at K1 saved and K2 fresh continuations a state,
beside those of the test it replaced (z with each side's own standard error, chi-square), and
its power against a probe whose every saved value is off by two of its standard errors.

    python experiments/credit_recheck_calibration.py [--trials 2000] [--states 32] [--seed 0]

Returns per state s (S states a trial, its own distribution):
- gaussian: N(mu_s, sigma_s^2), mu_s ~ N(0, 1), sigma_s ~ U(0.2, 1);
- skewed (a rare large reward): 10 with probability p_s ~ U(0.01, 0.1), else 0, plus
  N(0, 0.05^2) (the small per-token terms).
The split test draws `--permutations` random splits per chunk of 100 trials, shared by the
trials of the chunk (`credit_recheck.split_p_values`: each trial's p-value is valid for any
splits drawn independently of its returns). Prints a markdown table; the numbers are a pure function of the arguments.
"""
import argparse
import os
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from marl_jax.credit import recheck as credit_recheck  # noqa: E402

DISTRIBUTIONS = ("gaussian", "skewed")
# (K1 saved, K2 fresh): the probes' 4 and 8 continuations against the command's default 32,
# and equal sizes.
SIZES = ((4, 4), (4, 32), (8, 8), (8, 32), (32, 32))
LEVELS = (1e-3, 0.05)
SHIFT = 2.0  # the broken probe's offset, in standard errors of its saved means
CHUNK = 100


def draw_returns(rng: np.random.Generator, distribution: str, trials: int, states: int,
                 sizes) -> tuple:
    """(returns `[trials, S, K]` for each K of `sizes`, the states' standard deviations
    `[trials, S]`), every K of a state from its one distribution."""
    if distribution == "gaussian":
        mean = rng.normal(size=(trials, states, 1))
        scale = rng.uniform(0.2, 1.0, size=(trials, states, 1))
        draws = [mean + scale * rng.normal(size=(trials, states, k)) for k in sizes]
        return draws, scale[..., 0]
    p = rng.uniform(0.01, 0.1, size=(trials, states, 1))
    draws = [10.0 * (rng.random((trials, states, k)) < p) + 0.05 * rng.normal(size=(trials, states, k))
             for k in sizes]
    return draws, np.sqrt(100.0 * p * (1 - p) + 0.05 ** 2)[..., 0]


def own_se_p_values(saved, new) -> np.ndarray:
    """`[trials]` p-values of the replaced test: z = (new - saved) / sqrt(se_new^2 + se_saved^2)
    per state, each se its own side's (ddof 1, / sqrt K), sum z^2 against chi-square with a
    degree of freedom per state; a state whose two se are both <= RESOLUTION is no test when
    its means agree and a contradiction (p 0) when they differ."""
    se = [x.std(axis=-1, ddof=1) / np.sqrt(x.shape[-1]) for x in (saved, new)]
    diff = new.mean(axis=-1) - saved.mean(axis=-1)
    scale = np.sqrt(se[0] ** 2 + se[1] ** 2)
    exact = scale <= credit_recheck.RESOLUTION
    z2 = np.where(exact, 0.0, diff ** 2 / np.where(exact, 1.0, scale) ** 2)
    contradiction = (exact & (np.abs(diff) > credit_recheck.RESOLUTION)).any(axis=-1)
    tested = (~exact).sum(axis=-1)
    p = np.where(tested > 0, stats.chi2.sf(z2.sum(axis=-1), np.maximum(tested, 1)), 1.0)
    return np.where(contradiction, 0.0, p)


def split_p_values(saved, new, seed, permutations: int) -> np.ndarray:
    """`[trials]` p-values of the split test (`credit_recheck.split_p_values`), a chunk of
    `CHUNK` trials at a time (the trials of a chunk share its random splits)."""
    return np.concatenate([credit_recheck.split_p_values(
        saved[lo:lo + CHUNK], new[lo:lo + CHUNK], permutations=permutations,
        seed=[*seed, lo])[1] for lo in range(0, saved.shape[0], CHUNK)])


def calibration(trials: int, states: int, seed: int, permutations: int) -> list[dict]:
    """One row per (distribution, K1, K2): the two tests' rejection counts at `LEVELS` on null
    data, and the split test's at the command's level on shifted data."""
    rows = []
    for d, distribution in enumerate(DISTRIBUTIONS):
        for k_saved, k_new in SIZES:
            cell = [seed, d, k_saved, k_new]
            (saved, new), sd = draw_returns(np.random.default_rng(cell), distribution, trials,
                                            states, (k_saved, k_new))
            own = own_se_p_values(saved, new)
            split = split_p_values(saved, new, [*cell, 0], permutations)
            shifted = saved + (SHIFT * sd / np.sqrt(k_saved))[..., None]
            power = split_p_values(shifted, new, [*cell, 1], permutations)
            rows.append({"distribution": distribution, "k_saved": k_saved, "k_new": k_new,
                         "own_se": {a: int(np.sum(own <= a)) for a in LEVELS},
                         "split": {a: int(np.sum(split <= a)) for a in LEVELS},
                         "power": int(np.sum(power <= credit_recheck.MIN_P_VALUE))})
    return rows


def rate(count: int, trials: int, interval: bool = False) -> str:
    """A count of `trials` as a percentage, with its exact (Clopper-Pearson) 95% interval."""
    text = f"{100 * count / trials:.2f}%"
    if not interval:
        return text
    ci = stats.binomtest(count, trials).proportion_ci(0.95)
    return f"{text} [{100 * ci.low:.2f}, {100 * ci.high:.2f}]"


def table(rows: list[dict], trials: int) -> str:
    lines = ["| returns | K1 saved | K2 fresh | own-se z: alarms at 0.1% | split test: alarms at "
             "0.1% [95% interval] | own-se z at 5% | split test at 5% [95% interval] | split "
             "test: power at 0.1% (2 se off) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['distribution']} | {r['k_saved']} | {r['k_new']} | "
                     f"{rate(r['own_se'][1e-3], trials)} | "
                     f"{rate(r['split'][1e-3], trials, True)} | "
                     f"{rate(r['own_se'][0.05], trials)} | {rate(r['split'][0.05], trials, True)} | "
                     f"{rate(r['power'], trials)} |")
    return "\n".join(lines) + f"\n\n{trials} trials a row."


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="credit_recheck_calibration.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--states", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--permutations", type=int, default=999)
    args = parser.parse_args(argv)
    print(table(calibration(args.trials, args.states, args.seed, args.permutations), args.trials))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
