"""Stage 3: PPO / MA-PPO, one sharded jitted step per iteration, resumable.

Actor and reference start from the SFT policy; the critic and the frozen reward model from the
reward model (as the paper does; `config.ppo.critic_init` can also start the critic from the SFT
backbone or from scratch).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import distributed, estimators
from marl_jax import models as models_lib
from marl_jax import rollout
from marl_jax.data import batches
from marl_jax.macro import steps
from marl_jax.models import lora
from marl_jax.train import async_schedule, build, checkpoint, loop, perf, programs, sharding
from marl_jax.train.async_step import AsyncStep
from marl_jax.train.async_turns import AsyncTurnsStep
from marl_jax.train import phases
from marl_jax.train.phased_step import PhasedStep
from marl_jax.train.turn_step import MultiTurnStep, TrajectoryEvaluation
from marl_jax.train.optim import adapter_weight_decay, make_optimizer, stage_schedule
from marl_jax.train.ppo_types import (Frozen, Models, PPOState, PPOStatic, RunHparams, role_model,
                                      role_params, sampler_logprobs_are_exact)


def static_from_config(config, tokenizer, variants=None) -> PPOStatic:
    p = config.ppo
    eos = tokenizer.eos_token_id
    if variants is None:
        variants = ((p.termination, p.value_weighting, p.reward_aggregation),)
    return PPOStatic(
        batch_size=p.batch_size, response_length=p.response_length, eos_id=eos,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        temperature=float(p.temperature), top_k=int(p.top_k), top_p=float(p.top_p),
        variants=tuple(variants), randomized_lengths=tuple(int(x) for x in p.randomized_lengths),
        randomized_repeats=int(p.randomized_repeats), isolate_last=bool(p.isolate_last),
        ppo_epochs=int(p.ppo_epochs), num_minibatches=int(p.num_minibatches),
        grad_accum_steps=int(p.get("grad_accum_steps", 1)),
        cliprange=float(p.cliprange), cliprange_value=float(p.cliprange_value),
        **objective_fields(p, estimators.action_budget(config)),
        action_budget=estimators.action_budget(config),
        vf_coef=float(p.vf_coef), kl_estimator=p.kl_estimator, reward_clip=float(p.reward_clip),
        normalize_reward=bool(p.normalize_reward),
        missing_eos_penalty=float(p.missing_eos_penalty),
        whiten_advantages=bool(p.whiten_advantages), loss_aggregation=loss_aggregation(p),
        compute_dtype=build.compute_dtype(config), matmul_precision=build.matmul_precision(config),
        old_logprobs=p.get("old_logprobs", "auto"),
        rollout_correction=p.get("rollout_correction", "none"),
        rollout_is_cap=float(p.get("rollout_is_cap", 2.0)),
        adaptive_kl=bool(p.adaptive_kl), kl_target=float(p.kl_target),
        kl_horizon=int(p.kl_horizon), reward_source=p.reward_source,
        estimator=p.get("estimator", "gae"), group_size=int(p.get("group_size", 1)),
        mc_rollouts=int(p.get("mc_rollouts", 4)),
        mc_branch_points=int(p.get("mc_branch_points", 4)),
        entropy_quantile=float(p.get("entropy_quantile", 0.2)),
        low_probability_quantile=float(p.get("low_probability_quantile", 0.2)),
        low_probability_threshold=float(p.get("low_probability_threshold", 0.0)),
        step_table=step_table(config, tokenizer, variants),
        num_layers_unfrozen=int(p.get("num_layers_unfrozen", -1)),
        decode_slots=int(p.get("decode_slots", 0)),
        lora=bool(config.model.get("lora", {}).get("rank", 0)),
        reference_adapters=bool(config.model.get("lora", {}).get("rank", 0))
        and not config.model.lora.get("merge_sft", True),
        rollout_chunks=int(p.get("rollout_chunks", 1)), **staleness_fields(config))


def staleness_fields(config) -> dict:
    """The `PPOStatic` fields of asynchronous PPO (`config.rollout`)."""
    r = config.get("rollout")
    if r is None:
        return {}
    limit = r.get("max_token_staleness")
    return dict(max_staleness=int(r.max_staleness),
                max_token_staleness=-1 if limit is None else int(limit))


def step_table(config, tokenizer, variants):
    """The step termination's tables (`macro.steps.step_table` of `ppo.step_delimiters` over
    the tokenizer) when a variant or the credit probe's rules cut at reasoning steps, else
    None."""
    credit = config.get("credit")
    rules = tuple(credit.rules) if credit is not None and credit.every else ()
    if "step" not in {v[0] for v in variants} | set(rules):
        return None
    return steps.step_table(tokenizer, tuple(config.ppo.step_delimiters))


def objective_fields(p, budget=None) -> dict:
    """The `PPOStatic` fields of the policy objective: `estimators.objective` of `config.ppo`
    (unset fields from the estimator's record; the overlong buffer's share of `budget`, the
    action budget)."""
    o = estimators.objective(p, budget)
    return dict(ratio_level=o.ratio_level, ratio_form=o.ratio_form,
                cliprange_low=o.cliprange_low, cliprange_high=o.cliprange_high,
                dual_clip=o.dual_clip, dynamic_sampling_oversample=o.dynamic_sampling_oversample,
                overlong_buffer=o.overlong_buffer if o.overlong_shaping else 0,
                overlong_penalty=o.overlong_penalty if o.overlong_shaping else 0.0,
                mask_truncated=bool(p.get("mask_truncated", False)))


def validate_decode_slots(config, mesh) -> None:
    """`config.ppo.decode_slots` (when it is below the batch) splits over the data-parallel shards."""
    p = config.ppo
    if 0 < p.get("decode_slots", 0) < p.batch_size:
        sharding.validate_batch(p.decode_slots, mesh, "config.ppo.decode_slots")


def loss_aggregation(ppo_config) -> str:
    """`ppo.loss_aggregation`, "auto" resolved to the estimator's published one."""
    chosen = ppo_config.get("loss_aggregation", "auto")
    if chosen == "auto":
        return estimators.ESTIMATORS[ppo_config.get("estimator", "gae")].loss_aggregation
    return chosen


def lora_roles(policy, critic, sft_params, rm_params, critic_params, key):
    """With LoRA, the roles on one base: (base, reference adapters, actor, reward model,
    critic). The base is the SFT model's frozen part. When SFT merged its adapter into the base,
    the reference is the base with the adapters off (no reference adapters: None) and the actor
    starts from fresh adapters (B = 0); otherwise the reference is the base with the SFT
    adapter attached, frozen, and the actor starts from a copy of that adapter. The reward
    model and the critic are their adapters and heads; the reward model was trained on the same
    base (`rm.init_from=sft`)."""
    base = lora.frozen_base(sft_params)
    reference = lora.adapters(sft_params) or None
    actor = lora.trainable(lora.with_adapters(policy, sft_params, jax.random.fold_in(key, 2)))
    critic_params = lora.trainable(lora.with_adapters(
        critic, critic_params, jax.random.fold_in(key, 3))) if critic_params else {}
    # An environment's task has no reward model.
    rm_params = None if rm_params is None else lora.trainable(rm_params)
    return base, reference, actor, rm_params, critic_params


def with_shared_trunk(static: PPOStatic, num_layers: int, actor_params, rm_params,
                      critics=()) -> PPOStatic:
    """`static` with `shared_trunk_layers` = k = L - n when the actor trains only its top n
    layers (`num_layers_unfrozen` = n >= 0, unrolled layers) and the reward model (when it
    scores) and every critic have the actor's embeddings and first k layers, value for value
    (SFT, reward model and PPO each training n or fewer top layers, the critic started from
    either model): the four models then share a frozen trunk, which a PPO step runs once
    instead of once per model. Otherwise `static` unchanged."""
    n = static.num_layers_unfrozen
    if n < 0 or n >= num_layers:
        return static
    k = num_layers - n

    def bottom(params):
        backbone = params["backbone"]
        if "layers" in backbone:  # scanned layers: no layer range to share
            return None
        return {name: v for name, v in backbone.items() if name != "final_norm" and not (
            name.startswith("layers_") and int(name[len("layers_"):]) >= k)}

    shared = bottom(actor_params)
    others = ([rm_params] if static.reward_source == "rm" else []) + \
        (list(critics) if static.uses_critic else [])
    for other in others:
        theirs = None if shared is None else bottom(other)
        if theirs is None or jax.tree.structure(theirs) != jax.tree.structure(shared) or not all(
                bool(jnp.array_equal(a, b))
                for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(theirs))):
            return static
    return dataclasses.replace(static, shared_trunk_layers=k)


def hparams_from_config(p, variant: int = 0) -> RunHparams:
    return RunHparams(lam=jnp.float32(p.lam), gamma=jnp.float32(p.gamma),
                           ngram=jnp.int32(p.ngram), variant=jnp.int32(variant))


def make_models(config, policy, critic, reward_model, gold_fn=None) -> Models:
    p = config.ppo
    if p.reward_source == "gold" and gold_fn is None:
        raise ValueError("config.ppo.reward_source='gold' needs a task with a gold reward "
                         "(the synthetic task)")
    updates = ppo_updates(p)
    decay = adapter_weight_decay(config)
    return Models(
        policy=policy, critic=critic, reward=reward_model,
        actor_optimizer=make_optimizer(p, updates, lora_weight_decay=decay),
        critic_optimizer=make_optimizer(p, updates, learning_rate=p.critic_learning_rate,
                                        lora_weight_decay=decay),
        gold_fn=gold_fn, actor_schedule=stage_schedule(p, updates),
        critic_schedule=stage_schedule(p, updates, learning_rate=p.critic_learning_rate))


def uses_critic(p) -> bool:
    """Whether `config.ppo` trains a critic (macro GAE) or estimates advantages without one."""
    return estimators.ESTIMATORS[p.get("estimator", "gae")].needs_critic


def ppo_updates(p) -> int:
    """Optimizer updates of a whole PPO run: every step makes `ppo_epochs x num_minibatches`
    (gradient accumulation splits a minibatch, it adds no update)."""
    return int(p.steps) * int(p.ppo_epochs) * int(p.num_minibatches)


def initial_critic_params(config, critic, sft_params, rm_params, key, reward_stats=None):
    """The critic's starting point: the reward model (paper), the SFT backbone, or scratch;
    nothing (an empty tree, no memory) for the critic-free estimators.

    Started from the reward model while PPO normalises its scores, the head is rescaled so the
    critic predicts normalised scores from the first step: kernel / std, bias -mean / std (the
    reward model's raw scores would be off by the normalisation, and the critic's first updates
    would go to undoing it).
    """
    if not uses_critic(config.ppo):
        return {}
    how = config.ppo.critic_init
    # With LoRA only the head and adapters are new (the base is shared).
    fresh = (lora.fresh_trainable if critic.config.lora_rank else models_lib.init_params)(
        critic, key)
    if how == "rm":
        kernel = rm_params["head"]["kernel"]
        bias = jnp.zeros_like(fresh["head"]["bias"])
        p = config.ppo
        if p.normalize_reward and p.reward_source == "rm":
            if reward_stats is None:
                raise ValueError("a critic started from the reward model needs the reward "
                                 "statistics to put it on the normalised scale")
            std = jnp.float32(reward_stats["std"])
            kernel = (kernel.astype(jnp.float32) / std).astype(kernel.dtype)
            bias = (bias - jnp.float32(reward_stats["mean"]) / std).astype(bias.dtype)
        return dict(rm_params, head=dict(kernel=kernel, bias=bias))
    if how == "sft":
        return dict(fresh, backbone=sft_params["backbone"])
    return fresh


def frozen_models(mods: Models, ref_params, rm_params, reward_stats, ref_adapters=None,
                  lora: bool = False) -> Frozen:
    """What the steps read and never update: the reference and the reward model, their weights
    cast once to the compute dtype (`models.compute_weights`: every forward computes the same
    numbers from them as from the float32 weights, and no step casts them again; half the
    memory in bfloat16), and the reward statistics. With LoRA the base stays as it is (the
    trained roles' adapters attach to it, and the checkpoints record its identity)."""
    if not lora:
        ref_params = models_lib.compute_weights(ref_params, mods.policy.config)
        rm_params = models_lib.compute_weights(rm_params, mods.reward.config)
    return Frozen(ref_params=ref_params, rm_params=rm_params,
                  reward_mean=jnp.float32(reward_stats["mean"]),
                  reward_std=jnp.float32(reward_stats["std"]), ref_adapters=ref_adapters)


def initial_state(config, mods: Models, actor_params, critic_params, seed: int):
    return PPOState(
        step=jnp.zeros((), jnp.int32), actor_params=actor_params,
        actor_opt_state=mods.actor_optimizer.init(actor_params), critic_params=critic_params,
        critic_opt_state=mods.critic_optimizer.init(critic_params),
        key=jax.random.key_data(jax.random.key(seed)), kl_coef=jnp.float32(config.ppo.kl_coef),
        skipped_updates=jnp.zeros((), jnp.float32), generated_tokens=jnp.zeros((), jnp.float32),
        prefill_tokens=jnp.zeros((), jnp.float32))


def state_shardings(mods: Models, mesh, actor_params, critic_params):
    a_sh = build.param_shardings(mods.policy, mesh, build.abstract(actor_params))
    c_sh = build.param_shardings(mods.critic, mesh, build.abstract(critic_params)) \
        if critic_params else {}
    rep = sharding.replicated(mesh)
    return PPOState(
        step=rep, actor_params=a_sh,
        actor_opt_state=sharding.opt_state_shardings(mods.actor_optimizer, a_sh, mesh,
                                                     params=build.abstract(actor_params)),
        critic_params=c_sh,
        critic_opt_state=sharding.opt_state_shardings(mods.critic_optimizer, c_sh, mesh,
                                                      params=build.abstract(critic_params)),
        key=rep, kl_coef=rep, skipped_updates=rep, generated_tokens=rep, prefill_tokens=rep)


def evaluate(static: PPOStatic, mods: Models, actor_params, frozen: Frozen,
             prompt_ids, prompt_mask, documents, key, gold_fn=None, samples_per_prompt=1):
    """Held-out evaluation of `prompt_ids [E, P]`, jittable: per prompt `[E]` the gold, length
    and KL to the reference (nats) and RM score.

    With m = `samples_per_prompt` > 1 each prompt is prefilled once and sampled m times
    (`response_ids` / `response_mask` `[E m, R]`, row e m + j sample j of prompt e); gold and
    length are the means over a prompt's m samples, KL and RM score those of its first sample
    (scoring is the costly part: one sample per prompt keeps it at E sequences).
    """
    m = int(samples_per_prompt)
    actor_params = role_params(static, "actor", frozen, actor_params)
    ref_params = role_params(static, "reference", frozen)
    sample = rollout.generate(
        mods.policy, actor_params, prompt_ids, prompt_mask, key=key,
        max_new_tokens=static.response_length, temperature=static.temperature,
        top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
        decode_slots=static.decode_slots, **({"num_samples": m} if m > 1 else {}))
    all_ids, all_mask = sample.tokens, sample.mask.astype(jnp.int32)
    ids, mask = all_ids[::m], all_mask[::m]  # the first sample of every prompt
    args = (prompt_ids, prompt_mask, ids, mask)
    trunk = phases.score.shared_trunk(static, mods, ref_params, *args)
    if sampler_logprobs_are_exact(static):
        logp = sample.logprobs[::m] * mask
    else:
        logp, _ = phases.score.token_logprobs(mods.policy, actor_params, *args, static.temperature,
                                      trunk)
    ref, _ = phases.score.token_logprobs(role_model(static, mods, "reference"), ref_params, *args,
                                 static.temperature, trunk)
    kl = ((logp - ref) * mask).sum(axis=1)
    score = phases.score.sequence_scores(mods.reward, role_params(static, "reward", frozen), *args,
                                 trunk if static.reward_source == "rm" else None)
    if static.normalize_reward:
        score = (score - frozen.reward_mean) / frozen.reward_std
    per_prompt = lambda x: x.reshape(-1, m).mean(axis=1)
    out = {"kl": kl, "rm_score": score,
           "length": per_prompt(all_mask.sum(axis=1).astype(jnp.float32)),
           "response_ids": all_ids, "response_mask": all_mask}
    if gold_fn is not None:
        docs = None if documents is None else jnp.repeat(documents, m, axis=0)
        out["gold"] = per_prompt(gold_fn(docs, all_ids, all_mask))
    return out


def evaluate_from_key_data(static, mods, actor_params, frozen, prompt_ids, prompt_mask,
                           documents, key_data, gold_fn=None, samples_per_prompt=1):
    """`evaluate` with the key as raw key data (a global array on multi-process meshes)."""
    return evaluate(static, mods, actor_params, frozen, prompt_ids, prompt_mask, documents,
                    jax.random.wrap_key_data(key_data), gold_fn=gold_fn,
                    samples_per_prompt=samples_per_prompt)


def eval_key(seed: int) -> jax.Array:
    """The key of the held-out evaluation's samples (one batch of every held-out prompt); the
    eval stage samples the final policy with it too."""
    return jax.random.fold_in(jax.random.key(seed), 7)


# What `eval_row` reads: the evaluation outputs fetched to the host.
EVAL_ROW_KEYS = ("kl", "rm_score", "length", "gold")


def eval_row(result: dict) -> dict:
    row = {k: float(np.mean(np.asarray(result[k]))) for k in ("kl", "rm_score", "length")}
    if "gold" in result:
        row["gold"] = float(np.mean(np.asarray(result["gold"])))
    return row


def run_ppo(config, task, policy, critic, reward_model, sft_params, rm_params, reward_stats, *,
            mesh, writer, workdir, make_probe=None):
    """Runs `config.ppo.steps` PPO / MA-PPO steps; returns the final PPOState.

    `make_probe`: None, or `(static, models) -> probe` (the advantage-quality probe the pipeline
    hands the loop, `marl_jax.credit.hook.ppo_probe`): at step 0 and the steps it is `due(step)`
    on, beside the evaluation, `probe(state, frozen, hparams, step)` gives a metrics row."""
    p = config.ppo
    # Asynchronous PPO on devices of its own: the trainer's mesh and the sampler's.
    mesh, sampler_mesh = async_schedule.meshes(config, mesh)
    sharding.validate_batch(p.batch_size, mesh, "config.ppo.batch_size")
    validate_decode_slots(config, mesh)
    if p.reward_source == "host" and task.host_reward is None:
        raise ValueError(f"config.ppo.reward_source='host': task {config.task.name!r} has no "
                         "host-side reward (APPS unit tests have one)")
    static = static_from_config(config, task.tokenizer)
    if static.group_size > 1:
        sharding.validate_batch(static.prompts_per_step, mesh,
                                "config.ppo.batch_size / config.ppo.group_size (prompts per step)")
    mods = make_models(config, policy, critic, reward_model, task.gold_fn)
    key = jax.random.key(config.seed)
    critic_params = initial_critic_params(config, critic, sft_params, rm_params,
                                          jax.random.fold_in(key, 1), reward_stats)
    static = with_shared_trunk(static, policy.config.num_layers, sft_params, rm_params,
                               [critic_params])
    ref_params, ref_adapters = sft_params, None
    metadata = dict(stage="ppo", config=config.to_dict())
    if static.lora:
        ref_params, ref_adapters, sft_params, rm_params, critic_params = lora_roles(
            policy, critic, sft_params, rm_params, critic_params, key)
    state_sh = state_shardings(mods, mesh, sft_params, critic_params)
    frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, rm_params,
                                          ref_params if static.lora else None, ref_adapters)
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    hparams = jax.device_put(hparams_from_config(p), rep)

    frozen = jax.device_put(frozen_models(mods, ref_params, rm_params, reward_stats,
                                          ref_adapters, static.lora), frozen_sh)
    if static.lora:
        metadata["base"] = checkpoint.lora_identity(frozen.ref_params)
        if frozen.ref_adapters is not None:
            # The reference is the base with the SFT adapter: a resumed run needs both.
            metadata["reference"] = checkpoint.lora_identity(frozen.ref_adapters)
    # The actor and critic are updated in place (donated), so they must not share buffers with
    # the frozen reference and reward model they start from.
    state = jax.device_put(initial_state(config, mods, sft_params, critic_params, config.seed),
                           state_sh, may_alias=False)
    if sampler_mesh is not None:
        # Put on part of the devices it was replicated over, an array shares their buffers
        # whatever may_alias says: the donated state gets buffers of its own.
        state = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=state_sh)(state)
    # Host work between the phases (parsing, host rewards) runs the phases as programs of their
    # own; so does phase timing. Otherwise the step is one program.
    phased = asynchronous = None
    timed = p.get("phase_timing", True)
    schedule = async_schedule.Schedule.from_config(config)
    if task.turn_callback is not None and schedule.asynchronous:
        # Each batch's episodes played in a thread, its turns by the schedule's versions.
        asynchronous = AsyncTurnsStep(config, task, static, mods, state_sh, frozen_sh, mesh,
                                      schedule, timed=timed)
    elif task.turn_callback is not None:
        # Multi-turn: the rollout plays the environment from the host, phase by phase.
        phased = MultiTurnStep(config, task, static, mods, state_sh, frozen_sh, mesh,
                               timed=timed)
    elif schedule.asynchronous:
        # The sampler runs ahead of the trainer: the loop's state holds its batches.
        asynchronous = AsyncStep(config, task, static, mods, state_sh, frozen_sh, mesh,
                                 schedule, timed=timed, sampler_mesh=sampler_mesh)
    elif timed or p.termination == "parsing" or p.reward_source == "host":
        phased = PhasedStep(config, task, static, mods, state_sh, frozen_sh, mesh, timed=timed)
    step_fn = programs.ppo_step_program(static, mods, state_sh, frozen_sh, mesh).fn
    eval_fn = jax.jit(functools.partial(evaluate_from_key_data, static, mods,
                                        gold_fn=task.gold_fn,
                                        samples_per_prompt=p.eval_samples_per_prompt))
    num_prompts = len(task.rl["ids"])
    # Held-out prompts and the evaluation key enter as global arrays on the mesh (on several
    # processes a jitted computation cannot take host arrays), the results come back whole.
    eval_inputs = sharding.put_global(
        dict(task.eval, key_data=jax.random.key_data(eval_key(config.seed))), mesh)

    trajectory_eval = None if task.turn_callback is None else TrajectoryEvaluation(
        config, task, static, mods)

    def run_eval(state):
        if trajectory_eval is not None:
            return trajectory_eval(state.actor_params, frozen)
        result = eval_fn(state.actor_params, frozen, eval_inputs["ids"], eval_inputs["mask"],
                         eval_inputs.get("documents"), eval_inputs["key_data"])
        return eval_row(distributed.global_to_host(
            {k: v for k, v in result.items() if k in EVAL_ROW_KEYS}))

    def run_step(state, step):
        if asynchronous is not None:
            return asynchronous(state, frozen, hparams, step)
        rows = batches.process_rows(batches.batch_indices(
            num_prompts, static.prompts_per_step, config.seed + 2, step), batch_sh)
        prompts = sharding.shard_batch({k: v[rows] for k, v in task.rl.items()}, mesh)
        if phased is not None:
            return phased(state, frozen, hparams, prompts, rows)
        return step_fn(state, frozen, hparams, prompts["ids"], prompts["mask"],
                       prompts.get("documents"))

    evaluates = loop.evaluation_steps(p.eval_every, p.steps)
    probe = None if make_probe is None else make_probe(static, mods)

    def hooks_due(done):
        return evaluates(done) or (probe is not None and probe.due(done))

    def eval_hook(state, done):
        rows = [dict(stage="eval", **run_eval(state))] if evaluates(done) else []
        if probe is not None and probe.due(done):
            rows.append(probe(state if asynchronous is None else state.ppo, frozen, hparams,
                              done))
        return rows

    stage = loop.Stage("ppo", workdir, max_to_keep=config.max_to_keep)
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            policy.config))):
        if not stage.latest_step() and p.eval_every > 0:
            writer.truncate_after("eval", -1)
            writer.write(dict(stage="eval", step=0, **run_eval(state)))
        if not stage.latest_step() and probe is not None:
            writer.truncate_after("credit", -1)
            writer.write(probe(state, frozen, hparams, 0))
        progress = ("objective/scores", "objective/kl")
        if asynchronous is not None:
            state = asynchronous.initial_state(state, frozen)
            progress += ("async/staleness_avg", "timing/overlap")
        try:
            state, _ = loop.run(stage, state=state, total_steps=p.steps, step_fn=run_step,
                                writer=writer, metadata=metadata,
                                checkpoint_every=config.checkpoint_every,
                                log_every=config.log_every,
                                # The asynchronous loop's state is restored as it is placed.
                                shardings=state_sh if asynchronous is None else None,
                                truncate_stages=("ppo", "eval", "credit"),
                                progress_keys=progress, hooks=eval_hook, hooks_due=hooks_due,
                                cost=step_cost(static, mods, task.prompt_length),
                                peak_flops=perf.devices_peak_flops(policy.config.dtype,
                                                                policy.config.precision))
        finally:
            if isinstance(asynchronous, AsyncTurnsStep):
                asynchronous.close()  # its threads still waiting for a version stop
    stage.close()
    if phased is not None:
        phased.close()
    return state


def step_cost(static: PPOStatic, mods: Models, prompt_length: int):
    """`(row) -> (tokens, model FLOPs)` of the PPO step(s) a metrics row reports, for the
    `perf/*` fields: every row's prompt and response tokens (`budget/*`) and
    `perf.ppo_step_flops` of the actor, reference, critic and reward model. A vmapped
    experiment's row holds a list per metric, one value per run: the sums over its runs."""
    flops = [perf.model_flops(m) for m in (mods.policy, mods.critic, mods.reward)]

    def cost(row):
        generated = np.atleast_1d(row["budget/generated_tokens"])
        # A single-turn rollout prefills each prompt once for its group; a multi-turn one every
        # row's prompt and observations, which the step's passes read as they read a prompt.
        multi_turn = "multiturn/turns_avg" in row
        prompts = np.atleast_1d(row["budget/prefill_tokens"]) * (
            1 if multi_turn else static.group_size)
        lengths = np.atleast_1d(row["val/response_length"])
        observed = np.atleast_1d(row["multiturn/observation_tokens_avg"]) * static.batch_size \
            if multi_turn else [None] * len(generated)
        total = sum(perf.ppo_step_flops(static, *flops, prompt_length, g, n, o)["total"]
                    for g, n, o in zip(generated, lengths, observed))
        return float(generated.sum() + prompts.sum()), total

    return cost
