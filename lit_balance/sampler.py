"""BalancedBatchSampler: token-budgeted, rank-balanced micro-batches for DDP."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from lit_balance._validate import check_bool as _check_bool
from lit_balance._validate import check_int as _check_int
from lit_balance.planning import EpochPlan, padded_lengths, plan_epoch

__all__ = ["MAX_TOKENS_LIMIT", "TOO_LONG_POLICIES", "BalancedBatchSampler", "MicroBatch"]

TOO_LONG_POLICIES = ("error", "skip", "truncate")


class MicroBatch(list):
    """A micro-batch: a ``list[int]`` of dataset indices that also carries its fill-row mask.

    Attributes:
        fill: ``tuple[bool, ...]`` of the same length; True marks a fill row, a duplicate that exists
            only to give every rank the same number of micro-batches. Its labels must be ignored.

    It compares equal to the plain list of its indices and survives pickling into DataLoader workers.
    """

    def __init__(self, indices: Sequence[int] = (), fill: Sequence[bool] | None = None) -> None:
        super().__init__(int(i) for i in indices)
        self.fill = tuple(bool(f) for f in fill) if fill is not None else (False,) * len(self)
        if len(self.fill) != len(self):
            raise ValueError(f"fill mask has {len(self.fill)} entries but the micro-batch has {len(self)} indices")


#: Largest accepted sample length and ``max_tokens`` (tokens); larger values are not token counts.
MAX_TOKENS_LIMIT = 2**40


def _validate_lengths(lengths: Any) -> np.ndarray:
    """Return ``lengths`` as int64 ``[num_samples]`` or raise ValueError naming the offending values."""
    hint = "pass integer token counts, e.g. np.asarray(lengths, dtype=np.int64)"
    if isinstance(lengths, torch.Tensor):
        t = lengths.detach().cpu()
        lengths = t.numpy() if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) else t.tolist()
    if isinstance(lengths, (list, tuple)):
        for i, v in enumerate(lengths):
            if isinstance(v, (bool, np.bool_)):
                raise ValueError(
                    f"lengths must be integers (tokens per sample); index {i} holds the bool {v!r}; {hint}"
                )
    try:
        arr = np.asarray(lengths)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"lengths must be a 1-D sequence of ints (tokens per sample); could not read it: {exc}"
        ) from exc
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D (tokens per sample), got an array of shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("lengths is empty: expected at least one sample length (tokens per sample), got []")
    if arr.dtype.kind not in "iu":  # floats, bools, objects: accept only Python/numpy ints, name the first other
        values = arr.tolist()
        integral = [not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))
                    for v in values]
        i = integral.index(False) if False in integral else next(
            (k for k, v in enumerate(values) if not isinstance(v, int)), None)
        if i is not None:  # the first non-integral value, else the first integral float
            raise ValueError(
                f"lengths must be integers (tokens per sample); index {i} holds {values[i]!r} "
                f"({type(values[i]).__name__}, array dtype {arr.dtype}); {hint}"
            )
        for i, v in enumerate(values):
            if not 1 <= v <= MAX_TOKENS_LIMIT:
                break
        else:
            return np.asarray(values, dtype=np.int64)
        raise ValueError(f"every length must be in [1, {MAX_TOKENS_LIMIT}] tokens; index {i} holds {v}")
    bad = np.flatnonzero((arr < 1) | (arr > MAX_TOKENS_LIMIT))
    if bad.size:
        shown = ", ".join(f"index {i}: {arr[i]}" for i in bad[:5])
        raise ValueError(
            f"every length must be in [1, {MAX_TOKENS_LIMIT}] tokens; {bad.size} are not "
            f"({shown}{', ...' if bad.size > 5 else ''}); a length counts tokens per sample: "
            "drop empty samples, check the array"
        )
    return arr.astype(np.int64)


class BalancedBatchSampler(DistributedSampler):
    """Token-budgeted, length-bucketed micro-batches with the same count on every rank.

    Yields, for this ``rank``, one micro-batch (a :class:`MicroBatch`, i.e. ``list[int]`` of dataset
    indices) per step. Use it as ``DataLoader(dataset, batch_sampler=sampler)`` or, so that Lightning
    neither replaces it nor forgets ``set_epoch`` under the default ``use_distributed_sampler=True``,
    as ``DataLoader(dataset, sampler=sampler, batch_size=None)`` with a dataset whose ``__getitem__``
    accepts a list of indices. It subclasses :class:`~torch.utils.data.distributed.DistributedSampler`
    because it already shards the data over ranks, which is how Lightning and Fabric recognise such a
    sampler; it calls none of the parent's code.

    Guarantees, per epoch:

    * **Budget.** Every micro-batch ``b`` has ``len(b) * padded(max(lengths[b])) <= max_tokens``, where
      ``padded`` rounds up to a multiple of ``pad_to_multiple_of``; ``max_tokens`` counts padded slots.
    * **Equal counts.** Every rank yields exactly ``len(self)`` micro-batches.
    * **Nothing lost.** With ``drop_last=False`` every eligible index appears on some rank; duplicates
      (fill rows, marked in :attr:`MicroBatch.fill`) appear only when there are fewer samples than
      micro-batches needed, at most ``num_replicas - 1`` per epoch. With ``drop_last=True`` there are no
      duplicates and only the samples that cannot be placed are dropped (:attr:`num_dropped`).
    * **Determinism.** The plan depends only on (lengths, arguments, epoch), never on global RNG state
      or the process; every rank computes the same global plan and keeps its own column.

    Planning (see :mod:`lit_balance.planning`): samples sorted by padded length (with ``shuffle``, in
    random order within buckets of ``length_tolerance``) are cut into the fewest contiguous micro-batches
    that fit the budget at each bucket's longest length, as in fairseq's ``batch_by_size``; micro-batches
    are split in half until their count is a multiple of ``num_replicas``; consecutive micro-batches of
    similar cost (padded slots) form one step, one per rank.

    Args:
        lengths: 1-D sequence, array or tensor of ints ``[num_samples]``: tokens per sample.
        max_tokens: padded token slots per micro-batch (rows x longest padded row), per rank.
        num_replicas: number of ranks; defaults to the initialised process group's world size, else 1.
        rank: this process's rank in ``[0, num_replicas)``; defaults to the process group's rank, else 0.
        shuffle: change batch composition and order every epoch (see :meth:`set_epoch`).
        seed: base seed, the same on every rank.
        drop_last: drop instead of duplicate when samples are too few for equal counts.
        too_long: what to do with a sample whose padded length exceeds ``max_tokens``: ``"error"``
            raises at construction, ``"skip"`` leaves it out (:attr:`num_skipped`), ``"truncate"`` keeps it
            at the largest multiple of ``pad_to_multiple_of`` that fits (:attr:`truncate_to` tokens; the
            collator must truncate it too).
        pad_to_multiple_of: rows are padded to a multiple of this many tokens.
        max_batch_size: maximum rows per micro-batch, or None.
        length_tolerance: with ``shuffle``, lengths within a factor ``1 + length_tolerance`` are shuffled
            together before micro-batches are cut, so composition changes every epoch even when no two
            lengths are equal; costs at most about that share of padding. 0 shuffles only equal lengths.

    Raises:
        ValueError: ``lengths`` empty, not 1-D, not integers, or with a value < 1; ``max_tokens < 1``;
            ``rank`` outside ``[0, num_replicas)``; unknown ``too_long``; a length or ``max_tokens`` above
            :data:`MAX_TOKENS_LIMIT`; a negative ``seed``; a too-long sample with
            ``too_long="error"`` (naming its index, length and ``max_tokens``); ``pad_to_multiple_of`` above
            ``max_tokens``; no sample left to plan.
        TypeError: an argument of the wrong type (e.g. ``shuffle="false"``).

    Example:
        >>> sampler = BalancedBatchSampler([95] * 5 + [20] * 5, max_tokens=100, num_replicas=2, rank=0,
        ...                                shuffle=False)
        >>> len(sampler), list(sampler)
        (3, [[5, 6, 7, 8, 9], [1], [3]])
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        too_long: str = "error",
        pad_to_multiple_of: int = 1,
        max_batch_size: int | None = None,
        length_tolerance: float = 0.03,
    ) -> None:
        lengths_arr = _validate_lengths(lengths)
        max_tokens = _check_int("max_tokens", max_tokens, 1, "set max_tokens to the padded token slots per micro-batch",
                                MAX_TOKENS_LIMIT)
        pad_to_multiple_of = _check_int("pad_to_multiple_of", pad_to_multiple_of, 1, "use 1 for no rounding")
        if pad_to_multiple_of > max_tokens:
            raise ValueError(
                f"pad_to_multiple_of ({pad_to_multiple_of}) exceeds max_tokens ({max_tokens}): no row would fit; "
                "lower pad_to_multiple_of or raise max_tokens"
            )
        if (isinstance(length_tolerance, (bool, np.bool_))
                or not isinstance(length_tolerance, (int, float, np.floating)) or not 0 <= length_tolerance <= 1):
            raise ValueError(f"length_tolerance must be a number in [0, 1], got {length_tolerance!r}")
        if max_batch_size is not None:
            max_batch_size = _check_int("max_batch_size", max_batch_size, 1, "or pass None for no row cap")
        if too_long not in TOO_LONG_POLICIES:
            raise ValueError(f"too_long must be one of {TOO_LONG_POLICIES}, got {too_long!r}")
        seed = _check_int("seed", seed, 0, "pass a non-negative int seed, the same on every rank")
        shuffle = _check_bool("shuffle", shuffle)
        drop_last = _check_bool("drop_last", drop_last)
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        num_replicas = _check_int("num_replicas", num_replicas, 1, "pass the world size")
        rank = _check_int("rank", rank, 0, "pass this process's global rank")
        if rank >= num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas) = [0, {num_replicas}), got rank={rank}")

        self.max_tokens = max_tokens
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.too_long = too_long
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_batch_size = max_batch_size
        self.length_tolerance = float(length_tolerance)
        self.epoch = 0
        self.dataset = None  # DistributedSampler attribute; this sampler works on lengths only
        #: Longest length (tokens) that fits the budget once padded: max_tokens rounded down to the multiple.
        self.truncate_to = (max_tokens // pad_to_multiple_of) * pad_to_multiple_of

        too_long_mask = padded_lengths(lengths_arr, pad_to_multiple_of) > max_tokens
        self._eligible: np.ndarray | None = None
        if too_long_mask.any():
            bad = np.flatnonzero(too_long_mask)
            if too_long == "error":
                shown = ", ".join(f"index {i}: {lengths_arr[i]} tokens" for i in bad[:5])
                raise ValueError(
                    f"{bad.size} sample(s) exceed max_tokens={max_tokens} padded token slots "
                    f"(pad_to_multiple_of={pad_to_multiple_of}): {shown}{', ...' if bad.size > 5 else ''}; "
                    'raise max_tokens, truncate the data, or pass too_long="skip" or "truncate"'
                )
            if too_long == "skip":
                self._eligible = ~too_long_mask
            else:
                lengths_arr = np.minimum(lengths_arr, self.truncate_to)
        #: int64 ``[num_samples]``: tokens per sample as planned (after truncation).
        self.lengths = lengths_arr
        #: int64 indices of samples left out by ``too_long="skip"`` (every epoch).
        self.skipped_indices = np.flatnonzero(too_long_mask) if too_long == "skip" else np.empty(0, np.int64)
        if self.skipped_indices.size == lengths_arr.size:
            raise ValueError(
                f"all {lengths_arr.size} samples exceed max_tokens={max_tokens} and too_long='skip' leaves none; "
                "raise max_tokens"
            )
        self._cached: tuple[int, EpochPlan] | None = None
        if len(self) == 0:
            raise ValueError(
                f"drop_last=True with {lengths_arr.size - self.skipped_indices.size} sample(s) and "
                f"num_replicas={num_replicas} leaves no micro-batch for any rank; set drop_last=False"
            )

    # ----------------------------------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Return the global plan (all ranks) of ``epoch`` (default: the current epoch)."""
        epoch = self.epoch if epoch is None else _check_int("epoch", epoch, 0, "epochs count from 0")
        if self._cached is None or self._cached[0] != epoch:
            plan = plan_epoch(
                self.lengths,
                self.max_tokens,
                num_replicas=self.num_replicas,
                seed=self.seed,
                epoch=epoch,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
                pad_to_multiple_of=self.pad_to_multiple_of,
                max_batch_size=self.max_batch_size,
                eligible=self._eligible,
                length_tolerance=self.length_tolerance,
            )
            self._cached = (epoch, plan)
        return self._cached[1]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to plan; with ``shuffle=True`` each epoch has its own composition and order.

        Raises:
            ValueError: ``epoch`` is negative.
        """
        epoch = _check_int("epoch", epoch, 0, "epochs count from 0")
        self.epoch = epoch

    def __len__(self) -> int:
        """Micro-batches this rank yields in the current epoch (the same on every rank)."""
        return self.plan().num_steps

    def __iter__(self) -> Iterator[MicroBatch]:
        plan = self.plan()
        column = plan.assignment[:, self.rank]
        for b in column:
            idx, fill = plan.batch(int(b))
            yield MicroBatch(idx.tolist(), fill.tolist())

    # ----------------------------------------------------------------------------------------------
    @property
    def num_skipped(self) -> int:
        """Samples left out every epoch by ``too_long="skip"`` (global count)."""
        return int(self.skipped_indices.size)

    @property
    def num_dropped(self) -> int:
        """Samples dropped in the current epoch by ``drop_last=True`` (global count)."""
        return int(self.plan().dropped.size)

    @property
    def num_fill_rows(self) -> int:
        """Fill rows (marked duplicates) in the current epoch over all ranks (at most ``num_replicas - 1``)."""
        return int(self.plan().is_fill.sum())
