"""Running several local JAX processes that form one job, for the multi-process tests; the
lock of the tests that must not run at the same time as each other."""
import contextlib
import fcntl
import os
import socket
import subprocess
import time

TPU_ENVIRONMENT = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_NUM_SLICES")
# XLA's CPU backend optimisations off, in the suite (conftest) and in every JAX process a test
# starts: the tests' programs are small, and compiling them, not running them, is most of the
# suite's time (numerics are checked against tolerances).
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@contextlib.contextmanager
def one_at_a_time():
    """Holds the lock named by `MARL_JAX_TEST_LOCK` (conftest), shared by the processes of
    `pytest -n 2`: the runs of a real model end to end take several GiB each, and two at once
    would add their peaks. Not reentrant: a holder must not take it again."""
    with open(os.environ["MARL_JAX_TEST_LOCK"], "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def cpu_env(devices: int, **extra) -> dict:
    """This environment with `devices` fake CPU devices, XLA's fast CPU flags (`FAST_XLA`) and
    no TPU host detection."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_XLA}")
    for name in TPU_ENVIRONMENT:
        env.pop(name, None)
    return env


def run_processes(commands, env, logdir, timeout_s) -> list:
    """Runs the commands at once, each logging to `<logdir>/worker<i>.log`; returns the logs.

    Stops at the first failure (the others would block in a collective) or at the timeout, and
    fails the test with the log of any process that did not exit with 0.
    """
    # Processes started together do not share the session's compilation cache: one could read
    # an entry while another is still writing it.
    env = dict(env, JAX_ENABLE_COMPILATION_CACHE="false")
    paths = [logdir / f"worker{i}.log" for i in range(len(commands))]
    logs = [open(path, "w") for path in paths]
    procs = [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
             for command, log in zip(commands, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    outputs = [path.read_text() for path in paths]
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"worker {i} exited with {proc.returncode}:\n{outputs[i][-4000:]}"
    return outputs
