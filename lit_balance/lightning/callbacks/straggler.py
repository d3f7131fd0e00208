"""StragglerMonitor: per-rank compute and data-wait time of every micro-batch, gathered every N micro-batches."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool, check_callable, check_int, check_number
from lit_balance.lightning.callbacks._common import batch_fields, emit, gather_same_everywhere, train_sampler
from lit_balance.plan.cost import CostModelProtocol, check_cost_model

__all__ = ["StragglerMonitor", "backward_is_local", "packed_rows_and_length", "step_imbalance"]

#: Columns of one timed micro-batch, in the gathered tensor ``[num_replicas, n, len(FIELDS)]``.
FIELDS = ("compute_s", "data_wait_s", "rows", "padded_length", "real_tokens", "cost", "backward_s")
COMPUTE, DATA_WAIT, ROWS, LENGTH, REAL, COST, BACKWARD = range(len(FIELDS))


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
    """Time every rank's compute and data wait per micro-batch; every N micro-batches, compare the ranks.

    **Timed interval (compute).** From ``on_train_batch_start`` to ``on_before_backward``: the forward pass
    and the loss of ``training_step``, on this rank. It deliberately stops before backward: under DDP the
    gradient all-reduce runs *inside* backward (bucket hooks overlap it with the gradient computation, and
    the last bucket waits for the slowest rank), so a backward-inclusive interval would charge the fast ranks
    with waiting for the slow one. The forward pass contains no collective when the module has no buffers
    (DDP broadcasts buffers before forward only when there are some and ``broadcast_buffers=True``; pass
    ``DDPStrategy(broadcast_buffers=False)`` otherwise). Forward seconds are a fixed share of a
    micro-batch's compute, which is all that ranking ranks needs. If ``on_before_backward`` is not reached
    (no loss), the interval ends at ``on_train_batch_end``.

    **Backward, where it is local.** From ``on_before_backward`` to ``on_after_backward`` (the LightningModule's
    ``backward``), but only for a backward that holds no collective (:func:`backward_is_local`): every
    micro-batch of a single process, and under DDP those inside an accumulation window (``no_sync``), but not
    the optimizer step's last, whose backward waits in the gradient all-reduce. Other micro-batches get NaN.
    :class:`lit_balance.callbacks.CostModelFeedback` fits rank speeds on forward + backward seconds where there
    are enough of these, so a rank that is slow in backward only is seen too.

    **Data wait.** From the previous ``on_train_batch_end`` (or ``on_train_epoch_start``) to
    ``on_train_batch_start``: fetching and transferring the batch, plus Lightning's per-batch SIGTERM broadcast
    from rank 0 (a collective when there are several processes), so it is reported apart from compute.

    With ``synchronize=True`` on a CUDA device, both ends of the compute interval call
    ``torch.cuda.synchronize()`` so that asynchronous kernels are counted.

    Every ``log_every_n_micro_batches`` micro-batches (the same batches on every rank, since every rank runs the same
    number) and at the end of each training epoch, the data-parallel ranks
    (:func:`lit_balance.world.data_parallel_world`) take part in one ``all_gather`` of a ``[n, 7]`` float64 tensor
    (compute s, data wait s, rows, padded length, real tokens, cost, local backward s or NaN, per micro-batch) and
    global rank 0 logs, over that window (where a replica spans several processes, tensor parallelism, global rank 0's
    gathered window is then broadcast to every process, so that the decisions taken on it are the same everywhere):

    * ``balance/straggler_ratio``: max over ranks / median over ranks of the summed compute seconds.
    * ``balance/straggler_gap_s``: max minus median of the same (seconds).
    * ``balance/slowest_rank``: the rank with the most compute seconds.
    * ``balance/compute_s_rank{r}``, ``balance/data_wait_s_rank{r}`` (seconds), ``balance/real_tokens_rank{r}``
      (tokens) and ``balance/cost_rank{r}`` (the sampler's cost model's unit) per rank.

    The cost column is the cost model's own: ``batch_cost(rows, T)`` of a padded micro-batch ``[rows, T]``, and
    ``packed_cost(document lengths)`` of a packed one (a batch with ``cu_seq_lens_q``,
    :class:`lit_balance.PackedCollator`; the lengths are the segments of ``cu_seq_lens_q``). For a packed
    micro-batch the ``rows`` and ``padded_length`` columns hold :func:`packed_rows_and_length`: the padded shape with
    the same ``sum(l)`` and ``sum(l**2)`` over its documents, so :class:`lit_balance.callbacks.CostModelFeedback`'s
    fit of a :class:`lit_balance.CostModel` is that of per-document costs,
    ``per_batch + linear * sum(l) + quadratic * sum(l**2)``.

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
            subclass); default: the training sampler's ``cost_model`` of each epoch if it has one, else
            :class:`lit_balance.plan.cost.CostModel()` (padded slots).
        synchronize: synchronize CUDA at the ends of the compute interval.
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
        #: Gathered windows of the current epoch: float64 arrays ``[num_replicas, n, 7]`` (columns :data:`FIELDS`).
        self.epoch_windows: list[np.ndarray] = []
        #: The last gathered window, kept across epochs (None before the first).
        self.last_window: np.ndarray | None = None
        #: Number of windows gathered so far in this fit (the same on every rank).
        self.num_windows = 0
        #: The last values logged (the same on every rank).
        self.last_metrics: dict[str, float] = {}
        self._records: list[list[float]] = []
        self._start = 0.0
        self._prev_end: float | None = None
        self._pending: list[float] | None = None
        self._backward_start: float | None = None
        self._slowest_run = (-1, 0)
        self._cost: CostModelProtocol = check_cost_model(None)

    # -- timing ------------------------------------------------------------------------------------------
    def _now(self, pl_module: L.LightningModule) -> float:
        if self.synchronize and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return self.clock()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cost = self.cost_model
        if cost is None:  # the sampler's cost model of this epoch, or padded slots
            cost = check_cost_model(getattr(train_sampler(trainer), "cost_model", None),
                                    parameter="the training sampler's cost_model")
        self._cost = cost
        self.epoch_windows = []
        self._records = []
        self._prev_end = self.clock()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = self._now(pl_module)
        wait = self._start - self._prev_end if self._prev_end is not None else 0.0
        self._pending = [0.0, wait, *self._shape(trainer, batch), 0.0]
        self._timed = False
        self._backward_start = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._pending is None:
            return
        now = self._now(pl_module)
        if not self._timed:
            self._pending[COMPUTE] = now - self._start
            self._timed = True
        # several backwards (manual optimization) add up; one that communicates makes the sum unusable
        self._backward_start = now if backward_is_local(trainer) else None
        if self._backward_start is None:
            self._pending[BACKWARD] = float("nan")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None and self._backward_start is not None:
            self._pending[BACKWARD] += self._now(pl_module) - self._backward_start
        self._backward_start = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self.clock()
        if self._pending is not None:
            if self._backward_start is not None:  # a backward that never reached on_after_backward
                self._pending[BACKWARD] = float("nan")
                self._backward_start = None
            if not self._timed:
                self._pending[COMPUTE] = end - self._start
                self._pending[BACKWARD] = float("nan")  # no backward ran
            self._records.append(self._pending)
            self._pending = None
        if len(self._records) >= self.log_every_n_micro_batches:
            self._gather(trainer, pl_module)
        self._prev_end = self.clock()

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
        local = torch.tensor(self._records, dtype=torch.float64)
        self._records = []
        window = gather_same_everywhere(trainer, local).numpy()  # feedback and accumulation decide on it
        self.epoch_windows.append(window)
        self.last_window = window
        self.num_windows += 1
        per_rank = window.sum(axis=1)  # [num_replicas, 7] (the backward column may hold NaN; not logged)
        compute = per_rank[:, COMPUTE]
        median = float(np.median(compute))
        slowest = int(np.argmax(compute))
        metrics = {
            "balance/straggler_ratio": float(compute.max()) / median if median > 0 else 1.0,
            "balance/straggler_gap_s": float(compute.max()) - median,
            "balance/slowest_rank": float(slowest),
        }
        for r in range(window.shape[0]):
            metrics[f"balance/compute_s_rank{r}"] = float(per_rank[r, COMPUTE])
            metrics[f"balance/data_wait_s_rank{r}"] = float(per_rank[r, DATA_WAIT])
            metrics[f"balance/real_tokens_rank{r}"] = float(per_rank[r, REAL])
            metrics[f"balance/cost_rank{r}"] = float(per_rank[r, COST])
        self.last_metrics = metrics
        emit(trainer, metrics)
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
