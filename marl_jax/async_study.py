"""The asynchronous-PPO study (`config.stage="async_study"`, docs/async.md): every arm of
`config.async_study.arms` under every variant of `config.async_study.variants` (overrides of
the rollout and ppo sections: staleness k, chunk length, correction), for every seed of
`config.seeds`, each a `stage=ppo` run of its own, then one report comparing each variant with
the same arm's synchronous run.

    <workdir>/base/                       SFT and reward model, once (config.seed)
    <workdir>/runs/<arm>_<variant>/seed_<s>/   a copy of base, then its PPO stage
    <workdir>/metrics.jsonl               the plan row and every run's eval rows (arm =
                                          "<arm>_<variant>", seed, `train_s`: PPO's seconds
                                          before the evaluation)
    <workdir>/report.{json,md}, curves.png, curves_time.png
    <workdir>/divergence.json             per arm, the seeds whose first evaluation after step 0
                                          fell more than `DIVERGENCE_DROP` below step 0's gold

Every run of a seed starts from the same SFT policy and reward model (those of `config.seed`,
as in the experiment runner) with PPO seed s: the variants of an arm see the same prompts and
sampling keys, so their differences are paired per seed. A variant's control is the arm under
the variant named `async_study.baseline` (k = 0). A run is resumed where it stopped (its own
checkpoints); a finished one is read, not run again. Asynchronous runs are single runs, not
vmapped (`experiment.py` vmaps synchronous steps only).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import jax
import ml_collections
import numpy as np

from marl_jax import config_check, experiment
from marl_jax.eval import report as report_lib
from marl_jax.pipeline import Pipeline
from marl_jax.train import preemption
from marl_jax.train.metrics import MetricsWriter, read_metrics

@dataclasses.dataclass(frozen=True)
class StudyRun:
    arm: str
    variant: str
    seed: int
    config: ml_collections.ConfigDict

    @property
    def name(self) -> str:
        return f"{self.arm}_{self.variant}"


def _overridden(config, overrides, where: str):
    """`config` with the nested dict `overrides` applied; ValueError naming a field that does
    not exist."""
    for key, value in overrides.items():
        if key not in config:
            raise ValueError(f"{where}.{key}: no such field of the config")
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            _overridden(config[key], value, f"{where}.{key}")
        else:
            config[key] = value
    return config


def plan(config) -> list[StudyRun]:
    """Every (arm, variant, seed) run's config, checked (`config_check.validate_config`): one
    ValueError naming the variant whose settings cannot run."""
    s = config.async_study
    variants = s.variants.to_dict() if isinstance(s.variants, ml_collections.ConfigDict) \
        else dict(s.variants)
    if s.baseline not in variants:
        raise ValueError(f"config.async_study.baseline={s.baseline!r}: not among the variants "
                         f"{sorted(variants)}")
    only = dict(s.get("only", {}))
    runs = []
    for arm in s.arms:
        fields = experiment.resolve_arm(arm, config.ppo)
        for variant, overrides in variants.items():
            if arm not in only.get(variant, (arm,)):
                continue
            c = copy.deepcopy(config)
            with c.unlocked():
                c.stage = "ppo"
                c.ppo.update({k: v for k, v in fields.items() if k in c.ppo})
                _overridden(c, overrides, f"config.async_study.variants.{variant}")
            try:  # a seed changes nothing the check reads
                config_check.validate_config(c)
            except ValueError as error:
                raise ValueError(f"async_study variant {variant!r} of arm {arm!r}: "
                                 f"{error}") from None
            for seed in config.seeds:
                run_config = copy.deepcopy(c)
                run_config.seed = int(seed)
                runs.append(StudyRun(arm, variant, int(seed), run_config))
    return runs


# Gold lost by the first evaluation after step 0 that counts a run as diverged early: a stale
# batch's failure mode (the policy's KL runs away within the first evaluation interval), apart
# from reward hacking, which lowers gold later in a run.
DIVERGENCE_DROP = 0.1


def early_divergence(rows, drop: float = DIVERGENCE_DROP) -> dict:
    """{arm: {"seeds": [...], "of": n, "runs": [{seed, step, gold_step0, gold, kl}, ...]}}: per arm
    of the study's eval rows, the seeds whose held-out gold at the first evaluation after step 0
    is more than `drop` below their step-0 gold (n: the arm's seeds)."""
    evals = {}
    for r in rows:
        if r.get("stage") == "eval":
            evals.setdefault(r["arm"], {}).setdefault(int(r["seed"]), []).append(r)
    out = {}
    for arm, seeds in evals.items():
        runs = []
        for seed, seed_rows in sorted(seeds.items()):
            seed_rows = sorted(seed_rows, key=lambda r: int(r["step"]))
            if len(seed_rows) < 2 or int(seed_rows[0]["step"]) != 0:
                continue
            start, first = seed_rows[0], seed_rows[1]
            if first["gold"] < start["gold"] - drop:
                runs.append(dict(seed=seed, step=int(first["step"]), gold_step0=start["gold"],
                                 gold=first["gold"], kl=first["kl"]))
        out[arm] = dict(seeds=[r["seed"] for r in runs], of=len(seeds), runs=runs)
    return out


def divergence_text(divergence: dict, drop: float = DIVERGENCE_DROP) -> str:
    """One line per arm: how many of its seeds diverged early, and which."""
    lines = [f"diverged early (gold at the first evaluation more than {drop} below step 0's):"]
    for arm, d in divergence.items():
        which = ", ".join(f"seed {r['seed']} (gold {r['gold']:.2f}, KL {r['kl']:.0f})"
                          for r in d["runs"])
        lines.append(f"  {arm}: {len(d['seeds'])}/{d['of']}" + (f": {which}" if which else ""))
    return "\n".join(lines)


def run_async_study(config, workdir: str) -> dict:
    """Runs the study in `workdir` (see the module) and returns its report."""
    runs = plan(config)
    base = os.path.join(workdir, "base")
    pipe = Pipeline(config, base)
    try:
        pipe.rm()  # the SFT policy first, then the reward model
    finally:
        pipe.close()
    for i, run in enumerate(runs):
        run_dir = os.path.join(workdir, "runs", run.name, f"seed_{run.seed}")
        if not os.path.isdir(run_dir):
            shutil.copytree(base, run_dir + ".tmp", dirs_exist_ok=True)
            os.replace(run_dir + ".tmp", run_dir)
        print(f"[async_study] run {i + 1}/{len(runs)}: {run.name}, seed {run.seed}", flush=True)
        pipe = Pipeline(run.config, run_dir, run_earlier_stages=False)
        try:
            pipe.ppo()
        finally:
            pipe.close()
        preemption.safe_point(f"after async_study run {run.name}, seed {run.seed}")
    if jax.process_index() != 0:
        return {}
    write_rows(config, workdir, runs)
    report = report_lib.write_report(workdir)
    rows = read_metrics(workdir)
    plot_against_time(rows, os.path.join(workdir, "curves_time.png"))
    divergence = early_divergence(rows)
    with open(os.path.join(workdir, "divergence.json"), "w") as f:
        json.dump(divergence, f, indent=1)
    print(report_lib.summary_text(report))
    print(divergence_text(divergence))
    return report


def study_rows(config, runs, rows_of) -> list[dict]:
    """The plan row (with the instruction set of this machine, where the runs ran: the report
    names it) and every run's eval rows (arm "<arm>_<variant>", seed, `train_s`: the sum of the
    run's `perf/step_s` over the steps before the evaluation); `rows_of(run)` reads a run's
    metrics rows."""
    s = config.async_study
    names = list(dict.fromkeys(r.name for r in runs))
    controls = {r.name: f"{r.arm}_{s.baseline}" for r in runs
                if r.variant != s.baseline and f"{r.arm}_{s.baseline}" in names}
    out = [dict(stage="plan", step=0, arms=names, seeds=[int(x) for x in config.seeds],
                baseline=f"{s.arms[0]}_{s.baseline}", beta=float(config.ppo.kl_coef),
                controls=controls, macro_arms=list(controls),
                steps=int(config.ppo.steps), eval_every=int(config.ppo.eval_every),
                instruction_set=report_lib.instruction_set())]
    for run in runs:
        rows = rows_of(run)
        step_s = {int(r["step"]): float(r.get("perf/step_s", 0.0)) for r in rows
                  if r.get("stage") == "ppo"}
        for r in rows:
            if r.get("stage") == "eval":
                seconds = sum(v for step, v in step_s.items() if step <= int(r["step"]))
                out.append(dict(r, arm=run.name, seed=run.seed, train_s=seconds))
    return out


def write_rows(config, workdir: str, runs) -> None:
    """`study_rows` of the finished runs into `<workdir>/metrics.jsonl`, replacing any there."""
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        os.remove(path)
    writer = MetricsWriter(workdir, tensorboard=False)
    try:
        for row in study_rows(config, runs, lambda run: read_metrics(os.path.join(
                workdir, "runs", run.name, f"seed_{run.seed}"))):
            writer.write(row)
    finally:
        writer.close()


def plot_against_time(rows, path) -> None:
    """Held-out gold against PPO's training seconds, per arm: the mean over seeds of gold and of
    seconds at each evaluation step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm = {}
    for r in rows:
        if r.get("stage") == "eval":
            by_arm.setdefault(r["arm"], {}).setdefault(int(r["step"]), []).append(
                (r["train_s"], r["gold"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, steps in by_arm.items():
        points = np.array([np.mean(steps[k], axis=0) for k in sorted(steps)])
        ax.plot(points[:, 0], points[:, 1], marker="o", markersize=3, label=arm)
    ax.set_xlabel("PPO training seconds (mean over seeds)")
    ax.set_ylabel("held-out gold")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
