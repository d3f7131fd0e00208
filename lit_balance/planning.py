"""Pure epoch planning: lengths -> token-budgeted micro-batches -> steps x ranks.

Everything here is a pure function of its arguments. Every rank computes the same plan locally, with
no communication, and keeps its own column of it.

Worked example (``max_tokens=100``, ``num_replicas=2``, ``shuffle=False``)::

    lengths = [95, 95, 95, 95, 95, 20, 20, 20, 20, 20]
    # sorted by length, longest first; a micro-batch takes as many rows as the budget allows at the
    # length of its first (longest) row:  95 -> 100 // 95 = 1 row,  20 -> 100 // 20 = 5 rows
    # micro-batches: [0] [1] [2] [3] [4] [5 6 7 8 9]        -> 6, already a multiple of 2
    # costs in padded slots: 95 95 95 95 95 100; most costly first, two per step (rank 0, rank 1):
    #   step 0: [5 6 7 8 9] [0]   step 1: [1] [2]   step 2: [3] [4]

Sources: forming micro-batches from length-sorted samples under a padded-token budget follows
fairseq's ``batch_by_size`` and lhotse's ``DynamicBucketingSampler``; giving every rank the same number
of micro-batches by splitting before duplicating follows the equal-count rule of PyTorch's
``DistributedSampler``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["EpochPlan", "padded_lengths", "plan_epoch"]


@dataclass(frozen=True)
class EpochPlan:
    """The global plan of one epoch: which rows form each micro-batch and where each one runs.

    Attributes:
        rows: int64 ``[num_rows]``, sample indices of all micro-batches, concatenated.
        is_fill: bool ``[num_rows]``, True for a fill row (a duplicate added only so that every rank
            gets the same number of micro-batches; its labels must be ignored by the loss).
        batch_offsets: int64 ``[num_batches + 1]``; micro-batch ``b`` is
            ``rows[batch_offsets[b]:batch_offsets[b + 1]]``.
        assignment: int64 ``[num_steps, num_replicas]``; ``assignment[s, r]`` is the micro-batch that
            rank ``r`` runs at step ``s``.
        dropped: int64, sample indices left out this epoch by ``drop_last=True`` (global).
    """

    rows: np.ndarray
    is_fill: np.ndarray
    batch_offsets: np.ndarray
    assignment: np.ndarray
    dropped: np.ndarray

    @property
    def num_steps(self) -> int:
        """Micro-batches per rank in this epoch."""
        return int(self.assignment.shape[0])

    @property
    def num_batches(self) -> int:
        """Micro-batches over all ranks in this epoch."""
        return int(self.batch_offsets.shape[0] - 1)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(indices, is_fill)`` of micro-batch ``b``."""
        lo, hi = self.batch_offsets[b], self.batch_offsets[b + 1]
        return self.rows[lo:hi], self.is_fill[lo:hi]


def padded_lengths(lengths: np.ndarray, pad_to_multiple_of: int) -> np.ndarray:
    """Round each length up to a multiple of ``pad_to_multiple_of`` (tokens, int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // pad_to_multiple_of) * pad_to_multiple_of


def _form_batches(order: np.ndarray, padded: np.ndarray, max_tokens: int, max_batch_size: int) -> list[np.ndarray]:
    """Cut ``order`` (sample indices, longest first) into contiguous micro-batches within the budget.

    A micro-batch starting at a row of padded length ``L`` takes ``min(max_tokens // L, max_batch_size)``
    rows; since later rows are no longer, the budget holds. Contiguous cuts of a length-sorted order are
    the fewest micro-batches possible for this budget.
    """
    batches = []
    i, n = 0, order.shape[0]
    while i < n:
        take = min(max_tokens // int(padded[order[i]]), max_batch_size)
        batches.append(order[i : i + take])
        i += take
    return batches


def _split_to(batches: list[np.ndarray], target: int) -> list[np.ndarray]:
    """Split the micro-batches with the most rows in half until there are ``target`` (or all are single)."""
    heap = [(-len(b), k) for k, b in enumerate(batches)]
    heapq.heapify(heap)
    pieces: dict[int, np.ndarray] = dict(enumerate(batches))
    next_key = len(batches)
    count = len(batches)
    while count < target and heap and -heap[0][0] >= 2:
        _, k = heapq.heappop(heap)
        b = pieces.pop(k)
        half = (len(b) + 1) // 2
        for part in (b[:half], b[half:]):
            pieces[next_key] = part
            heapq.heappush(heap, (-len(part), next_key))
            next_key += 1
        count += 1
    return [pieces[k] for k in sorted(pieces)]


def plan_epoch(
    lengths: np.ndarray,
    max_tokens: int,
    *,
    num_replicas: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    pad_to_multiple_of: int = 1,
    max_batch_size: int | None = None,
    eligible: np.ndarray | None = None,
) -> EpochPlan:
    """Plan one epoch for all ranks (pure: the same inputs give the same plan on every rank).

    Args:
        lengths: int ``[num_samples]``, tokens per sample, already truncated where that applies; every
            eligible sample must satisfy ``padded(length) <= max_tokens``.
        max_tokens: padded token slots (rows x longest padded row) allowed per micro-batch, per rank.
        num_replicas: number of ranks; the plan has ``num_steps x num_replicas`` micro-batches.
        seed: base seed; randomness comes from a local generator seeded by ``(seed, epoch)``.
        epoch: epoch number; changes tie-breaking, rank assignment and step order when ``shuffle``.
        shuffle: randomise within equal lengths and the order of steps; otherwise fully ordered.
        drop_last: when the samples are too few to give every rank a micro-batch at every step without
            duplicates, drop the fewest samples instead of adding fill rows.
        pad_to_multiple_of: padded length is the length rounded up to this multiple (tokens).
        max_batch_size: cap on rows per micro-batch, or None for no cap.
        eligible: bool ``[num_samples]`` mask of samples to plan (others are skipped), or None for all.

    Returns:
        The :class:`EpochPlan` of the epoch.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = padded_lengths(lengths, pad_to_multiple_of)
    candidates = np.arange(lengths.shape[0], dtype=np.int64)
    if eligible is not None:
        candidates = candidates[eligible]
    cap = max_batch_size if max_batch_size is not None else max_tokens
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)])) if shuffle else None

    # Longest first; ties broken at random (shuffle) or by index.
    if rng is not None:
        candidates = rng.permutation(candidates)
    order = candidates[np.argsort(-padded[candidates], kind="stable")]
    batches = _form_batches(order, padded, max_tokens, cap)

    # Equal counts: a multiple of num_replicas micro-batches, splitting before duplicating.
    target = -(-len(batches) // num_replicas) * num_replicas
    batches = _split_to(batches, target)
    fills: list[np.ndarray] = []
    dropped = np.empty(0, dtype=np.int64)
    if len(batches) < target:  # every micro-batch is a single row: too few samples
        singles = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        if drop_last:
            keep = (len(singles) // num_replicas) * num_replicas
            # drop at random (shuffle) or, without shuffle, the highest-cost rows
            perm = rng.permutation(len(singles)) if rng is not None else np.argsort(-padded[singles], kind="stable")
            dropped = np.sort(singles[perm[keep:]])
            keep_mask = np.ones(len(singles), dtype=bool)
            keep_mask[perm[keep:]] = False
            batches = [singles[k : k + 1] for k in np.flatnonzero(keep_mask)]
        else:
            short_first = singles[np.argsort(padded[singles], kind="stable")]  # cheapest rows make the fills
            need = target - len(batches)
            fills = [short_first[k % len(short_first) : k % len(short_first) + 1] for k in range(need)]

    all_batches = batches + fills
    fill_flags = [False] * len(batches) + [True] * len(fills)
    num_steps = len(all_batches) // num_replicas

    # Balance: most costly first, then consecutive groups of num_replicas form a step.
    cost = np.array([len(b) * int(padded[b].max()) for b in all_batches], dtype=np.int64)
    by_cost = np.argsort(-cost, kind="stable")
    assignment = by_cost.reshape(num_steps, num_replicas) if num_steps else np.empty((0, num_replicas), np.int64)
    if rng is not None and num_steps:
        assignment = rng.permuted(assignment, axis=1)  # which rank gets which micro-batch in a step
        assignment = assignment[rng.permutation(num_steps)]  # step order

    sizes = np.array([len(b) for b in all_batches], dtype=np.int64)
    offsets = np.zeros(len(all_batches) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    rows = np.concatenate(all_batches) if all_batches else np.empty(0, dtype=np.int64)
    is_fill = np.repeat(np.array(fill_flags, dtype=bool), sizes)
    return EpochPlan(
        rows=rows.astype(np.int64),
        is_fill=is_fill,
        batch_offsets=offsets,
        assignment=np.ascontiguousarray(assignment, dtype=np.int64),
        dropped=dropped,
    )
