"""LedgerCheck: while training, every rank's micro-batches are compared with the ledger written before training."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance.errors import InputValueError
from lit_balance.sampler.state import plan_micro_step
from lit_balance.lightning.callbacks._common import batch_fields, gather, needed_sampler
from lit_balance.world import data_parallel_world

__all__ = ["LedgerCheck", "LedgerMismatchError"]

_NONE = -1


class LedgerMismatchError(RuntimeError):
    """A rank trained on other documents than the ledger says: raised on every rank, naming the optimizer step,
    micro-step, rank and the first differing document."""


class LedgerCheck(L.Callback):
    """Check that every rank trains on exactly the documents of the ledger (:mod:`lit_balance.ledger`), micro-batch by
    micro-batch, and stop the run on every rank at the first difference.

    At the start of the ledger's epoch, each rank reads its own rows of the ledger (a Parquet filter on ``rank``) and
    checks the ledger's header against its training sampler (:func:`lit_balance.ledger.check_ledger_header`: the epoch,
    ranks, accumulation, the micro-step a resume starts at, the lengths' hash, the batching and mixture settings).
    Each training micro-batch's ``indices`` and ``is_fill`` (what :class:`~lit_balance.PadCollator` and
    :class:`~lit_balance.PackedCollator` put in a batch: the sampler's index of every row) are compared with the
    ledger's rows of that micro-step (Lightning's ``batch_idx``, the epoch's micro-step) and rank; every
    ``every_n_steps`` optimizer steps, and at the epoch's end, the ranks gather their first difference (one
    ``all_gather`` of eight integers), so a difference on one rank stops every rank with the same message. At the
    epoch's end each rank also checks that it ran every micro-step of the ledger from where the pass started. Other
    epochs than the ledger's are not checked.

    With ``record=DIR`` each rank also keeps, per micro-batch it trained (its training step ended), the hash of what it
    received and the indices
    (:mod:`lit_balance.lightning.ledger_record`), and writes them at the end of each pass over an epoch (also a pass cut
    short by ``max_steps`` or an error) to ``DIR/epochE-fromM-rankR.parquet``, for ``lit-balance ledger check DIR
    --ledger LEDGER`` after training; with ``ledger=None`` it only records (no ledger needed while training, no
    collective).

    Args:
        ledger: the ledger's Parquet file (:func:`lit_balance.ledger.write_ledger`, ``lit-balance plan --ledger``) of
            the run's epoch, number of ranks and ``accumulate_grad_batches``; after a resume on another number of
            ranks, the ledger of the resumed plan (:func:`lit_balance.ledger.write_datamodule_ledger` with
            ``sampler_state``).
        every_n_steps: optimizer steps between the gathers of differences (1: a difference stops the run at the end of
            its optimizer step).
        record: a directory where every rank writes what it received, for a later check; None: no record.

    Raises:
        LedgerMismatchError: on every rank, at the first gather after a rank received other documents than the ledger
            says (naming the optimizer step, micro-step, rank, row and both sample indices), or missed micro-steps of
            the ledger.
        ValueError: the ledger was written for other settings (naming each), ``every_n_steps`` below 1, neither
            ``ledger`` nor ``record`` given.
        KeyError, TypeError: batches without ``indices`` / ``is_fill``.
        RuntimeError: (at the epoch the ledger is of) no training sampler was handed to the Trainer (by
            :class:`~lit_balance.BalancedTextDataModule`, ``balanced_dataloader(..., trainer=self.trainer)`` or
            :func:`~lit_balance.use_training_sampler`).

    Example:
        >>> from lit_balance.callbacks import LedgerCheck
        >>> callback = LedgerCheck("ledger.parquet")  # Trainer(callbacks=[callback])
        >>> recorder = LedgerCheck(record="received/")  # then: lit-balance ledger check received/ --ledger L.parquet
    """

    def __init__(self, ledger: str | os.PathLike | None = None, *, every_n_steps: int = 1,
                 record: str | os.PathLike | None = None) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise InputValueError(f"every_n_steps must be an int >= 1 (optimizer steps between checks), got "
                                  f"{every_n_steps!r}", parameter="every_n_steps")
        if ledger is None and record is None:
            raise InputValueError("LedgerCheck needs a ledger to compare with (ledger=PATH), a directory to record "
                                  "what each rank received (record=DIR), or both; got neither", parameter="ledger")
        self.ledger = None if ledger is None else os.fspath(ledger)
        self.record = None if record is None else os.fspath(record)
        self._recorded: dict[str, Any] | None = None  # this pass's record: header, micro-steps, samples, fill
        self.every_n_steps = every_n_steps
        self._expected: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        self._epoch: int | None = None
        self._first: list[int] | None = None  # [micro_step, row, expected, received, expected_fill, received_fill]
        self._seen: set[int] = set()
        self._acc = 1
        self._rank = 0
        self._optimizer_step0 = 0
        self._skips: tuple[tuple[int, int], ...] = ()  # the ledger's skipped micro-steps (plan numbering)
        self._loaded_for: int | None = None  # the epoch whose ledger rows were read (or found not to be the ledger's)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._load(trainer)

    def _load(self, trainer: L.Trainer) -> None:
        """Read this rank's rows of the ledger for the trainer's epoch (a fit resumed mid-epoch has no
        ``on_train_epoch_start``: then at its first micro-batch)."""
        from lit_balance.lightning.ledger import check_ledger_header, ledger_header, read_ledger

        self._write_record()  # a pass that ended without on_train_epoch_end (a restarted loop)
        self._loaded_for = int(trainer.current_epoch)
        self._expected, self._first, self._seen = None, None, set()
        world = data_parallel_world(trainer)
        if self.record is not None:
            sampler = needed_sampler(trainer, "LedgerCheck")
            header = ledger_header(sampler)
            self._recorded = {"header": header, "rank": world.rank, "acc": int(header["accumulate_grad_batches"]),
                              "skips": tuple((int(a), int(b)) for a, b in header["skip_micro_steps"]),
                              "micro": [], "samples": [], "fill": []}
        if self.ledger is None:
            return
        table, header = read_ledger(self.ledger, columns=["micro_step", "rank", "sample", "fill"], rank=world.rank)
        if int(header["epoch"]) != int(trainer.current_epoch):
            return
        sampler = needed_sampler(trainer, "LedgerCheck")
        check_ledger_header(header, ledger_header(sampler), source=f"the ledger {self.ledger}")
        self._epoch, self._acc, self._rank = int(header["epoch"]), int(header["accumulate_grad_batches"]), world.rank
        self._optimizer_step0 = int(header["first_optimizer_step"])
        self._skips = tuple((int(a), int(b)) for a, b in header.get("skip_micro_steps", []))
        micro = table.column("micro_step").to_numpy()
        sample = table.column("sample").to_numpy()
        fill = table.column("fill").to_numpy(zero_copy_only=False)
        cuts = np.flatnonzero(np.diff(micro)) + 1
        starts = np.concatenate([[0], cuts]).astype(np.int64)
        self._expected = {int(m): (s, f) for m, s, f in zip(micro[starts].tolist(), np.split(sample, cuts),
                                                             np.split(fill, cuts))} if micro.size else {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._loaded_for != int(trainer.current_epoch):
            self._load(trainer)
        if self._expected is None and self._recorded is None:
            return
        indices, is_fill = batch_fields(batch, ("indices", "is_fill"), "LedgerCheck")
        got = torch.as_tensor(indices).cpu().numpy().astype(np.int64, copy=True).reshape(-1)
        got_fill = torch.as_tensor(is_fill).cpu().numpy().astype(bool, copy=True).reshape(-1)
        if self._recorded is not None:  # recorded once its training step ends (a failed step did not train)
            self._recorded["pending"] = (int(batch_idx), got, got_fill)
        if self._expected is None:
            return
        self._seen.add(int(batch_idx))
        if self._first is not None:
            return
        want, want_fill = self._expected.get(int(batch_idx), (np.zeros(0, np.int64), np.zeros(0, bool)))
        if got.shape == want.shape and np.array_equal(got, want) and np.array_equal(got_fill, want_fill):
            return
        n = min(got.size, want.size)
        differ = np.flatnonzero((got[:n] != want[:n]) | (got_fill[:n] != want_fill[:n]))
        row = int(differ[0]) if differ.size else n
        pick = lambda a, i: int(a[i]) if i < a.size else _NONE  # noqa: E731
        self._first = [int(batch_idx), row, pick(want, row), pick(got, row), pick(want_fill, row),
                       pick(got_fill, row)]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        recorded = self._recorded
        if recorded is not None and recorded.get("pending") is not None:
            micro, got, got_fill = recorded.pop("pending")
            recorded["micro"].append(micro)
            recorded["samples"].append(got)
            recorded["fill"].append(got_fill)
        if self._expected is None:
            return
        step_end = (batch_idx + 1) % self._acc == 0
        if step_end and ((batch_idx + 1) // self._acc) % self.every_n_steps == 0:
            self._gather(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_record()
        if self._expected is None:
            return
        if self._first is None and self._seen:
            start = min(self._seen)
            missed = sorted(m for m in self._expected if m >= start and m not in self._seen)
            if missed:
                self._first = [missed[0], 0, int(self._expected[missed[0]][0][0]), _NONE, 0, 0]
        self._gather(trainer)
        self._expected = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_record()  # a pass not written at its epoch's end

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._write_record()

    def _write_record(self) -> None:
        """Write this rank's record of the pass now ending (nothing when no micro-batch was received); it is
        ``complete`` when it ran the epoch's last micro-step (not when ``max_steps`` or an error cut it short)."""
        from lit_balance.lightning.ledger_record import record_file_name, write_record

        recorded, self._recorded = self._recorded, None
        if recorded is None or not recorded["micro"]:
            return
        acc, skips, micro = recorded["acc"], recorded["skips"], recorded["micro"]
        header = {**recorded["header"], "complete": micro[-1] == int(recorded["header"]["micro_steps"]) - 1}
        steps = [int(header["first_optimizer_step"]) + plan_micro_step(skips, m) // acc for m in micro]
        name = record_file_name(header["epoch"], recorded["rank"], micro[0])
        write_record(os.path.join(self.record, name), header, micro, steps, recorded["rank"], recorded["samples"],
                     recorded["fill"])

    def _gather(self, trainer: L.Trainer) -> None:
        mine = [1, self._rank, *self._first] if self._first is not None else [0, self._rank] + [_NONE] * 6
        every = gather(trainer, torch.tensor(mine, dtype=torch.long)).reshape(-1, 8).tolist()
        bad = [r for r in every if r[0]]
        if not bad:
            return
        _, rank, micro, row, want, got, want_fill, got_fill = min(bad, key=lambda r: (r[2], r[1]))
        # the optimizer step of the run as the ledger numbers it (skipped steps counted)
        step = self._optimizer_step0 + plan_micro_step(self._skips, micro) // self._acc
        what = (f"received sample {got}{' (a fill row)' if got_fill == 1 else ''} where the ledger has sample {want}"
                f"{' (a fill row)' if want_fill == 1 else ''}" if got != _NONE and want != _NONE else
                f"received no row where the ledger has sample {want}" if got == _NONE and micro in self._seen else
                f"never ran this micro-step, whose first row in the ledger is sample {want}" if got == _NONE else
                f"received sample {got} beyond the ledger's rows of this micro-batch")
        raise LedgerMismatchError(
            f"training differs from the ledger {self.ledger} at optimizer step {step} (epoch {self._epoch}, micro-step "
            f"{micro}, micro-batch {micro % self._acc} of the step), rank {rank}, row {row}: the rank {what} "
            f"({len(bad)} rank(s) differ). The loader did not deliver the planned documents: check the dataset's "
            "indexing and the collator, or write the ledger again for this run's settings")
