"""Tokens per optimizer step as a schedule: a batch-size ramp in tokens, exact to one document per step.

Megatron-LM ramps the global batch in samples (``--rampup-batch-size``, ``--step-batch-size-schedule``); here the
global **real tokens** of each optimizer step follow a :class:`~lit_balance.Schedule` (``tokens_per_step_schedule``).

How a plan is made (:func:`plan_tokens_per_step`): the epoch's documents are taken in a seeded order (index order
without ``shuffle``) and cut into optimizer steps: step ``g`` takes the next documents while their tokens stay within
the schedule's value ``T(g)``, so it holds ``T(g) - l < tokens <= T(g)`` (``l`` the next document's length: within one
document of the schedule; only the epoch's last step may hold less). Each step's documents are planned by the ordinary
planner (:func:`~lit_balance.plan.epoch.plan_epoch`: the same budget, padded or packed, equal counts on every rank,
LPT over ranks), so step ``g`` runs ``k_g`` micro-batches on every rank, its accumulation
(``step_micro_batches[g]``), which :class:`lit_balance.callbacks.TokensPerStepAccumulation` applies to the Trainer.

Pure NumPy: the same inputs give the same plan on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance._checks import check_int, check_lengths
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.epoch import plan_epoch
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, empty_plan, padded_lengths
from lit_balance.schedule import Schedule

__all__ = ["TokenStepPlan", "check_tokens_per_step_schedule", "plan_tokens_per_step"]

#: The setting's name in errors, configs and state.
SETTING = "tokens_per_step_schedule"


def check_tokens_per_step_schedule(schedule: Any, settings: BatchingSettings, num_replicas: int) -> Schedule:
    """The schedule of global real tokens per optimizer step, checked against one micro-step's budget.

    Args:
        schedule: a :class:`~lit_balance.Schedule` of numbers or what :meth:`Schedule.of` takes (an int, a list of
            ``[at, tokens]`` pairs, a mapping with ``points``); values are global real tokens per optimizer step (all
            ranks, all micro-batches).
        settings: the batching settings (``max_tokens`` per rank, or one per rank).
        num_replicas: data-parallel ranks.

    Returns:
        The :class:`~lit_balance.Schedule`, named ``tokens_per_step_schedule``.

    Raises:
        TypeError, ValueError: points the schedule refuses; mapping values; a value below one micro-batch's budget
            times the ranks (``sum`` of the per-rank budgets), which no step of whole micro-batches could honour.
    """
    schedule = Schedule.of(schedule, name=SETTING)
    if schedule.keys is not None:
        raise InputTypeError(f"{SETTING}: values are global real tokens per optimizer step (numbers), got mappings "
                             f"naming {list(schedule.keys)}", parameter=SETTING)
    floor = int(sum(settings.rank_max_tokens(num_replicas)))
    for at, value in schedule.points_as_given():
        if value < floor:
            raise InputValueError(f"{SETTING}: the point at {at} {schedule.unit} asks {value:g} tokens per optimizer "
                                  f"step, below one micro-batch's budget times the ranks ({floor} = max_tokens "
                                  f"{settings.max_tokens} x {num_replicas} ranks); raise the point to >= {floor} or "
                                  "lower max_tokens", parameter=SETTING)
    return schedule


@dataclass(frozen=True)
class TokenStepPlan:
    """An epoch's plan whose optimizer steps hold the tokens a schedule gives.

    Attributes:
        plan: the :class:`~lit_balance.plan.types.EpochPlan` (micro-steps of all steps laid end to end;
            ``accumulate_grad_batches`` is 1: the steps are given by ``step_micro_batches``).
        step_micro_batches: int64 ``[num_steps]``, micro-batches per rank of each optimizer step (its accumulation).
        step_tokens: int64 ``[num_steps]``, global real tokens of each step.
        step_target: int64 ``[num_steps]``, the schedule's value for each step (rounded down to whole tokens).
        first_step: the run's optimizer step at which this plan starts.
        tokens_before: global real tokens the run trained before :attr:`first_step`.
        order: int64 ``[n]``, the documents in the order the steps take them (step ``g`` holds the next ones).
    """

    plan: EpochPlan
    step_micro_batches: np.ndarray
    step_tokens: np.ndarray
    step_target: np.ndarray
    first_step: int
    tokens_before: int
    order: np.ndarray

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the plan."""
        return int(self.step_micro_batches.shape[0])

    @property
    def step_starts(self) -> np.ndarray:
        """int64 ``[num_steps + 1]``: the micro-step at which each step starts, and the plan's end."""
        return np.concatenate([[0], np.cumsum(self.step_micro_batches)]).astype(np.int64)


def _target(schedule: Schedule) -> Callable[[int, int], int]:
    if schedule.unit == "tokens":
        return lambda step, tokens: int(schedule.value_at(tokens))
    return lambda step, tokens: int(schedule.value_at(step))


def plan_tokens_per_step(lengths: Any, settings: BatchingSettings, *, num_replicas: int, epoch: int,
                         schedule: Any, first_step: int = 0, tokens_before: int = 0,
                         documents: np.ndarray | None = None) -> TokenStepPlan:
    """Plan an epoch whose optimizer steps hold the global real tokens ``schedule`` gives (see the module doc).

    Args:
        lengths: int ``[num_docs]``, tokens of each document (global), each within the budget.
        settings: :class:`~lit_balance.BatchingSettings`; ``drop_last=False`` (every document once per epoch).
            Its ``accumulate_grad_batches`` is not used: the schedule sets each step's.
        num_replicas: data-parallel ranks.
        epoch: seeds the order (with ``shuffle``) and each step's plan.
        schedule: tokens per optimizer step (:func:`check_tokens_per_step_schedule`).
        first_step: the run's optimizer step at which this plan starts (the schedule is read from there).
        tokens_before: global real tokens trained before ``first_step`` (for a schedule in tokens).
        documents: int ``[n]``, the documents to plan, in the order the steps take them (not shuffled), or None for
            every document in a seeded order (with ``shuffle``). A resume passes the rest of the saved plan's
            :attr:`TokenStepPlan.order`, so its steps hold the documents of the uninterrupted run.

    Returns:
        The :class:`TokenStepPlan`.

    Raises:
        ValueError: bad lengths or ranks; ``drop_last=True``; a schedule :func:`check_tokens_per_step_schedule`
            refuses; a document over the budget.

    Example:
        >>> p = plan_tokens_per_step([4] * 6, BatchingSettings(max_tokens=4, shuffle=False), num_replicas=1,
        ...                          epoch=0, schedule=[[0, 4], [1, 8]])
        >>> p.step_micro_batches.tolist(), p.step_tokens.tolist()
        ([1, 2, 2, 1], [4, 8, 8, 4])
    """
    lengths = check_lengths(lengths)
    num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
    epoch = check_int("epoch", epoch, 0, "epochs count from 0")
    if settings.drop_last:
        raise InputValueError(f"{SETTING} plans every document once per epoch; drop_last=True would leave some out: "
                              "set drop_last=False", parameter="drop_last")
    schedule = check_tokens_per_step_schedule(schedule, settings, num_replicas)
    target = _target(schedule)
    given = documents is not None
    documents = np.asarray(documents if given else np.arange(lengths.shape[0]), dtype=np.int64)
    too_long = padded_lengths(lengths[documents], settings.pad_to_multiple_of) > min(settings.rank_max_tokens(
        num_replicas))
    if too_long.any():
        d = int(documents[np.flatnonzero(too_long)[0]])
        raise InputValueError(f"{SETTING}: document {d} has {int(lengths[d])} tokens, over the budget "
                              f"max_tokens={settings.max_tokens}; every document must fit one micro-batch",
                              parameter="max_tokens")
    if settings.shuffle and not given:
        order = documents[np.random.default_rng([settings.seed, epoch, 0x70CE]).permutation(documents.shape[0])]
    else:
        order = documents
    cum = np.concatenate([[0], np.cumsum(lengths[order], dtype=np.int64)])
    step_settings = dataclasses.replace(settings, accumulate_grad_batches=1)
    parts, micro, tokens, targets = [], [], [], []
    start, step, trained = 0, first_step, tokens_before
    n = order.shape[0]
    while start < n:
        want = target(step, trained)
        end = int(np.searchsorted(cum, cum[start] + want, side="right")) - 1
        end = max(end, start + 1)  # a step holds at least one document (want >= the budget >= any document)
        group = order[start:end]
        plan = plan_epoch(lengths[group], step_settings, num_replicas=num_replicas, epoch=epoch)
        parts.append((plan, group))
        micro.append(plan.num_micro_steps)
        got = int(cum[end] - cum[start])
        tokens.append(got)
        targets.append(want)
        trained += got
        step += 1
        start = end
    return TokenStepPlan(plan=_concat(parts, num_replicas), step_micro_batches=np.asarray(micro, dtype=np.int64),
                         step_tokens=np.asarray(tokens, dtype=np.int64),
                         step_target=np.asarray(targets, dtype=np.int64), first_step=int(first_step),
                         tokens_before=int(tokens_before), order=order)


def _concat(parts: list[tuple[EpochPlan, np.ndarray]], num_replicas: int) -> EpochPlan:
    """The steps' plans laid end to end, their rows mapped back to document indices."""
    if not parts:
        return empty_plan(num_replicas)
    rows, fills, offsets, assignment = [], [], [np.zeros(1, dtype=np.int64)], []
    batches, row_count = 0, 0
    for plan, group in parts:
        rows.append(group[plan.rows])
        fills.append(plan.is_fill)
        offsets.append(plan.batch_offsets[1:] + row_count)
        assignment.append(plan.assignment + batches)
        batches += plan.num_batches
        row_count += plan.rows.shape[0]
    return EpochPlan(rows=np.concatenate(rows), is_fill=np.concatenate(fills), batch_offsets=np.concatenate(offsets),
                     assignment=np.concatenate(assignment), dropped=np.empty(0, dtype=np.int64),
                     accumulate_grad_batches=1)
