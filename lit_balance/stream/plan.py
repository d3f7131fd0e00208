"""Planning a stream window by window: pure functions of the window's lengths, the same on every rank.

A window is the next ``window_documents`` documents of the stream (fewer at its end). Its lengths are gathered from the
ranks that read them (:mod:`lit_balance.stream.batches`), then it is planned with :func:`~lit_balance.plan_epoch`,
the planner of every corpus (budget, equal counts, cost balance, padded / packed / static layouts), seeded by
``(seed, epoch, window)``. A window that is not the stream's last is planned to whole optimizer steps
(``accumulate_grad_batches`` micro-steps each), so optimizer steps never straddle two windows.

Worked example (``window_documents=4``, 2 ranks, ``max_tokens=100``)::

    stream lengths 90 30 40 20 | 50 ...   window 0 = documents 0-3: rank 0 reads 0 and 2, rank 1 reads 1 and 3
    gathered [90, 30, 40, 20] -> plan_epoch -> micro-step 0: rank 0 [0], rank 1 [2, 3]; micro-step 1: rank 0 [1] ...
    rank 1 trains 2 (read by rank 0) and 3 (its own): rank 0 sends document 2's token ids to rank 1
"""

from __future__ import annotations

import numpy as np

from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.epoch import plan_epoch
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan

__all__ = ["plan_window", "reader_of", "trained_by", "window_seed"]


def window_seed(seed: int, epoch: int, window: int) -> int:
    """The seed window ``window`` of pass ``epoch`` is planned with (>= 0; independent of the world size)."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(window), 0x5354]).generate_state(1)[0] >> 1)


def reader_of(positions: np.ndarray, num_replicas: int) -> np.ndarray:
    """int64: the rank that reads and tokenizes each window position (``position % num_replicas``)."""
    return np.asarray(positions, dtype=np.int64) % int(num_replicas)


def plan_window(lengths: np.ndarray, settings: BatchingSettings, *, num_replicas: int, epoch: int, window: int,
                last: bool, eligible: np.ndarray | None = None,
                cost_model: CostModelProtocol | None = None) -> EpochPlan:
    """The plan of one window, in window positions (``0 .. len(lengths) - 1``), for all ranks.

    Args:
        lengths: int ``[n]`` tokens per document of the window, in stream order.
        settings: the batching settings (static shapes already chosen, see
            :func:`~lit_balance.plan.shapes.resolve_static_shapes`).
        num_replicas: data-parallel ranks.
        epoch, window: the pass over the stream and the window's index in it (they seed the plan).
        last: whether this is the stream's last window; any other is planned to whole optimizer steps.
        eligible: bool ``[n]``, the documents still to train (a resumed window), or None for all.
        cost_model: as for :func:`~lit_balance.plan_epoch`.

    Returns:
        The window's :class:`~lit_balance.EpochPlan`; ``num_micro_steps`` a multiple of
        ``settings.accumulate_grad_batches`` unless ``last``.

    Raises:
        ValueError: as :func:`~lit_balance.plan_epoch` (a document longer than ``max_tokens``, names the setting).

    Example:
        >>> plan = plan_window([90, 30, 40, 20], BatchingSettings(max_tokens=100), num_replicas=2, epoch=0,
        ...                    window=0, last=True)
        >>> plan.num_micro_steps, int(plan.is_fill.sum())
        (2, 0)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    settings = settings.replace(seed=window_seed(settings.seed, epoch, window))
    acc = settings.accumulate_grad_batches
    kwargs = dict(num_replicas=num_replicas, epoch=0, eligible=eligible, cost_model=cost_model)
    plan = plan_epoch(lengths, settings, **kwargs)
    if last or plan.num_micro_steps % acc == 0:
        return plan
    whole = -(-plan.num_micro_steps // acc) * acc
    plan = plan_epoch(lengths, settings, min_steps=whole, **kwargs)
    if plan.num_micro_steps % acc:  # too few documents to split further: fill rows complete the optimizer step
        plan = _fill_steps(plan, lengths, eligible, whole)
    return plan


def _fill_steps(plan: EpochPlan, lengths: np.ndarray, eligible: np.ndarray | None, steps: int) -> EpochPlan:
    """``plan`` grown to ``steps`` micro-steps by micro-batches of one fill row each (the shortest document)."""
    candidates = np.flatnonzero(eligible) if eligible is not None else np.arange(lengths.shape[0])
    shortest = int(candidates[np.argmin(lengths[candidates])])
    num_replicas = plan.assignment.shape[1]
    extra = (steps - plan.num_micro_steps) * num_replicas
    first = plan.num_batches
    return EpochPlan(rows=np.concatenate([plan.rows, np.full(extra, shortest, np.int64)]),
                     is_fill=np.concatenate([plan.is_fill, np.ones(extra, bool)]),
                     batch_offsets=np.concatenate([plan.batch_offsets, plan.batch_offsets[-1] + 1 + np.arange(extra)]),
                     assignment=np.concatenate([plan.assignment,
                                                (first + np.arange(extra)).reshape(-1, num_replicas)]),
                     dropped=plan.dropped, accumulate_grad_batches=plan.accumulate_grad_batches)


def trained_by(plan: EpochPlan, rank: int) -> np.ndarray:
    """int64, sorted: the window positions of the documents ``rank`` trains in ``plan`` (fill rows included)."""
    batches = plan.assignment[:, rank]
    if not batches.size:
        return np.zeros(0, dtype=np.int64)
    rows = [plan.rows[plan.batch_offsets[b]:plan.batch_offsets[b + 1]] for b in batches]
    return np.unique(np.concatenate(rows)).astype(np.int64)
