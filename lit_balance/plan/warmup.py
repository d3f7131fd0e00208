"""A length warm-up that loses no tokens: documents longer than the step's ``max_length`` are planned as pieces.

Length warm-up by truncation (composer's ``SeqLengthWarmup``, DeepSpeed's curriculum) cuts every document to the
step's ``max_length`` and throws the rest away. Here a document longer than the ``max_length`` of the optimizer step
it is planned in is split into ``ceil(length / max_length)`` pieces of at most ``max_length`` tokens, each a document
of its own for attention, position ids, labels and packing, so every token of the data is trained once per epoch.

How a plan is made (:func:`plan_length_warmup`): the epoch's spans (whole documents; on a resume, the parts not yet
trained) are taken in a seeded order and cut into *chunks*, each about as many tokens as the optimizer steps ahead
hold while the schedule keeps its value (a stage of a piecewise-constant schedule; for a linear ramp, at least
``min_chunk_steps`` steps). A chunk's spans are split at the smallest ``max_length`` of the steps it will fill, and
the pieces are planned by the ordinary planner (:func:`~lit_balance.plan.epoch.plan_epoch`: the same budget, equal
counts, LPT within steps, padded or packed); the chunks' plans are laid end to end. Pieces of one document lie in
one chunk; its full pieces (all but the last, of one length, so interchangeable in the plan) are then given to the
plan's rows of that length in piece order along the training order, so they sit next to each other: in one
micro-batch or optimizer step where they fit. Each chunk ends with at most one partly
filled optimizer step, so padding grows by about one step per chunk.

Pure NumPy: the same inputs give the same plan on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance._checks import check_int, check_lengths
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.epoch import plan_epoch
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, empty_plan
from lit_balance.schedule import Schedule

__all__ = ["LengthWarmupPlan", "length_pieces", "max_length_function", "plan_length_warmup", "remaining_spans"]

#: The fewest optimizer steps a chunk is sized for (a linear ramp changes its value every step).
DEFAULT_MIN_CHUNK_STEPS = 8
#: The share of an optimizer step's token slots a chunk is sized to fill (the planners' U is about this).
_FILL = 0.97
#: Steps looked ahead at most for the end of a stage of constant ``max_length``.
_LOOKAHEAD = 1 << 16


def length_pieces(lengths: np.ndarray, max_length: int,
                  starts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split spans of ``lengths`` tokens into pieces of at most ``max_length`` tokens, in order.

    Args:
        lengths: int ``[n]``, tokens of each span (>= 1).
        max_length: tokens per piece at most (>= 1).
        starts: int ``[n]``, the first token of each span within its document (None: 0).

    Returns:
        ``(span, start, length)``: int64 ``[num_pieces]`` each; piece ``p`` is tokens
        ``[start[p], start[p] + length[p])`` of span ``span[p]``'s document. A span of ``l`` tokens gives
        ``ceil(l / max_length)`` pieces, all of ``max_length`` tokens but the last.

    Example:
        >>> [a.tolist() for a in length_pieces(np.array([5, 2]), 2)]
        [[0, 0, 0, 1], [0, 2, 4, 0], [2, 2, 1, 2]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros_like(lengths) if starts is None else np.asarray(starts, dtype=np.int64)
    count = -(-lengths // max_length)
    span = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), count)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    k = np.arange(span.shape[0], dtype=np.int64) - np.repeat(first, count)  # piece number within its span
    offset = k * max_length
    return span, starts[span] + offset, np.minimum(lengths[span] - offset, max_length)


def max_length_function(max_length: Any, settings: BatchingSettings) -> Callable[[int], int]:
    """The per-optimizer-step ``max_length`` as a function of the step, checked against the budget.

    Args:
        max_length: a :class:`~lit_balance.Schedule` in optimizer steps (a linear one rounded down to whole
            tokens), an int (every step), a sequence of ints (step ``g`` reads item ``g``, the last item after its
            end) or a callable ``step -> int``.
        settings: the batching settings; every value must lie in ``[1, settings.truncate_to]`` (the longest row
            the budget ``max_tokens`` holds once padded).

    Raises:
        TypeError: ``max_length`` is none of these.
        ValueError: a schedule in tokens or of named values; an empty sequence; a value below 1 or above the budget
            (every point of a :class:`~lit_balance.Schedule` and every item of a sequence here, a callable's where it
            is read).
    """
    limit = settings.truncate_to

    def check(step: int, value: Any) -> int:
        return check_int(f"max_length_schedule (at optimizer step {step})", value, 1,
                         f"a piece holds at most max_tokens={settings.largest_max_tokens} padded token slots "
                         f"(pad_to_multiple_of={settings.pad_to_multiple_of}); keep the schedule within "
                         f"[1, {limit}] or raise max_tokens", limit)

    if isinstance(max_length, (bool, np.bool_, str, bytes)):
        raise InputTypeError(f"max_length_schedule must be an int, a list of ints per optimizer step or a callable "
                             f"step -> int, got {max_length!r}", parameter="max_length_schedule")
    if isinstance(max_length, Schedule):
        if max_length.unit != "steps" or max_length.keys is not None:
            raise InputValueError(f"max_length_schedule must give one number per optimizer step (unit='steps'), got "
                                  f"a schedule of unit {max_length.unit!r}"
                                  + ("" if max_length.keys is None else f" with names {list(max_length.keys)}")
                                  + "; give its points in optimizer steps", parameter="max_length_schedule")
        for at, value in zip(max_length.positions, max_length.values):  # every point, before any token is read
            check(at, math.floor(value))
        return lambda step: check(step, math.floor(max_length.value_at(step)))
    if isinstance(max_length, (int, np.integer)):
        value = check(0, max_length)
        return lambda step: value
    if callable(max_length):
        return lambda step: check(step, max_length(step))
    if isinstance(max_length, (Sequence, np.ndarray)):
        values = [check(g, v) for g, v in enumerate(np.asarray(max_length).reshape(-1).tolist())]
        if not values:
            raise InputValueError("max_length_schedule must hold at least one value, got an empty sequence",
                                  parameter="max_length_schedule")
        return lambda step: values[min(step, len(values) - 1)]
    raise InputTypeError(f"max_length_schedule must be an int, a list of ints per optimizer step or a callable "
                         f"step -> int, got {type(max_length).__name__}", parameter="max_length_schedule")


@dataclass(frozen=True)
class LengthWarmupPlan:
    """The plan of an epoch (or of its rest, on a resume) whose samples are pieces of documents.

    Attributes:
        plan: the :class:`EpochPlan`; its rows are piece numbers (indices into the arrays below).
        piece_doc: int64 ``[num_pieces]``, the document (index into the planned ``lengths``) of each piece.
        piece_start: int64 ``[num_pieces]``, the piece's first token within its document.
        piece_length: int64 ``[num_pieces]``, its tokens (at most the ``max_length`` of its optimizer step).
        step_max_length: int64 ``[num_optimizer_steps]``, the length the pieces of each optimizer step were cut to
            (at most the schedule's value at that step).
        first_step: the optimizer step (of the run) of the plan's first step.
    """

    plan: EpochPlan
    piece_doc: np.ndarray
    piece_start: np.ndarray
    piece_length: np.ndarray
    step_max_length: np.ndarray
    first_step: int = 0

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the plan."""
        return int(self.step_max_length.shape[0])



def check_warmup_settings(*, static_packing: Any, padded_shapes: Any, drop_last: Any, too_long: Any) -> None:
    """Refuse the batching settings a length warm-up cannot plan (given as set, before or after they are resolved).

    Raises:
        ValueError: ``static_packing`` or ``padded_shapes`` (fixed shapes, where each step's pieces have their own
            length), ``drop_last=True`` (samples left out, where the warm-up trains every token), ``too_long`` other
            than ``"error"`` (long documents skipped or cut, where the warm-up splits them), each naming the setting and
            ``max_length_schedule``.
    """
    for name, value in (("static_packing", static_packing), ("padded_shapes", padded_shapes),
                        ("drop_last", drop_last)):
        if value not in (None, False):
            raise InputValueError(
                f"{name}={value!r} cannot be planned with a length warm-up (max_length_schedule): "
                + ("it leaves documents out, and the warm-up trains every token" if name == "drop_last" else
                   "it fixes the micro-batches' shapes, and the warm-up cuts each step's pieces to its own length")
                + f"; leave {name} unset or leave max_length_schedule unset", parameter=name)
    if too_long not in (None, "error"):
        raise InputValueError(f"too_long={too_long!r} skips or cuts long documents, and a length warm-up "
                              "(max_length_schedule) splits them into pieces instead: leave too_long at 'error' or "
                              "leave max_length_schedule unset", parameter="too_long")

def plan_length_warmup(
    lengths: np.ndarray,
    settings: BatchingSettings,
    *,
    num_replicas: int,
    epoch: int,
    max_length: Any,
    first_step: int = 0,
    spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    cost_model: CostModelProtocol | None = None,
    min_chunk_steps: int = DEFAULT_MIN_CHUNK_STEPS,
) -> LengthWarmupPlan:
    """Plan an epoch whose documents are split into pieces no longer than each optimizer step's ``max_length``.

    Args:
        lengths: int ``[num_docs]``, tokens per document (the whole document: nothing is truncated).
        settings: the :class:`~lit_balance.BatchingSettings` (budget, padded or packed, accumulation, seed ...);
            ``drop_last`` and ``too_long`` other than ``"error"`` are refused (they leave tokens out).
        num_replicas: ranks; the plan has ``num_micro_steps x num_replicas`` micro-batches.
        epoch: the epoch (seeds the order of the documents and each chunk's plan).
        max_length: the schedule, see :func:`max_length_function` (an int, a list per optimizer step, or
            ``step -> int``); optimizer steps count from the start of the run.
        first_step: the run's optimizer step at which this plan starts (a resume mid-epoch: the steps consumed).
        spans: ``(doc, start, length)`` int ``[n]`` each, the token ranges still to train (:func:`remaining_spans`),
            or None for every document whole.
        cost_model: cost of a micro-batch (default: padded token slots).
        min_chunk_steps: the fewest optimizer steps a chunk is sized for.

    Returns:
        The :class:`LengthWarmupPlan`.

    Raises:
        ValueError: ``drop_last=True`` or ``too_long`` other than ``"error"`` with a warm-up; a ``max_length`` below
            1 or above ``max_tokens``; bad lengths or spans.

    Example:
        >>> s = BatchingSettings(max_tokens=8, shuffle=False)
        >>> wp = plan_length_warmup(np.array([8, 3, 5]), s, num_replicas=1, epoch=0, max_length=[4, 4, 8])
        >>> wp.piece_length.tolist(), wp.step_max_length.tolist()
        ([4, 4, 3, 4, 1], [4, 4, 4])
    """
    check_warmup_settings(static_packing=settings.static_packing, padded_shapes=settings.padded_shapes,
                          drop_last=settings.drop_last, too_long=settings.too_long)
    num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
    epoch = check_int("epoch", epoch, 0, "epochs count from 0")
    first_step = check_int("first_step", first_step, 0, "optimizer steps count from 0")
    min_chunk_steps = check_int("min_chunk_steps", min_chunk_steps, 1, "optimizer steps per chunk at least")
    value_at = functools.lru_cache(maxsize=None)(max_length_function(max_length, settings))
    lengths = check_lengths(lengths)
    if spans is None:
        doc = np.arange(lengths.shape[0], dtype=np.int64)
        start, length = np.zeros_like(doc), lengths.astype(np.int64)
    else:
        doc, start, length = (np.asarray(a, dtype=np.int64).reshape(-1) for a in spans)
        if not (doc.shape == start.shape == length.shape):
            raise InputValueError(f"spans must be three arrays of one shape, got {doc.shape}, {start.shape}, "
                                  f"{length.shape}", parameter="spans")
        if doc.size and (doc.min() < 0 or doc.max() >= lengths.shape[0] or start.min() < 0 or length.min() < 1
                         or np.any(start + length > lengths[doc])):
            raise InputValueError("spans must lie within their documents (0 <= start, 1 <= length, start + length "
                                  "<= the document's length)", parameter="spans")
    acc = settings.accumulate_grad_batches
    rng = np.random.default_rng([settings.seed, epoch, first_step, 0x57A6])
    order = rng.permutation(doc.shape[0]) if settings.shuffle else np.arange(doc.shape[0])
    doc, start, length = doc[order], start[order], length[order]
    ends = np.cumsum(length)

    parts: list[tuple[EpochPlan, np.ndarray, np.ndarray, np.ndarray, int, int]] = []
    step, cursor, n = first_step, 0, doc.shape[0]
    chunk_index = 0
    while cursor < n:
        done = int(ends[cursor - 1]) if cursor else 0
        capacity = _step_capacity(settings, num_replicas, value_at(step))
        # no stage is looked at beyond the steps the rest of the epoch could fill, half full
        lookahead = min(_LOOKAHEAD, 2 * -(-(int(ends[-1]) - done) // capacity) + min_chunk_steps)
        m, stage = _stage(value_at, step, min_chunk_steps, lookahead)
        capacity = _step_capacity(settings, num_replicas, m)
        target = max(1, int(_FILL * stage * capacity))
        end = int(np.searchsorted(ends, done + target, side="left")) + 1
        if end < n and int(ends[-1]) - int(ends[end - 1]) < 2 * capacity:
            end = n  # a short tail joins this chunk rather than make a chunk of its own
        end = min(max(end, cursor + 1), n)
        while True:
            span, p_start, p_len = length_pieces(length[cursor:end], m, start[cursor:end])
            chunk_settings = settings.replace(seed=_chunk_seed(settings.seed, chunk_index))
            plan = plan_epoch(p_len, chunk_settings, num_replicas=num_replicas, epoch=epoch, cost_model=cost_model)
            if plan.num_micro_steps % acc and end < n:  # whole optimizer steps: smaller micro-batches, or more pieces
                plan = plan_epoch(p_len, chunk_settings, num_replicas=num_replicas, epoch=epoch, cost_model=cost_model,
                                  min_steps=-(-plan.num_micro_steps // acc) * acc)
                if plan.num_micro_steps % acc:
                    end = min(n, end + (end - cursor) // 2 + 1)
                    continue
            k = -(-plan.num_micro_steps // acc)
            low = min((value_at(g) for g in range(step, step + k)), default=m)
            if low >= m:
                break
            m = low  # the schedule falls within the chunk's steps: cut shorter, and take fewer documents
            end = max(cursor + 1, cursor + (end - cursor) // 2)
        parts.append((_group_pieces(plan, p_len, m), doc[cursor:end][span], p_start, p_len, m, k))
        step, cursor, chunk_index = step + k, end, chunk_index + 1
    return _concat(parts, num_replicas, acc, first_step)


def remaining_spans(warmup: LengthWarmupPlan, steps_consumed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(doc, start, length)`` of the tokens that optimizer steps ``[steps_consumed, ...)`` of ``warmup`` train:
    what is left of the epoch after its first ``steps_consumed`` steps (all ranks), adjacent pieces of a document
    joined again, ready for :func:`plan_length_warmup` (``spans=``, ``first_step=warmup.first_step +
    steps_consumed``), e.g. on another number of ranks.

    Raises:
        ValueError: ``steps_consumed`` outside ``[0, warmup.num_steps]``.
    """
    steps_consumed = check_int("steps_consumed", steps_consumed, 0, "optimizer steps of the plan already run",
                               warmup.num_steps)
    seen = np.zeros(warmup.piece_doc.shape[0], dtype=bool)
    warmup.plan.mark_rows(steps_consumed * warmup.plan.accumulate_grad_batches, seen)
    left = np.flatnonzero(~seen)
    doc, start, length = warmup.piece_doc[left], warmup.piece_start[left], warmup.piece_length[left]
    order = np.lexsort((start, doc))
    doc, start, length = doc[order], start[order], length[order]
    if not doc.size:
        return doc, start, length
    joins = (doc[1:] == doc[:-1]) & (start[1:] == start[:-1] + length[:-1])  # piece i + 1 continues piece i
    head = np.concatenate([[True], ~joins])
    group = np.cumsum(head) - 1
    total = np.bincount(group, weights=length).astype(np.int64)
    return doc[head], start[head], total


def _stage(value_at: Callable[[int], int], step: int, min_steps: int, lookahead: int) -> tuple[int, int]:
    """``(max_length, steps)``: the smallest value of the schedule over the steps a chunk starting at ``step`` is
    sized for: the stage of constant value there (up to ``lookahead`` steps), at least ``min_steps``."""
    first = value_at(step)
    steps = 1
    while steps < lookahead and value_at(step + steps) == first:
        steps += 1
    steps = max(steps, min_steps)
    return min(value_at(g) for g in range(step, step + steps)), steps


def _step_capacity(settings: BatchingSettings, num_replicas: int, max_length: int) -> int:
    """Tokens one optimizer step (all ranks) holds at most when no piece is longer than ``max_length``."""
    per_batch = settings.truncate_to
    if settings.max_batch_size is not None:
        per_batch = min(per_batch, settings.max_batch_size * max_length)
    return max(1, per_batch * num_replicas * settings.accumulate_grad_batches)


def _group_pieces(plan: EpochPlan, piece_length: np.ndarray, max_length: int) -> EpochPlan:
    """``plan`` with its full pieces (``max_length`` tokens) laid out in piece order along the training order.

    Pieces of one length are interchangeable in a plan (the same slots, cost and budget), so the real rows holding a
    full piece are given the full pieces in piece order (a document's pieces are numbered one after another) as they
    come micro-step by micro-step, rank by rank: a document's pieces then sit next to each other, in one micro-batch
    or one optimizer step where they fit. Fill rows keep theirs. Nothing else of the plan changes.
    """
    order = plan.assignment.reshape(-1)  # micro-step major, then rank: the order the rows are trained in
    lo, hi = plan.batch_offsets[order], plan.batch_offsets[order + 1]
    sizes = hi - lo
    at = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    full = at[~plan.is_fill[at] & (piece_length[plan.rows[at]] == max_length)]
    if full.size < 2:
        return plan
    rows = plan.rows.copy()
    rows[full] = np.sort(rows[full])
    return dataclasses.replace(plan, rows=rows)


def _chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk``'s plan: chunk 0 plans with the sampler's own seed."""
    return seed if chunk == 0 else int(np.random.default_rng([seed, chunk]).integers(0, 2**31 - 1))


def _concat(parts: Sequence[tuple[EpochPlan, np.ndarray, np.ndarray, np.ndarray, int, int]], num_replicas: int,
            acc: int, first_step: int) -> LengthWarmupPlan:
    """The chunks' plans laid end to end, their piece numbers made global."""
    if not parts:
        z = np.empty(0, dtype=np.int64)
        return LengthWarmupPlan(empty_plan(num_replicas, acc), z, z, z, z, first_step)
    rows, fills, offsets, assignment, dropped = [], [], [np.zeros(1, dtype=np.int64)], [], []
    pieces, batches, row_count = 0, 0, 0
    for plan, _, _, p_len, _, k in parts:
        micro = plan.assignment  # every chunk but the last ends at an optimizer step's end
        rows.append(plan.rows + pieces)
        fills.append(plan.is_fill)
        offsets.append(plan.batch_offsets[1:] + row_count)
        assignment.append(micro + batches)
        dropped.append(plan.dropped + pieces)
        pieces += p_len.shape[0]
        batches += plan.num_batches
        row_count += plan.rows.shape[0]
    plan = EpochPlan(rows=np.concatenate(rows), is_fill=np.concatenate(fills),
                     batch_offsets=np.concatenate(offsets), assignment=np.concatenate(assignment),
                     dropped=np.concatenate(dropped), accumulate_grad_batches=acc)
    return LengthWarmupPlan(plan=plan, piece_doc=np.concatenate([p[1] for p in parts]),
                            piece_start=np.concatenate([p[2] for p in parts]),
                            piece_length=np.concatenate([p[3] for p in parts]),
                            step_max_length=np.concatenate([np.full(p[5], p[4], dtype=np.int64) for p in parts]),
                            first_step=first_step)
