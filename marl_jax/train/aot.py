"""Abstract arguments to lower every stage's program with, from a config alone.

`sft_program`, `rm_program` and `ppo_programs` return the stage's `programs.Program` (the very
program the trainer runs) with abstract arguments: `ShapeDtypeStruct`s carrying their shardings,
parameters and optimizer states from `jax.eval_shape`. So `program.fn.lower(*args).compile()`
compiles a stage for any mesh, a TPU topology without its chips included, and nothing is
allocated (a 7B model is never materialised). Lower inside `sharding.mesh_context(mesh, ...)`,
as the trainers trace their steps. `experiments/bench.py memory` reads the compiler's memory
analysis of these.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from marl_jax import models
from marl_jax.models import lora
from marl_jax.data import tasks
from marl_jax.train import build, ppo, programs, reward, sft, sharding, supervised
from marl_jax.train.optim import adapter_weight_decay, make_optimizer, stage_schedule
from marl_jax.train.ppo_types import RunHparams


@dataclasses.dataclass(frozen=True)
class TaskInputs:
    """What a task feeds the stages besides token arrays: prompts `[B, prompt_length]`; the
    synthetic task's documents `[B, documents_width]` and gold reward (None for real tasks)."""

    prompt_length: int
    documents_width: int | None = None
    gold_fn: Callable | None = None


def task_inputs(config) -> TaskInputs:
    """Real tasks pad prompts to `config.task.max_prompt_length`; the synthetic task's prompts
    have its own fixed length and carry documents."""
    if config.task.name != "synthetic":
        return TaskInputs(int(config.task.max_prompt_length))
    from marl_jax.data import synthetic

    task = tasks.synthetic_task_from_config(config.task)
    return TaskInputs(task.prompt_length, task.doc_size,
                      functools.partial(synthetic.gold_score_jax, task))


def abstract_params(module) -> dict:
    """`ShapeDtypeStruct`s of `module`'s parameters (its init tree, in its param dtype)."""
    return jax.eval_shape(lambda: models.init_params(module, jax.random.key(0)))


def with_shardings(tree, shardings) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s leaves carrying `shardings` (one sharding for every leaf,
    or a pytree matching `tree`)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def _ids(batch: int, length: int):
    return jax.ShapeDtypeStruct((batch, length), jnp.int32)


def _train_state(params, optimizer):
    return jax.eval_shape(lambda p: build.TrainState(
        step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
        skipped_updates=jnp.zeros((), jnp.float32)), params)


def _supervised(cfg, name: str, module, loss_fn, batch: dict, mesh, weight_fn=None,
                lora_weight_decay=None):
    sharding.validate_batch(cfg.batch_size, mesh, f"config.{name}.batch_size")
    optimizer = make_optimizer(cfg, cfg.steps, lora_weight_decay=lora_weight_decay)
    params = abstract_params(module)
    # With adapter dropout the step draws its masks as the run's does (the seed changes no shape).
    kwargs = dict(schedule=stage_schedule(cfg, cfg.steps),
                  grad_accum_steps=int(cfg.get("grad_accum_steps", 1)), weight_fn=weight_fn,
                  dropout_seed=0 if module.config.lora_dropout else None,
                  compute_weights=functools.partial(models.compute_weights, config=module.config))
    base = None
    if module.config.lora_rank:  # the state trains adapters (and heads); the base is an argument
        base, params = lora.frozen_base(params), lora.trainable(params)
    state_sh = build.train_state_shardings(module, optimizer, mesh, params)
    args = (with_shardings(_train_state(params, optimizer), state_sh),
            with_shardings(batch, sharding.batch_sharding(mesh)))
    if base is None:
        step = supervised.make_train_step(loss_fn, optimizer, **kwargs)
        return programs.supervised_program(step, state_sh, mesh), args
    base_sh = build.param_shardings(module, mesh, base)
    step = supervised.make_lora_train_step(loss_fn, optimizer, **kwargs)
    return (programs.supervised_program(step, state_sh, mesh, base_shardings=base_sh),
            args + (with_shardings(base, base_sh),))


def sft_program(config, policy, mesh, inputs: TaskInputs | None = None):
    """(Program, abstract (state, batch), plus the frozen base with LoRA) of the SFT step: `[B, P]` prompts and `[B, R]`
    demonstrations (ids and masks, int32), B = `config.sft.batch_size`."""
    inputs = inputs or task_inputs(config)
    b, r = config.sft.batch_size, config.ppo.response_length
    p = inputs.prompt_length
    batch = dict(prompt_ids=_ids(b, p), prompt_mask=_ids(b, p), response_ids=_ids(b, r),
                 response_mask=_ids(b, r))
    return _supervised(config.sft, "sft", policy,
                       lambda p, x, rngs=None: sft.sft_loss(policy, p, x, rngs), batch, mesh,
                       weight_fn=lambda x: x["response_mask"].sum(),
                       lora_weight_decay=adapter_weight_decay(config))


def rm_program(config, reward_model, mesh, inputs: TaskInputs | None = None):
    """(Program, abstract (state, batch), plus the frozen base with LoRA) of the reward-model
    step: `[B, P]` prompts, `[B, R]` chosen and rejected responses (ids and masks, int32),
    B = `config.rm.batch_size`.

    With `config.rm.group_by_prompt`, B prompt groups (`reward.PromptGroups`) at their largest:
    K = `task.samples_per_prompt` responses `[B, K, R]` and every pair among them, M = K (K - 1)
    / 2 (at most `task.pairs_per_prompt` when that is set) slots `[B, M]`."""
    inputs = inputs or task_inputs(config)
    b, r = config.rm.batch_size, config.ppo.response_length
    p = inputs.prompt_length
    if config.rm.get("group_by_prompt", False):
        k = int(config.task.get("samples_per_prompt", 2))
        m = k * (k - 1) // 2
        if config.task.get("pairs_per_prompt", 0):
            m = min(m, int(config.task.pairs_per_prompt))
        batch = dict(prompt_ids=_ids(b, p), prompt_mask=_ids(b, p),
                     response_ids=jax.ShapeDtypeStruct((b, k, r), jnp.int32),
                     response_mask=jax.ShapeDtypeStruct((b, k, r), jnp.int32),
                     win=_ids(b, m), lose=_ids(b, m),
                     pair_mask=jax.ShapeDtypeStruct((b, m), jnp.float32))
        return _supervised(config.rm, "rm", reward_model,
                           lambda p, x, rngs=None: reward.grouped_rm_loss(reward_model, p, x,
                                                                          0, rngs),
                           batch, mesh,
                           weight_fn=lambda x: x["pair_mask"].sum(),
                           lora_weight_decay=adapter_weight_decay(config))
    batch = dict(prompt_ids=_ids(b, p), prompt_mask=_ids(b, p), chosen_ids=_ids(b, r),
                 chosen_mask=_ids(b, r), rejected_ids=_ids(b, r), rejected_mask=_ids(b, r))
    return _supervised(config.rm, "rm", reward_model,
                       lambda p, x, rngs=None: reward.rm_loss(reward_model, p, x, rngs), batch,
                       mesh, lora_weight_decay=adapter_weight_decay(config))


def _frozen(mods, ref_params, rm_params, ref_adapters=None, lora=False):
    """The abstract `Frozen` a run builds (`ppo.frozen_models`: weights in the compute dtype)."""
    return jax.eval_shape(lambda ref, rm, adapters: ppo.frozen_models(
        mods, ref, rm, {"mean": 0.0, "std": 1.0}, adapters, lora), ref_params, rm_params,
        ref_adapters)


def ppo_programs(config, tokenizer, policy, critic, reward_model, mesh,
                 inputs: TaskInputs | None = None) -> dict:
    """{"rollout", "update", "ppo_step", "generate", "score"} -> (Program, abstract arguments),
    built as
    `ppo.run_ppo` builds its step: actor and reference of `policy`'s shape, critic and reward
    model of theirs (no critic for the critic-free estimators), `config.ppo.batch_size` rows
    (`batch_size / group_size` prompts).

    `tokenizer`: anything with `eos_token_id` and `pad_token_id`. The experience and rollout
    metrics the update takes are the rollout's outputs, traced here (inside the mesh context)
    to learn their shapes. `generate` and `score` are the two parts of `rollout` as the phase
    programs (`programs.phase_programs`: rollout, score) a phase-timed run runs.
    """
    inputs = inputs or task_inputs(config)
    p = config.ppo
    sharding.validate_batch(p.batch_size, mesh, "config.ppo.batch_size")
    static = ppo.static_from_config(config, tokenizer)
    mods = ppo.make_models(config, policy, critic, reward_model, inputs.gold_fn)
    actor, critic_params, rm_params = (abstract_params(m) for m in (policy, critic, reward_model))
    if not ppo.uses_critic(p):
        critic_params = {}
    base = ref_adapters = None
    if static.lora:
        if static.reference_adapters:  # the SFT adapter, kept apart from the base
            ref_adapters = lora.adapters(actor)
        base, actor, rm_params = (lora.frozen_base(actor), lora.trainable(actor),
                                  lora.trainable(rm_params))
        critic_params = lora.trainable(critic_params) if critic_params else {}
    state_sh = ppo.state_shardings(mods, mesh, actor, critic_params)
    frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, rm_params, base, ref_adapters)
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)

    state = with_shardings(jax.eval_shape(
        lambda a, c: ppo.initial_state(config, mods, a, c, config.seed), actor, critic_params),
        state_sh)
    frozen = with_shardings(_frozen(mods, actor if base is None else base, rm_params,
                                    ref_adapters, static.lora), frozen_sh)
    hparams = with_shardings(build.abstract(ppo.hparams_from_config(p)), rep)
    prompts = with_shardings((_ids(static.prompts_per_step, inputs.prompt_length),) * 2, batch_sh)
    documents = None if inputs.documents_width is None else with_shardings(
        _ids(static.prompts_per_step, inputs.documents_width), batch_sh)

    rollout = programs.rollout_program(static, mods, state_sh, frozen_sh, mesh)
    rollout_args = (state, frozen, *prompts, documents)
    phase = programs.phase_programs(static, mods, state_sh, frozen_sh, mesh)
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            policy.config))):
        exp, roll_metrics = jax.eval_shape(rollout.fn, *rollout_args)
        sample = jax.eval_shape(phase["rollout"].fn, state, frozen, *prompts)
    update = programs.update_program(static, mods, state_sh, frozen_sh, mesh)
    return {
        "generate": (phase["rollout"], (state, frozen, *prompts)),
        "score": (phase["score"], (state, frozen, *prompts, with_shardings(sample, batch_sh),
                                   documents, None)),
        "rollout": (rollout, rollout_args),
        "update": (update, (state, with_shardings(exp, batch_sh),
                            with_shardings(roll_metrics, rep), hparams, None, frozen)),
        "ppo_step": (programs.ppo_step_program(static, mods, state_sh, frozen_sh, mesh),
                     (state, frozen, hparams, *prompts, documents)),
    }


def experiment_programs(config, tokenizer, policy, critic, reward_model, mesh, num_runs: int,
                        variants: tuple, inputs: TaskInputs | None = None,
                        eval_samples_per_prompt: int = 1, num_eval_prompts: int = 0,
                        phases: bool = False) -> dict:
    """{"experiment", "experiment_eval"} -> (Program, abstract arguments): the experiment
    stage's PPO step vmapped over `num_runs` runs of one group (`marl_jax.experiment`: the
    group's static fields in `config.ppo`, its runs' `variants`), and its held-out evaluation
    of `num_eval_prompts` prompts x `eval_samples_per_prompt` responses per run (vmapped, the
    arguments' shardings as the experiment puts them). With `phases`, also that step's four
    phase programs as a phase-timed experiment runs them (`programs.experiment_phase_programs`):
    `experiment_rollout`, `experiment_score`, `experiment_advantages`, `experiment_update`, each
    taking what the one before gives (traced here for its shapes).

    The state, hparams and prompts carry a leading run axis `[num_runs, ...]`, runs replicated,
    everything else sharded as one run's (`programs.with_run_axis`).
    """
    inputs = inputs or task_inputs(config)
    p = config.ppo
    sharding.validate_batch(p.batch_size, mesh, "config.ppo.batch_size")
    static = ppo.static_from_config(config, tokenizer, variants=tuple(variants))
    mods = ppo.make_models(config, policy, critic, reward_model, inputs.gold_fn)
    actor, critic_params, rm_params = (abstract_params(m) for m in (policy, critic, reward_model))
    if not ppo.uses_critic(p):
        critic_params = {}
    run_sh = ppo.state_shardings(mods, mesh, actor, critic_params)
    frozen_sh = programs.frozen_shardings(mods, mesh, run_sh, rm_params)
    step = programs.experiment_step_program(static, mods, run_sh, frozen_sh, mesh)
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)

    def runs_of(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((num_runs, *x.shape), x.dtype),
                            tree)

    one_run = jax.eval_shape(
        lambda a, c: ppo.initial_state(config, mods, a, c, config.seed), actor, critic_params)
    state = with_shardings(runs_of(one_run), step.in_shardings[0])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    frozen = with_shardings(_frozen(mods, actor, rm_params), frozen_sh)
    hparams = with_shardings(runs_of(RunHparams(
        lam=scalar, gamma=scalar, ngram=jax.ShapeDtypeStruct((), jnp.int32),
        variant=jax.ShapeDtypeStruct((), jnp.int32))), rep)
    prompts_sh = sharding.batch_sharding(mesh, axis=1)
    prompts = with_shardings(runs_of((_ids(static.prompts_per_step, inputs.prompt_length),) * 2),
                             prompts_sh)
    documents = None if inputs.documents_width is None else with_shardings(
        runs_of(_ids(static.prompts_per_step, inputs.documents_width)), prompts_sh)
    out = {"experiment": (step, (state, frozen, hparams, *prompts, documents))}
    if phases:
        fns = programs.experiment_phase_programs(static, mods, run_sh, frozen_sh, mesh)
        with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
                policy.config))):
            sample = with_shardings(jax.eval_shape(fns["rollout"].fn, state, frozen, *prompts),
                                    prompts_sh)
            exp, roll_metrics = jax.eval_shape(fns["score"].fn, state, frozen, *prompts, sample,
                                               documents)
            exp, roll_metrics = with_shardings(exp, prompts_sh), with_shardings(roll_metrics, rep)
            adv, adv_metrics = jax.eval_shape(fns["advantages"].fn, state, frozen, hparams, exp)
            adv, adv_metrics = with_shardings(adv, prompts_sh), with_shardings(adv_metrics, rep)
        out.update(
            experiment_rollout=(fns["rollout"], (state, frozen, *prompts)),
            experiment_score=(fns["score"], (state, frozen, *prompts, sample, documents)),
            experiment_advantages=(fns["advantages"], (state, frozen, hparams, exp)),
            experiment_update=(fns["update"], (state, exp, adv, roll_metrics, adv_metrics,
                                               frozen)))
    if num_eval_prompts:
        sharding.validate_batch(num_eval_prompts, mesh, "config.task.num_eval_prompts")
        evaluate = jax.jit(jax.vmap(functools.partial(
            ppo.evaluate_from_key_data, static, mods, gold_fn=inputs.gold_fn,
            samples_per_prompt=int(eval_samples_per_prompt)), in_axes=(0, None, None, None, None,
                                                                       0)))
        eval_ids = with_shardings(_ids(num_eval_prompts, inputs.prompt_length), batch_sh)
        eval_docs = None if inputs.documents_width is None else with_shardings(
            _ids(num_eval_prompts, inputs.documents_width), batch_sh)
        key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        out["experiment_eval"] = (
            programs.Program(evaluate, (), None),
            (state.actor_params, frozen, eval_ids, eval_ids, eval_docs,
             with_shardings(runs_of(key_data), rep)))
    return out
