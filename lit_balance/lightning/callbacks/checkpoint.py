"""LastStepCheckpoint: the weights and loop state of the last optimizer step, however training ends."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_balance.data.workers import STOP_SIGNALS

__all__ = ["LastStepCheckpoint"]


class LastStepCheckpoint(Checkpoint):
    """Write ``last.ckpt`` when training ends: at ``max_steps``, at ``max_epochs``, or interrupted.

    Lightning's :class:`~lightning.pytorch.callbacks.ModelCheckpoint` saves at validation or epoch ends, and its
    ``save_last`` writes at ``on_train_end`` only if it never saved: a run stopped by ``max_steps`` between two saves
    keeps an older step, and one stopped before the first save keeps nothing. This callback always writes the state of
    the last optimizer step (``Trainer.save_checkpoint``, every rank taking part, rank 0 writing), so
    ``ckpt_path=<that file>`` resumes from it:

    * at ``max_steps``: at the ``on_train_batch_end`` of the micro-batch that reached it, a mid-epoch state (as
      ``ModelCheckpoint(every_n_train_steps=...)`` writes), so a resume with a larger ``max_steps`` continues the same
      epoch (a state written at ``on_train_end`` would count that epoch as finished and skip the rest of it);
    * at ``on_train_end`` otherwise (``max_epochs``, a ``max_time``, an early stop), unless it already wrote this step;
    * when a SIGINT (Ctrl-C) or SIGTERM reaches any rank during training: with ``stop_on_signal=True`` (the default)
      the signal only sets a flag; at the end of each optimizer step, and at the end of a validation inside training,
      every process takes part in one small all-gather of the flags, and when any is set every rank stops there
      (``trainer.should_stop``) and this callback writes the step's mid-epoch state, as at ``max_steps``. Training then
      ends as it normally does (``on_train_end`` and ``on_fit_end`` run on every rank: a :class:`RunSummary` prints its
      table, the monitors log every trained step), ``trainer.fit`` returns, and :attr:`stopped_by` names the signal.
      A further Ctrl-C or SIGTERM while the run stops (the rest of the step, validation, the save, the table) waits
      for it: rank 0 says so on stderr once; SIGKILL ends the processes at once, and the last complete checkpoint is
      then the one written before. The handlers are installed at ``setup`` (a signal before training starts is
      answered by the handler they replaced: Ctrl-C raises ``KeyboardInterrupt``) and set back at ``teardown``; after
      an exception, which calls no ``teardown``, they stay and answer as the handlers they replaced.
      DataLoader workers of this package's loaders ignore both signals
      (:func:`lit_balance.data.workers.ignore_stop_signals_in_workers`): the terminal's Ctrl-C reaches every process
      of the group, and the main process decides.

    Lightning keeps its checkpoint callbacks last, so this one runs after every other callback's ``on_train_end``.
    Beside a :class:`~lightning.pytorch.callbacks.ModelCheckpoint`, pass ``Trainer(callbacks=[ModelCheckpoint(...),
    LastStepCheckpoint()])``: the Trainer adds its default ModelCheckpoint only when no checkpoint callback is given.

    Args:
        dirpath: directory of ``last.ckpt``; default: the first ModelCheckpoint's directory, else
            ``<trainer.log_dir or default_root_dir>/checkpoints``.
        filename: the file's name, ``.ckpt`` added.
        stop_on_signal: SIGINT and SIGTERM during training stop every rank at the end of the optimizer step (one
            all-gather of a flag per optimizer step and per validation); False: Lightning's own handling (SIGTERM
            stops every rank with a ``SIGTERMException``, after this callback saved; Ctrl-C raises
            ``KeyboardInterrupt``).

    Attributes:
        last_model_path: the file written by this fit ("" before it wrote one; not restored from a checkpoint), as
            ModelCheckpoint names it, so that :func:`lit_balance.lightning.outputs.run_outputs` lists it.
        stopped_by: the name of the signal that stopped training (``"SIGINT"``, ``"SIGTERM"``; the largest signal
            number any rank received), the same on every rank; None when training was not stopped by one.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = "last",
                 stop_on_signal: bool = True) -> None:
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.stop_on_signal = bool(stop_on_signal)
        self.last_model_path = ""
        self.stopped_by: str | None = None
        self._saved_step = -1
        self._received = 0  # the signal number this process received during training, 0 if none
        self._checked_step = -1
        self._handlers: dict[int, Any] = {}
        self._armed = False  # training runs: a signal stops it at a step's end
        self._presses = 0
        self._global_zero = False

    def _path(self, trainer: L.Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath / f"{self.filename}.ckpt"
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath) / f"{self.filename}.ckpt"
        root = trainer.log_dir or trainer.default_root_dir
        return Path(root) / "checkpoints" / f"{self.filename}.ckpt"

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.global_step <= 0 or trainer.sanity_checking or trainer.global_step == self._saved_step:
            return
        path = self._path(trainer)
        trainer.save_checkpoint(path)
        self.last_model_path = str(path)
        self._saved_step = int(trainer.global_step)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # installed before Lightning records the process's handlers (Trainer._run), so that the ones it sets back
        # when the fit ends are these: a further Ctrl-C while the table prints still waits
        self._armed, self._presses = False, 0
        if stage == "fit" and self.stop_on_signal and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signum not in self._handlers:
                    self._handlers[signum] = signal.signal(signum, self._on_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step, self._checked_step, self._received, self.stopped_by = -1, int(trainer.global_step), 0, None
        self.last_model_path = ""  # a resumed fit names the file it writes, not the one it loaded
        self._global_zero = bool(trainer.is_global_zero)
        if self._handlers:
            # Lightning put its SIGTERM handler (a stop by exception, SIGTERMException) in front of this one
            signal.signal(signal.SIGTERM, self._on_signal)
            self._armed = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Note the signal; the next optimizer step's end (or validation's) stops every rank. A further one while the
        run stops (the step, validation, the save, the table) waits for it. Before training starts, the handler this
        one replaced answers (Ctrl-C: ``KeyboardInterrupt``)."""
        if not self._armed:  # before training starts, or after it ended without a stop: as if this were not here
            previous = self._handlers.get(signum, signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        self._received = max(self._received, int(signum))
        self._presses += 1
        if self._presses == 2 and self._global_zero:
            print(f"\n{signal.Signals(signum).name} again: every rank is stopping at the end of this optimizer step "
                  "and writing last.ckpt; waiting for it (SIGKILL ends at once, without it)", file=sys.stderr,
                  flush=True)

    def _restore_handlers(self) -> None:
        self._armed = False
        while self._handlers:
            signum, previous = self._handlers.popitem()
            signal.signal(signum, previous)

    def _stop_if_signalled(self, trainer: L.Trainer) -> None:
        """Every process takes part: one all-gather of the signal each received; any: every rank stops here, saved."""
        device = getattr(trainer.strategy, "root_device", torch.device("cpu"))
        received = int(trainer.strategy.all_gather(torch.tensor([self._received], device=device)).max())
        if received:
            self.stopped_by = signal.Signals(received).name
            trainer.should_stop = True
            self._save(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps > 0 and trainer.global_step >= max_steps:
            self._save(trainer)
        if self._armed and self.stopped_by is None and int(trainer.global_step) != self._checked_step:
            self._checked_step = int(trainer.global_step)  # an optimizer step ended here
            self._stop_if_signalled(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # validation inside training runs at an optimizer step's end on every rank: a signal during it stops there
        if self._armed and self.stopped_by is None and not trainer.sanity_checking:
            self._stop_if_signalled(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._received:  # no stop under way: a signal now is the previous handler's (teardown sets it back)
            self._armed = False
        self._save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning sets back the handlers it found at the fit's start (these) and calls no teardown hook after an
        # exception: from now on they answer as the handlers they replaced
        self._armed = False
        if isinstance(exception, SIGTERMException) or (
                isinstance(exception, KeyboardInterrupt) and int(trainer.world_size) == 1):
            self._save(trainer)

    def state_dict(self) -> dict[str, str]:
        return {"last_model_path": self.last_model_path}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        self.last_model_path = str(state_dict.get("last_model_path", ""))
