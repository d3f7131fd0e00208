"""The data-parallel world: which data-parallel rank this process is, and how many there are.

Every part of lit_balance that shards data or sums over ranks asks :func:`data_parallel_world` and nothing else: the
DataModule (which column of the plan a rank trains), the sampler's defaults, the token-weighted loss (its divisor and
gradient scale), the metrics and the callbacks (what they gather). "World" here means the ranks that hold different
data (``num_replicas`` in PyTorch's ``DistributedSampler``, ``dp_world_size`` in torchtitan, the data-parallel group
in Megatron); under plain DDP it is every process, under tensor parallelism the processes of one replica share one
data-parallel rank and receive the same micro-batches.

Where the answer comes from:

* a Lightning ``Trainer`` or a Fabric object: its strategy's ``distributed_sampler_kwargs`` (``num_replicas``,
  ``rank``; what Lightning gives ``DistributedSampler``), checked against the global world; when the data-parallel
  ranks are fewer than the processes, the strategy's ``device_mesh`` must have a ``data_parallel`` dimension
  (``ModelParallelStrategy``'s), whose process group the collectives use;
* a ``torch.distributed`` device mesh or process group (a torchrun loop without Lightning);
* else the initialised default process group (every process), else one rank.

A strategy whose data-parallel world cannot be known that way is refused (:func:`data_parallel_world` raises).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lit_balance._checks import check_int
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["DATA_PARALLEL_MESH_DIMS", "DataParallelWorld", "check_defaulted_world", "data_parallel_world",
           "process_group_world", "resolve_world"]

#: Names of a device mesh's data-parallel dimension that :func:`data_parallel_world` recognises, in order:
#: Lightning's ``ModelParallelStrategy`` (``"data_parallel"``) and torchtitan (``"dp"``).
DATA_PARALLEL_MESH_DIMS = ("data_parallel", "dp")


@dataclass(frozen=True)
class DataParallelWorld:
    """This process's data-parallel rank, the number of data-parallel ranks, and collectives over them.

    Collectives take a small tensor, move it to the device the strategy communicates on, and return a CPU tensor;
    with one rank they return a copy without communicating. Every data-parallel rank must call them alike (with a
    ``process_group``, only the processes of that group; the other groups call them on theirs).

    Attributes:
        rank: this process's data-parallel rank, in ``[0, num_replicas)``.
        num_replicas: the number of data-parallel ranks (>= 1).
        strategy: the Lightning or Fabric strategy (``trainer.strategy``) whose collectives are used when there is no
            ``process_group``, or ``None``: then ``torch.distributed`` collectives.
        process_group: the ``torch.distributed`` process group of the data-parallel ranks this process belongs to,
            when they are not every process (tensor parallelism: the mesh's ``data_parallel`` group); None: every
            process of the default group. Pass it to torchmetrics metrics as ``process_group=`` (as
            :class:`lit_balance.TokenMeanLoss` takes it) so that they sum over the data-parallel ranks only.

    Example:
        >>> world = DataParallelWorld(rank=0, num_replicas=1)
        >>> world.all_gather(torch.tensor([1.0, 2.0])).tolist()
        [[1.0, 2.0]]
    """

    rank: int
    num_replicas: int
    strategy: Any = field(default=None, repr=False, compare=False)
    process_group: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, low in (("num_replicas", 1), ("rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputValueError(f"{name} must be an int >= {low}, got {value!r}", parameter=name)
        if self.rank >= self.num_replicas:
            raise InputValueError(f"rank must be in [0, num_replicas) = [0, {self.num_replicas}), got {self.rank}",
                                  parameter="rank")

    def _device_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        device = getattr(self.strategy, "root_device", None)
        return tensor if device is None else tensor.to(device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[num_replicas, *tensor.shape]`` on the CPU: ``tensor`` of every data-parallel rank, by rank."""
        if self.num_replicas == 1:
            return tensor.detach().cpu().unsqueeze(0).clone()
        if self.strategy is not None and self.process_group is None:
            out = self.strategy.all_gather(self._device_tensor(tensor))
        else:
            local = self._device_tensor(tensor).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.num_replicas)]
            dist.all_gather(parts, local, group=self.process_group)
            out = torch.stack(parts)
        return out.cpu().reshape(self.num_replicas, *tensor.shape)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel ranks, on the CPU."""
        if self.num_replicas == 1:
            return tensor.detach().cpu().clone()
        if self.strategy is not None and self.process_group is None:
            # a Lightning strategy has reduce(); a Fabric strategy has all_reduce(); both reduce in place: a copy
            reduce = getattr(self.strategy, "reduce", None) or self.strategy.all_reduce
            return reduce(self._device_tensor(tensor).clone(), reduce_op="sum").cpu()
        out = self._device_tensor(tensor).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.process_group)
        return out.cpu()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Data-parallel rank ``src``'s ``tensor`` on every rank, on the CPU."""
        if self.num_replicas == 1:
            return tensor.detach().cpu().clone()
        if self.strategy is not None and self.process_group is None:
            return self.strategy.broadcast(self._device_tensor(tensor), src=src).cpu()
        out = self._device_tensor(tensor).clone()
        global_src = src if self.process_group is None else dist.get_global_rank(self.process_group, src)
        dist.broadcast(out, src=global_src, group=self.process_group)
        return out.cpu()


def process_group_world(group: Any = None) -> DataParallelWorld | None:
    """The world of an initialised ``torch.distributed`` process group, or None when none is initialised.

    Args:
        group: the process group of the data-parallel ranks (e.g. ``mesh["dp"].get_group()``), or None: the default
            group (every process).

    Raises:
        RuntimeError: ``group`` given but no process group is initialised, or this process is not in ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a data-parallel process group was given, but torch.distributed is not initialised; "
                               "call torch.distributed.init_process_group() first")
        return None
    if group is None:
        return DataParallelWorld(rank=dist.get_rank(), num_replicas=dist.get_world_size())
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(f"this process (global rank {dist.get_rank()}) is not a member of the data-parallel process "
                           "group it was given; pass the group of the data-parallel ranks this process belongs to")
    size = dist.get_world_size(group)
    subgroup = group if size < dist.get_world_size() else None  # the whole world: the default group's collectives
    return DataParallelWorld(rank=rank, num_replicas=size, process_group=subgroup)


def _mesh_world(mesh: Any, strategy: Any = None) -> DataParallelWorld:
    """The world of a device mesh's data-parallel dimension (the whole mesh when it is 1-D)."""
    if not (hasattr(mesh, "size") and hasattr(mesh, "get_local_rank") and hasattr(mesh, "get_group")):
        raise InputTypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}",
                             parameter="mesh")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", 1) > 1:
        dim = next((name for name in DATA_PARALLEL_MESH_DIMS if name in names), None)
        if dim is None:
            raise InputValueError(
                f"the device mesh has {mesh.ndim} dimensions named {list(names)}, none of them a data-parallel one "
                f"({' or '.join(map(repr, DATA_PARALLEL_MESH_DIMS))}); pass its 1-D data-parallel sub-mesh, e.g. "
                "data_parallel_world(mesh=mesh['dp_shard'])", parameter="mesh")
        mesh = mesh[dim]
    num_replicas, rank = int(mesh.size()), int(mesh.get_local_rank())
    group = mesh.get_group() if num_replicas > 1 else None
    return DataParallelWorld(rank=rank, num_replicas=num_replicas, strategy=strategy, process_group=group)


def _strategy_world(trainer: Any) -> DataParallelWorld:
    """The data-parallel world of a Trainer's (or Fabric's) strategy; see :func:`data_parallel_world`."""
    strategy = getattr(trainer, "strategy", None)
    world_size, global_rank = int(trainer.world_size), int(trainer.global_rank)
    name = type(strategy).__name__
    how = ("lit_balance supports strategies whose distributed_sampler_kwargs give the data-parallel num_replicas "
           "and rank (DDP, FSDP, DeepSpeed, ModelParallelStrategy; see docs/strategies.md); for another strategy, "
           "give it a distributed_sampler_kwargs property (and, when a replica spans several processes, a "
           "device_mesh with a 'data_parallel' dimension)")
    try:
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    except RuntimeError as error:  # ModelParallelStrategy before its processes and device mesh are set up
        raise RuntimeError(f"the {name} strategy cannot say its data-parallel world yet ({error}); ask for it once the "
                           "Trainer has set up its processes (in setup(), configure_model() or later)") from error
    if not isinstance(kwargs, dict) or "num_replicas" not in kwargs or "rank" not in kwargs:
        raise RuntimeError(f"the {name} strategy runs {world_size} processes but does not say which data-parallel "
                           f"rank this process is (its distributed_sampler_kwargs is {kwargs!r}, not a dict with "
                           f"num_replicas and rank); {how}")
    num_replicas, rank = kwargs["num_replicas"], kwargs["rank"]
    valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (num_replicas, rank))
    fits = valid and 1 <= num_replicas <= world_size and world_size % num_replicas == 0 and 0 <= rank < num_replicas
    if not fits:
        raise RuntimeError(f"the {name} strategy's distributed_sampler_kwargs {kwargs} do not describe a data-parallel "
                           f"world of this run of {world_size} processes (this one is global rank {global_rank}): "
                           f"expected num_replicas dividing {world_size} and 0 <= rank < num_replicas; {how}")
    if num_replicas == world_size:
        if rank != global_rank:
            raise RuntimeError(f"the {name} strategy's distributed_sampler_kwargs {kwargs} give every process its own "
                               f"data-parallel rank but rank {rank} differs from this process's global rank "
                               f"{global_rank}; {how}")
        return DataParallelWorld(rank=rank, num_replicas=num_replicas, strategy=strategy)
    try:
        mesh = getattr(strategy, "device_mesh", None)
    except RuntimeError:  # Lightning's ModelParallelStrategy before its processes are initialised
        mesh = None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None or "data_parallel" not in names:
        raise RuntimeError(f"the {name} strategy's distributed_sampler_kwargs {kwargs} give {num_replicas} "
                           f"data-parallel ranks for {world_size} processes, but the strategy has no device_mesh with "
                           f"a 'data_parallel' dimension (found {list(names) if mesh is not None else None}), so the "
                           f"processes of each replica are unknown; {how}")
    world = _mesh_world(mesh["data_parallel"], strategy)
    if (world.num_replicas, world.rank) != (num_replicas, rank):
        raise RuntimeError(f"the {name} strategy's distributed_sampler_kwargs {kwargs} disagree with its device mesh's "
                           f"'data_parallel' dimension (num_replicas={world.num_replicas}, rank={world.rank}); {how}")
    return world


def data_parallel_world(trainer: Any = None, *, mesh: Any = None, process_group: Any = None) -> DataParallelWorld:
    """Which data-parallel rank this process is and how many there are, with collectives over those ranks.

    Give at most one of ``trainer``, ``mesh`` and ``process_group``; with none, the initialised default process group
    (every process is a data-parallel rank: DDP, FSDP, a torchrun loop without model parallelism), else rank 0 of 1.

    Args:
        trainer: a Lightning ``Trainer`` or a Fabric object (anything with ``strategy``, ``world_size`` and
            ``global_rank``). One process: rank 0 of 1. Several: the strategy's ``distributed_sampler_kwargs``
            (DDP, FSDP and DeepSpeed: every process; ``ModelParallelStrategy``: the device mesh's ``data_parallel``
            dimension, and its process group for the collectives; otherwise those of the strategy).
        mesh: a ``torch.distributed.device_mesh.DeviceMesh``: a 1-D mesh of the data-parallel ranks (e.g.
            ``mesh["dp"]``), or a mesh with a dimension named as in :data:`DATA_PARALLEL_MESH_DIMS`.
        process_group: the ``torch.distributed`` process group of the data-parallel ranks this process belongs to.

    Returns:
        The :class:`DataParallelWorld`.

    Raises:
        RuntimeError: the strategy does not say which data-parallel rank this process is (no
            ``distributed_sampler_kwargs``), says it inconsistently (num_replicas not dividing the world size, a rank
            out of range, disagreeing with its device mesh), or has fewer data-parallel ranks than processes but no
            device mesh with a ``data_parallel`` dimension; ``process_group`` without an initialised
            ``torch.distributed``.
        ValueError: more than one source given; a mesh of several dimensions without a data-parallel one.
        TypeError: ``mesh`` is not a device mesh.

    Example:
        >>> data_parallel_world()  # no process group here
        DataParallelWorld(rank=0, num_replicas=1)
    """
    given = [name for name, value in (("trainer", trainer), ("mesh", mesh), ("process_group", process_group))
             if value is not None]
    if len(given) > 1:
        raise InputValueError(f"give data_parallel_world at most one of trainer, mesh and process_group, got "
                              f"{' and '.join(given)}", parameter=given[-1])
    if mesh is not None:
        return _mesh_world(mesh)
    if process_group is not None:
        return process_group_world(process_group)
    if trainer is not None:
        if int(trainer.world_size) <= 1:
            return DataParallelWorld(rank=0, num_replicas=1, strategy=getattr(trainer, "strategy", None))
        return _strategy_world(trainer)
    return process_group_world() or DataParallelWorld(rank=0, num_replicas=1)


# --- a sampler's world from its arguments, or from the environment ---------------------------------------------
_HOW_TO_PASS = (
    "Pass num_replicas and rank, the data-parallel ones: under Lightning, build the sampler in "
    "LightningDataModule.setup() or train_dataloader() with **self.trainer.distributed_sampler_kwargs (or use "
    "lit_balance.BalancedTextDataModule, which does); elsewhere, process_group= the data-parallel process group, or "
    "the data-parallel world size and this process's data-parallel rank (lit_balance.world.data_parallel_world)."
)


def resolve_world(num_replicas: int | None, rank: int | None, process_group: Any = None, *,
                  owner: str = "BalancedBatchSampler") -> tuple[int, int]:
    """``(num_replicas, rank)``: those given, else those of ``process_group``, else the initialised default process
    group's (:func:`lit_balance.world.process_group_world`), else one rank; refused in a launched multi-process run
    before its process group exists.

    Raises:
        RuntimeError: a default taken where the environment says the run is distributed but no process group is
            initialised yet; ``process_group`` without an initialised ``torch.distributed``.
        TypeError, ValueError: ``num_replicas`` below 1, or ``rank`` outside ``[0, num_replicas)``; values given
            with ``process_group`` that disagree with it.
    """
    if process_group is not None:
        world = process_group_world(process_group)
        for name, given, value in (("num_replicas", num_replicas, world.num_replicas), ("rank", rank, world.rank)):
            if given is not None and given != value:
                raise InputValueError(f"{name}={given!r} disagrees with the process_group given, whose {name} is "
                                      f"{value}; pass one or the other", parameter=name)
        return world.num_replicas, world.rank
    group = process_group_world()
    if (num_replicas is None or rank is None) and group is None:
        _refuse_distributed_environment(num_replicas, rank, owner)
    if num_replicas is None:
        num_replicas = group.num_replicas if group is not None else 1
    if rank is None:
        rank = group.rank if group is not None else 0
    num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
    rank = check_int("rank", rank, 0, "pass this process's global rank")
    if rank >= num_replicas:
        raise InputValueError(f"rank must be in [0, num_replicas) = [0, {num_replicas}), got rank={rank}",
                              parameter="rank")
    return num_replicas, rank


def _launch_environment() -> dict[str, str]:
    """Variables by which a launcher says this process is one of several, as ``{name: value}`` (empty: one process).

    torchrun and Lightning's DDP launcher set ``WORLD_SIZE``; ``srun`` sets ``SLURM_STEP_NUM_TASKS`` for the tasks
    of a job step (``SLURM_NTASKS`` alone is also set in an ``sbatch`` script that runs one process); Open MPI
    sets ``OMPI_COMM_WORLD_SIZE``, MPICH and Intel MPI ``PMI_SIZE``.
    """
    found = {}
    for name in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(name, "")
        if value.strip().isascii() and value.strip().isdigit() and int(value) > 1:
            found[name] = value.strip()
    if found:
        for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
            if name in os.environ:
                found[name] = os.environ[name]
    return found


def _refuse_distributed_environment(num_replicas: int | None, rank: int | None, owner: str) -> None:
    """Raise when defaults would be taken in a process that its launcher started as one of several."""
    found = _launch_environment()
    if not found:
        return
    shown = ", ".join(f"{k}={v}" for k, v in found.items())
    defaulted = " and ".join(name for name, value in (("num_replicas", num_replicas), ("rank", rank)) if value is None)
    raise RuntimeError(
        f"{owner} was left to default {defaulted}, and the environment says this is a distributed "
        f"run ({shown}), but no torch.distributed process group is initialised yet: the defaults would be "
        f"num_replicas=1, rank=0 and every rank would train the whole epoch. {_HOW_TO_PASS}"
    )


def check_defaulted_world(owner: str, num_replicas: int, rank: int, replicas_defaulted: bool,
                          rank_defaulted: bool) -> None:
    """Raise when ``num_replicas`` / ``rank`` taken as defaults (:func:`resolve_world`) when ``owner`` was built
    disagree with the process group initialised since.

    Raises:
        RuntimeError: they disagree (naming both, and how to pass the data-parallel world).
    """
    group = process_group_world()
    if group is None or not (replicas_defaulted or rank_defaulted):
        return
    world, group_rank = group.num_replicas, group.rank
    if (replicas_defaulted and world != num_replicas) or (rank_defaulted and group_rank != rank):
        raise RuntimeError(
            f"{owner} was built for num_replicas={num_replicas}, rank={rank} (the defaults, taken when it was "
            f"constructed), but the initialised process group has world size {world} and this process is rank "
            f"{group_rank}: iterating would not shard the epoch over the ranks. {_HOW_TO_PASS}"
        )

