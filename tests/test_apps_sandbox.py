"""APPS execution in the sandbox: verdicts, the reference comparison, escapes contained,
unit-test reward and pass@k."""
import itertools
import json
import math
import os
import socket
import time
import uuid

import numpy as np
import pytest

from marl_jax.eval import apps, sandbox

STDIN_IO = {"inputs": ["1 2\n", "3 4\n", "-5 5\n"], "outputs": ["3\n", "7\n", "0\n"]}
CALL_IO = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [10, -3]], "outputs": [[3], [7], [7]]}
ONE_CASE = {"inputs": ["\n"], "outputs": ["done\n"]}
FAST = sandbox.SandboxLimits(timeout_s=2.0)


def _processes_in_pid_namespace(inode):
    """pids (host view) of the processes living in the pid namespace with this inode."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}/ns/pid").st_ino == inode:
                found.append(int(name))
        except OSError:
            continue
    return found


def test_isolation_report():
    report = sandbox.describe_isolation()
    assert report["network_namespace"] and report["pid_namespace"]
    assert report["not_read_only"] == []
    assert "/tmp" in report["hidden"]
    assert report["mode"] == ("root" if os.geteuid() == 0 else "user_namespace")
    # the unprivileged worker can import modules the sandbox did not preload, wherever the
    # interpreter is installed (e.g. a pyenv under /root, closed to other users)
    run = sandbox.run_program("import sqlite3, decimal, fractions, json\nprint('imported')",
                              [""], limits=FAST)
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
def test_stdin_programs(code, codes):
    result = apps.evaluate_solution(code, json.dumps(STDIN_IO), 2.0)
    assert result.codes == codes
    assert apps.run_solution(code, STDIN_IO, 2.0) == [c is True for c in codes]


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
def test_call_based_programs(code, codes):
    assert apps.evaluate_solution(code, CALL_IO, 2.0).codes == codes


def test_call_based_values_like_the_reference():
    io = {"fn_name": "f", "inputs": [[{"1": 2}], [3], [4]],
          "outputs": [[{"1": 2}], [[1, 2]], [[[4, 5]]]]}
    code = ("def f(x):\n    if isinstance(x, dict):\n        return {k: v for k, v in x.items()}\n"
            "    if x == 3:\n        return (1, 2)\n    return [(4, 5)]")
    # dict keys are ints again on both sides; tuples compare as lists; output[0] unwrapped.
    assert apps.run_solution(code, io) == [True, True, True]
    numpy_code = ("import numpy as np\ndef f(x):\n"
                  "    return np.int64(7) if x == 3 else np.array([1.5])")
    assert apps.run_solution(numpy_code, {"fn_name": "f", "inputs": [[3], [4]],
                                          "outputs": [[7], [[1.5]]]}) == [True, True]


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


def test_infinite_loop_is_killed_on_time():
    start = time.monotonic()
    result = apps.evaluate_solution("while True:\n    pass", ONE_CASE, 1.0)
    elapsed = time.monotonic() - start
    assert result.codes == (-1,) and result.statuses == ("timeout",)
    assert elapsed < 1.0 + 2.0
    # ignoring SIGXCPU and sleeping do not escape the wall-clock deadline either
    code = "import signal, time\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\ntime.sleep(60)"
    start = time.monotonic()
    assert apps.evaluate_solution(code, ONE_CASE, 1.0).statuses == ("timeout",)
    assert time.monotonic() - start < 1.0 + 2.0


def test_huge_allocation_fails():
    code = "x = bytearray(16 * 2**30)\nprint('done')"
    result = apps.evaluate_solution(code, ONE_CASE, 2.0)
    assert result.codes == (-1,) and result.statuses == ("runtime_error",)


def test_fork_bomb_is_bounded_and_cleaned_up():
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError:\n    pass\nprint(n, len([p for p in os.listdir('/proc') "
            "if p.isdigit()]))")
    run = sandbox.run_program(code, [""], limits=sandbox.SandboxLimits(timeout_s=5.0,
                                                                        max_processes=16))
    case = run.cases[0]
    assert case.status == "ok"
    forks, visible = map(int, case.output.split())
    assert 0 < forks < 16  # RLIMIT_NPROC stopped it (the worker itself counts)
    assert visible == forks + 2  # the sandbox saw only its init, the worker and the forks
    # nothing is left of the sandbox afterwards: no process in its pid namespace or of its uid
    assert _processes_in_pid_namespace(run.isolation["pid_namespace_inode"]) == []
    if run.isolation["mode"] == "root":
        uids = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                uids.append(os.stat(f"/proc/{name}").st_uid)
            except OSError:
                continue
        assert run.isolation["worker_uid"] not in uids


def test_writes_outside_workdir_do_not_land(tmp_path):
    targets = [tmp_path / "escape.txt", f"/tmp/escape-{uuid.uuid4().hex}.txt",
               os.path.join(os.path.dirname(apps.__file__), "escape.txt")]
    code = ("import os\nfor path in %r:\n    try:\n        with open(path, 'w') as f:\n"
            "            f.write('x')\n        print('wrote', path)\n    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n"
            "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
            % [str(t) for t in targets])
    run = sandbox.run_program(code, [""], limits=FAST)
    assert run.cases[0].status == "ok"
    assert "wrote" not in run.cases[0].output
    assert run.cases[0].output.endswith("fine\n")  # the working directory is writable
    for target in targets:
        assert not os.path.exists(target)


def test_loopback_connection_never_arrives():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    code = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=1)\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)" % port)
    try:
        run = sandbox.run_program(code, [""], limits=FAST)
        server.settimeout(0.3)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert run.cases[0].status == "ok" and run.cases[0].output.startswith("refused")


def test_killing_the_parent_fails():
    code = ("import os, signal\nfor pid in (os.getppid(), %d):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n        print('sent')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n"
            "    print(type(e).__name__)\nprint('after')" % os.getpid())
    run = sandbox.run_program(code, [""], limits=FAST)
    # Still alive to read the result: the parent is the sandbox's init (immune to SIGKILL from
    # inside, or another uid), the test's pid does not exist in the sandbox's pid namespace.
    lines = run.cases[0].output.split()
    assert lines[1] == "ProcessLookupError" and lines[-1] == "after"
    assert os.getppid() > 0


def test_huge_output_is_capped():
    limits = sandbox.SandboxLimits(timeout_s=5.0, max_output_bytes=1 << 16)
    start = time.monotonic()
    run = sandbox.run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", [""],
                              limits=limits)
    assert run.cases[0].status == "output_limit"
    assert time.monotonic() - start < 4.0  # stopped by the cap, not the timeout
    assert apps.run_solution("while True:\n    print('x' * 4096)", ONE_CASE, 5.0) == [False]


def test_cases_are_independent_and_stop_early():
    code = ("import os\nprint(os.path.exists('state'))\nopen('state', 'w').close()\n"
            "print(os.getpid())")
    run = sandbox.run_program(code, ["", ""], limits=FAST)
    # a fresh process and an emptied working directory per case
    assert [c.output.split()[0] for c in run.cases] == ["False", "False"]
    io = {"inputs": ["1", "2", "3"], "outputs": ["1", "0", "3"]}
    result = apps.evaluate_solution("print(input())", io, 2.0, stop_at_first_failure=True)
    assert result.statuses == ("ok", "ok", "not_run") and result.codes == (True, False, -1)


def test_run_solutions_parallel_keeps_order():
    codes = ["print(int(input()) * 2)", "print(int(input()) + 2)", "print(", "print(4)"]
    io = {"inputs": ["2", "3"], "outputs": ["4", "6"]}
    assert apps.run_solutions(codes, io, 2.0, max_workers=3) == [
        [True, True], [True, False], [False, False], [True, False]]
    with pytest.raises(ValueError, match="input_outputs"):
        apps.run_solutions(codes, [io], 2.0)


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
