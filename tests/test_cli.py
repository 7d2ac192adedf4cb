"""experiments/run.py as a user meets it: configuration and input errors as one line and exit
status 2 (a traceback with --traceback), flag syntax errors as absl prints them, and which
exceptions count as input errors."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from train_util import ROOT

RUN_PY = str(ROOT / "experiments" / "run.py")
TIMEOUT_S = 120


def run_cli(*flags, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, RUN_PY, *flags], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=cwd)


@pytest.mark.smoke
def test_a_bad_field_is_one_line_and_status_2(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli("--config.ppo.ngram=0", f"--workdir={workdir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == "error: config.ppo.ngram=0: must be an integer >= 1"
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not workdir.exists(), "the run stopped before it started"


def test_a_task_name_without_its_fields_names_the_config_to_use(tmp_path):
    # From another directory: the default config file is still shown relative to the checkout.
    result = run_cli("--config.task.name=tldr", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: config.task.name='tldr' needs the real-dataset task fields (cache_dir, "
        "difficulties, eval_split, include_cnndm, max_prompt_length, max_rows, sandbox, "
        "split_fractions, split_seed, tokenizer, unit_test_memory_mb, unit_test_timeout_s, "
        "unit_test_workers, use_chat_template) that "
        "configs/synthetic.py does not have; use --config=configs/tldr_smollm2.py")


@pytest.mark.smoke
@pytest.mark.parametrize("config_args", [("--config", "configs/synthetic.py"), ()],
                         ids=["named_config", "default_config"])
def test_an_unknown_field_is_one_line_naming_the_nearest_field(tmp_path, config_args):
    workdir = tmp_path / "run"
    result = run_cli(*config_args, "--config.ppo.ngrm=5", f"--workdir={workdir}", cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: config.ppo.ngrm: no such field; did you mean config.ppo.ngram?"]
    assert not workdir.exists()


@pytest.mark.parametrize("flag, line", [
    ("--config.size=study", "error: config.size='study': must be one of ('accelerator', 'cpu', "
                            "'cpu_study', 'window')"),
    ("--config.seeds=(4,5,4,6,6)", "error: config.seeds=(4, 5, 4, 6, 6): seed(s) 4, 6 listed "
                                   "more than once; every seed must be distinct"),
], ids=["unknown_size", "seed_twice"])
def test_a_size_that_does_not_exist_or_a_seed_twice_is_one_line(tmp_path, flag, line):
    workdir = tmp_path / "run"
    result = run_cli("--config", str(ROOT / "configs" / "real_text_smollm2.py"), flag,
                     f"--workdir={workdir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [line] and not workdir.exists()


def test_traceback_flag_shows_the_traceback(tmp_path):
    result = run_cli("--config.ppo.ngram=0", "--traceback", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "Traceback (most recent call last):" in lines
    assert lines[-1] == "ValueError: config.ppo.ngram=0: must be an integer >= 1"
    assert any("marl_jax/config_check.py" in line and "validate_config" in line for line in lines)


@pytest.mark.smoke
def test_a_flag_value_of_the_wrong_type_is_one_line(tmp_path):
    result = run_cli("--config.ppo.dynamic_sampling_oversample=1.5",
                     f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: flag --config.ppo.dynamic_sampling_oversample=1.5: invalid literal for int() "
        "with base 10: '1.5'"]
    assert not (tmp_path / "run").exists()


@pytest.mark.smoke
def test_transformers_import_notices_are_silenced_and_its_modules_warnings_are_not():
    """By logger and level: the package logger's own notices (its import-time "PyTorch was not
    found") go, its errors and the warnings of its modules stay."""
    script = textwrap.dedent("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("run_cli", sys.argv[1])
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        from transformers.utils import logging
        package = logging.get_logger("transformers")
        package.warning("a notice of the package logger")
        package.error("an error of the package logger")
        logging.get_logger("transformers.tokenization_utils_base").warning("a module's warning")
    """)
    result = subprocess.run([sys.executable, "-c", script, RUN_PY], capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines  # transformers' own handler may prefix the logger's name
    assert lines[0].endswith("an error of the package logger") and lines[1].endswith("a module's warning")


# Runs in its own interpreter: loading run.py defines its absl flags, which must not leak into
# the test process. Code compiled under a file name inside the marl_jax package stands for the
# project's own code; each case prints whether its exception counts as an input error.
CLASSIFY = textwrap.dedent("""
    import importlib.util, json, pathlib, sys
    import jax, numpy as np
    import marl_jax
    from marl_jax import data
    from marl_jax.config import base_config
    from marl_jax.config_check import validate_config

    spec = importlib.util.spec_from_file_location("run_cli", sys.argv[1])
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    project_file = str(pathlib.Path(marl_jax.__file__).parent / "not_a_module.py")
    scope = {}
    exec(compile('''
    import pathlib
    import jax
    import numpy as np
    def own_check(x):
        raise ValueError("config.x: bad")
    def under_jit(x):
        return jax.jit(own_check)(x)
    def library_error(x):
        return np.reshape(np.ones(3), (2,))
    def stdlib_error(x):
        return pathlib.Path("/nonexistent/marl_jax/file").read_text()
    def bug(x):
        raise TypeError("a bug")
    ''', project_file, "exec"), scope)

    def bad_config():
        c = base_config()
        c.ppo.ngram = 0
        validate_config(c)

    cases = {
        "validate_config": bad_config,
        "missing data path": lambda: data.load_prompts("tldr", "/nonexistent/data"),
        "own check": lambda: scope["own_check"](0),
        "library ValueError under own code": lambda: scope["library_error"](0),
        "FileNotFoundError surfacing in the stdlib": lambda: scope["stdlib_error"](0),
        "TypeError": lambda: scope["bug"](0),
        "own check under jit": lambda: scope["under_jit"](1.0),
        "own check under jit, frames removed": lambda: (
            jax.config.update("jax_traceback_filtering", "remove_frames"),
            scope["under_jit"](2.0)),
        "own check under jit, frames kept": lambda: (
            jax.config.update("jax_traceback_filtering", "off"),
            scope["under_jit"](3.0)),
        "numpy, called from elsewhere": lambda: np.reshape(np.ones(3), (2,)),
    }
    verdicts = {}
    for name, case in cases.items():
        try:
            case()
        except Exception as error:
            verdicts[name] = cli.is_input_error(error)
    print(json.dumps(verdicts))
""")


@pytest.mark.smoke
def test_which_errors_count_as_input_errors():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", CLASSIFY, RUN_PY], capture_output=True,
                            text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "validate_config": True,
        "missing data path": True,
        "own check": True,
        "library ValueError under own code": False,
        "FileNotFoundError surfacing in the stdlib": True,
        "TypeError": False,
        "own check under jit": False,
        "own check under jit, frames removed": False,
        "own check under jit, frames kept": False,
        "numpy, called from elsewhere": False,
    }
