"""Where each rank's training time goes: compute, waiting for data, waiting for the other ranks, and the rest.

The Trainer reports what it is doing through its profiler (Lightning's public :class:`~lightning.pytorch.profilers.
Profiler` API: ``start(action)`` / ``stop(action)``, the actions that ``SimpleProfiler`` lists). :class:`PhaseClock`
stands in front of the Trainer's own profiler, passes every call on to it, and adds up, on its rank, the seconds spent
in each phase; :class:`lit_balance.callbacks.StragglerMonitor` (per window) and
:class:`lit_balance.callbacks.RunSummary` (per fit) read the same totals, so the live bar, ``metrics.csv``,
``training.png`` and the per-rank table agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
import lightning as L
import torch
from lightning.pytorch.profilers import Profiler

__all__ = ["PHASES", "PhaseClock", "PhaseTotals", "backward_is_local", "phase_clock", "remove_phase_clock"]

#: Lightning's profiler action of one training micro-batch's ``training_step``, backward and optimizer step.
TRAINING_BATCH = "run_training_batch"
#: Lightning's profiler action around fetching the next training batch (suffix of ``[<loop>].train_dataloader_next``).
TRAIN_FETCH = ".train_dataloader_next"
#: Lightning's profiler action around moving a batch to the device (suffix of ``[Strategy]<name>.batch_to_device``).
TRANSFER = ".batch_to_device"
#: Prefixes of Lightning's profiler actions that are not compute even inside a training micro-batch.
CALLBACK, CHECKPOINT = "[Callback]", "save_checkpoint"


@dataclass(frozen=True)
class PhaseTotals:
    """Seconds a rank spent in each phase since its :class:`PhaseClock` was made, at one moment (a snapshot).

    ``other_s`` is what is left of ``wall_s`` (``wall_s - compute_s - data_wait_s - rank_wait_s``); the difference of
    two snapshots (``later - earlier``) is the time between them.
    """

    wall_s: float
    compute_s: float
    data_wait_s: float
    rank_wait_s: float

    @property
    def other_s(self) -> float:
        return self.wall_s - self.compute_s - self.data_wait_s - self.rank_wait_s

    def __sub__(self, earlier: PhaseTotals) -> PhaseTotals:
        return PhaseTotals(self.wall_s - earlier.wall_s, self.compute_s - earlier.compute_s,
                           self.data_wait_s - earlier.data_wait_s, self.rank_wait_s - earlier.rank_wait_s)

    def as_list(self) -> list[float]:
        """``[compute_s, data_wait_s, rank_wait_s, other_s, wall_s]``, the order of :data:`PHASES` then wall."""
        return [self.compute_s, self.data_wait_s, self.rank_wait_s, self.other_s, self.wall_s]


#: The phases, in the order of :meth:`PhaseTotals.as_list` (then ``wall_s``).
PHASES = ("compute_s", "data_wait_s", "rank_wait_s", "other_s")


class PhaseClock(Profiler):
    """A profiler in front of the Trainer's own: forwards every call to it and times four phases on this rank.

    The phases, each measured where it happens (seconds, this rank; every instant counts in exactly one phase):

    * **compute**: inside Lightning's ``run_training_batch`` action: ``training_step`` (forward and loss), backward
      and the optimizer step, less the callbacks' hooks called inside it and less the wait below.
    * **data wait**: inside ``[<loop>].train_dataloader_next`` (fetching a training batch, collation, the
      DataLoader's workers) and ``[Strategy]<name>.batch_to_device`` (moving it to the device).
    * **rank wait** (waiting for the other ranks, with several processes only): (1) right before a backward that
      synchronises gradients (DDP outside ``no_sync``, and any other strategy's backward), the ranks meet in one
      ``strategy.barrier()``, and the seconds in it are the time this rank waited for the slowest to finish its
      forward; the gradient all-reduce then starts with every rank there, and what is left of waiting inside it (ranks
      whose backward differs) stays in compute. (2) Lightning broadcasts a stop flag from rank 0 before fetching each
      training batch: the seconds from the last profiled action before a fetch to the fetch (that broadcast, and the
      loop's bookkeeping) count as rank wait. Manual optimization's ``manual_backward`` is not a profiled action: there
      the wait in the all-reduce stays in compute.
    * **other**: the rest of the wall time: validation, checkpointing, logging, the callbacks' hooks (this progress
      bar, the monitors' own gathers), epoch ends.

    One extra barrier per optimizer step (not per micro-batch under gradient accumulation) is the cost of telling
    rank wait from compute. With ``synchronize=True`` on a CUDA device, the clock synchronises the device at the ends
    of compute, so that asynchronous kernels count where they run.

    Install it with :func:`phase_clock` (the monitors do); it relies on Lightning's profiler action names (those of
    ``SimpleProfiler``'s report), which a test pins.
    """

    def __init__(self, trainer: L.Trainer, inner: Profiler, *, synchronize: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.trainer = trainer
        self.inner = inner
        self.synchronize = synchronize
        self.clock = clock
        self._stack: list[str] = []  # phases of the open actions that have one: "compute", "data", "other"
        self._seconds = {"compute": 0.0, "data": 0.0, "rank": 0.0}
        self._origin = self._last = clock()

    # -- the Profiler interface, forwarded -------------------------------------------------------------
    def start(self, action_name: str) -> None:
        phase = _phase(action_name)
        now = self._now(phase == "compute")
        if action_name.endswith(TRAIN_FETCH) and not self._stack and self._several():
            self._add("rank", now)  # Lightning's stop-flag broadcast from rank 0, right before the fetch
        else:
            self._add(self._current(), now)
        if action_name.startswith("[Strategy]") and action_name.endswith(".backward") and self._sync_backward():
            self.trainer.strategy.barrier("PhaseClock.backward")
            self._add("rank", self._now(True))
        if phase is not None:
            self._stack.append(phase)
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        phase = _phase(action_name)
        self._add(self._current(), self._now(phase == "compute"))
        if phase is not None and self._stack:
            self._stack.pop()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank=local_rank, log_dir=log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def describe(self) -> None:
        self.inner.describe()

    def summary(self) -> str:
        return self.inner.summary()

    def __del__(self) -> None:  # the inner profiler closes its own files
        pass

    # -- the totals ------------------------------------------------------------------------------------
    def totals(self) -> PhaseTotals:
        """The phases' seconds so far on this rank (the time since the last action counts in the current phase)."""
        now = self.clock()
        self._add(self._current(), now)
        s = self._seconds
        return PhaseTotals(now - self._origin, s["compute"], s["data"], s["rank"])

    @property
    def rank_wait_s(self) -> float:
        """Seconds this rank has waited for the others so far (the barriers and broadcasts counted up to now)."""
        return self._seconds["rank"]

    def _current(self) -> str:
        return self._stack[-1] if self._stack else "other"

    def _add(self, phase: str, now: float) -> None:
        if phase in self._seconds:
            self._seconds[phase] += now - self._last
        self._last = now

    def _now(self, sync: bool) -> float:
        if sync and self.synchronize:
            module = self.trainer.lightning_module
            device = getattr(module, "device", None) if module is not None else None
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
        return self.clock()

    def _several(self) -> bool:
        return int(self.trainer.world_size) > 1

    def _sync_backward(self) -> bool:
        return self._several() and not backward_is_local(self.trainer)


def backward_is_local(trainer: L.Trainer) -> bool:
    """Whether the backward about to run holds no collective: one process, or DDP inside ``no_sync``.

    Lightning runs the micro-batches inside an accumulation window (all but the optimizer step's last) under
    :meth:`torch.nn.parallel.DistributedDataParallel.no_sync`, which clears the wrapped model's
    ``require_backward_grad_sync``; their backward computes gradients without the all-reduce. Any other
    strategy (FSDP, DeepSpeed, tensor parallelism even with one data-parallel rank, ...) is assumed to communicate in
    backward.
    """
    if trainer.world_size <= 1:
        return True
    model = getattr(trainer.strategy, "model", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return not bool(model.require_backward_grad_sync)
    return False


def _phase(action_name: str) -> str | None:
    if action_name == TRAINING_BATCH:
        return "compute"
    if action_name.endswith(TRAIN_FETCH) or (action_name.startswith("[Strategy]") and action_name.endswith(TRANSFER)):
        return "data"
    if action_name.startswith(CALLBACK) or action_name == CHECKPOINT:
        return "other"
    return None  # Lightning's other actions (the module's and strategy's hooks) belong to the phase around them


def phase_clock(trainer: L.Trainer, *, synchronize: bool = True,
                clock: Callable[[], float] = time.perf_counter) -> PhaseClock:
    """The Trainer's :class:`PhaseClock`: put in front of ``trainer.profiler`` on the first call, the same one after.

    Call it from a callback's ``setup`` (the Trainer has set up its profiler by then); :func:`remove_phase_clock` in
    ``teardown`` gives the Trainer its own profiler back.
    """
    profiler = trainer.profiler
    if isinstance(profiler, PhaseClock) and profiler.trainer is trainer:
        return profiler
    installed = PhaseClock(trainer, profiler, synchronize=synchronize, clock=clock)
    trainer.profiler = installed
    return installed


def remove_phase_clock(trainer: L.Trainer) -> None:
    """Give the Trainer back the profiler that :func:`phase_clock` stood in front of (nothing if none)."""
    profiler = trainer.profiler
    if isinstance(profiler, PhaseClock):
        trainer.profiler = profiler.inner
