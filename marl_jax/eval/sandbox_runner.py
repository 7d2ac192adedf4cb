"""The jailed side of the sandbox: compile one program, run it once per test case, each case in
a fresh process, and report what each case printed or returned.

The caller (`marl_jax.eval.sandbox.run_program`) starts this file (or `jail_namespaces.py`,
which loads it) as a script with `python -I -B`, writes a JSON payload on its stdin and reads
JSON lines from its stdout. It uses the standard library only: inside the bubblewrap jail
nothing else exists (the caller binds numpy next to it, because the APPS prelude imports it),
and it must never import the caller's packages. The caller imports it too, for the plain-data codec.

Who built the jail this process runs in:

- `bubblewrap` (run as this script): bwrap did, before starting this process as pid 1 of new
  pid, network, ipc, uts and mount namespaces, on a new root holding only the interpreter,
  under a seccomp filter, with no_new_privs (see `marl_jax.eval.jail_bwrap`). As host root
  (bwrap made no user namespace then, and left this process CAP_SETUID and CAP_SETGID only)
  it first becomes the sandbox's otherwise unused uid, so nothing here holds a capability and
  RLIMIT_NPROC applies (the kernel never applies it to uid 0).
- `namespaces` (run as `jail_namespaces.py`, which calls `main` with its own `enter`): that
  module builds it here with hand-written Linux namespaces and loads the seccomp filter the
  caller sent (weaker: host files stay readable).

Either way the jail is checked before anything of the program runs; an incomplete one is
reported as a `sandbox_error` and nothing runs. Process layout: this process (pid 1 of the
sandbox) forks one worker per test case, which sets rlimits, drops what is left to drop, and
runs the program on one input; after each case every other process of the sandbox is
SIGKILLed and the working directory is emptied, so no state leaks between cases. Expected
outputs never come here: only what each case printed (stdin programs) or returned (call-based
programs, encoded as plain data) goes back, and the caller compares.
"""
from __future__ import annotations

import base64
import collections
import ctypes
import json
import math
import os
import resource
import select
import shutil
import signal
import sys
import time

WORKDIR = "/tmp/sandbox"
JAIL_DIR = "/jail"
"""In the bubblewrap jail: this file is bound read-only at JAIL_DIR/runner.py and numpy (with
its bundled libraries) under SITE_DIR, the only directory added to sys.path."""
SITE_DIR = JAIL_DIR + "/site"
_EXIT_INTERNAL = 70
_EXIT_RUNTIME = 1
_EXIT_SETUP = 3
PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4

# The APPS evaluator prepends these imports to every program; many solutions rely on them
# (for example `List` in LeetCode-style signatures).
_PRELUDE = (
    "import sys",
    "import time",
    "import itertools",
    "from itertools import accumulate, product, permutations, combinations",
    "import collections",
    "from collections import Counter, OrderedDict, deque, defaultdict, ChainMap",
    "from functools import lru_cache",
    "import math",
    "from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2",
    "import fractions",
    "from typing import List, Tuple",
    "import numpy as np",
    "import random",
    "import heapq",
    "from heapq import *",
)

Jail = collections.namedtuple("Jail", "isolation drop_privileges nproc_offset")
Jail.__doc__ = """A complete jail: `isolation`, its self-report; `drop_privileges()`, what each
worker still has to call (None when nothing is left to drop); `nproc_offset`, processes of the
worker's uid that are not the program's (this process when it shares the worker's uid)."""


class JailError(RuntimeError):
    """The jail is missing or incomplete: nothing of the program may run."""


# ---------------------------------------------------------------------------------------------
# Plain-data codec for arguments and returned values (both sides)
# ---------------------------------------------------------------------------------------------


class Unsupported:
    """A returned value of a type that has no plain-data form (set, custom object, ...).

    It equals nothing, so such a result never matches an expected output."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = object.__hash__

    def __repr__(self):
        return f"Unsupported({self.type_name})"


def encode_value(value) -> str:
    """Plain-data JSON of a returned value: tuples become lists at every depth, dicts keep
    their key types ({"d": [[k, v], ...]}), numpy values become Python values, anything else
    becomes {"u": type name} (never equal to an expected output)."""

    def plain(x):
        if x is None or type(x) is bool:
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x)
        if isinstance(x, str):
            return str(x)
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {"d": [[plain(k), plain(v)] for k, v in x.items()]}
        if type(x).__module__.split(".")[0] == "numpy" and hasattr(x, "tolist"):
            return plain(x.tolist())
        return {"u": type(x).__name__}

    return json.dumps(plain(value))


def decode_value(text: str):
    """Inverse of `encode_value`: JSON with dicts as {"d": [[k, v], ...]} and sentinels."""

    def hook(obj):
        if "d" in obj:
            return {_hashable(k): v for k, v in obj["d"]}
        return Unsupported(str(obj.get("u", "?")))

    return json.loads(text, object_hook=hook)


def _hashable(key):
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def sandbox_env() -> dict:
    """The whole environment of the sandbox (the caller starts the jail with it)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": WORKDIR,
        "TMPDIR": WORKDIR,
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


# ---------------------------------------------------------------------------------------------
# libc, path and output helpers (shared with jail_namespaces.py and jail_bwrap)
# ---------------------------------------------------------------------------------------------


def load_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def check(result: int, what: str):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(libc, option, arg):
    check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def outermost(paths) -> list:
    """`paths` without those inside another one of them, sorted."""
    kept = []
    for path in sorted(set(paths)):
        if not any(is_under(path, k) for k in kept):
            kept.append(path)
    return kept


def emit(message: dict):
    data = (json.dumps(message) + "\n").encode()
    while data:
        written = os.write(1, data)
        data = data[written:]


# ---------------------------------------------------------------------------------------------
# The bubblewrap jail: check what bwrap built
# ---------------------------------------------------------------------------------------------


def _proc_status() -> dict:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _network_interfaces() -> list:
    with open("/proc/self/net/dev") as f:
        return sorted(line.split(":")[0].strip() for line in f.readlines()[2:])


def _enter_bubblewrap(payload: dict, libc) -> Jail:
    """What bwrap built, checked: the jail of this process (see the module docstring)."""
    uid = payload["uid"]
    mode = "user_namespace"
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        mode = "root"
    if os.path.isdir(SITE_DIR):
        sys.path.append(SITE_DIR)
    status = _proc_status()
    interfaces = _network_interfaces()
    isolation = {
        "sandbox": "bubblewrap", "mode": mode, "worker_uid": os.getuid(),
        "host_files_hidden": True, "root_entries": sorted(os.listdir("/")),
        "network_namespace": interfaces == ["lo"], "network_interfaces": interfaces,
        "pid_namespace": os.getpid() == 1, "process_limit": os.getuid() != 0,
        "seccomp": status.get("Seccomp") == "2", "no_new_privs": status.get("NoNewPrivs") == "1",
        "capabilities": [name for name in ("CapPrm", "CapEff", "CapAmb")
                         if int(status.get(name, "1"), 16)],
    }
    missing = [what for what, ok in (
        ("seccomp filter", isolation["seccomp"]), ("no_new_privs", isolation["no_new_privs"]),
        ("capabilities dropped", not isolation["capabilities"]),
        ("network namespace", isolation["network_namespace"]),
        ("pid namespace", isolation["pid_namespace"]),
        ("unprivileged uid", isolation["process_limit"])) if not ok]
    if missing:
        raise JailError(f"the bubblewrap jail is incomplete (missing: {', '.join(missing)}); "
                        f"refusing to run: {isolation}")
    return Jail(isolation, None, 1)


# ---------------------------------------------------------------------------------------------
# Running the cases
# ---------------------------------------------------------------------------------------------


def _load_prelude() -> dict:
    namespace = {"__builtins__": __builtins__}
    for line in _PRELUDE:
        try:
            exec(line, namespace)
        except Exception:  # numpy may be absent; the program then fails on its own
            pass
    return namespace


def _worker(ctx: dict, case: dict, out_fd: int):
    """Runs in the forked worker; never returns."""
    import builtins
    import io

    libc = ctx["libc"]
    limits = ctx["limits"]
    os.setsid()
    prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
    # An unnamed file of the working directory's tmpfs: its size is counted there (the
    # jails refuse memfds).
    stdin_fd = os.open(WORKDIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    data = case.get("stdin", "").encode("utf-8", "surrogateescape")
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view):]
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    devnull = os.open("/dev/null", os.O_RDWR)
    call_based = ctx["fn_name"] is not None
    os.dup2(stdin_fd, 0)
    os.dup2(devnull if call_based else out_fd, 1)
    os.dup2(devnull, 2)
    result_fd = os.dup(out_fd) if call_based else 1
    keep = max(result_fd, 2)
    os.closerange(3, result_fd)
    os.closerange(keep + 1, 1 << 20)

    cpu = int(math.ceil(limits["timeout_s"])) + 1
    for which, value in ((resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, limits["memory_mb"] << 20),
                         (resource.RLIMIT_FSIZE, limits["max_file_mb"] << 20),
                         (resource.RLIMIT_NOFILE, limits["max_open_files"]),
                         (resource.RLIMIT_NPROC, limits["max_processes"] + ctx["nproc_offset"])):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))
    if ctx["drop_privileges"] is not None:
        ctx["drop_privileges"]()
    prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
    os.environ.clear()
    os.environ.update(sandbox_env())

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
        errors="surrogateescape")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
        errors="backslashreplace")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
        errors="backslashreplace")
    sys.argv = ["solution.py"]
    namespace = dict(ctx["prelude"])
    namespace["__builtins__"] = builtins

    if not call_based:
        namespace["__name__"] = "__main__"
        status = 0
        try:
            exec(ctx["code_obj"], namespace)
        except SystemExit:  # any exit status: the APPS evaluator also just compares the output
            pass
        except BaseException:
            status = _EXIT_RUNTIME
        try:
            sys.stdout.flush()
        except BaseException:
            status = _EXIT_RUNTIME
        os._exit(status)

    namespace["__name__"] = "solution"
    args = decode_value(case["args"])
    try:
        exec(ctx["code_obj"], namespace)
        function = None
        if "class Solution" in ctx["code"] and "Solution" in namespace:
            function = getattr(namespace["Solution"](), ctx["fn_name"], None)
        if function is None:
            function = namespace[ctx["fn_name"]]
    except BaseException:
        os._exit(_EXIT_SETUP)
    try:
        encoded = encode_value(function(*args)).encode()
        view = memoryview(encoded)
        while view:
            view = view[os.write(result_fd, view):]
    except BaseException:
        os._exit(_EXIT_RUNTIME)
    os._exit(0)


def _kill_namespace_except_init():
    """Kill every process of the sandbox's pid namespace except this init process."""
    if os.getpid() == 1:  # never outside a pid namespace: -1 would reach the host's processes
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _run_case(ctx: dict, index: int, case: dict) -> dict:
    limits = ctx["limits"]
    cap = limits["max_output_bytes"]
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            _worker(ctx, case, write_fd)
        finally:
            os._exit(_EXIT_INTERNAL)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    pid_fd = os.pidfd_open(pid)
    deadline = start + limits["timeout_s"]
    output = bytearray()
    status, wait_status, eof = None, None, False

    def drain() -> bool:
        nonlocal eof
        while not eof:
            try:
                chunk = os.read(read_fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                eof = True
            output.extend(chunk)
            if len(output) > cap:
                return False
        return True

    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        watch = [pid_fd] if eof else [pid_fd, read_fd]
        ready, _, _ = select.select(watch, [], [], remaining)
        if read_fd in ready and not drain():
            status = "output_limit"
        elif pid_fd in ready:
            _, wait_status = os.waitpid(pid, 0)
            if not drain():
                status = "output_limit"
            break
    wall = time.monotonic() - start
    _kill_namespace_except_init()
    _empty_workdir()
    os.close(read_fd)
    os.close(pid_fd)
    if status is None:
        status = _status_from_wait(wait_status)
    message = {"i": index, "status": status, "wall_s": round(wall, 4)}
    if status == "ok":
        if ctx["fn_name"] is not None and not output:
            message["status"] = "runtime_error"
        else:
            message["out"] = base64.b64encode(bytes(output)).decode()
    return message


def _empty_workdir():
    """Test cases must not see each other's files. A program may have closed its directories
    to listing or writing: their owner (this process's uid) opens them up again first."""
    try:
        os.chmod(WORKDIR, 0o777)
    except OSError:  # not this uid's (root mode: bwrap's); then not the program's either
        pass
    for root, dirs, _ in os.walk(WORKDIR):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, 0o700)
                except OSError:
                    pass
    for entry in os.scandir(WORKDIR):
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _status_from_wait(wait_status: int) -> str:
    if os.WIFEXITED(wait_status):
        code = os.WEXITSTATUS(wait_status)
        if code == 0:
            return "ok"
        if code == _EXIT_SETUP:
            return "compile_error"
        return "runtime_error"
    if os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGXCPU:
        return "timeout"
    return "runtime_error"


def _serve(payload: dict, jail: Jail, libc):
    """pid 1 of the sandbox: compile the program, then run the cases one by one."""
    import warnings

    # pid 1 ignores the signals it has no handler for, even SIGKILL, from inside its namespace;
    # Python's SIGINT handler would let the program interrupt it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    isolation = dict(jail.isolation)
    isolation["pid_namespace_inode"] = os.stat("/proc/self/ns/pid").st_ino
    # Not dumpable: the program (possibly of the same uid) cannot ptrace this process or open
    # /proc/1/fd/*.
    prctl(libc, _PR_SET_DUMPABLE, 0)
    prelude = _load_prelude()
    warnings.simplefilter("ignore")
    try:
        code_obj = compile(payload["code"], "solution.py", "exec", dont_inherit=True)
    except BaseException:
        emit({"isolation": isolation, "compile_error": True})
        return
    emit({"isolation": isolation, "compile_error": False})
    ctx = {"libc": libc, "limits": payload["limits"], "prelude": prelude,
           "code": payload["code"], "code_obj": code_obj, "fn_name": payload["fn_name"],
           "drop_privileges": jail.drop_privileges, "nproc_offset": jail.nproc_offset}
    for index, case in enumerate(payload["cases"]):
        emit(_run_case(ctx, index, case))


def main(enter):
    """Read the payload, enter the jail (`enter(payload, libc) -> Jail`), run the cases."""
    payload = json.loads(sys.stdin.buffer.read().decode("utf-8", "surrogatepass"))
    libc = load_libc()
    try:
        _serve(payload, enter(payload, libc), libc)
    except BaseException as error:
        message = str(error) if isinstance(error, JailError) else f"sandbox failed: {error!r}"
        emit({"isolation": {}, "sandbox_error": message})
        os._exit(_EXIT_INTERNAL)
    os._exit(0)


if __name__ == "__main__":
    main(_enter_bubblewrap)
