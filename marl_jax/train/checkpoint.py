"""Atomic, resumable checkpoints of a training state pytree plus JSON metadata (orbax).

Layout: `<directory>/<step>/state` (the arrays, written by every process for its shards) and
`<directory>/<step>/metadata` (JSON, written once). Orbax writes each step into
`<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only when everything is on disk (on
GCS, where renames are not atomic, a `commit_success.txt` marks completion instead), so a killed
run leaves either a complete checkpoint or a temporary directory that is ignored and removed when
the directory is opened again.

Resuming: a trainer opens `Checkpointer(checkpoint_dir(workdir, stage))`, and if `latest_step()` is
not None restores the state (params, optimizer state, RNG key data, data position) onto its
current shardings, which may come from a different mesh than the one that wrote it.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

_STATE = "state"
_METADATA = "metadata"


def _absolute(path: str | os.PathLike) -> str:
    """Local paths made absolute; URLs such as gs://bucket/run kept as they are."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)


def checkpoint_dir(workdir: str | os.PathLike, stage: str) -> str:
    """`<workdir>/checkpoints/<stage>`: where a stage's checkpoints live (local or gs://)."""
    if not stage:
        raise ValueError("stage must be a non-empty string")
    return f"{_absolute(workdir).rstrip('/')}/checkpoints/{stage}"


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint step in `directory` (None: none, or no directory), read
    from the directory listing alone: for looking at another stage's progress without opening
    a manager on it."""
    steps = ocp.path.step.checkpoint_steps(_absolute(directory))
    return max(steps) if steps else None


def all_steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoint steps in `directory`, ascending ([]: none, or no directory), read
    from the directory listing alone, like `latest_step`."""
    return sorted(ocp.path.step.checkpoint_steps(_absolute(directory)))


def commit_id(directory: str | os.PathLike, step: int) -> str:
    """An identity of the checkpoint `step` in `directory`: its commit time in nanoseconds as
    orbax records it (a checkpoint written again, e.g. by a retrained stage, gets a new one);
    "" when there is none."""
    from etils import epath

    path = epath.Path(_absolute(directory)) / str(step) / "_CHECKPOINT_METADATA"
    try:
        return str(json.loads(path.read_text())["commit_timestamp_nsecs"])
    except (OSError, ValueError, KeyError):
        return ""


def should_save(step: int, every: int, final_step: int) -> bool:
    """True at every `every`-th completed step (step > 0) and at `final_step`.

    `every=0` saves only at `final_step`.
    """
    if every < 0:
        raise ValueError(f"checkpoint every={every} must be >= 0 (0 = only at the end)")
    return step == final_step or (every > 0 and step > 0 and step % every == 0)


def _is_key_array(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_host_value(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, int, float, bool))


def _reject_typed_keys(tree: Any, argument: str) -> None:
    for path, leaf in jax.tree.flatten_with_path(tree)[0]:
        if _is_key_array(leaf):
            raise ValueError(f"{argument}{jax.tree_util.keystr(path)} is a typed PRNG key; store "
                             f"jax.random.key_data(key) and rebuild it with "
                             f"jax.random.wrap_key_data")


def _to_savable(state: Any) -> Any:
    """Python and numpy scalars become 0-d numpy arrays (orbax stores arrays only)."""
    _reject_typed_keys(state, "state")
    return jax.tree.map(lambda x: np.asarray(x) if _is_host_value(x) else x, state)


def _default_sharding() -> jax.sharding.Sharding:
    if jax.process_count() > 1:
        raise ValueError("restoring a multi-process checkpoint needs explicit shardings (pass "
                         "shardings= or abstract_state leaves with .sharding)")
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class Checkpointer:
    """Saves and restores `(state pytree, JSON metadata)` per step in one directory.

    Args:
      directory: e.g. `checkpoint_dir(workdir, stage)`; created if missing. Must be the same path
        on every process (a shared filesystem or GCS on multi-host runs).
      max_to_keep: newest complete checkpoints kept; older ones are deleted after a save.
        None keeps all.
      async_save: write in a background thread; `save` returns once the arrays are copied off
        the accelerators, so the caller may donate or overwrite them right away.
      read_only: only look and restore (e.g. to check another stage's progress): nothing is
        created, cleaned up or saved.

    Every process must call `save`, `restore`, `wait` and `close` (orbax synchronises them).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 2,
                 async_save: bool = True, read_only: bool = False):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 (or None to keep all)")
        self.directory = _absolute(directory)
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.LatestN(n=max_to_keep),
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None) -> bool:
        """Starts saving `state` (pytree of jax/numpy arrays and scalars) and `metadata` at `step`.

        `metadata` must be JSON-serialisable (config as a dict, stage, data position, ...).
        Returns False, writing nothing, if `step` is already saved (a run resumed at its final
        step saves nothing new).
        """
        if self.read_only:
            raise ValueError(f"Checkpointer({self.directory!r}) is read_only; cannot save")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata is not JSON-serialisable: {err}") from None
        step = int(step)
        if step in self._manager.all_steps():
            return False
        return self._manager.save(
            step,
            args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardSave(_to_savable(state)),
                _METADATA: ocp.args.JsonSave(metadata),
            }),
            force=True,
        )

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending (waits for a save in flight)."""
        self.wait()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """Newest complete checkpoint, or None (waits for a save in flight)."""
        self.wait()
        return self._manager.latest_step()

    def restore(self, step: int | None = None, abstract_state: Any = None, shardings: Any = None
                ) -> tuple[Any, dict[str, Any]]:
        """Loads `(state, metadata)` of `step` (default: the latest complete one).

        Args:
          step: which checkpoint.
          abstract_state: pytree with the structure of the saved state whose leaves are
            ShapeDtypeStructs or arrays (e.g. `jax.eval_shape` of the state initialiser). Their
            `.sharding`, or `shardings`, says where each array goes; numpy and Python scalar
            leaves come back as the same host types. None restores the saved tree as it was
            written (arrays on the shardings they were saved with; same topology only).
          shardings: optional pytree of `jax.sharding.Sharding` matching `abstract_state`
            (None at host leaves), overriding the leaves' own shardings; this is how a
            checkpoint written on one mesh is restored onto another.

        Raises:
          FileNotFoundError: no complete checkpoint in the directory, or not `step`.
          ValueError: bad arguments.
        """
        self.wait()
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(f"no complete checkpoint for step={step} in {self.directory}; "
                                    f"available: {sorted(self._manager.all_steps())}")
        if abstract_state is None:
            if shardings is not None:
                raise ValueError("shardings needs abstract_state (the structure, shapes and "
                                 "dtypes of the saved state)")
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore(),
                _METADATA: ocp.args.JsonRestore(),
            }))
            return restored[_STATE], restored[_METADATA]
        _reject_typed_keys(abstract_state, "abstract_state")
        target = self._restore_target(abstract_state, shardings)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target),
            _METADATA: ocp.args.JsonRestore(),
        }))
        state = jax.tree.map(_like, abstract_state, restored[_STATE])
        return state, restored[_METADATA]

    @staticmethod
    def _restore_target(abstract_state: Any, shardings: Any) -> Any:
        treedef = jax.tree.structure(abstract_state)
        leaves = treedef.flatten_up_to(abstract_state)
        if shardings is None:
            sharding_leaves = [None] * len(leaves)
        else:
            try:
                sharding_leaves = treedef.flatten_up_to(shardings)
            except (ValueError, TypeError) as err:
                raise ValueError(f"shardings does not match the structure of abstract_state: "
                                 f"{err}") from None
        target = []
        for leaf, sharding in zip(leaves, sharding_leaves):
            if _is_host_value(leaf):
                target.append(np.zeros(np.shape(leaf), np.asarray(leaf).dtype))
                continue
            sharding = sharding or getattr(leaf, "sharding", None) or _default_sharding()
            target.append(jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding))
        return treedef.unflatten(target)

    def wait(self) -> None:
        """Blocks until a save in flight is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and deletions and releases resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _like(template: Any, value: Any) -> Any:
    """Restored host values take the template's type back (Python int stays int)."""
    if isinstance(template, np.generic):
        return template.dtype.type(value)
    if isinstance(template, bool):
        return bool(value)
    if isinstance(template, int):
        return int(value)
    if isinstance(template, float):
        return float(value)
    return value


# Elements of each base leaf that its fingerprint reads (evenly strided over the leaf).
FINGERPRINT_SAMPLES = 4096


def lora_identity(base) -> dict:
    """The identity of a LoRA stage's frozen base, saved in its checkpoints' metadata in its
    place: `{"hash": sha256 of every leaf's path, shape, dtype and the bytes of
    FINGERPRINT_SAMPLES evenly strided elements}` (the base's path is in the saved config).
    Reads a few KiB per leaf, so hashing a 27B base costs no more than a step; a merged SFT
    adapter changes every element of the kernels it targets, so any trained base differs."""
    import hashlib

    from marl_jax import distributed

    def sample(x):
        flat = x.reshape(-1)
        return flat[::max(1, flat.size // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]

    samples = distributed.global_to_host(jax.jit(lambda t: jax.tree.map(sample, t))(base))
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        picked = np.asarray(_get_path(samples, path))
        digest.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}{leaf.dtype}".encode())
        digest.update(np.ascontiguousarray(picked).tobytes())
    return {"hash": digest.hexdigest()}


def _get_path(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def check_same_base(saved: dict | None, metadata: dict, name: str) -> None:
    """One-line ValueError when a LoRA checkpoint's adapters were trained on another base than
    the one this run attaches them to, or (PPO with the SFT adapter kept apart from the base,
    `model.lora.merge_sft=False`) against another reference adapter (before anything is
    written)."""
    want, have = metadata or {}, saved or {}
    if "base" in want and "base" in have and want["base"] != have["base"]:
        raise ValueError(f"checkpoints/{name}: its adapters were trained on a base with hash "
                         f"{have['base']['hash'][:12]}, this run's base has hash "
                         f"{want['base']['hash'][:12]}; use the workdir's own base "
                         "(config.model.path) or a new workdir")
    if "reference" in want and "reference" in have and want["reference"] != have["reference"]:
        raise ValueError(f"checkpoints/{name}: its adapters were trained against the reference "
                         f"SFT adapter with hash {have['reference']['hash'][:12]}, this run's SFT "
                         f"adapter has hash {want['reference']['hash'][:12]} (the SFT stage "
                         "changed); use the SFT it was trained against or a new workdir")
