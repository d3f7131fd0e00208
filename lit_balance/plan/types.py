"""The plan of an epoch: micro-batches of sample indices, which rank runs each at which micro-step.

Every planner (:mod:`lit_balance.plan.padded`, :mod:`lit_balance.plan.packed`) returns an :class:`EpochPlan`; the
sampler yields this rank's column of it as :class:`MicroBatch` lists. Both hold global values: the same on every
rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lit_balance.errors import InputValueError

__all__ = ["EpochPlan", "MicroBatch", "PieceMicroBatch", "WorstCaseBatch", "empty_plan", "padded_lengths"]


class MicroBatch(list):
    """A micro-batch: a ``list[int]`` of dataset indices that also carries its fill-row mask.

    Attributes:
        is_fill: ``tuple[bool, ...]`` of the same length; True marks a fill row, a duplicate that exists
            only to give every rank the same number of micro-batches. Its labels must be ignored.
        step_real_tokens: real tokens (fill rows excluded) of all micro-batches of this micro-batch's
            optimizer step, over all ranks (global, as planned), or None when not known.
        step_rows: rows (fill rows excluded) of those micro-batches, global, or None; with ``packing`` a row is a
            document. A causal language model without masked labels supervises ``step_real_tokens - step_rows``
            tokens in that optimizer step (each document's first token has no label, packed or not).
        step_supervised_tokens: the next-token targets of those micro-batches (global, counted from the
            sampler's ``supervised_lengths``), or None when not known.

    It compares equal to the plain list of its indices and survives pickling into DataLoader workers.

    Example:
        >>> mb = MicroBatch([4, 7], is_fill=[False, True], step_real_tokens=30, step_rows=3)
        >>> mb == [4, 7], mb.is_fill
        (True, (False, True))
    """

    def __init__(self, indices: Sequence[int] = (), is_fill: Sequence[bool] | None = None,
                 step_real_tokens: int | None = None, step_rows: int | None = None,
                 step_supervised_tokens: int | None = None) -> None:
        if isinstance(indices, np.ndarray) and indices.dtype.kind in "iu":  # plain ints without a Python loop
            super().__init__(indices.tolist())
        else:
            super().__init__(int(i) for i in indices)
        if isinstance(is_fill, np.ndarray) and is_fill.dtype == np.bool_:
            self.is_fill = tuple(is_fill.tolist())
        else:
            self.is_fill = tuple(bool(f) for f in is_fill) if is_fill is not None else (False,) * len(self)
        if len(self.is_fill) != len(self):
            raise InputValueError(f"is_fill mask has {len(self.is_fill)} entries but the micro-batch has {len(self)} "
                                  "indices")
        self.step_real_tokens = None if step_real_tokens is None else int(step_real_tokens)
        self.step_rows = None if step_rows is None else int(step_rows)
        self.step_supervised_tokens = None if step_supervised_tokens is None else int(step_supervised_tokens)


class PieceMicroBatch(MicroBatch):
    """A :class:`MicroBatch` of document indices whose rows are pieces of those documents.

    Attributes:
        piece_start: ``tuple[int, ...]``, each row's first token within its document.
        piece_length: ``tuple[int, ...]``, each row's tokens.

    Example:
        >>> mb = PieceMicroBatch([3, 3], piece_start=[0, 4], piece_length=[4, 2])
        >>> mb == [3, 3], mb.piece_start, mb.piece_length
        (True, (0, 4), (4, 2))
    """

    def __init__(self, indices: Sequence[int] = (), is_fill: Sequence[bool] | None = None, *,
                 piece_start: Sequence[int], piece_length: Sequence[int], **step_totals: Any) -> None:
        super().__init__(indices, is_fill, **step_totals)
        self.piece_start = tuple(int(s) for s in piece_start)
        self.piece_length = tuple(int(n) for n in piece_length)
        if not len(self.piece_start) == len(self.piece_length) == len(self):
            raise InputValueError(f"a piece micro-batch needs one piece_start and piece_length per index, got "
                                  f"{len(self.piece_start)} and {len(self.piece_length)} for {len(self)} indices")


@dataclass(frozen=True)
class EpochPlan:
    """The global plan of one epoch: which rows form each micro-batch and where each one runs.

    Attributes:
        rows: int64 ``[num_rows]``, sample indices of all micro-batches, concatenated.
        is_fill: bool ``[num_rows]``, True for a fill row (a duplicate added only so that every rank
            gets the same number of micro-batches; its labels must be ignored by the loss).
        batch_offsets: int64 ``[num_batches + 1]``; micro-batch ``b`` is
            ``rows[batch_offsets[b]:batch_offsets[b + 1]]``.
        assignment: int64 ``[num_micro_steps, num_replicas]``; ``assignment[s, r]`` is the micro-batch that
            rank ``r`` runs at micro-step ``s``. Optimizer step ``g`` is micro-steps
            ``[g * accumulate_grad_batches, (g + 1) * accumulate_grad_batches)``.
        dropped: int64, sample indices left out this epoch by ``drop_last=True`` (global).
        accumulate_grad_batches: micro-batches per rank per optimizer step the plan was balanced for.
    """

    rows: np.ndarray
    is_fill: np.ndarray
    batch_offsets: np.ndarray
    assignment: np.ndarray
    dropped: np.ndarray
    accumulate_grad_batches: int = 1

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps in this epoch: micro-batches per rank (the same on every rank)."""
        return int(self.assignment.shape[0])

    @property
    def num_batches(self) -> int:
        """Micro-batches over all ranks in this epoch."""
        return int(self.batch_offsets.shape[0] - 1)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(indices, is_fill)`` of micro-batch ``b``."""
        lo, hi = self.batch_offsets[b], self.batch_offsets[b + 1]
        return self.rows[lo:hi], self.is_fill[lo:hi]

    def batch_widths(self, padded: np.ndarray) -> np.ndarray:
        """int64 ``[num_batches]``: each micro-batch's longest padded row, given padded lengths of all samples."""
        if not self.num_batches:
            return np.zeros(0, dtype=np.int64)
        return np.maximum.reduceat(padded[self.rows], self.batch_offsets[:-1])

    def sum_per_batch(self, row_values: np.ndarray) -> np.ndarray:
        """int64 ``[num_batches]``: ``row_values`` (int64 ``[num_rows]``, one per row) summed per micro-batch."""
        cumulative = np.concatenate([[0], np.cumsum(row_values, dtype=np.int64)])
        return cumulative[self.batch_offsets[1:]] - cumulative[self.batch_offsets[:-1]]

    def real_tokens_per_batch(self, lengths: np.ndarray) -> np.ndarray:
        """int64 ``[num_batches]``: real tokens of each micro-batch (fill rows excluded).

        Args:
            lengths: int ``[num_samples]``, tokens per sample as planned (e.g. ``sampler.lengths``).
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        return self.sum_per_batch(np.where(self.is_fill, 0, lengths[self.rows]))

    def real_rows_per_batch(self) -> np.ndarray:
        """int64 ``[num_batches]``: rows of each micro-batch that are not fill rows."""
        return self.sum_per_batch((~self.is_fill).astype(np.int64))

    def mark_rows(self, upto: int, seen: np.ndarray) -> None:
        """Set ``seen`` (bool ``[num_samples]``) at the samples of the real rows (fill rows excluded) of micro-steps
        ``[0, upto)``, all ranks: what those micro-steps trained on."""
        batches = self.assignment[:upto].reshape(-1)
        if not batches.size:
            return
        lo, hi = self.batch_offsets[batches], self.batch_offsets[batches + 1]
        sizes = hi - lo
        # row positions of the chosen micro-batches, without a loop: each run lo..hi-1 laid end to end
        at = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
        seen[self.rows[at[~self.is_fill[at]]]] = True


def padded_lengths(lengths: np.ndarray, pad_to_multiple_of: int) -> np.ndarray:
    """Round each length up to a multiple of ``pad_to_multiple_of`` (tokens, int64)."""
    if pad_to_multiple_of == 1:
        return np.array(lengths, dtype=np.int64)  # a new array, as below
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // pad_to_multiple_of) * pad_to_multiple_of


def longest_first_order(values: np.ndarray) -> np.ndarray:
    """int64 ``[n]``: the indices that sort ``values`` (int ``[n]``, tokens) longest first, ties in index order.

    The same permutation as ``np.argsort(-values, kind="stable")`` (a stable sort's result is unique); values in
    ``[0, 32767]`` (every length below 32,768 tokens) are sorted as int16 keys, which NumPy's stable sort orders by
    a radix sort in linear time instead of a comparison sort.
    """
    values = np.asarray(values)
    if values.size and values.dtype.kind in "iu" and 0 <= int(values.min()) and int(values.max()) <= 32767:
        return np.argsort(-(values.astype(np.int16)), kind="stable").astype(np.int64, copy=False)
    return np.argsort(-values, kind="stable")


def sorted_descending(values: np.ndarray) -> np.ndarray:
    """int64 ``[n]``: ``values`` (int ``[n]``, tokens) sorted longest first; ``values[longest_first_order(values)]``.

    Lengths in ``[0, 2**20]`` are counted (``np.bincount``) and laid out value by value, in linear time.
    """
    values = np.asarray(values)
    if values.size and values.dtype.kind in "iu" and 0 <= int(values.min()) and int(values.max()) <= 1 << 20:
        counts = np.bincount(values)
        present = np.flatnonzero(counts)[::-1]
        return np.repeat(present.astype(np.int64), counts[present])
    return np.sort(np.asarray(values, dtype=np.int64), kind="stable")[::-1].copy()


def empty_plan(num_replicas: int, accumulate_grad_batches: int = 1) -> EpochPlan:
    """An :class:`EpochPlan` with no micro-batch: ``num_micro_steps == 0`` on ``num_replicas`` ranks."""
    z = np.empty(0, dtype=np.int64)
    return EpochPlan(rows=z, is_fill=np.empty(0, dtype=bool), batch_offsets=np.zeros(1, dtype=np.int64),
                     assignment=np.empty((0, num_replicas), dtype=np.int64), dropped=z,
                     accumulate_grad_batches=accumulate_grad_batches)



@dataclass(frozen=True)
class WorstCaseBatch:
    """The largest micro-batch a planner may form from rows of one length under a budget: what the token budget
    probe measures (:meth:`lit_balance.plan.padded.PaddedPlanner.worst_case_batch`, and the packed planner's).

    Attributes:
        rows: tokens of each row (padded layout: every row the given length) or, packed, of each document of the one
            packed row (whole documents of the given length, and the rest of the row as one shorter document).
        slots: padded token slots of the micro-batch (at most the budget).
        squares: the sum of squared row lengths (padded: of padded rows; packed: of documents), tokens**2; attention
            memory grows with it.

    Example:
        >>> WorstCaseBatch(rows=(100, 100), slots=200, squares=20000).slots
        200
    """

    rows: tuple[int, ...]
    slots: int
    squares: int
