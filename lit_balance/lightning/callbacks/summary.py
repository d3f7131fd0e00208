"""RunSummary: per-rank micro-batches, real tokens, padded slots, and where each rank's time went in a fit; for a
mixture, each component's tokens per rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool, check_callable
from lit_balance.lightning.callbacks._common import batch_fields, gather, mixture_sampler, row_tokens
from lit_balance.lightning.callbacks.phases import PhaseTotals, phase_clock, remove_phase_clock
from lit_balance.lightning.metrics import ComponentTokens

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

    On a mixture (the training sampler a :class:`~lit_balance.sampler.mixture.MixtureBatchSampler`), every rank also
    counts each component's real tokens, supervised tokens and documents (fill rows left out; as
    :class:`lit_balance.callbacks.MixtureMonitor` counts them) in the same gather; :attr:`components` then holds one
    dict per component (``name``, ``target`` and ``share``: its target share and its share of the run's units in the
    mixture's unit; ``real_tokens``, ``supervised_tokens``, ``documents``: sums over ranks; ``rank_real_tokens``,
    ``rank_supervised_tokens``: lists by rank) and the table ends with them. For a single corpus it is empty and the
    table is unchanged.

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
        self.components: list[dict[str, Any]] = []
        self._counts = [0, 0, 0]
        self._mixture: Any = None  # the mixture sampler's settings, None for a single corpus
        self._sampler: Any = None
        self._component_tokens: ComponentTokens | None = None
        self._start: PhaseTotals | None = None
        self._print_pending = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        phase_clock(trainer, clock=self.clock)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        remove_phase_clock(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts = [0, 0, 0]
        self._start = phase_clock(trainer, clock=self.clock).totals()
        self.components = []
        self._sampler = sampler = mixture_sampler(trainer)
        self._mixture = None if sampler is None else sampler.mixture
        self._component_tokens = (None if sampler is None else
                                  ComponentTokens(len(sampler.mixture.names), unit=sampler.mixture.unit,
                                                  sync_on_compute=False))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._component_tokens is not None:  # the loader may be rebuilt every epoch
            self._sampler = mixture_sampler(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        real, padded = batch_fields(batch, ("num_real_tokens", "num_padded_tokens"), "RunSummary")
        self._counts[0] += 1
        self._counts[1] += int(real)
        self._counts[2] += int(padded)
        if self._component_tokens is not None:
            indices, real_rows, supervised = row_tokens(batch, "RunSummary")
            self._component_tokens.update(self._sampler.component_of(indices), real_rows, supervised)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = phase_clock(trainer, clock=self.clock).totals()
        times = (now - (self._start if self._start is not None else now)).as_list()
        local = torch.tensor([*self._counts, *times], dtype=torch.float64)
        m = self._component_tokens
        if m is not None:  # [real_tokens, supervised_tokens, documents] x components, after the fields
            local = torch.cat([local, m.real_tokens.cpu(), m.supervised_tokens.cpu(), m.documents.cpu()])
        gathered = gather(trainer, local)
        fields = (*_COUNTS, *_TIMES)
        if m is not None:
            self.components = _components(self._mixture, gathered[:, len(fields):].reshape(gathered.shape[0], 3, -1))
            gathered = gathered[:, :len(fields)]
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
        if self.components:
            lines += _component_lines(self.components, self._mixture.unit if self._mixture is not None else "tokens")
        return "\n".join(lines)


def _components(mixture: Any, counts: torch.Tensor) -> list[dict[str, Any]]:
    """Per component, from the gathered ``counts`` ``[ranks, 3 (real, supervised, documents), components]``."""
    unit = ("tokens", "supervised_tokens", "documents").index(mixture.unit)
    total = counts.sum(dim=0)
    units = float(total[unit].sum())
    return [{"name": name, "target": float(target),
             "share": float(total[unit, c]) / units if units > 0 else 0.0,
             "real_tokens": float(total[0, c]), "supervised_tokens": float(total[1, c]),
             "documents": float(total[2, c]),
             "rank_real_tokens": counts[:, 0, c].tolist(), "rank_supervised_tokens": counts[:, 1, c].tolist()}
            for c, (name, target) in enumerate(zip(mixture.names, np.asarray(mixture.shares).tolist()))]


def _component_lines(components: list[dict[str, Any]], unit: str) -> list[str]:
    """The mixture's part of the table: per component its target, its share of the run and its tokens (all ranks);
    then per rank each component's real / supervised tokens, three components a block (lines of at most 80
    characters while names have at most 22 characters and counts at most 9 digits)."""
    unit_name = {"tokens": "real tokens", "supervised_tokens": "supervised tokens", "documents": "documents"}[unit]
    width = max(9, *(len(c["name"]) for c in components))
    lines = [f"{'component':<{width}}  target   share  real tokens  supervised   documents",
             *(f"{c['name']:<{width}}  {c['target']:6.4f}  {c['share']:6.4f}  {int(c['real_tokens']):>11} "
               f"{int(c['supervised_tokens']):>11} {int(c['documents']):>11}" for c in components),
             f"share: of the run's {unit_name}, all ranks; supervised: tokens with a target"]
    cell = max(19, width)
    for lo in range(0, len(components), 3):
        block = components[lo:lo + 3]
        lines.append(f"{'rank':>5} " + " ".join(f"{c['name']:>{cell}}" for c in block))
        for r in range(len(block[0]["rank_real_tokens"])):
            cells = [f"{int(c['rank_real_tokens'][r])} / {int(c['rank_supervised_tokens'][r])}" for c in block]
            lines.append(f"{r:>5} " + " ".join(f"{text:>{cell}}" for text in cells))
    lines.append("per rank: real tokens / supervised tokens of each component")
    return lines
