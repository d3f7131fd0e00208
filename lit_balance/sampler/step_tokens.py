"""The sampler of a tokens-per-step schedule: this rank's column of a
:class:`~lit_balance.plan.step_tokens.TokenStepPlan`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from lit_balance._checks import check_int, check_lengths
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.step_tokens import SETTING, TokenStepPlan, check_tokens_per_step_schedule, plan_tokens_per_step
from lit_balance.plan.types import MicroBatch
from lit_balance.schedule import Schedule

__all__ = ["TokensPerStepSampler"]

#: Version of :meth:`TokensPerStepSampler.state_dict`'s layout.
STATE_VERSION = 1


class TokensPerStepSampler(DistributedSampler):
    """Micro-batches whose optimizer steps hold the global real tokens of ``tokens_per_step_schedule``.

    Yields, for this ``rank``, one :class:`~lit_balance.plan.types.MicroBatch` per micro-step, carrying its step's
    global ``step_real_tokens`` and ``step_rows``; the plan is
    :func:`~lit_balance.plan.step_tokens.plan_tokens_per_step` (every document once per epoch, each step within one
    document of its scheduled tokens, every micro-batch within ``max_tokens``, equal counts on every rank). Step ``g``
    runs :attr:`step_micro_batches` ``[g]`` micro-batches per rank; add
    :class:`lit_balance.callbacks.TokensPerStepAccumulation` to the Trainer so Lightning's optimizer steps follow
    them. Optimizer steps count from the start of the run (earlier epochs are planned to know where an epoch starts).

    Resume: :meth:`state_dict` holds the schedule, the epoch, where it starts in the run and its segments
    (``[num_replicas, micro-steps consumed]``); :meth:`load_state_dict` continues it, on another number of ranks too
    (the documents of the steps not yet trained, planned from the step reached: the same documents). A schedule given
    to the new sampler may change points at or after the step reached (the future); an edit before it is refused
    naming the first differing point (:meth:`~lit_balance.Schedule.check_unchanged_before`).

    Args:
        lengths: int ``[num_docs]``, tokens of each document (global).
        settings: :class:`~lit_balance.BatchingSettings` (``drop_last=False``; ``accumulate_grad_batches`` unused).
        tokens_per_step_schedule: global real tokens per optimizer step (a :class:`~lit_balance.Schedule` or what
            :meth:`Schedule.of` takes), each value >= ``max_tokens * num_replicas``.
        num_replicas, rank: the data-parallel world.

    Raises:
        ValueError: bad lengths or ranks; ``drop_last=True``; a schedule value below one micro-batch's budget times
            the ranks (before any token is read).

    Example:
        >>> s = TokensPerStepSampler([4] * 6, BatchingSettings(max_tokens=4, shuffle=False), [[0, 4], [1, 8]],
        ...                          num_replicas=1, rank=0)
        >>> [list(mb) for mb in s], s.step_micro_batches.tolist()
        ([[0], [1], [2], [3], [4], [5]], [1, 2, 2, 1])
    """

    def __init__(self, lengths: Any, settings: BatchingSettings, tokens_per_step_schedule: Any, *,
                 num_replicas: int, rank: int) -> None:
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a lit_balance.BatchingSettings, got {type(settings).__name__}",
                                 parameter="settings")
        self.num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
        self.rank = check_int("rank", rank, 0, "ranks count from 0", self.num_replicas - 1)
        if settings.drop_last:
            raise InputValueError(f"{SETTING} plans every document once per epoch; drop_last=True would leave some "
                                  "out: set drop_last=False", parameter="drop_last")
        self._schedule = check_tokens_per_step_schedule(tokens_per_step_schedule, settings, self.num_replicas)
        self._saved_schedule: Schedule | None = None  # the schedule of the steps before a resume's cut
        self._lengths = check_lengths(lengths)
        self._settings = settings
        self._epoch = 0
        self._segments: list[list[int]] = [[self.num_replicas, 0]]
        self._epoch_starts: dict[int, tuple[int, int]] = {0: (0, 0)}
        self._cache: tuple[tuple, TokenStepPlan] | None = None
        self._resume_pending, self._yielded = False, 0

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens of each document."""
        return self._lengths

    @property
    def settings(self) -> BatchingSettings:
        """The batching settings."""
        return self._settings

    @property
    def schedule(self) -> Schedule:
        """The tokens-per-step schedule in force (the one given, or at a resume the edited one)."""
        return self._schedule

    def _plan_epoch(self, epoch: int, start: tuple[int, int], replicas: int,
                    documents: np.ndarray | None = None, schedule: Schedule | None = None) -> TokenStepPlan:
        return plan_tokens_per_step(self._lengths, self._settings, num_replicas=replicas, epoch=epoch,
                                    schedule=self._schedule if schedule is None else schedule,
                                    first_step=start[0], tokens_before=start[1], documents=documents)

    def epoch_start(self, epoch: int) -> tuple[int, int]:
        """``(first optimizer step, global real tokens before it)`` of ``epoch`` in the run."""
        known = max(e for e in self._epoch_starts if e <= epoch)
        start = self._epoch_starts[known]
        for e in range(known, epoch):
            p = self._plan_epoch(e, start, self.num_replicas)
            start = (start[0] + p.num_steps, start[1] + int(p.step_tokens.sum()))
            self._epoch_starts[e + 1] = start
        return start

    def plan(self) -> TokenStepPlan:
        """The plan of the current segment of the epoch: the whole epoch, or after a resume on another number of
        ranks or with an edited schedule, its rest (then its first step is the run's step reached)."""
        key = (self._epoch, tuple(map(tuple, self._segments)), self._schedule.fingerprint)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        start = self.epoch_start(self._epoch)
        segments = self._segments
        old = self._saved_schedule or self._schedule
        plan = self._plan_epoch(self._epoch, start, segments[0][0], schedule=old if len(segments) > 1 else None)
        for i, ((_, consumed), (replicas, _)) in enumerate(zip(segments[:-1], segments[1:])):
            steps = int(np.searchsorted(plan.step_starts, consumed))
            done = np.zeros(self._lengths.shape[0], dtype=bool)
            plan.plan.mark_rows(consumed, done)
            rest = plan.order[~done[plan.order]]  # in the order of the uninterrupted run
            last = i == len(segments) - 2
            plan = self._plan_epoch(self._epoch, (plan.first_step + steps,
                                                  plan.tokens_before + int(plan.step_tokens[:steps].sum())),
                                    replicas, documents=rest, schedule=None if last else old)
        self._cache = (key, plan)
        return plan

    @property
    def step_micro_batches(self) -> np.ndarray:
        """int64 ``[steps]``: micro-batches per rank of each optimizer step of the current segment."""
        return self.plan().step_micro_batches

    def step_bounds(self) -> np.ndarray:
        """int64 ``[steps + 1]``: the epoch's micro-step (Lightning's ``batch_idx``, from the epoch's start) at which
        each optimizer step of the current segment starts, and its end."""
        return self.plan().step_starts + self.first_micro_step

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` next (Lightning calls this before each epoch)."""
        epoch = check_int("epoch", epoch, 0, "epochs count from 0")
        if epoch == self._epoch + 1:  # where the next epoch starts: where this one's plan (resumed or not) ends
            p = self.plan()
            self._epoch_starts[epoch] = (p.first_step + p.num_steps, p.tokens_before + int(p.step_tokens.sum()))
        if epoch != self._epoch:
            self._epoch, self._segments, self._resume_pending = epoch, [[self.num_replicas, 0]], False
            self._saved_schedule = None

    @property
    def epoch(self) -> int:
        """The epoch planned."""
        return self._epoch

    @property
    def first_micro_step(self) -> int:
        """Micro-step of the epoch at which the current segment starts (0 unless resumed on another plan)."""
        return sum(consumed for _, consumed in self._segments[:-1])

    @property
    def start_micro_step(self) -> int:
        """Micro-step of the epoch at which the next pass begins."""
        return self.first_micro_step + self._segments[-1][1]

    def __len__(self) -> int:
        """Micro-batches of the epoch on this rank, counted from its start."""
        return self.first_micro_step + self.plan().plan.num_micro_steps

    def __iter__(self) -> Iterator[MicroBatch]:
        if not self._resume_pending:
            self._segments = [[self.num_replicas, 0]]
            self._saved_schedule = None
        self._resume_pending = False
        self._yielded = 0
        return self._iterate()

    def _iterate(self) -> Iterator[MicroBatch]:
        steps = self.plan()
        plan, starts = steps.plan, steps.step_starts
        real = plan.real_tokens_per_batch(self._lengths)
        rows = plan.real_rows_per_batch()
        step_of = np.repeat(np.arange(steps.num_steps), steps.step_micro_batches)
        for s in range(self._segments[-1][1], plan.num_micro_steps):
            g = int(step_of[s])
            batches = plan.assignment[starts[g]:starts[g + 1]].reshape(-1)
            indices, fill = plan.batch(int(plan.assignment[s, self.rank]))
            self._yielded += 1
            yield MicroBatch(indices, fill, step_real_tokens=int(real[batches].sum()),
                             step_rows=int(rows[batches].sum()))

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Plain-Python resume state, the same on every rank.

        Args:
            batches_consumed: micro-batches of the epoch consumed by training, from the epoch's start (default: those
                the latest pass yielded after :attr:`start_micro_step`).

        Returns:
            ``{"version", "epoch", "epoch_start", "segments", "num_samples", "settings", "tokens_per_step_schedule",
            "saved_schedule"}``; once the epoch is consumed, the start of the next one.
        """
        if batches_consumed is None:
            batches_consumed = self.start_micro_step + self._yielded
        consumed = check_int("batches_consumed", batches_consumed, self.first_micro_step,
                             "micro-batches of the epoch consumed, counted from its start", len(self))
        saved = self._saved_schedule
        if consumed == len(self):
            epoch, segments = self._epoch + 1, [[self.num_replicas, 0]]
            p = self.plan()
            start = (p.first_step + p.num_steps, p.tokens_before + int(p.step_tokens.sum()))
            saved = None
        else:
            epoch, start = self._epoch, self.epoch_start(self._epoch)
            segments = [list(s) for s in self._segments[:-1]] + [[self.num_replicas, consumed - self.first_micro_step]]
        return {"version": STATE_VERSION, "epoch": epoch, "epoch_start": list(start), "segments": segments,
                "num_samples": int(self._lengths.shape[0]), "settings": self._settings.to_dict(),
                SETTING: self._schedule.to_dict(), "saved_schedule": None if saved is None else saved.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s position; on another number of ranks or with an edited future schedule, the
        rest of the epoch is planned anew from the step reached.

        Raises:
            ValueError: missing or unknown keys, another version, corpus or settings; a schedule that changes a point
                before the step reached (naming the first differing point); on another plan, a position inside an
                optimizer step.
        """
        self._load(state, check=True)

    def _load(self, state: dict[str, Any], *, check: bool) -> None:
        keys = {"version", "epoch", "epoch_start", "segments", "num_samples", "settings", SETTING, "saved_schedule"}
        if set(state) != keys:
            raise InputValueError(f"a tokens-per-step state holds the keys {sorted(keys)}, got {sorted(state)}")
        if state["version"] != STATE_VERSION or state["num_samples"] != self._lengths.shape[0]:
            raise InputValueError(f"the state is of version {state['version']} over {state['num_samples']} "
                                  f"documents; this sampler reads version {STATE_VERSION} over "
                                  f"{self._lengths.shape[0]}: resume on the same corpus")
        if BatchingSettings.from_dict(state["settings"]) != self._settings:
            raise InputValueError("the state was saved with other batching settings; resume with the same ones")
        new = self._schedule
        saved = Schedule.from_dict(state[SETTING])
        before_cut = Schedule.from_dict(state["saved_schedule"]) if state["saved_schedule"] is not None else saved
        epoch = int(state["epoch"])
        start = (int(state["epoch_start"][0]), int(state["epoch_start"][1]))
        segments = [[int(r), int(c)] for r, c in state["segments"]]
        self._epoch, self._epoch_starts, self._cache = epoch, {epoch: start}, None
        self._schedule, self._saved_schedule = saved, (before_cut if len(segments) > 1 else None)
        self._segments = segments
        plan = self.plan()  # the saved plan of the state's segment
        consumed = segments[-1][1]
        steps = int(np.searchsorted(plan.step_starts, consumed))
        reached = plan.first_step + steps
        at_tokens = plan.tokens_before + int(plan.step_tokens[:steps].sum())
        self._schedule = new
        if check:
            saved.check_unchanged_before(new, at_tokens if saved.unit == "tokens" else reached)
        changed = new.fingerprint != saved.fingerprint
        if segments[-1][0] != self.num_replicas or (changed and consumed):
            if consumed not in set(plan.step_starts.tolist()):
                raise InputValueError(f"the state lies at micro-step {consumed}, inside an optimizer step: resume on "
                                      f"{segments[-1][0]} ranks with the saved {SETTING}, or from a checkpoint at an "
                                      "optimizer step's end")
            self._saved_schedule = before_cut if len(segments) > 1 or changed else None
            if changed and len(segments) == 1:
                self._saved_schedule = saved
            segments.append([self.num_replicas, 0])
        elif changed:  # at the epoch's start: the new schedule from here
            self._saved_schedule = None
        self._segments, self._cache = segments, None
        self._resume_pending = True
