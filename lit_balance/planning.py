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


def _cut_points(pl: np.ndarray, max_tokens: int, max_batch_size: int) -> np.ndarray:
    """End offsets of the micro-batches of ``pl`` (non-increasing per-row caps) within the budget.

    ``pl[i]`` is row ``i``'s padded length, or the longest padded length of its length bucket (see
    :func:`_bucket_upper`); either way no later row is longer. A micro-batch starting at a row with
    cap ``L`` takes ``min(max_tokens // L, max_batch_size)`` rows; since later rows are no longer, the
    budget holds. Contiguous cuts of a sorted order are the fewest micro-batches possible for these
    caps. Runs of equal caps are cut in one vectorised step, so the Python loop runs about twice per
    distinct cap, not once per micro-batch.
    """
    n = pl.shape[0]
    caps = np.minimum(max_tokens // pl, max_batch_size)
    run_ends = np.append(np.flatnonzero(pl[1:] != pl[:-1]) + 1, n)
    ends: list[np.ndarray] = []
    i = r = 0
    while i < n:
        while run_ends[r] <= i:
            r += 1
        take, run_end = int(caps[i]), int(run_ends[r])
        full = (run_end - i) // take  # micro-batches that lie wholly inside this run of equal lengths
        if full:
            ends.append(np.arange(i + take, i + full * take + 1, take))
            i += full * take
        if i < run_end:  # one micro-batch that starts here and runs into the shorter rows after
            i = min(i + take, n)
            ends.append(np.array([i]))
    return np.concatenate(ends) if ends else np.empty(0, dtype=np.int64)


def _bucket_upper(padded: np.ndarray, candidates: np.ndarray, tolerance: float) -> np.ndarray:
    """Per sample, the longest padded length among the candidates of its length bucket.

    Buckets are geometric: ``floor(log(L) / log(1 + tolerance))``, so lengths in one bucket differ by
    less than a factor ``1 + tolerance``. Samples outside ``candidates`` keep their own length.
    """
    bucket = np.floor(np.log(padded[candidates]) / np.log1p(tolerance)).astype(np.int64)
    ids, inverse = np.unique(bucket, return_inverse=True)
    longest = np.zeros(ids.shape[0], dtype=np.int64)
    np.maximum.at(longest, inverse, padded[candidates])
    upper = padded.copy()
    upper[candidates] = longest[inverse]
    return upper


def _split_to(starts: np.ndarray, ends: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the micro-batches with the most rows in half until there are ``target`` (or all are single).

    Only the ``target - len(starts)`` largest micro-batches can take part (each split takes the largest,
    ties to the earliest), so only they enter the heap.
    """
    need = target - starts.shape[0]
    if need <= 0:
        return starts, ends
    sizes = ends - starts
    top = np.argsort(-sizes, kind="stable")[:need]
    heap = [(-int(sizes[k]), int(starts[k]), int(ends[k])) for k in top]
    heapq.heapify(heap)
    while need and heap and -heap[0][0] >= 2:
        size, lo, hi = heapq.heappop(heap)
        mid = lo + (-size + 1) // 2
        heapq.heappush(heap, (lo - mid, lo, mid))
        heapq.heappush(heap, (mid - hi, mid, hi))
        need -= 1
    keep = np.ones(starts.shape[0], dtype=bool)
    keep[top] = False
    new_starts = np.concatenate([starts[keep], np.array([h[1] for h in heap], dtype=np.int64)])
    new_ends = np.concatenate([ends[keep], np.array([h[2] for h in heap], dtype=np.int64)])
    order = np.argsort(new_starts, kind="stable")
    return new_starts[order], new_ends[order]


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
    length_tolerance: float = 0.0,
) -> EpochPlan:
    """Plan one epoch for all ranks (pure: the same inputs give the same plan on every rank).

    Args:
        lengths: int ``[num_samples]``, tokens per sample, already truncated where that applies; every
            eligible sample must satisfy ``padded(length) <= max_tokens``.
        max_tokens: padded token slots (rows x longest padded row) allowed per micro-batch, per rank.
        num_replicas: number of ranks; the plan has ``num_steps x num_replicas`` micro-batches.
        seed: base seed; randomness comes from a local generator seeded by ``(seed, epoch)``.
        epoch: epoch number; changes tie-breaking, rank assignment and step order when ``shuffle``.
        shuffle: randomise the order within a length bucket (see ``length_tolerance``), the rank of each
            micro-batch within its step and the order of steps; otherwise fully ordered.
        drop_last: when the samples are too few to give every rank a micro-batch at every step without
            duplicates, drop the fewest samples instead of adding fill rows.
        pad_to_multiple_of: padded length is the length rounded up to this multiple (tokens).
        max_batch_size: cap on rows per micro-batch, or None for no cap.
        eligible: bool ``[num_samples]`` mask of samples to plan (others are skipped), or None for all.
        length_tolerance: with ``shuffle``, padded lengths within a factor ``1 + length_tolerance`` of each
            other fall into one bucket and are shuffled together, so batch composition changes between
            epochs even when no two lengths are equal; a micro-batch then takes as many rows as its
            bucket's longest length allows. It trades padding (at most about ``length_tolerance`` of the
            slots) for randomness; 0 shuffles only equal lengths. Ignored without ``shuffle``.

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

    # Longest bucket first, in random order within a bucket (shuffle), else longest first by index.
    upper = padded
    if rng is not None:
        candidates = rng.permutation(candidates)
        if length_tolerance > 0 and candidates.size:
            upper = _bucket_upper(padded, candidates, length_tolerance)
    order = candidates[np.argsort(-upper[candidates], kind="stable")]
    ends = _cut_points(upper[order], max_tokens, cap)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64) if ends.size else np.empty(0, dtype=np.int64)

    # Equal counts: a multiple of num_replicas micro-batches, splitting before duplicating.
    target = -(-starts.shape[0] // num_replicas) * num_replicas
    starts, ends = _split_to(starts, ends, target)
    rows, offsets = order, np.append(starts, order.shape[0])
    num_fill = 0
    dropped = np.empty(0, dtype=np.int64)
    if starts.shape[0] < target:  # every micro-batch is a single row: too few samples
        if drop_last:
            keep = (order.shape[0] // num_replicas) * num_replicas
            # drop at random (shuffle) or, without shuffle, the highest-cost rows (order is longest first)
            perm = rng.permutation(order.shape[0]) if rng is not None else np.arange(order.shape[0])[::-1]
            keep_mask = np.ones(order.shape[0], dtype=bool)
            keep_mask[perm[keep:]] = False
            dropped = np.sort(order[~keep_mask])
            rows = order[keep_mask]
        else:
            num_fill = target - starts.shape[0]  # at most num_replicas - 1
            cheapest_first = order[::-1]
            rows = np.concatenate([order, cheapest_first[np.arange(num_fill) % order.shape[0]]])
        offsets = np.arange(rows.shape[0] + 1, dtype=np.int64)
    is_fill = np.zeros(rows.shape[0], dtype=bool)
    if num_fill:
        is_fill[-num_fill:] = True
    num_batches = offsets.shape[0] - 1
    num_steps = num_batches // num_replicas

    # Balance: most costly first, then consecutive groups of num_replicas form a step. A micro-batch's
    # cost in padded slots is its rows x its longest row's padded length.
    cost = (np.diff(offsets) * np.maximum.reduceat(padded[rows], offsets[:-1]) if num_batches
            else np.empty(0, dtype=np.int64))
    assignment = np.argsort(-cost, kind="stable").reshape(num_steps, num_replicas)
    if rng is not None and num_steps:
        assignment = rng.permuted(assignment, axis=1)  # which rank gets which micro-batch in a step
        assignment = assignment[rng.permutation(num_steps)]  # step order

    return EpochPlan(
        rows=rows.astype(np.int64),
        is_fill=is_fill,
        batch_offsets=offsets.astype(np.int64),
        assignment=np.ascontiguousarray(assignment, dtype=np.int64),
        dropped=dropped,
    )
