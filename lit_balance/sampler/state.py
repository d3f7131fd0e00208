"""Resume state of :class:`~lit_balance.BalancedBatchSampler`: the plain-dict round trip and segment replay.

A sampler's position is its epoch and the epoch's history as *segments*, ``[num_replicas, micro-steps
consumed]`` pairs: one segment for an epoch that ran on one world size, one more for each resume on a
different number of ranks. The plan a segment ran is rebuilt from the same inputs (lengths, settings,
epoch, ranks, speeds), so the state never stores indices; replaying the segments in turn removes what each
one consumed and leaves the plan of the rest of the epoch.

The state dict holds plain Python types only (it loads with ``torch.load(weights_only=True)``) and is the
same on every rank. Layout (version :data:`STATE_VERSION`)::

    {"version": 1, "epoch": int, "segments": [[num_replicas, consumed], ...],
     "num_samples": int, "lengths_sha256": str, "settings": BatchingSettings.to_dict(),
     "cost_model": CostModel.to_dict(), "rank_speeds": [float] | None, "first_rank_speeds": [float] | None,
     "pending": None | {"cost_model": CostModel.to_dict(), "rank_speeds": [float] | None}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lit_balance._checks import check_int, check_speeds
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModel
from lit_balance.plan.types import EpochPlan
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.windows import WindowedPlan

if TYPE_CHECKING:
    from lit_balance.sampler.sampler import BalancedBatchSampler

__all__ = ["STATE_KEYS", "STATE_VERSION", "Position", "build_state", "micro_step_totals", "parse_state",
           "replay_segments", "window_supervised_tokens", "window_totals"]

#: Version of the state dict's layout.
STATE_VERSION = 1

#: Keys of the state dict.
STATE_KEYS = ("version", "epoch", "segments", "num_samples", "lengths_sha256", "settings", "cost_model",
              "rank_speeds", "first_rank_speeds", "pending")

@dataclass(frozen=True)
class Position:
    """Where a sampler stands and what its plans are made from: what :func:`parse_state` restores.

    Attributes:
        epoch: the current epoch.
        segments: the epoch's history as ``[num_replicas, micro-steps consumed]`` pairs; the last is the
            current world size's, its count the micro-steps of the current plan already consumed.
        cost_model: cost model of the current epoch's plan.
        rank_speeds: float64 ``[num_replicas]`` speeds of the current plan, or None for equal ranks.
        first_speeds: speeds the epoch's first segment ran with when there are several segments, else None.
        pending: ``(cost_model, rank_speeds)`` handed over for the next epoch, or None.
    """

    epoch: int
    segments: list[list[int]]
    cost_model: CostModel
    rank_speeds: np.ndarray | None
    first_speeds: np.ndarray | None
    pending: tuple[CostModel, np.ndarray | None] | None


def _plain(speeds: np.ndarray | None) -> list[float] | None:
    return None if speeds is None else [float(x) for x in speeds]


def build_state(sampler: BalancedBatchSampler, current: int) -> dict[str, Any]:
    """The state dict of ``sampler`` with ``current`` micro-steps of its current plan consumed.

    Once the whole epoch is consumed, the state is the start of the next epoch (with the pending cost model
    and speeds applied).
    """
    segments = [list(seg) for seg in sampler._segments[:-1]] + [[sampler.num_replicas, int(current)]]
    epoch, cost_model, speeds, pending = sampler.epoch, sampler.cost_model, sampler.rank_speeds, sampler._pending
    first_speeds = sampler._first_speeds if len(sampler._segments) > 1 else speeds
    if current >= sampler._segment().num_micro_steps:  # the epoch is done: the state is the start of the next one
        epoch, segments = epoch + 1, [[sampler.num_replicas, 0]]
        first_speeds = None
        if pending is not None:
            (cost_model, speeds), pending = pending, None
    return {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "segments": segments,
        "num_samples": int(sampler.lengths.shape[0]),
        "lengths_sha256": sampler._lengths_sha256,
        "settings": sampler.settings.to_dict(),
        "cost_model": cost_model.to_dict(),
        "rank_speeds": _plain(speeds),
        "first_rank_speeds": _plain(first_speeds),
        "pending": None if pending is None else {"cost_model": pending[0].to_dict(), "rank_speeds": _plain(pending[1])},
    }


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


def parse_state(state_dict: Any, *, num_samples: int, lengths_sha256: str, settings: BatchingSettings,
                num_replicas: int) -> Position:
    """Check a state dict against the sampler it is loaded into and return the position it describes.

    Rule for a different ``num_replicas``: a new segment starts on the new ranks; the old ranks' speeds are
    dropped (equal ranks), also those pending for the next epoch.

    Raises:
        TypeError: ``state_dict`` is not a dict.
        ValueError: unknown or missing keys, another ``version``, different lengths (count or content) or
            different settings (naming each one with both values), malformed values.
    """
    if not isinstance(state_dict, dict):
        raise InputTypeError(f"state_dict must be a dict from BalancedBatchSampler.state_dict(), got "
                        f"{type(state_dict).__name__}")
    expected = set(STATE_KEYS)
    if set(state_dict) != expected:
        missing, unknown = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        raise InputValueError(f"sampler state_dict keys do not match: missing {missing}, unknown {unknown}")
    if state_dict["version"] != STATE_VERSION:
        raise InputValueError(f"sampler state_dict version {state_dict['version']!r} is not supported "
                         f"(this version reads {STATE_VERSION})")
    if state_dict["num_samples"] != num_samples:
        raise InputValueError(
            f"cannot resume: the saved sampler planned {state_dict['num_samples']} samples, this one has "
            f"{num_samples}: resume needs the same dataset, tokenization and truncation"
        )
    if state_dict["lengths_sha256"] != lengths_sha256:
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
    diff = [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in now if saved[k] != now[k]]
    if diff:
        raise InputValueError("cannot resume: the sampler's settings differ from the saved ones (" + "; ".join(diff)
                         + "); construct the sampler with the saved settings")
    segments = _check_segments(state_dict["segments"])
    epoch = check_int("epoch", state_dict["epoch"], 0, "epochs count from 0")
    pending = state_dict["pending"]
    if pending is not None and (not isinstance(pending, dict) or set(pending) != {"cost_model", "rank_speeds"}):
        raise InputValueError(f"sampler state_dict pending must be None or a dict with keys cost_model, rank_speeds; "
                         f"got {pending!r}")
    try:
        cost_model = CostModel(**state_dict["cost_model"])
        pending_model = None if pending is None else CostModel(**pending["cost_model"])
    except TypeError as exc:
        raise InputValueError(f"sampler state_dict cost_model must have keys linear, quadratic, per_batch: {exc}") from exc
    speeds = state_dict["rank_speeds"]
    first = state_dict["first_rank_speeds"]
    first_speeds = None if first is None else check_speeds(first, segments[0][0])
    resized = segments[-1][0] != num_replicas
    if resized:
        if len(segments) == 1:
            first_speeds = None if speeds is None else check_speeds(speeds, segments[0][0])
        segments.append([num_replicas, 0])
        speeds = None  # the old ranks' speeds say nothing about the new ones
    rank_speeds = check_speeds(speeds, num_replicas)
    pending_pair = None
    if pending is not None:  # speeds measured on the old ranks are dropped after a resize
        pending_pair = (pending_model, check_speeds(None if resized else pending["rank_speeds"], num_replicas))
    return Position(epoch=epoch, segments=segments, cost_model=cost_model, rank_speeds=rank_speeds,
                    first_speeds=first_speeds if len(segments) > 1 else None, pending=pending_pair)


def _empty_plan(num_replicas: int, accumulate: int) -> EpochPlan:
    z = np.empty(0, dtype=np.int64)
    return EpochPlan(rows=z, is_fill=np.empty(0, dtype=bool), batch_offsets=np.zeros(1, dtype=np.int64),
                     assignment=np.empty((0, num_replicas), dtype=np.int64), dropped=z,
                     accumulate_grad_batches=accumulate)


def _segment_plan(sampler: BalancedBatchSampler, epoch: int, segments: list[list[int]], i: int,
                  eligible: np.ndarray | None) -> EpochPlan | WindowedPlan:
    """The plan segment ``i`` of the epoch ran (or runs) on, given the samples still eligible then."""
    replicas = segments[i][0]
    if i == 0:
        speeds = sampler.rank_speeds if len(segments) <= 1 else sampler._first_speeds
        return sampler._plan_for(epoch, replicas, eligible, speeds)
    # The rest of the epoch on new ranks: at least as many micro-steps as a whole epoch on them has, counting
    # those consumed before, so the epoch is never shorter than the next (a training loop that fixed its
    # epoch length at the resume keeps every micro-batch of later epochs).
    full = sampler._plan_for(epoch, replicas, sampler._eligible, None).num_micro_steps
    earlier = sum(consumed for _, consumed in segments[:i])
    return sampler._plan_for(epoch, replicas, eligible, None, min_steps=max(0, full - earlier))


def _micro_step_sums(plan: EpochPlan, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``[num_micro_steps]`` each: real tokens and rows (fill rows excluded) of every rank's micro-batch
    at each micro-step of ``plan``, summed over its ranks."""
    tokens = plan.real_tokens_per_batch(lengths)[plan.assignment].sum(axis=1)
    rows = plan.real_rows_per_batch()[plan.assignment].sum(axis=1)
    return tokens.astype(np.int64), rows.astype(np.int64)


def _micro_step_supervised(plan: EpochPlan, sampler: BalancedBatchSampler) -> np.ndarray:
    """int64 ``[num_micro_steps]``: next-token targets (fill rows excluded) at each micro-step, over its ranks."""
    supervised = getattr(sampler, "supervised_lengths", None)
    if supervised is None:  # every token but a row's first is a target
        tokens, rows = _micro_step_sums(plan, sampler.lengths)
        return tokens - rows
    return plan.real_tokens_per_batch(supervised)[plan.assignment].sum(axis=1).astype(np.int64)


def replay_segments(sampler: BalancedBatchSampler, epoch: int,
                    segments: list[list[int]]) -> tuple[EpochPlan | WindowedPlan, np.ndarray, np.ndarray, np.ndarray]:
    """Plan of the last segment, and what the earlier segments ran before it.

    Each earlier segment's plan, rebuilt as it ran, removes what it consumed from the samples still to plan.

    Returns:
        ``(plan, earlier_tokens, earlier_rows, earlier_supervised)``: the last segment's plan, and int64
        ``[earlier micro-steps]`` each, the real tokens, rows and next-token targets (fill rows excluded, summed
        over that segment's ranks) of every micro-step the earlier segments consumed, in epoch order (empty for
        an epoch of one segment).

    Raises:
        ValueError: a segment consumed more micro-steps than its plan has (the state is not this sampler's).
    """
    segments = segments or [[sampler.num_replicas, 0]]
    eligible = sampler._eligible
    tokens: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    rows: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    supervised: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for i in range(len(segments)):
        plan = _segment_plan(sampler, epoch, segments, i, eligible)
        if i == len(segments) - 1:
            break
        consumed = segments[i][1]
        if consumed > plan.num_micro_steps:
            raise InputValueError(
                f"the saved state consumed {consumed} micro-steps of epoch {epoch} on {segments[i][0]} "
                f"rank(s), but that plan has only {plan.num_micro_steps}: the state does not belong to this sampler"
            )
        seen = np.zeros(sampler.lengths.shape[0], dtype=bool)
        if isinstance(plan, WindowedPlan):
            step_tokens, step_rows = plan.consume(consumed, seen)
        else:
            step_tokens, step_rows = _micro_step_sums(plan, sampler.lengths)
            plan.mark_rows(consumed, seen)
        tokens.append(step_tokens[:consumed])
        rows.append(step_rows[:consumed])
        supervised.append(step_tokens[:consumed] - step_rows[:consumed] if isinstance(plan, WindowedPlan)
                          else _micro_step_supervised(plan, sampler)[:consumed])
        eligible = (np.ones_like(seen) if eligible is None else eligible) & ~seen
        if not eligible.any():
            plan = _empty_plan(sampler.num_replicas, sampler.accumulate_grad_batches)
            break
    return plan, np.concatenate(tokens), np.concatenate(rows), np.concatenate(supervised)


def micro_step_totals(sampler: BalancedBatchSampler) -> tuple[np.ndarray, np.ndarray]:
    """Real tokens and rows of every micro-step of the sampler's current epoch, as it runs over all its segments.

    Returns:
        int64 ``[len(sampler)]`` each: at epoch micro-step ``t`` (Lightning's ``batch_idx``), the real tokens and
        rows (fill rows excluded) of every rank's micro-batch, summed over the ranks that ran (or run) it. Steps
        consumed before a resume on another number of ranks come from the old ranks' plan.
    """
    plan = sampler._segment()
    earlier_tokens, earlier_rows = sampler._cached[2], sampler._cached[3]
    if isinstance(plan, WindowedPlan):
        step_tokens, step_rows = plan.step_sums(0, plan.num_micro_steps)
    else:
        step_tokens, step_rows = _micro_step_sums(plan, sampler.lengths)
    return np.concatenate([earlier_tokens, step_tokens]), np.concatenate([earlier_rows, step_rows])


def window_totals(sampler: BalancedBatchSampler) -> tuple[np.ndarray, np.ndarray]:
    """Global real tokens and rows of the optimizer step of every micro-step of the current epoch.

    Optimizer steps are Lightning's accumulation windows of ``accumulate_grad_batches`` micro-steps, counted
    from the epoch's start (the last one may be short), whatever resumes on other numbers of ranks cut them:
    a window cut by one sums the micro-batches the old ranks ran before the cut and those the new ranks run
    after it.

    Returns:
        int64 ``[len(sampler)]`` each: at epoch micro-step ``t``, the sums of :func:`micro_step_totals` over the
        window ``t // accumulate_grad_batches``.
    """
    tokens, rows = micro_step_totals(sampler)
    window = np.arange(tokens.shape[0]) // sampler.settings.accumulate_grad_batches
    num_windows = int(window[-1]) + 1 if window.size else 0
    window_tokens = np.zeros(num_windows, dtype=np.int64)
    window_rows = np.zeros(num_windows, dtype=np.int64)
    np.add.at(window_tokens, window, tokens)
    np.add.at(window_rows, window, rows)
    return window_tokens[window], window_rows[window]


def window_supervised_tokens(sampler: BalancedBatchSampler) -> np.ndarray:
    """Global next-token targets of the optimizer step of every micro-step of the current epoch.

    The windows are those of :func:`window_totals`; a sample counts its ``sampler.supervised_lengths`` (or
    ``length - 1`` without them).

    Returns:
        int64 ``[len(sampler)]``: at epoch micro-step ``t``, the targets of every micro-batch of all ranks in the
        window ``t // accumulate_grad_batches``.
    """
    plan = sampler.plan()
    steps = np.concatenate([sampler._cached[4], _micro_step_supervised(plan, sampler)])
    window = np.arange(steps.shape[0]) // sampler.settings.accumulate_grad_batches
    totals = np.zeros(int(window[-1]) + 1 if window.size else 0, dtype=np.int64)
    np.add.at(totals, window, steps)
    return totals[window]
