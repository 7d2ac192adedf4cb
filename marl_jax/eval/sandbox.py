"""Run untrusted Python programs in a jail, one fresh process per test case (caller side).

`run_program(code, cases, sandbox=...)` starts one jail per program, sends it the program and
the inputs, and collects what each case printed or returned; expected outputs never enter the
jail (the caller compares). Two jails, both refusing to run rather than run weaker:

- `bubblewrap` (default; `jail_bwrap`): a new root that holds only the interpreter and its
  libraries, read-only, and a small tmpfs working directory; new pid, network, ipc, uts and
  mount namespaces; a seccomp filter; no capabilities, no_new_privs, an unused uid. Needs the
  `bwrap` binary (Debian: apt-get install bubblewrap) and pyseccomp (with libseccomp2). The
  program sees none of the host's files.
- `namespaces` (`jail_namespaces`): hand-written namespaces through libc, for machines without
  bubblewrap: network, processes, writes and memory are contained the same way, under the same
  seccomp filter (`seccomp_filter`), but every host file the worker's uid may read stays
  readable. Without libseccomp / pyseccomp it refuses to start, unless the caller allows an
  unfiltered jail (`allow_unfiltered_jail`, `config.eval.allow_unfiltered_jail`): a program may
  then reach host Unix sockets, and the isolation report says so.

Inside either jail `sandbox_runner` (standard library only) runs the cases: one forked worker
per case under RLIMIT_CPU (timeout + 1 s), RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE
and RLIMIT_CORE = 0, a wall-clock deadline, stdout read up to a byte cap; after each case
every process but the runner is killed and the working directory emptied. Each program may
hold up to `SandboxLimits.program_memory_mb`; `parallel_sandboxes` refuses more parallel
sandboxes than the host's memory holds.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from marl_jax.eval import jail_bwrap, seccomp_filter
from marl_jax.eval.sandbox_limits import SandboxError, SandboxLimits
from marl_jax.eval.sandbox_runner import decode_value, encode_value, sandbox_env

STATUSES = ("ok", "runtime_error", "timeout", "output_limit", "compile_error", "not_run")
"""Case statuses. `ok` means the program ran to the end (its output still has to be compared);
`compile_error` means the source does not compile or, for call-based programs, the module body
failed or the function was not found (the APPS evaluator's code -2)."""

SANDBOXES = ("bubblewrap", "namespaces")
NAMESPACES_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail_namespaces.py")
# As root, workers run as 2**30 + the host pid of the jail's launcher: unique while it lives,
# far above any real account.
_UID_BASE = 1 << 30


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


def run_program(code: str, cases: Sequence, *, fn_name: Optional[str] = None,
                limits: SandboxLimits = SandboxLimits(),
                should_continue: Optional[Callable[[int, CaseRun], bool]] = None,
                sandbox: str = "bubblewrap", allow_unfiltered_jail: bool = False) -> ProgramRun:
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
      sandbox: "bubblewrap" (default) or "namespaces" (weaker, see the module docstring).
      allow_unfiltered_jail: the namespaces jail may run without its seccomp filter when
        libseccomp / pyseccomp is missing (otherwise it refuses).
    Returns:
      ProgramRun with one CaseRun per case; its `isolation` is the jail's self-report (its
      `sandbox` names the jail). Only a missing or incomplete jail raises (`SandboxError`,
      before anything of the program ran); anything the program does ends up in the statuses.
    """
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {SANDBOXES}, got {sandbox!r}")
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
    payload = {"code": code, "fn_name": fn_name, "cases": payload_cases,
               "limits": dataclasses.asdict(limits)}

    start = time.monotonic()
    budget = limits.startup_s + len(cases) * (limits.timeout_s + 1.0)
    with _command(sandbox, limits, allow_unfiltered_jail) as (argv, pass_fds):
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, env=sandbox_env(), cwd="/", close_fds=True,
            pass_fds=pass_fds)
    payload["uid"] = _UID_BASE + proc.pid
    header, runs, stderr_tail, error = None, {}, b"", None
    try:
        try:
            proc.stdin.write(json.dumps(payload).encode("utf-8", "surrogatepass"))
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
        starter = "bwrap cannot create the jail here" if sandbox == "bubblewrap" else (
            "the namespaces sandbox did not start")
        raise SandboxError(f"{starter} (exit status {proc.returncode}): "
                           f"{stderr_tail.decode('utf-8', 'replace').strip()}")
    if header.get("sandbox_error"):
        raise SandboxError(header["sandbox_error"])
    compile_error = bool(header.get("compile_error"))
    if compile_error:
        results = tuple(CaseRun("compile_error") for _ in cases)
    else:
        results = tuple(runs.get(i, CaseRun(unfinished)) for i in range(len(cases)))
    return ProgramRun(compile_error, results, dict(header["isolation"]), wall, error)


def _command(sandbox: str, limits: SandboxLimits, allow_unfiltered_jail: bool = False):
    """Context manager giving (argv, fds to pass) that start the jail's runner."""
    if sandbox == "bubblewrap":
        return jail_bwrap.command(limits)
    return _namespaces_command(allow_unfiltered_jail)


def namespaces_seccomp_program(allow_unfiltered_jail: bool = False) -> Optional[bytes]:
    """The namespaces jail's compiled seccomp filter; None when libseccomp / pyseccomp is
    missing and `allow_unfiltered_jail`; else SandboxError, one line naming the missing package,
    its install command and the setting that allows the unfiltered jail."""
    try:
        return seccomp_filter.seccomp_program()
    except SandboxError as error:
        if allow_unfiltered_jail:
            return None
        raise SandboxError(
            f"the namespaces jail refuses to run without its seccomp filter: {error}; or set "
            "config.eval.allow_unfiltered_jail=True to run it unfiltered (programs may then "
            "reach host Unix sockets)") from None


@contextlib.contextmanager
def _namespaces_command(allow_unfiltered_jail: bool = False):
    """The namespaces jail under the seccomp filter, or (allowed, libseccomp missing) with
    `--allow-unfiltered`: its isolation report then says `seccomp` false."""
    argv = [sys.executable, "-I", "-B", NAMESPACES_SCRIPT]
    program = namespaces_seccomp_program(allow_unfiltered_jail)
    if program is None:
        yield argv + ["--allow-unfiltered"], ()
        return
    with seccomp_filter.program_fd(program) as fd:
        yield argv + ["--seccomp-fd", str(fd)], (fd,)


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
    """Yield ("msg", dict) for each JSON line the runner prints, ("stderr", bytes) for stderr
    chunks, until both pipes close or the deadline passes."""
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


def describe_isolation(limits: SandboxLimits = SandboxLimits(),
                       sandbox: str = "bubblewrap", allow_unfiltered_jail: bool = False) -> dict:
    """Start an empty sandbox and report what it contains on this machine (which jail, mode,
    namespaces, seccomp, ...). Raises SandboxError if the jail is missing or incomplete."""
    return dict(run_program("", [], limits=limits, sandbox=sandbox,
                            allow_unfiltered_jail=allow_unfiltered_jail).isolation)


def parallel_sandboxes(workers: Optional[int], limits: SandboxLimits,
                       setting: str = "max_workers") -> int:
    """How many sandboxes may run at once: `workers`, or for None / 0 one per CPU, as many as
    the host's memory holds. Every program may hold `limits.program_memory_mb`; `workers` of
    them must fit in the host's MemTotal (a host that swaps or OOM-kills the trainer is worse
    than a refused config), else ValueError naming `setting` and the numbers."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)
                                or workers < 0):
        raise ValueError(f"{setting} must be an int >= 0 (0 = one per CPU), got {workers!r}")
    host_mb = _host_memory_mb()
    per_program = limits.program_memory_mb
    fit = host_mb // per_program
    count = workers or min(os.cpu_count() or 1, fit)
    if count < 1 or count * per_program > host_mb:
        raise ValueError(
            f"{setting}={workers!r}: {count} parallel sandboxes x {per_program} MiB per program "
            f"(memory_mb={limits.memory_mb} x max_processes={limits.max_processes} + "
            f"workdir_mb={limits.workdir_mb} + pipe buffers "
            f"{-(-limits.pipe_buffer_bytes // (1 << 20))}) = {count * per_program} MiB do not "
            f"fit in this "
            f"host's {host_mb} MiB (MemTotal); use at most {fit} workers or a smaller memory "
            "limit")
    return count


def _host_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise SandboxError("/proc/meminfo has no MemTotal")
