"""LoRA: low-rank adapters beside the decoder's frozen projections.

A targeted projection `y = x . W` becomes `y = x . W + (alpha / r) (x . A) . B` with A
`[in..., r]` and B `[r, out...]` stored in float32 next to the kernel (`.../q/lora_a`,
`.../q/lora_b`), whatever the base's `param_dtype`. B starts at zero, so an adapted model equals
its base at initialisation, and the low-rank path runs as two thin matmuls: no `[in, out]`
update is ever formed inside a step. Adapter dropout (PEFT's `lora_dropout`) drops inputs of
the low-rank path only, `(alpha / r) (dropout(x) . A) . B`, and only in the forwards that are
given a `"dropout"` rng (the training losses); sampling, scoring and evaluation run without it.
A carries the kernel's logical axes on its input side and B on its output side, their rank
axis on fsdp where those axes are not, so the adapters shard with the base.

A model with adapters on (`lora_rank` > 0) needs an adapter for every targeted projection: params
without one raise, naming the projection (adapters trained on a scanned model and attached to an
unrolled one, or a base passed where a role's adapters belong, never run as the plain base). The
base with the adapters off is an explicit switch, `adapters_off(module)`: the model with
`lora_rank` 0, which applies a base (and ignores any adapter leaves). `attach` lays a role's
adapters over the one frozen base; `merge` folds the adapters into the kernels.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ADAPTER_NAMES = ("lora_a", "lora_b")


class LoraSettings(NamedTuple):
    """What a projection needs to know (hashable, a Dense field)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def settings(config) -> LoraSettings | None:
    """The LoRA settings of a `ModelConfig` (None when `lora_rank` is 0)."""
    if not config.lora_rank:
        return None
    return LoraSettings(int(config.lora_rank), float(config.lora_alpha),
                        tuple(config.lora_targets), float(config.lora_dropout))


def low_rank_update(module: nn.Module, x: jax.Array, y: jax.Array, lora: LoraSettings | None,
                    in_shape: tuple[int, ...], kernel_axes: tuple, contract_dims: int,
                    dtype) -> jax.Array:
    """`y + scale * (x . A) . B` for a projection `module` (a `Dense` named after its target)
    contracting the last `contract_dims` axes of `x` (`in_shape`) into `y [..., out...]`; `y`
    unchanged when the projection is not targeted (or adapters are off: `lora` None). A targeted
    projection whose params hold no adapter raises ValueError naming it. With `lora.dropout` > 0
    and a `"dropout"` rng in the apply call, `x` reaches A through inverted dropout (each
    projection draws its own mask)."""
    if lora is None or module.name not in lora.targets:
        return y
    if not module.is_initializing() and not (module.has_variable("params", "lora_a")
                                             and module.has_variable("params", "lora_b")):
        where = "/".join(str(part) for part in module.scope.path)
        raise ValueError(
            f"LoRA: the targeted projection {where} has no adapter (lora_a, lora_b) in the "
            f"params; attach the role's adapters to the base (lora.attach), or apply the base "
            f"with the adapters off (lora.adapters_off)")
    fan_in = math.prod(in_shape)
    bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming_uniform(a=sqrt(5)) bound for A
    out_shape = y.shape[x.ndim - contract_dims:]
    # The rank axis takes fsdp where the kernel's axes on that side do not (a mesh axis shards
    # one dimension).
    in_axes, out_axes = tuple(kernel_axes[:contract_dims]), tuple(kernel_axes[contract_dims:])
    rank_axis = lambda axes: None if "embed" in axes else "lora_rank"
    a = module.param("lora_a", nn.with_logical_partitioning(
        lambda key, shape, dt: jax.random.uniform(key, shape, dt, -bound, bound),
        (*in_axes, rank_axis(in_axes))), (*in_shape, lora.rank), jnp.float32)
    b = module.param("lora_b", nn.with_logical_partitioning(
        nn.initializers.zeros, (rank_axis(out_axes), *out_axes)), (lora.rank, *out_shape),
        jnp.float32)
    if lora.dropout > 0.0 and module.has_rng("dropout"):
        x = inverted_dropout(module.make_rng("dropout"), x, lora.dropout)
    down = jnp.tensordot(x.astype(dtype), a.astype(dtype), axes=contract_dims)
    delta = jnp.tensordot(down, b.astype(dtype), axes=1)
    return y + (delta * jnp.asarray(lora.scale, dtype)).astype(y.dtype)


def inverted_dropout(key: jax.Array, x: jax.Array, rate: float) -> jax.Array:
    """`x` with each element zeroed with probability `rate` and the rest scaled by
    `1 / (1 - rate)` (torch's and Flax's dropout), in `x`'s dtype."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


# ---- pytrees ------------------------------------------------------------------------------------
def _filter(tree, keep_adapters: bool):
    """The sub-dict of `tree` of its adapter leaves (or of all other leaves); empty dicts
    dropped."""
    def walk(node):
        out = {}
        for key, child in node.items():
            if isinstance(child, dict):
                sub = walk(child)
                if sub:
                    out[key] = sub
            elif (key in ADAPTER_NAMES) == keep_adapters:
                out[key] = child
        return out
    return walk(dict(tree))


def adapters(params) -> dict:
    """Only the adapter leaves of `params` (same nesting)."""
    return _filter(params, True)


def without_adapters(params) -> dict:
    """`params` with every adapter leaf removed: the frozen base."""
    return _filter(params, False)


def has_adapters(params) -> bool:
    return bool(jax.tree.leaves(adapters(params)))


def attach(base, trained) -> dict:
    """The params a role applies: `base` with `trained` (adapters, heads) laid over it, key by
    key. Inside a jitted step this builds a pytree of the same arrays (nothing is copied)."""
    if not isinstance(trained, dict) or not isinstance(base, dict):
        return trained
    out = dict(base)
    for key, value in trained.items():
        out[key] = attach(base[key], value) if key in base else value
    return out


def adapters_off(module: nn.Module) -> nn.Module:
    """`module` with its adapters switched off (`lora_rank` 0): the plain base model, for params
    that are a base (the pretrained model, a merged SFT policy, the reference of a merged
    run)."""
    if not module.config.lora_rank:
        return module
    return module.clone(config=dataclasses.replace(module.config, lora_rank=0))


def fresh_trainable(module: nn.Module, key: jax.Array) -> dict:
    """Newly initialised adapters (A random, B zero) and head of `module`. Jitted, so the base
    weights that `init` would also create are never materialised."""
    def init(k):
        ids = jnp.zeros((1, 1), jnp.int32)
        return trainable(nn.meta.unbox(module.init(k, ids, jnp.ones_like(ids))["params"]))
    return jax.jit(init)(key)


def with_adapters(module: nn.Module, params, key: jax.Array) -> dict:
    """`params` as they are when they hold adapters, else with fresh ones attached."""
    return params if has_adapters(params) else attach(
        params, adapters(fresh_trainable(module, key)))


def select(tree, like) -> dict:
    """The part of `tree` with the keys of `like` (a sub-tree of it), e.g. the shardings of a
    role's adapters and heads out of those of its whole model."""
    if not isinstance(like, dict):
        return tree
    return {key: select(tree[key], value) for key, value in like.items()}


def trainable(params) -> dict:
    """What a LoRA stage trains of a model's `params`: its adapters and its scalar head (the
    reward model's score, the critic's value); the embeddings, LM head and every kernel stay the
    frozen base's."""
    out = adapters(params)
    if "head" in params:
        out["head"] = params["head"]
    return out


def frozen_base(params) -> dict:
    """The frozen base of a model's `params`: everything but `trainable`."""
    out = without_adapters(params)
    out.pop("head", None)
    return out


def merge(params, lora: LoraSettings, *, precision: str) -> dict:
    """`params` with each adapted kernel replaced by `W + scale * A . B` (in W's dtype) and the
    adapters removed: the plain model the adapters define. `precision` is the model's
    (`ModelConfig.precision`: default, high or highest), so a model computing at highest merges
    exactly, not through the platform's faster default (TF32 on NVIDIA GPUs, one bfloat16 pass
    on TPUs). Works on unrolled and scanned (leading layer axis) params alike. Jittable."""
    def walk(node):
        if not isinstance(node, dict):
            return node
        if "lora_a" in node:
            node = dict(node)
            a, b, w = node.pop("lora_a"), node.pop("lora_b"), node["kernel"]
            node["kernel"] = (w.astype(jnp.float32)
                              + lora.scale * delta(a, b, w.shape, precision)).astype(w.dtype)
            return node
        return {key: walk(child) for key, child in node.items()}
    return walk(dict(params))


def delta(a: jax.Array, b: jax.Array, kernel_shape: tuple[int, ...],
          precision: str) -> jax.Array:
    """`A . B` in float32 at `precision`, shaped like the kernel: A `[L..., in..., r]`,
    B `[L..., r, out...]` (L... the scanned layer axis, when present)."""
    lead = a.ndim + b.ndim - 2 - len(kernel_shape)
    lead_shape = a.shape[:lead]
    in_size = math.prod(a.shape[lead:-1])
    out_size = math.prod(b.shape[lead + 1:])
    a2 = a.astype(jnp.float32).reshape(lead_shape + (in_size, a.shape[-1]))
    b2 = b.astype(jnp.float32).reshape(lead_shape + (b.shape[lead], out_size))
    return jnp.matmul(a2, b2, precision=precision).reshape(kernel_shape)


def projection_dims(config) -> dict[str, tuple[int, int]]:
    """(input, output) width of each targetable projection of a `ModelConfig`."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    dims = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "up": (d, f), "down": (f, d)}
    if config.gated_mlp:
        dims["gate"] = (d, f)
    return dims


def check(rank: int, targets, config, field: str = "model.lora") -> None:
    """One-line ValueError for an unknown target, a target the architecture lacks, or a rank
    above a targeted projection's smaller dimension."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"config.{field}.targets: unknown {unknown}; choose from {TARGETS}")
    if not targets:
        raise ValueError(f"config.{field}.targets: empty; choose from {TARGETS}")
    if config is None:
        return
    dims = projection_dims(config)
    missing = [t for t in targets if t not in dims]
    if missing:
        raise ValueError(f"config.{field}.targets: the {config.family} architecture has no "
                         f"{missing} projection (its MLP is not gated)")
    for target in targets:
        if rank > min(dims[target]):
            raise ValueError(f"config.{field}.rank={rank}: above the {target} projection's "
                             f"smaller dimension {min(dims[target])} {dims[target]}")
