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

seccomp: the filter of `marl_jax.eval.seccomp_filter`, handed to bwrap as a compiled BPF
program, which bwrap loads right before it starts the interpreter, so the jailed side imports
nothing of it.

Not bounded by the jail: the tmpfs's inode count (bwrap sets only its size), so a program may
create empty files until its CPU time runs out; they go with the case's cleanup.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from marl_jax.eval import sandbox_runner as runner
from marl_jax.eval import seccomp_filter
from marl_jax.eval.sandbox_limits import SandboxError

RUNNER = runner.JAIL_DIR + "/runner.py"


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
    program = seccomp_filter.seccomp_program()
    interpreter, filesystem = _filesystem()
    with seccomp_filter.program_fd(program) as seccomp_fd:
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
