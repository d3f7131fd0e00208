"""The data-parallel world: which data-parallel rank this process is, and how many there are.

Every part of lit_balance that shards data or sums over ranks asks :func:`data_parallel_world` and nothing else: the
DataModule (which column of the plan a rank trains), the sampler's defaults, the token-weighted loss (its divisor and
gradient scale), the metrics and the callbacks (what they gather). "World" here means the ranks that hold different
data (``num_replicas`` in PyTorch's ``DistributedSampler``, ``dp_world_size`` in torchtitan, the data-parallel group
in Megatron); under plain DDP it is every process.

Today it answers with the global world: a Trainer's ``global_rank`` and ``world_size`` (its collectives go through
the Trainer's strategy), else the initialised ``torch.distributed`` process group, else one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lit_balance.errors import InputValueError

__all__ = ["DataParallelWorld", "data_parallel_world", "process_group_world"]


@dataclass(frozen=True)
class DataParallelWorld:
    """This process's data-parallel rank, the number of data-parallel ranks, and collectives over them.

    Collectives take a small tensor, move it to the device the strategy communicates on, and return a CPU tensor;
    with one rank they return a copy without communicating. Every data-parallel rank must call them alike.

    Attributes:
        rank: this process's data-parallel rank, in ``[0, num_replicas)``.
        num_replicas: the number of data-parallel ranks (>= 1).
        strategy: the Lightning strategy (``trainer.strategy``) whose collectives are used, or ``None``: then
            ``torch.distributed`` collectives on the default process group.

    Example:
        >>> world = DataParallelWorld(rank=0, num_replicas=1)
        >>> world.all_gather(torch.tensor([1.0, 2.0])).tolist()
        [[1.0, 2.0]]
    """

    rank: int
    num_replicas: int
    strategy: Any = field(default=None, repr=False, compare=False)

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
        if self.strategy is not None:
            out = self.strategy.all_gather(self._device_tensor(tensor))
        else:
            parts = [torch.empty_like(tensor) for _ in range(self.num_replicas)]
            dist.all_gather(parts, tensor.contiguous())
            out = torch.stack(parts)
        return out.cpu().reshape(self.num_replicas, *tensor.shape)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel ranks, on the CPU."""
        if self.num_replicas == 1:
            return tensor.detach().cpu().clone()
        if self.strategy is not None:
            return self.strategy.reduce(self._device_tensor(tensor), reduce_op="sum").cpu()
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Data-parallel rank ``src``'s ``tensor`` on every rank, on the CPU."""
        if self.num_replicas == 1:
            return tensor.detach().cpu().clone()
        if self.strategy is not None:
            return self.strategy.broadcast(self._device_tensor(tensor), src=src).cpu()
        out = tensor.clone()
        dist.broadcast(out, src=src)
        return out.cpu()


def process_group_world() -> DataParallelWorld | None:
    """The world of the initialised default ``torch.distributed`` process group, or None when there is none."""
    if dist.is_available() and dist.is_initialized():
        return DataParallelWorld(rank=dist.get_rank(), num_replicas=dist.get_world_size())
    return None


def data_parallel_world(trainer: Any = None) -> DataParallelWorld:
    """Which data-parallel rank this process is and how many there are.

    Args:
        trainer: a Lightning ``Trainer`` (or None). With one, its ``global_rank`` and ``world_size``, and collectives
            through ``trainer.strategy``; without, the initialised default process group's rank and size
            (torchrun without Lightning), else rank 0 of 1.

    Returns:
        The :class:`DataParallelWorld`.

    Example:
        >>> data_parallel_world()  # no process group here
        DataParallelWorld(rank=0, num_replicas=1)
    """
    if trainer is not None:
        return DataParallelWorld(rank=int(trainer.global_rank), num_replicas=int(trainer.world_size),
                                 strategy=trainer.strategy)
    return process_group_world() or DataParallelWorld(rank=0, num_replicas=1)
