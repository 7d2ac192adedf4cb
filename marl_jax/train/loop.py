"""The resumable outer loop every stage shares: restore, step, log, checkpoint, repeat.

A stage's state lives in `<workdir>/checkpoints/<stage>/<step>`. Running the same command again
restores the latest complete checkpoint, drops metrics rows logged after it, and continues, so a
run killed at any moment loses at most `checkpoint_every` steps and never duplicates a row. A
stage whose final checkpoint exists is complete and is not run again. Under
`preemption.watching()` a preemption notice (SIGTERM) loses no step: every process saves the
checkpoint of the same step boundary and the loop raises `preemption.Preempted`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from marl_jax.train import checkpoint as ckpt_lib
from marl_jax.train import perf, preemption
from marl_jax.train.metrics import ProgressBar

# Shown on the progress line after a stage's own keys, where a row has them.
PERF_PROGRESS_KEYS = ("perf/tokens_per_s", "perf/mfu")


class Stage:
    """Checkpoint bookkeeping of one stage (`sft`, `rm`, `ppo`, or an experiment group)."""

    def __init__(self, name: str, workdir: str, *, max_to_keep: int = 2):
        self.name = name
        self.checkpointer = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(workdir, name),
                                                  max_to_keep=max_to_keep)

    def latest_step(self) -> Optional[int]:
        return self.checkpointer.latest_step()

    def restore(self, abstract_state, shardings=None, step=None):
        return self.checkpointer.restore(step=step, abstract_state=abstract_state,
                                         shardings=shardings)

    def save(self, step: int, state, metadata: Mapping[str, Any]):
        self.checkpointer.save(step, state, dict(metadata))

    def close(self):
        self.checkpointer.wait()
        self.checkpointer.close()


def run(stage: Stage, *, state, total_steps: int, step_fn: Callable, writer, metadata: dict,
        checkpoint_every: int, log_every: int = 1, abstract_state=None, shardings=None,
        row_keys: Optional[dict] = None, progress_keys=(), hooks: Callable = None,
        hooks_due: Optional[Callable[[int], bool]] = None,
        cost: Optional[Callable] = None, peak_flops: Optional[float] = None,
        truncate_stages=None):
    """Runs `state = step_fn(state, step)` from the latest checkpoint to `total_steps`.

    Args:
      step_fn: `(state, step) -> (state, metrics)`; `step` is the 0-based index of the step
        being taken; metrics are device scalars, fetched once per logged step.
      abstract_state / shardings: how to restore (defaults: the shapes and shardings of `state`).
      row_keys: extra keys of every metrics row (e.g. arm, seed).
      hooks: `(state, done_steps) -> list[rows]` called after every step (evaluation rows).
      hooks_due: `(done_steps) -> bool`, the steps whose hook call does work (e.g.
        `evaluation_steps`); None: any step's may.
      cost: `(row) -> (tokens, model FLOPs)` of one step from its logged row (host values), for
        the `perf/*` fields (`perf.step_fields`); `peak_flops`: the peak FLOP/s of all devices
        (None: no `perf/mfu`).
      truncate_stages: stages whose rows after a restored step are dropped (default: this one).

    Every logged row carries `perf/step_s`: the wall-clock seconds per step since the previous
    logged row (the first includes compiling), without the hooks' and the checkpoints' time;
    with `hooks`, `timing/eval_s`: the seconds of the hook calls that gave rows (evaluations)
    since the previous logged row, this step's included (0 when none did). The row is written
    before the hooks' rows. Steps are dispatched ahead of the devices; before the hooks or a
    checkpoint start their stopwatch the loop waits for the state, so that the steps still
    queued count as steps whatever `log_every` is (a step waits for its state when its hook
    call is due, when it checkpoints, and when it is logged, for its metrics).
    Returns:
      (state, start_step): the final state and the step the run resumed from.
    """
    row_keys = dict(row_keys or {})
    start = stage.latest_step() or 0
    if start:
        if abstract_state is None:
            abstract_state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        if shardings is None:
            shardings = jax.tree.map(lambda x: x.sharding, state)
        state, saved = stage.restore(abstract_state, shardings, step=start)
        ckpt_lib.check_same_base(saved, metadata, stage.name)
    # Rows logged after the step we start from (also from a run killed before its first
    # checkpoint) are logged again below.
    for name in truncate_stages or (stage.name,):
        writer.truncate_after(name, start, **row_keys)
    if start >= total_steps:
        return state, start
    with preemption.steps(stage.name):
        if preemption.at_boundary():
            stage.close()
            raise preemption.Preempted(stage.name, start, stage.checkpointer.directory)
        bar = ProgressBar(total_steps, initial=start, desc=stage.name)
        shown = tuple(progress_keys) + PERF_PROGRESS_KEYS
        last_time, last_logged = time.perf_counter(), start
        outside = evaluating = 0.0  # seconds of hooks and checkpoints since the last logged row
        for step in range(start, total_steps):
            state, metrics = step_fn(state, step)
            done = step + 1
            row = None
            if done % log_every == 0 or done == total_steps:
                row = {k: _host_value(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                seconds = (now - last_time - outside) / (done - last_logged)
                last_time, last_logged, outside = now, done, 0.0
                if cost is not None:
                    row.update(perf.step_fields(seconds, *cost(row), peak_flops))
                else:
                    row["perf/step_s"] = seconds
            extra = []
            if hooks is not None:
                if hooks_due is None or hooks_due(done):
                    # Steps still queued on the devices are the steps' time, not the hooks'.
                    jax.block_until_ready(state)
                started = time.perf_counter()
                extra = hooks(state, done)
                spent = time.perf_counter() - started
                outside += spent
                if extra:
                    evaluating += spent
            if row is not None:
                if hooks is not None:
                    row["timing/eval_s"], evaluating = evaluating, 0.0
                row = {"stage": stage.name, "step": done, **row_keys, **row}
                writer.write(row)
                bar.update(done, {k: float(np.mean(row[k])) for k in shown if k in row})
            else:
                bar.update(done)
            for hook_row in extra:
                writer.write({"step": done, **row_keys, **hook_row})
            # Every row of this step is written: the checkpoint of `done` resumes after them.
            stop = preemption.at_boundary()
            if stop or ckpt_lib.should_save(done, checkpoint_every, total_steps):
                jax.block_until_ready(state)  # likewise for the checkpoint's time
                started = time.perf_counter()
                stage.save(done, state, metadata)
                outside += time.perf_counter() - started
            if stop:
                bar.close()
                stage.close()  # waits until the checkpoint is on disk
                raise preemption.Preempted(stage.name, done, stage.checkpointer.directory)
        bar.close()
        stage.checkpointer.wait()
    return state, start


def evaluation_steps(eval_every: int, total_steps: int) -> Callable[[int], bool]:
    """`(done_steps) -> bool`: every `eval_every` steps and after the last one (never when
    `eval_every` <= 0): when a stage's held-out evaluation runs."""
    return lambda done: eval_every > 0 and (done % eval_every == 0 or done == total_steps)


def _host_value(v):
    """A float for a scalar metric; a list for a per-run vector (vmapped experiments)."""
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else [float(x) for x in a.reshape(-1)]
