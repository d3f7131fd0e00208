"""What the training benchmarks share: the documents and model of a run, its Trainer, a model hook, a metrics
callback, and the figures of a run.

:func:`corpus_documents` picks a run's documents of the built-in corpus; :data:`MODEL_SIZES` names the model;
:func:`make_trainer` is the Trainer every run trains with; :class:`CompareLM` records each optimizer step's loss and
the exact validation loss (and can slow one rank down, a demonstration of a slower device); :class:`Meter` records
every micro-batch's trace row (:data:`TRACE_FIELDS`: times, real tokens, padded slots, rows, attention pairs) on
every rank and gathers them once at the end; :func:`run_stats` and :func:`loss_curve` turn the records into the
figures of ``research/compare_strategies.py`` and ``research/packed_vs_padded.py``.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_balance.callbacks import backward_is_local
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer
from lit_balance.demo import DemoTransformerLM

__all__ = ["MODEL_SIZES", "REAL", "TRACE_FIELDS", "CompareLM", "Meter", "corpus_documents", "loss_curve",
           "make_trainer", "real_tokens", "run_stats", "split_documents", "trace_shape"]

#: DemoTransformerLM sizes: ``small`` is the main job's model (4.3M parameters with the 30,522-token vocabulary),
#: ``bert`` BERT-base's shape (about 110M), ``tiny`` for tests.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 32, "num_heads": 2, "num_layers": 1, "dim_feedforward": 64},
    "small": {"d_model": 128, "num_heads": 4, "num_layers": 2, "dim_feedforward": 512},
    "bert": {"d_model": 768, "num_heads": 12, "num_layers": 12, "dim_feedforward": 3072},
}


def split_documents(num_docs: int, val_fraction: float, num_train: int | None, seed: int = 0) -> tuple[np.ndarray,
                                                                                                       np.ndarray]:
    """``(train_docs, val_docs)``: a seeded split of corpus documents, the same for every strategy and run.

    Args:
        num_docs: documents in the corpus.
        val_fraction: share held out for validation (at least one document).
        num_train: keep this many training documents (a seeded subset), or None for all.
        seed: data seed (independent of the run's seed, so every run sees the same documents).

    Returns:
        Sorted document indices, int64 ``[train]`` and ``[validation]``.

    Raises:
        ValueError: nothing left for training, or ``num_train < 1``.
    """
    perm = np.random.default_rng([seed, 0xC0]).permutation(num_docs)
    num_val = max(1, round(val_fraction * num_docs))
    train = perm[num_val:]
    if num_train is not None:
        if num_train < 1:
            raise ValueError(f"num_train must be >= 1, got {num_train}")
        train = train[:num_train]
    if train.size == 0:
        raise ValueError(f"{num_docs} documents, val_fraction={val_fraction}: none left to train on")
    return np.sort(train), np.sort(perm[:num_val])


def corpus_documents(num_train: int | None, val_fraction: float, cache_dir: str | None,
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids (int32, untruncated) of the training and validation documents of :func:`split_documents` of the
    built-in corpus (Python standard-library docstrings, BERT-uncased WordPiece), tokenized into ``cache_dir``
    (None: lit_balance's default cache)."""
    corpus = load_or_build(resolve_corpus(None), resolve_tokenizer(None), cache_dir)
    train, val = split_documents(len(corpus), val_fraction, num_train)
    return [corpus.document(d) for d in train], [corpus.document(d) for d in val]


def make_trainer(spec: dict[str, Any], callbacks: list[L.Callback], accumulate_grad_batches: int = 1) -> L.Trainer:
    """The Trainer of one run: ``spec``'s ``accelerator``, ``devices``, ``precision`` (default ``"32-true"``) and
    ``epochs`` under DDP (collective timeout ``ddp_timeout_s``), validating once after the last epoch, the train
    loader reloaded every epoch (rank speeds handed to a sampler can lengthen an epoch), no logger, checkpoint or
    progress bar."""
    return L.Trainer(
        accelerator=spec["accelerator"], devices=spec["devices"], precision=spec.get("precision", "32-true"),
        strategy=DDPStrategy(timeout=timedelta(seconds=spec["ddp_timeout_s"])), max_epochs=spec["epochs"],
        accumulate_grad_batches=accumulate_grad_batches, callbacks=callbacks, use_distributed_sampler=False,
        reload_dataloaders_every_n_epochs=1, check_val_every_n_epoch=spec["epochs"], num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _spin(seconds: float) -> None:
    """Wait ``seconds`` the way a slower device keeps its host waiting: asleep (a device computes without the host's
    CPU, and on a machine whose cores the ranks share, spinning would take a core from the other ranks), the last
    millisecond busy so the scheduler's wake-up delay does not lengthen the wait."""
    until = time.perf_counter() + seconds
    if seconds > 2e-3:
        time.sleep(seconds - 1e-3)
    while time.perf_counter() < until:
        pass


class CompareLM(DemoTransformerLM):
    """DemoTransformerLM that records each optimizer step's loss and the exact validation loss; optionally slowed.

    The validation loss is the demo model's own (:class:`lit_balance.lightning.TokenMeanLoss`: the mean over every
    validation token of all ranks), read once per validation.

    Args:
        slow_rank: the rank slowed down by the demo-only hook, or None.
        slowdown: extra share of its own compute time that rank waits (0.5: 1.5x): forward+loss, backward
            (the step's last backward without its wait for the other ranks' gradients) and the parameter update.
        **kwargs: :class:`lit_balance.demo.DemoTransformerLM` arguments.
    """

    def __init__(self, slow_rank: int | None = None, slowdown: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_rank, self.slowdown = slow_rank, float(slowdown)
        #: ``(micro-batches trained so far on this rank, global step loss)`` per optimizer step.
        self.step_losses: list[tuple[int, float]] = []
        #: ``(epoch, micro-batches trained so far, validation loss)`` per validation.
        self.val_losses: list[tuple[int, int, float]] = []
        self.micro_batches = 0
        self._forward_s = self._forward_sum = self._backward_sum = 0.0

    def _slowed(self) -> bool:
        return self.slow_rank is not None and self.slowdown > 0 and self.global_rank == self.slow_rank

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        loss = super().training_step(batch, batch_idx)  # no collective inside (the plan's loss divisor)
        self._forward_s = time.perf_counter() - start
        if self._slowed():
            _spin(self.slowdown * self._forward_s)
        self.micro_batches += 1
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # the slowed rank's extra backward time lands inside backward, where a slower device spends it (and where
        # StragglerMonitor's local-backward interval, on_before_backward -> on_after_backward, sees it)
        start = time.perf_counter()
        super().backward(loss, *args, **kwargs)
        if not self._slowed():
            return
        elapsed = time.perf_counter() - start
        if backward_is_local(self.trainer):
            # inside no_sync: all compute; learn this rank's backward/forward ratio
            self._backward_sum += elapsed
            self._forward_sum += self._forward_s
        elif self._forward_sum > 0:
            # the step's last backward also waits for the other ranks' gradients (DDP all-reduce); a slower device
            # computes longer but does not wait longer, so only its own compute, estimated from the ratio, is slowed
            elapsed = min(elapsed, self._forward_s * self._backward_sum / self._forward_sum)
        _spin(self.slowdown * elapsed)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if not self._slowed():
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        marks: list[float] = []

        def closure() -> Any:  # forward, backward, then Lightning's on_before_optimizer_step (a collective)
            out = optimizer_closure()
            marks.append(time.perf_counter())
            return out

        optimizer.step(closure=closure)
        if marks:  # the parameter update after the closure, slowed like the rest of this rank's compute
            _spin(self.slowdown * (time.perf_counter() - marks[-1]))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # kept, not logged (no logger in a run); a Python float (finish_step's value is already on the CPU): keeping
        # a small tensor per step would pin freed heap memory between the large activation buffers and inflate the
        # process's RSS step by step
        self.step_losses.append((self.micro_batches, float(self.step_loss.finish_step(self))))

    def on_validation_epoch_end(self) -> None:
        # every rank takes part in the metric's sum over ranks; Lightning's own compute then reuses the value
        self.val_losses.append((int(self.current_epoch), self.micro_batches, float(self.val_loss.compute())))


def real_tokens(batch: dict[str, Any]) -> int:
    """Real tokens of a micro-batch's documents, fill documents excluded: padded (``attention_mask``) or packed
    (segments of ``cu_seq_lens_q``, the row's tail padding taken off the last one)."""
    if "cu_seq_lens_q" in batch:
        lengths = (batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).long()
        lengths[-1] -= int(batch["num_padded_tokens"]) - int(batch["num_real_tokens"])
        return int(lengths[~batch["is_fill"]].sum())
    return int(batch["attention_mask"][~batch["is_fill"]].sum())


#: Columns of a run's micro-batch trace, float64 ``[world_size, micro-batches, len(TRACE_FIELDS)]``, one row per
#: training micro-batch of each rank in the order it ran: ``epoch``; ``step`` (the optimizer step it belongs to, 0-based
#: over the run); ``start_s`` and ``end_s`` (``time.perf_counter()`` at ``on_train_batch_start`` and
#: ``on_train_batch_end``, seconds; comparable between ranks of one machine only); ``compute_s`` (forward + loss, s);
#: ``real_tokens`` (fill documents excluded); ``padded_slots`` (token positions the model computes: rows x padded
#: length, or the packed row's length with its tail padding); ``rows`` (sequences attended over: padded rows, or the
#: documents of a packed row, fills included); ``attention_pairs`` (sum over those sequences of length squared:
#: rows x padded length**2 padded, sum of document length**2 packed). The time model (``research/time_model.py``)
#: is fitted on these columns.
TRACE_FIELDS = ("epoch", "step", "start_s", "end_s", "compute_s", "real_tokens", "padded_slots", "rows",
                "attention_pairs")

# Columns of :attr:`Meter.gathered` (what :func:`run_stats` reads): a view of the trace's columns.
_EPOCH, _STEP, _COMPUTE, REAL, _PADDED = range(5)
_GATHERED_COLUMNS = [TRACE_FIELDS.index(f) for f in ("epoch", "step", "compute_s", "real_tokens", "padded_slots")]


def trace_shape(batch: dict[str, Any]) -> tuple[int, int]:
    """``(rows, attention_pairs)`` of a micro-batch, the :data:`TRACE_FIELDS` columns of that name.

    Padded (``attention_mask`` ``[B, T]``): ``(B, B * T**2)``, the padded length being the input's sequence
    dimension. Packed (one row, ``cu_seq_lens_q`` ``[D + 1]``): ``(D, sum of segment length**2)``, the segments of
    ``cu_seq_lens_q`` (fill documents included; a tail padding belongs to the last segment).

    Example:
        >>> import torch
        >>> trace_shape({"input_ids": torch.zeros(3, 8, dtype=torch.long)})
        (3, 192)
        >>> trace_shape({"input_ids": torch.zeros(1, 6, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 2, 6])})
        (2, 20)
    """
    if "cu_seq_lens_q" in batch:
        segments = (batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).long()
        return int(segments.numel()), int((segments * segments).sum())
    rows, length = batch["input_ids"].shape
    return int(rows), int(rows) * int(length) ** 2


class Meter(L.Callback):
    """Per rank, per training micro-batch: one row of :data:`TRACE_FIELDS`; gathered from every rank at the end.

    Compute is ``on_train_batch_start`` -> ``on_before_backward`` (forward + loss; CUDA synchronized), the interval
    of :class:`lit_balance.callbacks.StragglerMonitor`, which holds no collective. ``step`` is
    ``trainer.global_step`` at ``on_train_batch_start``: the 0-based optimizer step over the run the micro-batch
    belongs to. Each epoch's training interval is this rank's first ``on_train_batch_start`` to its last
    ``on_train_batch_end`` (validation runs after it). Real tokens exclude fill rows (:func:`real_tokens`; padded or
    packed batches); ``rows`` and ``attention_pairs``: :func:`trace_shape`. At ``on_train_end`` every rank takes
    part in one ``all_gather``; afterwards :attr:`trace` (float64 ``[world_size, n, len(TRACE_FIELDS)]``),
    :attr:`gathered` (``[world_size, n, 5]``: epoch, step, compute s, real tokens, padded slots; what
    :func:`run_stats` reads), :attr:`epoch_intervals` (``[world_size, epochs, 2]``) and :attr:`peak_memory_mb`
    (``[world_size]``) are set on every rank.

    Raises:
        RuntimeError: at ``on_train_end``, ranks ran different numbers of micro-batches.
    """

    def __init__(self) -> None:
        self.records: list[list[float]] = []
        self.intervals: dict[int, list[float]] = {}
        #: ``{epoch: the rank speeds the training sampler planned that epoch with, or None}`` (lit_balance).
        self.planned_speeds: dict[int, list[float] | None] = {}
        self._start = 0.0
        self._step = 0
        self._compute: float | None = None
        self.trace: np.ndarray | None = None
        self.gathered: np.ndarray | None = None
        self.epoch_intervals: np.ndarray | None = None
        self.peak_memory_mb: np.ndarray | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        speeds = getattr(getattr(trainer.train_dataloader, "sampler", None), "rank_speeds", None)
        self.planned_speeds[trainer.current_epoch] = None if speeds is None else [float(v) for v in speeds]

    @staticmethod
    def _now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = self._now(pl_module)
        self._compute = None
        self.intervals.setdefault(trainer.current_epoch, [self._start, self._start])
        self._step = trainer.global_step

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._compute is None:
            self._compute = self._now(pl_module) - self._start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self._now(pl_module)
        compute = self._compute if self._compute is not None else end - self._start
        rows, pairs = trace_shape(batch)
        self.records.append([trainer.current_epoch, self._step, self._start, end, compute, real_tokens(batch),
                             int(batch["num_padded_tokens"]), rows, pairs])
        self.intervals[trainer.current_epoch][1] = end

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        else:  # ru_maxrss: KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
        width = len(TRACE_FIELDS)
        epochs = sorted(self.intervals)
        head = [peak, len(self.records)] + [0.0] * (width - 2)
        local = torch.tensor([head, *self.records, *[[e, *self.intervals[e]] + [0.0] * (width - 3) for e in epochs]],
                             dtype=torch.float64)
        if trainer.world_size > 1:
            out = trainer.strategy.all_gather(local.to(pl_module.device)).cpu().numpy()
        else:
            out = local.numpy()[None]
        n = len(self.records)
        if not (out[:, 0, 1] == n).all():
            raise RuntimeError(f"ranks ran different numbers of training micro-batches: {out[:, 0, 1].tolist()}")
        self.peak_memory_mb = out[:, 0, 0]
        self.trace = out[:, 1:1 + n]
        self.gathered = self.trace[:, :, _GATHERED_COLUMNS]
        self.epoch_intervals = out[:, 1 + n:, 1:3]


def _median_ratio(values: np.ndarray) -> float:
    median = float(np.median(values))
    return float(values.max()) / median if median > 0 else 1.0


def run_stats(gathered: np.ndarray, epoch_intervals: np.ndarray, peak_memory_mb: np.ndarray, max_tokens: int,
              headline_from_epoch: int = 1) -> dict[str, Any]:
    """Throughput, padding, straggler and memory figures of one run from the gathered per-micro-batch records.

    Args:
        gathered: float ``[world_size, n, 5]`` (epoch, optimizer step, compute s, real tokens, padded slots) per
            micro-batch and rank; every rank ran the same ``n`` micro-batches.
        epoch_intervals: float ``[world_size, epochs, 2]``: each rank's first batch start and last batch end, s.
        peak_memory_mb: ``[world_size]`` peak memory per rank, MiB.
        max_tokens: the budget, padded slots per micro-batch per rank.
        headline_from_epoch: the headline throughput counts epochs from this one on (all epochs if there are none).

    Returns:
        A dict of the figures documented in the docstring of ``research/compare_strategies.py``.
    """
    g = np.asarray(gathered, dtype=np.float64)
    epochs = g[0, :, _EPOCH].astype(int)
    seconds = (epoch_intervals[:, :, 1] - epoch_intervals[:, :, 0]).max(axis=0)  # slowest rank per epoch
    real_per_epoch = np.bincount(epochs, weights=g[:, :, REAL].sum(axis=0), minlength=seconds.shape[0])
    steps = g[0, :, _STEP].astype(int)
    steps_per_epoch = np.array([np.unique(steps[epochs == e]).size for e in range(seconds.shape[0])])
    head = np.arange(seconds.shape[0]) >= headline_from_epoch
    if not head.any():
        head[:] = True
    compute = g[:, :, _COMPUTE]
    step_sums = np.zeros((g.shape[0], int(steps.max()) + 1))
    np.add.at(step_sums, (slice(None), steps), compute)
    step_med = np.median(step_sums, axis=0)
    padded = g[:, :, _PADDED]
    return {
        "real_tokens_per_s": float(real_per_epoch[head].sum() / seconds[head].sum()),
        "real_tokens_per_s_all_epochs": float(real_per_epoch.sum() / seconds.sum()),
        "optimizer_steps_per_s": float(steps_per_epoch[head].sum() / seconds[head].sum()),
        "headline_epochs": [int(e) for e in np.flatnonzero(head)],
        "epoch_train_s": [float(s) for s in seconds],
        "epoch_real_tokens_per_s": [float(t / s) for t, s in zip(real_per_epoch, seconds)],
        "real_tokens_per_epoch": [round(float(t)) for t in real_per_epoch],
        "padding_ratio": float(1.0 - g[:, :, REAL].sum() / padded.sum()),
        "straggler_ratio": _median_ratio(compute.sum(axis=1)),
        "step_straggler_ratio": float(step_sums.max(axis=0).sum() / step_med.sum()) if step_med.sum() > 0 else 1.0,
        "compute_s_per_rank": [float(c) for c in compute.sum(axis=1)],
        "compute_s_per_padded_slot_per_rank": [float(c / p) for c, p in zip(compute.sum(axis=1), padded.sum(axis=1))],
        "peak_memory_mb": float(np.max(peak_memory_mb)),
        "peak_memory_mb_per_rank": [float(m) for m in peak_memory_mb],
        "train_real_tokens": int(g[:, :, REAL].sum()),
        "train_padded_slots": int(padded.sum()),
        "micro_batches_per_rank": int(g.shape[1]),
        "optimizer_steps": int(np.unique(steps).size),
        "real_tokens_per_optimizer_step": float(g[:, :, REAL].sum() / max(np.unique(steps).size, 1)),
        "max_micro_batch_slots": int(padded.max()),
        "over_budget_micro_batches": int((padded > max_tokens).sum()),
    }


def loss_curve(step_losses: Sequence[tuple[int, float]], gathered: np.ndarray) -> tuple[list[float], list[float]]:
    """``(tokens, losses)``: each optimizer step's loss against the global real tokens trained up to it.

    Args:
        step_losses: ``(micro-batches trained so far, loss)`` per optimizer step.
        gathered: see :func:`run_stats`.
    """
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(gathered)[:, :, REAL].sum(axis=0))])
    return [float(cum[m]) for m, _ in step_losses], [float(v) for _, v in step_losses]
