"""Runs marl_jax: the default MA-PPO vs PPO experiment, or any stage of any config.

    python experiments/run.py                                   # the default experiment
    python experiments/run.py --config=configs/synthetic.py --config.stage=all --workdir=runs/x
    python experiments/run.py --config=configs/tldr_smollm2.py --config.ppo.ngram=10

`--config.stage` in {sft, rm, ppo, all, experiment, eval}; every field of the config file can be
overridden as `--config.<section>.<field>=<value>`. Running the same command again resumes.
"""
import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "synthetic.py"),
                                "Experiment config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    from marl_jax import pipeline

    config = flags.FLAGS.config
    workdir = flags.FLAGS.workdir or os.path.join(
        "runs", pathlib.Path(flags.FLAGS["config"].config_filename).stem)
    pipeline.run(config, workdir)


if __name__ == "__main__":
    app.run(main)
