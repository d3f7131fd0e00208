"""How a :class:`~lit_balance.BalancedBatchSampler` makes its plans: of whole samples (:class:`SamplePlans`, the
default), or of pieces of documents under a length warm-up (:class:`LengthWarmupPlans`, ``max_length_schedule=``).

The sampler holds one of them and asks it for the inputs of its plans, the plan of the current segment of an epoch
(:func:`~lit_balance.sampler.state.replay` for whole samples) and the keys it adds to the resume state; everything
else (position, equal counts, skipped steps, the state's other keys, resume on another number of ranks) is the
sampler's own, the same for both.

A length warm-up (:mod:`lit_balance.plan.warmup`): while the schedule's ``max_length`` is below a document's length,
the document is trained as pieces of at most ``max_length`` tokens, each a row of its own, so no token is lost.
Optimizer steps count from the start of the run: the state saves the schedule and the run's step at which the saved epoch
starts, so a resume on any number of ranks plans the rest of the epoch (the tokens not yet trained) from the step
reached, with the same schedule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_balance._checks import check_int
from lit_balance._fingerprint import sha256_of_int64
from lit_balance.errors import InputValueError
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.warmup import (DEFAULT_MIN_CHUNK_STEPS, LengthWarmupPlan, check_warmup_settings,
                                     max_length_function, plan_length_warmup, remaining_spans)
from lit_balance.sampler import state as sampler_state
from lit_balance.sampler.inputs import PlanInputs
from lit_balance.sampler.state import Replay, ReplayRecord
from lit_balance.schedule import Schedule

__all__ = ["LengthWarmupPlans", "SamplePlans", "plans_for"]


class SamplePlans:
    """Plans of whole samples: the sampler's default."""

    #: ``skip_steps(..., replace=True)`` re-plans the rest of an epoch of these plans.
    replaces_skipped_steps = True

    def inputs(self, lengths: np.ndarray, settings: BatchingSettings, supervised_lengths: Any,
               num_replicas: int) -> PlanInputs:
        """The inputs every plan is made from (:meth:`PlanInputs.build`)."""
        return PlanInputs.build(lengths, settings, supervised_lengths, num_replicas)

    def replay(self, inputs: PlanInputs, record: ReplayRecord, num_replicas: int) -> Replay:
        """The plan of the record's current segment (:func:`~lit_balance.sampler.state.replay`)."""
        return sampler_state.replay(inputs, record, num_replicas)

    def state(self, inputs: PlanInputs, record: ReplayRecord, num_replicas: int, epoch: int) -> dict[str, Any]:
        """Keys added to the resume state: none."""
        return {}

    def load_state(self, state: dict[str, Any], record: ReplayRecord) -> None:
        """Refuse a state saved under a length warm-up.

        Raises:
            ValueError: the state holds ``max_length_schedule``.
        """
        if "max_length_schedule" in state:
            saved = state["max_length_schedule"]
            points = saved.get("points") if isinstance(saved, dict) else saved
            raise InputValueError(
                f"cannot resume: the checkpoint was saved with a length warm-up (max_length_schedule={points!r}), and "
                "this sampler plans whole documents: pass the same max_length_schedule",
                parameter="max_length_schedule")


class LengthWarmupPlans:
    """Plans of pieces of documents no longer than each optimizer step's ``max_length`` (a length warm-up).

    Args:
        max_length_schedule: a :class:`~lit_balance.Schedule` in optimizer steps of the run (a linear one rounded
            down to whole tokens), or what :meth:`Schedule.of <lit_balance.Schedule.of>` reads: an int (every step), a
            list of ``[step, max_length]`` points, or ``{"points": ..., "interpolation": ...}``.
        min_chunk_steps: see :func:`~lit_balance.plan.warmup.plan_length_warmup`.

    Raises:
        TypeError, ValueError: as :class:`~lit_balance.Schedule`; a schedule in tokens or of named values.
    """

    #: The rest of a warm-up epoch is not re-planned for ``skip_steps(..., replace=True)``.
    replaces_skipped_steps = False

    def __init__(self, max_length_schedule: Any, min_chunk_steps: int = DEFAULT_MIN_CHUNK_STEPS) -> None:
        self.schedule = Schedule.of(max_length_schedule, name="max_length_schedule")
        if self.schedule.unit != "steps" or self.schedule.keys is not None:
            raise InputValueError(f"max_length_schedule must give one number per optimizer step (unit='steps'), got "
                                  f"a schedule of unit {self.schedule.unit!r}"
                                  + ("" if self.schedule.keys is None else f" with names {list(self.schedule.keys)}")
                                  + "; give its points in optimizer steps", parameter="max_length_schedule")
        self.min_chunk_steps = check_int("min_chunk_steps", min_chunk_steps, 1, "optimizer steps per chunk at least")
        self._starts: dict[int, int] = {0: 0}  # epoch -> the run's optimizer step at which it starts

    def inputs(self, lengths: np.ndarray, settings: BatchingSettings, supervised_lengths: Any,
               num_replicas: int) -> PlanInputs:
        """The inputs of the warm-up's plans: every document whole (pieces are cut per chunk), planned whole.

        Raises:
            ValueError: static shapes (``static_packing``, ``padded_shapes``), masked labels (``supervised_lengths``),
                ``drop_last=True`` or ``too_long`` other than ``"error"``, each naming the setting and
                ``max_length_schedule``; a schedule value outside ``[1, max_tokens]``.
        """
        check_warmup_settings(static_packing=settings.static_packing, padded_shapes=settings.padded_shapes,
                              drop_last=settings.drop_last, too_long=settings.too_long)
        if supervised_lengths is not None:
            raise InputValueError(
                "masked labels (supervised_lengths: prompt-completion records) are not planned under a length "
                "warm-up (max_length_schedule): a piece's targets are not counted yet; train on plain texts or leave "
                "max_length_schedule unset", parameter="max_length_schedule")
        max_length_function(self.schedule, settings)  # every point within the budget, before any token is read
        lengths = np.asarray(lengths).astype(np.int64)
        return PlanInputs(lengths, settings, None, None, None, sha256_of_int64(lengths))

    def first_step(self, inputs: PlanInputs, epoch: int, num_replicas: int) -> int:
        """The run's optimizer step at which ``epoch`` starts: saved, or after the earlier epochs planned whole on
        ``num_replicas`` ranks from the latest epoch whose start is known."""
        known = max(e for e in self._starts if e <= epoch)
        step = self._starts[known]
        for e in range(known, epoch):
            step += self._plan(inputs, e, num_replicas, step, None, inputs.settings).num_steps
            self._starts[e + 1] = step
        return step

    def _plan(self, inputs: PlanInputs, epoch: int, num_replicas: int, first_step: int, spans: Any,
              settings: BatchingSettings, cost_model: Any = None) -> LengthWarmupPlan:
        return plan_length_warmup(inputs.lengths, settings, num_replicas=num_replicas, epoch=epoch,
                                  max_length=self.schedule, first_step=first_step, spans=spans,
                                  cost_model=cost_model, min_chunk_steps=self.min_chunk_steps)

    def replay(self, inputs: PlanInputs, record: ReplayRecord, num_replicas: int) -> Replay:
        """The plan of the record's current segment, its rows pieces of documents; each earlier segment's plan,
        rebuilt as it ran, leaves the tokens it did not train to the next.

        Raises:
            ValueError: rank speeds or per-rank budgets that changed with the number of ranks (not planned under a
                warm-up); a segment that consumed more micro-steps than its plan has, or stopped inside an optimizer
                step before a change of the number of ranks.
        """
        if record.rank_speeds is not None or record.first_speeds is not None:
            raise InputValueError("rank_speeds (unequal ranks, e.g. from CostModelFeedback(fit_speeds=True)) are not "
                                  "planned under a length warm-up (max_length_schedule): leave rank_speeds unset "
                                  "(CostModelFeedback(fit_speeds=False)) or leave max_length_schedule unset",
                                  parameter="rank_speeds")
        if record.segment_max_tokens is not None:
            raise InputValueError("a length warm-up (max_length_schedule) resumes on another number of ranks with the "
                                  "same max_tokens only; keep max_tokens", parameter="max_tokens")
        settings, acc = inputs.settings, inputs.settings.accumulate_grad_batches
        segments = record.segments or ((num_replicas, 0),)
        first = self.first_step(inputs, record.epoch, segments[0][0])
        warmup = self._plan(inputs, record.epoch, segments[0][0], first, None, settings, record.cost_model)
        tokens, rows = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for (replicas, consumed), (after, _) in zip(segments[:-1], segments[1:]):
            plan = warmup.plan
            if consumed > plan.num_micro_steps:
                raise InputValueError(
                    f"the saved state consumed {consumed} micro-steps of epoch {record.epoch} on {replicas} rank(s), "
                    f"but that plan has only {plan.num_micro_steps}: the state does not belong to this sampler")
            if consumed % acc:
                raise InputValueError(
                    f"the saved state lies at micro-step {consumed}, inside an optimizer step of "
                    f"accumulate_grad_batches={acc}; a length warm-up (max_length_schedule) resumes on another number "
                    f"of ranks at an optimizer step's end: resume on {replicas} ranks, or from a checkpoint saved at "
                    "an optimizer step's end", parameter="max_length_schedule")
            step_tokens = plan.real_tokens_per_batch(warmup.piece_length)[plan.assignment].sum(axis=1)
            step_rows = plan.real_rows_per_batch()[plan.assignment].sum(axis=1)
            tokens.append(step_tokens[:consumed].astype(np.int64))
            rows.append(step_rows[:consumed].astype(np.int64))
            warmup = self._plan(inputs, record.epoch, after, warmup.first_step + consumed // acc,
                                remaining_spans(warmup, consumed // acc), settings, record.cost_model)
        # the next epoch starts where this one ends, as it ran (the first replay of an epoch is the one that runs)
        self._starts.setdefault(record.epoch + 1, warmup.first_step + warmup.num_steps)
        earlier_tokens, earlier_rows = np.concatenate(tokens), np.concatenate(rows)
        return Replay(warmup.plan, earlier_tokens, earlier_rows, earlier_tokens - earlier_rows,
                      pieces=(warmup.piece_doc, warmup.piece_start, warmup.piece_length))

    def state(self, inputs: PlanInputs, record: ReplayRecord, num_replicas: int, epoch: int) -> dict[str, Any]:
        """``{"max_length_schedule": schedule.to_dict(), "first_optimizer_step": int}``: the schedule and the run's
        optimizer step at which the saved ``epoch`` starts."""
        return {"max_length_schedule": self.schedule.to_dict(),
                "first_optimizer_step": int(self.first_step(inputs, epoch, num_replicas))}

    def load_state(self, state: dict[str, Any], record: ReplayRecord) -> None:
        """Take the saved epoch's first optimizer step.

        Raises:
            ValueError: the state has no length warm-up, or another schedule (naming the first differing point).
        """
        if "max_length_schedule" not in state or "first_optimizer_step" not in state:
            raise InputValueError(
                f"cannot resume: the checkpoint was saved without a length warm-up, and this sampler has "
                f"max_length_schedule={self.schedule.points_as_given()}: leave max_length_schedule unset to resume "
                "it", parameter="max_length_schedule")
        saved = Schedule.from_dict(state["max_length_schedule"])
        if saved.fingerprint != self.schedule.fingerprint:
            raise InputValueError(
                f"cannot resume: the checkpoint's max_length_schedule is {saved.points_as_given()} "
                f"({saved.interpolation}), this sampler's is {self.schedule.points_as_given()} "
                f"({self.schedule.interpolation}); resume with the saved max_length_schedule",
                parameter="max_length_schedule")
        start = check_int("first_optimizer_step", state["first_optimizer_step"], 0, "optimizer steps count from 0")
        self._starts = {0: 0, int(record.epoch): start}


def plans_for(max_length_schedule: Any) -> SamplePlans | LengthWarmupPlans:
    """The plans of a sampler: of whole samples, or of pieces under ``max_length_schedule`` (None: whole samples)."""
    return SamplePlans() if max_length_schedule is None else LengthWarmupPlans(max_length_schedule)
