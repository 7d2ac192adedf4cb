"""Run untrusted Python programs in a contained process, one fresh process per test case.

The caller side (`run_program`) starts this very file as a script: `python -I -B sandbox.py`.
Standard library only, so the script never imports the caller's packages.

Process layout (one sandbox per program, all test cases of that program)::

    caller (trainer thread)
      `- P  host-side launcher: reads the payload, unshare()s, forks C, waits for it
          `- C  pid 1 of a new pid namespace: mounts, compiles, runs the cases one by one
              `- W  one per test case: rlimits, unprivileged, runs the program on one input

Containment, all without extra packages (Linux namespaces through libc, Python >= 3.9):

- network: a new network namespace with only a loopback device that is down; no connection
  leaves it (TCP, UDP, abstract Unix sockets). Path-based Unix sockets are hidden by empty
  read-only mounts over /run, /tmp, /var/tmp and /dev/shm.
- processes: a new pid namespace; the program sees only its own processes, so it cannot signal
  the caller or anything else on the machine. Each test case runs in a fresh worker process;
  after every case every process of the namespace except C is SIGKILLed and the working
  directory is emptied, so no state leaks between cases. When C dies the kernel kills the whole
  namespace; C dies with P (PDEATHSIG) and the caller kills P's process group on its own
  wall-clock deadline.
- filesystem: a new mount namespace in which every mount is remounted read-only; /tmp, /run,
  /var/tmp and /dev/shm are covered by empty read-only tmpfs mounts, and /tmp holds the working
  directory, a small writable tmpfs (`workdir_mb`). Nothing the program writes reaches the
  host's disk; all of it vanishes with the namespace. Other host files stay readable (the
  interpreter and its libraries must be), within the worker's permissions.
- privileges: as root, the worker switches to an otherwise unused uid (2**30 + pid of P), so it
  holds no capabilities and RLIMIT_NPROC (which never applies to uid 0) counts only its own
  processes. As a non-root user a new user namespace is created and the worker drops every
  capability. `no_new_privs` is set either way.
- resources per worker: RLIMIT_CPU (timeout + 1 s), RLIMIT_AS (memory), RLIMIT_FSIZE,
  RLIMIT_NPROC (bounded forks), RLIMIT_NOFILE, RLIMIT_CORE = 0; a wall-clock deadline per case;
  stdout is read up to a byte cap and the worker is killed beyond it.

Expected outputs never enter the sandbox: C only returns what each case printed (stdin
programs) or returned (call-based programs, encoded as plain data), and the caller compares.
"""
from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

STATUSES = ("ok", "runtime_error", "timeout", "output_limit", "compile_error", "not_run")
"""Case statuses. `ok` means the program ran to the end (its output still has to be compared);
`compile_error` means the source does not compile or, for call-based programs, the module body
failed or the function was not found (the APPS evaluator's code -2)."""

_WORKDIR = "/tmp/sandbox"
_EXIT_RUNTIME = 1
_EXIT_SETUP = 3
_EXIT_INTERNAL = 70
_NON_ROOT_UID_BASE = 1 << 30

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


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the program under test)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program.

    timeout_s: wall-clock budget of ONE test case (also sets RLIMIT_CPU to ceil(timeout_s) + 1).
    memory_mb: RLIMIT_AS of each process of the program (address space, including the
      interpreter's ~0.5 GiB). It is a per-process limit: a program that forks can hold up to
      max_processes * memory_mb in total (cap the total, if needed, by running the caller in a
      memory cgroup, e.g. `systemd-run --scope -p MemoryMax=...`).
    max_processes: RLIMIT_NPROC of each worker (processes and threads of the program,
      including the worker itself).
    max_open_files: RLIMIT_NOFILE.
    max_file_mb: RLIMIT_FSIZE, the largest file the program may write.
    max_output_bytes: stdout (or encoded return value) kept per case; beyond it the case stops
      with status `output_limit`.
    workdir_mb: size of the writable tmpfs that is the program's working directory.
    startup_s: budget for starting the sandbox and compiling, on top of the per-case budgets.
    """

    timeout_s: float = 4.0
    memory_mb: int = 2048
    max_processes: int = 8
    max_open_files: int = 64
    max_file_mb: int = 16
    max_output_bytes: int = 1 << 20
    workdir_mb: int = 64
    startup_s: float = 30.0

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < 3600):
            raise ValueError(f"timeout_s must be a number in (0, 3600), got {self.timeout_s!r}")
        for name in ("memory_mb", "max_processes", "max_open_files", "max_file_mb",
                     "max_output_bytes", "workdir_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_open_files < 8:
            raise ValueError(f"max_open_files must be >= 8, got {self.max_open_files}")
        if not (isinstance(self.startup_s, (int, float)) and self.startup_s > 0):
            raise ValueError(f"startup_s must be a positive number, got {self.startup_s!r}")


@dataclasses.dataclass(frozen=True)
class CaseRun:
    """What one test case did. `output`: stdout text (stdin programs) or the returned value
    decoded to plain Python data (call-based programs); None unless status is `ok`."""

    status: str
    output: Any = None
    wall_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProgramRun:
    """All cases of one program. `isolation` describes what the sandbox contained; `error` is
    an internal failure of the sandbox after it started (its unfinished cases are `not_run`)."""

    compile_error: bool
    cases: tuple
    isolation: dict
    wall_s: float
    error: Optional[str] = None


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


# ---------------------------------------------------------------------------------------------
# Plain-data codec for arguments and returned values (both sides)
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Caller side
# ---------------------------------------------------------------------------------------------


def _sandbox_env() -> dict:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": _WORKDIR,
        "TMPDIR": _WORKDIR,
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def run_program(code: str, cases: Sequence, *, fn_name: Optional[str] = None,
                limits: SandboxLimits = SandboxLimits(),
                should_continue: Optional[Callable[[int, CaseRun], bool]] = None) -> ProgramRun:
    """Run `code` once per case in the sandbox.

    Args:
      code: Python source.
      cases: stdin programs (fn_name None): one input string per case; call-based programs:
        one list of positional arguments (plain JSON data) per case.
      fn_name: name of the function to call (a module-level function, or a method of
        `Solution()` when the source defines `class Solution`).
      limits: resource limits.
      should_continue: called after each finished case with (index, CaseRun); returning False
        stops the sandbox, the remaining cases get status `not_run`. Cases still unfinished
        when the overall budget (startup_s + per case timeout_s + 1 s) runs out get `timeout`.
    Returns:
      ProgramRun with one CaseRun per case. Only a failure to set up the sandbox raises
      (`SandboxError`); anything the program does ends up in the case statuses.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"fn_name must be a Python identifier or None, got {fn_name!r}")
    cases = list(cases)
    payload_cases = []
    for i, case in enumerate(cases):
        if fn_name is None:
            if not isinstance(case, str):
                raise ValueError(f"cases[{i}] must be a str (stdin) for a stdin program, "
                                 f"got {type(case).__name__}")
            payload_cases.append({"stdin": case})
        else:
            if not isinstance(case, (list, tuple)):
                raise ValueError(f"cases[{i}] must be a list of arguments for fn_name "
                                 f"{fn_name!r}, got {type(case).__name__}")
            payload_cases.append({"args": encode_value(list(case))})
    payload = json.dumps({
        "code": code,
        "fn_name": fn_name,
        "cases": payload_cases,
        "limits": dataclasses.asdict(limits),
    }).encode("utf-8", "surrogatepass")

    start = time.monotonic()
    budget = limits.startup_s + len(cases) * (limits.timeout_s + 1.0)
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", os.path.abspath(__file__)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=_sandbox_env(), cwd="/", close_fds=True)
    header, runs, stderr_tail, error = None, {}, b"", None
    try:
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        for kind, message in _read_messages(proc, start + budget):
            if kind == "stderr":
                stderr_tail = (stderr_tail + message)[-4000:]
            elif header is None and "isolation" in message:
                header = message
                if header.get("sandbox_error"):
                    break
            elif "sandbox_error" in message:
                error = message["sandbox_error"]
            elif "i" in message:
                case_run = _case_from_message(message, fn_name)
                runs[message["i"]] = case_run
                if should_continue is not None and not should_continue(message["i"], case_run):
                    break
    finally:
        _kill_group(proc)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    wall = time.monotonic() - start
    unfinished = "timeout" if wall >= budget else "not_run"
    if header is None:
        raise SandboxError("the sandbox did not start (exit status "
                           f"{proc.returncode}): {stderr_tail.decode('utf-8', 'replace')}")
    if header.get("sandbox_error"):
        raise SandboxError(header["sandbox_error"])
    compile_error = bool(header.get("compile_error"))
    if compile_error:
        results = tuple(CaseRun("compile_error") for _ in cases)
    else:
        results = tuple(runs.get(i, CaseRun(unfinished)) for i in range(len(cases)))
    return ProgramRun(compile_error, results, dict(header["isolation"]), wall, error)


def _case_from_message(message: dict, fn_name: Optional[str]) -> CaseRun:
    status = message["status"]
    if status not in STATUSES:
        status = "runtime_error"
    output = None
    if status == "ok":
        raw = base64.b64decode(message["out"])
        if fn_name is None:
            output = raw.decode("utf-8", "replace")
        else:
            try:
                output = decode_value(raw.decode("utf-8"))
            except (ValueError, TypeError, RecursionError):
                status = "runtime_error"
    return CaseRun(status, output, float(message.get("wall_s", 0.0)))


def _read_messages(proc: subprocess.Popen, deadline: float):
    """Yield ("msg", dict) for each JSON line C prints, ("stderr", bytes) for stderr chunks,
    until both pipes close or the deadline passes."""
    streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    for fd in streams:
        os.set_blocking(fd, False)
    pending = bytearray()
    while streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        ready, _, _ = select.select(list(streams), [], [], remaining)
        for fd in ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                del streams[fd]
                continue
            if streams[fd] == "err":
                yield "stderr", chunk
                continue
            pending += chunk
            while True:
                newline = pending.find(b"\n")
                if newline < 0:
                    break
                line = bytes(pending[:newline])
                del pending[:newline + 1]
                try:
                    yield "msg", json.loads(line)
                except ValueError:
                    continue


def _kill_group(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def describe_isolation(limits: SandboxLimits = SandboxLimits()) -> dict:
    """Start an empty sandbox and report what it contains on this machine (mode, namespaces,
    mounts that could not be made read-only). Raises SandboxError if it cannot start."""
    return dict(run_program("", [], limits=limits).isolation)


# ---------------------------------------------------------------------------------------------
# Sandbox side (runs as `python -I -B sandbox.py`)
# ---------------------------------------------------------------------------------------------

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_LOCKED_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                       "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
                       "relatime": _MS_RELATIME, "strictatime": _MS_STRICTATIME}
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def _check(result: int, what: str):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {target}")


def _prctl(libc, option, arg):
    _check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _emit(message: dict):
    data = (json.dumps(message) + "\n").encode()
    while data:
        written = os.write(1, data)
        data = data[written:]


def _unshare_namespaces(libc) -> str:
    """Move this process into new user (non-root only), mount, network, ipc, uts and pid
    namespaces (the pid namespace applies to the next child). Returns the mode."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if uid == 0 and libc.unshare(flags) == 0:
        return "root"
    _check(libc.unshare(flags | _CLONE_NEWUSER), "unshare (user namespace)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    return "user_namespace"


def _mount_table():
    """(mount point, per-mount options) of the current mount namespace, in order."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            table.append((point, fields[5].split(",")))
    return table


def _set_up_filesystem(libc, workdir_mb: int, owner: Optional[int]) -> dict:
    """Private, read-only view of the host; /tmp, /run, /var/tmp, /dev/shm hidden; a writable
    tmpfs working directory."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    not_read_only = []
    for point, options in _mount_table():
        if "ro" in options:
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for option in options:
            flags |= _LOCKED_MOUNT_FLAGS.get(option, 0)
        try:
            _mount(libc, None, point, None, flags)
        except OSError:
            not_read_only.append(point)
    interpreter = _interpreter_paths()
    covers = [p for p in ("/run", "/var/tmp", "/dev/shm", "/dev/mqueue", "/tmp")
              if os.path.isdir(p) and not os.path.islink(p)]
    if owner is not None:
        # The unprivileged worker must also read an interpreter that lives under a directory
        # closed to other users (e.g. a pyenv in /root): that directory is covered too.
        closed = {_closed_ancestor(p) for p in interpreter
                  if not any(_is_under(p, c) for c in covers)}
        covers += sorted(c for c in closed if c is not None)
    hidden = []
    for point in covers:
        keep = [p for p in interpreter if _is_under(p, point)]
        if point == "/tmp":
            _cover(libc, point, keep, workdir=(workdir_mb, owner))
            hidden.append(point)
        else:
            try:
                _cover(libc, point, keep)
                hidden.append(point)
            except OSError:
                pass
    try:
        _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
        own_proc = True
    except OSError:
        own_proc = False
    os.chdir(_WORKDIR)
    return {"not_read_only": not_read_only, "hidden": hidden, "own_proc": own_proc}


def _is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _cover(libc, point: str, keep: Sequence[str], workdir=None):
    """Cover `point` with an empty read-only tmpfs into which only the paths `keep` (under
    `point`) are bind-mounted back, read-only; with `workdir=(size_mb, owner)` also the
    writable working directory."""
    handles = {path: os.open(path, os.O_PATH) for path in keep}
    _mount(libc, "tmpfs", point, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=755")
    for path, handle in handles.items():
        if os.path.isdir(f"/proc/self/fd/{handle}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
        _mount(libc, f"/proc/self/fd/{handle}", path, None, _MS_BIND | _MS_REC)
        _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
        os.close(handle)
    if workdir is not None:
        size_mb, owner = workdir
        os.mkdir(_WORKDIR)
        options = f"size={size_mb}m,nr_inodes=4096,mode=700"
        if owner is not None:
            options += f",uid={owner},gid={owner}"
        _mount(libc, "tmpfs", _WORKDIR, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    _mount(libc, None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _interpreter_paths() -> list:
    """Directories (and zip files) the interpreter imports from, without nested duplicates."""
    candidates = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
    candidates.update(p for p in sys.path if p)
    minimal = []
    for path in sorted({os.path.realpath(p) for p in candidates if os.path.exists(p)}):
        if not any(_is_under(path, m) for m in minimal):
            minimal.append(path)
    return minimal


def _closed_ancestor(path: str) -> Optional[str]:
    """Shallowest strict ancestor of `path` that other users cannot traverse (no o+x)."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _load_prelude() -> dict:
    namespace = {"__builtins__": __builtins__}
    for line in _PRELUDE:
        try:
            exec(line, namespace)
        except Exception:  # numpy may be absent; the program then fails on its own
            pass
    return namespace


def _drop_privileges(libc, mode: str, uid: int):
    if mode == "root":
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:
        header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()
        _check(libc.capset(header, data), "capset")
    _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)


def _worker(ctx: dict, case: dict, out_fd: int):
    """Runs in the forked worker; never returns."""
    import builtins
    import io

    libc = ctx["libc"]
    limits = ctx["limits"]
    os.setsid()
    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
    stdin_fd = os.memfd_create("stdin", 0)
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
    memory = limits["memory_mb"] << 20
    for which, value in ((resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_FSIZE, limits["max_file_mb"] << 20),
                         (resource.RLIMIT_NOFILE, limits["max_open_files"]),
                         (resource.RLIMIT_NPROC, limits["max_processes"] + ctx["nproc_offset"])):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))
    _drop_privileges(libc, ctx["mode"], ctx["uid"])
    os.environ.clear()
    os.environ.update(_sandbox_env())

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
    if os.getpid() == 1:
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
    """Test cases must not see each other's files."""
    for entry in os.scandir(_WORKDIR):
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


def _init_main(payload: dict, libc, mode: str, uid: int):
    """C: pid 1 of the sandbox's pid namespace."""
    import warnings

    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    limits = payload["limits"]
    isolation = {"mode": mode, "network_namespace": True, "pid_namespace": os.getpid() == 1,
                 # The kernel never applies RLIMIT_NPROC to the host's uid 0.
                 "process_limit": mode == "root" or uid != 0}
    isolation.update(_set_up_filesystem(libc, limits["workdir_mb"],
                                        uid if mode == "root" else None))
    isolation["pid_namespace_inode"] = os.stat("/proc/self/ns/pid").st_ino
    isolation["worker_uid"] = uid
    # Not dumpable: the program (same uid in user-namespace mode) cannot open /proc/1/fd/*.
    _prctl(libc, _PR_SET_DUMPABLE, 0)
    prelude = _load_prelude()
    warnings.simplefilter("ignore")
    try:
        code_obj = compile(payload["code"], "solution.py", "exec", dont_inherit=True)
    except BaseException:
        _emit({"isolation": isolation, "compile_error": True})
        return
    _emit({"isolation": isolation, "compile_error": False})
    ctx = {"libc": libc, "limits": limits, "mode": mode, "uid": uid, "prelude": prelude,
           "code": payload["code"], "code_obj": code_obj, "fn_name": payload["fn_name"],
           # In a user namespace RLIMIT_NPROC also counts this init process.
           "nproc_offset": 0 if mode == "root" else 1}
    for index, case in enumerate(payload["cases"]):
        _emit(_run_case(ctx, index, case))


def _main():
    payload = json.loads(sys.stdin.buffer.read().decode("utf-8", "surrogatepass"))
    libc = _libc()
    try:
        mode = _unshare_namespaces(libc)
    except OSError as error:
        _emit({"isolation": {}, "sandbox_error": (
            f"cannot create Linux namespaces ({error}); run as root, or enable unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces > 0)")})
        return
    uid = _NON_ROOT_UID_BASE + os.getpid() if mode == "root" else os.geteuid()
    child = os.fork()
    if child == 0:
        try:
            _init_main(payload, libc, mode, uid)
        except BaseException as error:
            _emit({"isolation": {}, "sandbox_error": f"sandbox setup failed: {error!r}"})
            os._exit(_EXIT_INTERNAL)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    _main()
