"""The strategy table's batching rules besides the sampler benchmark's peers (:mod:`benchmarks.peers`): length-sorted
buckets of a fixed size, dealt to ranks with equal counts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch.utils.data import Sampler

__all__ = ["EpochBatchSampler", "deal_even", "sorted_bucket_batches"]


def sorted_bucket_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-sorted buckets of a fixed size, in a shuffled order (global: every rank computes the same list).

    Samples are sorted by length (random order among equal lengths, from ``(seed, epoch)``), cut into consecutive
    batches of ``batch_size`` (the last may be shorter), and the batch order is shuffled.

    Args:
        lengths: int ``[num_samples]``, tokens per sample.
        batch_size: rows per batch.
        seed: base seed, the same on every rank.
        epoch: epoch number; each epoch breaks ties and orders batches anew.

    Returns:
        Batches of dataset indices.

    Example:
        >>> sorted(map(sorted, sorted_bucket_batches(np.array([5, 1, 4, 2, 3]), 2, seed=0, epoch=0)))
        [[0], [1, 3], [2, 4]]
    """
    lengths = np.asarray(lengths)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(lengths.shape[0])
    order = perm[np.argsort(lengths[perm], kind="stable")]
    batches = [order[i:i + batch_size].tolist() for i in range(0, order.shape[0], batch_size)]
    return [batches[k] for k in rng.permutation(len(batches))]


def deal_even(batches: Sequence[list[int]], num_replicas: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Deal micro-batches round-robin to ranks, dropping the last ``len(batches) % num_replicas`` so counts match.

    Args:
        batches: the epoch's global micro-batches, in training order.
        num_replicas: number of ranks.

    Returns:
        ``(per_rank, dropped)``: ``per_rank[r]`` is rank ``r``'s micro-batches (``batches[r::num_replicas]`` of the
        kept ones, all ranks the same length); ``dropped`` the micro-batches left out (fewer than ``num_replicas``).

    Raises:
        ValueError: ``num_replicas < 1``.

    Example:
        >>> deal_even([[0], [1], [2], [3, 4], [5]], 2)
        ([[[0], [2]], [[1], [3, 4]]], [[5]])
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    keep = len(batches) - len(batches) % num_replicas
    return [list(batches[r:keep:num_replicas]) for r in range(num_replicas)], list(batches[keep:])


class EpochBatchSampler(Sampler):
    """This rank's micro-batches of a global per-epoch batch list (:func:`deal_even`); a ``set_epoch`` sampler.

    Use as ``DataLoader(dataset, sampler=sampler, batch_size=None)`` with a dataset that accepts index lists.

    Args:
        build: ``build(epoch) -> list of micro-batches`` (global, identical on every rank).
        num_replicas: number of ranks.
        rank: this rank, in ``[0, num_replicas)``.

    Attributes:
        epoch: the epoch ``set_epoch`` selected.

    Raises:
        ValueError: ``rank`` outside ``[0, num_replicas)``.
    """

    def __init__(self, build: Callable[[int], list[list[int]]], num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.build, self.num_replicas, self.rank = build, num_replicas, rank
        self.epoch = 0
        self._cache: tuple[int, list[list[int]], list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose micro-batches ``__iter__`` yields."""
        self.epoch = int(epoch)

    def _dealt(self) -> tuple[list[list[int]], list[list[int]]]:
        if self._cache is None or self._cache[0] != self.epoch:
            per_rank, dropped = deal_even(self.build(self.epoch), self.num_replicas)
            self._cache = (self.epoch, per_rank[self.rank], dropped)
        return self._cache[1], self._cache[2]

    @property
    def dropped(self) -> list[list[int]]:
        """The current epoch's micro-batches that no rank trains on (global, fewer than ``num_replicas``)."""
        return self._dealt()[1]

    def __len__(self) -> int:
        return len(self._dealt()[0])

    def __iter__(self):
        yield from self._dealt()[0]
