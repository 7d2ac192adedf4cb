"""The `namespaces` sandbox: a jail of hand-written Linux namespaces through libc, no packages.

Selected explicitly (`sandbox="namespaces"`, `--config.task.sandbox=namespaces`) where
bubblewrap cannot be installed. It is weaker than the default bubblewrap jail: every host file
the worker's uid may read stays readable (the interpreter runs from the host's filesystem,
remounted read-only). It loads the same seccomp filter (`marl_jax.eval.seccomp_filter`, sent by
the caller on `--seccomp-fd`) once its mounts are set up; that filter refuses every socket, so
no host Unix socket is reachable. Without a filter it refuses to run, unless the caller allows
it (`--allow-unfiltered`, where libseccomp is missing and `config.eval.allow_unfiltered_jail` is
set); it then says so (`seccomp` and `host_unix_sockets_reachable` in its isolation report): a
program may connect to a Unix socket in any host directory it can reach, and create namespaces
of its own inside these. Run as a script (`python -I -B jail_namespaces.py`, so this
package is not importable: `sandbox_runner.py` beside it is loaded by path), standard library
only.

Process layout: this script, started by the caller (P), unshares the namespaces and forks C, pid
1 of the new pid namespace, which sets up the mounts and returns from `enter` to run the cases;
P waits for C and exits with it.

- network: a new network namespace with only a loopback device that is down; no connection
  leaves it (TCP, UDP, abstract Unix sockets). Path-based Unix sockets are hidden by empty
  read-only mounts over /run, /tmp, /var/tmp and /dev/shm.
- processes: a new pid namespace; the program sees only its own processes, so it cannot signal
  the caller or anything else on the machine. When C dies the kernel kills the whole
  namespace; C dies with P (PDEATHSIG) and the caller kills P's process group on its deadline.
- filesystem: a new mount namespace in which every mount is remounted read-only (a mount that
  cannot be is refused: nothing runs); /tmp, /run, /var/tmp and /dev/shm are covered by empty
  read-only tmpfs mounts, and /tmp holds the working directory, a small writable tmpfs
  (`workdir_mb`). Nothing the program writes reaches the host's disk.
- privileges: as root, the worker switches to an otherwise unused uid, so it holds no
  capabilities and RLIMIT_NPROC (which never applies to uid 0) counts only its own processes.
  As a non-root user a new user namespace is created and the worker drops every capability.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import signal
import sys
from typing import Optional, Sequence

# Covered by empty read-only tmpfs mounts inside the jail (/tmp then holds the working directory).
COVERED_DIRS = ("/run", "/var/tmp", "/dev/shm", "/dev/mqueue", "/tmp")

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
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


def _load_runner():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
    spec = importlib.util.spec_from_file_location("sandbox_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def enter(payload: dict, libc) -> "runner.Jail":
    """Build the jail; returns in C only (P waits for C and exits with it)."""
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    try:
        mode = _unshare_namespaces(libc)
    except OSError as error:
        raise runner.JailError(
            f"cannot create Linux namespaces ({error}); run as root, or enable unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces > 0)") from None
    uid = payload["uid"] if mode == "root" else os.geteuid()
    child = os.fork()
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
    runner.prctl(libc, runner.PR_SET_PDEATHSIG, signal.SIGKILL)
    isolation = {"sandbox": "namespaces", "mode": mode, "worker_uid": uid,
                 "host_files_hidden": False, "network_namespace": True,
                 "pid_namespace": os.getpid() == 1,
                 # The kernel never applies RLIMIT_NPROC to the host's uid 0.
                 "process_limit": mode == "root" or uid != 0}
    isolation.update(_set_up_filesystem(libc, payload["limits"]["workdir_mb"],
                                        uid if mode == "root" else None))
    isolation["seccomp"] = _load_seccomp_filter(libc, _seccomp_fd(sys.argv[1:]))
    if not isolation["seccomp"] and "--allow-unfiltered" not in sys.argv[1:]:
        raise runner.JailError("the namespaces jail has no seccomp filter (no --seccomp-fd); "
                               "refusing to run")
    # Without the filter a program may connect to a Unix socket in any host directory it can
    # reach (a read-only mount does not stop `connect`).
    isolation["host_unix_sockets_reachable"] = not isolation["seccomp"]
    if isolation["not_read_only"] or not isolation["pid_namespace"]:
        raise runner.JailError(
            "the namespaces sandbox is incomplete (mounts not read-only: "
            f"{isolation['not_read_only']}, pid namespace: {isolation['pid_namespace']}); "
            "refusing to run")
    return runner.Jail(isolation, functools.partial(_drop_privileges, libc, mode, uid),
                       # In a user namespace RLIMIT_NPROC also counts this init process.
                       0 if mode == "root" else 1)


def _seccomp_fd(args: Sequence[str]) -> Optional[int]:
    """The descriptor of the compiled seccomp program (`--seccomp-fd N`), if the caller sent one."""
    return int(args[args.index("--seccomp-fd") + 1]) if "--seccomp-fd" in args else None


def _load_seccomp_filter(libc, fd: Optional[int]) -> bool:
    """Loads the BPF program on `fd` (`marl_jax.eval.seccomp_filter`) as this process's seccomp
    filter, inherited by every process of the jail; False when there is none."""
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f:
        program = f.read()
    if not program or len(program) % 8:
        raise runner.JailError(f"the seccomp program has {len(program)} bytes, not a whole "
                               "number of 8-byte BPF instructions; refusing to run")
    instructions = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
    runner.prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
    runner.check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
                 "prctl(PR_SET_SECCOMP)")
    return True


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    runner.check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
                 f"mount {target}")


def _unshare_namespaces(libc) -> str:
    """Move this process into new user (non-root only), mount, network, ipc, uts and pid
    namespaces (the pid namespace applies to the next child). Returns the mode."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if uid == 0 and libc.unshare(flags) == 0:
        return "root"
    runner.check(libc.unshare(flags | _CLONE_NEWUSER), "unshare (user namespace)")
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
    covers = [p for p in COVERED_DIRS if os.path.isdir(p) and not os.path.islink(p)]
    if owner is not None:
        # The unprivileged worker must also read an interpreter that lives under a directory
        # closed to other users (e.g. a pyenv in /root): that directory is covered too.
        closed = {_closed_ancestor(p) for p in interpreter
                  if not any(runner.is_under(p, c) for c in covers)}
        covers += sorted(c for c in closed if c is not None)
    hidden = []
    for point in covers:
        keep = [p for p in interpreter if runner.is_under(p, point)]
        if point == "/tmp":
            _cover(libc, point, keep, workdir=(runner.WORKDIR, workdir_mb, owner))
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
    os.chdir(runner.WORKDIR)
    return {"not_read_only": not_read_only, "hidden": hidden, "own_proc": own_proc}


def _cover(libc, point: str, keep: Sequence[str], workdir=None):
    """Cover `point` with an empty read-only tmpfs into which only the paths `keep` (under
    `point`) are bind-mounted back, read-only; with `workdir=(path, size_mb, owner)` also the
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
        path, size_mb, owner = workdir
        os.mkdir(path)
        options = f"size={size_mb}m,nr_inodes=4096,mode=700"
        if owner is not None:
            options += f",uid={owner},gid={owner}"
        _mount(libc, "tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    _mount(libc, None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _interpreter_paths() -> list:
    """Directories (and zip files) the interpreter imports from, without nested duplicates."""
    candidates = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
    candidates.update(p for p in sys.path if p)
    return runner.outermost(os.path.realpath(p) for p in candidates if os.path.exists(p))


def _closed_ancestor(path: str) -> Optional[str]:
    """Shallowest strict ancestor of `path` that other users cannot traverse (no o+x)."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _drop_privileges(libc, mode: str, uid: int):
    """In the worker: root mode becomes the unused uid; user-namespace mode drops every
    capability it holds in the namespace."""
    if mode == "root":
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:
        header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()
        runner.check(libc.capset(header, data), "capset")


if __name__ == "__main__":
    runner.main(enter)
