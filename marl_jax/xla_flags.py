"""XLA flags the project sets for itself on NVIDIA GPUs, before JAX starts its backends.

Small models decode launch-bound on GPUs: each decode step is hundreds of small kernels. XLA's
command buffers (CUDA graphs) replay a captured sequence of kernels with one launch, but by
default they do not capture `while` loops and conditionals, the shape of every decode loop
here (the sampler's `while_loop` over steps, the layer scan inside it). `GPU_FLAGS` adds them.
A flag already named in `XLA_FLAGS` is left as the user set it; on other platforms nothing is
set, and `--config.model.xla_gpu_flags=none` sets nothing on GPUs either (every GPU program of
the process gets these flags: a run that must not, e.g. beside an XLA whose command buffers
crash on its loops, opts out). `apply` runs at the top of `experiments/run.py` (after the
config is checked, before JAX starts a backend) and `experiments/bench.py`, and returns what it
added, which they print first.
"""
from __future__ import annotations

import glob
import importlib.util
import os

# `config.model.xla_gpu_flags`: auto sets `GPU_FLAGS` on NVIDIA GPUs, none sets nothing.
MODES = ("auto", "none")
GPU_FLAGS = {
    "--xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def gpu_present() -> bool:
    """An NVIDIA GPU and a CUDA plugin of JAX are on this machine (read without starting JAX)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    for name in plugins:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def apply(environ=None, gpu: bool | None = None, mode: str = "auto") -> list[str]:
    """Adds `GPU_FLAGS` that `XLA_FLAGS` does not name yet to `environ` (default `os.environ`)
    when `gpu` (default: `gpu_present()`) and `mode` is auto; returns the flags added. Call
    before JAX's first backend use (XLA reads the flags when it starts a backend)."""
    if mode not in MODES:
        raise ValueError(f"config.model.xla_gpu_flags={mode!r}: must be one of {MODES}")
    if mode == "none":
        return []
    environ = os.environ if environ is None else environ
    if gpu is None:
        gpu = gpu_present() and environ.get("JAX_PLATFORMS", "gpu") not in ("cpu", "tpu")
    if not gpu:
        return []
    existing = environ.get("XLA_FLAGS", "")
    named = {token.split("=", 1)[0] for token in existing.split()}
    added = [f"{flag}={value}" for flag, value in GPU_FLAGS.items() if flag not in named]
    if added:
        environ["XLA_FLAGS"] = " ".join([existing, *added]).strip()
    return added


def current(environ=None) -> str:
    """`XLA_FLAGS` as this process sees it."""
    return (os.environ if environ is None else environ).get("XLA_FLAGS", "")
