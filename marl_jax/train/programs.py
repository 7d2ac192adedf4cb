"""The jitted, sharded programs of the stages: what the trainers run and what
`experiments/bench.py memory` compiles (through `marl_jax.train.aot`), one definition for both.

    supervised_program   (state, batch) -> (state, metrics)          SFT and reward-model steps
    ppo_step_program     (state, frozen, hparams, ids, mask, documents) -> (state, metrics)
    rollout_program      (state, frozen, ids, mask, documents) -> (experience, metrics)
    update_program       (state, experience, rollout metrics, hparams, segments, frozen)
                         -> (state, metrics)
    experiment_step_program  the ppo step vmapped over runs (`marl_jax.experiment`): every
                         argument but `frozen` with a leading run axis `[runs, ...]`
    phase_programs       the four phases of the ppo step as programs of their own (timed one
                         by one, `train/phased_step.py`): rollout, score, advantages, update
    trajectory_score_program  the score phase on multi-turn trajectories
                         (`train/turn_step.py`, whose rollout is host-driven)
    experiment_phase_programs  the same four phases vmapped over runs, as the experiment's
                         step is

Each returns a `Program`: the `jax.jit` of the stage function with the shardings and donation
it is jitted with, whatever the arguments are (arrays or `jax.ShapeDtypeStruct`s).
`rollout_program` and `update_program` are the two halves of `ppo_step` (generation and
scoring; termination, advantages and the updates): the experience between them is split over
the batch axes like the prompts.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from marl_jax.train import build, sharding
from marl_jax.train import ppo_core as core
from marl_jax.train.ppo_types import Frozen, Models, PPOState, PPOStatic


@dataclasses.dataclass(frozen=True)
class Program:
    """`fn = jax.jit(f, in_shardings=..., out_shardings=..., donate_argnums=...)` and what it
    was jitted with."""

    fn: Any
    in_shardings: tuple
    out_shardings: Any
    donate_argnums: tuple[int, ...] = ()


def jit_program(fun: Callable, in_shardings: tuple, out_shardings: Any,
                donate_argnums: tuple[int, ...] = ()) -> Program:
    return Program(jax.jit(fun, in_shardings=in_shardings, out_shardings=out_shardings,
                           donate_argnums=donate_argnums),
                   in_shardings, out_shardings, donate_argnums)


# ---- the programs, for concrete or abstract arguments -------------------------------------------
def supervised_program(train_step: Callable, state_shardings, mesh, base_shardings=None) -> Program:
    """The SFT / reward-model train step (`supervised.make_train_step`), the state donated;
    with `base_shardings` a LoRA step (`supervised.make_lora_train_step`) whose third argument
    is the frozen base."""
    in_shardings = (state_shardings, sharding.batch_sharding(mesh))
    if base_shardings is not None:
        in_shardings += (base_shardings,)
    return jit_program(train_step, in_shardings, (state_shardings, sharding.replicated(mesh)),
                       donate_argnums=(0,))


def frozen_shardings(mods: Models, mesh, state_sh: PPOState, rm_params,
                     ref_params=None, ref_adapters=None) -> Frozen:
    """The reference policy shares the actor's shardings (with LoRA, `ref_params`, the base,
    gets the whole policy's, and the reference's SFT adapter, when it has one, the adapters');
    the reward model gets its own."""
    rep = sharding.replicated(mesh)
    ref_sh = state_sh.actor_params if ref_params is None else build.param_shardings(
        mods.policy, mesh, build.abstract(ref_params))
    adapters_sh = None if ref_adapters is None else build.param_shardings(
        mods.policy, mesh, build.abstract(ref_adapters))
    return Frozen(ref_params=ref_sh,
                       # No reward model on an environment's task.
                       rm_params=None if rm_params is None else build.param_shardings(
                           mods.reward, mesh, build.abstract(rm_params)),
                       reward_mean=rep, reward_std=rep, ref_adapters=adapters_sh)


def ppo_step_program(static: PPOStatic, mods: Models, state_sh: PPOState,
                     frozen_sh: Frozen, mesh) -> Program:
    """One whole PPO step (`ppo_core.ppo_step`), the state donated."""
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jit_program(functools.partial(core.ppo_step, static, mods),
                       (state_sh, frozen_sh, rep, batch_sh, batch_sh, batch_sh),
                       (state_sh, rep), donate_argnums=(0,))


def rollout_program(static: PPOStatic, mods: Models, state_sh: PPOState,
                    frozen_sh: Frozen, mesh) -> Program:
    """Generation and scoring (`ppo_core.rollout_phase`); the state is read, not donated."""
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jit_program(functools.partial(core.rollout_phase, static, mods),
                       (state_sh, frozen_sh, batch_sh, batch_sh, batch_sh), (batch_sh, rep))


def update_program(static: PPOStatic, mods: Models, state_sh: PPOState,
                   frozen_sh: Frozen, mesh) -> Program:
    """Termination, advantages and the updates (`ppo_core.update_phase`: state, experience,
    rollout metrics, hparams, the host's segment ids `[B, R]` or None, and the frozen models
    that score Monte Carlo branches), the state donated."""
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jit_program(functools.partial(core.update_phase, static, mods),
                       (state_sh, batch_sh, rep, rep, batch_sh, frozen_sh), (state_sh, rep),
                       donate_argnums=(0,))


def trajectory_score_program(static: PPOStatic, mods: Models, state_sh: PPOState,
                             frozen_sh: Frozen, mesh) -> Program:
    """The score phase on multi-turn trajectories (`ppo_core.score_trajectory_phase`: state,
    frozen, prompt ids and mask `[B, P]`, the trajectory's `[B, T]` arrays) -> (experience,
    rollout metrics); the multi-turn step's advantages and update are `phase_programs`'."""
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jit_program(functools.partial(core.score_trajectory_phase, static, mods),
                       (state_sh, frozen_sh, batch_sh, batch_sh, batch_sh), (batch_sh, rep))


def phase_programs(static: PPOStatic, mods: Models, state_sh: PPOState, frozen_sh: Frozen,
                   mesh) -> dict[str, Program]:
    """The phases of `ppo_core.ppo_step` as four programs, whose composition is that step:

        rollout     (state, frozen, prompt ids, prompt mask) -> SampleOutput
        score       (state, frozen, prompt ids, prompt mask, sample, documents, host scores)
                    -> (experience, rollout metrics)
        advantages  (state, frozen, hparams, experience, host segment ids) -> (advantages,
                    metrics)
        update      (state, experience, advantages, rollout metrics, advantages' metrics,
                    frozen) -> (state, metrics), the state donated

    What passes between them (samples, experience, advantages) is split over the batch axes
    like the prompts; the metrics are replicated."""
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    generate = lambda state, frozen, ids, mask: core.generate_phase(static, mods, state, ids,
                                                                    mask, frozen)
    return {
        "rollout": jit_program(generate, (state_sh, frozen_sh, batch_sh, batch_sh), batch_sh),
        "score": jit_program(functools.partial(core.score_phase, static, mods),
                             (state_sh, frozen_sh, batch_sh, batch_sh, batch_sh, batch_sh,
                              batch_sh), (batch_sh, rep)),
        "advantages": jit_program(functools.partial(core.advantages_phase, static, mods),
                                  (state_sh, frozen_sh, rep, batch_sh, batch_sh),
                                  (batch_sh, rep)),
        "update": jit_program(functools.partial(core.update_from_advantages, static, mods),
                              (state_sh, batch_sh, batch_sh, rep, rep, frozen_sh),
                              (state_sh, rep), donate_argnums=(0,)),
    }


def async_programs(static: PPOStatic, mods: Models, state_sh: PPOState, frozen_sh: Frozen,
                   mesh, chunk_tokens: int, sampler_mesh=None,
                   sampler_params_sh=None) -> dict[str, Program]:
    """The programs of asynchronous PPO (`train/async_step.py`) besides the advantages and
    update of `phase_programs`:

        fresh    (prompt ids, prompt mask, documents) -> a `PartialBatch` with nothing sampled
        carry    (finished batch, fresh batch, target step) -> (batch, tokens cleared, groups
                 carried)                                  (`phases.rollout.carry_over`)
        decode   (sampling params, batch, key, version) -> (batch, tokens sampled, tokens
                 prefilled), `chunk_tokens` tokens a response (`phases.rollout.decode_chunk`),
                 the batch donated
        score    (state, frozen, batch) -> (experience, rollout metrics)
                                                           (`ppo_core.score_async_phase`)

    The sampler's programs (fresh, carry, decode) run on `sampler_mesh` with the sampling params
    split as `sampler_params_sh` (default: the trainer's mesh and the actor's shardings); the
    batches are split over the batch axes like the prompts."""
    from marl_jax.train.phases import rollout as rollout_phases

    sampler_mesh = mesh if sampler_mesh is None else sampler_mesh
    params_sh = state_sh.actor_params if sampler_params_sh is None else sampler_params_sh
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    s_rep, s_batch = sharding.replicated(sampler_mesh), sharding.batch_sharding(sampler_mesh)

    def decode(params, batch, key, version):
        return rollout_phases.decode_chunk(static, mods, params, batch, key, version,
                                           chunk_tokens)

    return {
        "fresh": jit_program(functools.partial(rollout_phases.empty_batch, static),
                             (s_batch, s_batch, s_batch), s_batch),
        "carry": jit_program(functools.partial(rollout_phases.carry_over, static),
                             (s_batch, s_batch, s_rep), (s_batch, s_rep, s_rep)),
        "decode": jit_program(decode, (params_sh, s_batch, s_rep, s_rep),
                              (s_batch, s_rep, s_rep), donate_argnums=(1,)),
        "score": jit_program(functools.partial(core.score_async_phase, static, mods),
                             (state_sh, frozen_sh, batch_sh), (batch_sh, rep)),
    }


def with_run_axis(named_sharding: NamedSharding) -> NamedSharding:
    """The sharding of a run-stacked `[runs, ...]` leaf: runs replicated, the rest as before."""
    return NamedSharding(named_sharding.mesh, PartitionSpec(None, *named_sharding.spec))


def experiment_step_program(static: PPOStatic, mods: Models, run_state_sh: PPOState,
                            frozen_sh: Frozen, mesh) -> Program:
    """`ppo_core.ppo_step` vmapped over runs: state `[runs, ...]` (one run's shardings
    `run_state_sh` under a replicated run axis), the frozen models shared, hparams `[runs]`
    replicated, prompts `[runs, B, P]` split over the batch axes along B; the state donated."""
    rep = sharding.replicated(mesh)
    state_sh = jax.tree.map(with_run_axis, run_state_sh)
    prompts_sh = sharding.batch_sharding(mesh, axis=1)
    vmapped = jax.vmap(functools.partial(core.ppo_step, static, mods),
                       in_axes=(0, None, 0, 0, 0, 0, None))

    def step(state, frozen, hparams, prompt_ids, prompt_mask, documents):
        # The runs of a group step together: one unbatched first-step flag for all of them.
        return vmapped(state, frozen, hparams, prompt_ids, prompt_mask, documents, state.step[0] == 0)

    return jit_program(step, (state_sh, frozen_sh, rep, prompts_sh, prompts_sh, prompts_sh),
                       (state_sh, rep), donate_argnums=(0,))


def experiment_trajectory_score_program(static: PPOStatic, mods: Models, run_state_sh: PPOState,
                                        frozen_sh: Frozen, mesh) -> Program:
    """`trajectory_score_program` vmapped over runs (the multi-turn experiment's score phase):
    prompts `[runs, B, P]` and trajectories `[runs, B, T]` split along B, the frozen models
    shared, the group's one unbatched first-step flag."""
    rep = sharding.replicated(mesh)
    state_sh = jax.tree.map(with_run_axis, run_state_sh)
    runs_sh = sharding.batch_sharding(mesh, axis=1)

    def score(state, frozen, ids, mask, trajectory):
        first_step = state.step[0] == 0
        return jax.vmap(lambda s, i, m, t: core.score_trajectory_phase(
            static, mods, s, frozen, i, m, t, first_step=first_step))(state, ids, mask,
                                                                      trajectory)

    return jit_program(score, (state_sh, frozen_sh, runs_sh, runs_sh, runs_sh), (runs_sh, rep))


def experiment_phase_programs(static: PPOStatic, mods: Models, run_state_sh: PPOState,
                              frozen_sh: Frozen, mesh) -> dict[str, Program]:
    """The four programs of `phase_programs` vmapped over runs, whose composition is
    `experiment_step_program`: what passes between them carries a leading run axis `[runs, B,
    ...]` (split over the batch axes along B), the frozen models are shared, hparams `[runs]`;
    the update donates the state. The score phase takes the group's one unbatched first-step
    flag (`score.score`)."""
    rep = sharding.replicated(mesh)
    state_sh = jax.tree.map(with_run_axis, run_state_sh)
    runs_sh = sharding.batch_sharding(mesh, axis=1)

    def rollout(state, frozen, ids, mask):
        return jax.vmap(lambda s, i, m: core.generate_phase(static, mods, s, i, m, frozen))(
            state, ids, mask)

    def score(state, frozen, ids, mask, sample, documents):
        first_step = state.step[0] == 0
        return jax.vmap(lambda s, i, m, x, d: core.score_phase(
            static, mods, s, frozen, i, m, x, d, first_step=first_step))(
                state, ids, mask, sample, documents)

    def advantages(state, frozen, hparams, exp):
        return jax.vmap(lambda s, h, e: core.advantages_phase(static, mods, s, frozen, h, e))(
            state, hparams, exp)

    def update(state, exp, adv, roll_metrics, adv_metrics, frozen):
        return jax.vmap(lambda s, e, a, r, m: core.update_from_advantages(
            static, mods, s, e, a, r, m, frozen))(state, exp, adv, roll_metrics, adv_metrics)

    return {
        "rollout": jit_program(rollout, (state_sh, frozen_sh, runs_sh, runs_sh), runs_sh),
        "score": jit_program(score, (state_sh, frozen_sh, runs_sh, runs_sh, runs_sh, runs_sh),
                             (runs_sh, rep)),
        "advantages": jit_program(advantages, (state_sh, frozen_sh, rep, runs_sh),
                                  (runs_sh, rep)),
        "update": jit_program(update, (state_sh, runs_sh, runs_sh, rep, rep, frozen_sh),
                              (state_sh, rep), donate_argnums=(0,)),
    }
