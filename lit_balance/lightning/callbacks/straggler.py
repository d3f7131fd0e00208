"""StragglerMonitor: every rank's micro-batches and where its time went, gathered every N micro-batches."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool, check_callable, check_int, check_number
from lit_balance.errors import InputValueError
from lit_balance.lightning.callbacks._common import batch_fields, emit, gather_same_everywhere, train_sampler
from lit_balance.lightning.callbacks.phases import (PHASES, PhaseClock, PhaseTotals, backward_is_local, phase_clock,
                                                   remove_phase_clock)
from lit_balance.plan.cost import CostModelProtocol, check_cost_model

__all__ = ["StragglerMonitor", "TimingWindow", "backward_is_local", "packed_rows_and_length", "step_imbalance"]

@dataclass(frozen=True)
class TimingWindow:
    """One gathered window of :class:`StragglerMonitor`: every rank's micro-batches and where its time went.

    Per micro-batch, float64 ``[num_replicas, n]`` (rank by rank, in the order they ran; the same on every rank):
    ``forward_s`` (seconds from ``on_train_batch_start`` to ``on_before_backward``: forward and loss, no collective),
    ``backward_s`` (seconds of a backward that holds no collective, NaN otherwise; see :func:`backward_is_local`),
    ``rows`` and ``padded_length`` (the micro-batch's shape ``[rows, padded_length]``; for a packed one,
    :func:`packed_rows_and_length`), ``real_tokens`` and ``cost`` (in the cost model's unit).

    Per rank over the window, float64 ``[num_replicas]`` seconds (:class:`lit_balance.lightning.callbacks.phases.
    PhaseClock`; they add up to the window's wall time on that rank): ``compute_s`` (forward, backward, optimizer
    step), ``data_wait_s`` (fetching and moving batches), ``rank_wait_s`` (waiting for the other ranks), ``other_s``
    (validation, checkpointing, logging, callbacks). ``first_step`` and ``last_step``: Lightning's ``global_step`` at
    the start of the window's first and last micro-batch (the step the loss of that micro-batch is logged at).

    Phases left out (None) are zeros; :meth:`concatenate` joins windows (micro-batches side by side, phases added).
    """

    forward_s: np.ndarray
    rows: np.ndarray
    padded_length: np.ndarray
    backward_s: np.ndarray | None = None
    real_tokens: np.ndarray | None = None
    cost: np.ndarray | None = None
    compute_s: np.ndarray | None = None
    data_wait_s: np.ndarray | None = None
    rank_wait_s: np.ndarray | None = None
    other_s: np.ndarray | None = None
    first_step: int = 0
    last_step: int = 0

    def __post_init__(self) -> None:
        shape = np.shape(self.forward_s)
        for name in MICRO_BATCH_FIELDS:
            value = getattr(self, name)
            fill = np.nan if name == "backward_s" else 0.0
            value = np.full(shape, fill) if value is None else np.asarray(value, dtype=np.float64)
            if value.shape != shape or len(shape) != 2:
                raise InputValueError(f"TimingWindow fields per micro-batch must all be [num_replicas, n], got "
                                      f"{name} of shape {value.shape} beside forward_s of shape {shape}")
            object.__setattr__(self, name, value)
        for name in PHASES:
            value = getattr(self, name)
            value = np.zeros(shape[0]) if value is None else np.asarray(value, dtype=np.float64)
            if value.shape != (shape[0],):
                raise InputValueError(f"TimingWindow phase {name} must be [num_replicas] = [{shape[0]}], got "
                                      f"shape {value.shape}")
            object.__setattr__(self, name, value)

    @property
    def num_replicas(self) -> int:
        return int(self.forward_s.shape[0])

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank in the window."""
        return int(self.forward_s.shape[1])

    @classmethod
    def concatenate(cls, windows: list[TimingWindow]) -> TimingWindow:
        """One window holding ``windows`` one after the other (the same number of ranks each)."""
        if not windows:
            raise InputValueError("TimingWindow.concatenate needs at least one window, got none")
        return cls(**{name: np.concatenate([getattr(w, name) for w in windows], axis=1) for name in MICRO_BATCH_FIELDS},
                   **{name: np.sum([getattr(w, name) for w in windows], axis=0) for name in PHASES},
                   first_step=windows[0].first_step, last_step=windows[-1].last_step)


#: The per-micro-batch fields of a :class:`TimingWindow`, in the order :class:`StragglerMonitor` gathers them.
MICRO_BATCH_FIELDS = ("forward_s", "backward_s", "rows", "padded_length", "real_tokens", "cost")


def _document_lengths(cu_seq_lens: Any) -> np.ndarray:
    """int64 ``[D]``: the segment lengths of ``cu_seq_lens`` (int ``[D + 1]``, a tensor or a sequence)."""
    cu = np.asarray(cu_seq_lens.tolist() if hasattr(cu_seq_lens, "tolist") else cu_seq_lens, dtype=np.int64)
    return np.diff(cu)


def packed_rows_and_length(cu_seq_lens: Any) -> tuple[float, float]:
    """The padded shape ``(rows, L)`` that costs what a packed row of documents costs, under any :class:`CostModel`.

    A packed micro-batch of documents of ``l_1 ... l_D`` tokens (the segments of ``cu_seq_lens``, int
    ``[D + 1]``) costs ``per_batch + linear * S1 + quadratic * S2`` with ``S1 = sum(l)`` and ``S2 = sum(l**2)``
    (each document attends within itself). ``rows = S1**2 / S2`` rows of ``L = S2 / S1`` tokens give
    ``rows * L = S1`` and ``rows * L**2 = S2``, so :meth:`lit_balance.CostModel.batch_cost` and
    :meth:`lit_balance.CostModel.fit` of ``(rows, L)`` are exactly those of the packed row (``rows`` need not be an
    integer), whatever the coefficients. For one document, ``(1, l)``. Another cost model's row cost need not be
    linear in ``L`` and ``L**2``: its cost of a packed row is its own ``packed_cost`` (which
    :class:`StragglerMonitor`'s cost column uses), and ``(rows, L)`` is then the shape its ``fit`` sees.

    Example:
        >>> packed_rows_and_length([0, 2, 6])  # documents of 2 and 4 tokens: S1 = 6, S2 = 20
        (1.8, 3.3333333333333335)
    """
    lengths = _document_lengths(cu_seq_lens).astype(np.float64)
    s1, s2 = float(lengths.sum()), float((lengths * lengths).sum())
    if s1 <= 0:
        return 0.0, 0.0
    return s1 * s1 / s2, s2 / s1



def step_imbalance(compute_s: np.ndarray, accumulate_grad_batches: int) -> float:
    """Straggler ratio of optimizer steps of ``accumulate_grad_batches`` consecutive micro-batches.

    Ranks that wait for each other only once per optimizer step (DDP's gradient all-reduce, ``no_sync`` in
    between) pay, per step, the slowest rank's summed compute. Lightning >= 2.5 also synchronises the ranks
    before every training micro-batch (its SIGTERM broadcast; see :class:`AdaptiveGradAccumulation`); there
    ``step_imbalance(compute_s, 1)`` is what they pay, whatever the accumulation. Returns ``sum over steps of
    max over ranks / sum over steps of the median over ranks`` of the per-step compute seconds (>= 1; 1.0 when
    no rank ever waits).

    Args:
        compute_s: float ``[num_replicas, n]``: compute seconds of ``n`` consecutive micro-batches per rank.
        accumulate_grad_batches: micro-batches per optimizer step (the last step may be shorter).
    """
    c = np.asarray(compute_s, dtype=np.float64)
    n = c.shape[1]
    groups = np.arange(n) // int(accumulate_grad_batches)
    sums = np.zeros((c.shape[0], int(groups[-1]) + 1 if n else 0))
    np.add.at(sums, (slice(None), groups), c)
    med = float(np.median(sums, axis=0).sum())
    return float(sums.max(axis=0).sum()) / med if med > 0 else 1.0


class StragglerMonitor(L.Callback):
    """Time every rank's micro-batches and where its time goes; every N micro-batches, compare the ranks.

    **Where the time goes** (per rank, :class:`lit_balance.lightning.callbacks.phases.PhaseClock`, which the monitor
    puts in front of the Trainer's profiler at ``setup``): ``compute`` (forward, backward, optimizer step), ``data
    wait`` (fetching and moving batches), ``rank wait`` (waiting for the other ranks: a barrier right before each
    backward that synchronises gradients, and Lightning's stop-flag broadcast before each fetch) and ``other``
    (validation, checkpointing, logging, callbacks), each window's four adding up to its wall time on that rank.

    **Per micro-batch** (:class:`TimingWindow`): ``forward_s`` from ``on_train_batch_start`` to
    ``on_before_backward`` less the rank wait of the barrier in between (the forward pass and the loss of
    ``training_step``; no collective when the module has no buffers, or with ``DDPStrategy(broadcast_buffers=False)``;
    to ``on_train_batch_end`` when no backward runs), and
    ``backward_s`` from ``on_before_backward`` to ``on_after_backward`` for a backward that holds no collective
    (:func:`backward_is_local`: a single process, or DDP inside ``no_sync``), NaN otherwise.
    :class:`lit_balance.callbacks.CostModelFeedback` fits rank speeds on these.

    With ``synchronize=True`` on a CUDA device, the ends of the timed intervals call ``torch.cuda.synchronize()`` so
    that asynchronous kernels are counted where they run.

    Every ``log_every_n_micro_batches`` micro-batches (the same batches on every rank, since every rank runs the same
    number) and at the end of each training epoch (a window that ends with the epoch's or the fit's last micro-batch is
    gathered there, so it holds the validation and checkpoints that follow that micro-batch), the data-parallel ranks
    (:func:`lit_balance.world.data_parallel_world`) take part in one ``all_gather`` (where a replica spans several
    processes, tensor parallelism, global rank 0's gathered window is then broadcast to every process, so that the
    decisions taken on it are the same everywhere), and global rank 0 logs, over that window, at Lightning's
    ``global_step`` of the window's last micro-batch (the step its loss is logged at):

    * ``balance/straggler_ratio``: max over ranks / median over ranks of the window's compute seconds.
    * ``balance/straggler_gap_s``: max minus median of the same (seconds).
    * ``balance/slowest_rank``: the rank with the most compute seconds.
    * ``balance/compute_s_rank{r}``, ``balance/data_wait_s_rank{r}``, ``balance/rank_wait_s_rank{r}``,
      ``balance/other_s_rank{r}`` (seconds), ``balance/real_tokens_rank{r}`` (tokens) and ``balance/cost_rank{r}``
      (the sampler's cost model's unit) per rank.

    The cost is the cost model's own: ``batch_cost(rows, T)`` of a padded micro-batch ``[rows, T]``, and
    ``packed_cost(document lengths)`` of a packed one (a batch with ``cu_seq_lens_q``,
    :class:`lit_balance.PackedCollator`). For a packed micro-batch ``rows`` and ``padded_length`` hold
    :func:`packed_rows_and_length`: the padded shape with the same ``sum(l)`` and ``sum(l**2)`` over its documents, so
    :class:`lit_balance.callbacks.CostModelFeedback`'s fit of a :class:`lit_balance.CostModel` is that of
    per-document costs, ``per_batch + linear * sum(l) + quadratic * sum(l**2)``.

    It warns when the same rank is the slowest, with a ratio above ``warn_ratio``, for more than
    ``warn_after`` windows in a row. The gathered windows of the current epoch stay in :attr:`epoch_windows`
    (the same on every rank), for :class:`lit_balance.callbacks.CostModelFeedback` and
    :class:`lit_balance.callbacks.AdaptiveGradAccumulation`.

    Args:
        log_every_n_micro_batches: training micro-batches per window (one ``all_gather`` and one log each), per rank;
            a micro-batch is one ``training_step``, not an optimizer step.
        warn_ratio: straggler ratio above which a window counts towards the warning.
        warn_after: windows in a row with the same slowest rank above ``warn_ratio`` before warning.
        cost_model: cost of a micro-batch for ``balance/cost_rank{r}``: any cost model
            (:class:`lit_balance.plan.cost.CostModelProtocol`, e.g. a :class:`lit_balance.plan.CostModelBase`
            subclass); default: the ``cost_model`` of each epoch of the training sampler handed to the Trainer
            (:func:`lit_balance.use_training_sampler`; the DataModule and ``balanced_dataloader(...,
            trainer=self.trainer)`` hand theirs over), else :class:`lit_balance.plan.cost.CostModel()` (padded slots).
        synchronize: synchronize CUDA at the ends of the timed intervals.
        clock: seconds, monotonic (default :func:`time.perf_counter`); tests inject a fake one.

    Raises:
        TypeError: ``log_every_n_micro_batches`` or ``warn_after`` not an int; ``warn_ratio`` not a real number;
            ``cost_model`` neither a cost model nor None (``check_cost_model``); ``synchronize`` not a bool; a
            ``clock`` that is not callable; a training batch that is not a dict.
        ValueError: ``log_every_n_micro_batches < 1``, ``warn_after < 1``, ``warn_ratio < 1`` or not finite.
        KeyError: a training batch lacks ``input_ids`` or ``num_real_tokens``.

    Example:
        >>> trainer = L.Trainer(callbacks=[StragglerMonitor(log_every_n_micro_batches=50)], logger=False)
    """

    def __init__(
        self,
        log_every_n_micro_batches: int = 50,
        *,
        warn_ratio: float = 1.2,
        warn_after: int = 3,
        cost_model: CostModelProtocol | None = None,
        synchronize: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if cost_model is not None:
            cost_model = check_cost_model(cost_model)
        self.log_every_n_micro_batches = check_int("log_every_n_micro_batches", log_every_n_micro_batches, 1,
                                                   "set the micro-batches per window")
        self.warn_ratio = check_number("warn_ratio", warn_ratio, 1, None,
                                       "set the straggler ratio (max / median) above which to warn, e.g. 1.2")
        self.warn_after = check_int("warn_after", warn_after, 1, "set the windows in a row before warning")
        self.cost_model = cost_model
        self.synchronize = check_bool("synchronize", synchronize)
        self.clock = check_callable("clock", clock, "pass a function returning seconds, or leave the default")
        #: Gathered windows of the current epoch (the same on every rank).
        self.epoch_windows: list[TimingWindow] = []
        #: The last gathered window, kept across epochs (None before the first).
        self.last_window: TimingWindow | None = None
        #: Number of windows gathered so far in this fit (the same on every rank).
        self.num_windows = 0
        #: The last values logged (the same on every rank).
        self.last_metrics: dict[str, float] = {}
        self._records: list[list[float]] = []
        self._steps: list[int] = []
        self._start = 0.0
        self._pending: list[float] | None = None
        self._timed = False
        self._backward_start: float | None = None
        self._slowest_run = (-1, 0)
        self._cost: CostModelProtocol = check_cost_model(None)
        self._phases: PhaseTotals | None = None
        self._rank_wait_start = 0.0

    # -- timing ------------------------------------------------------------------------------------------
    def _now(self, pl_module: L.LightningModule) -> float:
        if self.synchronize and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return self.clock()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        phase_clock(trainer, synchronize=self.synchronize, clock=self.clock)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        remove_phase_clock(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phases = phase_clock(trainer, synchronize=self.synchronize, clock=self.clock).totals()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cost = self.cost_model
        if cost is None:  # the training sampler's cost model of this epoch, or padded slots without one
            sampler = train_sampler(trainer)
            cost = check_cost_model(None if sampler is None else sampler.cost_model,
                                    parameter="the training sampler's cost_model")
        self._cost = cost
        self.epoch_windows = []
        self._records = []
        self._steps = []
        if self._phases is None:  # driven without on_train_start
            self.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = self._now(pl_module)
        self._rank_wait_start = _rank_wait(trainer)
        self._pending = [0.0, 0.0, *self._shape(trainer, batch)]
        self._steps.append(int(trainer.global_step))
        self._timed = False
        self._backward_start = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._pending is None:
            return
        now = self._now(pl_module)
        if not self._timed:  # less the PhaseClock's barrier before a synchronising backward: waiting, not forward
            self._pending[_FORWARD] = now - self._start - (_rank_wait(trainer) - self._rank_wait_start)
            self._timed = True
        # several backwards (manual optimization) add up; one that communicates makes the sum unusable
        self._backward_start = now if backward_is_local(trainer) else None
        if self._backward_start is None:
            self._pending[_BACKWARD] = float("nan")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None and self._backward_start is not None:
            self._pending[_BACKWARD] += self._now(pl_module) - self._backward_start
        self._backward_start = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self.clock()
        if self._pending is not None:
            if self._backward_start is not None:  # a backward that never reached on_after_backward
                self._pending[_BACKWARD] = float("nan")
                self._backward_start = None
            if not self._timed:
                self._pending[_FORWARD] = end - self._start
                self._pending[_BACKWARD] = float("nan")  # no backward ran
            self._records.append(self._pending)
            self._pending = None
        if len(self._records) >= self.log_every_n_micro_batches and not _last_of_epoch(trainer, batch_idx):
            self._gather(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.flush(trainer, pl_module)

    def flush(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Gather and log the micro-batches timed since the last window (all ranks must call it together)."""
        if self._records:
            self._gather(trainer, pl_module)

    def _shape(self, trainer: L.Trainer, batch: Any) -> list[float]:
        input_ids, real = batch_fields(batch, ("input_ids", "num_real_tokens"), "StragglerMonitor")
        if isinstance(batch, dict) and "cu_seq_lens_q" in batch:
            rows, length = packed_rows_and_length(batch["cu_seq_lens_q"])
            cost = self._cost.packed_cost(_document_lengths(batch["cu_seq_lens_q"]))
        else:
            rows, length = float(input_ids.shape[0]), float(input_ids.shape[1])
            cost = self._cost.batch_cost(input_ids.shape[0], input_ids.shape[1])
        return [rows, length, float(real), float(cost)]

    # -- gathering ---------------------------------------------------------------------------------------
    def _gather(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = phase_clock(trainer, synchronize=self.synchronize, clock=self.clock).totals()
        phases = now - (self._phases if self._phases is not None else now)
        self._phases = now
        n = len(self._records)
        local = torch.tensor([x for record in self._records for x in record] + phases.as_list()[:4],
                             dtype=torch.float64)
        steps = (self._steps[0], self._steps[-1]) if self._steps else (int(trainer.global_step),) * 2
        self._records, self._steps = [], []
        gathered = gather_same_everywhere(trainer, local).numpy()  # feedback and accumulation decide on it
        per_batch = gathered[:, :n * len(MICRO_BATCH_FIELDS)].reshape(gathered.shape[0], n, len(MICRO_BATCH_FIELDS))
        totals = gathered[:, n * len(MICRO_BATCH_FIELDS):]
        window = TimingWindow(**{name: per_batch[:, :, i] for i, name in enumerate(MICRO_BATCH_FIELDS)},
                              **{name: totals[:, i] for i, name in enumerate(PHASES)},
                              first_step=steps[0], last_step=steps[1])
        self.epoch_windows.append(window)
        self.last_window = window
        self.num_windows += 1
        compute = window.compute_s
        median = float(np.median(compute))
        slowest = int(np.argmax(compute))
        metrics = {
            "balance/straggler_ratio": float(compute.max()) / median if median > 0 else 1.0,
            "balance/straggler_gap_s": float(compute.max()) - median,
            "balance/slowest_rank": float(slowest),
        }
        real, cost = window.real_tokens.sum(axis=1), window.cost.sum(axis=1)
        for r in range(window.num_replicas):
            for name in PHASES:
                metrics[f"balance/{name}_rank{r}"] = float(getattr(window, name)[r])
            metrics[f"balance/real_tokens_rank{r}"] = float(real[r])
            metrics[f"balance/cost_rank{r}"] = float(cost[r])
        self.last_metrics = metrics
        emit(trainer, metrics, step=window.last_step)
        self._check_warn(trainer, slowest, metrics["balance/straggler_ratio"])

    def _check_warn(self, trainer: L.Trainer, slowest: int, ratio: float) -> None:
        if ratio <= self.warn_ratio:
            self._slowest_run = (-1, 0)
            return
        run = self._slowest_run[1] + 1 if self._slowest_run[0] == slowest else 1
        self._slowest_run = (slowest, run)
        if run == self.warn_after + 1 and trainer.is_global_zero:
            warnings.warn(
                f"rank {slowest} has been the slowest for {run} windows of {self.log_every_n_micro_batches} "
                f"micro-batches (straggler ratio {ratio:.3f} > warn_ratio {self.warn_ratio}); its micro-batches "
                "take longer than the others' at equal planned cost: check that rank's device, or add "
                "CostModelFeedback so the sampler plans with measured rank speeds",
                RuntimeWarning,
                stacklevel=2,
            )


_FORWARD, _BACKWARD = MICRO_BATCH_FIELDS.index("forward_s"), MICRO_BATCH_FIELDS.index("backward_s")


def _rank_wait(trainer: L.Trainer) -> float:
    profiler = getattr(trainer, "profiler", None)
    return profiler.rank_wait_s if isinstance(profiler, PhaseClock) else 0.0


def _last_of_epoch(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether this micro-batch ends the epoch or the fit (its last batch, or ``max_steps`` reached): its window is
    gathered at ``on_train_epoch_end`` instead, so that the validation and checkpoints that follow it count in it."""
    max_steps = getattr(trainer, "max_steps", None)
    if max_steps is not None and max_steps > 0 and int(trainer.global_step) >= max_steps:
        return True
    total = getattr(trainer, "num_training_batches", None)
    return isinstance(total, int) and batch_idx + 1 >= total
