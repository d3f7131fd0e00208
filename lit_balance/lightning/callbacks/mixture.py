"""MixtureMonitor: each mixture component's real and supervised tokens in every optimizer step, per rank and in all."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_bool, check_int
from lit_balance.lightning.callbacks._common import emit, gather, mixture_sampler, row_tokens
from lit_balance.lightning.metrics import ComponentTokens

__all__ = ["MixtureMonitor", "component_keys"]


def component_keys(names: Any, num_replicas: int | None = None) -> list[str]:
    """The keys :class:`MixtureMonitor` logs for components ``names``: global keys, then with ``num_replicas`` the
    per-rank keys (rank by rank).

    Example:
        >>> component_keys(["web"], 2)  # doctest: +NORMALIZE_WHITESPACE
        ['train/tokens/web', 'train/supervised_tokens/web', 'train/share/web', 'train/target/web',
         'train/tokens/web_rank0', 'train/supervised_tokens/web_rank0', 'train/tokens/web_rank1',
         'train/supervised_tokens/web_rank1']
    """
    keys = [f"train/{kind}/{name}" for name in names for kind in ("tokens", "supervised_tokens", "share", "target")]
    for r in range(num_replicas or 0):
        keys += [f"train/{kind}/{name}_rank{r}" for name in names for kind in ("tokens", "supervised_tokens")]
    return keys


class MixtureMonitor(L.Callback):
    """Log, for every optimizer step, each mixture component's real and supervised tokens, per rank and over all ranks.

    Active when the training loader's sampler is a mixture's
    (:class:`~lit_balance.sampler.mixture.MixtureBatchSampler`, e.g. from
    :class:`~lit_balance.BalancedTextDataModule` on a :class:`~lit_balance.Mixture`); for a single corpus it logs
    nothing and takes part in no collective.

    Every rank attributes each real row of its training micro-batches (fill rows left out) to its component through
    the sampler's ``component_of`` (the batch's ``indices``) and counts its tokens from the batch's own keys
    (:func:`~lit_balance.lightning.callbacks._common.row_tokens`: rows of a padded batch, documents of a packed row,
    so packing is exact) in a :class:`~lit_balance.lightning.metrics.ComponentTokens` (reading the batch's
    ``indices``, labels and masks once per micro-batch: on a GPU, one synchronisation). The micro-batches of one
    optimizer step (``accumulate_grad_batches`` of them, whatever value is in force) add up to that step's counts. The
    sampler is looked up at each micro-batch (a fit resumed mid-epoch, where Lightning skips ``on_train_epoch_start``,
    logs its steps too; a run stopped by an exception logs the steps gathered before it).
    Every ``log_every_n_steps`` optimizer steps (the same steps on every rank), at the end of each training epoch and
    of training, and when a checkpoint is saved (``on_save_checkpoint``, on every rank: the steps a checkpoint holds
    are in the metrics file before it is used, also when training is stopped by a signal or fails after the save), the
    data-parallel ranks take part in one ``all_gather`` of the steps since the last one, and global
    rank 0 logs each step's figures at that step (Lightning's ``global_step`` at the start of the step's micro-batches,
    the step the loss of that step is logged at), for every component ``<name>``:

    * ``train/tokens/<name>``: real tokens of the component in the step, all ranks (a sum).
    * ``train/supervised_tokens/<name>``: its tokens with a next-token target (labels other than -100), all ranks.
    * ``train/share/<name>``: its share of the step's units over all ranks, in the mixture's ``unit`` (real tokens,
      supervised tokens or documents): a ratio of sums, comparable with the component's target share.
    * ``train/target/<name>``: the component's target share for that step: under a weight schedule
      (``MixtureBatchSampler(weights_schedule=...)``) the share the schedule gives the step (a schedule in optimizer
      steps: its weights at Lightning's ``global_step`` of the step, normalised; in tokens: the step's scheduled
      share as the sampler planned it, :meth:`~lit_balance.sampler.mixture.MixtureBatchSampler.step_targets`), else
      the mixture's share.
    * ``train/tokens/<name>_rank{r}``, ``train/supervised_tokens/<name>_rank{r}``: the same on rank ``r`` (with
      ``per_rank=True``).

    Args:
        log_every_n_steps: optimizer steps between gathers (each gather logs every step since the previous one);
            None (default) falls back to the Trainer's ``log_every_n_steps``.
        per_rank: also log each rank's counts.

    Attributes:
        names: the components' names (empty for a single corpus).
        targets: float64 ``[num_components]``: the mixture's target shares (under a weight schedule, the last
            logged step's scheduled shares).
        last_metrics: the last step's logged values (the same on every rank), what the progress bar shows.

    Raises:
        TypeError: ``log_every_n_steps`` neither an int nor None, ``per_rank`` not a bool; a training batch that is not
            a dict.
        ValueError: ``log_every_n_steps < 1``.
        KeyError: a mixture's training batch without ``indices``, ``is_fill``, ``labels``, ``num_real_tokens`` and
            ``attention_mask`` (padded) or ``cu_seq_lens_q`` (packed).

    Example:
        >>> trainer = L.Trainer(callbacks=[MixtureMonitor(log_every_n_steps=10)], logger=False)
    """

    def __init__(self, log_every_n_steps: int | None = None, per_rank: bool = True) -> None:
        if log_every_n_steps is not None:
            log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 1,
                                          "set the optimizer steps between gathers, or None for the Trainer's "
                                          "log_every_n_steps")
        self.log_every_n_steps = log_every_n_steps
        self.per_rank = check_bool("per_rank", per_rank)
        self.names: tuple[str, ...] = ()
        self.targets = np.zeros(0)
        self.last_metrics: dict[str, float] = {}
        self._sampler: Any = None
        self._metric: ComponentTokens | None = None
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, [3, num_components]) of steps not yet gathered
        self._step = 0
        self._planned: tuple[int, np.ndarray] | None = None
        self._counted = False  # the current step has micro-batches

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer)  # the loader may be rebuilt every epoch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._sampler is None or self._sampler is not mixture_sampler(trainer):
            self._attach(trainer)  # a fit resumed mid-epoch has no on_train_epoch_start
        self._step = int(trainer.global_step)

    def _attach(self, trainer: L.Trainer) -> None:
        """Follow the training loader's sampler: a mixture's (the counts of a step in progress kept), or none."""
        sampler = mixture_sampler(trainer)
        self._sampler = sampler
        if sampler is None:
            self.names, self._metric = (), None
            return
        names = tuple(sampler.mixture.names)
        if names != self.names or self._metric is None:
            self._metric = ComponentTokens(len(names), unit=sampler.mixture.unit, sync_on_compute=False)
        self.names = names
        self.targets = np.asarray(sampler.mixture.shares, dtype=np.float64)
        self._planned = None  # a schedule in tokens: (first optimizer step of the epoch's planned steps, targets)
        schedule = sampler.weights_schedule
        if schedule is not None and schedule.unit != "steps":
            planned = sampler.step_targets()
            acc = max(int(sampler.settings.accumulate_grad_batches), 1)
            epoch_steps = -(-len(sampler) // acc)  # counted from the epoch's start, also after a resume
            first = int(sampler.schedule_start()[0]) + epoch_steps - len(planned)  # a resumed epoch plans its rest
            self._planned = (first, np.asarray(planned, dtype=np.float64))

    def _target(self, step: int) -> np.ndarray | None:
        """The components' target shares of optimizer step ``step`` of the run (None where a schedule in tokens has
        no planned step there)."""
        schedule = None if self._sampler is None else self._sampler.weights_schedule
        if schedule is None:
            return self.targets
        if schedule.unit == "steps":
            weights = np.asarray(schedule.vector_at(step, self.names), dtype=np.float64)
            return weights / weights.sum()
        first, planned = self._planned
        return planned[step - first] if 0 <= step - first < len(planned) else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._metric is None:
            return
        indices, real, supervised = row_tokens(batch, "MixtureMonitor")
        self._metric.update(self._sampler.component_of(indices), real, supervised)
        self._counted = True
        if int(trainer.global_step) != self._step:  # this micro-batch ended an optimizer step
            self._end_step()
            every = self.log_every_n_steps or max(int(trainer.log_every_n_steps), 1)
            if len(self._pending) >= every:
                self._log(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flush(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flush(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # every rank takes part in a save (Trainer.save_checkpoint): the figures of every step the checkpoint holds
        # are logged and written now, whatever happens after it (a stop by a signal, a failure before the end)
        if self._metric is None or not self._pending:
            return
        self._log(trainer)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()

    def _flush(self, trainer: L.Trainer) -> None:
        if self._metric is None:
            return
        if self._counted:  # micro-batches whose step did not end (an epoch that ends inside a step)
            self._end_step()
        if self._pending:
            self._log(trainer)

    def _end_step(self) -> None:
        m = self._metric
        self._pending.append((self._step, torch.stack([m.real_tokens, m.supervised_tokens, m.documents]).cpu()))
        m.reset()
        self._counted = False

    def _log(self, trainer: L.Trainer) -> None:
        steps = [step for step, _ in self._pending]
        local = torch.stack([counts for _, counts in self._pending]).to(torch.float64)  # [steps, 3, components]
        self._pending = []
        g = gather(trainer, local)  # [ranks, steps, 3, components]
        unit = ("tokens", "supervised_tokens", "documents").index(self._metric.unit)
        for i, step in enumerate(steps):
            per_rank = g[:, i]  # [ranks, 3, components]
            total = per_rank.sum(dim=0)
            units = float(total[unit].sum())
            metrics: dict[str, float] = {}
            target = self._target(step)
            if target is not None:
                self.targets = target
            for c, name in enumerate(self.names):
                metrics[f"train/tokens/{name}"] = float(total[0, c])
                metrics[f"train/supervised_tokens/{name}"] = float(total[1, c])
                metrics[f"train/share/{name}"] = float(total[unit, c]) / units if units > 0 else 0.0
                if target is not None:
                    metrics[f"train/target/{name}"] = float(target[c])
            if self.per_rank:
                for r in range(per_rank.shape[0]):
                    for c, name in enumerate(self.names):
                        metrics[f"train/tokens/{name}_rank{r}"] = float(per_rank[r, 0, c])
                        metrics[f"train/supervised_tokens/{name}_rank{r}"] = float(per_rank[r, 1, c])
            self.last_metrics = metrics
            emit(trainer, metrics, step=step)
