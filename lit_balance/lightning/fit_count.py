"""Lightning's fit-loop count for every :class:`~lit_balance.BalancedDataLoader` of a fit, with no argument to pass.

A :class:`~lit_balance.BalancedDataLoader` saves the sampler's position at the micro-batches training consumed. Under
``Trainer.fit`` the right count is the fit loop's (:func:`lit_balance.lightning.fit_batches_consumed`): after a training
step raised, the checkpoint ``OnExceptionCheckpoint`` writes must count that micro-batch as not done, which the loader
alone cannot tell. :class:`FitLoopCount` hands the trainer's count to each such loader of ``trainer.train_dataloader``
at the start of training and of every training epoch (after Lightning has built or reloaded the loaders), and takes it
back at ``teardown``. The package registers it with every ``Trainer`` through Lightning's
``lightning.pytorch.callbacks_factory`` entry point (see ``pyproject.toml``), so ``balanced_dataloader(...)`` with
default arguments resumes exactly from any Lightning checkpoint; a ``batches_consumed`` function given to the loader
still takes precedence.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L

from lit_balance.data.loader import BalancedDataLoader
from lit_balance.lightning.datamodule import fit_batches_consumed

__all__ = ["FitLoopCount", "trainer_callbacks"]


def _balanced_loaders(loaders: Any) -> Iterator[BalancedDataLoader]:
    """The :class:`BalancedDataLoader` objects in ``trainer.train_dataloader``: one loader, or a list, tuple or dict of
    them (nested too), as Lightning's ``CombinedLoader`` takes them."""
    if isinstance(loaders, BalancedDataLoader):
        yield loaders
    elif isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from _balanced_loaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _balanced_loaders(value)


class _TrainerCount:
    """A function of no argument: the trainer's :func:`fit_batches_consumed` (None once the trainer is gone)."""

    def __init__(self, trainer: L.Trainer) -> None:
        self._trainer = weakref.ref(trainer)

    def __call__(self) -> int | None:
        trainer = self._trainer()
        return None if trainer is None else fit_batches_consumed(trainer)


class FitLoopCount(L.Callback):
    """Give every :class:`~lit_balance.BalancedDataLoader` of a fit the fit loop's count of consumed micro-batches.

    At ``on_train_start`` and ``on_train_epoch_start`` each such loader of ``trainer.train_dataloader`` takes
    :func:`lit_balance.lightning.fit_batches_consumed` of this trainer as its default count
    (:meth:`~lit_balance.BalancedDataLoader.set_count_source`), so the loader state Lightning saves in a checkpoint
    holds the micro-batches the fit loop counts as done when it restores that checkpoint: a micro-batch whose
    training step raised runs again after a resume from ``OnExceptionCheckpoint``, and one that finished does not.
    ``teardown`` takes the count back (the loaders count for themselves again). Loaders of other kinds are left
    alone.

    Registered with every ``Trainer`` by the ``lightning.pytorch.callbacks_factory`` entry point of the installed
    package (:func:`trainer_callbacks`); adding it by hand is not needed.
    """

    def __init__(self) -> None:
        self._attached: list[weakref.ReferenceType] = []  # the loaders given the count, to take it back at teardown

    def __getstate__(self) -> dict[str, Any]:  # pickled with the Trainer (ddp_spawn): weak references do not pickle
        return {"_attached": []}

    def _attach(self, trainer: L.Trainer) -> None:
        for loader in _balanced_loaders(trainer.train_dataloader):
            loader.set_count_source(_TrainerCount(trainer))
            self._attached.append(weakref.ref(loader))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer)  # loaders reloaded for this epoch (reload_dataloaders_every_n_epochs) too

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for ref in self._attached:
            loader = ref()
            if loader is not None:
                loader.set_count_source(None)
        self._attached = []


def trainer_callbacks() -> list[L.Callback]:
    """The callbacks the package adds to every ``Trainer`` (Lightning's ``lightning.pytorch.callbacks_factory`` entry
    point): :class:`FitLoopCount`."""
    return [FitLoopCount()]
