"""Optimizers: AdamW with warmup + constant / linear / cosine decay and global-norm clipping."""
from __future__ import annotations

import re

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


# Parameters without weight decay, by leaf name: norm scales and biases (as DeepSpeed-Chat's
# `no_decay` list), whatever their rank (scanned layers stack them into [L, D]).
NO_DECAY_NAMES = ("scale", "bias")
# LoRA's adapter leaves (`models.lora.ADAPTER_NAMES`): their own weight decay.
ADAPTER_NAMES = ("lora_a", "lora_b")


def _leaf_name(path):
    last = path[-1]
    return getattr(last, "key", getattr(last, "name", None))


def weight_decay_mask(params):
    """A pytree of bools like `params`: True where AdamW applies the stage's weight decay
    (matrices; not norm scales, biases or LoRA adapters)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _leaf_name(path) not in NO_DECAY_NAMES + ADAPTER_NAMES, params)


def adapter_mask(params):
    """A pytree of bools like `params`: True on LoRA's adapter leaves."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) in ADAPTER_NAMES,
                                            params)


def adapter_weight_decay(config) -> float | None:
    """The weight decay of LoRA's adapters, `config.model.lora.weight_decay` (PEFT / TRL LoRA
    recipes: 0), for a LoRA run; None for full fine-tuning."""
    lo = config.model.get("lora", None)
    if lo is None or not lo.rank:
        return None
    return float(lo.get("weight_decay", 0.0))


def make_optimizer(cfg, total_updates: int, learning_rate: float | None = None,
                   lora_weight_decay: float | None = None):
    """AdamW (b1, b2, weight_decay on matrices only) after global-norm clipping, on the stage's
    schedule over `total_updates` optimizer updates.

    `lora_weight_decay` (a LoRA stage: `adapter_weight_decay(config)`) is the decay of the
    adapter leaves; the stage's `weight_decay` stays that of the other matrices (the heads).

    With `cfg.num_layers_unfrozen` = n >= 0 (trlx's knob) only the top n decoder layers, the
    final norm and the heads train (`trainable_mask`): the other leaves get no update and no
    optimizer state."""
    schedule = stage_schedule(cfg, total_updates, learning_rate)
    if lora_weight_decay is None:
        update = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                             mask=weight_decay_mask)
    else:  # optax.adamw's chain, with the adapters' decay beside the stage's
        update = optax.chain(
            optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2),
            optax.add_decayed_weights(cfg.weight_decay, mask=weight_decay_mask),
            optax.add_decayed_weights(lora_weight_decay, mask=adapter_mask),
            optax.scale_by_learning_rate(schedule))
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        update)
    n = int(cfg.get("num_layers_unfrozen", -1))
    if n < 0:
        return adamw
    labels = lambda params: jax.tree.map(lambda t: "train" if t else "frozen",
                                         trainable_mask(params, n))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


_LAYER = re.compile(r"layers_(\d+)")


def trainable_mask(params, num_layers_unfrozen: int):
    """A pytree of bools like `params`: the leaves a stage with `num_layers_unfrozen` = n trains
    (every leaf for n < 0; else the top n of the decoder's unrolled `layers_<i>`, its
    `final_norm`, and the `head` / untied `lm_head`; embeddings and the lower layers frozen)."""
    keys = lambda path: [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if num_layers_unfrozen < 0:
        return jax.tree.map(lambda _: True, params)
    paths = [keys(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if any(len(k) > 1 and k[0] == "backbone" and k[1] == "layers" for k in paths):
        raise ValueError("num_layers_unfrozen needs unrolled decoder layers: set "
                         "config.model.scan_layers=False")
    depth = 1 + max((int(m.group(1)) for k in paths if len(k) > 1
                     for m in [_LAYER.fullmatch(k[1])] if m), default=-1)
    if num_layers_unfrozen > depth:
        raise ValueError(f"num_layers_unfrozen={num_layers_unfrozen}: the model has {depth} "
                         "layers")

    def trains(path, _):
        k = keys(path)
        if k[0] in ("head", "lm_head"):
            return True
        if k[0] == "backbone" and len(k) > 1:
            if k[1] == "final_norm":
                return True
            m = _LAYER.fullmatch(k[1])
            return bool(m) and int(m.group(1)) >= depth - num_layers_unfrozen
        return False

    return jax.tree_util.tree_map_with_path(trains, params)


def with_frozen_leaves(loss_fn, num_layers_unfrozen: int):
    """`loss_fn(params, ...)` with the leaves `trainable_mask` freezes behind `stop_gradient`, so
    autodiff neither computes their gradients (zeros) nor backpropagates below the lowest
    trained layer."""
    if num_layers_unfrozen < 0:
        return loss_fn

    def wrapped(params, *args):
        mask = trainable_mask(params, num_layers_unfrozen)
        params = jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), params, mask)
        return loss_fn(params, *args)

    return wrapped


def applied_updates(opt_state) -> jax.Array:
    """How many updates the optimizer of `make_optimizer` has applied: the count of its
    learning-rate schedule (`optax.scale_by_schedule`), which a skipped non-finite update
    (`apply_if_finite`) leaves where it was. The schedule's learning rate of the next update is
    `schedule(applied_updates(opt_state))`."""
    of_schedule = lambda path, _: getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"  # noqa: E731
    count = optax.tree_utils.tree_get(opt_state, "count", filtering=of_schedule)
    if count is None:
        raise ValueError("the optimizer state holds no learning-rate schedule")
    return count


def stage_schedule(cfg, total_updates: int, learning_rate: float | None = None):
    """The learning-rate schedule of a stage (`learning_rate` overrides the peak, e.g. the
    critic's)."""
    if learning_rate is not None:
        cfg = cfg.copy_and_resolve_references()
        cfg.learning_rate = learning_rate
    return learning_rate_schedule(cfg, total_updates)


def accumulate_gradients(loss_fn, params, batch, num_micro: int, weight_fn,
                         num_layers_unfrozen: int = -1, dropout_key=None, term_weights=None):
    """`(loss, metrics), grads` of `loss_fn(params, batch)` computed over `num_micro`
    micro-batches, one after another (a scan), so activation memory is a micro-batch's.

    Micro-batch results are averaged with weights `weight_fn(micro_batch)` (e.g. its number of
    valid tokens for a token-mean loss), so the result equals the whole-batch gradient exactly
    for losses that are weighted means. Micro-batch j holds rows j, j + num_micro, ..., so each
    keeps the batch's even spread over the devices of a data-sharded leading axis.

    `term_weights` ({name: weight function}, None: none) names terms of the loss that are
    weighted means over other units than the rest of it (a KL term averaged over tokens in a
    loss averaged over macro actions): `loss_fn`'s metrics hold each such term, already added
    into its loss. Each is averaged over the micro-batches with its own weights, the rest of
    the loss with `weight_fn`'s, so the sum is still the whole batch's loss and gradient; the
    term's metric is averaged with its own weights too.

    `dropout_key` (None: no dropout) is the step's dropout rng: micro-batch j calls
    `loss_fn(params, micro_batch, rngs={"dropout": fold_in(dropout_key, j)})`.
    """
    def loss_of_micro_batch(p, mb, j):
        if dropout_key is None:
            return loss_fn(p, mb)
        return loss_fn(p, mb, rngs={"dropout": jax.random.fold_in(dropout_key, j)})

    grad_fn = jax.value_and_grad(with_frozen_leaves(loss_of_micro_batch, num_layers_unfrozen),
                                 has_aux=True)
    if num_micro == 1:
        return grad_fn(params, batch, 0)
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % num_micro:
        raise ValueError(f"a batch of {size} rows does not split into {num_micro} micro-batches")
    micro = jax.tree.map(
        lambda x: x.reshape((size // num_micro, num_micro) + x.shape[1:]).swapaxes(0, 1), batch)
    fraction_of = lambda fn: (lambda w: w / jnp.maximum(w.sum(), 1e-12))(  # noqa: E731
        jax.vmap(fn)(micro).astype(jnp.float32))
    fractions = fraction_of(weight_fn)
    if term_weights:
        return _accumulate_terms(loss_of_micro_batch, params, micro, num_micro, fractions,
                                 {name: fraction_of(fn) for name, fn in term_weights.items()},
                                 num_layers_unfrozen)

    def body(total, xs):
        mb, fraction, j = xs
        out = grad_fn(params, mb, j)
        return jax.tree.map(lambda t, x: t + (fraction * x).astype(t.dtype), total, out), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), 0))
    total, _ = jax.lax.scan(body, zeros, (micro, fractions, jnp.arange(num_micro)))
    return total


def _accumulate_terms(loss_of_micro_batch, params, micro, num_micro, fractions, term_fractions,
                      num_layers_unfrozen):
    """`accumulate_gradients` with terms of their own weights: micro-batch j contributes
    f_j (loss_j - sum_k term_kj) + sum_k g_kj term_kj to the loss (f, g_k: its fractions of
    the loss's and of term k's weights), and that contribution's gradient."""
    def weighted(p, mb, j, fraction, term_fraction):
        loss, metrics = loss_of_micro_batch(p, mb, j)
        objective = fraction * loss + sum((term_fraction[k] - fraction) * metrics[k]
                                          for k in term_fraction)
        return objective, {k: term_fraction.get(k, fraction) * v for k, v in metrics.items()}

    grad_fn = jax.value_and_grad(with_frozen_leaves(weighted, num_layers_unfrozen), has_aux=True)

    def body(total, xs):
        mb, fraction, term_fraction, j = xs
        out = grad_fn(params, mb, j, fraction, term_fraction)
        return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, out), None

    first = (jax.tree.map(lambda x: x[0], micro), 0, fractions[0],
             jax.tree.map(lambda x: x[0], term_fractions))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(grad_fn, params, *first))
    total, _ = jax.lax.scan(body, zeros, (micro, fractions, term_fractions,
                                          jnp.arange(num_micro)))
    return total


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
