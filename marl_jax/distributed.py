"""Multi-process JAX: start the distributed runtime once, and move batches between hosts and meshes.

One JAX process runs per host (a Cloud TPU VM worker, a GPU node, or several CPU processes on one
machine). Every process runs the same program; each loads only its own rows of a global batch,
`host_local_to_global` assembles them into one array sharded over the global mesh, and
`global_to_host_local` reads each process's rows of a result back.

    distributed.initialize(config.distributed)     # before anything touches a JAX device
    mesh = sharding.make_mesh(config.mesh)         # over all devices of all processes
    rows = distributed.local_batch_slice(batch_size, sharding=sharding.batch_sharding(mesh))
    batch = distributed.host_local_to_global(load(rows), mesh, PartitionSpec(("data", "fsdp")))
    scores = distributed.global_to_host(step(batch))  # whole arrays on every process

`config.distributed` has three fields:
  coordinator    "HOST:PORT" of process 0, "" = automatic (Cloud TPU VM slices and multi-slice)
  num_processes  total number of processes, 0 = automatic
  process_id     this process, 0 .. num_processes - 1, -1 = automatic
Automatic mode initialises only on a multi-host Cloud TPU job; on a single host (one TPU VM, a
GPU box, a laptop) it does nothing. GPU clusters and CPU processes pass all three explicitly.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_NAME = "config.distributed"
_METADATA_URL = "http://{host}/computeMetadata/v1/instance/attributes/{key}"
_METADATA_TIMEOUT_S = 10.0

MetadataReader = Callable[[str], "str | None"]


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Validated `config.distributed`; empty coordinator = automatic."""

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1

    @property
    def explicit(self) -> bool:
        return bool(self.coordinator)


_FIELDS = tuple(field.name for field in dataclasses.fields(DistributedSettings))
_initialized: DistributedSettings | None = None
_multi_process = False


def _as_dict(distributed_config: Any) -> dict[str, Any]:
    if distributed_config is None:
        return {}
    if hasattr(distributed_config, "to_dict"):
        return dict(distributed_config.to_dict())
    if isinstance(distributed_config, Mapping):
        return dict(distributed_config)
    raise TypeError(f"{_NAME} must be an ml_collections ConfigDict or a mapping with "
                    f"{', '.join(_FIELDS)}; got {type(distributed_config).__name__}")


def _int_field(values: dict[str, Any], field: str, default: int, minimum: int, meaning: str) -> int:
    value = values.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{_NAME}.{field}={value!r} must be an int >= {minimum} ({meaning})")
    return int(value)


def _check_coordinator(coordinator: Any) -> str:
    if not isinstance(coordinator, str):
        raise ValueError(f"{_NAME}.coordinator={coordinator!r} must be a string 'HOST:PORT' "
                         f"('' = automatic)")
    if not coordinator:
        return coordinator
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{_NAME}.coordinator={coordinator!r} must look like 'HOST:PORT' "
                         f"(the address of process 0 and a free port, e.g. '10.0.0.2:8476')")
    return coordinator


def parse_settings(distributed_config: Any = None) -> DistributedSettings:
    """Validates `config.distributed` (ConfigDict, mapping or None = all automatic).

    Raises:
      ValueError: an unknown field, a wrong type, or a partial explicit setting; the message
        names the field, e.g. "config.distributed.process_id=2 must be in [0, 2)".
    """
    values = _as_dict(distributed_config)
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{_NAME} has unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(_FIELDS)}")
    coordinator = _check_coordinator(values.get("coordinator", ""))
    num_processes = _int_field(values, "num_processes", 0, 0, "0 = automatic")
    process_id = _int_field(values, "process_id", -1, -1, "-1 = automatic")
    if not coordinator:
        if num_processes or process_id != -1:
            raise ValueError(
                f"{_NAME}.coordinator is empty but {_NAME}.num_processes={num_processes} and "
                f"{_NAME}.process_id={process_id} are set: give all three (coordinator "
                f"'HOST:PORT' of process 0) or none (automatic)")
        return DistributedSettings()
    if num_processes < 1:
        raise ValueError(f"{_NAME}.num_processes={num_processes} must be >= 1 when "
                         f"{_NAME}.coordinator={coordinator!r} is set")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{_NAME}.process_id={process_id} must be in [0, {num_processes}) when "
                         f"{_NAME}.coordinator={coordinator!r} is set")
    return DistributedSettings(coordinator, num_processes, process_id)


# Cloud TPU chips on the PCI bus: Google's vendor id and the device ids of TPU v2/v3, v4, v5p, v5e,
# v6e and TPU7x (the table JAX's TPU backend scans to decide that it runs on a TPU VM), so that a
# Google network card (gVNIC) is not taken for a TPU.
_GOOGLE_PCI_VENDOR_ID = "0x1ae0"
_TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def _local_tpu_chip_count(pci_devices: str = "/sys/bus/pci/devices") -> int:
    """TPU chips attached to this machine, counted on the PCI bus (0 where there is none)."""
    count = 0
    for device in pathlib.Path(pci_devices).glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            device_id = (device / "device").read_text().strip()
        except OSError:
            continue
        count += vendor == _GOOGLE_PCI_VENDOR_ID and device_id in _TPU_PCI_DEVICE_IDS
    return count


def _read_gce_metadata(key: str) -> str | None:
    """One instance attribute from the GCE metadata server; None if the attribute is absent."""
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(_METADATA_URL.format(host=host, key=key),
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=_METADATA_TIMEOUT_S) as response:
            return response.read().decode()
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise RuntimeError(f"TPU metadata attribute {key!r}: HTTP {err.code}; set "
                           f"{_NAME}.coordinator, num_processes and process_id explicitly") from err
    except OSError as err:
        raise RuntimeError(f"cannot reach the TPU metadata server for {key!r} ({err}); set "
                           f"{_NAME}.coordinator, num_processes and process_id explicitly") from err


def _tpu_env_value(key: str, environ: Mapping[str, str], metadata: MetadataReader | None
                   ) -> str | None:
    """A TPU runtime variable from the environment, else from the `tpu-env` metadata attribute."""
    if key in environ:
        return environ[key]
    if metadata is None:
        return None
    for line in (metadata("tpu-env") or "").splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip().strip("'\"")
    return None


def tpu_process_count(environ: Mapping[str, str] | None = None, *, tpu_chips: int | None = None,
                      metadata: MetadataReader | None = _read_gce_metadata) -> int:
    """Number of hosts (one JAX process each) in this Cloud TPU job; 1 off Cloud TPU VMs.

    Hosts per slice come from TPU_PROCESS_ADDRESSES / TPU_WORKER_HOSTNAMES (GKE) or the
    `worker-network-endpoints` metadata attribute (TPU VMs); slices from MEGASCALE_NUM_SLICES
    (environment, else the `tpu-env` metadata attribute on TPU VMs).

    Args:
      environ: environment variables (default `os.environ`).
      tpu_chips: TPU chips attached to this machine (default: scanned on the PCI bus).
      metadata: reads one GCE instance attribute (None if absent); None = no metadata server.
    """
    environ = os.environ if environ is None else environ
    chips = _local_tpu_chip_count() if tpu_chips is None else tpu_chips
    if chips == 0:
        return 1
    if environ.get("TPU_SKIP_MDS_QUERY") is not None:
        metadata = None
    hostnames = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
    if hostnames is not None:
        # GKE sets every TPU variable in the environment; its metadata server knows none of them.
        metadata = None
    elif metadata is not None:
        hostnames = metadata("worker-network-endpoints")
    hosts = len([host for host in (hostnames or "").split(",") if host.strip()]) or 1
    slices = _tpu_env_value("MEGASCALE_NUM_SLICES", environ, metadata)
    return hosts * (int(slices) if slices else 1)


def initialize(distributed_config: Any = None, *, initialization_timeout: int = 300) -> bool:
    """Starts the JAX distributed runtime when this run spans several processes.

    Call it first, before anything touches a JAX device. Calling it again with the same (or the
    automatic) settings does nothing.

    Args:
      distributed_config: `config.distributed` (see the module docstring), or None = automatic.
      initialization_timeout: seconds to wait for all processes to connect.

    Returns:
      True if this process is one of several (the runtime is initialised), False otherwise.

    Raises:
      ValueError: invalid `config.distributed` (see `parse_settings`).
      RuntimeError: JAX already ran a computation in this process, or a second call asks for
        different explicit settings.
    """
    global _initialized, _multi_process
    settings = parse_settings(distributed_config)
    if _initialized is not None:
        if settings.explicit and settings != _initialized:
            raise RuntimeError(f"JAX distributed is already initialised with {_initialized}; "
                               f"cannot re-initialise with {settings}")
        return _multi_process
    if jax.distributed.is_initialized():
        _initialized, _multi_process = settings, True
        return True
    if settings.explicit:
        # CPU arrays of different processes talk through gloo (JAX's TCP collectives); without it
        # cross-process computations on the CPU backend fail.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _start(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
               process_id=settings.process_id, initialization_timeout=initialization_timeout)
        multi = settings.num_processes > 1
    else:
        count = tpu_process_count()
        multi = count > 1
        if multi:
            _start(initialization_timeout=initialization_timeout)
            if jax.process_count() != count:
                logging.warning("TPU metadata lists %d hosts, JAX found %d processes", count,
                                jax.process_count())
    _initialized, _multi_process = settings, multi
    if multi:
        logging.info("JAX distributed: process %d of %d, %d local / %d global devices",
                     jax.process_index(), jax.process_count(), jax.local_device_count(),
                     jax.device_count())
    return multi


def _start(**kwargs: Any) -> None:
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as err:
        if "must be called before" in str(err):
            raise RuntimeError("marl_jax.distributed.initialize must run before any JAX "
                               "computation or device query in this process") from err
        raise


def process_index() -> int:
    """This process, 0 .. process_count() - 1."""
    return jax.process_index()


def process_count() -> int:
    """Number of JAX processes (hosts) in the run."""
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0, which writes metrics, logs and metadata."""
    return jax.process_index() == 0


def _leading_dim_sharding(sharding: NamedSharding) -> NamedSharding:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding must be a NamedSharding, got {type(sharding).__name__}")
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if spec else None))


def _check_batch_size(global_batch_size: Any) -> None:
    if (isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer))
            or global_batch_size < 1):
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive int")


def local_batch_slice(global_batch_size: int, *, sharding: NamedSharding | None = None) -> slice:
    """Rows of a global batch `[global_batch_size, ...]` that this process loads.

    Without `sharding`: contiguous equal blocks in process order (process p gets rows
    [p * B / P, (p + 1) * B / P)). With `sharding` (the batch's NamedSharding): exactly the rows
    whose shards live on this process's devices, which `host_local_to_global` expects.

    Raises:
      ValueError: `global_batch_size` does not split evenly, or the mesh does not give this
        process one contiguous block of rows.
    """
    _check_batch_size(global_batch_size)
    global_batch_size = int(global_batch_size)
    if sharding is None:
        count, index = jax.process_count(), jax.process_index()
        if global_batch_size % count:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the "
                             f"{count} processes")
        per_process = global_batch_size // count
        return slice(index * per_process, (index + 1) * per_process)
    rows = local_batch_rows(global_batch_size, sharding)
    if rows[-1] - rows[0] + 1 != len(rows):
        raise ValueError(f"the mesh gives process {jax.process_index()} batch rows that are not "
                         f"one contiguous block; order the mesh devices by process")
    return slice(int(rows[0]), int(rows[-1]) + 1)


def local_batch_rows(global_batch_size: int, sharding: NamedSharding) -> np.ndarray:
    """Indices `[B_local]` (ascending) of the rows of a global batch on this process's devices.

    Unlike `local_batch_slice` the rows need not be one contiguous block (a mesh laid out by the
    physical topology can interleave processes); `jax.make_array_from_process_local_data` maps
    them back in this order.

    Raises:
      ValueError: `global_batch_size` does not split evenly over the batch shards.
    """
    _check_batch_size(global_batch_size)
    leading = _leading_dim_sharding(sharding)
    axes = leading.spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = int(np.prod([leading.mesh.shape[axis] for axis in axes]))
    if global_batch_size % shards:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the "
                         f"{shards} batch shards of {sharding.spec}")
    return _addressable_indices(leading, (int(global_batch_size),))[0]


def _addressable_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
                         ) -> list[np.ndarray]:
    """Per dimension, the sorted global indices held by this process's devices."""
    bounds: list[set[tuple[int, int]]] = [set() for _ in shape]
    for index in sharding.addressable_devices_indices_map(shape).values():
        for dim, (size, part) in enumerate(zip(shape, index)):
            bounds[dim].add(part.indices(size)[:2])
    return [np.unique(np.concatenate([np.arange(start, stop) for start, stop in dim_bounds]))
            for dim_bounds in bounds]


def _as_sharding_tree(tree: Any, mesh: Mesh, pspec: Any) -> Any:
    """One PartitionSpec for every leaf, or a pytree of them matching `tree`."""
    if isinstance(pspec, PartitionSpec):
        return jax.tree.map(lambda _: NamedSharding(mesh, pspec), tree)
    treedef = jax.tree.structure(tree)
    try:
        specs = treedef.flatten_up_to(pspec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"pspec must be a PartitionSpec or a pytree of them matching the data: "
                         f"{err}") from None
    return treedef.unflatten([NamedSharding(mesh, spec) for spec in specs])


def host_local_to_global(local_array_tree: Any, mesh: Mesh, pspec: Any) -> Any:
    """This process's rows -> global arrays sharded over `mesh`.

    Each leaf holds, along every sharded dimension, the indices this process's devices own, in
    order (rows `local_batch_slice(B, sharding=...)` of a batch sharded on its leading axis);
    along replicated dimensions it holds everything, identical on every process.

    Args:
      local_array_tree: pytree of numpy (or host-convertible) arrays, e.g. `[B / P, T]`.
      mesh: the global mesh over all processes' devices.
      pspec: a PartitionSpec for every leaf, or a pytree of them.

    Returns:
      Pytree of `jax.Array`s of the global shape, e.g. `[B, T]`.
    """
    shardings = _as_sharding_tree(local_array_tree, mesh, pspec)
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
                        local_array_tree, shardings)


def _host_local(array: Any) -> np.ndarray:
    if not isinstance(array, jax.Array):
        return np.asarray(array)
    indices = _addressable_indices(array.sharding, array.shape)
    position = [np.searchsorted(dim_indices, np.arange(size))
                for dim_indices, size in zip(indices, array.shape)]
    local = np.empty(tuple(len(dim_indices) for dim_indices in indices), dtype=array.dtype)
    written = set()
    for shard in array.addressable_shards:
        bounds = tuple(part.indices(size)[:2] for part, size in zip(shard.index, array.shape))
        if bounds in written:
            continue
        written.add(bounds)
        target = tuple(slice(int(pos[start]), int(pos[start]) + stop - start)
                       for pos, (start, stop) in zip(position, bounds))
        local[target] = np.asarray(shard.data)
    return local


def global_to_host_local(global_array_tree: Any) -> Any:
    """Global arrays -> this process's part of each, as numpy (the inverse of `host_local_to_global`).

    Along every dimension a leaf keeps the indices this process's devices hold, in order: the
    process's rows of a batch-sharded result, or the whole of a replicated one.
    """
    return jax.tree.map(_host_local, global_array_tree)


def _whole(array: Any) -> np.ndarray:
    if not isinstance(array, jax.Array):
        return np.asarray(array)
    if array.is_fully_addressable:
        return np.asarray(array)
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def global_to_host(global_array_tree: Any) -> Any:
    """Global arrays -> whole numpy arrays, the same on every process.

    Every process must call it with the same tree: leaves sharded over several processes are
    gathered (one leaf at a time, so the transient device memory is one leaf replicated);
    replicated and process-local leaves are read locally. With one process it is
    `jax.device_get`.
    """
    return jax.tree.map(_whole, global_array_tree)


def main_process_value(value: bool | int | float) -> bool | int | float:
    """Process 0's `value` on every process (a no-op with one process).

    For decisions read from the shared workdir that decide whether a collective runs (a file
    written by process 0, an existing export): all processes must take the same branch.
    """
    if jax.process_count() == 1:
        return value
    as_array = np.asarray(int(value) if isinstance(value, (bool, np.bool_)) else value)
    agreed = multihost_utils.broadcast_one_to_all(as_array)
    return type(value)(np.asarray(agreed).item())


def sync(name: str) -> None:
    """Blocks until every process reaches `sync(name)` (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
