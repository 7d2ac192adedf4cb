"""APPS execution in the sandbox: verdicts over both jails, the reference comparison, the jail
refusing to run when incomplete, the memory budget of parallel sandboxes, the config wiring,
unit-test reward and pass@k. Escapes are in test_sandbox_escapes.py."""
import contextlib
import itertools
import json
import math
import os
import shutil
import sys
import textwrap
import types

import numpy as np
import pytest

from marl_jax.config import base_config
from marl_jax.eval import apps, run_eval, sandbox, seccomp_filter, unit_test_reward

STDIN_IO = {"inputs": ["1 2\n", "3 4\n", "-5 5\n"], "outputs": ["3\n", "7\n", "0\n"]}
CALL_IO = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [10, -3]], "outputs": [[3], [7], [7]]}
FAST = sandbox.SandboxLimits(timeout_s=2.0)
SMALL = sandbox.SandboxLimits(timeout_s=2.0, memory_mb=1024, max_processes=2)
ADD = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_isolation_report(sandbox_name):
    report = sandbox.describe_isolation(sandbox=sandbox_name)
    assert report["sandbox"] == sandbox_name
    assert report["network_namespace"] and report["pid_namespace"] and report["process_limit"]
    assert report["mode"] == ("root" if os.geteuid() == 0 else "user_namespace")
    if sandbox_name == "bubblewrap":
        assert report["host_files_hidden"] and report["seccomp"] and report["no_new_privs"]
        assert report["capabilities"] == [] and report["network_interfaces"] == ["lo"]
    else:
        assert not report["host_files_hidden"] and report["seccomp"]
        assert not report["host_unix_sockets_reachable"]
        assert report["not_read_only"] == [] and "/tmp" in report["hidden"]
    # the unprivileged worker imports modules the runner did not preload, wherever the
    # interpreter is installed (e.g. a pyenv under /root, closed to other users)
    run = sandbox.run_program("import sqlite3, decimal, fractions, json, ssl\nprint('imported')",
                              [""], limits=FAST, sandbox=sandbox_name)
    assert run.cases[0].output == "imported\n"


@pytest.mark.parametrize("code, codes", [
    ("a, b = map(int, input().split())\nprint(a + b)", (True, True, True)),
    ("import sys\ndef main():\n    a, b = map(int, sys.stdin.read().split())\n"
     "    print(a + b)\nif __name__ == '__main__':\n    main()", (True, True, True)),
    ("a, b = map(int, input().split())\nprint(a - b if a > 0 else a + b)", (False, False, True)),
    ("a, b = map(int, input().split()\nprint(a + b)", (-2, -2, -2)),
    ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)", (True, True, True)),
    ("a, b = map(int, input().split())\nprint(a // (a - a))", (-1, -1, -1)),
])
@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_stdin_programs(code, codes, sandbox_name):
    result = apps.evaluate_solution(code, json.dumps(STDIN_IO), 2.0, sandbox=sandbox_name)
    assert result.codes == codes
    assert result.isolation["sandbox"] == sandbox_name


@pytest.mark.parametrize("code, codes", [
    ("class Solution:\n    def add(self, a: int, b: int) -> int:\n        return a + b",
     (True, True, True)),
    ("def add(a, b):\n    return a + b", (True, True, True)),
    ("def add(a, b):\n    return (a + b, )", (True, True, True)),
    ("def add(a, b):\n    return a * b", (False, False, False)),
    ("def add(a, b)\n    return a + b", (-2, -2, -2)),
    ("def plus(a, b):\n    return a + b", (-2, -2, -2)),
    ("class Solution:\n    def add(self, a, b):\n        return [a][b]", (-1, -1, -1)),
    # An object claiming equality with everything is compared as data, not by its __eq__.
    ("class Anything:\n    def __eq__(self, other):\n        return True\n"
     "def add(a, b):\n    return Anything()", (False, False, False)),
])
@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_call_based_programs(code, codes, sandbox_name):
    assert apps.evaluate_solution(code, CALL_IO, 2.0, sandbox=sandbox_name).codes == codes


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_call_based_values_like_the_reference(sandbox_name):
    io = {"fn_name": "f", "inputs": [[{"1": 2}], [3], [4]],
          "outputs": [[{"1": 2}], [[1, 2]], [[[4, 5]]]]}
    code = ("def f(x):\n    if isinstance(x, dict):\n        return {k: v for k, v in x.items()}\n"
            "    if x == 3:\n        return (1, 2)\n    return [(4, 5)]")
    # dict keys are ints again on both sides; tuples compare as lists; output[0] unwrapped.
    assert apps.run_solution(code, io, sandbox=sandbox_name) == [True, True, True]
    # numpy (imported by the APPS prelude) is in both jails
    numpy_code = ("def f(x):\n    return np.int64(7) if x == 3 else np.array([1.5])")
    assert apps.run_solution(numpy_code, {"fn_name": "f", "inputs": [[3], [4]],
                                          "outputs": [[7], [[1.5]]]},
                             sandbox=sandbox_name) == [True, True]


def test_stdout_comparison_cascade():
    match = apps.stdout_matches
    assert match("3 \n  4\n\n", "3\n4")  # per-line strip
    assert match("1\n\n2\n", "1\n2\n")  # blank lines
    assert match("0.3333333333\n", "0.333333333333")  # allclose
    assert not match("0.34\n", "0.3333")
    assert match("2\n1\n", "1\n2") and not match("2\n1\n", "1\n2", compare="strict")
    assert match("1.00001 2\n", "1.000012 2", compare="strict")
    assert not match("1 2 3\n", "1 2", compare="strict")
    assert not match("YES\n", "NO\n")
    with pytest.raises(ValueError, match="compare"):
        match("1", "1", compare="fuzzy")


def test_parse_input_output_validation():
    with pytest.raises(ValueError, match="outputs"):
        apps.parse_input_output({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match=r"inputs'\]\[0\]"):
        apps.parse_input_output({"fn_name": "f", "inputs": ["1"], "outputs": [1]})
    with pytest.raises(ValueError, match="JSON"):
        apps.parse_input_output("{not json")
    tests = apps.parse_input_output({"inputs": [["1", "2"]], "outputs": [["3", "4"]]})
    assert tests.inputs == ("1\n2",) and tests.outputs == ("3\n4",)


def test_run_solution_is_the_bool_view_and_stops_early():
    assert apps.run_solution(ADD, STDIN_IO, 2.0) == [True, True, True]
    assert apps.run_solution(ADD.replace("+", "*"), STDIN_IO, 2.0) == [False, False, False]
    io = {"inputs": ["1", "2", "3"], "outputs": ["1", "0", "3"]}
    result = apps.evaluate_solution("print(input())", io, 2.0, stop_at_first_failure=True)
    assert result.statuses == ("ok", "ok", "not_run") and result.codes == (True, False, -1)


def test_run_solutions_parallel_keeps_order():
    codes = ["print(int(input()) * 2)", "print(int(input()) + 2)", "print(", "print(4)"]
    io = {"inputs": ["2", "3"], "outputs": ["4", "6"]}
    assert apps.run_solutions(codes, io, 2.0, max_workers=3, limits=SMALL) == [
        [True, True], [True, False], [False, False], [True, False]]
    with pytest.raises(ValueError, match="input_outputs"):
        apps.run_solutions(codes, [io], 2.0)


# ---- the jail refuses to run rather than run weaker -----------------------------------------

@pytest.fixture
def fresh_seccomp():
    """The seccomp program is built once per process; these tests build it again."""
    seccomp_filter.seccomp_program.cache_clear()
    yield
    seccomp_filter.seccomp_program.cache_clear()


def _executable(path, text):
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)
    return path


def test_refuses_without_bubblewrap(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(sandbox.SandboxError,
                       match=r"^bubblewrap not installed: apt-get install bubblewrap"):
        apps.run_solution(ADD, STDIN_IO, 2.0)


def test_refuses_without_pyseccomp(monkeypatch, fresh_seccomp):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # `import pyseccomp` raises ImportError
    with pytest.raises(sandbox.SandboxError,
                       match=r"^pyseccomp not installed: pip install pyseccomp -c requirements/lock\.txt"):
        apps.run_solution(ADD, STDIN_IO, 2.0)


def test_refuses_without_libseccomp(monkeypatch, fresh_seccomp):
    class NoLibseccomp:  # what importing pyseccomp does when ctypes finds no libseccomp
        def find_spec(self, name, path=None, target=None):
            if name == "pyseccomp":
                raise RuntimeError("Unable to find libseccomp")

    monkeypatch.delitem(sys.modules, "pyseccomp", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoLibseccomp(), *sys.meta_path])
    with pytest.raises(sandbox.SandboxError,
                       match=r"^libseccomp not found \(Unable to find libseccomp\): "
                             r"apt-get install libseccomp2"):
        apps.run_solution(ADD, STDIN_IO, 2.0)


def test_namespaces_without_libseccomp_refuses_unless_allowed(monkeypatch, fresh_seccomp):
    """The namespaces jail without its seccomp filter: one line naming the missing package, its
    install command and the setting that allows it, at config time (before anything compiles)
    and at the jail; allowed, it runs unfiltered and its isolation report says so. The jail
    itself refuses to start without a filter it was not told to do without."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    refusal = (r"the namespaces jail refuses to run without its seccomp filter: pyseccomp not "
               r"installed: pip install pyseccomp -c requirements/lock\.txt \(the jails' seccomp filter\); "
               r"or set "
               r"config\.eval\.allow_unfiltered_jail=True to run it unfiltered")
    config = _apps_config(sandbox="namespaces")
    prefix = r"^config\.task\.sandbox='namespaces': "
    with pytest.raises(ValueError, match=prefix + refusal) as error:
        unit_test_reward.check_unit_test_config(config)
    assert "\n" not in str(error.value)
    with pytest.raises(sandbox.SandboxError, match="^" + refusal):
        apps.run_solution(ADD, STDIN_IO, 2.0, sandbox="namespaces")
    config.eval.allow_unfiltered_jail = True
    unit_test_reward.check_unit_test_config(config)
    options = unit_test_reward.unit_test_options(config)
    assert apps.run_solution(ADD, STDIN_IO, 2.0, sandbox="namespaces",
                             allow_unfiltered_jail=options["allow_unfiltered_jail"]) == [True] * 3
    report = sandbox.describe_isolation(sandbox="namespaces", allow_unfiltered_jail=True)
    assert not report["seccomp"] and report["host_unix_sockets_reachable"]

    @contextlib.contextmanager
    def no_filter_no_permission(allow_unfiltered_jail=False):
        yield [sys.executable, "-I", "-B", sandbox.NAMESPACES_SCRIPT], ()

    monkeypatch.setattr(sandbox, "_namespaces_command", no_filter_no_permission)
    with pytest.raises(sandbox.SandboxError, match=r"^the namespaces jail has no seccomp filter "
                                                   r"\(no --seccomp-fd\); refusing to run$"):
        sandbox.describe_isolation(sandbox="namespaces")


def _bwrap_on_path(tmp_path, monkeypatch, text):
    """A `bwrap` script first on PATH."""
    _executable(tmp_path / "bwrap", text)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_refuses_when_bwrap_cannot_create_namespaces(tmp_path, monkeypatch):
    _bwrap_on_path(tmp_path, monkeypatch, """
        #!/bin/sh
        echo "bwrap: Creating new namespace failed: Operation not permitted" >&2
        exit 1
        """)
    with pytest.raises(sandbox.SandboxError,
                       match=r"^bwrap cannot create the jail here \(exit status 1\): "
                             r"bwrap: Creating new namespace failed: Operation not permitted$"):
        apps.run_solution(ADD, STDIN_IO, 2.0)


def test_refuses_a_jail_without_seccomp(tmp_path, monkeypatch):
    # A bwrap that drops the seccomp filter: the runner notices before running anything.
    _bwrap_on_path(tmp_path, monkeypatch, f"""
        #!/bin/bash
        args=()
        while [ $# -gt 0 ]; do
          if [ "$1" = --seccomp ]; then shift 2; continue; fi
          args+=("$1"); shift
        done
        exec {shutil.which("bwrap")} "${{args[@]}}"
        """)
    with pytest.raises(sandbox.SandboxError,
                       match=r"^the bubblewrap jail is incomplete \(missing: seccomp filter\); "
                             r"refusing to run"):
        apps.run_solution(ADD, STDIN_IO, 2.0)


def test_namespaces_refuse_when_a_remount_fails(tmp_path, monkeypatch):
    # The namespaces jail with a kernel that will not remount / read-only.
    script = _executable(tmp_path / "jail_namespaces_failing.py", f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("jail_namespaces",
                                                      {sandbox.NAMESPACES_SCRIPT!r})
        jail = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(jail)
        mount = jail._mount

        def failing(libc, source, target, fstype, flags, data=None):
            if flags & jail._MS_REMOUNT and target == "/":
                raise OSError(1, "mount /: Operation not permitted")
            return mount(libc, source, target, fstype, flags, data)

        jail._mount = failing
        jail.runner.main(jail.enter)
        """)
    monkeypatch.setattr(sandbox, "NAMESPACES_SCRIPT", str(script))
    with pytest.raises(sandbox.SandboxError,
                       match=r"^the namespaces sandbox is incomplete \(mounts not read-only: "
                             r"\['/'\], pid namespace: True\); refusing to run$"):
        apps.run_solution(ADD, STDIN_IO, 2.0, sandbox="namespaces")


def test_unknown_sandbox():
    with pytest.raises(ValueError, match=r"sandbox must be one of \('bubblewrap', "
                                         r"'namespaces'\), got 'docker'"):
        apps.run_solution(ADD, STDIN_IO, 2.0, sandbox="docker")


# ---- memory budget of parallel sandboxes ----------------------------------------------------

def test_parallel_sandboxes_must_fit_the_host(monkeypatch):
    monkeypatch.setattr(sandbox, "_host_memory_mb", lambda: 20000)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    limits = sandbox.SandboxLimits()
    # pipe buffers: 4 processes x 64 open files x 16 pages of 4 KiB
    assert limits.pipe_buffer_bytes == 4 * 64 * 16 * os.sysconf("SC_PAGE_SIZE")
    assert limits.program_memory_mb == 2048 * 4 + 64 + limits.pipe_buffer_bytes // 2**20
    assert sandbox.parallel_sandboxes(2, limits) == 2
    assert sandbox.parallel_sandboxes(None, limits) == 2  # one per CPU, as many as fit
    assert sandbox.parallel_sandboxes(0, SMALL) == 8
    with pytest.raises(ValueError) as error:
        sandbox.parallel_sandboxes(3, limits, setting="config.task.unit_test_workers")
    assert str(error.value) == (
        "config.task.unit_test_workers=3: 3 parallel sandboxes x 8272 MiB per program "
        "(memory_mb=2048 x max_processes=4 + workdir_mb=64 + pipe buffers 16) = 24816 MiB do "
        "not fit in this host's 20000 MiB (MemTotal); use at most 2 workers or a smaller "
        "memory limit")
    with pytest.raises(ValueError, match=r"^max_workers=3: 3 parallel sandboxes"):
        apps.run_solutions([ADD], STDIN_IO, 2.0, max_workers=3)  # refused before running
    with pytest.raises(ValueError, match=r"max_workers must be an int >= 0"):
        apps.run_solutions([ADD], STDIN_IO, 2.0, max_workers=-1)


def test_host_memory_is_memtotal():
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert sandbox._host_memory_mb() == total_kb // 1024


# ---- config wiring and the eval output -------------------------------------------------------

def _apps_config(**task):
    config = base_config()
    config.task.name = "apps"
    config.rm.steps = 0
    config.task.update(task)
    return config


def test_config_selects_the_sandbox_and_its_limits(monkeypatch):
    options = unit_test_reward.unit_test_options(_apps_config(sandbox="namespaces",
                                                        unit_test_memory_mb=512,
                                                        unit_test_workers=2,
                                                        unit_test_timeout_s=3.0))
    assert options == {"timeout_s": 3.0, "max_workers": 2, "sandbox": "namespaces",
                       "allow_unfiltered_jail": False,
                       "limits": sandbox.SandboxLimits(timeout_s=3.0, memory_mb=512)}
    default = unit_test_reward.unit_test_options(_apps_config())
    assert default["sandbox"] == "bubblewrap" and default["max_workers"] is None
    check = unit_test_reward.check_unit_test_config
    with pytest.raises(ValueError, match=r"^config\.task\.sandbox='docker': must be one of"):
        check(_apps_config(sandbox="docker"))
    with pytest.raises(ValueError, match=r"^config\.task\.unit_test_memory_mb=0: must be"):
        check(_apps_config(unit_test_memory_mb=0))
    monkeypatch.setattr(sandbox, "_host_memory_mb", lambda: 20000)
    with pytest.raises(ValueError, match=r"^config\.task\.unit_test_workers=64: 64 parallel "
                                         r"sandboxes x 8272 MiB per program"):
        check(_apps_config(unit_test_workers=64))
    check(_apps_config(unit_test_workers=2))


def test_unit_test_reward_runs_in_the_configured_sandbox():
    reward = unit_test_reward.UnitTestReward(None, [STDIN_IO], **unit_test_reward.unit_test_options(
        _apps_config(sandbox="namespaces", unit_test_timeout_s=2.0)))
    assert reward.run_options["sandbox"] == "namespaces" and reward.timeout_s == 2.0


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_eval_reports_which_sandbox_ran(sandbox_name):
    task = types.SimpleNamespace(info={"eval_records": [{"input_output": STDIN_IO}]})
    config = _apps_config(sandbox=sandbox_name)
    config.eval.pass_at_k = (1,)
    passed, summary = run_eval.apps_results(
        config, task, np.array([0, 0]), {"policy": [ADD, "print(1)"], "sft": [ADD, ADD]}, 2)
    assert passed == {"policy": [1.0, 0.0], "sft": [1.0, 1.0]}
    assert summary["isolation"]["sandbox"] == sandbox_name
    assert summary["isolation"]["host_files_hidden"] is (sandbox_name == "bubblewrap")
    assert summary["policy"]["pass@1"] == 0.5 and summary["sft"]["pass@1"] == 1.0


def test_unit_test_reward():
    assert apps.unit_test_reward([True, False, True, True]) == 0.75
    assert apps.unit_test_reward([True, -1, False, True]) == 0.5
    assert apps.unit_test_reward([-2, -2]) == 0.0
    assert apps.unit_test_reward([]) == 0.0
    assert apps.unit_test_reward([np.True_, np.False_]) == 0.5


def _brute_force_pass_at_k(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(apps.pass_at_k(n, c, k), _brute_force_pass_at_k(n, c, k),
                                    rel_tol=1e-12, abs_tol=1e-12)
    # large n stays finite and matches the closed form
    assert math.isclose(apps.pass_at_k(1000, 10, 5),
                        1 - math.comb(990, 5) / math.comb(1000, 5), rel_tol=1e-12)
    for bad in [(0, 0, 1), (3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError):
            apps.pass_at_k(*bad)


def test_apps_pass_at_k():
    problems = [
        [[True, True], [True, False], [-2]],           # 1 of 3 samples passes all its tests
        [[False], [True], [True]],                     # 2 of 3
        [[], [True], [-1]],                            # an empty result list never passes
    ]
    expected = np.mean([_brute_force_pass_at_k(3, c, 2) for c in (1, 2, 1)])
    assert math.isclose(apps.apps_pass_at_k(problems, 2), expected)
    assert math.isclose(apps.apps_pass_at_k(problems, 1), np.mean([1 / 3, 2 / 3, 1 / 3]))
    with pytest.raises(ValueError, match="fewer than k"):
        apps.apps_pass_at_k(problems, 4)
