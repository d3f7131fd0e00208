"""Resume state of :class:`~lit_balance.BalancedBatchSampler`: the replay record, its plain-dict round trip, replay.

A sampler's position is a :class:`ReplayRecord`: its epoch, the cost model and rank speeds its plans use, and the
epoch's history as *segments*, ``[num_replicas, micro-steps consumed]`` pairs: one segment for an epoch that ran on
one world size, one more for each resume on a different number of ranks. The plan a segment ran is rebuilt from the
same inputs (:class:`~lit_balance.sampler.inputs.PlanInputs`, the record, the ranks), so the state never stores
indices; replaying the segments in turn (:func:`replay`) removes what each one consumed and leaves the plan of the
rest of the epoch.

The state dict holds plain Python types only (it loads with ``torch.load(weights_only=True)``) and is the same on
every rank. Layout (version :data:`STATE_VERSION`)::

    {"version": 1, "epoch": int, "segments": [[num_replicas, consumed], ...],
     "num_samples": int, "lengths_sha256": str, "settings": BatchingSettings.to_dict(),
     "cost_model": cost_model.to_dict(), "rank_speeds": [float] | None, "first_rank_speeds": [float] | None,
     "pending": None | {"cost_model": cost_model.to_dict(), "rank_speeds": [float] | None},
     "cost_model_class": "lit_balance.CostModel" | "module.QualifiedName",
     "segment_max_tokens": [int | [int, ...], ...], "segment_padded_shapes": [[[rows, length], ...], ...],
     "skip_micro_steps": [[first, end], ...], "skip_steps": [[a, b], ...], "first_optimizer_step": int | None}

``skip_steps`` (present only when the run skips optimizer steps, :meth:`BalancedBatchSampler.skip_steps`) holds every
range given so far as optimizer steps of the run (``[a, b)``, any epoch, past ones included, so a range given again
after a further restart is recognised); ``first_optimizer_step`` the optimizer steps of the run before the current
epoch (the plan's: skipped ones counted; None when the sampler was moved to the epoch without the ones before it).
States without them were saved in epoch 0 or without skips. ``skip_micro_steps`` (present only when the epoch skips
optimizer steps) holds the current epoch's part of those ranges as epoch micro-steps of the plan (``[first, end)``,
multiples of ``accumulate_grad_batches``): those micro-steps are consumed without being yielded. Positions in ``segments`` count them (plan micro-steps); the
micro-steps a training loop counts (Lightning's ``batch_idx``, ``batches_consumed``, ``len()``) do not
(:func:`trained_micro_step`, :func:`plan_micro_step`).

``segment_max_tokens`` (present only when an earlier segment of the epoch ran on ranks of other per-rank budgets)
holds each segment's ``max_tokens``; without it every segment ran with ``settings["max_tokens"]``.
``segment_padded_shapes`` (present only when an earlier segment of the epoch ran with other ``padded_shapes``) holds
each segment's shapes; without it every segment ran with ``settings["padded_shapes"]``.

Rule for ``padded_shapes`` on a resume: the shapes an int ``K`` chooses depend on the number of ranks (their rows fill
the micro-batches every rank runs, :func:`~lit_balance.plan.shapes.choose_padded_shapes`), so on another number of
ranks they may change, as ``max_tokens`` may: the rest of the epoch is planned with the new shapes, the segments
before with those they ran with. On the same number of ranks they must equal the saved ones.

Rule for ``max_tokens`` on a resume: on the same number of ranks it must equal the saved value (one int or the same
list). On another number of ranks it may change (per-rank budgets need a list of the new length): the rest of the
epoch is planned with the new budgets, the segments before with those they ran with; the largest budget must stay
the same when it changes which samples ``too_long="skip"`` or ``"truncate"`` leaves out or cuts.

A cost model is rebuilt with ``from_dict`` of the class of the sampler's own cost model
(:class:`~lit_balance.plan.CostModelProtocol`), which must be the class that saved it (``cost_model_class``; a state
without that key was saved with :class:`~lit_balance.CostModel`), so a sampler of a custom cost model resumes one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance._checks import check_int, check_speeds
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModel, CostModelProtocol, check_cost_model
from lit_balance.plan.types import EpochPlan, empty_plan
from lit_balance.plan.windows import WindowedPlan
from lit_balance.sampler.inputs import PlanInputs

__all__ = ["OPTIONAL_STATE_KEYS", "STATE_KEYS", "STATE_VERSION", "Replay", "ReplayRecord", "SettingsMismatchError",
           "build_state", "check_skip_steps", "check_skips", "class_name", "concat_plans", "epoch_optimizer_steps",
           "epoch_replaced", "epoch_skips", "replace_chain",
           "micro_step_totals", "parse_state", "plan_micro_step", "replay", "trained_micro_step",
           "window_supervised_tokens", "window_totals"]

#: Version of the state dict's layout.
STATE_VERSION = 1

#: Keys of the state dict.
STATE_KEYS = ("version", "epoch", "segments", "num_samples", "lengths_sha256", "settings", "cost_model",
              "rank_speeds", "first_rank_speeds", "pending")
#: Keys a state dict may lack: ``cost_model_class`` (absent: :class:`~lit_balance.CostModel`),
#: ``segment_max_tokens`` (absent: every segment of the epoch ran with the saved settings' ``max_tokens``),
#: ``segment_padded_shapes`` (absent: every segment ran with the saved settings' ``padded_shapes``).
#: ``max_length_schedule`` (a length warm-up only: its schedule, :mod:`lit_balance.sampler.plans`).
OPTIONAL_STATE_KEYS = ("cost_model_class", "segment_max_tokens", "skip_micro_steps", "segment_padded_shapes",
                       "skip_steps", "first_optimizer_step", "max_length_schedule", "skip_replace")

Speeds = np.ndarray | None


class SettingsMismatchError(InputValueError):
    """A resume state saved with other batching settings than the sampler's.

    Attributes:
        differences: ``{setting: (saved value, current value)}`` of every setting that differs.
    """

    def __init__(self, message: str, differences: dict[str, tuple[Any, Any]]) -> None:
        super().__init__(message, parameter="settings")
        self.differences = dict(differences)

    def __reduce__(self) -> tuple:  # pickles with its differences (errors cross process boundaries in DDP runs)
        return type(self), (self.args[0], self.differences)


@dataclass(frozen=True)
class ReplayRecord:
    """Where a sampler stands and what its plans are made from: what a state dict saves and replay reads.

    Attributes:
        epoch: the current epoch.
        segments: the epoch's history as ``(num_replicas, micro-steps consumed)`` pairs (empty: the epoch runs on the
            sampler's own ranks from its start); the last is the current world size's, its count the micro-steps of
            the current plan consumed before a restore.
        cost_model: cost model of the current epoch's plan.
        rank_speeds: float64 ``[num_replicas]`` speeds of the current plan, or None for equal ranks.
        first_speeds: speeds the epoch's first segment ran with when there are several segments, else None.
        pending: ``(cost_model, rank_speeds)`` handed over for the next epoch, or None.
        segment_max_tokens: each segment's ``max_tokens`` (an int or a tuple of per-rank budgets) when an earlier
            segment ran with other budgets than the sampler's, else None (every segment ran with the sampler's).
        skips: ``((first, end), ...)`` sorted, disjoint ranges of epoch micro-steps (plan numbering) that are consumed
            without being trained (:meth:`BalancedBatchSampler.skip_steps`): the current epoch's part of
            ``run_skips``; empty: none.
        run_skips: ``((a, b), ...)`` sorted, disjoint ranges of optimizer steps of the run given to skip, any epoch.
        first_step: optimizer steps of the run before the current epoch (the plans' steps, skipped ones counted), or
            None when unknown (the sampler was moved to the epoch without the ones before it).
        replace: ``run_skips`` are replaced (``skip_steps(..., replace=True)``): their documents are taken out and the
            rest of the epoch is planned again (:func:`replace_chain`), so no step is skipped (``skips`` stays empty).
        replaced: with ``replace``, the current epoch's ranges as epoch micro-steps ``(first, end)`` (those that start
            in it): at ``first`` the documents of the micro-steps ``first .. end - 1`` of the plan running then are
            taken out and the rest of the epoch is planned again.
        segment_padded_shapes: each segment's ``padded_shapes`` (a tuple of ``(rows, length)``) when an earlier
            segment ran with other shapes than the sampler's, else None (every segment ran with the sampler's).
    """

    epoch: int
    segments: tuple[tuple[int, int], ...]
    cost_model: CostModelProtocol
    rank_speeds: Speeds = None
    first_speeds: Speeds = None
    pending: tuple[CostModelProtocol, Speeds] | None = None
    segment_max_tokens: tuple | None = None
    skips: tuple[tuple[int, int], ...] = ()
    segment_padded_shapes: tuple | None = None
    run_skips: tuple[tuple[int, int], ...] = ()
    first_step: int | None = 0
    replace: bool = False
    replaced: tuple[tuple[int, int], ...] = ()

    @property
    def offset(self) -> int:
        """Micro-steps of the current plan consumed before the restore (0 without one)."""
        return self.segments[-1][1] if self.segments else 0

    @property
    def earlier(self) -> int:
        """Micro-steps of the epoch consumed on other numbers of ranks before the current segment."""
        return sum(consumed for _, consumed in self.segments[:-1])

    def key(self) -> tuple:
        """A hashable summary of everything the plan of the record's epoch depends on."""
        return (self.epoch, self.segments, self.cost_model, _plain_tuple(self.rank_speeds),
                _plain_tuple(self.first_speeds), self.segment_max_tokens, self.segment_padded_shapes, self.replaced)

    def to_epoch(self, epoch: int) -> ReplayRecord:
        """The record at the start of ``epoch`` (unchanged for the current one): the pending cost model and speeds
        apply when the epoch changes."""
        if epoch == self.epoch:
            return self
        cost_model, speeds = self.pending if self.pending is not None else (self.cost_model, self.rank_speeds)
        return ReplayRecord(epoch=epoch, segments=(), cost_model=cost_model, rank_speeds=speeds,
                            run_skips=self.run_skips, first_step=None, replace=self.replace)

    def fresh(self) -> ReplayRecord:
        """The same epoch run from its start on the sampler's own ranks (a later pass over the epoch)."""
        return dataclasses.replace(self, segments=(), first_speeds=None, segment_max_tokens=None, skips=(),
                                   segment_padded_shapes=None)


@dataclass(frozen=True)
class Replay:
    """The plan of a record's current segment, and what earlier segments ran before it.

    Attributes:
        plan: the current segment's plan (an :class:`EpochPlan`, or a lazy :class:`WindowedPlan`).
        earlier_tokens, earlier_rows, earlier_supervised: int64 ``[earlier micro-steps]`` each: the real tokens,
            rows and next-token targets (fill rows excluded, summed over that segment's ranks) of every micro-step
            the earlier segments consumed, in epoch order (empty for an epoch of one segment).
        pieces: ``(doc, start, length)``, int64 ``[num_pieces]`` each, when the plan's rows are pieces of documents
            (a length warm-up, :mod:`lit_balance.sampler.plans`): row ``p`` is tokens ``[start[p], start[p] +
            length[p])`` of document ``doc[p]``; None when its rows are whole samples.
    """

    plan: EpochPlan | WindowedPlan
    earlier_tokens: np.ndarray
    earlier_rows: np.ndarray
    earlier_supervised: np.ndarray
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def row_lengths(self, inputs: PlanInputs) -> np.ndarray:
        """int ``[rows]``: tokens of each sample the plan's rows index (its pieces', or ``inputs.lengths``)."""
        return inputs.lengths if self.pieces is None else self.pieces[2]


def _plain(speeds: Speeds) -> list[float] | None:
    return None if speeds is None else [float(x) for x in speeds]


def _plain_tuple(speeds: Speeds) -> tuple | None:
    return None if speeds is None else tuple(speeds)


def trained_micro_step(skips: tuple[tuple[int, int], ...], micro_step: int) -> int:
    """The micro-steps trained before epoch micro-step ``micro_step`` of the plan: those not in ``skips``."""
    return int(micro_step) - sum(max(0, min(end, micro_step) - first) for first, end in skips)


def plan_micro_step(skips: tuple[tuple[int, int], ...], trained: int) -> int:
    """The epoch micro-step of the plan reached once ``trained`` micro-steps were trained: the inverse of
    :func:`trained_micro_step`, past a skipped range that starts there."""
    position = int(trained)
    for first, end in skips:  # sorted
        if first <= position:
            position += end - first
    return position


def epoch_skips(run_skips: tuple[tuple[int, int], ...], first_step: int | None, accumulate: int,
                end: int) -> tuple[tuple[int, int], ...]:
    """The part of the run's skipped optimizer steps ``run_skips`` that falls in an epoch whose first optimizer step of
    the run is ``first_step`` and whose plan has ``end`` micro-steps: ``((first, end), ...)`` epoch micro-steps of the
    plan (a range begun in an earlier epoch starts at 0; one that ends past the epoch keeps its end)."""
    if first_step is None:
        return ()
    out = []
    for a, b in run_skips:
        lo, hi = max(a - first_step, 0) * accumulate, (b - first_step) * accumulate
        if hi > 0 and lo < end:
            out.append((lo, hi))
    return tuple(out)


def epoch_replaced(run_skips: tuple[tuple[int, int], ...], first_step: int | None,
                   accumulate: int) -> tuple[tuple[int, int], ...]:
    """With ``replace``, the ranges of ``run_skips`` that start in or after an epoch whose first optimizer step of the
    run is ``first_step``, as epoch micro-steps ``((first, end), ...)``; a range that started in an earlier epoch was
    replaced there."""
    if first_step is None:
        return ()
    return tuple(((a - first_step) * accumulate, (b - first_step) * accumulate)
                 for a, b in run_skips if a >= first_step)


def concat_plans(parts: list[tuple[EpochPlan, int]], num_replicas: int, accumulate: int) -> EpochPlan:
    """One :class:`EpochPlan` running the first ``n`` micro-steps of each plan of ``parts`` (``(plan, n)`` pairs) one
    after the other; ``dropped`` is the last plan's."""
    rows, fills, sizes, steps = [], [], [], 0
    for plan, n in parts:
        batches = plan.assignment[:n].reshape(-1)
        lo, hi = plan.batch_offsets[batches], plan.batch_offsets[batches + 1]
        size = hi - lo
        at = np.repeat(lo - np.concatenate([[0], np.cumsum(size)[:-1]]), size) + np.arange(int(size.sum()))
        rows.append(plan.rows[at])
        fills.append(plan.is_fill[at])
        sizes.append(size)
        steps += n
    size = np.concatenate(sizes).astype(np.int64)
    return EpochPlan(rows=np.concatenate(rows).astype(np.int64), is_fill=np.concatenate(fills).astype(bool),
                     batch_offsets=np.concatenate([[0], np.cumsum(size)]).astype(np.int64),
                     assignment=np.arange(steps * num_replicas, dtype=np.int64).reshape(steps, num_replicas),
                     dropped=parts[-1][0].dropped, accumulate_grad_batches=accumulate)


def replace_chain(inputs: PlanInputs, record: ReplayRecord, plan: EpochPlan, eligible: np.ndarray | None, start: int,
                  replan: Any, stop: int | None = None,
                  strict: Any = ()) -> tuple[EpochPlan, list[tuple[int, np.ndarray]]]:
    """A segment's plan with the record's replaced ranges applied: at each range's first micro-step the documents of
    its micro-steps are taken out and the rest is planned again (``replan(eligible)``) over what is left.

    Args:
        plan: the segment's plan, starting at epoch micro-step ``start``, over ``eligible`` samples.
        replan: ``eligible -> EpochPlan``: the plan of the rest of the epoch on the segment's ranks.
        stop: the epoch micro-step where the segment ended (a resume on other ranks followed), or None for the
            current segment: a range starting there or later is the next segment's.
        strict: ranges ``(first, end)`` (those given now) refused when they run past the end of their epoch; another
            range that does (the epoch was planned anew since, e.g. on more ranks, and ends earlier) takes out the
            rest of the epoch only.

    Returns:
        ``(plan, drops)``: the plan as it runs (the first micro-steps of each re-planned part in turn), and for each
        range applied, its first epoch micro-step and the bool ``[num_samples]`` mask of the documents taken out.

    Raises:
        ValueError: ``strict`` and a range that runs past the end of the epoch it starts in.
    """
    if not record.replaced:
        return plan, []
    accumulate = inputs.settings.accumulate_grad_batches
    parts, drops, begin = [], [], start
    for lo, hi in record.replaced:
        if lo < begin:
            continue  # applied by an earlier segment
        if lo >= begin + plan.num_micro_steps or (stop is not None and lo >= stop):
            break  # past the epoch's end (a later epoch's), or after the segment ended
        end = begin + plan.num_micro_steps
        if (lo, hi) in strict and hi > -(-end // accumulate) * accumulate:  # the last step of the epoch may be short
            raise InputValueError(
                f"skip_steps range of epoch micro-steps [{lo}, {hi}) with replace=True runs past the end of epoch "
                f"{record.epoch} (micro-step {end}): with replace=True a range must end in the epoch it starts in; "
                "split it at the epoch's end or pass replace=False", parameter="skip_steps")
        parts.append((plan, lo - begin))
        seen = np.zeros(inputs.num_samples, dtype=bool)
        plan.mark_rows(lo - begin, seen)
        taken = np.zeros(inputs.num_samples, dtype=bool)
        plan.mark_rows(hi - begin, taken)
        taken &= ~seen
        drops.append((lo, taken))
        seen |= taken
        eligible = (np.ones(inputs.num_samples, dtype=bool) if eligible is None else eligible) & ~seen
        plan = replan(eligible) if eligible.any() else empty_plan(int(plan.assignment.shape[1]), accumulate)
        begin = lo
    parts.append((plan, plan.num_micro_steps))
    return concat_plans(parts, int(plan.assignment.shape[1]), accumulate), drops


def epoch_optimizer_steps(micro_steps: int, accumulate: int) -> int:
    """Optimizer steps of an epoch of ``micro_steps`` plan micro-steps: the last window may be short."""
    return -(-int(micro_steps) // int(accumulate))


def check_skip_steps(skip_steps: Any) -> list[tuple[int, int]]:
    """``skip_steps`` (optimizer steps ``a .. b - 1`` of the run per pair) as sorted ``(a, b)`` int pairs.

    Raises:
        TypeError: not a list of pairs of ints, naming ``skip_steps``.
        ValueError: a negative step, a reversed or empty range, overlapping ranges, naming ``skip_steps``.
    """
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if (isinstance(skip_steps, (str, bytes)) or not isinstance(skip_steps, (list, tuple))
            or not all(isinstance(p, (list, tuple)) and not isinstance(p, (str, bytes)) and len(p) == 2
                       and all(is_int(v) for v in p) for p in skip_steps)):
        raise InputTypeError(f"skip_steps must be a list of (a, b) pairs of ints (optimizer steps a .. b-1 of the "
                             f"run), got {skip_steps!r}", parameter="skip_steps")
    ranges = sorted((int(a), int(b)) for a, b in skip_steps)
    for a, b in ranges:
        if a < 0 or b <= a:
            got = "a negative step" if a < 0 else "a reversed or empty range"
            raise InputValueError(f"skip_steps range ({a}, {b}) must have 0 <= a < b (optimizer steps a .. b-1 of the "
                                  f"run, inclusive-exclusive); got {got}", parameter="skip_steps")
    for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
        if a1 < b0:
            raise InputValueError(f"skip_steps ranges ({a0}, {b0}) and ({a1}, {b1}) overlap; give disjoint ranges",
                                  parameter="skip_steps")
    return ranges


def check_skips(raw: Any, accumulate: int) -> tuple[tuple[int, int], ...]:
    """Saved ``skip_micro_steps`` as a tuple of ``(first, end)`` pairs, checked: sorted, disjoint, aligned."""
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if (not isinstance(raw, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in raw)
            or not all(is_int(v) for p in raw for v in p)):
        raise InputValueError(f"sampler state_dict skip_micro_steps must be a list of [first, end] int pairs, got "
                              f"{raw!r}", parameter="skip_steps")
    skips = tuple((int(a), int(b)) for a, b in raw)
    previous = 0
    for a, b in skips:
        if not previous <= a < b or a % accumulate or b % accumulate:
            raise InputValueError(f"sampler state_dict skip_micro_steps must be sorted, disjoint [first, end) ranges "
                                  f"of micro-steps, multiples of accumulate_grad_batches={accumulate}, got "
                                  f"{list(map(list, skips))}", parameter="skip_steps")
        previous = b
    return skips


def build_state(inputs: PlanInputs, record: ReplayRecord, num_replicas: int, consumed: int,
                plan_micro_steps: int) -> dict[str, Any]:
    """The state dict with ``consumed`` of the ``plan_micro_steps`` micro-steps of the record's current plan consumed.

    Once the whole epoch is consumed, the state is the start of the next epoch (with the pending cost model and
    speeds applied).
    """
    segments = [list(seg) for seg in record.segments[:-1]] + [[num_replicas, int(consumed)]]
    epoch, cost_model, speeds, pending = record.epoch, record.cost_model, record.rank_speeds, record.pending
    first_speeds = record.first_speeds if len(record.segments) > 1 else speeds
    segment_max_tokens = record.segment_max_tokens if len(record.segments) > 1 else None
    segment_shapes = record.segment_padded_shapes if len(record.segments) > 1 else None
    first_step = record.first_step
    if consumed >= plan_micro_steps:  # the epoch is done: the state is the start of the next one
        if first_step is not None:
            first_step += epoch_optimizer_steps(record.earlier + plan_micro_steps,
                                                inputs.settings.accumulate_grad_batches)
        epoch, segments = epoch + 1, [[num_replicas, 0]]
        first_speeds = segment_max_tokens = segment_shapes = None
        if pending is not None:
            (cost_model, speeds), pending = pending, None
    extra = {} if segment_max_tokens is None else {"segment_max_tokens": [_plain_budget(b) for b in segment_max_tokens]}
    if segment_shapes is not None:
        extra["segment_padded_shapes"] = [[[int(r), int(t)] for r, t in shapes] for shapes in segment_shapes]
    if record.skips and epoch == record.epoch:  # the epoch's part of the skipped ranges
        extra["skip_micro_steps"] = [[int(a), int(b)] for a, b in record.skips]
    if record.run_skips:
        extra["skip_steps"] = [[int(a), int(b)] for a, b in record.run_skips]
        if record.replace:
            extra["skip_replace"] = True
    if record.run_skips or first_step != 0:
        extra["first_optimizer_step"] = None if first_step is None else int(first_step)
    return {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "segments": segments,
        "num_samples": inputs.num_samples,
        "lengths_sha256": inputs.lengths_sha256,
        "settings": inputs.settings.to_dict(),
        "cost_model": cost_model.to_dict(),
        "rank_speeds": _plain(speeds),
        "first_rank_speeds": _plain(first_speeds),
        "pending": None if pending is None else {"cost_model": pending[0].to_dict(), "rank_speeds": _plain(pending[1])},
        "cost_model_class": class_name(type(cost_model)),
        **extra,
    }


def _plain_budget(max_tokens: int | tuple[int, ...]) -> int | list[int]:
    return list(max_tokens) if isinstance(max_tokens, tuple) else int(max_tokens)


def class_name(cls: type) -> str:
    """How a state names the class of its cost model: ``lit_balance.CostModel``, else ``module.QualifiedName``."""
    return "lit_balance.CostModel" if cls is CostModel else f"{cls.__module__}.{cls.__qualname__}"


def _check_segments(raw: Any) -> list[list[int]]:
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if (not isinstance(raw, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in raw)
            or not all(is_int(v) for p in raw for v in p)):
        raise InputValueError(f"sampler state_dict segments must be a list of [num_replicas, consumed] int pairs, "
                              f"got {raw!r}")
    segments = [[int(r), int(c)] for r, c in raw]
    if not segments or any(r < 1 or c < 0 for r, c in segments):
        raise InputValueError(f"sampler state_dict segments must be [num_replicas >= 1, consumed >= 0] pairs, "
                              f"got {segments}")
    return segments


def _check_identity(state_dict: dict[str, Any], inputs: PlanInputs, resized: bool) -> None:
    """Raise unless the state was saved by a sampler of the same lengths and settings (``max_tokens`` may differ when
    ``resized``, the state's last world size is not this sampler's: :func:`_check_max_tokens`)."""
    num_samples, settings = inputs.num_samples, inputs.settings
    if type(state_dict["num_samples"]) is not int:
        raise InputValueError(f"sampler state_dict num_samples must be an int, got {state_dict['num_samples']!r}")
    if state_dict["num_samples"] != num_samples:
        raise InputValueError(
            f"cannot resume: the saved sampler planned {state_dict['num_samples']} samples, this one has "
            f"{num_samples}: resume needs the same dataset, tokenization and truncation"
        )
    saved_settings = state_dict["settings"]
    if resized and isinstance(saved_settings, dict) and "max_tokens" in saved_settings:
        _check_max_tokens(saved_settings["max_tokens"], inputs)
    if state_dict["lengths_sha256"] != inputs.lengths_sha256:
        raise InputValueError(
            f"cannot resume: the saved sampler planned the same number of samples ({num_samples}) with other "
            "lengths: the samples' token lengths differ (another order, tokenization or truncation); resume "
            "needs the same dataset, tokenization and truncation"
        )
    saved, now = state_dict["settings"], settings.to_dict()
    if isinstance(saved, dict) and "plan_window" not in saved and num_samples <= settings.plan_window:
        saved = {**saved, "plan_window": now["plan_window"]}  # saved before plan_window existed: planned whole, as now
    if isinstance(saved, dict) and "packing" not in saved:  # saved before packing existed: padded batches
        saved = {**saved, "packing": False}
    if not isinstance(saved, dict) or set(saved) != set(now):
        got = sorted(saved) if isinstance(saved, dict) else saved
        raise InputValueError(f"sampler state_dict settings must have keys {sorted(now)}, got {got}")
    # on another number of ranks, max_tokens may change, and so may the shapes an int padded_shapes chose (checked
    # as shapes by _segment_shapes)
    shapes_change = resized and isinstance(saved.get("padded_shapes"), list) and isinstance(now["padded_shapes"], list)
    differences = {k: (saved[k], now[k]) for k in now
                   if saved[k] != now[k] and not (k == "max_tokens" and resized)
                   and not (k == "padded_shapes" and shapes_change)}
    if differences:
        diff = "; ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in differences.items())
        wanted = ", ".join(f"{k}={old!r}" for k, (old, _) in differences.items())
        raise SettingsMismatchError(
            f"cannot resume: the sampler's settings differ from the saved ones ({diff}); construct the sampler with "
            f"the saved settings (BalancedBatchSampler(..., {wanted}), or settings=BatchingSettings(...) with them; "
            "max_tokens may change only with the number of ranks)",
            differences)


def _check_max_tokens(saved: Any, inputs: PlanInputs) -> None:
    """Raise unless the saved ``max_tokens`` (of a resume onto another number of ranks) leaves out and cuts the same
    samples as this sampler's: the largest budgets agree, or no sample lies between them."""
    settings = inputs.settings
    try:
        old = settings.replace(max_tokens=saved)
    except (TypeError, ValueError) as exc:
        raise InputValueError(f"sampler state_dict settings max_tokens must be an int or a list of ints, got "
                              f"{saved!r}: {exc}", parameter="max_tokens") from exc
    if old.truncate_to == settings.truncate_to or settings.too_long == "error":
        return
    low, high = sorted((old.truncate_to, settings.truncate_to))
    lengths = np.asarray(inputs.lengths)
    if settings.too_long == "truncate":  # planned lengths at or above the lower cut were (or may have been) cut
        affected = int(np.count_nonzero(lengths >= low))
    else:  # "skip": samples between the two budgets are planned by one run and left out by the other
        affected = int(np.count_nonzero((lengths > low) & (lengths <= high)))
    if affected:
        raise InputValueError(
            f"cannot resume: the saved run's largest budget was max_tokens={old.largest_max_tokens}, this one's is "
            f"{settings.largest_max_tokens}, and too_long={settings.too_long!r} treats {affected} sample(s) between "
            f"them differently; keep the largest per-rank budget when resuming on another number of ranks",
            parameter="max_tokens")


def _cost_models(state_dict: dict[str, Any], cost_class: type) -> tuple[Any, Any]:
    """The saved cost model and the pending one (or None), rebuilt with ``cost_class.from_dict``."""
    pending = state_dict["pending"]
    if pending is not None and (not isinstance(pending, dict) or set(pending) != {"cost_model", "rank_speeds"}):
        raise InputValueError(f"sampler state_dict pending must be None or a dict with keys cost_model, rank_speeds; "
                              f"got {pending!r}")
    saved = state_dict.get("cost_model_class", class_name(CostModel))
    if saved != class_name(cost_class):
        raise InputValueError(f"cannot resume: the saved sampler planned with a cost model of class {saved}, this one "
                              f"has a {class_name(cost_class)}; construct the sampler (or the DataModule) with a cost "
                              f"model of the saved class", parameter="cost_model")
    try:
        cost_model = cost_class.from_dict(state_dict["cost_model"])
        pending_model = None if pending is None else cost_class.from_dict(pending["cost_model"])
    except (TypeError, ValueError) as exc:
        raise InputValueError(f"sampler state_dict cost_model must describe a {cost_class.__name__} (the class of "
                              f"this sampler's cost model, from its to_dict()): {exc}") from exc
    for model in (cost_model,) if pending is None else (cost_model, pending_model):
        if type(model) is not cost_class:
            raise InputTypeError(f"{cost_class.__name__}.from_dict returned {model!r:.80} of type "
                                 f"{type(model).__name__}, not a {cost_class.__name__}; it must rebuild the model "
                                 "to_dict() describes", parameter="cost_model")
        check_cost_model(model, parameter="the saved cost_model")
    return cost_model, pending_model


def parse_state(state_dict: Any, inputs: PlanInputs, *, num_replicas: int, cost_class: type) -> ReplayRecord:
    """Check a state dict against the sampler it is loaded into and return the record it describes.

    Rule for a different ``num_replicas``: a new segment starts on the new ranks; the old ranks' speeds are
    dropped (equal ranks), also those pending for the next epoch.

    Args:
        state_dict: from :func:`build_state`.
        inputs: the inputs of the sampler that loads it.
        num_replicas: that sampler's ranks.
        cost_class: the class of that sampler's cost model (``from_dict`` rebuilds the saved ones).

    Raises:
        TypeError: ``state_dict`` is not a dict.
        ValueError: unknown or missing keys, another ``version``, different lengths (count or content) or
            different settings (naming each one with both values), malformed values.
    """
    if not isinstance(state_dict, dict):
        raise InputTypeError(f"state_dict must be a dict from BalancedBatchSampler.state_dict(), got "
                             f"{type(state_dict).__name__}")
    expected, keys = set(STATE_KEYS), set(state_dict)
    if not expected <= keys <= expected | set(OPTIONAL_STATE_KEYS):
        missing, unknown = sorted(expected - keys), sorted(keys - expected - set(OPTIONAL_STATE_KEYS))
        raise InputValueError(f"sampler state_dict keys do not match: missing {missing}, unknown {unknown}")
    if type(state_dict["version"]) is not int or state_dict["version"] != STATE_VERSION:
        raise InputValueError(f"sampler state_dict version {state_dict['version']!r} is not supported "
                              f"(this version reads {STATE_VERSION})")
    segments = _check_segments(state_dict["segments"])
    resized = segments[-1][0] != num_replicas
    _check_identity(state_dict, inputs, resized)
    epoch = check_int("epoch", state_dict["epoch"], 0, "epochs count from 0")
    cost_model, pending_model = _cost_models(state_dict, cost_class)
    speeds = state_dict["rank_speeds"]
    first = state_dict["first_rank_speeds"]
    first_speeds = None if first is None else check_speeds(first, segments[0][0])
    budgets = _segment_budgets(state_dict, len(segments))
    shapes = _segment_shapes(state_dict, len(segments), inputs)
    if resized:
        budgets.append(inputs.settings.max_tokens)
        shapes.append(inputs.settings.padded_shapes)
        if len(segments) == 1:
            first_speeds = None if speeds is None else check_speeds(speeds, segments[0][0])
        segments.append([num_replicas, 0])
        speeds = None  # the old ranks' speeds say nothing about the new ones
    rank_speeds = check_speeds(speeds, num_replicas)
    pending = None
    if state_dict["pending"] is not None:  # speeds measured on the old ranks are dropped after a resize
        pending = (pending_model, check_speeds(None if resized else state_dict["pending"]["rank_speeds"],
                                               num_replicas))
    for (replicas, _), budget in zip(segments, budgets):  # each segment's budgets fit its ranks
        inputs.settings.replace(max_tokens=budget).rank_max_tokens(replicas)
    same = all(b == inputs.settings.max_tokens for b in budgets)
    same_shapes = all(s == inputs.settings.padded_shapes for s in shapes)
    accumulate = inputs.settings.accumulate_grad_batches
    skips = check_skips(state_dict.get("skip_micro_steps", []), accumulate)
    first_step = state_dict.get("first_optimizer_step", 0 if epoch == 0 else None)
    if first_step is not None:
        first_step = check_int("first_optimizer_step", first_step, 0, "a sampler state_dict's optimizer steps before "
                               "its epoch")
    if "skip_steps" in state_dict:
        run_skips = tuple(check_skip_steps(state_dict["skip_steps"]))
    else:  # saved before skips were kept for the run: the epoch's ones
        base = 0 if first_step is None else first_step
        run_skips = tuple((base + a // accumulate, base + epoch_optimizer_steps(b, accumulate)) for a, b in skips)
    replace = state_dict.get("skip_replace", False)
    if type(replace) is not bool:
        raise InputValueError(f"sampler state_dict skip_replace must be a bool, got {replace!r}",
                              parameter="skip_steps")
    replaced = epoch_replaced(run_skips, first_step, accumulate) if replace else ()
    return ReplayRecord(epoch=epoch, segments=tuple((r, c) for r, c in segments), cost_model=cost_model,
                        rank_speeds=rank_speeds, first_speeds=first_speeds if len(segments) > 1 else None,
                        pending=pending, segment_max_tokens=None if same or len(segments) < 2 else tuple(budgets),
                        skips=() if replace else skips, run_skips=run_skips, first_step=first_step,
                        replace=replace, replaced=replaced,
                        segment_padded_shapes=None if same_shapes or len(segments) < 2 else tuple(shapes))


def _segment_shapes(state_dict: dict[str, Any], num_segments: int, inputs: PlanInputs) -> list:
    """Each saved segment's ``padded_shapes`` (None or a tuple of ``(rows, length)``): ``segment_padded_shapes``, else
    the saved settings', each checked as shapes of this sampler's budget."""
    raw = state_dict.get("segment_padded_shapes")
    if raw is None:
        raw = [state_dict["settings"].get("padded_shapes")] * num_segments
    elif not isinstance(raw, list) or len(raw) != num_segments:
        raise InputValueError(f"sampler state_dict segment_padded_shapes must be a list of one padded_shapes per "
                              f"segment ({num_segments}), got {raw!r}")
    if inputs.settings.padded_shapes is None or all(s == inputs.settings.padded_shapes for s in raw):
        return [inputs.settings.padded_shapes] * num_segments
    out = []
    for shapes in raw:  # shapes of another number of ranks (an int padded_shapes chose them): valid shapes
        try:
            out.append(inputs.settings.replace(padded_shapes=shapes).padded_shapes)
        except (TypeError, ValueError) as exc:
            raise InputValueError(f"sampler state_dict padded_shapes must be (rows, length) pairs within max_tokens, "
                                  f"got {shapes!r}: {exc}", parameter="padded_shapes") from exc
    return out


def _segment_budgets(state_dict: dict[str, Any], num_segments: int) -> list:
    """Each saved segment's ``max_tokens`` (an int or a tuple): ``segment_max_tokens``, else the saved settings'."""
    raw = state_dict.get("segment_max_tokens")
    if raw is None:
        saved = state_dict["settings"]["max_tokens"]
        return [tuple(saved) if isinstance(saved, list) else saved] * num_segments
    if not isinstance(raw, list) or len(raw) != num_segments:
        raise InputValueError(f"sampler state_dict segment_max_tokens must be a list of one max_tokens per segment "
                              f"({num_segments}), got {raw!r}")
    return [tuple(b) if isinstance(b, list) else b for b in raw]


def _segment_plan(inputs: PlanInputs, record: ReplayRecord, segments: tuple[tuple[int, int], ...], i: int,
                  eligible: np.ndarray | None) -> EpochPlan | WindowedPlan:
    """The plan segment ``i`` of the epoch ran (or runs) on, given the samples still eligible then."""
    replicas, epoch, cost_model = segments[i][0], record.epoch, record.cost_model
    budget = None if record.segment_max_tokens is None else record.segment_max_tokens[i]
    shapes = None if record.segment_padded_shapes is None else record.segment_padded_shapes[i]
    if i == 0:
        speeds = record.rank_speeds if len(segments) <= 1 else record.first_speeds
        return inputs.plan(epoch, replicas, eligible=eligible, speeds=speeds, cost_model=cost_model,
                           max_tokens=budget, padded_shapes=shapes)
    # The rest of the epoch on new ranks: at least as many micro-steps as a whole epoch on them has, counting
    # those consumed before, so the epoch is never shorter than the next (a training loop that fixed its
    # epoch length at the resume keeps every micro-batch of later epochs).
    full = inputs.plan(epoch, replicas, eligible=inputs.eligible, speeds=None, cost_model=cost_model,
                       max_tokens=budget, padded_shapes=shapes).num_micro_steps
    earlier = sum(consumed for _, consumed in segments[:i])
    # micro-steps whose documents replaced ranges took out before: the epoch is that much shorter
    earlier += sum(hi - lo for lo, hi in record.replaced if lo < earlier)
    return inputs.plan(epoch, replicas, eligible=eligible, speeds=None, cost_model=cost_model,
                       min_steps=max(0, full - earlier), max_tokens=budget, padded_shapes=shapes)


def _replanner(inputs: PlanInputs, record: ReplayRecord, segments: tuple[tuple[int, int], ...], i: int) -> Any:
    """``eligible -> EpochPlan``: the rest of the epoch planned again on segment ``i``'s ranks (its speeds, budgets
    and shapes) after a replaced range."""
    replicas = segments[i][0]
    budget = None if record.segment_max_tokens is None else record.segment_max_tokens[i]
    shapes = None if record.segment_padded_shapes is None else record.segment_padded_shapes[i]
    speeds = (record.rank_speeds if len(segments) <= 1 else record.first_speeds) if i == 0 else None

    def replan(eligible: np.ndarray) -> EpochPlan:
        return inputs.plan(record.epoch, replicas, eligible=eligible, speeds=speeds, cost_model=record.cost_model,
                           max_tokens=budget, padded_shapes=shapes)
    return replan


def _micro_step_sums(plan: EpochPlan, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``[num_micro_steps]`` each: real tokens and rows (fill rows excluded) of every rank's micro-batch
    at each micro-step of ``plan``, summed over its ranks."""
    tokens = plan.real_tokens_per_batch(lengths)[plan.assignment].sum(axis=1)
    rows = plan.real_rows_per_batch()[plan.assignment].sum(axis=1)
    return tokens.astype(np.int64), rows.astype(np.int64)


def _micro_step_supervised(plan: EpochPlan, inputs: PlanInputs, lengths: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[num_micro_steps]``: next-token targets (fill rows excluded) at each micro-step, over its ranks
    (``lengths``: of the samples the plan's rows index, default ``inputs.lengths``)."""
    if inputs.supervised_lengths is None:  # every token but a row's first is a target
        tokens, rows = _micro_step_sums(plan, inputs.lengths if lengths is None else lengths)
        return tokens - rows
    return plan.real_tokens_per_batch(inputs.supervised_lengths)[plan.assignment].sum(axis=1).astype(np.int64)


def replay(inputs: PlanInputs, record: ReplayRecord, num_replicas: int, strict: Any = ()) -> Replay:
    """Plan of the record's current segment, and what its earlier segments ran before it.

    ``strict``: replaced ranges ``(first, end)`` of the current segment refused when they run past the epoch's end
    (:func:`replace_chain`).

    Each earlier segment's plan, rebuilt as it ran, removes what it consumed from the samples still to plan.

    Raises:
        ValueError: a segment consumed more micro-steps than its plan has (the state is not this sampler's).
    """
    segments = record.segments or ((num_replicas, 0),)
    eligible = inputs.eligible
    tokens: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    rows: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    supervised: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for i in range(len(segments)):
        plan = _segment_plan(inputs, record, segments, i, eligible)
        drops: list = []
        if record.replaced:  # replaced ranges: the rest of the epoch is planned again at each one's start
            start = sum(c for _, c in segments[:i])
            stop = None if i == len(segments) - 1 else start + segments[i][1]
            plan, drops = replace_chain(inputs, record, plan, eligible, start, _replanner(inputs, record, segments, i),
                                        stop, strict=strict if stop is None else ())
        if i == len(segments) - 1:
            break
        consumed = segments[i][1]
        if consumed > plan.num_micro_steps:
            raise InputValueError(
                f"the saved state consumed {consumed} micro-steps of epoch {record.epoch} on {segments[i][0]} "
                f"rank(s), but that plan has only {plan.num_micro_steps}: the state does not belong to this sampler"
            )
        seen = np.zeros(inputs.num_samples, dtype=bool)
        if isinstance(plan, WindowedPlan):
            step_tokens, step_rows, step_supervised = plan.consume(consumed, seen)
        else:
            step_tokens, step_rows = _micro_step_sums(plan, inputs.lengths)
            step_supervised = _micro_step_supervised(plan, inputs)
            plan.mark_rows(consumed, seen)
            start = sum(c for _, c in segments[:i])
            for first, taken in drops:  # documents taken out before the segment ended: never trained
                if first < start + consumed:
                    seen |= taken
        tokens.append(step_tokens[:consumed])
        rows.append(step_rows[:consumed])
        supervised.append(step_supervised[:consumed])
        eligible = (np.ones_like(seen) if eligible is None else eligible) & ~seen
        if not eligible.any():
            plan = empty_plan(num_replicas, inputs.settings.accumulate_grad_batches)
            break
    return Replay(plan, np.concatenate(tokens), np.concatenate(rows), np.concatenate(supervised))


def micro_step_totals(inputs: PlanInputs, replayed: Replay) -> tuple[np.ndarray, np.ndarray]:
    """Real tokens and rows of every micro-step of a replayed epoch, as it runs over all its segments.

    Returns:
        int64 ``[micro-steps of the epoch]`` each: at epoch micro-step ``t`` (Lightning's ``batch_idx``), the real
        tokens and rows (fill rows excluded) of every rank's micro-batch, summed over the ranks that ran (or run)
        it. Steps consumed before a resume on another number of ranks come from the old ranks' plan.
    """
    plan = replayed.plan
    if isinstance(plan, WindowedPlan):
        step_tokens, step_rows, _ = plan.step_sums(0, plan.num_micro_steps)
    else:
        step_tokens, step_rows = _micro_step_sums(plan, replayed.row_lengths(inputs))
    return (np.concatenate([replayed.earlier_tokens, step_tokens]),
            np.concatenate([replayed.earlier_rows, step_rows]))


def _per_window(steps: np.ndarray, accumulate: int) -> np.ndarray:
    """``steps`` summed over each optimizer step (``accumulate`` micro-steps from the epoch's start; the last may
    be short), repeated at each of its micro-steps."""
    window = np.arange(steps.shape[0]) // accumulate
    totals = np.zeros(int(window[-1]) + 1 if window.size else 0, dtype=np.int64)
    np.add.at(totals, window, steps)
    return totals[window]


def window_totals(inputs: PlanInputs, replayed: Replay) -> tuple[np.ndarray, np.ndarray]:
    """Global real tokens and rows of the optimizer step of every micro-step of a replayed epoch.

    Optimizer steps are Lightning's accumulation windows of ``accumulate_grad_batches`` micro-steps, counted
    from the epoch's start (the last one may be short), whatever resumes on other numbers of ranks cut them:
    a window cut by one sums the micro-batches the old ranks ran before the cut and those the new ranks run
    after it.

    Returns:
        int64 ``[micro-steps of the epoch]`` each: at epoch micro-step ``t``, the sums of :func:`micro_step_totals`
        over the window ``t // accumulate_grad_batches``.
    """
    tokens, rows = micro_step_totals(inputs, replayed)
    accumulate = inputs.settings.accumulate_grad_batches
    return _per_window(tokens, accumulate), _per_window(rows, accumulate)


def window_supervised_tokens(inputs: PlanInputs, replayed: Replay, plan: EpochPlan) -> np.ndarray:
    """Global next-token targets of the optimizer step of every micro-step of a replayed epoch planned whole.

    The windows are those of :func:`window_totals`; a sample counts its ``supervised_lengths`` (or
    ``length - 1`` without them). ``plan`` is the current segment's plan as one :class:`EpochPlan`.

    Returns:
        int64 ``[micro-steps of the epoch]``: at epoch micro-step ``t``, the targets of every micro-batch of all
        ranks in the window ``t // accumulate_grad_batches``.
    """
    steps = np.concatenate([replayed.earlier_supervised,
                            _micro_step_supervised(plan, inputs, replayed.row_lengths(inputs))])
    return _per_window(steps, inputs.settings.accumulate_grad_batches)
