"""RunSummary: per-rank micro-batches, real tokens, padded slots, and compute, waiting and other seconds of a fit."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool
from lit_balance.lightning.callbacks._common import batch_fields, gather

__all__ = ["RunSummary"]

_FIELDS = ("micro_batches", "real_tokens", "padded_tokens", "compute_s", "wait_s", "wall_s")


class RunSummary(L.Callback):
    """Count and time, on every rank, what training consumed; gather it once at the end of training.

    Counts per rank, over all training micro-batches of the fit (batches from
    :class:`lit_balance.PadCollator`, which carry ``num_real_tokens`` and ``num_padded_tokens``):
    micro-batches, real tokens and padded token slots. Times per rank, in seconds, over the same intervals as
    :class:`lit_balance.callbacks.StragglerMonitor`:

    * ``compute_s``: from ``on_train_batch_start`` to ``on_before_backward`` (the forward pass and the loss; to
      ``on_train_batch_end`` when no backward runs). It holds no collective, so it differs between ranks as their
      work and speed do.
    * ``wait_s``: from the previous ``on_train_batch_end`` (or ``on_train_start``) to ``on_train_batch_start``:
      fetching the batch, and Lightning's per-micro-batch broadcast from rank 0, where a rank that finished early
      waits for the others.
    * ``other_s``: ``wall_s - compute_s - wait_s``: backward (with the gradient all-reduce, where ranks also wait),
      the optimizer step, validation and logging.
    * ``wall_s``: from ``on_train_start`` to ``on_train_end`` (about the same on every rank: they wait for each
      other).

    At ``on_train_end`` every data-parallel rank (:func:`lit_balance.world.data_parallel_world`) takes part in one
    ``all_gather``; afterwards :attr:`rows` holds one dict per rank (keys ``rank``, ``micro_batches``,
    ``real_tokens``, ``padded_tokens``, ``padding_ratio``, ``compute_s``, ``wait_s``, ``other_s``, ``wall_s``) and
    :attr:`total` the sums over ranks (``wall_s``: the slowest rank's; ``straggler_ratio``: the largest ``compute_s``
    over the median), on every rank. With ``print_table=True`` global rank 0 prints them (:meth:`format_table`).

    Args:
        print_table: print the table on rank 0 at the end of training.

    Raises:
        TypeError: ``print_table`` not a bool; a training batch that is not a dict.
        KeyError: a training batch lacks ``num_real_tokens`` or ``num_padded_tokens``.
    """

    def __init__(self, print_table: bool = True) -> None:
        self.print_table = check_bool("print_table", print_table)
        self.rows: list[dict[str, float]] = []
        self.total: dict[str, float] = {}
        self._counts = [0, 0, 0]
        self._times = [0.0, 0.0]
        self._start = 0.0
        self._batch_start: float | None = None
        self._prev_end = 0.0
        self._timed = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts = [0, 0, 0]
        self._times = [0.0, 0.0]
        self._start = self._prev_end = time.perf_counter()
        self._batch_start = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        self._times[1] += now - self._prev_end
        self._batch_start = now
        self._timed = False

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._batch_start is not None and not self._timed:
            self._times[0] += time.perf_counter() - self._batch_start
            self._timed = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self._batch_start is not None and not self._timed:
            self._times[0] += now - self._batch_start
        self._batch_start = None
        real, padded = batch_fields(batch, ("num_real_tokens", "num_padded_tokens"), "RunSummary")
        self._counts[0] += 1
        self._counts[1] += int(real)
        self._counts[2] += int(padded)
        self._prev_end = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = torch.tensor([*self._counts, *self._times, time.perf_counter() - self._start], dtype=torch.float64)
        gathered = gather(trainer, local)
        self.rows = []
        for rank, values in enumerate(gathered.tolist()):
            row: dict[str, float] = {"rank": rank, **dict(zip(_FIELDS, values))}
            row["padding_ratio"] = 1.0 - row["real_tokens"] / row["padded_tokens"] if row["padded_tokens"] else 0.0
            row["other_s"] = row["wall_s"] - row["compute_s"] - row["wait_s"]
            self.rows.append(row)
        sums = gathered.sum(dim=0).tolist()
        self.total = dict(zip(_FIELDS, sums))
        self.total["wall_s"] = float(gathered[:, 5].max())
        self.total["other_s"] = sum(row["other_s"] for row in self.rows)
        self.total["padding_ratio"] = (
            1.0 - self.total["real_tokens"] / self.total["padded_tokens"] if self.total["padded_tokens"] else 0.0
        )
        compute = gathered[:, 3].numpy()
        median = float(np.median(compute))
        self.total["straggler_ratio"] = float(compute.max()) / median if median > 0 else 1.0
        if self.print_table and trainer.is_global_zero:
            print(self.format_table(), flush=True)

    def format_table(self) -> str:
        """The per-rank table, its total line (sums over ranks) and a line with the wall time and straggler ratio."""
        head = (f"{'rank':>6} {'micro-batches':>14} {'real tokens':>12} {'padded slots':>13} "
                f"{'padding ratio':>14} {'compute s':>10} {'wait s':>8} {'other s':>8}")
        lines = [head]
        for r in [*self.rows, {**self.total, "rank": "total"}]:
            lines.append(
                f"{r['rank']:>6} {int(r['micro_batches']):>14} {int(r['real_tokens']):>12} "
                f"{int(r['padded_tokens']):>13} {r['padding_ratio']:>14.4f} {r['compute_s']:>10.1f} "
                f"{r['wait_s']:>8.1f} {r['other_s']:>8.1f}"
            )
        lines.append(f"wall {self.total['wall_s']:.1f} s | straggler ratio {self.total['straggler_ratio']:.3f} "
                     "(largest compute s over the median) | compute s: forward and loss; wait s: data and waiting for the other "
                     "ranks before each micro-batch; other s: backward with the gradient all-reduce, optimizer, "
                     "validation")
        return "\n".join(lines)
