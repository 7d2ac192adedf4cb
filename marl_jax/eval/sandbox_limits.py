"""What a sandboxed program may use (`SandboxLimits`) and the error of a jail that cannot be set
up (`SandboxError`), shared by the caller side (`marl_jax.eval.sandbox`) and the jails."""
from __future__ import annotations

import dataclasses
import os

# A pipe's default capacity in pages (Linux PIPE_DEF_BUFFERS).
_PIPE_PAGES = 16


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the program under test)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program.

    timeout_s: wall-clock budget of ONE test case (also sets RLIMIT_CPU to ceil(timeout_s) + 1).
    memory_mb: RLIMIT_AS of each process of the program (address space, including the
      interpreter's ~0.1 GiB with numpy). It is a per-process limit: a program that forks can
      hold up to max_processes * memory_mb in total (see `program_memory_mb`).
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
    max_processes: int = 4
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

    @property
    def pipe_buffer_bytes(self) -> int:
        """The most the kernel's pipe buffers of one program can hold: every descriptor of
        every process a pipe of the default 16 pages (the jails refuse F_SETPIPE_SZ; they
        refuse sockets and memfds)."""
        return self.max_processes * self.max_open_files * _PIPE_PAGES * os.sysconf("SC_PAGE_SIZE")

    @property
    def program_memory_mb(self) -> int:
        """The most memory one program can hold: every process at its RLIMIT_AS, its working
        directory (tmpfs lives in memory) and its pipe buffers."""
        return (self.memory_mb * self.max_processes + self.workdir_mb
                + -(-self.pipe_buffer_bytes // (1 << 20)))
