"""Which :class:`~lit_balance.BalancedBatchSampler` a ``Trainer`` trains from: handed to it explicitly, never guessed
from its loader (no Lightning import here).

The callbacks that read the training sampler's plan, cost model or mixture (``StragglerMonitor``,
``CostModelFeedback``, ``AdaptiveGradAccumulation``, ``LedgerCheck``, ``MixtureMonitor``, ``RunSummary``) and
:class:`~lit_balance.StepTokenLoss` ask :func:`training_sampler_of`. The sampler reaches the Trainer in one of three
ways:

* :class:`~lit_balance.BalancedTextDataModule` hands its training sampler over in ``train_dataloader()``;
* a :class:`~lit_balance.BalancedDataLoader` given the Trainer (``balanced_dataloader(..., trainer=self.trainer)``)
  offers its sampler, which counts while the Trainer trains from that loader (a validation loader given the Trainer
  offers its sampler too, and is not the training loader);
* :func:`use_training_sampler` hands one over by hand, e.g. in a ``train_dataloader`` hook that returns a
  ``DataLoader(dataset, sampler=sampler, batch_size=None)`` of one's own.

What was handed over is kept on the Trainer object itself (so it travels with the Trainer to the processes
``strategy="ddp_spawn"`` starts) until something else is handed over.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from lit_balance.errors import InputTypeError
from lit_balance.sampler.sampler import BalancedBatchSampler

__all__ = ["HAND_OVER_ADVICE", "offer_training_loader", "training_loaders", "training_sampler_of",
           "training_stream_of", "use_training_sampler", "use_training_stream"]

#: How to hand a training sampler to a Trainer, for the messages of what needs one.
HAND_OVER_ADVICE = ("train with BalancedTextDataModule, or build the training loader with balanced_dataloader(..., "
                    "trainer=self.trainer), or call lit_balance.use_training_sampler(self.trainer, sampler) in "
                    "train_dataloader()")

_ATTRIBUTE = "_lit_balance_hand_over"


class _HandOver:
    """What a Trainer was handed: a sampler by hand, and the balanced loaders that were given the Trainer."""

    def __init__(self) -> None:
        self.sampler: BalancedBatchSampler | None = None
        self.loaders: list[weakref.ref] = []
        self.stream: str | None = None  # what the Trainer trains from when it is a stream (no plan of the epoch)

    def __getstate__(self) -> dict[str, Any]:  # a weak reference does not pickle; a spawned process builds its loaders
        return {"sampler": self.sampler, "loaders": [], "stream": self.stream}


def _record(trainer: Any, create: bool) -> _HandOver | None:
    record = getattr(trainer, _ATTRIBUTE, None)
    if isinstance(record, _HandOver):
        return record
    if not create:
        return None
    record = _HandOver()
    setattr(trainer, _ATTRIBUTE, record)
    return record


def use_training_sampler(trainer: Any, sampler: BalancedBatchSampler | None) -> None:
    """Hand ``trainer`` the sampler it trains from, for the callbacks and the loss that read it.

    Call it where the training loader is built, e.g. in a ``train_dataloader`` hook that returns a plain
    ``DataLoader(dataset, sampler=sampler, batch_size=None)``; :class:`~lit_balance.BalancedTextDataModule` and
    :func:`~lit_balance.balanced_dataloader` (given ``trainer=``) do it themselves. It takes precedence over a loader's
    offer (:func:`offer_training_loader`) and lasts until the next call; None withdraws it.

    Args:
        trainer: the ``lightning.Trainer`` (or ``pytorch_lightning.Trainer``) that fits with the sampler's loader.
        sampler: the training loader's :class:`~lit_balance.BalancedBatchSampler` (a ``MixtureBatchSampler`` too), or
            None.

    Raises:
        TypeError: ``sampler`` is neither a BalancedBatchSampler nor None.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(train_dataloader=None)  # a Trainer
        >>> sampler = BalancedBatchSampler([3, 5, 2, 7], max_tokens=8, num_replicas=1, rank=0)
        >>> use_training_sampler(trainer, sampler)
        >>> training_sampler_of(trainer) is sampler
        True
    """
    if sampler is not None and not isinstance(sampler, BalancedBatchSampler):
        raise InputTypeError(f"use_training_sampler takes the training loader's lit_balance.BalancedBatchSampler (or "
                             f"None), got {type(sampler).__name__}", parameter="sampler")
    record = _record(trainer, create=True)
    record.sampler, record.stream = sampler, None


def use_training_stream(trainer: Any, description: str) -> None:
    """Tell ``trainer`` that it trains from a stream (``description``, e.g. ``"stream of 3 file(s): ..."``), planned
    window by window: there is no training sampler and no plan of the epoch, and what needs one says so by name
    (:func:`training_stream_of`). :class:`~lit_balance.BalancedTextDataModule` calls it for a stream corpus; it lasts
    until :func:`use_training_sampler` is called.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(train_dataloader=None)
        >>> use_training_stream(trainer, "stream of 1 file(s): a.jsonl")
        >>> training_sampler_of(trainer), training_stream_of(trainer)
        (None, 'stream of 1 file(s): a.jsonl')
    """
    record = _record(trainer, create=True)
    record.sampler, record.stream = None, str(description)


def training_stream_of(trainer: Any) -> str | None:
    """What ``trainer`` trains from when it is a stream (:func:`use_training_stream`), else None."""
    record = _record(trainer, create=False)
    return None if record is None else record.stream


def offer_training_loader(trainer: Any, loader: Any) -> None:
    """Offer ``loader``'s sampler (``loader.balanced_sampler``) as ``trainer``'s training sampler while ``trainer``
    trains from ``loader`` (:func:`training_loaders`); :class:`~lit_balance.BalancedDataLoader` calls it when it is
    given ``trainer=``. The Trainer holds the loader by a weak reference."""
    record = _record(trainer, create=True)
    record.loaders = [ref for ref in record.loaders if ref() is not None] + [weakref.ref(loader)]


def training_loaders(trainer: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader``: one, or a list, tuple or dict of them (nested too); none before
    the Trainer has loaded them."""
    out, todo = [], [trainer.train_dataloader]
    while todo:
        item = todo.pop()
        if isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif item is not None:
            out.append(item)
    return out


def training_sampler_of(trainer: Any) -> BalancedBatchSampler | None:
    """The sampler ``trainer`` trains from, as it was handed over: by :func:`use_training_sampler`, else the sampler of
    an offered loader (:func:`offer_training_loader`) that is one of the Trainer's training loaders; None when
    nothing was handed over (a ``DataLoader`` of another sampler, or one whose sampler nobody handed over).

    The same on every rank when every rank hands over alike (each rank's sampler plans the same epoch).
    """
    record = _record(trainer, create=False)
    if record is None or record.stream is not None:
        return None
    if record.sampler is not None:
        return record.sampler
    offered = [ref() for ref in record.loaders]
    for loader in training_loaders(trainer):
        if any(loader is candidate for candidate in offered):
            return loader.balanced_sampler
    return None
