"""An installed dependency outside setup.cfg's range: one line naming the package, its version and
the range; older stops `experiments/run.py` before anything imports it, newer lets it go on."""
import os
import subprocess
import sys

import pytest

from marl_jax import dependencies
from train_util import ROOT

RUN_PY = str(ROOT / "experiments" / "run.py")
REQUIREMENTS = ["jax>=0.10.2,<0.12", "transformers>=5.17,<6", "gguf>=0.19,<0.20", "numpy>=2.0,<3",
                "pyseccomp>=0.1.2,<0.2; sys_platform == 'win32'"]


@pytest.mark.smoke
def test_each_package_outside_its_range_is_one_line():
    installed = {"jax": "0.12.0", "transformers": "4.57.1", "gguf": None, "numpy": "2.4.6+local",
                 "pyseccomp": None}.get
    assert dependencies.problems(REQUIREMENTS, ">=3.11,<3.13", installed=installed,
                                 python_version="3.12.1") == [
        "warning: jax 0.12.0 is newer than the supported range jax>=0.10.2,<0.12; untested, continuing",
        "error: transformers 4.57.1 is older than the supported range transformers>=5.17,<6 "
        "(pip install -e . -c requirements/lock.txt)",
        "error: gguf is not installed; marl_jax needs gguf>=0.19,<0.20 "
        "(pip install -e . -c requirements/lock.txt)"]
    assert dependencies.problems([], ">=3.11,<3.13", python_version="3.13.0") == [
        "warning: Python 3.13.0 is newer than the supported range Python >=3.11,<3.13; untested, "
        "continuing"]
    assert dependencies.problems([], ">=3.11,<3.13", python_version="3.10.14") == [
        "error: Python 3.10.14 is older than the supported range Python >=3.11,<3.13 (make the "
        "virtualenv with a Python in it)"]


@pytest.mark.smoke
def test_this_environment_meets_every_range():
    requirements, python_requires = dependencies.declared_requirements()
    assert "transformers>=5.17,<6" in requirements and python_requires == ">=3.11,<3.13"
    assert dependencies.problems(requirements, python_requires) == []


def _run_with_installed(tmp_path, name, version, *flags):
    """run.py with `name` reported at `version` (a distribution record ahead of site-packages; the
    package itself still imports from site-packages)."""
    record = tmp_path / "site" / f"{name}-{version}.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, RUN_PY, *flags, f"--workdir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.smoke
def test_run_stops_on_an_older_transformers_with_one_line(tmp_path):
    result = _run_with_installed(tmp_path, "transformers", "4.57.1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: transformers 4.57.1 is older than the supported range transformers>=5.17,<6 "
        "(pip install -e . -c requirements/lock.txt)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.smoke
def test_run_goes_on_past_a_newer_tqdm(tmp_path):
    tqdm_range = next(r for r in dependencies.declared_requirements()[0] if r.startswith("tqdm"))
    result = _run_with_installed(tmp_path, "tqdm", "99.0", "--config.ppo.ngram=0")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"warning: tqdm 99.0 is newer than the supported range {tqdm_range}; untested, continuing",
        "error: config.ppo.ngram=0: must be an integer >= 1"]


# What CI's smoke run holds at both ends of the ranges (docs/installing.md).
SMOKE_SET = {
    # the sampler: its distribution under temperature / top-k / top-p, its row-wise draws
    "tests/test_sampling.py::test_first_token_distribution",
    "tests/test_decode_slots.py::test_row_draws_equal_the_batch_categorical_bit_for_bit",
    # one PPO step
    "tests/test_train.py::test_macro_update_with_n1_equals_token_update",
    # the GGUF and transformers-directory loaders with their tokenizers
    "tests/test_models.py::test_smollm2_gguf_and_its_hf_export_load_with_their_tokenizers_without_torch",
    # the macro core
    "tests/test_termination.py::test_fixed_ngram_hand_cases",
    "tests/test_advantage.py::test_hand_computed_macro_gae",
    "tests/test_advantage.py::test_one_token_macros_equal_token_gae_exactly",
    # the command line's errors
    "tests/test_cli.py::test_a_bad_field_is_one_line_and_status_2",
    "tests/test_cli.py::test_an_unknown_field_is_one_line_naming_the_nearest_field",
    "tests/test_cli.py::test_a_flag_value_of_the_wrong_type_is_one_line",
    "tests/test_cli.py::test_transformers_import_notices_are_silenced_and_its_modules_warnings_are_not",
    "tests/test_cli.py::test_which_errors_count_as_input_errors",
    # the version check, and no private module of a dependency
    "tests/test_dependencies.py::test_each_package_outside_its_range_is_one_line",
    "tests/test_dependencies.py::test_this_environment_meets_every_range",
    "tests/test_dependencies.py::test_run_stops_on_an_older_transformers_with_one_line",
    "tests/test_dependencies.py::test_run_goes_on_past_a_newer_tqdm",
    "tests/test_layering.py::test_no_private_module_of_a_dependency_is_imported",
}


def test_the_smoke_marker_selects_the_smoke_set():
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "smoke",
                             "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line} == SMOKE_SET
