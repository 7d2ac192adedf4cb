"""SFT -> reward model -> PPO / MA-PPO in one workdir: what `experiments/run.py` runs.

Each stage checkpoints under `<workdir>/checkpoints/<stage>`; a finished stage is reused, an
unfinished one resumes, so running the same command again continues where it stopped. Finished
models are also exported as transformers-loadable directories under `<workdir>/models/`.
"""
from __future__ import annotations

import json
import os
import shutil

import jax

from marl_jax import distributed
from marl_jax.config import validate_config
from marl_jax.data.tasks import build_task
from marl_jax.train import build, checkpoint, metrics as metrics_lib, sharding
from marl_jax.train.ppo import run_ppo
from marl_jax.train.reward import reward_stats, run_rm
from marl_jax.train.sft import run_sft

# The reward model's score mean and std over its training responses, saved beside it so PPO
# (and anyone serving it) can centre and scale its scores.
REWARD_STATS = "reward_stats.json"

SUMMARY_COLUMNS = {
    "sft": ("step", "loss", "accuracy"),
    "rm": ("step", "loss", "accuracy"),
    "ppo": ("step", "objective/scores", "objective/kl", "policy/clipfrac_avg",
            "critic/explained_variance"),
    "eval": ("step", "gold", "kl", "rm_score"),
}


class Pipeline:
    """The models and data of one workdir; stages run on demand and in order."""

    def __init__(self, config, workdir: str, *, run_earlier_stages: bool = True):
        validate_config(config)
        distributed.initialize(config.distributed)
        sharding.validate_mesh(config.mesh, jax.device_count())
        self.config, self.workdir = config, workdir
        os.makedirs(workdir, exist_ok=True)
        self.mesh = sharding.make_mesh(config.mesh)
        for stage in ("sft", "rm", "ppo"):
            sharding.validate_batch(config[stage].batch_size, self.mesh,
                                    f"config.{stage}.batch_size")
        self.writer = metrics_lib.MetricsWriter(workdir)
        self.task = build_task(config, workdir)
        cfg = build.model_config(config, self.task.tokenizer)
        if len(self.task.tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self.task.tokenizer)} tokens but the model "
                f"(config.model.path={config.model.path!r}) only {cfg.vocab_size}; use the "
                "model's own tokenizer (config.task.tokenizer)")
        self.policy = build.policy_module(cfg)
        self.reward_model = build.reward_module(cfg)
        self.critic = build.critic_module(cfg)
        self._sft = self._rm = None
        self.run_earlier_stages = run_earlier_stages

    def _require(self, name: str, needed_by: str):
        """With `--config.stage=rm` or `ppo`, the earlier stages must have finished already."""
        if self.run_earlier_stages:
            return
        steps = self.config[name].steps
        latest = checkpoint.Checkpointer(checkpoint.checkpoint_dir(self.workdir, name),
                                         read_only=True).latest_step() if steps else 0
        if steps and (latest or 0) < steps:
            raise FileNotFoundError(
                f"stage {needed_by!r} needs the finished {name!r} stage in {self.workdir} "
                f"(found step {latest or 0} of config.{name}.steps={steps}); run "
                f"--config.stage={name} (or --config.stage=all) with this workdir first")

    def sft(self, needed_by: str = ""):
        if self._sft is None:
            if needed_by:
                self._require("sft", needed_by)
            init = build.initial_policy_params(self.config, self.policy,
                                               jax.random.key(self.config.seed))
            self._sft = run_sft(self.config, self.task, self.policy, init, mesh=self.mesh,
                                writer=self.writer, workdir=self.workdir)
            self._export("sft", self.policy, self._sft)
        return self._sft

    def rm(self, needed_by: str = ""):
        if self._rm is None:
            if needed_by:
                self._require("rm", needed_by)
            sft_params = self.sft(needed_by="rm")
            fresh = build.models.init_params(self.reward_model,
                                             jax.random.key(self.config.seed + 1))
            init = dict(fresh, backbone=sft_params["backbone"]) \
                if self.config.rm.init_from == "sft" else fresh
            params = run_rm(self.config, self.task, self.reward_model, init, mesh=self.mesh,
                            writer=self.writer, workdir=self.workdir)
            stats_path = os.path.join(self.workdir, "models", "rm", REWARD_STATS)
            if os.path.exists(stats_path):
                with open(stats_path) as f:
                    stats = json.load(f)
            elif len(self.task.rm["prompt_ids"]) == 0:
                stats = {"mean": 0.0, "std": 1.0}  # no preference pairs (APPS): nothing to centre
            else:
                stats = reward_stats(self.reward_model, params, self.task.rm,
                                     batch_size=self.config.rm.batch_size)
            self._export("rm", self.reward_model, params, extra={REWARD_STATS: stats})
            self._rm = (params, stats)
        return self._rm

    def ppo(self):
        rm_params, stats = self.rm(needed_by="ppo")
        state = run_ppo(self.config, self.task, self.policy, self.critic, self.reward_model,
                        self.sft(needed_by="ppo"), rm_params, stats, mesh=self.mesh, writer=self.writer,
                        workdir=self.workdir)
        self._export("policy", self.policy, state.actor_params)
        return state

    def _export(self, name, module, params, extra=None):
        """A transformers-loadable directory `<workdir>/models/<name>`, complete or absent."""
        path = os.path.join(self.workdir, "models", name)
        if distributed.main_process_value(os.path.exists(path)):
            return
        params = distributed.global_to_host(params)  # a gather every process takes part in
        if jax.process_index() != 0:
            return
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build.models.save_pretrained(module, params, tmp)
        self.task.tokenizer.save_pretrained(tmp)
        for filename, content in (extra or {}).items():
            with open(os.path.join(tmp, filename), "w") as f:
                json.dump(content, f, indent=2)
        os.replace(tmp, path)

    def close(self):
        self.writer.close()


def run(config, workdir: str) -> None:
    """Runs `config.stage` in `workdir` and prints a closing summary table."""
    stage = config.stage
    if stage == "experiment":
        from marl_jax import experiment
        experiment.run_experiment(config, workdir)
        return
    pipeline = Pipeline(config, workdir, run_earlier_stages=stage == "all")
    try:
        if stage in ("sft",):
            pipeline.sft()
        elif stage == "rm":
            pipeline.rm()
        elif stage in ("ppo", "all"):
            pipeline.ppo()
        elif stage == "eval":
            from marl_jax.eval import run_eval
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
