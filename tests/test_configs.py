"""Every shipped config file builds and passes the checks a run makes before compiling, and the
arms of the experiment configs resolve to the macro settings their docstrings promise."""
import importlib

import pytest

from marl_jax import experiment
from marl_jax.config import validate_config

from train_util import ROOT  # puts the repository root (and so `configs`) on sys.path

CONFIG_DIR = ROOT / "configs"
CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_builds_and_validates(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    validate_config(config)
    if config.stage == "experiment":
        runs = experiment.plan_runs(config)
        assert len(runs) == len(config.experiment.arms) * len(config.seeds)


def test_the_shipped_configs_cover_the_paper_tasks():
    assert {"synthetic", "synthetic_sweep", "tldr_smollm2", "hh_rlhf_smollm2", "webgpt_smollm2",
            "apps_smollm2", "tldr_gemma2b_tpu", "tldr_gemma7b_tpu"} <= set(CONFIG_NAMES)


def test_default_arms_are_the_four_of_the_study():
    config = importlib.import_module("configs.synthetic").get_config()
    p = config.ppo
    arms = {run.arm: run.ppo for run in experiment.plan_runs(config) if run.seed == config.seeds[0]}
    assert set(arms) == {"ppo", "ma_ppo", "ppo_matched", "ma_ppo_smdp"}
    assert arms["ppo"]["ngram"] == 1 and arms["ppo"]["lam"] == p.lam
    assert (arms["ma_ppo"]["ngram"], arms["ma_ppo"]["value_weighting"],
            arms["ma_ppo"]["reward_aggregation"]) == (5, "equal", "weighted")
    assert arms["ppo_matched"]["ngram"] == 1
    assert arms["ppo_matched"]["lam"] == pytest.approx(p.lam ** (1 / 5))
    assert arms["ppo_matched"]["kl_coef"] == pytest.approx(p.kl_coef / 5)
    assert (arms["ma_ppo_smdp"]["ngram"], arms["ma_ppo_smdp"]["value_weighting"],
            arms["ma_ppo_smdp"]["reward_aggregation"]) == (5, "first", "sum")


def test_sweep_arms_change_what_their_names_say():
    config = importlib.import_module("configs.synthetic_sweep").get_config()
    arms = {run.arm: run.ppo for run in experiment.plan_runs(config) if run.seed == config.seeds[0]}
    assert [arms[f"n{n}"]["ngram"] for n in (3, 5, 10)] == [3, 5, 10]
    assert arms["n_inf"]["ngram"] >= config.ppo.response_length
    assert arms["randomized"]["termination"] == "randomized"
    assert arms["perplexity"]["termination"] == "perplexity"
    for weighting in ("equal", "unit", "position", "first"):
        assert arms[weighting]["value_weighting"] == weighting
    assert arms["agg_sum"]["reward_aggregation"] == "sum"
    assert arms["agg_weighted"]["reward_aggregation"] == "weighted"
    assert arms["ppo_lam1"]["lam"] == arms["ma_ppo_lam1"]["lam"] == 1.0
    assert tuple(config.experiment.horizons) == (2, 8)
