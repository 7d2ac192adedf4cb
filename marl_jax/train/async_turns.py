"""Asynchronous PPO on a multi-turn task (the schedule: `train/async_schedule.py`; docs/async.md).

A trajectory's turns are split over its batch's k chunks, `ceil(max_turns / k)` turns each:
turn j of batch s is played by version max(0, s - k + min(j // chunk, k - 1)). Each batch plays
its episodes in a thread of its own (`rollout.turns.reprefill_turns`: every turn prefills the
history again with its version's weights, so a turn is exactly that version's policy given its
history), and the thread waits wherever the schedule asks for a version the trainer has not
made yet:

    iteration t:  the actor's weights are published as version t (a copy for the sampler);
                  batch t + k starts (its first chunk is version t's);
                  the trainer scores batch t (played to its end), advantages, update (t -> t + 1);
                  batch t + 1 is waited for (its last chunk was version t's).

A turn depends only on its version's weights, its history and its keys, so whatever the threads'
timing every run with the same seed and k plays the same trajectories. A checkpoint holds the
weights of the k versions before the step (`AsyncTurnsState`): a resumed run plays the batches in
flight again from their start (the environments replay from their seeds) and gets the same
trajectories. A batch's tokens count as generated when its last turn is played; in flight at a
row's end are those of batch t + 1, played and not yet trained.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.data import batches as batches_lib
from marl_jax.rollout import turns
from marl_jax.train import async_schedule, programs, sharding, turn_step
from marl_jax.train.async_step import batch_key, iteration_timing
from marl_jax.train.phased_step import PhaseClock
from marl_jax.train.ppo_types import PPOState, PPOStatic, role_params


@flax.struct.dataclass
class AsyncTurnsState:
    """The multi-turn asynchronous loop's state at the boundary before `ppo.step` = t: the
    trainer's `PPOState`, the actor's weights of versions t - k .. t - 1 (`past`; at t < k the
    first ones repeat version 0's), and the token accounting's totals (int32)."""

    ppo: PPOState
    past: tuple
    tokens_sampled: jax.Array
    tokens_trained: jax.Array
    tokens_masked: jax.Array

    @property
    def actor_params(self) -> Any:
        return self.ppo.actor_params


class Versions:
    """The actor's weights by version: published by the loop, waited for by the threads that
    play the batches; closing it stops the threads still waiting."""

    def __init__(self):
        self.cond, self.params, self.closed = threading.Condition(), {}, False

    def publish(self, version: int, params) -> None:
        with self.cond:
            self.params[version] = params
            self.cond.notify_all()

    def get(self, version: int):
        with self.cond:
            self.cond.wait_for(lambda: version in self.params or self.closed)
            if version not in self.params:
                raise RuntimeError(f"the loop stopped before version {version}")
            return self.params[version]

    def keep_from(self, version: int) -> None:
        """Forgets the versions before `version`, which no batch asks for any more."""
        with self.cond:
            for old in [v for v in self.params if v < version]:
                del self.params[old]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class EpisodeBatch:
    """Batch `index` played in a thread: `play(params_of_turn) -> Trajectory`, turn j with the
    weights of its version (`AsyncTurnsStep.version_of`); `prompts` its prompt ids and mask
    `[B, P]`; `finished` when its last turn was played (`time.perf_counter`)."""

    def __init__(self, play, index: int, version_of, versions: Versions, prompts):
        self.index, self.version_of, self.versions = index, version_of, versions
        self.prompts, self.trajectory, self.error, self.finished = prompts, None, None, None
        self.thread = threading.Thread(target=self._run, args=(play,), daemon=True)
        self.thread.start()

    def _run(self, play):
        try:
            self.trajectory = play(lambda turn: self.versions.get(self.version_of(self.index,
                                                                                  turn)))
        except BaseException as error:  # raised again in the loop's thread by `result`
            self.error = error
        self.finished = time.perf_counter()

    def result(self) -> turns.Trajectory:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.trajectory


class AsyncTurnsStep:
    """`(state: AsyncTurnsState, frozen, hparams, step) -> (state, metrics)`: one iteration of
    the multi-turn asynchronous loop (module docstring), `timed` as `config.ppo.phase_timing`
    asks (`timing/rollout_s`: from the iteration's start until batch t + 1, whose last chunk is
    this iteration's version's, was played)."""

    def __init__(self, config, task, static: PPOStatic, mods, state_sh, frozen_sh, mesh,
                 schedule: async_schedule.Schedule, *, timed: bool):
        self.static, self.schedule, self.timed, self.mesh = static, schedule, timed, mesh
        self.k = schedule.max_staleness
        self.chunk_turns = math.ceil(int(config.task.max_turns) / self.k)
        self.player = turn_step.TrajectoryPlayer(config, task, static, mods.policy)
        self.programs = {"score": programs.trajectory_score_program(static, mods, state_sh,
                                                                    frozen_sh, mesh).fn}
        phases = programs.phase_programs(static, mods, state_sh, frozen_sh, mesh)
        self.programs.update(advantages=phases["advantages"].fn, update=phases["update"].fn)
        # Weights of their own for the threads (the actor's are donated at the update).
        self.copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                            out_shardings=state_sh.actor_params)
        self.task, self.seed = task, int(config.seed)
        self.versions, self.batches, self.key_data = Versions(), {}, None

    def version_of(self, batch: int, turn: int) -> int:
        """The version that plays turn `turn` of batch `batch`'s trajectories."""
        return self.schedule.version(batch, min(turn // self.chunk_turns, self.k - 1))

    def _publish(self, version: int, params, frozen) -> None:
        if version >= 0:
            self.versions.publish(version, role_params(self.static, "actor", frozen, params))

    def _play(self, batch: int, frozen):
        """Starts batch `batch`: the prompts and environments of a synchronous step `batch`."""
        s = self.static
        rows = np.repeat(batches_lib.batch_indices(len(self.task.rl["ids"]), s.prompts_per_step,
                                                   self.seed + 2, batch), s.group_size)
        ids, mask = (np.asarray(self.task.rl[k])[rows] for k in ("ids", "mask"))
        task_rows = [self.task.info["rl_rows"][r] for r in rows]
        seeds = turn_step.episode_seeds(self.seed, batch, range(len(rows)))
        key = batch_key(self.key_data, batch)
        player = self.player

        def play(params_of_turn):
            return turns.reprefill_turns(
                player.policy, None, ids, mask, step_turns=player.turn_callback(task_rows, seeds),
                row_keys=jax.random.split(key, len(rows)), max_turns=player.max_turns,
                max_total_tokens=s.response_length, max_turn_tokens=player.max_turn_tokens,
                end_of_turn=player.end_of_turn, temperature=s.temperature, top_k=s.top_k,
                top_p=s.top_p, pad_id=s.pad_id, params_of_turn=params_of_turn)

        self.batches[batch] = EpisodeBatch(play, batch, self.version_of, self.versions,
                                           (ids, mask))

    def initial_state(self, ppo: PPOState, frozen) -> AsyncTurnsState:
        """The state before step 0: versions -k .. -1 are version 0's weights, zero totals."""
        zero = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(self.mesh))
        return AsyncTurnsState(ppo=ppo, past=tuple(self.copy(ppo.actor_params)
                                                   for _ in range(self.k)),
                               tokens_sampled=zero, tokens_trained=zero, tokens_masked=zero)

    def _start(self, state: AsyncTurnsState, frozen, step: int) -> None:
        """At the first iteration of a run, fresh or resumed: versions step - k .. step - 1 from
        the state, and batches step .. step + k - 1 played from their start."""
        self.key_data = np.asarray(jax.device_get(state.ppo.key))
        for i, params in enumerate(state.past):
            self._publish(step - self.k + i, params, frozen)
        for batch in range(step, step + self.k):
            self._play(batch, frozen)

    def trajectory_arrays(self, batch: int) -> dict:
        """Batch `batch`'s played trajectories as the score program reads them, with the version
        of every action token."""
        played = self.batches[batch].result()
        arrays = turn_step.trajectory_arrays(played)
        version = np.vectorize(lambda turn: self.version_of(batch, int(turn)))(arrays["turn_ids"])
        arrays["versions"] = np.where(arrays["kinds"] == turns.ACTION, version,
                                      async_schedule.NO_VERSION).astype(np.int32)
        return arrays

    def __call__(self, state: AsyncTurnsState, frozen, hparams, step: int):
        fresh = not self.batches
        if fresh:
            self._start(state, frozen, step)
        clock = PhaseClock(self.timed)
        started = clock.last
        latest = self.copy(state.ppo.actor_params)
        self._publish(step, latest, frozen)
        self._play(step + self.k, frozen)
        arrays = self.trajectory_arrays(step)
        ids, mask = self.batches.pop(step).prompts
        generated = int((arrays["kinds"] == turns.ACTION).sum()) if step == 0 and fresh else 0
        batch = sharding.shard_batch(dict(arrays, ids=ids, mask=mask), self.mesh)
        trajectory = {key: batch[key] for key in (*turn_step.TRAJECTORY_KEYS, "versions")}
        p = self.programs
        exp, roll_metrics = clock.done("score", p["score"](state.ppo, frozen, batch["ids"],
                                                           batch["mask"], trajectory))
        adv, adv_metrics = clock.done("advantages", p["advantages"](state.ppo, frozen, hparams,
                                                                    exp, None))
        ppo, metrics = clock.done("update", p["update"](state.ppo, exp, adv, roll_metrics,
                                                        adv_metrics, frozen))
        following = self.trajectory_arrays(step + 1)  # played to its end: its tokens count
        if self.timed:
            finished = self.batches[step + 1].finished
            clock.seconds["timing/rollout_s"] = max(0.0, finished - started)
        in_flight = int((following["kinds"] == turns.ACTION).sum())
        generated += in_flight
        self.versions.keep_from(step + 1 - self.k)
        trained, masked = (metrics.pop(f"async/batch_tokens_{name}") for name in ("trained",
                                                                                   "masked"))
        state = AsyncTurnsState(ppo=ppo, past=state.past[1:] + (latest,),
                                tokens_sampled=state.tokens_sampled + generated,
                                tokens_trained=state.tokens_trained + trained,
                                tokens_masked=state.tokens_masked + masked)
        metrics.update({"async/tokens_generated": state.tokens_sampled,
                        "async/tokens_trained": state.tokens_trained,
                        "async/tokens_stale": state.tokens_masked,
                        "async/tokens_in_flight": in_flight})
        if self.timed:
            metrics.update(iteration_timing(clock.seconds, time.perf_counter() - started))
        return state, dict(metrics, **clock.seconds)

    def close(self) -> None:
        """Stops the threads still waiting for a version."""
        self.versions.close()
