"""One jitted, sharded, resumable loop for the supervised stages (SFT and the reward model)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from marl_jax.data import batches
from marl_jax import models
from marl_jax.models import lora
from marl_jax.train import build, loop, perf, programs, sharding
from marl_jax.train.checkpoint import check_same_base, lora_identity
from marl_jax.train.optim import (
    accumulate_gradients,
    applied_updates,
    apply_if_finite,
    make_optimizer,
    stage_schedule,
)


# The stream of a supervised stage's dropout keys: fold_in(fold_in(key(seed), this), step).
DROPOUT_STREAM = 1


def make_train_step(loss_fn: Callable, optimizer, *, schedule=None, grad_accum_steps: int = 1,
                    weight_fn: Callable | None = None, num_layers_unfrozen: int = -1,
                    dropout_seed: int | None = None, compute_weights: Callable | None = None):
    """`(state, batch) -> (state, metrics)`; a non-finite loss skips the update and is counted.

    With `grad_accum_steps` > 1 the batch is split into micro-batches whose gradients are
    averaged with `weight_fn(micro_batch)` weights (default: equal) before the one update.
    `schedule` (the optimizer's learning rate per update) adds the `lr` metric: the rate of
    this step's update, at the optimizer's own count of applied updates (skipped ones do not
    count).
    `num_layers_unfrozen` >= 0 trains the top layers only (`optim.with_frozen_leaves`; pair it
    with an optimizer of the same setting).
    `dropout_seed` (None: no dropout): the loss is called with `rngs` (the adapters' dropout,
    `accumulate_gradients`) drawn from the seed and the state's step, so a resumed run draws the
    masks the uninterrupted one drew.
    `compute_weights` (`models.compute_weights` of the model's config): the loss sees the
    weights cast to the compute dtype once per micro-batch instead of once per layer call.
    """
    weight_fn = weight_fn or (lambda batch: jnp.float32(1.0))
    if compute_weights is not None:
        uncast_loss_fn = loss_fn
        loss_fn = lambda params, batch, **kw: uncast_loss_fn(compute_weights(params), batch, **kw)

    def train_step(state: build.TrainState, batch):
        dropout_key = None
        if dropout_seed is not None:
            stream = jax.random.fold_in(jax.random.key(dropout_seed), DROPOUT_STREAM)
            dropout_key = jax.random.fold_in(stream, state.step)
        (loss, metrics), grads = accumulate_gradients(loss_fn, state.params, batch,
                                                      grad_accum_steps, weight_fn,
                                                      num_layers_unfrozen, dropout_key)
        params, opt_state, skipped = apply_if_finite(loss, grads, state.params, state.opt_state,
                                                     optimizer)
        total_skipped = state.skipped_updates + skipped
        metrics = dict(metrics, loss=loss, skipped_updates=total_skipped)
        if schedule is not None:
            metrics["lr"] = schedule(applied_updates(state.opt_state))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                             skipped_updates=total_skipped), metrics

    return train_step


def make_lora_train_step(loss_fn: Callable, optimizer, **kwargs):
    """`(state, batch, base) -> (state, metrics)`: `make_train_step` of a LoRA stage, whose state
    holds the adapters and heads and whose loss sees them attached to the frozen `base` (an
    argument of the step, so one copy of it sits on the devices and none in the state)."""
    cast = kwargs.pop("compute_weights", None) or (lambda params: params)

    def train_step(state: build.TrainState, batch, base):
        attached = lambda params, b, **kw: loss_fn(cast(lora.attach(base, params)), b, **kw)
        return make_train_step(attached, optimizer, **kwargs)(state, batch)

    return train_step


def train(*, name: str, cfg, seed: int, module, init_params, loss_fn: Callable, data: dict,
          mesh, writer, workdir: str, checkpoint_every: int, log_every: int, max_to_keep: int,
          metadata: dict, progress_keys=(), weight_fn: Callable | None = None,
          sequences: Sequence[tuple[int, int]] | None = None,
          lora_weight_decay: float = 0.0) -> Any:
    """Trains `module` from `init_params` for `cfg.steps` steps; returns the final params.

    Args:
      cfg: the stage's config section (steps, batch_size, grad_accum_steps, optimizer fields).
      loss_fn: `(params, batch, rngs=None) -> (loss, metrics)`; `rngs` carries the adapters'
        dropout rng (`model.lora.dropout` > 0) and is passed to the model's training forward.
      data: dict of host arrays with a common leading axis; batches are rows of it.
      weight_fn: a micro-batch's weight in gradient accumulation (see `make_train_step`).
      sequences: what one row of `data` runs through the model, as (count, width) pairs of
        sequences (a preference pair: the prompt with each response), for the `perf/*` fields
        (tokens: their positions; FLOPs: `perf.ModelFlops.train` of each, the LM head over the
        response positions of a `*response_ids` array); default one sequence as wide as the
        row's `*ids` arrays together.
      lora_weight_decay: the AdamW weight decay of the adapters (`model.lora.weight_decay`).

    With LoRA (`module.config.lora_rank`) the stage trains the adapters of `init_params` (fresh
    ones when it has none) and its head, on the rest of it, the frozen base: an argument of the
    step, absent from the state and the checkpoints, which record its identity
    (`checkpoint.lora_identity`). Returns the base with the trained adapters attached.
    """
    if cfg.steps == 0:
        return init_params
    base = None
    if module.config.lora_rank:
        init_params = lora.with_adapters(module, init_params, jax.random.key(seed))
        base, init_params = lora.frozen_base(init_params), lora.trainable(init_params)
    sharding.validate_batch(cfg.batch_size, mesh, f"config.{name}.batch_size")
    optimizer = make_optimizer(cfg, cfg.steps,
                               lora_weight_decay=lora_weight_decay if base is not None else None)
    shardings = build.train_state_shardings(module, optimizer, mesh, init_params)
    batch_sh = sharding.batch_sharding(mesh)
    step_kwargs = dict(schedule=stage_schedule(cfg, cfg.steps),
                       grad_accum_steps=int(cfg.get("grad_accum_steps", 1)), weight_fn=weight_fn,
                       num_layers_unfrozen=int(cfg.get("num_layers_unfrozen", -1)),
                       dropout_seed=seed if module.config.lora_dropout else None,
                       compute_weights=functools.partial(models.compute_weights, config=module.config))
    if base is None:
        step_fn = programs.supervised_program(make_train_step(loss_fn, optimizer, **step_kwargs),
                                              shardings, mesh).fn
    else:
        base_sh = build.param_shardings(module, mesh, build.abstract(base))
        base = jax.device_put(base, base_sh)
        metadata = dict(metadata, base=lora_identity(base))
        lora_fn = programs.supervised_program(
            make_lora_train_step(loss_fn, optimizer, **step_kwargs), shardings, mesh,
            base_shardings=base_sh).fn
        step_fn = lambda state, batch: lora_fn(state, batch, base)
    num_examples = len(next(iter(data.values())))
    if sequences is None:
        sequences = ((1, sum(v.shape[1] for k, v in data.items() if k.endswith("ids"))),)
    cost = step_cost(module, cfg.batch_size, sequences,
                     head_width=data["response_ids"].shape[-1] if "response_ids" in data else None)
    stage = loop.Stage(name, workdir, max_to_keep=max_to_keep)

    def run_step(state, step):
        rows = batches.process_rows(batches.batch_indices(num_examples, cfg.batch_size, seed,
                                                          step), batch_sh)
        batch = sharding.shard_batch(batches.take(data, rows), mesh)
        return step_fn(state, batch)

    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(
            module.config))):
        latest = stage.latest_step()
        if latest is not None and latest >= cfg.steps:
            abstract = jax.eval_shape(lambda: build.TrainState(
                step=jnp.zeros((), jnp.int32), params=init_params,
                opt_state=optimizer.init(init_params), skipped_updates=jnp.zeros(())))
            state, saved = stage.restore(abstract, shardings, step=latest)
            stage.close()
            check_same_base(saved, metadata, stage.name)
            return _with_base(base, state.params)
        state = build.new_train_state(init_params, optimizer, shardings)
        state, _ = loop.run(stage, state=state, total_steps=cfg.steps, step_fn=run_step,
                            writer=writer, metadata=metadata, checkpoint_every=checkpoint_every,
                            log_every=log_every, progress_keys=progress_keys,
                            cost=lambda row: cost,
                            peak_flops=perf.devices_peak_flops(module.config.dtype,
                                                            module.config.precision))
    stage.close()
    return _with_base(base, state.params)


def step_cost(module, batch_size: int, sequences, head_width: int | None = None):
    """(tokens, model FLOPs) of one supervised step of `batch_size` rows, each running
    `sequences` ((count, width) pairs) forward and backward through `module`; a causal LM's head
    over the last `head_width` positions of each sequence (the response), else over all."""
    flops = perf.model_flops(module)
    is_lm = isinstance(module, models.CausalLM)
    tokens = batch_size * sum(count * width for count, width in sequences)
    total = batch_size * sum(count * flops.train(width, width, head_width if is_lm and head_width
                                                  else None) for count, width in sequences)
    return float(tokens), float(total)


def _with_base(base, trained):
    return trained if base is None else lora.attach(base, trained)
