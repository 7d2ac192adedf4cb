"""Parameter initialisation and logical sharding axes of a model, as plain pytrees."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _boxed_init(model: nn.Module, key: jax.Array):
    ids = jnp.zeros((1, 1), jnp.int32)
    return model.init(key, ids, jnp.ones_like(ids))["params"]


def init_params(model: nn.Module, key: jax.Array) -> dict:
    """Random parameters (plain arrays, no partitioning boxes). Jittable: wrap in
    `jax.jit(..., out_shardings=...)` to initialise directly into a sharded layout."""
    return nn.meta.unbox(_boxed_init(model, key))


def logical_axes(model: nn.Module) -> dict:
    """`jax.sharding.PartitionSpec` of logical axis names for every parameter, same tree as
    `init_params`."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(model, jax.random.key(0))))
