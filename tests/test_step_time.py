"""`perf/step_s` is the step's own time whatever `log_every` is: the training loop dispatches steps
ahead of the device, and a checkpoint or an evaluation at an unlogged step must not take the
queued steps' device time as its own.

The loop runs a jitted step of known cost (a matmul chain sized here to about 150 ms), real orbax
checkpoints and the metrics writer. The wall time per step it should report is measured around
it: the clock between its rows, less the checkpoints' and the evaluations' own seconds, each
timed by the test once the state it reads is ready.
"""
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.train import loop, metrics

WIDTH = 256
STEP_SECONDS = 0.15  # the device time one step is sized to (a loaded CPU jitters by ~0.1 s)
LOG_EVERY = 5
TOLERANCE = 0.2


def _step_program():
    """(`(state, step) -> (state, metrics)`, state): a chain of `[WIDTH, WIDTH]` matmuls long
    enough to take about `STEP_SECONDS` here, compiled; and its blocking seconds per step."""
    w = jax.random.normal(jax.random.key(1), (WIDTH, WIDTH)) / math.sqrt(WIDTH)

    def chain(x, length):
        return jax.lax.fori_loop(0, length, lambda _, y: jnp.tanh(y @ w), x)

    x = jax.random.normal(jax.random.key(0), (WIDTH, WIDTH))
    probe = jax.jit(chain, static_argnums=1)
    probe(x, 16).block_until_ready()
    start = time.perf_counter()
    probe(x, 16).block_until_ready()
    length = max(16, round(16 * STEP_SECONDS / (time.perf_counter() - start)))
    program = jax.jit(lambda x: chain(x, length))

    def step_fn(state, step):
        x = program(state["x"])
        return {"x": x}, {"mean": jnp.mean(x)}

    state = {"x": x}
    jax.block_until_ready(step_fn(state, 0))  # compiled before anything is timed
    start = time.perf_counter()
    jax.block_until_ready(step_fn(state, 0))
    return step_fn, state, time.perf_counter() - start


class _Clock:
    """What the test times of a run: when each step is called, when each row is written, and
    the seconds of each checkpoint and evaluation (`done` -> seconds), each started on a ready
    state."""

    def __init__(self):
        self.calls, self.rows, self.saves, self.evals = [], {}, {}, {}

    def seconds_per_step(self, step):
        """Wall-clock seconds per step of the `LOG_EVERY` steps a row at `step` reports, less
        the checkpoints and evaluations among them (the checkpoint of the row's own step comes
        after the row)."""
        begin = self.rows.get(step - LOG_EVERY, self.calls[0])
        outside = sum(s for done, s in [*self.saves.items(), *self.evals.items()]
                      if step - LOG_EVERY <= done < step)
        return (self.rows[step] - begin - outside) / LOG_EVERY


def _run(workdir, step_fn, state, *, checkpoint_every, hooks=None, hooks_due=None,
         total_steps=10):
    clock = _Clock()
    stage = loop.Stage("toy", str(workdir))
    save = stage.save

    def timed_save(done, state, metadata):
        jax.block_until_ready(state)
        start = time.perf_counter()
        save(done, state, metadata)
        clock.saves[done] = time.perf_counter() - start

    def timed_step(state, step):
        clock.calls.append(time.perf_counter())
        return step_fn(state, step)

    def timed_hooks(state, done):
        if hooks_due is None or hooks_due(done):
            jax.block_until_ready(state)
        start = time.perf_counter()
        rows = hooks(state, done)
        if rows:
            clock.evals[done] = time.perf_counter() - start
        return rows

    stage.save = timed_save
    with metrics.MetricsWriter(workdir, tensorboard=False) as writer:
        write = writer.write

        def timed_write(row):
            write(row)
            if row.get("stage") == "toy":
                clock.rows[row["step"]] = time.perf_counter()

        writer.write = timed_write
        loop.run(stage, state=state, total_steps=total_steps, step_fn=timed_step,
                 writer=writer, metadata={}, checkpoint_every=checkpoint_every,
                 log_every=LOG_EVERY, hooks=None if hooks is None else timed_hooks,
                 hooks_due=hooks_due)
    stage.close()
    return metrics.read_metrics(workdir, stage="toy"), clock


def test_step_s_with_a_checkpoint_at_every_step_is_the_steps_time(tmp_path):
    step_fn, state, blocking = _step_program()
    assert blocking > STEP_SECONDS / 3  # device time that a checkpoint could take as its own
    rows, clock = _run(tmp_path, step_fn, state, checkpoint_every=1)
    assert [r["step"] for r in rows] == [5, 10]
    assert sorted(clock.saves) == list(range(1, 11))
    for row in rows:
        wall = clock.seconds_per_step(row["step"])
        assert row["perf/step_s"] == pytest.approx(wall, rel=TOLERANCE), (row, wall, blocking)


def test_an_evaluation_at_an_unlogged_step_times_itself_only(tmp_path):
    """Steps 1-3 (6-8) are queued when the hook evaluates after step 3 (8): `timing/eval_s` is
    the hook's own 0.3 s and `perf/step_s` keeps the queued steps."""
    step_fn, state, blocking = _step_program()
    pause = 0.3

    def hooks(state, done):
        if done % LOG_EVERY != 3:
            return []
        np.asarray(state["x"]).sum()  # an evaluation reads the state
        time.sleep(pause)
        return [{"stage": "eval", "done": done}]

    rows, clock = _run(tmp_path, step_fn, state, checkpoint_every=10, hooks=hooks,
                       hooks_due=lambda done: done % LOG_EVERY == 3)
    assert [r["step"] for r in rows] == [5, 10] and sorted(clock.evals) == [3, 8]
    for row in rows:
        wall = clock.seconds_per_step(row["step"])
        assert row["perf/step_s"] == pytest.approx(wall, rel=TOLERANCE), (row, wall, blocking)
        assert row["timing/eval_s"] == pytest.approx(pause, rel=TOLERANCE), row


@pytest.mark.parametrize("with_hooks", [False, True])
def test_steps_with_nothing_timed_between_them_are_dispatched_ahead(tmp_path, with_hooks):
    """No checkpoint until step 10, and no hook, or hooks that are not due before step 10: the
    loop does not wait for steps 1-4, so it calls the fifth step before the device could have
    run the first four."""
    step_fn, state, blocking = _step_program()
    hooks = dict(hooks=lambda state, done: [], hooks_due=lambda done: done == 10) \
        if with_hooks else {}
    rows, clock = _run(tmp_path / str(with_hooks), step_fn, state, checkpoint_every=10, **hooks)
    assert sorted(clock.saves) == [10]
    assert clock.calls[4] - clock.calls[0] < 2 * blocking, (clock.calls, blocking)
    for row in rows:
        wall = clock.seconds_per_step(row["step"])
        assert row["perf/step_s"] == pytest.approx(wall, rel=TOLERANCE), (row, wall, blocking)
