"""Every shipped config file builds and passes the checks a run makes before compiling, the arms
of the experiment configs resolve to the macro settings their docstrings promise, and bad fields
(micro-batching, TPU topology, a task name without its task fields) are named."""
import importlib

import pytest

from marl_jax import experiment
from marl_jax.config import TASK_CONFIGS, base_config
from marl_jax.config_check import validate_config
from marl_jax.data.real_tasks import REAL_TASKS
from marl_jax.estimators import ESTIMATORS

from train_util import ROOT  # puts the repository root (and so `configs`) on sys.path

CONFIG_DIR = ROOT / "configs"
CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_builds_and_validates(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    validate_config(config)
    if config.stage == "experiment":
        runs = experiment.plan_runs(config)
        assert len(runs) == len(experiment.experiment_arms(config)) * len(config.seeds)


def test_the_real_text_sizes_resolve_and_the_accelerator_size_is_the_study():
    from marl_jax.config import resolve_size

    module = importlib.import_module("configs.real_text_smollm2")
    cpu = resolve_size(module.get_config(), file_config=module.get_config())
    validate_config(cpu)
    assert experiment.experiment_arms(cpu) == ("ppo", "ma_ppo") and cpu.task.num_eval_prompts >= 64
    big = module.get_config()
    big.size = "accelerator"
    big.ppo.steps = 7  # as on the command line: kept
    resolve_size(big, file_config=module.get_config())
    validate_config(big)
    assert big.ppo.steps == 7 and len(big.seeds) >= 5 and big.ppo.response_length >= 128
    assert big.ppo.batch_size >= 64 and big.model.dtype == "bfloat16"
    assert set(experiment.experiment_arms(big)) == {"ppo", "ma_ppo", "ma_ppo_ctrl",
                                                    "ma_ppo_smdp"}
    assert big.task.num_rl_prompts >= 1000 and cpu.task.num_rl_prompts >= 1000
    # The CPU size's short run with a fresh value head uses Monte-Carlo returns; the study keeps
    # the paper's lam, which its matched control takes to the power 1/n.
    assert cpu.ppo.lam == 1.0 and big.ppo.lam == 0.95


def _real_text_size(size):
    from marl_jax.config import resolve_size

    module = importlib.import_module("configs.real_text_smollm2")
    config = module.get_config()
    config.size = size
    resolve_size(config, file_config=module.get_config())
    validate_config(config)
    return config


@pytest.mark.parametrize("size, least_seeds", [("cpu_study", 4), ("window", 3)])
def test_the_real_text_studies_run_ppo_ma_ppo_and_its_matched_control(size, least_seeds):
    """Both study sizes: `ppo`, `ma_ppo` (fixed 5-grams, `equal` values, mean rewards) and its
    matched token-PPO control (lam^(1/5), kl_coef / 5) on every seed, the report pairing each
    macro arm with its control."""
    config = _real_text_size(size)
    p = config.ppo
    runs = experiment.plan_runs(config)
    seeds = tuple(config.seeds)
    assert len(seeds) >= least_seeds and len(set(seeds)) == len(seeds)
    assert [(r.arm, r.seed) for r in runs] == [(a, s) for a in ("ppo", "ma_ppo", "ma_ppo_ctrl")
                                               for s in seeds]
    arms = {r.arm: r.ppo for r in runs if r.seed == seeds[0]}
    assert (arms["ppo"]["ngram"], arms["ppo"]["lam"], arms["ppo"]["kl_coef"]) == (1, p.lam,
                                                                                   p.kl_coef)
    assert (arms["ma_ppo"]["ngram"], arms["ma_ppo"]["value_weighting"],
            arms["ma_ppo"]["reward_aggregation"]) == (5, "equal", "weighted")
    assert arms["ma_ppo_ctrl"]["ngram"] == 1
    assert arms["ma_ppo_ctrl"]["lam"] == pytest.approx(p.lam ** (1 / 5))
    assert arms["ma_ppo_ctrl"]["kl_coef"] == pytest.approx(p.kl_coef / 5)
    assert experiment.controls_of(runs, config) == {"ma_ppo": "ma_ppo_ctrl"}
    # One SFT policy and one reward model (config.seed) for every run.
    assert isinstance(config.seed, int) and config.stage == "experiment"


def test_the_cpu_study_is_the_cpu_size_with_its_stated_changes():
    """cpu_study: the cpu size's data, models and PPO settings; 12 steps evaluated at 0, 6 and
    12 on 64 held-out prompts x 4 responses; one run per program."""
    cpu, study = _real_text_size("cpu"), _real_text_size("cpu_study")
    assert (study.ppo.steps, study.ppo.eval_every, study.task.num_eval_prompts,
            study.ppo.eval_samples_per_prompt) == (12, 6, 64, 4)
    assert tuple(study.seeds) == (0, 1, 2, 3)
    changed = {k for k in ("ppo", "task", "sft", "rm", "model", "mesh")
               for f in cpu[k] if cpu[k][f] != study[k][f]}
    assert changed == {"ppo", "task"}
    assert {f for f in cpu.ppo if cpu.ppo[f] != study.ppo[f]} == {"steps", "eval_every"}
    assert {f for f in cpu.task if cpu.task[f] != study.task[f]} == {"num_eval_prompts"}
    assert study.experiment.runs_per_program == 1 and study.ppo.lam == 1.0


def test_the_window_size_is_the_full_size_in_bfloat16():
    """window: 128-token responses, batch 64, every layer of every stage trained with bfloat16
    compute over scanned, rematerialised layers, the paper's critic and lam, three runs per
    program."""
    w = _real_text_size("window")
    assert w.ppo.response_length == 128 and w.ppo.batch_size >= 64
    assert (w.model.dtype, w.model.param_dtype, w.model.scan_layers, w.model.remat) == (
        "bfloat16", "float32", True, "full")
    assert w.sft.num_layers_unfrozen == w.rm.num_layers_unfrozen == w.ppo.num_layers_unfrozen == -1
    assert (w.ppo.critic_init, w.ppo.lam, w.ppo.whiten_advantages) == ("rm", 0.95, False)
    assert (w.ppo.steps, w.ppo.eval_every, w.task.num_eval_prompts) == (64, 32, 128)
    # One pass over the RL prompts; every program the same shape (one compile for 9 runs).
    assert w.task.num_rl_prompts == w.ppo.steps * w.ppo.batch_size
    assert len(w.experiment.arms) * len(w.seeds) % w.experiment.runs_per_program == 0
    assert dict(w.mesh) == {"data": 1, "fsdp": -1, "tensor": 1}


def test_the_shipped_configs_cover_the_paper_tasks():
    assert {"synthetic", "synthetic_sweep", "tldr_smollm2", "hh_rlhf_smollm2", "webgpt_smollm2",
            "apps_smollm2", "tldr_gemma2b_tpu", "tldr_gemma7b_tpu"} <= set(CONFIG_NAMES)


def test_default_arms_are_the_macro_arms_beside_their_controls():
    config = importlib.import_module("configs.synthetic").get_config()
    p = config.ppo
    arms = {run.arm: run.ppo for run in experiment.plan_runs(config) if run.seed == config.seeds[0]}
    assert list(arms) == ["ppo", "ma_ppo", "ma_ppo_ctrl", "ma_ppo_smdp", "ma_ppo_smdp_ctrl",
                          "ppo_lam1"]
    assert len(config.seeds) >= 8
    token = ("fixed", 1)
    for arm in ("ppo", "ma_ppo_ctrl", "ma_ppo_smdp_ctrl", "ppo_lam1"):
        assert (arms[arm]["termination"], arms[arm]["ngram"]) == token, arm
    assert arms["ppo"]["lam"] == p.lam and arms["ppo_lam1"]["lam"] == 1.0
    assert (arms["ma_ppo"]["ngram"], arms["ma_ppo"]["value_weighting"],
            arms["ma_ppo"]["reward_aggregation"]) == (5, "equal", "weighted")
    # Released MA-PPO averages rewards over the macro: its control takes beta / 5 too.
    assert arms["ma_ppo_ctrl"]["lam"] == pytest.approx(p.lam ** (1 / 5))
    assert arms["ma_ppo_ctrl"]["kl_coef"] == pytest.approx(p.kl_coef / 5)
    assert (arms["ma_ppo_smdp"]["ngram"], arms["ma_ppo_smdp"]["value_weighting"],
            arms["ma_ppo_smdp"]["reward_aggregation"]) == (5, "first", "sum")
    # Summed rewards keep the full KL coefficient.
    assert arms["ma_ppo_smdp_ctrl"]["lam"] == pytest.approx(p.lam ** (1 / 5))
    assert arms["ma_ppo_smdp_ctrl"]["kl_coef"] == p.kl_coef
    assert config.ppo.eval_every <= 5 and config.task.num_eval_prompts >= 128


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
    # Every macro arm runs beside its control; the cold-critic arms on both sides of the axis.
    macro = [a for a in config.experiment.arms if a not in ("ppo", "ppo_lam1", "ppo_cold_critic")]
    for arm in macro:
        assert arms[arm + "_ctrl"]["ngram"] == 1, arm
    assert arms["ma_ppo_cold_critic_ctrl"]["critic_init"] == "random"
    assert arms["ppo_cold_critic"]["critic_init"] == "random"
    assert arms["ppo"]["critic_init"] == arms["n5"]["critic_init"] == "rm"


def _synthetic(overrides=None):
    """The default config with `{"section.field": value}` overrides."""
    c = importlib.import_module("configs.synthetic").get_config()
    for dotted, value in (overrides or {}).items():
        section, _, name = dotted.rpartition(".")
        (c[section] if section else c)[name] = value
    return c


def test_new_fields_and_their_defaults():
    c = base_config()
    assert (c.sft.grad_accum_steps, c.rm.grad_accum_steps, c.ppo.grad_accum_steps) == (1, 1, 1)
    assert c.model.scan_layers is False and c.tpu_topology == ""


@pytest.mark.parametrize("overrides, message", [
    ({"sft.grad_accum_steps": 0}, "config.sft.grad_accum_steps=0: must be an integer >= 1"),
    ({"rm.grad_accum_steps": 3}, "config.rm.grad_accum_steps=3: must divide rm.batch_size=32"),
    ({"ppo.grad_accum_steps": 3},
     "config.ppo.grad_accum_steps=3: ppo.num_minibatches * ppo.grad_accum_steps = 1 * 3 must "
     "divide ppo.batch_size=16"),
    # 4 and 8 each divide 16, their product does not: every minibatch needs whole micro-batches.
    ({"ppo.num_minibatches": 4, "ppo.grad_accum_steps": 8},
     "config.ppo.grad_accum_steps=8: ppo.num_minibatches * ppo.grad_accum_steps = 4 * 8 must "
     "divide ppo.batch_size=16"),
    ({"tpu_topology": "v4"}, "config.tpu_topology='v4': must be empty or a Cloud TPU slice"),
    ({"tpu_topology": "V4-16"}, "config.tpu_topology='V4-16': must be empty or a Cloud TPU"),
])
def test_bad_new_fields_are_named(overrides, message):
    with pytest.raises(ValueError) as error:
        validate_config(_synthetic(overrides))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_group_estimator_needs_two_samples_per_prompt(estimator):
    """One sample per prompt is its own baseline: every advantage of a group estimator would be
    0 and the run would train the KL term alone."""
    config = _synthetic({"ppo.estimator": estimator})
    if ESTIMATORS[estimator].min_group_size < 2:
        validate_config(config)
        return
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value) == (
        f"config.ppo.group_size=1: ppo.estimator={estimator!r} compares each response with the "
        "other samples of its prompt: set ppo.group_size >= 2 (and ppo.batch_size a multiple "
        "of it)")
    validate_config(_synthetic({"ppo.estimator": estimator, "ppo.group_size": 2}))


@pytest.mark.parametrize("overrides", [
    {"sft.batch_size": 32, "sft.grad_accum_steps": 8},
    {"ppo.num_minibatches": 2, "ppo.grad_accum_steps": 8},
    {"tpu_topology": "v4-16"},
    {"tpu_topology": "v5litepod-8"},
])
def test_good_new_fields_pass(overrides):
    validate_config(_synthetic(overrides))


def test_each_task_name_has_the_config_that_serves_it():
    assert set(TASK_CONFIGS) == {"synthetic", "reviews", "calculator", "game", "reasoning_gym",
                                 *REAL_TASKS}
    for name, path in TASK_CONFIGS.items():
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert module.get_config().task.name == name


def test_a_task_name_without_its_fields_fails_naming_them_and_the_config():
    c = _synthetic()
    c.task.name = "tldr"
    with pytest.raises(ValueError) as error:
        validate_config(c, config_file="configs/synthetic.py")
    assert str(error.value) == (
        "config.task.name='tldr' needs the real-dataset task fields (cache_dir, difficulties, "
        "eval_split, include_cnndm, max_prompt_length, max_rows, sandbox, split_fractions, "
        "split_seed, tokenizer, unit_test_memory_mb, unit_test_timeout_s, unit_test_workers, "
        "use_chat_template) that "
        "configs/synthetic.py does not have; use --config=configs/tldr_smollm2.py")

    c = importlib.import_module("configs.webgpt_smollm2").get_config()
    c.task.name = "synthetic"
    with pytest.raises(ValueError) as error:
        validate_config(c)
    assert str(error.value) == (
        "config.task.name='synthetic' needs the synthetic task fields (data_seed) that this "
        "config does not have; use --config=configs/synthetic.py")

    c.task.name = "tl;dr"
    with pytest.raises(ValueError, match=r"config.task.name='tl;dr': must be one of "
                                         r"\('synthetic', 'tldr', 'hh_rlhf', 'webgpt', 'apps', "
                                         r"'reviews', 'calculator', 'game', 'reasoning_gym'\)"):
        validate_config(c)


def test_the_credit_smollm2_accelerator_size_is_the_window_run_probed():
    from configs import credit_smollm2, real_text_smollm2
    from marl_jax.config import resolve_size
    from marl_jax.credit.probe import probe_steps

    probed = credit_smollm2.get_config()
    probed.size = "accelerator"
    resolve_size(probed)
    validate_config(probed)
    window = real_text_smollm2.get_config()
    window.size = "window"
    resolve_size(window)
    for section in ("model", "mesh", "task", "sft", "rm"):
        assert probed[section].to_dict() == window[section].to_dict(), section
    ppo, expected = probed.ppo.to_dict(), window.ppo.to_dict()
    assert {k for k in ppo if ppo[k] != expected[k]} == {"parsing_model"}
    assert probed.stage == "all" and probed.model.dtype == "bfloat16"
    assert probe_steps(probed.credit.every, probed.ppo.steps) == [0, 32, 64]
    assert probed.credit.prompts * probed.credit.group_size == 64
