"""One compilation of each distinct program per run: JAX's persistent compilation cache in a
directory of the run's own.

A run builds the same program more than once: every arm of an experiment that runs in its own
program (`config.experiment.runs_per_program`) jits the same PPO step and evaluation afresh, and
every sampled part of the review task the same sampler. Through the persistent cache the second
and later builds load the first one's executable instead of compiling it again (SmolLM2's PPO
step compiles in ~45 s on a 2-core CPU).

The directory is temporary and local to the process, removed when the process exits: no entry
is read while another process writes it (each process of a multi-host run has its own), and no
executable compiled for one machine's CPU is ever loaded on another. A cache configured already
(`JAX_COMPILATION_CACHE_DIR`, or `jax_compilation_cache_dir` set in the process) is left alone.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import jax

# Programs that compile faster than this are not worth a cache entry.
MIN_COMPILE_SECONDS = 1.0


def use_run_cache() -> str:
    """Turns on the persistent compilation cache in a temporary directory of this process's (or
    keeps the one configured already); returns the directory. Calling it again does nothing."""
    configured = jax.config.jax_compilation_cache_dir or os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", "")
    if configured:
        return configured
    run_dir = tempfile.mkdtemp(prefix="marl_jax_xla_cache_")
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", run_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return run_dir
