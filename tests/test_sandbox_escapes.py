"""Escapes from the APPS sandbox, each tried and contained, over both jails.

Every program prints what its escape attempt got; the tests assert that exact outcome. Both
jails load the same seccomp filter; where the `namespaces` jail is documented as weaker (host
files stay readable), the expected outcome says so explicitly per jail, and the host-file cases
that only bubblewrap contains are parametrized over bubblewrap alone.
"""
import json
import os
import socket
import sys
import time
import uuid

import pytest

from marl_jax.eval import apps, jail_namespaces, sandbox
from marl_jax.eval import sandbox_runner as runner

SANDBOXES = sandbox.SANDBOXES
FAST = sandbox.SandboxLimits(timeout_s=2.0)
ONE_CASE = {"inputs": ["\n"], "outputs": ["done\n"]}
ROOT = os.geteuid() == 0

# Prints "DENIED <exception>" or "READ <first line>" for each path given on stdin.
READ_PROGRAM = """
import sys
for path in sys.stdin.read().split("\\n"):
    try:
        with open(path) as f:
            print("READ", f.readline().strip())
    except OSError as e:
        print("DENIED", type(e).__name__)
"""


def _run(code, sandbox_name, cases=("",), limits=FAST):
    return sandbox.run_program(code, list(cases), limits=limits, sandbox=sandbox_name)


def _only_output(run):
    assert [c.status for c in run.cases] == ["ok"], run
    return run.cases[0].output


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


def _covered_by_namespaces_jail(path: str) -> bool:
    """Whether the namespaces jail covers `path` with its own empty tmpfs (a checkout under /tmp
    is hidden there, like anything else in /tmp)."""
    real = os.path.realpath(path)
    return any(runner.is_under(real, point) for point in jail_namespaces.COVERED_DIRS)


def _uids_of_host_processes():
    uids = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            uids.add(os.stat(f"/proc/{name}").st_uid)
        except OSError:
            continue
    return uids


# ---- host files ------------------------------------------------------------------------------

@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Secrets a program must not read: in the caller's working directory, in $HOME, and next
    to an APPS dataset (its expected outputs)."""
    workdir = tmp_path / "caller_cwd"
    workdir.mkdir()
    (workdir / "secret.txt").write_text("cwd-secret\n")
    monkeypatch.chdir(workdir)
    dataset = tmp_path / "apps" / "test" / "0000"
    dataset.mkdir(parents=True)
    (dataset / "input_output.json").write_text(json.dumps(
        {"inputs": ["1 2\n"], "outputs": ["3\n"]}) + "\n")
    home = os.path.expanduser("~")
    home_secret = os.path.join(home, f".marl_sandbox_probe_{uuid.uuid4().hex}")
    with open(home_secret, "w") as f:
        f.write("home-secret\n")
    os.chmod(home_secret, 0o644)
    try:
        yield [str(workdir / "secret.txt"), "secret.txt", home_secret,
               str(dataset / "input_output.json"), os.path.join(home, ".ssh", "id_rsa")]
    finally:
        os.remove(home_secret)


@pytest.mark.parametrize("sandbox_name", ["bubblewrap"])  # namespaces: see the next test
def test_host_files_are_not_in_the_jail(planted, sandbox_name):
    run = _run(READ_PROGRAM, sandbox_name, ["\n".join(planted)])
    assert _only_output(run).splitlines() == ["DENIED FileNotFoundError"] * len(planted)
    # and the grader still works from that working directory
    assert apps.run_solution("print(int(input()) * 2)", {"inputs": ["4"], "outputs": ["8"]},
                             2.0, sandbox=sandbox_name) == [True]


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_project_sources_visible_only_to_the_namespaces_jail(sandbox_name):
    setup_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "setup.cfg")
    # Documented weakness of the namespaces jail: world-readable host files stay readable,
    # except under the directories it covers.
    visible = sandbox_name == "namespaces" and not _covered_by_namespaces_jail(setup_cfg)
    expected = "READ [metadata]" if visible else "DENIED FileNotFoundError"
    run = _run(READ_PROGRAM, sandbox_name, [setup_cfg])
    assert _only_output(run).splitlines() == [expected]
    assert run.isolation["host_files_hidden"] is (sandbox_name == "bubblewrap")


@pytest.mark.parametrize("sandbox_name", ["bubblewrap"])
def test_jail_root_holds_only_the_interpreter(sandbox_name):
    prefix = os.path.realpath(sys.base_prefix)
    parts = prefix.strip("/").split("/")
    ancestors = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
    site_packages = os.path.join(prefix, "lib", f"python{sys.version_info[0]}."
                                 f"{sys.version_info[1]}", "site-packages")
    listed = ["/", "/etc", "/tmp", "/jail", "/jail/site", "/usr", "/proc", site_packages,
              *ancestors]
    code = ("import json, os\nout = {p: sorted(os.listdir(p)) for p in %r}\n"
            "out['links'] = {p: os.readlink(p) for p in ('/lib', '/lib64') if os.path.islink(p)}\n"
            "print(json.dumps(out))" % listed)
    seen = json.loads(_only_output(_run(code, sandbox_name)))
    assert seen["/"] == sorted({"dev", "etc", "jail", "lib", "lib64", "proc", "tmp", "usr",
                                parts[0]})
    assert seen["links"] == {"/lib": "usr/lib", "/lib64": "usr/lib64"}  # Debian's merged /usr
    assert seen["/etc"] == ["ld.so.cache"]
    assert seen["/tmp"] == ["sandbox"]
    assert seen["/jail"] == ["runner.py", "site"]
    assert seen["/jail/site"] == ["numpy", "numpy.libs"]
    assert seen[site_packages] == []
    libraries = {"lib", "lib64"}  # /usr/lib/x86_64-linux-gnu and the loader's link in /usr/lib64
    for ancestor, child in zip(ancestors, parts[1:]):
        # e.g. /root holds .pyenv and nothing else
        assert seen[ancestor] == sorted({child} | (libraries if ancestor == "/usr" else set()))
    if not (prefix + "/").startswith("/usr/"):
        assert seen["/usr"] == sorted(libraries)
    # /proc of the jail's own pid namespace: the runner (1) and this program (2)
    assert [p for p in seen["/proc"] if p.isdigit()] == ["1", "2"]


# ---- kernel interfaces -----------------------------------------------------------------------

CTYPES_PROGRAM = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
for name, args in %r:
    result = getattr(libc, name)(*[os.getppid() if a == "PPID" else a for a in args])
    print(name, result, errno.errorcode.get(ctypes.get_errno()) if result == -1 else "-")
"""


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_ptrace_and_new_namespaces(sandbox_name):
    calls = [("ptrace", (16, "PPID", 0, 0)),  # PTRACE_ATTACH to the runner
             ("unshare", (0x10000000,)),       # CLONE_NEWUSER
             ("mount", (b"none", b"/tmp/sandbox", b"tmpfs", 0, None))]
    lines = _only_output(_run(CTYPES_PROGRAM % calls, sandbox_name)).splitlines()
    assert lines == ["ptrace -1 EPERM", "unshare -1 EPERM", "mount -1 EPERM"]


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_seccomp_denies_with_eperm(sandbox_name):
    # raw x86_64 syscall numbers (libc has no wrapper for some)
    calls = [("syscall", (135, 0xFFFFFFFF)),   # personality
             ("syscall", (321, 0, 0, 0)),      # bpf
             ("syscall", (250, 0, 0)),         # keyctl
             ("syscall", (298, 0, 0, -1, -1, 0)),  # perf_event_open
             ("syscall", (308, 0, 0)),         # setns
             ("syscall", (425, 1, 0)),         # io_uring_setup
             ("syscall", (323, 0)),            # userfaultfd
             ("syscall", (310, 1, 0, 0, 0, 0, 0)),  # process_vm_readv
             ("syscall", (435, 0, 0)),         # clone3: ENOSYS, so libc falls back to clone
             ("syscall", (56, 0x10000011, 0, 0, 0, 0))]  # clone(CLONE_NEWUSER | SIGCHLD)
    lines = _only_output(_run(CTYPES_PROGRAM % calls, sandbox_name)).splitlines()
    assert lines == ["syscall -1 EPERM"] * 8 + ["syscall -1 ENOSYS", "syscall -1 EPERM"]
    # threads and processes still work (pthread_create falls back from clone3 to clone)
    code = ("import threading, subprocess, sys\nt = threading.Thread(target=print, args=('t',))"
            "\nt.start()\nt.join()\nprint(subprocess.run([sys.executable, '-c', 'print(5)'], "
            "capture_output=True).stdout.decode().strip())")
    assert _only_output(_run(code, sandbox_name)) == "t\n5\n"


SOCKET_PROGRAM = """
import errno, socket
for family, kind in ((socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                     (socket.AF_NETLINK, socket.SOCK_RAW)):
    try:
        s = socket.socket(family, kind)
    except OSError as e:
        print("DENIED", type(e).__name__, errno.errorcode[e.errno])
        continue
    try:
        s.connect(("1.1.1.1", 53) if family == socket.AF_INET else ("::1", 53, 0, 0)
                  if family == socket.AF_INET6 else (0, 0))
        print("CONNECTED", family)
    except OSError as e:
        print("UNREACHABLE", type(e).__name__, errno.errorcode[e.errno])
try:
    socket.socketpair()
except OSError as e:
    print("DENIED", type(e).__name__, errno.errorcode[e.errno])
"""


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_network_sockets(sandbox_name):
    assert _only_output(_run(SOCKET_PROGRAM, sandbox_name)).splitlines() == \
        ["DENIED PermissionError EPERM"] * 4


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_loopback_connection_never_arrives(sandbox_name):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    code = ("import errno, socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), "
            "timeout=1)\n    print('connected')\nexcept OSError as e:\n"
            "    print('refused', errno.errorcode[e.errno])" % port)
    try:
        run = _run(code, sandbox_name)
        server.settimeout(0.3)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert _only_output(run) == "refused EPERM\n"


# ---- processes -------------------------------------------------------------------------------

@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_signalling_the_caller_fails(sandbox_name):
    code = ("import os, signal\nfor pid in (%d, os.getppid()):\n    try:\n"
            "        os.kill(pid, signal.SIGTERM)\n        print('sent')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "os.kill(os.getppid(), signal.SIGINT) if %r else None\nprint('after')"
            % (os.getpid(), sandbox_name == "bubblewrap"))
    run = _run(code, sandbox_name, ["", ""])
    # The caller's pid does not exist in the jail's pid namespace. The runner is pid 1 of it:
    # in bubblewrap it shares the program's uid, and ignores every signal from inside; in
    # namespaces (as root) it is another uid.
    to_runner = "sent" if sandbox_name == "bubblewrap" or not ROOT else "PermissionError"
    assert [c.output for c in run.cases] == [f"ProcessLookupError\n{to_runner}\nafter\n"] * 2
    assert os.getpid() > 0  # this process is alive to read the result


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_fork_bomb_is_bounded_and_cleaned_up(sandbox_name):
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(type(e).__name__)\nprint(n, len([p for p in "
            "os.listdir('/proc') if p.isdigit()]))")
    limits = sandbox.SandboxLimits(timeout_s=5.0, max_processes=16)
    start = time.monotonic()
    run = _run(code, sandbox_name, limits=limits)
    assert time.monotonic() - start < 4.0
    error, counts = _only_output(run).splitlines()
    forks, visible = map(int, counts.split())
    assert error == "BlockingIOError"  # EAGAIN: RLIMIT_NPROC
    assert 0 < forks < 16  # the worker itself counts
    assert visible == forks + 2  # the jail saw only its runner, the worker and the forks
    # nothing is left afterwards: no process in its pid namespace, none of its uid
    assert _processes_in_pid_namespace(run.isolation["pid_namespace_inode"]) == []
    if ROOT:
        assert run.isolation["worker_uid"] not in _uids_of_host_processes()


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_unbounded_fork_bomb_ends_quickly(sandbox_name):
    start = time.monotonic()
    result = apps.evaluate_solution("import os\nwhile True:\n    os.fork()", ONE_CASE, 3.0,
                                    sandbox=sandbox_name)
    assert result.statuses == ("runtime_error",) and result.codes == (-1,)
    assert time.monotonic() - start < 3.0


# ---- memory, disk ----------------------------------------------------------------------------

@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_huge_allocation_fails(sandbox_name):
    caught = ("try:\n    x = bytearray(16 * 2**30)\nexcept MemoryError:\n"
              "    print('DENIED MemoryError')")
    assert _only_output(_run(caught, sandbox_name)) == "DENIED MemoryError\n"
    result = apps.evaluate_solution("x = bytearray(16 * 2**30)\nprint('done')", ONE_CASE, 2.0,
                                    sandbox=sandbox_name)
    assert result.codes == (-1,) and result.statuses == ("runtime_error",)


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_writes_outside_the_workdir_fail(tmp_path, sandbox_name):
    targets = ["/escape.txt", f"/tmp/escape-{uuid.uuid4().hex}.txt", "/usr/escape.txt",
               str(tmp_path / "escape.txt"),
               os.path.join(os.path.dirname(apps.__file__), "escape.txt")]
    code = ("import errno, sys\nfor path in %r:\n    try:\n        with open(path, 'w') as f:\n"
            "            f.write('x')\n        print('WROTE', path)\n    except OSError as e:\n"
            "        print('DENIED', errno.errorcode[e.errno])\n"
            "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
            % targets)
    lines = _only_output(_run(code, sandbox_name)).splitlines()
    # bubblewrap: the read-only new root has no such directories; namespaces: the host's
    # mounts, read-only, with /tmp covered
    package = ("ENOENT" if sandbox_name == "bubblewrap" or _covered_by_namespaces_jail(targets[-1])
               else "EROFS")
    assert lines == ["DENIED EROFS", "DENIED EROFS", "DENIED EROFS", "DENIED ENOENT",
                     f"DENIED {package}", "fine"]
    for target in targets:
        assert not os.path.exists(target)


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_filling_the_workdir_stays_in_its_tmpfs(sandbox_name):
    limits = sandbox.SandboxLimits(timeout_s=5.0, workdir_mb=8, max_file_mb=3)
    code = ("import errno, os\ndef fill(name, files, mib):\n    written = 0\n    try:\n"
            "        for i in range(files):\n            with open(f'{name}{i}', 'wb') as f:\n"
            "                for _ in range(mib):\n                    f.write(b'x' * 2**20)\n"
            "                    f.flush()\n                    written += 1\n"
            "    except OSError as e:\n        print(errno.errorcode[e.errno], written)\n"
            "fill('big', 1, 4)\nfor n in os.listdir('.'):\n    os.remove(n)\n"
            "fill('many', 8, 2)\n"
            "cwd = os.getcwd()\nfor line in open('/proc/self/mountinfo'):\n"
            "    fields = line.split()\n    if fields[4] == cwd:\n"
            "        print(fields[fields.index('-') + 1])")
    lines = _only_output(_run(code, sandbox_name, limits=limits)).splitlines()
    # RLIMIT_FSIZE stops one file at 3 MiB; the 8 MiB tmpfs stops many files before 8 MiB
    assert lines[0] == "EFBIG 3"
    assert lines[1].split()[0] == "ENOSPC" and 5 <= int(lines[1].split()[1]) <= 8
    assert lines[2] == "tmpfs"  # memory, not the host's disk


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_infinite_loop_and_sleep_are_killed_on_time(sandbox_name):
    for code in ("while True:\n    pass",
                 "import signal, time\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                 "time.sleep(60)"):
        start = time.monotonic()
        result = apps.evaluate_solution(code, ONE_CASE, 1.0, sandbox=sandbox_name)
        assert result.codes == (-1,) and result.statuses == ("timeout",)
        assert time.monotonic() - start < 1.0 + 2.0


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_huge_output_is_capped(sandbox_name):
    limits = sandbox.SandboxLimits(timeout_s=5.0, max_output_bytes=1 << 16)
    start = time.monotonic()
    run = _run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", sandbox_name,
               limits=limits)
    assert run.cases[0].status == "output_limit"
    assert time.monotonic() - start < 4.0  # stopped by the cap, not the timeout


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_cases_are_independent(sandbox_name):
    code = ("import os\nprint(os.path.exists('state'))\nos.makedirs('state/sub')\n"
            "os.chmod('state/sub', 0)\nos.chmod('state', 0)\nprint(os.getpid())")
    run = _run(code, sandbox_name, ["", "", ""])
    # a fresh process and an emptied working directory per case, even with closed directories
    assert [c.output.split()[0] for c in run.cases] == ["False"] * 3



# ---- memory the rlimits do not see, host sockets ---------------------------------------------

SYSV_PROGRAM = """
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
KEY, IPC_CREAT, O_CREAT_RDWR = 0x5EC, 0o1000, 0o102
first = sys.stdin.read().strip() == "first"
flags = IPC_CREAT | 0o666 if first else 0
for name, args in (("shmget", (KEY, 96 << 20, flags)), ("msgget", (KEY, flags)),
                   ("semget", (KEY, 1, flags)), ("mq_open", (b"/q", O_CREAT_RDWR if first else 2,
                                                             0o666, None))):
    result = getattr(libc, name)(*args)
    print(name, "DENIED" if result == -1 else "GOT", errno.errorcode.get(ctypes.get_errno())
          if result == -1 else "-")
"""


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_sysv_ipc_and_message_queues_are_refused(sandbox_name):
    # A SysV segment counts against no rlimit and outlives the case that made it: the next
    # case of the program would find it (and the host's memory would hold it).
    run = _run(SYSV_PROGRAM, sandbox_name, ["first", "second"])
    assert [c.output for c in run.cases] == [
        "shmget DENIED EPERM\nmsgget DENIED EPERM\nsemget DENIED EPERM\nmq_open DENIED EPERM\n"
    ] * 2


MEMORY_PROGRAM = """
import errno, fcntl, os
try:
    held = []
    for _ in range(60):
        fd = os.memfd_create("hold")
        os.write(fd, bytes(16 << 20))
        held.append(fd)
    print("memfd held", 16 * len(held))
except OSError as e:
    print("memfd DENIED", errno.errorcode[e.errno])
    for fd in held:
        os.close(fd)
pipes, total = [], 0
try:
    while True:
        r, w = os.pipe()
        pipes.append((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        os.set_blocking(w, False)
        try:
            while True:
                total += os.write(w, bytes(1 << 16))
        except BlockingIOError:
            pass
except OSError:
    pass
print("pipes held", total)
"""


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_memfd_and_pipe_buffers_stay_within_the_programs_memory(sandbox_name):
    limits = sandbox.SandboxLimits(timeout_s=5.0, memory_mb=256, max_processes=1, workdir_mb=8)
    memfd, pipes = _only_output(_run(MEMORY_PROGRAM, sandbox_name, limits=limits)).splitlines()
    # memfds live beside every rlimit (a file in memory that no tmpfs bounds): refused.
    assert memfd == "memfd DENIED EPERM"
    # Pipes keep their default capacity (F_SETPIPE_SZ is refused), which the program's memory
    # budget counts for every descriptor it may hold.
    held = int(pipes.split()[-1])
    assert 0 < held <= limits.pipe_buffer_bytes
    assert limits.program_memory_mb == 256 + 8 + -(-limits.pipe_buffer_bytes // (1 << 20))


@pytest.fixture
def host_unix_socket():
    """A listening Unix socket, open to everyone, in a host directory that no jail covers
    (neither /tmp nor /run): (path, server socket)."""
    parent = next((p for p in ("/srv", "/mnt", "/opt", os.path.expanduser("~"))
                   if os.path.isdir(p) and os.access(p, os.W_OK)), None)
    if parent is None:
        pytest.fail("no writable host directory outside /tmp and /run for the socket")
    folder = os.path.join(parent, f"marl_socket_{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "s")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(4)
    try:
        yield path, server
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(folder)


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_host_unix_sockets_are_unreachable(host_unix_socket, sandbox_name):
    path, server = host_unix_socket
    code = ("import errno, socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n"
            "    s.connect(%r)\n    s.sendall(b'escaped')\n    print('connected')\n"
            "except OSError as e:\n    print('refused', errno.errorcode[e.errno])" % path)
    run = _run(code, sandbox_name)
    server.settimeout(0.3)
    with pytest.raises(socket.timeout):
        server.accept()
    assert _only_output(run) == "refused EPERM\n"
