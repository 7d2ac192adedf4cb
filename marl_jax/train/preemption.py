"""A preempted run stops where nothing is half written (in training, at a step boundary with its
checkpoint), and says so.

A Spot or preemptible Cloud TPU VM (like a Kubernetes pod or a Slurm job given `--signal`) gets
SIGTERM and about 30 s of notice before it goes away. While `watching()` is on, a SIGTERM no
longer ends the process at once: inside a training loop (`marl_jax.train.loop`) the loop
finishes the step in flight, saves that step's checkpoint and raises `Preempted`; outside one
(loading, sampling data, evaluating, exporting, between stages) the run stops with `Preempted`
at a point where nothing is half written. `experiments/run.py` prints its one line and exits
with `EXIT_STATUS`. Running the same command again resumes at that step, or redoes the work
after the last finished stage or export.

How the processes agree where to stop:
  one process   a SIGTERM handler sets a flag that the loop reads at every step boundary.
                Outside a training loop no step is in flight, and what a stop there could cut
                short is written beside its place and renamed into it (exports, sampled data,
                the evaluation's files), so the handler stops the run at once.
  several       JAX's distributed runtime owns SIGTERM (its preemption notifier, started with
                `jax.distributed.initialize`): a notice that reaches any process reaches all of
                them, and `multihost_utils.reached_preemption_sync_point(n)` is True on every
                process at the same point n, one past the furthest point any process had
                passed (orbax's CheckpointManager reads the same sync point). The points are the
                step boundaries of the training loops (`at_boundary()`) and, outside them, the
                safe points (`safe_point(where)`): between the eval stage's sampling batches,
                after an export's rename, after sampled data or preference pairs, after the
                reward model's gold agreement, before an experiment group's step-0 evaluation
                and after its final evaluations. They are numbered together from the start of
                the process, every process calling them in the same order, so a sync point that
                falls after a stage's last step is reached at the next safe point or in the next
                stage. A notice after the last of them is absorbed: the run finishes.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator, Optional

import jax
from jax.experimental import multihost_utils

# EX_TEMPFAIL of sysexits.h ("a temporary failure; the user is invited to retry"): distinct from
# 0, from 1 (a bug), 2 (a bad config or input) and 128 + 15 (killed by SIGTERM unhandled).
EXIT_STATUS = 75

SIGNAL_FLAG = "signal"   # one process: this module's SIGTERM handler
SYNC_POINT = "sync"      # several processes: JAX's preemption sync point
OFF = "off"              # not watching, or several processes without JAX's preemption service


class Preempted(BaseException):
    """The run stopped for a preemption notice. A BaseException, like KeyboardInterrupt: no
    `except Exception` on its way (a library's, or a fallback) may swallow it.

    Attributes:
      stage: the stage that stopped at a step boundary; None outside a training loop.
      step: the stage's step at that boundary, whose checkpoint is on disk (0: none was taken).
      directory: that stage's checkpoint directory.
      at: outside a training loop, the safe point the run stopped at ("": at once, with one
        process).
    """

    def __init__(self, stage: Optional[str] = None, step: int = 0, directory: str = "", *,
                 at: str = ""):
        self.stage, self.step, self.directory, self.at = stage, step, directory, at
        if stage is None and at:
            where = f"stopped outside a training loop at a safe point ({at}), with nothing " \
                    "half written"
        elif stage is None:
            where = "stopped outside a training loop, with no step in flight"
        elif not step:
            where = f"stopped before the first step of {stage}, with no step in flight"
        else:
            where = f"{stage} stopped at step {step} with its checkpoint in {directory}/{step}"
        super().__init__(f"preempted: {where}; the same command resumes there (exit status "
                         f"{EXIT_STATUS})")


_mode = OFF
_requested = False   # one process: a SIGTERM arrived
_in_loop = False     # one process: a training loop runs, and reads `_requested` at its boundaries
_boundaries = 0      # several processes: boundaries passed in this process


def mode() -> str:
    """How a notice is received now: SIGNAL_FLAG, SYNC_POINT or OFF."""
    return _mode


@contextlib.contextmanager
def watching() -> Iterator[str]:
    """Stops the block's training at a step boundary on a preemption notice (see the module
    docstring); yields the mode. Enter it after `marl_jax.distributed.initialize` (the mode
    depends on it), from the main thread. On exit SIGTERM is handled as before."""
    global _mode, _requested, _in_loop
    if _mode != OFF:
        yield _mode
        return
    if jax.distributed.is_initialized():
        if not jax.config.jax_enable_preemption_service:
            logging.warning("jax_enable_preemption_service is off: a preemption notice stops "
                            "this multi-process run without a checkpoint")
            yield OFF
            return
        _mode = SYNC_POINT
        try:
            yield _mode
        finally:
            _mode = OFF
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption.watching() must be entered from the main thread "
                           "(Python runs signal handlers there only)")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _mode, _requested, _in_loop = SIGNAL_FLAG, False, False
    try:
        yield _mode
    finally:
        signal.signal(signal.SIGTERM, previous)
        _mode, _requested, _in_loop = OFF, False, False


def _on_sigterm(signum, frame) -> None:
    global _requested
    if _requested:
        return  # one stop per run: the cleanup on the way out is not interrupted again
    _requested = True
    if not _in_loop:
        raise Preempted()


@contextlib.contextmanager
def steps(stage: str) -> Iterator[None]:
    """The body of a training loop, whose boundaries call `at_boundary()`. With one process a
    notice that arrived during the loop's last step but after its last boundary stops the run
    on leaving the block (the stage's checkpoints are complete by then)."""
    global _in_loop
    if _mode != SIGNAL_FLAG:
        yield
        return
    _in_loop = True
    try:
        yield
    finally:
        _in_loop = False
    if _requested:
        raise Preempted()


def at_boundary() -> bool:
    """True at the step boundary where every process stops for a preemption notice. Every
    process calls it at every step boundary of every stage, in the same order."""
    return _reached()


def safe_point(where: str) -> None:
    """Raises `Preempted` (stage None, `at=where`) when the run stops here for a preemption
    notice: a point outside a training loop where nothing is half written and no collective is
    in flight. Every process calls it at the same points, in the same order among themselves
    and the step boundaries (where it stops, every process stops). Not inside a training loop:
    there only a step boundary, with its checkpoint, may stop the run."""
    if _reached():
        raise Preempted(at=where)


def _reached() -> bool:
    """Whether the run stops at this point (a step boundary or a safe point)."""
    global _boundaries
    if _mode == SIGNAL_FLAG:
        return _requested
    if _mode == SYNC_POINT:
        _boundaries += 1
        return multihost_utils.reached_preemption_sync_point(_boundaries)
    return False
