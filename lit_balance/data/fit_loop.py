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

__all__ = ["FitCount", "combined_mode", "fit_batches_consumed", "fitting"]


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


def combined_mode(trainer: Any) -> str | None:
    """The mode of the ``CombinedLoader`` a fit iterates (``"max_size_cycle"`` for a list or dict of loaders), or None
    when it cannot be read (Lightning keeps it in ``trainer.fit_loop._combined_loader._mode``, read here because no
    public attribute says it)."""
    mode = getattr(getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None), "_mode", None)
    return mode if isinstance(mode, str) else None


class FitCount:
    """The fit loop's count for one training loader of a fit: a function of no argument (None once the trainer is
    gone or not fitting).

    Beside other training loaders in a ``CombinedLoader`` (Lightning 2.x's modes, ``lightning.pytorch.utilities.
    combined_loader``):

    * ``min_size``: the fit's epoch ends with the shortest loader; this loader's count is the fit's.
    * ``max_size``: a loader that runs out first gives None to the later batches of the epoch; its count stops at
      its own end (``min(fit count, len(loader))``), so a checkpoint taken after it ran out resumes it at its end.
    * ``max_size_cycle`` (also the mode of a list or dict of loaders): a loader that runs out first would be iterated
      again within the epoch; refused by :meth:`check` (at the loader's first micro-batch, before any training step),
      naming ``max_size`` and ``min_size``. A balanced loader that is the longest never restarts: accepted.
    * ``sequential``: refused by Lightning's fit loop itself, before the first batch.

    Args:
        trainer: the fitting ``Trainer``.
        loader: the loader the fit iterates.

    Raises:
        ValueError: from :meth:`check`, when the fit's epoch would restart this loader (``max_size_cycle`` with a
            longer loader beside it, or a mode that cannot be read), naming the mode and the modes that train.
    """

    def __init__(self, trainer: Any, loader: Any) -> None:
        self._trainer, self._loader = weakref.ref(trainer), weakref.ref(loader)
        self._ends_early = False  # max_size beside a longer loader: the count stops at this loader's end

    def __call__(self) -> int | None:
        count = fit_batches_consumed(self._trainer())
        loader = self._loader()
        if count is None or loader is None or not self._ends_early:
            return count
        return min(count, len(loader))

    def ran_out(self) -> bool:
        """Whether this loader ran out before the fit's epoch ends (mode ``max_size``) and the fit counts past it."""
        count, loader = fit_batches_consumed(self._trainer()), self._loader()
        return self._ends_early and count is not None and loader is not None and count >= len(loader)

    def check(self) -> None:
        """Refuse a fit whose epoch would iterate this loader again (see the class docstring). Called at the loader's
        first micro-batch, before its training step."""
        trainer, loader = self._trainer(), self._loader()
        batches = None if trainer is None or loader is None else trainer.num_training_batches
        if batches is None or batches <= len(loader):
            return
        mode = combined_mode(trainer)
        if mode == "max_size":
            self._ends_early = True
            return
        said = f"mode {mode!r}" if mode is not None else "a mode that cannot be read"
        raise InputValueError(
            f"a BalancedDataLoader of {len(loader)} micro-batches is a training loader of a CombinedLoader in {said} "
            f"(the mode of a list or dict of loaders is 'max_size_cycle') whose epoch runs {batches} "
            f"batches: expected at most {len(loader)}, got {batches}: the epoch would start this loader again on the "
            "same plan, training its documents twice, and no checkpoint could resume it exactly. Combine the loaders "
            "with CombinedLoader(loaders, mode='max_size') (this loader gives None once its micro-batches are done, "
            "and resumes exactly) or mode='min_size' (the epoch ends with the shortest loader), or plan one "
            "BalancedBatchSampler over the corpora together (lit_balance.Mixture)", parameter="train_dataloader")
