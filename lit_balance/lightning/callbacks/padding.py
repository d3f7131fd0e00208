"""PaddingRatioMonitor: the padding ratio over the epoch so far (global and per rank) and real tokens per second."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from lit_balance._checks import check_callable, check_int
from lit_balance.errors import InputValueError
from lit_balance.lightning.callbacks._common import batch_fields, emit, gather
from lit_balance.lightning.metrics import PaddingRatio

__all__ = ["PaddingRatioMonitor"]


class PaddingRatioMonitor(L.Callback):
    """Log the padding ratio of the training micro-batches seen this epoch, over all ranks and per rank.

    Every rank counts real tokens and padded slots of each training micro-batch (the ``num_real_tokens``
    and ``num_padded_tokens`` of :class:`lit_balance.PadCollator` batches) in a
    :class:`lit_balance.lightning.metrics.PaddingRatio`. Every ``log_every_n_micro_batches`` micro-batches (the same
    batches on every rank) and at the end of each training epoch, the data-parallel ranks
    (:func:`lit_balance.world.data_parallel_world`) take part in one ``all_gather`` of four numbers each, and
    global rank 0 logs (packed micro-batches of :class:`lit_balance.PackedCollator` have no padding
    unless ``pad_to_multiple_of`` pads the row's tail, so the ratio is then exactly 0):

    * ``balance/padding_ratio``: ``1 - sum(real) / sum(padded)`` over all ranks, this epoch so far.
    * ``balance/padding_ratio_rank{r}``: the same over rank ``r``'s micro-batches.
    * ``balance/real_tokens_per_s``: real tokens of all ranks since the previous log, divided by the wall
      seconds since then (the slowest rank's; the interval covers everything: data, compute, waits).

    Args:
        log_every_n_micro_batches: training micro-batches between logs, per rank (a micro-batch is one
            ``training_step``, not an optimizer step); None (default) falls back to the Trainer's
            ``log_every_n_steps``, read as micro-batches too.
        clock: seconds, monotonic (default :func:`time.perf_counter`); tests inject a fake one.

    Raises:
        TypeError: ``log_every_n_micro_batches`` neither an int nor None; a ``clock`` that is not callable; a training
            batch that is not a dict.
        ValueError: ``log_every_n_micro_batches < 1``; a batch with more real tokens than padded slots.
        KeyError: a training batch lacks ``num_real_tokens`` or ``num_padded_tokens``.

    Example:
        >>> trainer = L.Trainer(callbacks=[PaddingRatioMonitor(log_every_n_micro_batches=20)], logger=False)
    """

    def __init__(self, log_every_n_micro_batches: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if log_every_n_micro_batches is not None:
            log_every_n_micro_batches = check_int(
                "log_every_n_micro_batches", log_every_n_micro_batches, 1,
                "set the training micro-batches between logs, or None for the Trainer's log_every_n_steps")
        self.log_every_n_micro_batches = log_every_n_micro_batches
        self.clock = check_callable("clock", clock, "pass a function returning seconds, or leave the default")
        self.metric = PaddingRatio(sync_on_compute=False)
        #: The last values logged (the same on every rank).
        self.last_metrics: dict[str, float] = {}
        self._since_real = 0
        self._since_padded = 0
        self._since_batches = 0
        self._last_time = 0.0
        self._batches = 0
        self._step = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = int(trainer.global_step)  # the step this micro-batch's figures are logged at

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.metric.reset()
        self._since_real = 0
        self._since_padded = 0
        self._since_batches = 0
        self._last_time = self.clock()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        real, padded = map(int, batch_fields(batch, ("num_real_tokens", "num_padded_tokens"), "PaddingRatioMonitor"))
        if not 0 <= real <= padded:
            raise InputValueError(f"expected 0 <= num_real_tokens <= num_padded_tokens, got {real} and {padded}")
        self._since_padded += padded  # the metric takes the window's sums at the next log (cheaper per batch)
        self._since_real += real
        self._since_batches += 1
        self._batches += 1
        every = self.log_every_n_micro_batches or max(int(trainer.log_every_n_steps), 1)
        if self._batches % every == 0:
            self._log(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._since_batches:
            self._log(trainer, pl_module)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = self.clock()
        self.metric.update(self._since_real, self._since_padded)
        local = torch.tensor([float(self.metric.real_tokens), float(self.metric.padded_tokens),
                              float(self._since_real), now - self._last_time], dtype=torch.float64)
        g = gather(trainer, local)
        self._since_real, self._since_padded, self._since_batches, self._last_time = 0, 0, 0, now
        real, padded = g[:, 0], g[:, 1]
        metrics = {"balance/padding_ratio": _ratio(float(real.sum()), float(padded.sum()))}
        for r in range(g.shape[0]):
            metrics[f"balance/padding_ratio_rank{r}"] = _ratio(float(real[r]), float(padded[r]))
        elapsed = float(g[:, 3].max())
        metrics["balance/real_tokens_per_s"] = float(g[:, 2].sum()) / elapsed if elapsed > 0 else 0.0
        self.last_metrics = metrics
        emit(trainer, metrics, step=self._step)


def _ratio(real: float, padded: float) -> float:
    return 1.0 - real / padded if padded > 0 else 0.0
