"""TokensPerStepAccumulation: run each optimizer step with the micro-batches a tokens-per-step plan gives it."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np

from lit_balance.data.fit_loop import fit_batches_consumed
from lit_balance.errors import InputValueError
from lit_balance.lightning.callbacks._common import emit
from lit_balance.sampler.step_tokens import TokensPerStepSampler

__all__ = ["TokensPerStepAccumulation", "window_accumulation"]


def window_accumulation(batch_idx: int, start: int, end: int) -> tuple[int, bool]:
    """The ``accumulate_grad_batches`` to set before micro-batch ``batch_idx`` of a step ``[start, end)`` so that
    Lightning zeroes gradients before its first micro-batch only and steps after its last only.

    Lightning 2.6 zeroes before ``batch_idx`` when ``batch_idx % a == 0`` and steps after it when
    ``(batch_idx + 1) % a == 0`` (``training_epoch_loop._accumulated_batches_reached``,
    ``optimization/automatic.py``). So: a step of one micro-batch: 1; its first: ``a = batch_idx`` (``2`` at
    ``batch_idx == 0``), dividing ``batch_idx`` and not ``batch_idx + 1``; its last: ``batch_idx + 1``; between:
    ``batch_idx + 2``, dividing neither. At ``batch_idx == 1`` no ``a >= 2`` divides it: the second value is True and
    the caller zeroes gradients itself.

    Returns:
        ``(accumulate_grad_batches, zero_gradients_here)``.

    Example:
        >>> [window_accumulation(b, 3, 6) for b in range(3, 6)]
        [(3, False), (6, False), (6, False)]
    """
    if end - start == 1:
        return 1, False
    if batch_idx == start:
        if batch_idx == 0:
            return 2, False
        if batch_idx == 1:
            return 3, True
        return batch_idx, False
    if batch_idx == end - 1:
        return batch_idx + 1, False
    return batch_idx + 2, False


class TokensPerStepAccumulation(L.Callback):
    """Make Lightning's optimizer steps those of a :class:`~lit_balance.TokensPerStepSampler`: step ``g`` runs the
    plan's ``step_micro_batches[g]`` micro-batches on every rank, so its global real tokens follow
    ``tokens_per_step_schedule`` (within one document).

    Before each micro-batch it sets ``trainer.accumulate_grad_batches`` to a value for which Lightning zeroes
    gradients before the step's first micro-batch and steps after its last one (:func:`window_accumulation`); the same
    value on every rank, read from the plan. The value also divides the loss Lightning returns;
    :class:`lit_balance.StepTokenLoss` sees this callback (``sets_accumulate_grad_batches``) and takes its all-reduce
    path: each step's gradient is that of the sum of its token losses over all ranks and micro-batches divided by the
    step's supervised tokens. A micro-batch that is not a step's last may run with DDP's gradient all-reduce (an
    all-reduce of the sum so far, which leaves the step's mean unchanged).

    **Checkpoint.** Given the ``sampler``, its position is saved in the callback's state (in every Lightning
    checkpoint: the schedule, the epoch, where it starts in the run, the micro-batches training consumed) and restored
    into the sampler at the resumed fit's start, before Lightning reads the loader's length: the run continues with the
    documents of the uninterrupted run, on another number of ranks too (from a checkpoint at an optimizer step's end),
    and with a schedule edited after the resume step (an edit before it is refused, naming the first differing point).

    Logs, at every optimizer step, ``balance/accumulate_grad_batches`` (micro-batches per rank in that step) and
    ``balance/tokens_per_optimizer_step`` (the plan's global real tokens of that step); :attr:`history` keeps
    ``(epoch, first batch_idx, micro-batches, tokens)`` per step. The Trainer's value is restored at the end of fit.

    Args:
        sampler: the training loader's :class:`~lit_balance.TokensPerStepSampler` (this rank's), whose steps the
            callback applies and whose position it saves and restores.

    Raises:
        RuntimeError: (at fit start) manual optimization; a strategy that accumulates itself; another callback that
            sets ``accumulate_grad_batches``.
        ValueError: (at fit start) ``Trainer(accumulate_grad_batches != 1)``.

    Example:
        >>> from lit_balance import BatchingSettings, TokensPerStepSampler
        >>> sampler = TokensPerStepSampler([4] * 6, BatchingSettings(max_tokens=4), [[0, 4], [1, 8]], num_replicas=1,
        ...                                rank=0)
        >>> cb = TokensPerStepAccumulation(sampler)  # Trainer(callbacks=[cb]); DataLoader(..., sampler=sampler)
    """

    #: Read by :class:`lit_balance.StepTokenLoss`: accumulation changes during fit.
    sets_accumulate_grad_batches = True

    def __init__(self, sampler: TokensPerStepSampler) -> None:
        if not isinstance(sampler, TokensPerStepSampler):
            raise InputValueError(f"sampler must be the training loader's TokensPerStepSampler, got "
                                  f"{type(sampler).__name__}", parameter="sampler")
        self.sampler = sampler
        self._pending: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None
        #: ``(epoch, first batch_idx, micro-batches per rank, global real tokens)`` of every optimizer step.
        self.history: list[tuple[int, int, int, int]] = []
        self._original: int | None = None
        self._step = 0

    def _sampler(self, trainer: L.Trainer) -> TokensPerStepSampler:
        return self.sampler

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "sampler": the sampler's state at the micro-batches training consumed, or None}``."""
        consumed = fit_batches_consumed(self._trainer)
        if consumed is not None:
            consumed = min(max(consumed, self.sampler.first_micro_step), len(self.sampler))
        return {"version": 1, "sampler": self.sampler.state_dict(batches_consumed=consumed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the sampler's saved position; restored into the sampler at the fit's start (``on_fit_start``).

        Raises:
            ValueError: other keys or version.
        """
        if set(state_dict) != {"version", "sampler"} or state_dict["version"] != 1:
            raise InputValueError(f"a TokensPerStepAccumulation state holds ['sampler', 'version'] of version 1, got "
                                  f"{state_dict!r}")
        self._pending = state_dict["sampler"]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        if self._pending is not None:
            self.sampler.load_state_dict(self._pending)  # before Lightning reads len(loader)
            self._pending = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError("TokensPerStepAccumulation needs automatic optimization")
        if trainer.strategy.handles_gradient_accumulation:
            raise RuntimeError(f"the {type(trainer.strategy).__name__} strategy manages gradient accumulation "
                               "itself; use strategy='ddp' with tokens_per_step_schedule")
        if trainer.accumulate_grad_batches != 1:
            raise InputValueError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with "
                                  "tokens_per_step_schedule, which sets each optimizer step's micro-batches; leave "
                                  "the Trainer's value at 1", parameter="accumulate_grad_batches")
        others = [type(c).__name__ for c in trainer.callbacks
                  if c is not self and getattr(c, "sets_accumulate_grad_batches", False) is True
                  or type(c).__name__ == "GradientAccumulationScheduler"]
        if others:
            raise RuntimeError(f"{others} also set accumulate_grad_batches; tokens_per_step_schedule sets it from the "
                               "plan: remove them")
        self._original = trainer.accumulate_grad_batches

    def _window(self, trainer: L.Trainer, batch_idx: int) -> tuple[int, int]:
        bounds = self._sampler(trainer).step_bounds()
        g = int(np.searchsorted(bounds, batch_idx, side="right")) - 1
        if not 0 <= g < bounds.shape[0] - 1:
            raise RuntimeError(f"micro-batch {batch_idx} lies outside the plan's optimizer steps "
                               f"[{int(bounds[0])}, {int(bounds[-1])})")
        return int(bounds[g]), int(bounds[g + 1])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = int(trainer.global_step)
        start, end = self._window(trainer, batch_idx)
        value, zero = window_accumulation(batch_idx, start, end)
        trainer.accumulate_grad_batches = value
        if zero:
            for optimizer in trainer.optimizers:
                pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        start, end = self._window(trainer, batch_idx)
        if batch_idx != end - 1:
            return
        sampler = self._sampler(trainer)
        plan = sampler.plan()
        g = int(np.searchsorted(sampler.step_bounds(), start))
        tokens = int(plan.step_tokens[g])
        self.history.append((int(trainer.current_epoch), start, end - start, tokens))
        emit(trainer, {"balance/accumulate_grad_batches": float(end - start),
                       "balance/tokens_per_optimizer_step": float(tokens)}, step=self._step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._original is not None:
            trainer.accumulate_grad_batches = self._original

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
