"""RunSummary: per-rank micro-batches, real tokens, padded slots and wall time of a fit."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lit_balance._checks import check_bool
from lit_balance.lightning.callbacks._common import batch_fields, gather

__all__ = ["RunSummary"]

_FIELDS = ("micro_batches", "real_tokens", "padded_tokens", "wall_s")


class RunSummary(L.Callback):
    """Count, on every rank, what training consumed; gather it once at the end of training.

    Counts per rank, over all training micro-batches of the fit (batches from
    :class:`lit_balance.PadCollator`, which carry ``num_real_tokens`` and ``num_padded_tokens``):
    micro-batches, real tokens, padded token slots, and wall seconds from ``on_train_start`` to
    ``on_train_end``. At ``on_train_end`` every data-parallel rank (:func:`lit_balance.world.data_parallel_world`)
    takes part in one ``all_gather``; afterwards
    :attr:`rows` holds one dict per rank (keys ``rank``, ``micro_batches``, ``real_tokens``,
    ``padded_tokens``, ``padding_ratio``, ``wall_s``) and :attr:`total` the sums (wall time: the slowest
    rank), on every rank. With ``print_table=True`` global rank 0 prints them.

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
        self._start = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts = [0, 0, 0]
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        real, padded = batch_fields(batch, ("num_real_tokens", "num_padded_tokens"), "RunSummary")
        self._counts[0] += 1
        self._counts[1] += int(real)
        self._counts[2] += int(padded)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = torch.tensor([*self._counts, time.perf_counter() - self._start], dtype=torch.float64)
        gathered = gather(trainer, local)
        self.rows = []
        for rank, values in enumerate(gathered.tolist()):
            row: dict[str, float] = {"rank": rank, **dict(zip(_FIELDS, values))}
            row["padding_ratio"] = 1.0 - row["real_tokens"] / row["padded_tokens"] if row["padded_tokens"] else 0.0
            self.rows.append(row)
        sums = gathered.sum(dim=0).tolist()
        self.total = dict(zip(_FIELDS, sums))
        self.total["wall_s"] = float(gathered[:, 3].max())
        self.total["padding_ratio"] = (
            1.0 - self.total["real_tokens"] / self.total["padded_tokens"] if self.total["padded_tokens"] else 0.0
        )
        if self.print_table and trainer.is_global_zero:
            print(self.format_table(), flush=True)

    def format_table(self) -> str:
        """The per-rank table and its total line, as text."""
        head = (f"{'rank':>6} {'micro-batches':>14} {'real tokens':>12} {'padded slots':>13} "
                f"{'padding ratio':>14} {'wall s':>8}")
        lines = [head]
        for r in [*self.rows, {**self.total, "rank": "total"}]:
            lines.append(
                f"{r['rank']:>6} {int(r['micro_batches']):>14} {int(r['real_tokens']):>12} "
                f"{int(r['padded_tokens']):>13} {r['padding_ratio']:>14.4f} {r['wall_s']:>8.1f}"
            )
        return "\n".join(lines)
