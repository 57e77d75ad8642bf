"""Device meshes, parameter sharding through logical axis names, and multi-host start-up.

The mesh has three axes: ``data``, ``fsdp`` and ``seq``. A batch's sequences are split over
``data`` and ``fsdp`` (``BATCH_AXES``), and each sequence's positions over ``seq`` (context
parallelism: device s of a ``seq`` group holds positions ``[s·n/P, (s+1)·n/P)`` of its sequences'
activations, and the attention layers exchange what the pattern needs, ``attention.context``;
``seq = 1``, the default, splits no sequence). Parameters and optimizer state are sharded over
``fsdp`` (fully-sharded data parallel: each device stores 1/fsdp of every large array and XLA
gathers a layer's weights when it runs) and replicated over ``data`` and ``seq``.
``mesh.fsdp = 1`` is plain data parallelism: the same code, with every array whole on every
device.

Every parameter's axes have logical names (``PARAM_AXES``, by the parameter's place in the
model: ``("embed", "mlp")`` for the first feed-forward kernel, ...), and ``RULES`` maps logical
names to mesh axes. The default shards the model width ``embed``, the one axis that every
weight matrix of the model has, so every large array is split evenly; the rest stay whole. The
embedding tables (token and position; small: 256 or ~sqrt(n) rows) name their width ``table``
and stay whole: a lookup into a table split along its width would split the activations
along the width too (XLA then replicates them to get back to the batch split). Optimizer
state (Adam's ``mu`` and ``nu``) mirrors the parameters' paths and takes the same shardings.

Multi-host: ``initialize_distributed`` wraps ``jax.distributed.initialize`` (cluster
auto-detection on SLURM, Open MPI, Kubernetes and Cloud TPU, or an explicit coordinator); then
``jax.devices()`` spans all hosts, each process feeds its own slice of every global batch
(``jax.make_array_from_process_local_data``) and the same jitted step runs everywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "seq")
BATCH_AXES = ("data", "fsdp")  # a batch's sequences are split over these
SEQ_AXIS = "seq"  # each sequence's positions over this (context parallelism)

# Logical axis names of each parameter, keyed by (module name, parameter name) as they appear
# at the end of the parameter's path. A leading "layers" axis is added for the stacked
# parameters of `scan_layers` models.
PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("token_embed", "embedding"): ("vocab", "table"),
    ("head", "kernel"): ("embed", "vocab"),
    ("head", "bias"): ("vocab",),
    ("query", "kernel"): ("embed", "qk"),
    ("query", "bias"): ("qk",),
    ("key", "kernel"): ("embed", "qk"),
    ("key", "bias"): ("qk",),
    ("value", "kernel"): ("embed", "heads"),
    ("value", "bias"): ("heads",),
    ("out", "kernel"): ("heads", "embed"),
    ("out", "bias"): ("embed",),
    ("ff_in", "kernel"): ("embed", "mlp"),
    ("ff_in", "bias"): ("mlp",),
    ("ff_out", "kernel"): ("mlp", "embed"),
    ("ff_out", "bias"): ("embed",),
    ("attn_norm", "scale"): ("norm",),
    ("attn_norm", "bias"): ("norm",),
    ("ff_norm", "scale"): ("norm",),
    ("ff_norm", "bias"): ("norm",),
    ("final_norm", "scale"): ("norm",),
    ("final_norm", "bias"): ("norm",),
}
# Position embeddings live in a list: (..., "pos_embeds", i, "embedding").
POSITION_AXES = ("position", "table")

# Logical axis -> mesh axis (absent: not sharded).
RULES: dict[str, str] = {"embed": "fsdp"}


def _names(path) -> list:
    """The keys of a jax tree path as plain strings / ints (the `.value` attribute access that
    ends the path of an nnx.Variable is dropped)."""
    out = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            out.append(entry.key)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            out.append(entry.idx)
        elif not isinstance(entry, jax.tree_util.GetAttrKey):
            out.append(str(entry))
    return out


def logical_axes(path, ndim: int) -> tuple[str, ...]:
    """Logical axis names of an array of rank `ndim` at `path` (a jax tree path, or a tuple of
    names such as ("blocks", 0, "ff_in", "kernel")): a parameter, or optimizer state that
    mirrors one. Scalars (step counts) get ()."""
    names = list(path) if all(isinstance(n, (str, int)) for n in path) else _names(path)
    if ndim == 0:
        return ()
    axes = None
    if len(names) >= 2 and (names[-2], names[-1]) in PARAM_AXES:
        axes = PARAM_AXES[names[-2], names[-1]]
    elif len(names) >= 3 and names[-3] == "pos_embeds" and names[-1] == "embedding":
        axes = POSITION_AXES
    where = "/".join(map(str, names))
    if axes is None:
        raise ValueError(f"no logical axis names for the array at {where} (rank {ndim}); add "
                         "its module and name to sparse_jax.sharding.PARAM_AXES")
    if ndim == len(axes) + 1:  # stacked over layers (scan_layers)
        axes = ("layers", *axes)
    if ndim != len(axes):
        raise ValueError(f"{where} has rank {ndim}, but its logical axes {axes} name {len(axes)}")
    return axes


def state_partition_specs(abstract_state, rules: Mapping[str, str] = RULES):
    """A PartitionSpec for every array of a (parameters / optimizer) state pytree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: P(*(rules.get(a) for a in logical_axes(path, len(x.shape)))),
        abstract_state)


def _checked_specs(abstract_state, mesh_shape: Mapping[str, int], rules: Mapping[str, str]):
    """The state's PartitionSpecs, after a ValueError naming the first array whose sharded
    axis does not split evenly over `mesh_shape`."""
    specs = state_partition_specs(abstract_state, rules)
    for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(abstract_state),
                               jax.tree.leaves(specs, is_leaf=_is_spec)):
        for dim, axis in zip(x.shape, spec):
            if axis is not None and dim % mesh_shape[axis]:
                raise ValueError(
                    f"{'/'.join(map(str, _names(path)))} of shape {tuple(x.shape)} cannot be split "
                    f"over mesh axis {axis!r} of size {mesh_shape[axis]} "
                    f"({dim} is not a multiple); "
                    f"choose mesh.fsdp dividing the model width")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, P)


def state_shardings(abstract_state, mesh: Mesh, rules: Mapping[str, str] = RULES):
    """NamedShardings for a state pytree on `mesh` (after checking that every split is even)."""
    specs = _checked_specs(abstract_state, dict(mesh.shape), rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def mesh_shape(devices: int, data: int, fsdp: int, seq: int = 1) -> dict[str, int]:
    """{"data": d, "fsdp": f, "seq": s} with d x f x s = devices; data = -1 takes what fsdp and
    seq leave."""
    for name, value in (("fsdp", fsdp), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh.{name} must be a positive integer, got {value!r}")
    if devices % (fsdp * seq):
        what = f"mesh.fsdp={fsdp}" if seq == 1 else f"mesh.fsdp={fsdp} x mesh.seq={seq}"
        raise ValueError(f"{what} does not divide the {devices} devices")
    data = devices // (fsdp * seq) if data == -1 else data
    if not isinstance(data, int) or data < 1 or data * fsdp * seq != devices:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x seq={seq} must equal the {devices} "
                         "devices (set mesh.data=-1 to use all devices the fsdp and seq axes "
                         "leave)")
    return {"data": data, "fsdp": fsdp, "seq": seq}


def make_mesh(data: int, fsdp: int, seq: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "seq") mesh over `devices` (default: all devices of all processes).
    ``seq`` is the last axis, so a sequence's shards sit on neighbouring devices (one host's,
    where ``seq`` divides its device count). With ``seq = 1`` the mesh has no seq axis: the
    ("data", "fsdp") mesh, whose programs are those of a run that never split a sequence."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(len(devices), data, fsdp, seq)
    axes = MESH_AXES if seq > 1 else BATCH_AXES
    return jax.make_mesh(tuple(shape[a] for a in axes), axes, devices=devices,
                         axis_types=(AxisType.Auto,) * len(axes))


def seq_size(mesh: Mesh) -> int:
    """Devices each sequence is split over (1: none)."""
    return dict(mesh.shape).get(SEQ_AXIS, 1)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a batch [B, n, ...] (tokens, or the activations [B, n, d]) lives: its sequences
    split over ``BATCH_AXES``, and their positions over ``seq`` when it has more than one
    device."""
    return NamedSharding(mesh, P(BATCH_AXES, SEQ_AXIS) if seq_size(mesh) > 1 else P(BATCH_AXES))


def per_device_bytes(abstract_state, mesh_shape: Mapping[str, int],
                     rules: Mapping[str, str] = RULES) -> int:
    """Bytes of `abstract_state` that one device stores on a mesh of `mesh_shape` (no devices
    needed: computed from shapes and the sharding rules)."""
    specs = _checked_specs(abstract_state, mesh_shape, rules)
    total = 0
    for x, spec in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(specs, is_leaf=_is_spec)):
        split = math.prod(mesh_shape[a] for a in spec if a is not None)
        total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize // split
    return total


def to_global(batch: dict, sharding) -> dict:
    """This process's rows of a batch ({name: array}) as global arrays split by `sharding` (each
    process passes its own rows; with one process, the whole batch)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_cpu_devices(count: int = -1) -> int | None:
    """Splits the host CPU into `count` JAX devices (-1: one per core); returns the count set,
    or None when it was left alone.

    XLA:CPU runs many of a training step's operations (small matmuls, batched matmuls,
    elementwise passes) on one core; on a mesh of one device per core, each core runs its own
    share of the batch, so a step uses every core (docs/benchmarks/training). It must be called
    before JAX starts its backends, and changes nothing on GPU/TPU (only the host platform is
    split) or when XLA_FLAGS already sets --xla_force_host_platform_device_count. If the
    backends have started, it does nothing."""
    if count == -1:
        count = cpu_cores()
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"--cpu_devices must be a positive integer or -1, got {count!r}")
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return None
    from jax._src import xla_bridge  # no public way to ask whether the backends have started

    if xla_bridge.backends_are_initialized():
        return None
    jax.config.update("jax_num_cpu_devices", count)
    return count


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           auto: bool = False) -> bool:
    """Joins a multi-process run; returns whether one was joined.

    With a coordinator address (argument or $JAX_COORDINATOR_ADDRESS), the process count and
    this process's id are required, unless a cluster launcher provides them. With `auto`, JAX
    detects the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU). Without either it does nothing
    (one process). On CPU, cross-process collectives use gloo.
    """
    named = "--coordinator_address"
    if not coordinator_address and os.environ.get("JAX_COORDINATOR_ADDRESS"):
        coordinator_address, named = os.environ["JAX_COORDINATOR_ADDRESS"], \
            "$JAX_COORDINATOR_ADDRESS"
    if not (auto or coordinator_address or num_processes or process_id is not None):
        return False
    if coordinator_address:
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{named}={coordinator_address!r} must be HOST:PORT (e.g. "
                             "10.0.0.1:1234), the address of process 0")
    if coordinator_address and not auto and (num_processes is None or process_id is None):
        raise ValueError(f"a coordinator address ({named}={coordinator_address}) needs "
                         "--num_processes and --process_id (or --jax_distributed to read them "
                         "from the cluster launcher)")
    if num_processes is not None and process_id is not None and \
            not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True


MAX_CPU_DEVICES = 1024  # the most devices a CPU is split into (--cpu_devices)


def check_distributed(cpu_devices: int, auto: bool, address: str | None,
                      num_processes: int | None, process_id: int | None) -> None:
    """ValueError (one line naming the flag) for values of `define_distributed_flags`' flags
    that no run takes, before any of them is used."""
    if cpu_devices != -1 and not 1 <= cpu_devices <= MAX_CPU_DEVICES:
        raise ValueError(f"--cpu_devices={cpu_devices}: give -1 (one device per core) or 1 to "
                         f"{MAX_CPU_DEVICES:,} devices")
    if address is not None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator_address={address!r} must be HOST:PORT (e.g. "
                             "10.0.0.1:1234), the address of process 0")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes={num_processes} must be a positive integer")
    if process_id is not None and process_id < 0:
        raise ValueError(f"--process_id={process_id} must be 0 or more (process 0 coordinates)")
    if (num_processes is not None or process_id is not None) and not auto and address is None \
            and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        given = "--num_processes" if num_processes is not None else "--process_id"
        raise ValueError(f"{given} is part of a multi-process run: give --coordinator_address "
                         "too (or --jax_distributed under a cluster launcher)")
    if address is not None and not auto and (num_processes is None or process_id is None):
        raise ValueError(f"--coordinator_address={address} needs --num_processes and "
                         "--process_id (or --jax_distributed to read them from the cluster "
                         "launcher)")
    if num_processes is not None and process_id is not None and \
            not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id={process_id} must be in [0, --num_processes="
                         f"{num_processes})")


def define_distributed_flags():
    """Defines the absl flags of the devices a script runs on (--cpu_devices) and of a
    multi-process run (--jax_distributed, --coordinator_address, --num_processes,
    --process_id), listed by the calling script's --help; returns a function that sets the CPU
    devices (`set_cpu_devices`) and joins the run they describe (`initialize_distributed`), to
    call in main() before anything touches a device. Its `check()` checks the flags' values
    (`check_distributed`) without either, for the script's check before any work; `joins()`
    says whether it will join a multi-process run."""
    import sys

    from absl import flags

    cpu = flags.DEFINE_integer("cpu_devices", -1, "Split the host CPU into this many JAX "
                               "devices (-1: one per core), so a step uses every core. No "
                               "effect on GPU/TPU.", lower_bound=-1,
                               upper_bound=MAX_CPU_DEVICES)

    auto = flags.DEFINE_bool("jax_distributed", False, "Join a multi-process run whose "
                             "coordinator, size and rank the cluster launcher provides (SLURM, "
                             "Open MPI, Kubernetes, Cloud TPU).")
    address = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 for a "
                                  "multi-process run (default: $JAX_COORDINATOR_ADDRESS).")
    count = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
    rank = flags.DEFINE_integer("process_id", None, "This process's rank, 0 .. N-1.")
    caller = sys._getframe(1).f_globals.get("__name__", "")
    caller = sys.argv[0] if caller == "__main__" else caller  # absl's name of a main module
    for holder in (cpu, auto, address, count, rank):  # the script's own: its --help lists them
        flags.FLAGS.register_key_flag_for_module(caller, flags.FLAGS[holder.name])

    def check():
        check_distributed(cpu.value, auto.value, address.value, count.value, rank.value)

    def joins() -> bool:
        return bool(auto.value or address.value or os.environ.get("JAX_COORDINATOR_ADDRESS")
                    or count.value is not None or rank.value is not None)

    def start():
        check()
        set_cpu_devices(cpu.value)
        return initialize_distributed(address.value, count.value, rank.value, auto=auto.value)

    start.check, start.joins = check, joins
    return start
