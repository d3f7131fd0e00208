"""AdaptiveGradAccumulation: keep the global real tokens per optimizer step near a target."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import check_int, check_number
from lit_balance.data.training_sampler import training_stream_of
from lit_balance.errors import InputValueError
from lit_balance.lightning.callbacks._common import batch_fields, emit, train_sampler
from lit_balance.lightning.callbacks.straggler import StragglerMonitor, step_imbalance
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.world import data_parallel_world

__all__ = ["AdaptiveGradAccumulation", "plan_step_tokens"]


def plan_step_tokens(sampler: BalancedBatchSampler | None) -> np.ndarray | None:
    """Global real tokens of each micro-step of the sampler's current epoch (fill rows excluded), or None without a
    sampler.

    ``out[t]`` sums, over all ranks, the real tokens of the micro-batch each rank runs at micro-step ``t`` of
    the epoch, Lightning's ``batch_idx`` (int64 ``[len(sampler)]``; :meth:`BalancedBatchSampler.micro_step_totals`).
    After a resume on another number of ranks, the micro-steps before the cut are those the old ranks ran. Every rank
    computes it alike, without communication.
    """
    return None if sampler is None else sampler.micro_step_totals()[0]


class AdaptiveGradAccumulation(L.Callback):
    """Set ``trainer.accumulate_grad_batches`` so each optimizer step sees about ``target_tokens_per_step``
    real tokens over all ranks, changing it only where Lightning's accumulation stays aligned.

    **When it may change.** Lightning (2.6, ``training_epoch_loop`` and ``optimization/automatic``) zeroes
    gradients before micro-batch ``batch_idx`` when ``batch_idx % accumulate_grad_batches == 0``, steps after
    it when ``(batch_idx + 1) % accumulate_grad_batches == 0`` or at the epoch's last batch (the epoch-end
    flush), runs the other micro-batches under DDP ``no_sync`` and divides the loss by the current value. So
    a new value ``k`` is set only in ``on_train_batch_start`` of a batch that opens a window (right after an
    optimizer step, or the epoch's first batch) and only if ``batch_idx % k == 0``; otherwise the change
    waits for the next window start where that holds (at the latest the next epoch's first batch). Windows
    therefore always start at multiples of the current value: zeroing, ``no_sync`` and the step stay aligned,
    and the epoch-end flush only shortens the last window, as it does without this callback.

    **Same value on every rank.** Decisions use only what every rank knows alike: the sampler's global plan
    (real tokens of every rank's micro-batch at every step, :func:`plan_step_tokens`), and the timings that
    :class:`StragglerMonitor` has gathered (identical on every rank). The sampler is the one handed to the Trainer
    (by :class:`~lit_balance.BalancedTextDataModule`, ``balanced_dataloader(..., trainer=self.trainer)`` or
    :func:`~lit_balance.use_training_sampler`); when none was (a loader of another sampler), the real tokens actually
    seen are summed over the data-parallel ranks (:func:`lit_balance.world.data_parallel_world`) by one all-reduce per
    optimizer step instead.

    **Policy.** Let ``m`` be the mean global real tokens per micro-step over the next ``lookahead``
    micro-steps. Tokens alone ask for ``k_tok = round(target / m)``; by default that is the value.

    **Straggler timings (off by default).** Under DDP ``no_sync`` alone, ranks would wait for each other once
    per optimizer step, and a rank slow on one micro-batch and fast on the next would lose nothing: longer
    steps would average per-micro-batch imbalance out. With ``target_straggler_ratio`` set and a
    StragglerMonitor in the callbacks, the latest gathered window of per-micro-batch compute seconds
    ``[num_replicas, n]`` gives that imbalance for steps of ``k`` micro-batches (:func:`step_imbalance`: sum of
    the slowest rank's time over sum of the median rank's); if ``k_tok`` gives more than
    ``target_straggler_ratio``, the smallest ``k`` up to ``max_overshoot * k_tok`` that meets it is taken (or
    the best one there), and the token target becomes a floor exceeded by at most ``max_overshoot``. But
    Lightning >= 2.5 (this package's requirement) broadcasts a SIGTERM flag from rank 0 before *every*
    training micro-batch, and that broadcast returns on rank 0 only when every rank has reached it (the
    measurements are in ``docs/callbacks.md``). Every micro-batch is then a barrier, the ranks pay
    ``sum over micro-batches of the slowest rank's time`` whatever ``k`` is, and raising ``k`` only adds
    tokens per step. So the default is None: under Lightning, imbalance between ranks is removed by the
    plan (equal-cost micro-batches per micro-step; rank speeds from :class:`CostModelFeedback`), not by
    accumulation.

    **Hysteresis.** The value changes only when the wanted one differs from the current one by at least
    ``max(1, tolerance * current)``.

    Logs, at every optimizer step, ``balance/accumulate_grad_batches`` (micro-batches in that step) and
    ``balance/tokens_per_optimizer_step`` (global real tokens of that step); :attr:`history` keeps
    ``(epoch, first batch_idx, accumulate_grad_batches, tokens)`` per step; a fit resumed inside a window closes
    that window where Lightning does, and its entry counts the micro-batches run before the checkpoint too. The
    Trainer's value is restored at the end of fit. Schedulers sized by ``trainer.estimated_stepping_batches`` see
    the starting value only.

    Args:
        target_tokens_per_step: real tokens per optimizer step, over all ranks and micro-batches.
        tolerance: hysteresis, a share of the current value, in ``[0, 1)``.
        max_accumulate_grad_batches: largest value it sets.
        lookahead: micro-steps of the plan averaged for ``m``.
        target_straggler_ratio: wanted step imbalance (>= 1); None (default) ignores straggler timings, which
            cannot average out under Lightning's per-micro-batch broadcast (see above).
        max_overshoot: how far above ``k_tok`` straggler timings may push the value (>= 1).

    Raises:
        TypeError: ``target_tokens_per_step``, ``max_accumulate_grad_batches`` or ``lookahead`` not an int;
            ``tolerance``, ``max_overshoot`` or ``target_straggler_ratio`` (unless None) not a real number.
        ValueError: an int argument < 1; ``tolerance`` outside ``[0, 1)``; ``max_overshoot`` or
            ``target_straggler_ratio`` < 1 or infinite; a NaN; (at fit start) ``Trainer(accumulate_grad_batches != 1)``.
        KeyError: a dict training batch that lacks ``num_real_tokens``.
        RuntimeError: (at fit start) manual optimization; a strategy that handles accumulation itself
            (DeepSpeed); another callback that sets ``accumulate_grad_batches``.

    Example:
        >>> cb = AdaptiveGradAccumulation(target_tokens_per_step=32768)
    """

    #: Declares that this callback changes ``trainer.accumulate_grad_batches`` during fit: read (by this attribute,
    #: without importing any callback) by :class:`lit_balance.StepTokenLoss`, which then divides by the tokens of
    #: the steps actually run instead of the plan's.
    sets_accumulate_grad_batches = True

    def __init__(
        self,
        target_tokens_per_step: int,
        *,
        tolerance: float = 0.25,
        max_accumulate_grad_batches: int = 64,
        lookahead: int = 64,
        target_straggler_ratio: float | None = None,
        max_overshoot: float = 2.0,
    ) -> None:
        self.target_tokens_per_step = check_int("target_tokens_per_step", target_tokens_per_step, 1,
                                                "set the real tokens per optimizer step, over all ranks")
        self.tolerance = check_number("tolerance", tolerance, 0, 1, "set the hysteresis as a share of the current "
                                      "value, e.g. 0.25", high_open=True)
        self.max_accumulate_grad_batches = check_int("max_accumulate_grad_batches", max_accumulate_grad_batches, 1,
                                                     "set the largest accumulate_grad_batches it may set")
        self.lookahead = check_int("lookahead", lookahead, 1, "set the micro-steps of the plan to average")
        if target_straggler_ratio is not None:
            target_straggler_ratio = check_number("target_straggler_ratio", target_straggler_ratio, 1, None,
                                                  "set the wanted step imbalance, or None to ignore timings")
        self.target_straggler_ratio = target_straggler_ratio
        self.max_overshoot = check_number("max_overshoot", max_overshoot, 1, None,
                                          "set how far above the token-based value timings may push it, e.g. 2.0")
        #: ``(epoch, first batch_idx, accumulate_grad_batches, global real tokens)`` of every optimizer step.
        self.history: list[tuple[int, int, int, int]] = []
        self._original: int | None = None
        self._restored: int | None = None
        self._current = 1
        self._monitor: StragglerMonitor | None = None
        self._tokens: np.ndarray | None = None
        self._tokens_epoch: int | None = None
        self._cum: np.ndarray | None = None
        self._wanted_cache: tuple[tuple[int, int], int] | None = None
        self._measured_mean: float | None = None
        self._window_start = 0
        self._window_local = 0
        self._first_batch = False  # the first batch of this fit is still to come
        self._step = 0  # global_step at the start of the current micro-batch

    # -- checks ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError("AdaptiveGradAccumulation needs automatic optimization; with manual optimization "
                               "accumulate in training_step yourself, or remove the callback")
        if trainer.strategy.handles_gradient_accumulation:
            raise RuntimeError(f"the {type(trainer.strategy).__name__} strategy manages gradient accumulation "
                               "itself; remove AdaptiveGradAccumulation or use strategy='ddp'")
        if trainer.accumulate_grad_batches != 1:
            raise InputValueError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with "
                                  "AdaptiveGradAccumulation, which sets it; leave the Trainer's value at 1")
        stream = training_stream_of(trainer)
        if stream is not None:
            raise InputValueError(f"AdaptiveGradAccumulation changes accumulate_grad_batches while training, and the "
                                  f"Trainer trains from a stream ({stream}) whose windows are planned to whole "
                                  "optimizer steps of a fixed accumulate_grad_batches: remove AdaptiveGradAccumulation "
                                  "and set Trainer(accumulate_grad_batches=...)", parameter="callbacks")
        others = [type(c).__name__ for c in trainer.callbacks
                  if c is not self and (isinstance(c, AdaptiveGradAccumulation)
                                        or type(c).__name__ == "GradientAccumulationScheduler")]
        if others:
            raise RuntimeError(f"{others} also set accumulate_grad_batches; keep only one AdaptiveGradAccumulation")
        self._original = trainer.accumulate_grad_batches
        self._first_batch = True
        if self._restored is not None:  # resuming: windows continue where the checkpoint left them
            trainer.accumulate_grad_batches = self._restored
            self._restored = None
        monitors = [c for c in trainer.callbacks if isinstance(c, StragglerMonitor)]
        self._monitor = monitors[0] if monitors and self.target_straggler_ratio is not None else None

    def state_dict(self) -> dict[str, int]:
        """``{"version": 1, "accumulate_grad_batches": the value in use}``, restored at the next fit start."""
        return {"version": 1, "accumulate_grad_batches": int(self._current)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the value in use when the checkpoint was written.

        Raises:
            ValueError: unknown or missing keys, or a value < 1.
        """
        if set(state_dict) != {"version", "accumulate_grad_batches"}:
            raise InputValueError(f"expected keys ['accumulate_grad_batches', 'version'], got {sorted(state_dict)}")
        value = state_dict["accumulate_grad_batches"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputValueError(f"accumulate_grad_batches in the checkpoint must be an int >= 1, got {value!r}")
        self._restored = self._current = value

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._original is not None:
            trainer.accumulate_grad_batches = self._original

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    # -- decisions ---------------------------------------------------------------------------------------
    def _mean_tokens(self, trainer: L.Trainer, batch_idx: int) -> float | None:
        sampler = train_sampler(trainer)
        epoch = None if sampler is None else sampler.epoch
        if self._tokens is None or self._tokens_epoch != epoch:
            self._tokens = plan_step_tokens(sampler)
            self._tokens_epoch = epoch
            self._cum = None if self._tokens is None else np.concatenate([[0], np.cumsum(self._tokens)])
        if self._tokens is None or self._tokens.size == 0:
            return self._measured_mean
        n = self._tokens.size
        lo, hi = min(batch_idx, n), min(batch_idx + self.lookahead, n)
        if hi > lo:
            return float(self._cum[hi] - self._cum[lo]) / (hi - lo)
        return float(self._cum[-1]) / n

    def _straggler_compute(self) -> np.ndarray | None:
        monitor = self._monitor
        if monitor is None or monitor.last_window is None:
            return None
        return monitor.last_window.forward_s

    def wanted(self, mean_tokens: float, compute_s: np.ndarray | None = None) -> int:
        """The value the policy wants, before hysteresis and alignment (see the class docstring).

        Args:
            mean_tokens: global real tokens per micro-step (> 0).
            compute_s: float ``[num_replicas, n]`` per-micro-batch compute seconds, or None.
        """
        cap = self.max_accumulate_grad_batches
        k_tok = min(max(round(self.target_tokens_per_step / mean_tokens), 1), cap)
        if compute_s is None or self.target_straggler_ratio is None or compute_s.shape[1] < 2:
            return k_tok
        hi = min(cap, math.floor(self.max_overshoot * k_tok), compute_s.shape[1])
        imbalance = {k: step_imbalance(compute_s, k) for k in range(k_tok, max(hi, k_tok) + 1)}
        if imbalance[k_tok] <= self.target_straggler_ratio:
            return k_tok
        meeting = [k for k, v in imbalance.items() if v <= self.target_straggler_ratio]
        return meeting[0] if meeting else min(imbalance, key=lambda k: (imbalance[k], k))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = int(trainer.global_step)  # the step this micro-batch's figures are logged at
        current = int(trainer.accumulate_grad_batches)
        if self._first_batch:  # the fit's first batch: a resume may start inside a window, which began earlier
            self._first_batch = False
            self._tokens = None
            if batch_idx % current:
                self._window_start, self._window_local = batch_idx - batch_idx % current, 0
                self._mean_tokens(trainer, batch_idx)  # reads the epoch's plan
        if batch_idx % current:
            return  # inside a window: never change here
        self._window_start, self._window_local = batch_idx, 0
        if batch_idx == 0:
            self._tokens = None  # a new epoch: read its plan
        mean = self._mean_tokens(trainer, batch_idx)
        if mean is None or mean <= 0:
            return
        monitor = self._monitor
        key = (round(self.target_tokens_per_step / mean), monitor.num_windows if monitor is not None else -1)
        if self._wanted_cache is None or self._wanted_cache[0] != key:  # recomputed per new window or k_tok
            self._wanted_cache = (key, self.wanted(mean, self._straggler_compute()))
        want = self._wanted_cache[1]
        if abs(want - current) < max(1.0, self.tolerance * current):
            return  # hysteresis
        if batch_idx % want == 0:  # aligned: zeroing, no_sync and the step all follow the new value
            trainer.accumulate_grad_batches = self._current = want

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(batch, dict):
            self._window_local += int(batch_fields(batch, ("num_real_tokens",), "AdaptiveGradAccumulation")[0])
        acc = int(trainer.accumulate_grad_batches)
        last = trainer.num_training_batches
        if (batch_idx + 1) % acc and not (isinstance(last, int) and batch_idx + 1 >= last):
            return  # not the step's last micro-batch
        micro_batches = batch_idx + 1 - self._window_start
        if self._cum is not None and batch_idx < self._tokens.size:  # this epoch's plan, read at its first batch
            tokens = int(self._cum[batch_idx + 1] - self._cum[self._window_start])
        else:  # no plan: sum the real tokens actually seen over ranks (one all-reduce per optimizer step)
            local = torch.tensor(float(self._window_local), dtype=torch.float64)
            tokens = round(float(data_parallel_world(trainer).all_reduce_sum(local)))
            self._measured_mean = tokens / micro_batches
        self.history.append((int(trainer.current_epoch), self._window_start, micro_batches, tokens))
        emit(trainer, {"balance/accumulate_grad_batches": float(micro_batches),
                       "balance/tokens_per_optimizer_step": float(tokens)}, step=self._step)
