"""LastStepCheckpoint: the weights and loop state of the last optimizer step, however training ends."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

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
    * when training is interrupted by SIGTERM (Lightning stops every rank at the same micro-batch) and, in a single
      process, by Ctrl-C (``KeyboardInterrupt``); under several processes a Ctrl-C may reach the ranks at different
      places, where a collective save could hang, so it writes nothing then (send SIGTERM to stop a multi-process run
      with a checkpoint).

    Lightning keeps its checkpoint callbacks last, so this one runs after every other callback's ``on_train_end``.
    Beside a :class:`~lightning.pytorch.callbacks.ModelCheckpoint`, pass ``Trainer(callbacks=[ModelCheckpoint(...),
    LastStepCheckpoint()])``: the Trainer adds its default ModelCheckpoint only when no checkpoint callback is given.

    Args:
        dirpath: directory of ``last.ckpt``; default: the first ModelCheckpoint's directory, else
            ``<trainer.log_dir or default_root_dir>/checkpoints``.
        filename: the file's name, ``.ckpt`` added.

    Attributes:
        last_model_path: the file written at the end ("" before), as ModelCheckpoint names it, so that
            :func:`lit_balance.lightning.outputs.run_outputs` lists it.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = "last") -> None:
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.last_model_path = ""
        self._saved_step = -1

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

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps > 0 and trainer.global_step >= max_steps:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) or (
                isinstance(exception, KeyboardInterrupt) and int(trainer.world_size) == 1):
            self._save(trainer)

    def state_dict(self) -> dict[str, str]:
        return {"last_model_path": self.last_model_path}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        self.last_model_path = str(state_dict.get("last_model_path", ""))
