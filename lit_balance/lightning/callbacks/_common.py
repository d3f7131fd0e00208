"""What the callbacks share: reading batch fields, sending exact values to every logger, gathering over ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance.data.collate import IGNORE_INDEX
from lit_balance.data.training_sampler import HAND_OVER_ADVICE, training_sampler_of, training_stream_of
from lit_balance.errors import InputTypeError
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.world import data_parallel_world


def emit(trainer: L.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` (the same on every rank) to every logger, from rank 0, at ``step``.

    ``step``: Lightning's ``global_step`` at the start of the micro-batch the figures end with, the step that
    micro-batch's ``self.log`` values are logged at (so one optimizer step has one step value in ``metrics.csv``);
    default ``trainer.global_step``. Values go straight to ``Logger.log_metrics`` (not through
    ``LightningModule.log``), so they are logged exactly as computed, whatever the Trainer's ``log_every_n_steps``
    says; they also appear in ``trainer.callback_metrics``.
    """
    if not metrics:
        return
    step = int(trainer.global_step) if step is None else int(step)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=step)
    callback_metrics = trainer.callback_metrics  # Lightning's own dict (the property returns it, updated)
    for k, v in metrics.items():
        callback_metrics[k] = torch.tensor(float(v))


def gather(trainer: L.Trainer, local: torch.Tensor) -> torch.Tensor:
    """All-gather a small tensor over the data-parallel ranks (:func:`lit_balance.world.data_parallel_world`):
    ``[num_replicas, *local.shape]`` on the CPU, by rank."""
    return data_parallel_world(trainer).all_gather(local)


def gather_same_everywhere(trainer: L.Trainer, local: torch.Tensor) -> torch.Tensor:
    """:func:`gather`, made the same on every process: where a replica spans several processes (tensor parallelism),
    each process gathers with its own peers of the other replicas, so global rank 0's result is broadcast to every
    process (one more collective; none under DDP, where the gather already is the same everywhere). Timings differ
    between the processes of a replica; what decides the plan or the accumulation must not."""
    gathered = gather(trainer, local)
    if int(trainer.world_size) <= data_parallel_world(trainer).num_replicas:
        return gathered
    strategy = trainer.strategy
    device = getattr(strategy, "root_device", None)
    out = strategy.broadcast(gathered if device is None else gathered.to(device), src=0)
    return out.cpu()


def train_sampler(trainer: L.Trainer) -> BalancedBatchSampler | None:
    """The training sampler handed to ``trainer`` (:func:`lit_balance.data.training_sampler.training_sampler_of`: by
    the DataModule, a :class:`~lit_balance.BalancedDataLoader` given ``trainer=``, or
    :func:`~lit_balance.use_training_sampler`), or None when none was."""
    return training_sampler_of(trainer)


def needed_sampler(trainer: L.Trainer, owner: str) -> BalancedBatchSampler:
    """:func:`train_sampler`, for a callback that cannot work without it.

    Raises:
        RuntimeError: no training sampler was handed to ``trainer`` (naming ``owner`` and how to hand one over).
    """
    sampler = training_sampler_of(trainer)
    stream = training_stream_of(trainer)
    if sampler is None and stream is not None:
        raise RuntimeError(f"{owner} reads the training sampler's plan of the epoch, and the Trainer trains from a "
                           f"stream ({stream}), planned window by window with no plan of the epoch: remove {owner} "
                           "(docs/streams.md lists the callbacks that work with a stream)")
    if sampler is None:
        raise RuntimeError(f"{owner} reads the training sampler's plan, and no lit_balance.BalancedBatchSampler was "
                           f"handed to the Trainer: {HAND_OVER_ADVICE}, or remove {owner}")
    return sampler


def batch_fields(batch: Any, keys: tuple[str, ...], owner: str) -> list[Any]:
    """``[batch[k] for k in keys]``, or a clear error naming the keys ``owner`` needs and the keys the batch has.

    Raises:
        KeyError: a dict-like batch that lacks some of ``keys``.
        TypeError: a batch that is not dict-like (e.g. a tuple).
    """
    try:
        return [batch[key] for key in keys]
    except (KeyError, TypeError, IndexError):
        if not isinstance(batch, Mapping):
            raise InputTypeError(f"{owner} needs dict training batches with keys {list(keys)}, got a "
                                 f"{type(batch).__name__}; collate with lit_balance.PadCollator, which produces "
                                 "them, or remove the callback") from None
        missing = [key for key in keys if key not in batch]
        if not missing:
            raise
        raise KeyError(f"{owner} needs the training batch keys {list(keys)}, missing {missing}; the batch has "
                       f"keys {sorted(map(str, batch))}; collate with lit_balance.PadCollator, which produces "
                       "them, or remove the callback") from None


def mixture_sampler(trainer: L.Trainer) -> BalancedBatchSampler | None:
    """The training sampler (:func:`train_sampler`) when it blends several components (its ``num_components``; every
    :class:`~lit_balance.BalancedBatchSampler` answers ``mixture``, ``num_components`` and ``component_of``), or None
    for one corpus or when no sampler was handed over. The same on every rank (the same plan)."""
    sampler = training_sampler_of(trainer)
    return sampler if sampler is not None and sampler.num_components > 1 else None


def row_tokens(batch: Any, owner: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real rows of a training micro-batch (fill rows left out): their dataset indices, real tokens and supervised
    tokens, int64 ``[rows]`` each, per rank.

    A padded batch (:class:`lit_balance.PadCollator`): a row's real tokens are its ``attention_mask`` sum, its
    supervised tokens its labels other than -100 after the causal shift (``labels[:, 1:]``). A packed batch
    (:class:`lit_balance.PackedCollator`, one row of documents): a document's real tokens are its segment of
    ``cu_seq_lens_q`` (the last document's segment less the row's tail padding, so that they sum to
    ``num_real_tokens``; a static row's empty segments are not documents), its supervised tokens its labels other than
    -100 in that segment (each document's first label is -100). These are the tokens
    :func:`lit_balance.lightning.loss.token_loss_sum` counts.

    Raises:
        KeyError, TypeError: as :func:`batch_fields` (``indices``, ``is_fill``, ``labels``, ``num_real_tokens`` and
            ``attention_mask`` or ``cu_seq_lens_q``).
    """
    packed = isinstance(batch, Mapping) and "cu_seq_lens_q" in batch
    keys = ("indices", "is_fill", "labels", "num_real_tokens", "cu_seq_lens_q" if packed else "attention_mask")
    indices, is_fill, labels, num_real, layout = batch_fields(batch, keys, owner)
    indices = torch.as_tensor(indices).reshape(-1).cpu().numpy().astype(np.int64)
    rows = indices.size
    supervised_mask = torch.as_tensor(labels) != IGNORE_INDEX
    if packed:
        cu = torch.as_tensor(layout).reshape(-1).cpu().numpy().astype(np.int64)
        real = np.diff(cu)[:rows]
        if rows:
            real[-1] -= int(real.sum()) - int(num_real)  # the tail padding ends the last document's segment
        marks = np.concatenate([[0], torch.cumsum(supervised_mask.reshape(-1).long(), 0).cpu().numpy()])
        supervised = marks[cu[1:rows + 1]] - marks[cu[:rows]]
    else:
        real = torch.as_tensor(layout)[:rows].sum(dim=1).cpu().numpy().astype(np.int64)
        supervised = supervised_mask[:rows, 1:].sum(dim=1).cpu().numpy().astype(np.int64)
    keep = ~torch.as_tensor(is_fill).reshape(-1).cpu().numpy().astype(bool)
    return indices[keep], real[keep], supervised[keep].astype(np.int64)
