"""The seccomp filter of both APPS jails, compiled to a BPF program with pyseccomp (libseccomp).

Everything is allowed except what a contest program never needs and what widens the kernel's
attack surface, reaches other processes or holds memory that no rlimit counts: those calls fail
with EPERM (Python raises PermissionError) rather than killing, so a program's failure reads
clearly.

- `clone3` fails with ENOSYS, so libc falls back to `clone`, whose namespace flags seccomp can
  inspect (refused).
- No sockets at all (`socket`, `socketpair`): no network, and no Unix socket reaches a host
  process, even where host directories are visible (the `namespaces` jail).
- SysV IPC (`shmget`, `msgget`, `semget`, their `*ctl`, attach and send calls) and POSIX
  message queues: their objects count against no rlimit and outlive the test case that made
  them, in the jail's IPC namespace, for the program's next case to find.
- `memfd_create` (and `memfd_secret`): a file in memory beside every rlimit and the working
  directory's tmpfs.
- `fcntl(F_SETPIPE_SZ)`: a pipe keeps its default 16 pages, so the pipes a program can hold are
  bounded by its open files (`SandboxLimits.pipe_buffer_bytes`, counted in its memory).
- The terminal-injection ioctls (TIOCSTI, TIOCLINUX).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile

from marl_jax.eval.sandbox_limits import SandboxError

PYSECCOMP = "pyseccomp -c requirements/lock.txt"
DENIED_SYSCALLS = (
    # other processes and the kernel's objects
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    "mbind", "migrate_pages", "move_pages", "personality",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "open_by_handle_at", "name_to_handle_at",
    # the machine
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl", "quotactl_fd",
    "lookup_dcookie", "uselib", "vhangup", "iopl", "ioperm", "_sysctl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname",
    # sockets
    "socket", "socketpair",
    # memory no rlimit counts, and state that outlives a test case
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "memfd_create", "memfd_secret",
)
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
# CLONE_NEWNET
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                          0x20000000, 0x40000000)
_TERMINAL_INJECTION = (0x5412, 0x541C)  # ioctl TIOCSTI, TIOCLINUX
_F_SETPIPE_SZ = 1031


@functools.lru_cache(maxsize=None)
def seccomp_program() -> bytes:
    """The compiled BPF program of the filter (see the module docstring). Raises SandboxError
    when pyseccomp or libseccomp is missing."""
    try:
        import pyseccomp
    except ImportError:
        raise SandboxError(f"pyseccomp not installed: pip install {PYSECCOMP} (the jails' "
                           "seccomp filter)") from None
    except RuntimeError as error:  # pyseccomp raises this when it finds no libseccomp
        raise SandboxError(f"libseccomp not found ({error}): apt-get install libseccomp2") \
            from None
    denied = pyseccomp.ERRNO(errno.EPERM)
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        rules.add_rule(denied, name)
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NAMESPACE_FLAGS:
        rules.add_rule(denied, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(denied, "fcntl", pyseccomp.Arg(1, pyseccomp.EQ, _F_SETPIPE_SZ))
    for request in _TERMINAL_INJECTION:
        rules.add_rule(denied, "ioctl", pyseccomp.Arg(1, pyseccomp.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


@contextlib.contextmanager
def program_fd(program: bytes):
    """A memfd holding `program`, at offset 0, for a child to read (hand it on with
    `pass_fds`); closed on exit."""
    fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)
