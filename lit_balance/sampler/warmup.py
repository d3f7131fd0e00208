"""The sampler of a length warm-up: this rank's column of a :class:`~lit_balance.plan.warmup.LengthWarmupPlan`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from lit_balance._checks import check_int, check_lengths
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import PieceMicroBatch
from lit_balance.plan.warmup import (DEFAULT_MIN_CHUNK_STEPS, LengthWarmupPlan, max_length_function,
                                     plan_length_warmup, remaining_spans)

__all__ = ["LengthWarmupSampler"]

#: Version of :meth:`LengthWarmupSampler.state_dict`'s layout.
STATE_VERSION = 1


class LengthWarmupSampler(DistributedSampler):
    """Micro-batches of pieces of documents, each piece at most its optimizer step's ``max_length`` tokens.

    Yields, for this ``rank``, one :class:`~lit_balance.plan.types.PieceMicroBatch` per micro-step (document indices
    with each row's ``piece_start`` and ``piece_length``, and the step's global ``step_real_tokens`` and
    ``step_rows``, a row being a piece); read them with :class:`~lit_balance.data.pieces.PieceDataset`. The plan is
    :func:`~lit_balance.plan.warmup.plan_length_warmup`: every token of every document once per epoch, every
    micro-batch within ``max_tokens``, the same count on every rank. Optimizer steps count from the start of the run
    (epoch ``e`` starts where epoch ``e - 1`` ended: earlier epochs are planned to know where).

    Resume: :meth:`state_dict` holds the epoch and its segments (``[num_replicas, micro-steps consumed]``, one per
    world size the epoch ran on); :meth:`load_state_dict` replans the rest of the epoch, on another number of ranks
    too (from the tokens not yet trained, the schedule continuing at the step reached). On another number of ranks
    the checkpoint must lie at an optimizer step's end.

    Args:
        lengths: int ``[num_docs]``, tokens of each whole document (global).
        settings: :class:`~lit_balance.BatchingSettings` (``drop_last=False``, ``too_long="error"``).
        max_length_schedule: an int, a list per optimizer step, or a callable ``step -> int`` (a schedule's
            ``value_at``); values in ``[1, max_tokens]``.
        num_replicas, rank: the data-parallel world.
        min_chunk_steps: see :func:`~lit_balance.plan.warmup.plan_length_warmup`.

    Raises:
        ValueError: bad lengths, ranks, or settings that leave tokens out; a schedule value outside ``[1,
            max_tokens]`` (when read).

    Example:
        >>> s = LengthWarmupSampler([6, 2, 3], BatchingSettings(max_tokens=6, shuffle=False), [3, 6],
        ...                         num_replicas=1, rank=0)
        >>> [(list(mb), mb.piece_length) for mb in s]
        [([0, 0], (3, 3)), ([2, 1], (3, 2))]
    """

    def __init__(self, lengths: Any, settings: BatchingSettings, max_length_schedule: Any, *, num_replicas: int,
                 rank: int, min_chunk_steps: int = DEFAULT_MIN_CHUNK_STEPS) -> None:
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a lit_balance.BatchingSettings, got {type(settings).__name__}",
                                 parameter="settings")
        self._lengths = check_lengths(lengths)
        self._settings = settings
        max_length_function(max_length_schedule, settings)(0)  # refused here, before any token is read
        self._schedule = max_length_schedule
        self.num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
        self.rank = check_int("rank", rank, 0, "ranks count from 0", self.num_replicas - 1)
        self._min_chunk_steps = min_chunk_steps
        self._epoch = 0
        self._segments: list[list[int]] = [[self.num_replicas, 0]]
        self._epoch_starts: dict[int, int] = {0: 0}
        self._cache: tuple[tuple, LengthWarmupPlan] | None = None
        self._resume_pending, self._yielded = False, 0

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens of each whole document."""
        return self._lengths

    @property
    def settings(self) -> BatchingSettings:
        """The batching settings."""
        return self._settings

    def _plan(self, epoch: int, first_step: int, segments: list[list[int]]) -> LengthWarmupPlan:
        key = (epoch, first_step, tuple(map(tuple, segments)))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        acc = self._settings.accumulate_grad_batches
        plan = plan_length_warmup(self._lengths, self._settings, num_replicas=segments[0][0], epoch=epoch,
                                  max_length=self._schedule, first_step=first_step,
                                  min_chunk_steps=self._min_chunk_steps)
        for (_, consumed), (replicas, _) in zip(segments[:-1], segments[1:]):
            steps = consumed // acc
            plan = plan_length_warmup(self._lengths, self._settings, num_replicas=replicas, epoch=epoch,
                                      max_length=self._schedule, first_step=plan.first_step + steps,
                                      spans=remaining_spans(plan, steps), min_chunk_steps=self._min_chunk_steps)
        self._cache = (key, plan)
        return plan

    def epoch_first_step(self, epoch: int) -> int:
        """The run's optimizer step at which ``epoch`` starts (earlier epochs planned whole, on this world)."""
        known = max(e for e in self._epoch_starts if e <= epoch)
        step = self._epoch_starts[known]
        for e in range(known, epoch):
            step += plan_length_warmup(self._lengths, self._settings, num_replicas=self.num_replicas, epoch=e,
                                       max_length=self._schedule, first_step=step,
                                       min_chunk_steps=self._min_chunk_steps).num_steps
            self._epoch_starts[e + 1] = step
        return step

    def plan(self) -> LengthWarmupPlan:
        """The plan of the current segment of the epoch: the whole epoch, or its rest after a resume on another
        number of ranks (then its first step is the run's step reached)."""
        return self._plan(self._epoch, self.epoch_first_step(self._epoch), self._segments)

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` next (Lightning calls this before each epoch)."""
        epoch = check_int("epoch", epoch, 0, "epochs count from 0")
        if epoch != self._epoch:
            self._epoch, self._segments, self._resume_pending = epoch, [[self.num_replicas, 0]], False

    @property
    def epoch(self) -> int:
        """The epoch planned (set by :meth:`set_epoch` or a restored state)."""
        return self._epoch

    @property
    def first_micro_step(self) -> int:
        """Micro-step of the epoch at which this world size's plan starts: 0, or after a resume on another number of
        ranks the micro-steps the earlier ranks ran (``len(self)`` counts them too)."""
        return sum(consumed for _, consumed in self._segments[:-1])

    @property
    def start_micro_step(self) -> int:
        """Micro-step of the epoch (from its start) at which the next pass begins: 0 or the restored position."""
        return self.first_micro_step + self._segments[-1][1]

    def __len__(self) -> int:
        """Micro-batches of the epoch on this rank, counted from its start (after a resume on another number of
        ranks, those the earlier ranks ran too): a training loop that counts from the epoch's start ends it here."""
        return self.first_micro_step + self.plan().plan.num_micro_steps

    def __iter__(self) -> Iterator[PieceMicroBatch]:
        """This rank's micro-batches from :attr:`start_micro_step` (the restored position on the first pass after
        :meth:`load_state_dict`; any later pass yields the whole epoch, as a fresh sampler does)."""
        if not self._resume_pending:
            self._segments = [[self.num_replicas, 0]]
        self._resume_pending = False
        self._yielded = 0
        return self._iterate()

    def _iterate(self) -> Iterator[PieceMicroBatch]:
        warmup = self.plan()
        plan, acc = warmup.plan, warmup.plan.accumulate_grad_batches
        real = plan.real_tokens_per_batch(warmup.piece_length)
        rows = plan.real_rows_per_batch()
        for s in range(self._segments[-1][1], plan.num_micro_steps):
            step = plan.assignment[(s // acc) * acc:(s // acc + 1) * acc].reshape(-1)
            pieces, fill = plan.batch(int(plan.assignment[s, self.rank]))
            self._yielded += 1
            yield PieceMicroBatch(warmup.piece_doc[pieces], fill, piece_start=warmup.piece_start[pieces],
                                  piece_length=warmup.piece_length[pieces],
                                  step_real_tokens=int(real[step].sum()), step_rows=int(rows[step].sum()))

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Plain-Python resume state, the same on every rank.

        Args:
            batches_consumed: micro-batches of the epoch consumed by training, counted from the epoch's start (as a
                training loop counts, :attr:`start_micro_step` plus those of this pass); default: those the latest
                pass yielded (with DataLoader workers that counts what they fetched ahead: pass the count).

        Returns:
            ``{"version", "epoch", "segments", "num_samples", "settings"}``; once the epoch is consumed, the start of
            the next one.
        """
        if batches_consumed is None:
            batches_consumed = self.start_micro_step + self._yielded
        consumed = check_int("batches_consumed", batches_consumed, self.first_micro_step,
                             "micro-batches of the epoch consumed, counted from its start", len(self))
        if consumed == len(self):
            epoch, segments = self._epoch + 1, [[self.num_replicas, 0]]
        else:
            epoch = self._epoch
            segments = [list(s) for s in self._segments[:-1]] + [[self.num_replicas, consumed - self.first_micro_step]]
        return {"version": STATE_VERSION, "epoch": epoch, "segments": segments,
                "num_samples": int(self._lengths.shape[0]), "settings": self._settings.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s position; on another number of ranks, the rest of the epoch is replanned.

        Raises:
            ValueError: missing or unknown keys, another version, corpus or settings; on another number of ranks, a
                position inside an optimizer step.
        """
        keys = {"version", "epoch", "segments", "num_samples", "settings"}
        if set(state) != keys:
            raise InputValueError(f"a length warm-up state holds the keys {sorted(keys)}, got {sorted(state)}")
        if state["version"] != STATE_VERSION or state["num_samples"] != self._lengths.shape[0]:
            raise InputValueError(f"the state is of version {state['version']} over {state['num_samples']} "
                                  f"documents; this sampler reads version {STATE_VERSION} over "
                                  f"{self._lengths.shape[0]}: resume on the same corpus")
        if BatchingSettings.from_dict(state["settings"]) != self._settings:
            raise InputValueError("the state was saved with other batching settings; resume with the same ones")
        segments = [[int(r), int(c)] for r, c in state["segments"]]
        if segments[-1][0] != self.num_replicas:
            acc = self._settings.accumulate_grad_batches
            if segments[-1][1] % acc:
                raise InputValueError(f"the state lies at micro-step {segments[-1][1]}, inside an optimizer step of "
                                      f"accumulate_grad_batches={acc}: resume on {segments[-1][0]} ranks, or from a "
                                      "checkpoint at an optimizer step's end")
            segments.append([self.num_replicas, 0])
        self._epoch, self._segments = int(state["epoch"]), segments
        self._resume_pending = True
