"""Optimizers: AdamW with warmup + constant / linear / cosine decay and global-norm clipping."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
    """`cfg`: a stage section (learning_rate, warmup_ratio, schedule); `total_steps` updates."""
    total_steps = max(int(total_steps), 1)
    warmup = int(round(cfg.warmup_ratio * total_steps))
    peak = float(cfg.learning_rate)
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, 0.0, max(total_steps - warmup, 1))
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1))
    else:
        raise ValueError(f"schedule={cfg.schedule!r}: must be constant, linear or cosine")
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), decay], boundaries=[warmup])


def make_optimizer(cfg, total_steps: int, learning_rate: float | None = None):
    """AdamW (b1, b2, weight_decay) after global-norm clipping, on the stage's schedule."""
    if learning_rate is not None:
        cfg = cfg.copy_and_resolve_references()
        cfg.learning_rate = learning_rate
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                    weight_decay=cfg.weight_decay),
    )


def apply_if_finite(loss, grads, params, opt_state, optimizer):
    """One optimizer update that is skipped when the loss or any gradient is not finite.

    Returns (params, opt_state, skipped) with `skipped` a float32 0/1, so a non-finite step is
    counted in the metrics and never reaches the params or the optimizer moments.
    """
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt_state = optimizer.update(safe_grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    return pick(new_params, params), pick(new_opt_state, opt_state), 1.0 - finite.astype(
        jnp.float32)
