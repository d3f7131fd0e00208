"""RunSummary: per-rank micro-batches, real tokens, padded slots, and where each rank's time went in a fit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool, check_callable
from lit_balance.lightning.callbacks._common import batch_fields, gather
from lit_balance.lightning.callbacks.phases import PhaseTotals, phase_clock, remove_phase_clock

__all__ = ["RunSummary"]

_COUNTS = ("micro_batches", "real_tokens", "padded_tokens")
_TIMES = ("compute_s", "data_wait_s", "rank_wait_s", "other_s", "wall_s")  # PhaseTotals.as_list()


class RunSummary(L.Callback):
    """Count and time, on every rank, what training consumed; gather it once at the end of training.

    Counts per rank, over all training micro-batches of the fit (batches from
    :class:`lit_balance.PadCollator`, which carry ``num_real_tokens`` and ``num_padded_tokens``):
    micro-batches, real tokens and padded token slots. Times per rank, in seconds, from ``on_train_start`` to
    ``on_train_end``, split as :class:`lit_balance.lightning.callbacks.phases.PhaseClock` measures them (the same
    clock as :class:`lit_balance.callbacks.StragglerMonitor`'s windows, so its logged seconds add up to these):

    * ``compute_s``: forward, backward and the optimizer step (Lightning's ``run_training_batch``, less the callbacks'
      hooks inside it and less the rank wait before the backward).
    * ``data_wait_s``: fetching the training batches and moving them to the device.
    * ``rank_wait_s``: waiting for the other ranks: at a barrier right before each backward that synchronises
      gradients, and in Lightning's stop-flag broadcast from rank 0 before each fetch.
    * ``other_s``: the rest: validation, checkpointing, logging, callbacks (the progress bar, the monitors).
    * ``wall_s``: their sum (about the same on every rank: they wait for each other).

    At ``on_train_end`` every data-parallel rank (:func:`lit_balance.world.data_parallel_world`) takes part in one
    ``all_gather``; afterwards :attr:`rows` holds one dict per rank (keys ``rank``, ``micro_batches``,
    ``real_tokens``, ``padded_tokens``, ``padding_ratio``, ``compute_s``, ``data_wait_s``, ``rank_wait_s``,
    ``other_s``, ``wall_s``) and :attr:`total` the sums over ranks (``wall_s``: the slowest rank's;
    ``straggler_ratio``: the largest ``compute_s`` over the median, over the whole run), on every rank. With
    ``print_table=True`` global rank 0 prints them (:meth:`format_table`, lines of at most 80 characters) at
    ``on_fit_end``, once a progress bar has closed (:class:`lit_balance.callbacks.BalanceProgressBar` closes at
    ``on_train_end``).

    Args:
        print_table: print the table on rank 0 at the end of the fit.
        clock: seconds, monotonic (default :func:`time.perf_counter`), for the :class:`PhaseClock` this callback puts
            in front of the Trainer's profiler when no other monitor has; tests inject a fake one.

    Raises:
        TypeError: ``print_table`` not a bool; a training batch that is not a dict.
        KeyError: a training batch lacks ``num_real_tokens`` or ``num_padded_tokens``.
    """

    def __init__(self, print_table: bool = True, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.print_table = check_bool("print_table", print_table)
        self.clock = check_callable("clock", clock, "pass a function returning seconds, or leave the default")
        self.rows: list[dict[str, float]] = []
        self.total: dict[str, float] = {}
        self._counts = [0, 0, 0]
        self._start: PhaseTotals | None = None
        self._print_pending = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        phase_clock(trainer, clock=self.clock)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        remove_phase_clock(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts = [0, 0, 0]
        self._start = phase_clock(trainer, clock=self.clock).totals()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        real, padded = batch_fields(batch, ("num_real_tokens", "num_padded_tokens"), "RunSummary")
        self._counts[0] += 1
        self._counts[1] += int(real)
        self._counts[2] += int(padded)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = phase_clock(trainer, clock=self.clock).totals()
        times = (now - (self._start if self._start is not None else now)).as_list()
        gathered = gather(trainer, torch.tensor([*self._counts, *times], dtype=torch.float64))
        fields = (*_COUNTS, *_TIMES)
        self.rows = []
        for rank, values in enumerate(gathered.tolist()):
            row: dict[str, float] = {"rank": rank, **dict(zip(fields, values))}
            row["padding_ratio"] = 1.0 - row["real_tokens"] / row["padded_tokens"] if row["padded_tokens"] else 0.0
            self.rows.append(row)
        self.total = dict(zip(fields, gathered.sum(dim=0).tolist()))
        self.total["wall_s"] = float(gathered[:, fields.index("wall_s")].max())
        self.total["padding_ratio"] = (
            1.0 - self.total["real_tokens"] / self.total["padded_tokens"] if self.total["padded_tokens"] else 0.0
        )
        compute = gathered[:, fields.index("compute_s")].numpy()
        median = float(np.median(compute))
        self.total["straggler_ratio"] = float(compute.max()) / median if median > 0 else 1.0
        self._print_pending = self.print_table and trainer.is_global_zero

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._print_pending:
            self._print_pending = False
            print(self.format_table(), flush=True)

    def format_table(self) -> str:
        """The per-rank table (a header of two lines), its total line (sums over ranks) and lines saying what the
        figures are: at most 80 characters a line while the counts have at most 9 digits."""
        heads = (("rank", ""), ("micro-", "batches"), ("real", "tokens"), ("padded", "slots"), ("padding", ""),
                 ("compute", "s"), ("data", "wait s"), ("rank", "wait s"), ("other", "s"))
        widths = (5, 7, 9, 9, 7, 8, 7, 7, 7)
        lines = [" ".join(f"{h[row]:>{w}}" for h, w in zip(heads, widths)).rstrip() for row in (0, 1)]
        for r in [*self.rows, {**self.total, "rank": "total"}]:
            lines.append(
                f"{r['rank']:>5} {int(r['micro_batches']):>7} {int(r['real_tokens']):>9} "
                f"{int(r['padded_tokens']):>9} {r['padding_ratio']:>7.4f} {r['compute_s']:>8.1f} "
                f"{r['data_wait_s']:>7.1f} {r['rank_wait_s']:>7.1f} {r['other_s']:>7.1f}"
            )
        lines += [
            f"wall {self.total['wall_s']:.1f} s (slowest rank) | straggler ratio {self.total['straggler_ratio']:.3f} "
            "(whole run)",
            "straggler ratio: the largest compute s over the median",
            "compute: forward, backward, optimizer step | rank wait: waiting for other ranks",
            "data wait: fetching batches, moving them to the device",
            "other: validation, checkpointing, logging, callbacks",
        ]
        return "\n".join(lines)
