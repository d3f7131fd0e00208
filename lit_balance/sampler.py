"""BalancedBatchSampler: token-budgeted, rank-balanced micro-batches for DDP."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from lit_balance._fingerprint import sha256_of
from lit_balance._validate import check_bool as _check_bool
from lit_balance._validate import check_int as _check_int
from lit_balance.cost import CostModel
from lit_balance.planning import EpochPlan, padded_lengths, plan_epoch

__all__ = ["MAX_TOKENS_LIMIT", "STATE_VERSION", "TOO_LONG_POLICIES", "BalancedBatchSampler", "MicroBatch"]

TOO_LONG_POLICIES = ("error", "skip", "truncate")


class MicroBatch(list):
    """A micro-batch: a ``list[int]`` of dataset indices that also carries its fill-row mask.

    Attributes:
        fill: ``tuple[bool, ...]`` of the same length; True marks a fill row, a duplicate that exists
            only to give every rank the same number of micro-batches. Its labels must be ignored.
        step_real_tokens: real tokens (fill rows excluded) of all micro-batches of this micro-batch's
            optimizer step, over all ranks (global, as planned), or None when not known.
        step_rows: rows (fill rows excluded) of those micro-batches, global, or None. A causal language
            model supervises ``step_real_tokens - step_rows`` tokens in that optimizer step.

    It compares equal to the plain list of its indices and survives pickling into DataLoader workers.
    """

    def __init__(self, indices: Sequence[int] = (), fill: Sequence[bool] | None = None,
                 step_real_tokens: int | None = None, step_rows: int | None = None) -> None:
        super().__init__(int(i) for i in indices)
        self.fill = tuple(bool(f) for f in fill) if fill is not None else (False,) * len(self)
        if len(self.fill) != len(self):
            raise ValueError(f"fill mask has {len(self.fill)} entries but the micro-batch has {len(self)} indices")
        self.step_real_tokens = None if step_real_tokens is None else int(step_real_tokens)
        self.step_rows = None if step_rows is None else int(step_rows)


#: Largest accepted sample length and ``max_tokens`` (tokens); larger values are not token counts.
MAX_TOKENS_LIMIT = 2**40


def _validate_lengths(lengths: Any) -> np.ndarray:
    """Return ``lengths`` as int64 ``[num_samples]`` or raise ValueError naming the offending values."""
    hint = "pass integer token counts, e.g. np.asarray(lengths, dtype=np.int64)"
    if np.ma.isMaskedArray(lengths):
        raise ValueError("lengths is a masked array: fill or drop the masked entries first (tokens per sample)")
    if lengths is None or isinstance(lengths, (dict, set, frozenset)):
        raise ValueError(f"lengths must be a 1-D sequence, array or tensor of ints (tokens per sample), got "
                         f"{type(lengths).__name__}{'' if lengths is None else ' (unordered or keyed)'}; {hint}")
    if isinstance(lengths, (str, bytes)) or (not hasattr(lengths, "__len__") and hasattr(lengths, "__iter__")):
        raise ValueError(
            f"lengths must be a 1-D sequence, array or tensor of ints (tokens per sample), got "
            f"{type(lengths).__name__}; e.g. pass list(...) of a generator"
        )
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


#: Version of :meth:`BalancedBatchSampler.state_dict`'s layout.
STATE_VERSION = 1

_PLAN_SETTINGS = ("max_tokens", "shuffle", "seed", "drop_last", "too_long", "pad_to_multiple_of", "max_batch_size",
                  "shuffle_window", "accumulate_grad_batches", "largest_first")


def _check_speeds(rank_speeds: Any, num_replicas: int) -> np.ndarray | None:
    if rank_speeds is None:
        return None
    try:
        ndim = np.ndim(rank_speeds)
    except ValueError:  # ragged nesting
        ndim = -1
    if ndim != 1:
        raise ValueError(f"rank_speeds must be 1-D, one number per rank ({num_replicas}), got {rank_speeds!r}")
    if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
               for x in np.asarray(rank_speeds, dtype=object)):
        raise TypeError(f"rank_speeds must be numbers (relative throughput per rank), got {rank_speeds!r}")
    try:
        speeds = np.asarray(rank_speeds, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"rank_speeds must be a sequence of {num_replicas} positive numbers, got {rank_speeds!r}") from exc
    if speeds.shape[0] != num_replicas or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
        raise ValueError(
            f"rank_speeds must hold {num_replicas} finite numbers > 0 (one relative throughput per rank), "
            f"got {rank_speeds!r}; pass None for equal ranks"
        )
    return speeds / speeds.max()


def _check_cost_model(cost_model: Any) -> CostModel:
    if cost_model is None:
        return CostModel()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a lit_balance.CostModel or None, got {type(cost_model).__name__}")
    return cost_model


class BalancedBatchSampler(DistributedSampler):
    """Token-budgeted micro-batches of equal cost, the same count on every rank, resumable mid-epoch.

    Yields, for this ``rank``, one micro-batch (a :class:`MicroBatch`, i.e. ``list[int]`` of dataset
    indices) per micro-step. Use it as ``DataLoader(dataset, batch_sampler=sampler)`` or, so that Lightning
    neither replaces it nor forgets ``set_epoch`` under the default ``use_distributed_sampler=True``,
    as ``DataLoader(dataset, sampler=sampler, batch_size=None)`` with a dataset whose ``__getitem__``
    accepts a list of indices. It subclasses :class:`~torch.utils.data.distributed.DistributedSampler`
    because it already shards the data over ranks, which is how Lightning and Fabric recognise such a
    sampler; it calls none of the parent's code.

    Guarantees, per epoch:

    * **Budget.** Every micro-batch ``b`` has ``len(b) * padded(max(lengths[b])) <= max_tokens``, where
      ``padded`` rounds up to a multiple of ``pad_to_multiple_of``; ``max_tokens`` counts padded slots.
    * **Equal counts.** Every rank yields exactly ``len(self)`` micro-batches.
    * **Balanced cost.** The ``num_replicas * accumulate_grad_batches`` micro-batches of each optimizer step
      are formed to about the same cost (``cost_model``) and spread so that every rank's summed cost per
      optimizer step is about equal (or proportional to ``rank_speeds``).
    * **Nothing lost.** With ``drop_last=False`` every eligible index appears on some rank; duplicates
      (fill rows, marked in :attr:`MicroBatch.fill`) appear only when there are fewer samples than
      micro-batches needed, at most ``num_replicas - 1`` per epoch. With ``drop_last=True`` there are no
      duplicates and only the samples that cannot be placed are dropped (:attr:`num_dropped`).
    * **Determinism.** The plan depends only on (lengths, arguments, epoch, cost model, speeds), never on
      global RNG state or the process; every rank computes the same global plan and keeps its own column.
    * **Exact resume.** :meth:`state_dict` / :meth:`load_state_dict` continue an epoch where it stopped,
      also on a different number of ranks.

    See :mod:`lit_balance.planning` for how the plan is made and the algorithms it follows.

    Args:
        lengths: 1-D sequence, array or tensor of ints ``[num_samples]``: tokens per sample.
        max_tokens: padded token slots per micro-batch (rows x longest padded row), per rank: a hard cap.
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
        shuffle_window: the knob that trades padding for randomness: with ``shuffle``, each sample's place in
            the longest-first order moves later by a random amount of up to this many micro-batches' worth
            of tokens before micro-batches are cut. 0 shuffles only equal lengths (least padding, batch-mates
            change least); 1 mixes lengths about one micro-batch apart. See the README for measured figures.
        cost_model: cost of a micro-batch (:class:`~lit_balance.cost.CostModel`); default: padded tokens.
        accumulate_grad_batches: micro-batches per rank per optimizer step that the plan balances together
            (set it to the Trainer's value); each yielded micro-batch then also carries its optimizer step's
            global real tokens and rows.
        rank_speeds: ``[num_replicas]`` relative throughput of each rank (e.g. ``[1.0, 0.67]`` when rank 1
            is 1.5x slower), or None for equal ranks. With equal ranks the number of micro-batches per epoch
            depends only on the lengths and settings (never on the epoch or the cost model); unequal speeds
            can need more (the fast ranks' larger shares must stay within ``max_tokens``), so under
            Lightning reload the train dataloader every epoch (``reload_dataloaders_every_n_epochs=1``).
        largest_first: put the optimizer step that holds the epoch's longest sample first, so that an
            out-of-memory error shows at the first step.

    Raises:
        ValueError: ``lengths`` empty, not 1-D, not integers, or with a value < 1; ``max_tokens < 1``;
            ``rank`` outside ``[0, num_replicas)``; unknown ``too_long``; a length or ``max_tokens`` above
            :data:`MAX_TOKENS_LIMIT`; a negative ``seed``; a too-long sample with
            ``too_long="error"`` (naming its index, length and ``max_tokens``); ``pad_to_multiple_of`` above
            ``max_tokens``; ``shuffle_window`` negative or not finite; ``rank_speeds`` of the wrong length or
            not positive; no sample left to plan.
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
        shuffle_window: float = 0.25,
        cost_model: CostModel | None = None,
        accumulate_grad_batches: int = 1,
        rank_speeds: Sequence[float] | None = None,
        largest_first: bool = False,
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
        if (isinstance(shuffle_window, (bool, np.bool_))
                or not isinstance(shuffle_window, (int, float, np.integer, np.floating))
                or not np.isfinite(shuffle_window) or shuffle_window < 0):
            raise ValueError(
                f"shuffle_window must be a finite number >= 0 (micro-batches), got {shuffle_window!r}; "
                "0 shuffles only equal lengths"
            )
        if max_batch_size is not None:
            max_batch_size = _check_int("max_batch_size", max_batch_size, 1, "or pass None for no row cap")
        if too_long not in TOO_LONG_POLICIES:
            raise ValueError(f"too_long must be one of {TOO_LONG_POLICIES}, got {too_long!r}")
        seed = _check_int("seed", seed, 0, "pass a non-negative int seed, the same on every rank")
        shuffle = _check_bool("shuffle", shuffle)
        drop_last = _check_bool("drop_last", drop_last)
        largest_first = _check_bool("largest_first", largest_first)
        accumulate_grad_batches = _check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                                             "pass the Trainer's accumulate_grad_batches (1 for none)")
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
        self.shuffle_window = float(shuffle_window)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.largest_first = largest_first
        #: Cost model and relative rank speeds of the current epoch's plan (see :meth:`set_cost_model`).
        self.cost_model = _check_cost_model(cost_model)
        self.rank_speeds = _check_speeds(rank_speeds, num_replicas)
        self._pending: tuple[CostModel, np.ndarray | None] | None = None
        self._first_speeds: np.ndarray | None = None  # speeds the epoch's first segment ran with, after a resize
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
        self._lengths_sha256 = sha256_of(np.ascontiguousarray(lengths_arr, dtype="<i8").tobytes())
        #: int64 indices of samples left out by ``too_long="skip"`` (every epoch).
        self.skipped_indices = np.flatnonzero(too_long_mask) if too_long == "skip" else np.empty(0, np.int64)
        if self.skipped_indices.size == lengths_arr.size:
            raise ValueError(
                f"all {lengths_arr.size} samples exceed max_tokens={max_tokens} and too_long='skip' leaves none; "
                "raise max_tokens"
            )
        # Resume: the epoch's history as [num_replicas, micro-steps consumed] segments (see state_dict).
        self._segments: list[list[int]] = []
        self._cursor = 0  # micro-steps of the current plan yielded by the latest iterator
        self._cached: tuple[tuple, EpochPlan] | None = None
        if len(self) == 0:
            raise ValueError(
                f"drop_last=True with {lengths_arr.size - self.skipped_indices.size} sample(s) and "
                f"num_replicas={num_replicas} leaves no micro-batch for any rank; set drop_last=False"
            )

    # ----------------------------------------------------------------------------------------------
    def _plan_for(self, epoch: int, num_replicas: int, eligible: np.ndarray | None,
                  speeds: np.ndarray | None, min_steps: int = 0) -> EpochPlan:
        return plan_epoch(
            self.lengths,
            self.max_tokens,
            num_replicas=num_replicas,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            pad_to_multiple_of=self.pad_to_multiple_of,
            max_batch_size=self.max_batch_size,
            eligible=eligible,
            shuffle_window=self.shuffle_window,
            cost_model=self.cost_model,
            accumulate_grad_batches=self.accumulate_grad_batches,
            rank_speeds=speeds,
            largest_first=self.largest_first,
            min_steps=min_steps,
        )

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Return the global plan (all ranks) of ``epoch`` (default: the current epoch).

        After :meth:`load_state_dict` with a different ``num_replicas``, the current epoch's plan is the
        plan of the samples the saved run had not yet consumed, over the new ranks.
        """
        epoch = self.epoch if epoch is None else _check_int("epoch", epoch, 0, "epochs count from 0")
        segments = self._segments if epoch == self.epoch else []
        key = (epoch, tuple(map(tuple, segments)), self.cost_model,
               None if self.rank_speeds is None else tuple(self.rank_speeds),
               None if self._first_speeds is None else tuple(self._first_speeds))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._replay(epoch, segments))
        return self._cached[1]

    def _segment_plan(self, epoch: int, segments: list[list[int]], i: int, eligible: np.ndarray | None) -> EpochPlan:
        """The plan segment ``i`` of the epoch ran (or runs) on, given the samples still eligible then."""
        replicas = segments[i][0]
        if i == 0:
            speeds = self.rank_speeds if len(segments) <= 1 else self._first_speeds
            return self._plan_for(epoch, replicas, eligible, speeds)
        # The rest of the epoch on new ranks: at least as many micro-steps as a whole epoch on them has, counting
        # those consumed before, so the epoch is never shorter than the next (a training loop that fixed its
        # epoch length at the resume keeps every micro-batch of later epochs).
        full = self._plan_for(epoch, replicas, self._eligible, None).num_steps
        earlier = sum(consumed for _, consumed in segments[:i])
        return self._plan_for(epoch, replicas, eligible, None, min_steps=full - earlier)

    def _replay(self, epoch: int, segments: list[list[int]]) -> EpochPlan:
        """Plan of the last segment: each earlier segment's plan, rebuilt as it ran, removes what it consumed."""
        segments = segments or [[self.num_replicas, 0]]
        eligible = self._eligible
        for i in range(len(segments)):
            plan = self._segment_plan(epoch, segments, i, eligible)
            if i == len(segments) - 1:
                return plan
            if segments[i][1] > plan.num_steps:
                raise ValueError(
                    f"the saved state consumed {segments[i][1]} micro-steps of epoch {epoch} on {segments[i][0]} "
                    f"rank(s), but that plan has only {plan.num_steps}: the state does not belong to this sampler"
                )
            seen = np.zeros(self.lengths.shape[0], dtype=bool)
            for b in plan.assignment[:segments[i][1]].reshape(-1):
                rows, fill = plan.batch(int(b))
                seen[rows[~fill]] = True
            eligible = (np.ones_like(seen) if eligible is None else eligible) & ~seen
            if not eligible.any():
                return _empty_plan(self.num_replicas, self.accumulate_grad_batches)
        raise AssertionError("unreachable")  # pragma: no cover

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to plan; with ``shuffle=True`` each epoch has its own composition and order.

        Moving to another epoch starts it from its first micro-batch and applies a cost model or rank speeds
        handed over by :meth:`set_cost_model`; setting the current epoch again changes nothing (so a resumed
        epoch keeps its position).

        Raises:
            ValueError: ``epoch`` is negative.
        """
        epoch = _check_int("epoch", epoch, 0, "epochs count from 0")
        if epoch != self.epoch:
            self._segments = []
            self._first_speeds = None
            self._cursor = 0
            if self._pending is not None:
                self.cost_model, self.rank_speeds = self._pending
                self._pending = None
        self.epoch = epoch

    def set_cost_model(self, cost_model: CostModel, rank_speeds: Sequence[float] | None = None) -> None:
        """Hand over a (measured) cost model and per-rank relative speeds for the NEXT epoch's plan.

        The current epoch's plan never changes mid-epoch, so resume stays exact; the new values apply at the
        next :meth:`set_epoch` to another epoch and are saved by :meth:`state_dict` meanwhile. Call it with the
        same values on every rank (e.g. from timings gathered over all ranks). A new cost model keeps the epoch
        length; unequal ``rank_speeds`` can lengthen it (see the class docstring).

        Args:
            cost_model: the cost of a micro-batch, e.g. :meth:`CostModel.fit` of measured seconds.
            rank_speeds: ``[num_replicas]`` relative throughput per rank, or None for equal ranks.

        Raises:
            TypeError: ``cost_model`` is not a :class:`~lit_balance.cost.CostModel`.
            ValueError: ``rank_speeds`` of the wrong length or not all positive.
        """
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a lit_balance.CostModel, got {type(cost_model).__name__}")
        self._pending = (cost_model, _check_speeds(rank_speeds, self.num_replicas))

    def _offset(self) -> int:
        """Micro-steps of the current plan already consumed before this sampler was restored."""
        return self._segments[-1][1] if self._segments else 0

    def __len__(self) -> int:
        """Micro-batches this rank yields in the current epoch (the same on every rank).

        After a resume this counts the micro-batches consumed before the checkpoint too, so that a training
        loop that counts batches from the start of the epoch ends it at the right place.
        """
        earlier = sum(consumed for _, consumed in self._segments[:-1])
        return earlier + self.plan().num_steps

    def __iter__(self) -> Iterator[MicroBatch]:
        # The position moves back to the start now, so state_dict() of a fresh iterator is its start; the plan
        # is read at the first next(), after any set_epoch() (Lightning creates the iterator before it).
        self._cursor = self._offset()
        return self._iterate()

    def _iterate(self) -> Iterator[MicroBatch]:
        plan = self.plan()
        column = plan.assignment[:, self.rank]
        start = self._offset()
        self._cursor = start
        step_tokens, step_rows = _step_totals(plan, self.lengths)
        accumulate = plan.accumulate_grad_batches
        for s in range(start, plan.num_steps):
            idx, fill = plan.batch(int(column[s]))
            group = s // accumulate
            self._cursor = s + 1
            yield MicroBatch(idx.tolist(), fill.tolist(), int(step_tokens[group]), int(step_rows[group]))

    # ----------------------------------------------------------------------------------------------
    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Position and plan inputs as plain Python types; the same on every rank.

        Args:
            batches_consumed: micro-batches of the current epoch consumed by training, counted from the
                start of the epoch (e.g. Lightning's ``batch_progress.current.ready``); default: those
                yielded by the latest iterator. Pass it when a DataLoader's workers run ahead of training.

        Returns:
            ``{"version", "epoch", "segments", "num_samples", "lengths_sha256", "settings", "cost_model",
            "rank_speeds", "first_rank_speeds", "pending"}``: ``segments`` is the epoch's history as ``[num_replicas,
            micro-steps consumed]`` pairs (more than one after a resume on a different number of ranks).
            Once the whole epoch is consumed, the state is the start of the next epoch. Loads with
            ``torch.load(weights_only=True)``.

        Raises:
            ValueError: ``batches_consumed`` negative or beyond the epoch.
        """
        earlier = sum(consumed for _, consumed in self._segments[:-1])
        if batches_consumed is None:
            current = self._cursor
        else:
            batches_consumed = _check_int("batches_consumed", batches_consumed, 0, "count from the epoch start")
            if batches_consumed < earlier or batches_consumed > len(self):
                raise ValueError(
                    f"batches_consumed must be in [{earlier}, {len(self)}] for epoch {self.epoch}, got {batches_consumed}"
                )
            current = batches_consumed - earlier
        segments = [list(seg) for seg in self._segments[:-1]] + [[self.num_replicas, int(current)]]
        epoch, cost_model, speeds, pending = self.epoch, self.cost_model, self.rank_speeds, self._pending
        first_speeds = self._first_speeds if len(self._segments) > 1 else speeds
        if current >= self.plan().num_steps:  # the epoch is done: the state is the start of the next one
            epoch, segments = epoch + 1, [[self.num_replicas, 0]]
            first_speeds = None
            if pending is not None:
                (cost_model, speeds), pending = pending, None

        def plain(speeds: np.ndarray | None) -> list[float] | None:
            return None if speeds is None else [float(x) for x in speeds]

        return {
            "version": STATE_VERSION,
            "epoch": int(epoch),
            "segments": segments,
            "num_samples": int(self.lengths.shape[0]),
            "lengths_sha256": self._lengths_sha256,
            "settings": {name: getattr(self, name) for name in _PLAN_SETTINGS},
            "cost_model": cost_model.to_dict(),
            "rank_speeds": plain(speeds),
            "first_rank_speeds": plain(first_speeds),
            "pending": None if pending is None else {"cost_model": pending[0].to_dict(), "rank_speeds": plain(pending[1])},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next iterator yields exactly the micro-batches an
        uninterrupted run would have yielded from there on, then full later epochs.

        Rule for a different ``num_replicas``: the rest of the saved epoch is re-planned over the new ranks
        from the samples not yet consumed (nothing lost, nothing repeated beyond marked fill rows); rank
        speeds of the old ranks are dropped (equal ranks) until the next :meth:`set_cost_model`.

        Raises:
            ValueError: unknown or missing keys, another ``version``, different lengths (count or content) or
                different planning settings (naming each one with both values).
            TypeError: ``state_dict`` is not a dict.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from BalancedBatchSampler.state_dict(), got "
                            f"{type(state_dict).__name__}")
        expected = {"version", "epoch", "segments", "num_samples", "lengths_sha256", "settings", "cost_model",
                    "rank_speeds", "first_rank_speeds", "pending"}
        if set(state_dict) != expected:
            missing, unknown = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            raise ValueError(f"sampler state_dict keys do not match: missing {missing}, unknown {unknown}")
        if state_dict["version"] != STATE_VERSION:
            raise ValueError(f"sampler state_dict version {state_dict['version']!r} is not supported "
                             f"(this version reads {STATE_VERSION})")
        if state_dict["num_samples"] != self.lengths.shape[0] or state_dict["lengths_sha256"] != self._lengths_sha256:
            raise ValueError(
                f"the saved sampler planned {state_dict['num_samples']} samples with other lengths than this one "
                f"({self.lengths.shape[0]} samples): resume needs the same dataset and tokenization"
            )
        saved = state_dict["settings"]
        if set(saved) != set(_PLAN_SETTINGS):
            raise ValueError(f"sampler state_dict settings must have keys {sorted(_PLAN_SETTINGS)}, got {sorted(saved)}")
        diff = [f"{k}: saved {saved[k]!r}, now {getattr(self, k)!r}" for k in _PLAN_SETTINGS if saved[k] != getattr(self, k)]
        if diff:
            raise ValueError("cannot resume: the sampler's settings differ from the saved ones (" + "; ".join(diff)
                             + "); construct the sampler with the saved settings")
        raw = state_dict["segments"]
        if (not isinstance(raw, (list, tuple))
                or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in raw)
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                           for p in raw for v in p)):
            raise ValueError(f"sampler state_dict segments must be a list of [num_replicas, consumed] int pairs, "
                             f"got {raw!r}")
        segments = [[int(r), int(c)] for r, c in raw]
        if not segments or any(r < 1 or c < 0 for r, c in segments):
            raise ValueError(f"sampler state_dict segments must be [num_replicas >= 1, consumed >= 0] pairs, got {segments}")
        epoch = _check_int("epoch", state_dict["epoch"], 0, "epochs count from 0")
        pending = state_dict["pending"]
        if pending is not None and (not isinstance(pending, dict) or set(pending) != {"cost_model", "rank_speeds"}):
            raise ValueError(f"sampler state_dict pending must be None or a dict with keys cost_model, rank_speeds; "
                             f"got {pending!r}")
        try:
            cost_model = CostModel(**state_dict["cost_model"])
            pending_model = None if pending is None else CostModel(**pending["cost_model"])
        except TypeError as exc:
            raise ValueError(f"sampler state_dict cost_model must have keys linear, quadratic, per_batch: {exc}") from exc
        speeds = state_dict["rank_speeds"]
        first = state_dict["first_rank_speeds"]
        first_speeds = None if first is None else _check_speeds(first, segments[0][0])
        resized = segments[-1][0] != self.num_replicas
        if resized:
            if len(segments) == 1:
                first_speeds = None if speeds is None else _check_speeds(speeds, segments[0][0])
            segments.append([self.num_replicas, 0])
            speeds = None  # the old ranks' speeds say nothing about the new ones
        rank_speeds = _check_speeds(speeds, self.num_replicas)
        pending_pair = None
        if pending is not None:
            pending_speeds = pending["rank_speeds"]
            if resized:  # speeds measured on the old ranks
                pending_speeds = None
            pending_pair = (pending_model, _check_speeds(pending_speeds, self.num_replicas))
        names = ("epoch", "cost_model", "rank_speeds", "_pending", "_segments", "_first_speeds", "_cached", "_cursor")
        before = {name: getattr(self, name) for name in names}
        try:  # all or nothing: a state that does not fit leaves the sampler as it was
            self.epoch, self.cost_model, self.rank_speeds, self._pending = epoch, cost_model, rank_speeds, pending_pair
            self._segments, self._first_speeds, self._cached = segments, first_speeds if len(segments) > 1 else None, None
            plan = self.plan()
            if segments[-1][1] > plan.num_steps:
                raise ValueError(
                    f"the saved state consumed {segments[-1][1]} micro-steps of epoch {epoch}, but its plan has only "
                    f"{plan.num_steps}: the state does not belong to this sampler's plan"
                )
            self._cursor = segments[-1][1]
        except Exception:
            for name, value in before.items():
                setattr(self, name, value)
            raise

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


def _empty_plan(num_replicas: int, accumulate: int) -> EpochPlan:
    z = np.empty(0, dtype=np.int64)
    return EpochPlan(rows=z, is_fill=np.empty(0, dtype=bool), batch_offsets=np.zeros(1, dtype=np.int64),
                     assignment=np.empty((0, num_replicas), dtype=np.int64), dropped=z,
                     accumulate_grad_batches=accumulate)


def _step_totals(plan: EpochPlan, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per optimizer step: real tokens and rows (fill rows excluded) over all ranks (int64 each)."""
    num_batches = plan.num_batches
    if not num_batches:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    real = ~plan.is_fill
    row_batch = np.repeat(np.arange(num_batches), np.diff(plan.batch_offsets))
    tokens = np.bincount(row_batch[real], weights=lengths[plan.rows[real]], minlength=num_batches)
    rows = np.bincount(row_batch[real], minlength=num_batches)
    group = np.arange(plan.num_steps) // plan.accumulate_grad_batches
    num_groups = int(group[-1]) + 1 if group.size else 0
    step_tokens = np.zeros(num_groups, dtype=np.int64)
    step_rows = np.zeros(num_groups, dtype=np.int64)
    np.add.at(step_tokens, group, tokens[plan.assignment].sum(axis=1).astype(np.int64))
    np.add.at(step_rows, group, rows[plan.assignment].sum(axis=1))
    return step_tokens, step_rows
