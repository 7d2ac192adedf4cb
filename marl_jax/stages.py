"""What `experiments/run.py` runs: `config.stage` of a config in one workdir, from the stages of a
`Pipeline` (sft, rm, ppo, all, eval), the experiment of many arms (experiment) or the
asynchronous-PPO study of single runs (async_study)."""
from __future__ import annotations

import jax

from marl_jax import async_study, distributed, experiment
from marl_jax import pipeline as pipeline_lib
from marl_jax.config import resolve_size
from marl_jax.eval import run_eval
from marl_jax.train import compile_cache, preemption
from marl_jax.train import metrics as metrics_lib

SUMMARY_COLUMNS = {
    "sft": ("step", "loss", "accuracy"),
    "rm": ("step", "loss", "accuracy"),
    "ppo": ("step", "objective/scores", "objective/kl", "policy/clipfrac_avg",
            "critic/explained_variance"),
    "eval": ("step", "gold", "kl", "rm_score"),
}


def run(config, workdir: str) -> None:
    """Runs `config.stage` in `workdir` and prints a closing summary table.

    Raises:
      preemption.Preempted: a preemption notice (SIGTERM) stopped the run at a step boundary,
        every step until there checkpointed, or outside a training loop where nothing is half
        written (`preemption.safe_point`); running the same command again resumes there.
    """
    resolve_size(config)
    compile_cache.use_run_cache()
    distributed.initialize(config.distributed)
    with preemption.watching():
        _run_stage(config, workdir)


def _run_stage(config, workdir: str) -> None:
    stage = config.stage
    if stage == "experiment":
        experiment.run_experiment(config, workdir)
        return
    if stage == "async_study":
        async_study.run_async_study(config, workdir)
        return
    pipeline = pipeline_lib.Pipeline(config, workdir, run_earlier_stages=stage == "all")
    try:
        if stage in ("sft",):
            pipeline.sft()
        elif stage == "rm":
            pipeline.rm()
        elif stage in ("ppo", "all"):
            pipeline.ppo()
        elif stage == "eval":
            run_eval.evaluate_workdir(pipeline)
    finally:
        pipeline.close()
    if jax.process_index() == 0:
        print(summary(workdir))


def summary(workdir: str) -> str:
    """The last logged row of every stage, as a table."""
    rows = metrics_lib.read_metrics(workdir)
    out = []
    for stage, columns in SUMMARY_COLUMNS.items():
        last = [r for r in rows if r.get("stage") == stage]
        if last:
            out.append(f"[{stage}]\n" + metrics_lib.summary_table(last[-1:], columns))
    return "\n".join(out)
