"""Asynchronous PPO's loop: the sampler runs up to k policy versions ahead of the trainer
(`rollout.max_staleness`; the schedule is `train/async_schedule.py`'s, docs/async.md says why).

    iteration t (the actor at version t):
      sampler   batch t + k: the prompts of step t + k, with the groups of batch t still
                unfinished in the places of its groups (`phases.rollout.carry_over`); then one
                chunk of each of batches t + 1 .. t + k (`phases.rollout.decode_chunk`: prompt
                and response so far prefilled again with version t's weights, `chunk_tokens`
                more tokens a response, each stamped with version t)
      trainer   batch t, all its chunks decoded: score (the proximal policy: version t's
                logprobs), advantages, update (t -> t + 1)

The two halves read the same weights and nothing of each other's outputs: on one set of devices
the loop runs them one after the other (nothing overlaps); with `rollout.sampler_devices` the
sampler decodes on its own devices while the trainer updates, and the new weights are copied to
the sampler's devices after each update. The partly decoded batches are part of the loop's state
(`AsyncState`): a checkpoint holds them, and a resumed run continues the schedule where it
stopped.

Every row carries the accounting `async/tokens_generated` = `async/tokens_trained` +
`async/tokens_stale` + `async/tokens_in_flight` (totals since the start; stale: tokens of trained
responses more than `max_token_staleness` versions old, and finished responses sampled again),
the staleness of the batch trained and, timed, where the iteration's time went.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from marl_jax.data import batches as batches_lib
from marl_jax.train import async_schedule, build, programs, sharding
from marl_jax.train.phased_step import PhaseClock
from marl_jax.train.ppo_types import PPOState, PPOStatic, role_params


@flax.struct.dataclass
class AsyncState:
    """What the asynchronous loop carries from one step to the next: the trainer's `PPOState`,
    the sampler's batches `step .. step + k - 1` (`PartialBatch`es; the first one's chunks all
    decoded) and the token accounting's totals (int32): sampled, trained, masked (trained
    responses' tokens over the staleness limit) and cleared (finished responses sampled
    again)."""

    ppo: PPOState
    batches: tuple
    tokens_sampled: jax.Array
    tokens_trained: jax.Array
    tokens_masked: jax.Array
    tokens_cleared: jax.Array

    @property
    def actor_params(self) -> Any:
        return self.ppo.actor_params


def batch_key(key_data, batch: int) -> jax.Array:
    """The sample key of batch `batch` from the run's raw key data (`PPOState.key`): the key step
    `batch` of a synchronous run samples with (`ppo_types.step_keys`), so the draws at a
    response position are the synchronous step's."""
    base = jax.random.wrap_key_data(jnp.asarray(key_data))
    return jax.random.split(jax.random.fold_in(base, batch), 3)[0]


class AsyncStep:
    """`(state: AsyncState, frozen, hparams, step) -> (state, metrics)`: one iteration of the
    asynchronous loop (module docstring), `timed` as `config.ppo.phase_timing` asks.

    With `sampler_mesh` (devices of its own) the sampler's programs run there on a copy of the
    actor's weights, made after each update, while the trainer's run on `mesh`; timed, a thread
    waits for the sampler's half (`timing/rollout_s`) while the trainer's phases are waited on
    one by one, and the weight copy is waited on (`timing/weight_copy_s`). On one mesh the
    halves run one after the other, each waited on when timed."""

    def __init__(self, config, task, static: PPOStatic, mods, state_sh, frozen_sh, mesh,
                 schedule: async_schedule.Schedule, *, timed: bool, sampler_mesh=None):
        if jax.process_count() > 1:
            raise ValueError(f"rollout.max_staleness={schedule.max_staleness}: the asynchronous "
                             "loop runs in one process")
        self.static, self.mods, self.schedule, self.timed = static, mods, schedule, timed
        self.mesh = mesh
        self.split = sampler_mesh is not None
        self.sampler_mesh = sampler_mesh if self.split else mesh
        self.rules = sharding.logical_rules(self.sampler_mesh, build.model_dims(
            mods.policy.config))
        # The actor's layout (its partition specs) on the sampler's mesh.
        self.params_sh = jax.tree.map(lambda s: NamedSharding(self.sampler_mesh, s.spec),
                                      state_sh.actor_params)
        self.programs = {name: program.fn for name, program in programs.async_programs(
            static, mods, state_sh, frozen_sh, mesh, schedule.chunk_tokens,
            sampler_mesh=self.sampler_mesh, sampler_params_sh=self.params_sh).items()}
        phases = programs.phase_programs(static, mods, state_sh, frozen_sh, mesh)
        self.programs.update(advantages=phases["advantages"].fn, update=phases["update"].fn)
        self.task_rl, self.seed = task.rl, int(config.seed)
        self.trainer_batch = sharding.batch_sharding(mesh)
        self.trainer_rep = sharding.replicated(mesh)
        # The sampler's weights (its own copy with devices of its own) and their version.
        self.weights, self.version, self.base = None, None, None
        self.key_data = None

    def sampler_context(self):
        """The sampler's mesh and logical rules, around its programs' calls."""
        return sharding.mesh_context(self.sampler_mesh, self.rules)

    def sampling_params(self, actor_params, frozen, version: int):
        """The params the sampler decodes with at `version`: the actor's, copied to the
        sampler's devices once per version when it has its own (with LoRA attached to the
        frozen base, itself copied there once)."""
        if not self.split:
            return role_params(self.static, "actor", frozen, actor_params)
        if self.version != version:
            self.weights, self.version = jax.device_put(actor_params, self.params_sh), version
        if not self.static.lora:
            return self.weights
        if self.base is None:
            self.base = jax.device_put(frozen.ref_params, jax.tree.map(
                lambda x: NamedSharding(self.sampler_mesh, x.sharding.spec), frozen.ref_params))
        return role_params(self.static, "actor", frozen.replace(ref_params=self.base),
                           self.weights)

    # The sampler ---------------------------------------------------------------------------------

    def fresh(self, step: int):
        """The batch of step `step`'s prompts (those a synchronous step `step` samples), nothing
        sampled."""
        rows = batches_lib.batch_indices(len(self.task_rl["ids"]), self.static.prompts_per_step,
                                         self.seed + 2, step)
        prompts = sharding.shard_batch({k: v[rows] for k, v in self.task_rl.items()},
                                       self.sampler_mesh)
        return self.programs["fresh"](prompts["ids"], prompts["mask"], prompts.get("documents"))

    def initial_state(self, ppo: PPOState, frozen) -> AsyncState:
        """The loop's state before step 0: batches 0 .. k - 1 after the sampler's warm-up
        (iterations -k .. -1, version 0: `ppo`'s actor), the totals counting their tokens."""
        zero = lambda mesh: jax.device_put(jnp.zeros((), jnp.int32),  # noqa: E731
                                           sharding.replicated(mesh))
        params = self.sampling_params(ppo.actor_params, frozen, 0)
        with self.sampler_context():
            batches = {b: self.fresh(b) for b in range(self.schedule.max_staleness)}
            sampled = zero(self.sampler_mesh)
            for iteration in self.schedule.warm_up():
                sampled = sampled + self._decode(params, ppo, batches, iteration)[0]
        return AsyncState(ppo=ppo, batches=tuple(batches[b] for b in sorted(batches)),
                          tokens_sampled=sampled, tokens_trained=zero(self.mesh),
                          tokens_masked=zero(self.mesh), tokens_cleared=zero(self.sampler_mesh))

    def _decode(self, params, ppo: PPOState, batches: dict, iteration: int):
        """Decodes the chunks `schedule.decoded_at(iteration)` of `batches` {batch index:
        PartialBatch} with `params` (the version of iteration `iteration`), in place; returns
        the tokens sampled and prefilled."""
        rep = sharding.replicated(self.sampler_mesh)
        sampled = prefilled = jnp.zeros((), jnp.int32)
        if self.key_data is None:  # the run's key, constant over its steps, kept on the host
            self.key_data = np.asarray(jax.device_get(ppo.key))
        for batch, chunk in self.schedule.decoded_at(iteration):
            version = jax.device_put(jnp.int32(self.schedule.version(batch, chunk)), rep)
            key = jax.device_put(batch_key(self.key_data, batch), rep)
            batches[batch], new, prefill = self.programs["decode"](params, batches[batch], key,
                                                                   version)
            sampled, prefilled = sampled + new, prefilled + prefill
        return sampled, prefilled

    def sample(self, state: AsyncState, params, step: int):
        """The sampler's half of iteration `step`: (batches step + 1 .. step + k, the totals of
        tokens sampled and cleared, the sampler's metrics), on the sampler's devices."""
        k = self.schedule.max_staleness
        with self.sampler_context():
            new = self.fresh(step + k)
            cleared = jnp.zeros((), jnp.int32)
            if self.schedule.carries_over:
                target = jax.device_put(jnp.int32(step + k), sharding.replicated(
                    self.sampler_mesh))
                new, cleared, _ = self.programs["carry"](state.batches[0], new, target)
            batches = {step + j: batch for j, batch in enumerate(state.batches[1:] + (new,), 1)}
            sampled, prefilled = self._decode(params, state.ppo, batches, step)
            batches = tuple(batches[b] for b in sorted(batches))
            sampled_total = state.tokens_sampled + sampled
            metrics = {"budget/generated_tokens": sampled.astype(jnp.float32),
                       "budget/prefill_tokens": prefilled.astype(jnp.float32),
                       "budget/generated_tokens_total": sampled_total.astype(jnp.float32),
                       "async/tokens_generated": sampled_total,
                       "async/tokens_in_flight": sum(b.mask.sum() for b in batches)}
            return batches, sampled_total, state.tokens_cleared + cleared, metrics

    # The iteration -------------------------------------------------------------------------------

    def __call__(self, state: AsyncState, frozen, hparams, step: int):
        clock = PhaseClock(self.timed)
        started = clock.last
        params = self.sampling_params(state.ppo.actor_params, frozen, step)
        sampler = self.sample(state, params, step)
        if self.split:
            waiting = SamplerWait(sampler, started) if self.timed else None
        else:
            sampler = clock.done("rollout", sampler)
        in_flight, sampled_total, cleared_total, sampler_metrics = sampler
        p = self.programs
        finished = jax.device_put(state.batches[0], self.trainer_batch)
        exp, roll_metrics = clock.done("score", p["score"](state.ppo, frozen, finished))
        adv, adv_metrics = clock.done("advantages", p["advantages"](state.ppo, frozen, hparams,
                                                                    exp, None))
        ppo, metrics = clock.done("update", p["update"](state.ppo, exp, adv, roll_metrics,
                                                        adv_metrics, frozen))
        copy_s = 0.0
        if self.split:
            copied = time.perf_counter()
            self.sampling_params(ppo.actor_params, frozen, step + 1)
            if self.timed:
                jax.block_until_ready(self.weights)
                copy_s = time.perf_counter() - copied
                clock.seconds["timing/rollout_s"] = waiting.seconds()
        trained, masked = (metrics.pop(f"async/batch_tokens_{name}") for name in ("trained",
                                                                                   "masked"))
        state = AsyncState(ppo=ppo, batches=in_flight, tokens_sampled=sampled_total,
                           tokens_trained=state.tokens_trained + trained,
                           tokens_masked=state.tokens_masked + masked,
                           tokens_cleared=cleared_total)
        metrics.update(sampler_metrics)
        metrics.update({
            "async/tokens_trained": state.tokens_trained,
            "async/tokens_stale": state.tokens_masked + jax.device_put(cleared_total,
                                                                       self.trainer_rep)})
        if self.timed:
            metrics.update(iteration_timing(clock.seconds, time.perf_counter() - started,
                                            copy_s))
        return state, dict(metrics, **clock.seconds)


class SamplerWait:
    """A thread that waits for the sampler's outputs: `seconds()` from `started` until they
    were ready, however long the trainer's half ran meanwhile."""

    def __init__(self, outputs, started: float):
        self.started, self.done = started, None
        self.thread = threading.Thread(target=self._wait, args=(outputs,), daemon=True)
        self.thread.start()

    def _wait(self, outputs):
        jax.block_until_ready(outputs)
        self.done = time.perf_counter()

    def seconds(self) -> float:
        self.thread.join()
        return self.done - self.started


def iteration_timing(seconds: dict, iteration_s: float, weight_copy_s: float = 0.0) -> dict:
    """Where an iteration's time went: the sampler's and the trainer's idle fractions (each
    half's time against the iteration's), the weight copy, and the overlap (sampler + trainer
    time) / iteration time: 1 when the halves run one after the other, up to 2 when they run
    entirely at once."""
    sampler = seconds["timing/rollout_s"]
    trainer = sum(seconds[f"timing/{phase}_s"] for phase in ("score", "advantages", "update"))
    return {"timing/iteration_s": iteration_s,
            "timing/sampler_idle_frac": max(0.0, 1.0 - sampler / iteration_s),
            "timing/trainer_idle_frac": max(0.0, 1.0 - trainer / iteration_s),
            "timing/weight_copy_s": weight_copy_s,
            "timing/overlap": (sampler + trainer) / iteration_s}
