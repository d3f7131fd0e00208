"""Lightning's fit-loop count of consumed micro-batches, for a :class:`~lit_balance.BalancedDataLoader` that a
``Trainer`` iterates, read through the Trainer's public attributes (no Lightning import here).

A :class:`~lit_balance.BalancedDataLoader` saves the sampler's position at the micro-batches training consumed. Under
``Trainer.fit`` the right count is the fit loop's (:func:`fit_batches_consumed`): after a training step raised, the
checkpoint ``OnExceptionCheckpoint`` writes must count that micro-batch as not done, which the loader alone cannot
tell. The ``Trainer`` is handed to the loader explicitly (``balanced_dataloader(..., trainer=self.trainer)`` in a
``train_dataloader`` hook; :class:`~lit_balance.BalancedTextDataModule` passes its own count): when the loader's
iterator is created for training in that fit (:func:`fitting`), the loader counts with :class:`FitCount`. Nothing is
registered with Lightning and no caller is searched for.
"""

from __future__ import annotations

import weakref
from typing import Any

from lit_balance.errors import InputValueError

__all__ = ["FitCount", "fit_batches_consumed", "fitting"]


def _batches_done_on_restore(progress: Any) -> int:
    """Micro-batches of the current epoch that Lightning's fit loop counts as done when it restores ``progress``.

    ``progress`` is ``trainer.fit_loop.epoch_loop.batch_progress`` at save time. On restore, Lightning 2.x
    (``_TrainingEpochLoop.reset``) restarts from ``current.completed``, plus the batch of a checkpoint saved in
    ``on_train_batch_end`` (``ready == started == processed == completed + 1``: the step ran, its end hook did
    not count yet). ``ready`` also counts a batch whose training step raised (an exception, Ctrl-C): that one
    runs again.
    """
    total, current = progress.total, progress.current
    done = int(current.completed)
    if total.ready == total.started == total.processed == total.completed + 1:
        done += 1
    return done


def fit_batches_consumed(trainer: Any) -> int | None:
    """Training micro-batches of the current epoch that Lightning counts as done if a checkpoint is saved now.

    The count a resume state must hold (``BalancedBatchSampler.state_dict(batches_consumed=...)``): Lightning restores
    a mid-epoch checkpoint at its fit loop's *completed* batches, plus the batch of a checkpoint saved in
    ``on_train_batch_end``; a micro-batch whose training step raised (an exception, Ctrl-C, then
    ``OnExceptionCheckpoint``) is not done and runs again. :class:`~lit_balance.BalancedTextDataModule` saves its
    sampler's position at this count, and so does a :class:`~lit_balance.BalancedDataLoader` that a fit iterates.

    Args:
        trainer: the ``lightning.Trainer`` (or ``pytorch_lightning.Trainer``).

    Returns:
        Micro-batches counted from the epoch's start, or None when the trainer is not fitting (no count applies).
    """
    if trainer is None or trainer.state.fn != "fit":  # also while validating inside fit
        return None
    return _batches_done_on_restore(trainer.fit_loop.epoch_loop.batch_progress)


def fitting(trainer: Any) -> bool:
    """Whether ``trainer`` (a ``lightning.Trainer`` or ``pytorch_lightning.Trainer``) is in the training stage of a
    fit: the time a training loader's iterator is created (not validation inside the fit, not another stage)."""
    return trainer.state.fn == "fit" and bool(trainer.training)


class FitCount:
    """The fit loop's count for one training loader of a fit: a function of no argument (None once the trainer is
    gone or not fitting).

    Args:
        trainer: the fitting ``Trainer``.
        loader: the loader the fit iterates.

    Raises:
        ValueError: from :meth:`check`, when the fit's batches per epoch are more than ``loader``'s micro-batches.
    """

    def __init__(self, trainer: Any, loader: Any) -> None:
        self._trainer, self._loader = weakref.ref(trainer), weakref.ref(loader)

    def __call__(self) -> int | None:
        return fit_batches_consumed(self._trainer())

    def check(self) -> None:
        """Refuse a fit whose batch count is not this loader's: one that runs more batches per epoch than the loader
        holds (a ``CombinedLoader`` of mode ``max_size_cycle``, ``max_size`` or ``sequential`` beside other loaders:
        Lightning's count then runs past this loader's end, or restarts it). Called at the loader's first
        micro-batch, before its training step."""
        trainer, loader = self._trainer(), self._loader()
        batches = None if trainer is None or loader is None else trainer.num_training_batches
        if batches is None or batches <= len(loader):
            return
        raise InputValueError(
            f"a BalancedDataLoader of {len(loader)} micro-batches is one of the training loaders of a fit of "
            f"{batches} batches per epoch: Lightning counts the combined batches (a CombinedLoader in mode "
            "'max_size_cycle', the mode of a list or dict of loaders, 'max_size' or 'sequential'), which run past "
            "this loader's end, so no checkpoint could resume it exactly. Combine the loaders with "
            "CombinedLoader(loaders, mode='min_size') (each then resumes exactly), or plan one BalancedBatchSampler "
            "over the corpora together", parameter="train_dataloader")
