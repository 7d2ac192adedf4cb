"""Device mesh, logical-axis sharding rules, and shardings for params, batches and optimizer states.

The mesh always has the axes ("data", "fsdp", "tensor"). Parameters and activations are annotated
with logical axis names (see `LOGICAL_RULES`); the rules map them onto mesh axes, MaxText-style. A
dimension that a mesh axis does not divide evenly stays replicated, so any model runs on any mesh.

Typical use in a trainer::

    mesh = make_mesh(config.mesh)
    validate_batch(config.ppo.batch_size, mesh, "config.ppo.batch_size")
    param_shardings = logical_to_sharding(logical_axes(model), mesh, shapes=abstract_params)
    opt_shardings = opt_state_shardings(optimizer, param_shardings, mesh, params=abstract_params)
    step = jax.jit(train_step, in_shardings=(param_shardings, opt_shardings, batch_sharding(mesh)),
                   out_shardings=(param_shardings, opt_shardings, replicated(mesh)),
                   donate_argnums=(0, 1))
    with mesh_context(mesh, logical_rules(mesh, dims={"heads": 9, "kv_heads": 3})):
        params, opt_state, metrics = step(params, opt_state, batch)
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (logical name, mesh axis or tuple of mesh axes or None), in order of precedence.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters.
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # LoRA's B [r, out...] where the kernel's output axes are not fsdp-sharded.
    ("lora_rank", "fsdp"),
    # The stacked-layer axis of scanned params: each scan step reads one whole layer.
    ("layers", None),
    # Activations.
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

_ACTIVATION_PREFIX = "activation_"


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _mesh_field(mesh_config: Any, field: str, name: str) -> int:
    missing = f"{name}.{field} is missing (expected an int, -1 = all remaining devices)"
    if isinstance(mesh_config, Mapping):
        if field not in mesh_config:
            raise ValueError(missing)
        value = mesh_config[field]
    else:
        try:
            value = getattr(mesh_config, field)
        except AttributeError:
            raise ValueError(missing) from None
    if not _is_int(value):
        raise ValueError(f"{name}.{field}={value!r} must be an int (-1 = all remaining devices)")
    value = int(value)
    if value == 0 or value < -1:
        raise ValueError(
            f"{name}.{field}={value} must be a positive int or -1 (all remaining devices)")
    return value


def validate_mesh(mesh_config: Any, num_devices: int, *, name: str = "config.mesh"
                  ) -> tuple[int, int, int]:
    """Checks a mesh config against a device count and resolves the -1 field.

    Args:
      mesh_config: ConfigDict, mapping or object with int fields `data`, `fsdp`, `tensor`; at most
        one of them may be -1, meaning "all remaining devices".
      num_devices: number of devices the mesh must cover exactly.
      name: how the config is called in error messages.

    Returns:
      (data, fsdp, tensor) with the product equal to `num_devices`.

    Raises:
      ValueError: naming the offending field, e.g. "config.mesh.fsdp=3 does not divide 8 devices".
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be positive")
    sizes = {field: _mesh_field(mesh_config, field, name) for field in MESH_AXES}
    inferred = [field for field, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(f"{name}: only one of data, fsdp, tensor may be -1, got "
                         + ", ".join(f"{name}.{f}=-1" for f in inferred))
    for field, size in sizes.items():
        if size != -1 and num_devices % size:
            raise ValueError(f"{name}.{field}={size} does not divide {num_devices} devices")
    fixed = {field: size for field, size in sizes.items() if size != -1}
    product = math.prod(fixed.values())
    described = " * ".join(f"{name}.{f}={s}" for f, s in fixed.items())
    if inferred:
        if num_devices % product:
            raise ValueError(f"{described} = {product} does not divide {num_devices} devices")
        sizes[inferred[0]] = num_devices // product
    elif product != num_devices:
        raise ValueError(f"{described} = {product} devices, but there are {num_devices}; "
                         f"set one field to -1 to use all remaining devices")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_config: Any, devices: Sequence[jax.Device] | None = None, *,
              name: str = "config.mesh") -> Mesh:
    """Builds a ("data", "fsdp", "tensor") mesh over `devices` (default: all devices).

    Axes are `AxisType.Auto` (GSPMD propagation with `with_sharding_constraint`). On one slice
    the device order comes from `jax.make_mesh`, which follows the physical topology on TPU.
    When the devices span several slices (TPU multi-slice, joined by the data-centre network),
    `data` is split across the slices and `fsdp` / `tensor` stay inside each slice, so only the
    data-parallel gradient reduction crosses the slower network (see `hybrid_device_grid`).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = validate_mesh(mesh_config, len(devices), name=name)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    grid = hybrid_device_grid(shape, devices, name=name)
    if grid is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def num_slices(devices: Sequence[Any]) -> int:
    """Number of distinct `slice_index` values among `devices` (1 where devices have none)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def hybrid_device_grid(shape: Sequence[int], devices: Sequence[Any], *,
                       name: str = "config.mesh") -> np.ndarray | None:
    """The `[data, fsdp, tensor]` device array of a multi-slice mesh; None on a single slice.

    `data` is split as (slices) x (data / slices): `data` index i lies in slice
    i // (data / slices), and each slice holds the whole `fsdp x tensor` block for its data
    indices, laid out over its own interconnect (`mesh_utils.create_hybrid_device_mesh`).

    Raises:
      ValueError: `data` is not a multiple of the number of slices.
    """
    slices = num_slices(devices)
    if slices == 1:
        return None
    data, fsdp, tensor = (int(x) for x in shape)
    if data % slices:
        raise ValueError(
            f"{name}.data={data} must be a multiple of the {slices} slices: on a multi-slice "
            f"run `data` spans the slices (set {name}.data=-1 or a multiple of {slices}, and "
            f"size fsdp / tensor to fit inside one slice)")
    from jax.experimental import mesh_utils

    return mesh_utils.create_hybrid_device_mesh(
        (data // slices, fsdp, tensor), (slices, 1, 1), devices,
        allow_split_physical_axes=True)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of shards of the batch dimension: data * fsdp."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def validate_batch(batch_size: int, mesh: Mesh, name: str) -> None:
    """Raises ValueError unless `batch_size` splits evenly over the data-parallel shards."""
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"{name}={batch_size!r} must be a positive int")
    shards = data_parallel_size(mesh)
    if batch_size % shards:
        raise ValueError(f"{name}={batch_size} is not divisible by the {shards} data-parallel "
                         f"shards (data*fsdp)")


def _as_axes(mesh_axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def _divisible_prefix(axes: tuple[str, ...], mesh: Mesh, size: int | None) -> tuple[str, ...]:
    """Longest prefix of `axes` whose mesh sizes multiply to a divisor of `size`."""
    if size is None:
        return axes
    kept = []
    for axis in axes:
        if size % math.prod(mesh.shape[a] for a in (*kept, axis)):
            break
        kept.append(axis)
    return tuple(kept)


def _spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _check_rules(rules: Rules, mesh: Mesh) -> None:
    for logical, mesh_axes in rules:
        for axis in _as_axes(mesh_axes):
            if axis not in mesh.shape:
                raise ValueError(f"logical axis rule {logical!r} -> {mesh_axes!r} names mesh axis "
                                 f"{axis!r}; the mesh has {tuple(mesh.shape)}")


def logical_to_mesh_spec(logical_spec: PartitionSpec | Sequence[str | None] | None, mesh: Mesh,
                         shape: Sequence[int] | None = None, rules: Rules = LOGICAL_RULES
                         ) -> PartitionSpec:
    """Maps one spec of logical names (one per array dimension) to a spec of mesh axes.

    A dimension is replicated when its logical name maps to None, when the mesh axis is already
    used by an earlier dimension, or when `shape` is given and the axis size does not divide it
    (for a tuple of mesh axes, the longest dividing prefix is kept).

    Raises:
      ValueError: for a logical name without a rule, or a spec longer than the array rank.
    """
    _check_rules(rules, mesh)
    names = tuple(logical_spec) if logical_spec is not None else ()
    if shape is not None and len(names) > len(shape):
        raise ValueError(f"logical spec {names} has {len(names)} entries for an array of shape "
                         f"{tuple(shape)}")
    known = {logical for logical, _ in rules}
    used: set[str] = set()
    entries = []
    for dim, logical in enumerate(names):
        if logical is None:
            entries.append(None)
            continue
        if not isinstance(logical, str):
            raise ValueError(f"logical spec {names}: entry {dim} must be a logical name or None, "
                             f"got {logical!r}")
        if logical not in known:
            raise ValueError(f"logical axis name {logical!r} has no rule; known names: "
                             f"{sorted(known)}")
        size = None if shape is None else int(shape[dim])
        chosen: tuple[str, ...] = ()
        for rule_logical, mesh_axes in rules:
            if rule_logical != logical:
                continue
            axes = _as_axes(mesh_axes)
            if used.intersection(axes):
                continue
            chosen = _divisible_prefix(axes, mesh, size)
            break
        used.update(chosen)
        entries.append(_spec_entry(chosen))
    return PartitionSpec(*entries)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def logical_to_sharding(logical_tree: Any, mesh: Mesh, shapes: Any = None,
                        rules: Rules = LOGICAL_RULES) -> Any:
    """Pytree of logical PartitionSpecs -> pytree of NamedSharding on `mesh`.

    Args:
      logical_tree: pytree whose leaves are PartitionSpecs of logical names (None = replicated),
        e.g. `models.logical_axes(model)` or `nn.get_partition_spec(boxed_variables)`.
      mesh: the device mesh.
      shapes: optional pytree with the same structure whose leaves have `.shape` (arrays or
        ShapeDtypeStructs); used to replicate dimensions the mesh axes do not divide.
      rules: logical-name -> mesh-axes rules.
    """
    if shapes is None:
        return jax.tree.map(
            lambda spec: NamedSharding(mesh, logical_to_mesh_spec(spec, mesh, None, rules)),
            logical_tree, is_leaf=_is_spec_leaf)
    treedef = jax.tree.structure(logical_tree, is_leaf=_is_spec_leaf)
    try:
        shape_leaves = treedef.flatten_up_to(shapes)
    except (ValueError, TypeError) as err:
        raise ValueError(f"shapes does not match the structure of logical_tree: {err}") from None
    specs = treedef.flatten_up_to(logical_tree)
    shardings = [NamedSharding(mesh, logical_to_mesh_spec(spec, mesh, np.shape(leaf), rules))
                 for spec, leaf in zip(specs, shape_leaves)]
    return treedef.unflatten(shardings)


def logical_rules(mesh: Mesh, dims: Mapping[str, int] | None = None, rules: Rules = LOGICAL_RULES
                  ) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Rules for `mesh_context`, with mesh axes dropped where they do not divide a known size.

    Activation constraints inside a model (`nn.with_logical_constraint`) see only names, not
    sizes, so sizes that may not divide the mesh (heads, kv_heads, vocab, ...) are given here.

    Args:
      mesh: the device mesh.
      dims: logical name -> dimension size. "activation_X" without its own entry uses the size of
        "X" (e.g. dims={"kv_heads": 2} also covers "activation_kv_heads").
      rules: the rules to adapt.
    """
    _check_rules(rules, mesh)
    dims = dict(dims or {})
    adapted = []
    for logical, mesh_axes in rules:
        size = dims.get(logical)
        if size is None and logical.startswith(_ACTIVATION_PREFIX):
            size = dims.get(logical[len(_ACTIVATION_PREFIX):])
        adapted.append((logical, _spec_entry(_divisible_prefix(_as_axes(mesh_axes), mesh, size))))
    return tuple(adapted)


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Iterator[Mesh]:
    """Makes `mesh` the current mesh and `rules` the logical axis rules.

    Inside, `nn.with_logical_constraint` in a model traced by `jax.jit` becomes a sharding
    constraint on `mesh` (outside, flax treats it as a no-op). Enter it around the first call of
    a jitted step (tracing) and its later calls.
    """
    _check_rules(rules, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(tuple(rules)):
        yield mesh


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, *, axis: int = 0) -> NamedSharding:
    """Axis `axis` (the batch) split over ("data", "fsdp"); other axes replicated.

    `axis=1` is the batch of run-stacked arrays `[runs, B, ...]` (vmapped experiments).
    """
    return NamedSharding(mesh, PartitionSpec(*((None,) * axis), BATCH_AXES))


def shard_pytree(tree: Any, shardings: Any) -> Any:
    """Places every leaf of `tree` with the matching sharding (one sharding or a matching pytree).

    The values must be the same on every process (parameters, optimizer states); per-process
    slices of a global batch go through `shard_batch`.
    """
    return jax.device_put(tree, shardings)


def shard_batch(batch: Any, mesh: Mesh, *, axis: int = 0) -> Any:
    """Builds global batch arrays `[B, ...]` from this process's rows.

    This process passes the rows `batches.process_rows(indices, batch_sharding(mesh))` picks (all
    of them with one process; `B / num_processes` when every process holds its own shards of the
    batch). With `axis=1` the arrays are `[runs, B_local, ...]` and the batch is axis 1.
    """
    sharding = batch_sharding(mesh, axis=axis)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        batch)


def put_global(tree: Any, mesh: Mesh, *, axis: int | None = 0) -> Any:
    """Whole host arrays, the same on every process -> global arrays on `mesh`.

    Axis `axis` is split over ("data", "fsdp") where the shard count divides it, otherwise (and
    with `axis=None`) the array is replicated. Every process supplies only its own devices' shards, so this is how
    host data that all processes hold (held-out prompts, hyper-parameters, keys) enters a jitted
    computation over a multi-process mesh, where plain numpy arguments cannot.
    """
    shards = data_parallel_size(mesh)

    def place(x):
        x = np.asarray(x)
        split = axis is not None and x.ndim > axis and x.shape[axis] % shards == 0
        sharding = batch_sharding(mesh, axis=axis) if split else replicated(mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, tree)


def _path_key(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(entry) for entry in path)


def opt_state_shardings(optimizer: Any, params_shardings: Any, mesh: Mesh, *, params: Any) -> Any:
    """Shardings for `optimizer.init(params)`: each state leaf mirroring a param gets its sharding.

    A state leaf mirrors a param when the param's key path is a suffix of the leaf's key path (as
    in `mu['dense']['kernel']` for `params['dense']['kernel']`) and the shapes are equal. Other
    leaves (step counts, factored statistics of a different shape) are replicated.

    Args:
      optimizer: an optax GradientTransformation (anything with `.init(params)`).
      params_shardings: pytree of shardings with the structure of `params`.
      mesh: the device mesh (for the replicated leaves).
      params: the params or their `jax.eval_shape` (only shapes and dtypes are used).
    """
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    treedef = jax.tree.structure(abstract_params)
    try:
        sharding_leaves = treedef.flatten_up_to(params_shardings)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"params_shardings does not match the structure of params: {err}") from None
    by_path = {
        _path_key(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(jax.tree.flatten_with_path(abstract_params)[0],
                                          sharding_leaves)
    }
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)
    fallback = replicated(mesh)

    def sharding_for(path, leaf):
        key = _path_key(path)
        for start in range(len(key) + 1):
            match = by_path.get(key[start:])
            if match is not None and tuple(match[0]) == tuple(leaf.shape):
                return match[1]
        return fallback

    return jax.tree.map_with_path(sharding_for, abstract_state)
