"""The schedule of asynchronous PPO: which policy version samples which decode chunk of which
batch, and which devices sample and which train (docs/async.md).

A pure function of the step and the config, never of timing: two runs with the same seed and
`rollout.max_staleness` sample every token with the same version, so an asynchronous run is as
reproducible as a synchronous one.

Versions: version v is the actor after v updates (version 0: the SFT policy); update s trains
batch s and turns version s into s + 1. With `max_staleness` k = 0 batch s is sampled by version
s, all at once: the synchronous step. With k >= 1 batch s is sampled while the trainer works on
the batches before it: each response is decoded in k chunks of `chunk_tokens` (D) tokens (D
more tokens of each response still going), chunk i by version `max(0, s - k + i)`, so

    iteration t (the weights at version t):  the sampler decodes chunk k - j of batch t + j for
                                              j = 1..k (batch t + k starts),
                                              the trainer scores batch t and updates: t -> t + 1.

Batch s + 1 is sampled (its last chunk) with the weights before update s; a token is at most k
versions older than the update that trains it, and a response longer than D tokens carries
several versions. Before step 0 the sampler runs k warm-up iterations (-k..-1) with version 0.

A response still unfinished after its k chunks (k D < `response_length`) is not trained with its
batch: its group (the rows of one prompt) carries over into batch s + k, in place of that batch's
group at the same position, and continues there (partial rollouts). Its tokens then age past k
versions; a token older than `max_token_staleness` versions at its update gets no loss weight and
is counted, and a finished row of a carried group whose tokens would all be that old is sampled
again from its prompt.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from marl_jax.train import sharding

# The version of a token no policy sampled (observations, padding).
NO_VERSION = -1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The asynchronous schedule of a run (`from_config`): k = `max_staleness`, D =
    `chunk_tokens` (resolved: ceil(response_length / k) when the config says 0), the response
    budget R, and the token staleness limit (None: none)."""

    max_staleness: int
    chunk_tokens: int
    response_length: int
    max_token_staleness: Optional[int] = None

    @classmethod
    def from_config(cls, config) -> "Schedule":
        r, k = config.rollout, int(config.rollout.max_staleness)
        length = int(config.ppo.response_length)
        chunk = int(r.chunk_tokens) or (math.ceil(length / k) if k else length)
        limit = r.get("max_token_staleness")
        return cls(max_staleness=k, chunk_tokens=min(chunk, length), response_length=length,
                   max_token_staleness=None if limit is None else int(limit))

    @property
    def asynchronous(self) -> bool:
        return self.max_staleness > 0

    @property
    def chunks(self) -> int:
        """Decode chunks of one pass of a batch through the sampler (1 when synchronous)."""
        return max(self.max_staleness, 1)

    @property
    def carries_over(self) -> bool:
        """Whether a response can outlast its batch's chunks (k D < R)."""
        return self.chunks * self.chunk_tokens < self.response_length

    def version(self, batch: int, chunk: int) -> int:
        """The policy version that samples chunk `chunk` of batch `batch`."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} outside the {self.chunks} chunks of a pass")
        return max(0, batch - self.max_staleness + chunk) if self.asynchronous else batch

    def decoded_at(self, iteration: int) -> list[tuple[int, int]]:
        """[(batch, chunk)] the sampler decodes at `iteration`, all with version max(0,
        iteration), oldest batch first (iterations -k..-1 are the warm-up)."""
        k = self.max_staleness
        if not k:
            return [(iteration, 0)]
        return [(iteration + j, k - j) for j in range(1, k + 1) if iteration + j >= 0]

    def warm_up(self) -> range:
        """The sampler's iterations before step 0 (k of them, all with version 0)."""
        return range(-self.max_staleness, 0)



def stamp_versions(mask, version):
    """`[B, R]` int32: `version` (a scalar, possibly traced) where `mask` is set, `NO_VERSION`
    elsewhere: the versions of a rollout sampled by one policy."""
    return jnp.where(jnp.asarray(mask) != 0, jnp.asarray(version, jnp.int32),
                     NO_VERSION).astype(jnp.int32)


def token_staleness(versions, trainer_version):
    """`[B, R]` int32: how many updates lie between each token's version and the update that
    trains it (`trainer_version`: the actor's version, the step); 0 where no policy sampled."""
    versions = jnp.asarray(versions)
    return jnp.where(versions >= 0, jnp.asarray(trainer_version, jnp.int32) - versions,
                     0).astype(jnp.int32)


def fresh_tokens(versions, trainer_version, max_token_staleness: Optional[int]):
    """`[B, R]` bool: the tokens at most `max_token_staleness` versions old (every one when it
    is None or negative) or sampled by no policy."""
    if max_token_staleness is None or max_token_staleness < 0:
        return jnp.ones(jnp.shape(versions), bool)
    return token_staleness(versions, trainer_version) <= max_token_staleness


def device_split(devices: Sequence, sampler: Sequence[int], trainer: Sequence[int]):
    """(sampler devices, trainer devices) of `rollout.sampler_devices` / `trainer_devices`
    (indices into `devices`): both empty, every device for both (one set, interleaved); the
    trainer's empty, every device the sampler does not take. Raises ValueError naming the field
    when the sets overlap, name a device that does not exist or leave one side none."""
    sampler, trainer = [int(i) for i in sampler], [int(i) for i in trainer]
    count = len(devices)
    for name, indices in (("sampler_devices", sampler), ("trainer_devices", trainer)):
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise ValueError(f"config.rollout.{name}={tuple(indices)}: devices {bad} do not exist "
                             f"(this run has {count}: 0..{count - 1})")
        if len(set(indices)) != len(indices):
            raise ValueError(f"config.rollout.{name}={tuple(indices)}: a device is listed twice")
    if not sampler:
        if trainer:
            raise ValueError(f"config.rollout.trainer_devices={tuple(trainer)}: set "
                             "rollout.sampler_devices too (both empty: one set of devices)")
        return list(devices), list(devices)
    if not trainer:
        trainer = [i for i in range(count) if i not in sampler]
    both = sorted(set(sampler) & set(trainer))
    if both:
        raise ValueError(f"config.rollout.sampler_devices={tuple(sampler)}: devices {both} also "
                         f"train (rollout.trainer_devices={tuple(trainer)}); the sets must be "
                         "disjoint")
    if not trainer:
        raise ValueError(f"config.rollout.sampler_devices={tuple(sampler)}: takes all {count} "
                         "devices, none is left to train")
    return [devices[i] for i in sampler], [devices[i] for i in trainer]


def meshes(config, mesh):
    """(the trainer's mesh, the sampler's mesh or None) of `config.mesh` over the device sets of
    `config.rollout` (`device_split` of `jax.devices()`): `mesh` and None when they are one
    set. Raises
    ValueError naming the field when a set does not exist, `config.mesh` does not fit a set or
    the batch does not split over the sampler's data shards (before anything compiles)."""
    r = config.rollout
    if not r.sampler_devices:
        return mesh, None
    sampler, trainer = device_split(jax.devices(), r.sampler_devices, r.trainer_devices)
    out = []
    for name, subset in (("trainer", trainer), ("sampler", sampler)):
        out.append(sharding.make_mesh(config.mesh, subset,
                                      name=f"config.mesh (over the {len(subset)} {name} devices)"))
    p = config.ppo
    sharding.validate_batch(p.batch_size, out[1], "config.ppo.batch_size (on the sampler's "
                            "devices)")
    sharding.validate_batch(p.batch_size // p.group_size, out[1], "config.ppo.batch_size / "
                            "config.ppo.group_size (prompts per step, on the sampler's devices)")
    return tuple(out)
