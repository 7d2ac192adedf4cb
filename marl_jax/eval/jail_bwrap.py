"""The `bubblewrap` sandbox (the default): the bwrap command line and its seccomp program.

Why bubblewrap: the hand-written namespaces of `jail_namespaces` keep the host's filesystem
(read-only) under the program, so it can read every world-readable file: the project's
sources, an APPS dataset with its expected outputs, ~/.ssh. bwrap builds the jail's root from
an empty tmpfs instead (then made read-only), into which only what the interpreter needs is
bound, read-only:

- the base interpreter's prefix (`sys.base_prefix`: the binary and the standard library; a
  virtualenv is not bound, the base interpreter runs with `-I -S`) with its site-packages
  covered by an empty directory, and numpy alone (the APPS prelude imports it) at /jail/site;
- the shared libraries the interpreter, its extension modules and numpy link (as `ldd`
  resolves them): their directories, the symlinks met on the way (e.g. /lib -> usr/lib), and
  the loader's cache /etc/ld.so.cache;
- the runner script at /jail/runner.py;
- a /proc of the new pid namespace, a minimal read-only /dev, and the working directory: a
  size-limited tmpfs, the only writable place.

Namespaces: pid (the runner is pid 1), network (loopback only), ipc, uts, cgroup, mount; a
user namespace only when the caller is not root. As root a user namespace would map the jail
to host uid 0, which RLIMIT_NPROC never limits: bwrap then leaves the runner CAP_SETUID and
CAP_SETGID only, with which it becomes an unused uid before anything else. Also
--die-with-parent, --new-session (no TIOCSTI into the caller's terminal), --cap-drop ALL, and
no_new_privs (bwrap sets it).

seccomp: built here with pyseccomp (libseccomp) and handed to bwrap as a compiled BPF program,
which bwrap loads right before it starts the interpreter, so the jailed side imports nothing
of it. Everything is allowed except what a contest program never needs and what widens the
kernel's attack surface or reaches other processes: those calls fail with EPERM (Python raises
PermissionError) rather than killing, so a program's failure reads clearly. `clone3` fails with
ENOSYS, so libc falls back to `clone`, whose namespace flags seccomp can inspect (refused);
sockets of families other than AF_UNIX and the terminal-injection ioctls are refused too.

Not bounded by the jail: the tmpfs's inode count (bwrap sets only its size), so a program may
create empty files until its CPU time runs out; they go with the case's cleanup.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from marl_jax.eval import sandbox_runner as runner
from marl_jax.eval.sandbox_limits import SandboxError

PYSECCOMP = "pyseccomp==0.1.2"
RUNNER = runner.JAIL_DIR + "/runner.py"
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
)
_AF_UNIX = 1
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
# CLONE_NEWNET
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                          0x20000000, 0x40000000)
_TERMINAL_INJECTION = (0x5412, 0x541C)  # ioctl TIOCSTI, TIOCLINUX


@contextlib.contextmanager
def command(limits):
    """(argv, fds to pass) that start the runner in a bubblewrap jail for `limits`. Refuses
    (SandboxError) when bwrap, pyseccomp or libseccomp is missing; the seccomp program travels
    on a memfd that is closed on exit."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(
            "bubblewrap not installed: apt-get install bubblewrap (the default sandbox, "
            "config.task.sandbox='bubblewrap', jails programs with bwrap; 'namespaces' is the "
            "weaker fallback that leaves host files readable)")
    program = seccomp_program()
    interpreter, filesystem = _filesystem()
    seccomp_fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)  # pass_fds hands it on
    try:
        os.write(seccomp_fd, program)
        os.lseek(seccomp_fd, 0, os.SEEK_SET)
        privileges = (["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
                      if os.geteuid() == 0 else ["--unshare-user"])
        yield [bwrap, "--die-with-parent", "--new-session", "--as-pid-1",
               "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--cap-drop", "ALL", *privileges,
               "--seccomp", str(seccomp_fd), *filesystem,
               "--proc", "/proc", "--dev", "/dev",
               "--perms", "0777", "--size", str(limits.workdir_mb << 20),
               "--tmpfs", runner.WORKDIR,
               "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", runner.WORKDIR,
               "--", interpreter, "-I", "-S", "-B", RUNNER], (seccomp_fd,)
    finally:
        os.close(seccomp_fd)


@functools.lru_cache(maxsize=None)
def seccomp_program() -> bytes:
    """The compiled BPF program of the jail's seccomp filter (see the module docstring)."""
    try:
        import pyseccomp
    except ImportError:
        raise SandboxError(f"pyseccomp not installed: pip install {PYSECCOMP} (the bubblewrap "
                           "sandbox's seccomp filter)") from None
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
    for name in ("socket", "socketpair"):
        rules.add_rule(denied, name, pyseccomp.Arg(0, pyseccomp.NE, _AF_UNIX))
    for request in _TERMINAL_INJECTION:
        rules.add_rule(denied, "ioctl", pyseccomp.Arg(1, pyseccomp.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


@functools.lru_cache(maxsize=None)
def _filesystem() -> tuple:
    """(interpreter, bwrap options that lay out the jail's read-only part), computed once."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefixes = runner.outermost({os.path.realpath(sys.base_prefix),
                                 os.path.realpath(sys.base_exec_prefix),
                                 os.path.dirname(interpreter)})
    numpy_dirs = _numpy_dirs()
    library_dirs, links = _library_dirs(interpreter, prefixes, numpy_dirs)
    bound = (*prefixes, *library_dirs)
    binds = {path: path for path in bound}
    binds[os.path.realpath(runner.__file__)] = RUNNER
    binds.update((folder, f"{runner.SITE_DIR}/{name}") for folder, name in numpy_dirs.items())
    if os.path.isfile("/etc/ld.so.cache"):
        binds["/etc/ld.so.cache"] = "/etc/ld.so.cache"
    symlinks = {link: target for link, target in links.items()
                if not any(runner.is_under(link, p) for p in bound)}
    site_vars = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    site_packages = {os.path.realpath(sysconfig.get_path(key, vars=site_vars))
                     for key in ("purelib", "platlib")}
    # bwrap would create missing parents closed to others (0700); the runner, unprivileged,
    # must traverse them.
    parents = {os.path.dirname(path) for path in (*binds.values(), *symlinks)} - {"/"}
    options = []
    for path in sorted({a for p in parents for a in _ancestors(p)}):
        options += ["--perms", "0755", "--dir", path]
    for source, target in binds.items():
        options += ["--ro-bind", source, target]
    for path in sorted(site_packages):
        if os.path.isdir(path) and any(runner.is_under(path, p) for p in prefixes):
            options += ["--tmpfs", path, "--remount-ro", path]
    for link, target in sorted(symlinks.items()):
        options += ["--symlink", target, link]
    return interpreter, tuple(options)


def _library_dirs(interpreter: str, prefixes: list, numpy_dirs: dict) -> tuple:
    """(directories outside the prefixes, {symlink: target} met on the way) of the shared
    libraries that the interpreter, the extension modules of its standard library and numpy
    link (those numpy bundles are bound with it)."""
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    binaries = [interpreter, *glob.glob(os.path.join(stdlib, "lib-dynload", "*.so"))]
    for folder in numpy_dirs:
        binaries += glob.glob(os.path.join(folder, "**", "*.so*"), recursive=True)
    links, directories = {}, set()
    for library in _linked_libraries(binaries):
        if not any(runner.is_under(os.path.realpath(library), p) for p in numpy_dirs):
            directories.add(os.path.dirname(_resolve(library, links)))
    return [d for d in runner.outermost(directories)
            if not any(runner.is_under(d, p) for p in prefixes)], links


def _numpy_dirs() -> dict:
    """{host directory: name under SITE_DIR} of numpy and the libraries its wheel bundles."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return {}
    package = os.path.realpath(list(spec.submodule_search_locations)[0])
    found = {package: "numpy"}
    if os.path.isdir(package + ".libs"):
        found[package + ".libs"] = "numpy.libs"
    return found


def _linked_libraries(binaries) -> set:
    """Absolute paths of the shared libraries (and the loader) `binaries` link, per `ldd`."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxError("ldd not found (Debian package libc-bin): the bubblewrap sandbox "
                           "asks it which shared libraries the interpreter needs")
    listing = subprocess.run([ldd, *binaries], capture_output=True, text=True,
                             env={"LC_ALL": "C", "PATH": os.defpath}).stdout
    return set(re.findall(r"^\s+(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$", listing, re.M))


def _resolve(path: str, links: dict) -> str:
    """The real path of `path`, resolved one component at a time; every symlink met on the
    way is recorded in `links` (link -> target): the jail needs them too."""
    parts = [p for p in path.split("/") if p]
    current, hops = "/", 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        if name != "." and os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise SandboxError(f"too many symlinks resolving {path}")
            target = os.readlink(candidate)
            links[candidate] = target
            parts = [p for p in target.split("/") if p] + parts
            if target.startswith("/"):
                current = "/"
            continue
        if name != ".":
            current = candidate
    return current


def _ancestors(path: str) -> list:
    """`path` and its ancestors below /, outermost first."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
