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

import time
from typing import Any

import flax
import jax
import jax.numpy as jnp

from marl_jax.data import batches as batches_lib
from marl_jax.train import async_schedule, programs, sharding
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

    def in_flight(self) -> jax.Array:
        """Tokens sampled into the batches not yet trained."""
        return sum(batch.mask.sum() for batch in self.batches)


def batch_key(state: PPOState, batch: int) -> jax.Array:
    """The sample key of batch `batch`: the key step `batch` of a synchronous run samples with
    (`ppo_types.step_keys`), so the draws at a response position are the synchronous step's."""
    base = jax.random.wrap_key_data(state.key)
    return jax.random.split(jax.random.fold_in(base, batch), 3)[0]


class AsyncStep:
    """`(state: AsyncState, frozen, hparams, step) -> (state, metrics)`: one iteration of the
    asynchronous loop (module docstring), `timed` as `config.ppo.phase_timing` asks (each half
    waited on; `timing/rollout_s` is the sampler's)."""

    def __init__(self, config, task, static: PPOStatic, mods, state_sh, frozen_sh, mesh,
                 schedule: async_schedule.Schedule, *, timed: bool):
        if jax.process_count() > 1:
            raise ValueError(f"rollout.max_staleness={schedule.max_staleness}: the asynchronous "
                             "loop runs in one process")
        self.static, self.mods, self.schedule, self.timed = static, mods, schedule, timed
        self.mesh = mesh
        self.programs = {name: program.fn for name, program in programs.async_programs(
            static, mods, state_sh, frozen_sh, mesh, schedule.chunk_tokens).items()}
        phases = programs.phase_programs(static, mods, state_sh, frozen_sh, mesh)
        self.programs.update(advantages=phases["advantages"].fn, update=phases["update"].fn)
        self.task_rl, self.seed = task.rl, int(config.seed)

    # The sampler ---------------------------------------------------------------------------------

    def fresh(self, step: int):
        """The batch of step `step`'s prompts (those a synchronous step `step` samples), nothing
        sampled."""
        rows = batches_lib.batch_indices(len(self.task_rl["ids"]), self.static.prompts_per_step,
                                         self.seed + 2, step)
        prompts = sharding.shard_batch({k: v[rows] for k, v in self.task_rl.items()}, self.mesh)
        return self.programs["fresh"](prompts["ids"], prompts["mask"], prompts.get("documents"))

    def initial_state(self, ppo: PPOState, frozen) -> AsyncState:
        """The loop's state before step 0: batches 0 .. k - 1 after the sampler's warm-up
        (iterations -k .. -1, version 0: `ppo`'s actor), the totals counting their tokens."""
        zero = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(self.mesh))
        batches = {b: self.fresh(b) for b in range(self.schedule.max_staleness)}
        params = role_params(self.static, "actor", frozen, ppo.actor_params)
        sampled = zero
        for iteration in self.schedule.warm_up():
            sampled = sampled + self._decode(params, ppo, batches, iteration)[0]
        return AsyncState(ppo=ppo, batches=tuple(batches[b] for b in sorted(batches)),
                          tokens_sampled=sampled, tokens_trained=zero, tokens_masked=zero,
                          tokens_cleared=zero)

    def _decode(self, params, ppo: PPOState, batches: dict, iteration: int):
        """Decodes the chunks `schedule.decoded_at(iteration)` of `batches` {batch index:
        PartialBatch} with `params` (version max(0, iteration)), in place; returns the tokens
        sampled and prefilled."""
        version = jnp.int32(max(0, iteration))
        sampled = prefilled = jnp.zeros((), jnp.int32)
        for batch, _ in self.schedule.decoded_at(iteration):
            batches[batch], new, prefill = self.programs["decode"](
                params, batches[batch], batch_key(ppo, batch), version)
            sampled, prefilled = sampled + new, prefilled + prefill
        return sampled, prefilled

    def sample(self, state: AsyncState, params, step: int):
        """The sampler's half of iteration `step`: (batches step + 1 .. step + k, tokens sampled,
        tokens prefilled, tokens cleared)."""
        k = self.schedule.max_staleness
        new = self.fresh(step + k)
        cleared = jnp.zeros((), jnp.int32)
        if self.schedule.carries_over:
            new, cleared, _ = self.programs["carry"](state.batches[0], new, jnp.int32(step + k))
        batches = {step + j: batch for j, batch in enumerate(state.batches[1:] + (new,), 1)}
        sampled, prefilled = self._decode(params, state.ppo, batches, step)
        return tuple(batches[b] for b in sorted(batches)), sampled, prefilled, cleared

    # The iteration -------------------------------------------------------------------------------

    def __call__(self, state: AsyncState, frozen, hparams, step: int):
        params = role_params(self.static, "actor", frozen, state.ppo.actor_params)
        clock = PhaseClock(self.timed)
        started = clock.last
        in_flight, sampled, prefilled, cleared = clock.done("rollout", self.sample(state, params,
                                                                                   step))
        p = self.programs
        exp, roll_metrics = clock.done("score", p["score"](state.ppo, frozen, state.batches[0]))
        adv, adv_metrics = clock.done("advantages", p["advantages"](state.ppo, frozen, hparams,
                                                                    exp, None))
        ppo, metrics = clock.done("update", p["update"](state.ppo, exp, adv, roll_metrics,
                                                        adv_metrics, frozen))
        trained, masked = (metrics.pop(f"async/batch_tokens_{name}") for name in ("trained",
                                                                                   "masked"))
        state = AsyncState(ppo=ppo, batches=in_flight,
                           tokens_sampled=state.tokens_sampled + sampled,
                           tokens_trained=state.tokens_trained + trained,
                           tokens_masked=state.tokens_masked + masked,
                           tokens_cleared=state.tokens_cleared + cleared)
        metrics.update({
            "budget/generated_tokens": sampled.astype(jnp.float32),
            "budget/prefill_tokens": prefilled.astype(jnp.float32),
            "budget/generated_tokens_total": state.tokens_sampled.astype(jnp.float32),
            "async/tokens_generated": state.tokens_sampled,
            "async/tokens_trained": state.tokens_trained,
            "async/tokens_stale": state.tokens_masked + state.tokens_cleared,
            "async/tokens_in_flight": state.in_flight()})
        if self.timed:
            metrics.update(iteration_timing(clock.seconds, time.perf_counter() - started))
        return state, dict(metrics, **clock.seconds)


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
