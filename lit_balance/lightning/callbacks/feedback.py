"""CostModelFeedback: fit the sampler's cost model and rank speeds from measured timings, once per epoch."""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch

from lit_balance._checks import MIN_RANK_SPEED_RATIO, check_bool, check_int, check_number
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.callbacks._common import emit, needed_sampler
from lit_balance.lightning.callbacks.straggler import StragglerMonitor, TimingWindow
from lit_balance.plan.cost import CostModel, CostModelProtocol
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.world import data_parallel_world

__all__ = ["CostModelFeedback", "fit_cost_and_speeds"]


_FITTED, _FIT_MISMATCH = 1.0, 2.0  # status of the broadcast fit (0: no fit this epoch)


def _no_fit_message(cost_class: Any) -> str:
    name = getattr(cost_class, "__qualname__", repr(cost_class))
    return (f"CostModelFeedback refits the training sampler's cost model with its class's fit, and {name} has no "
            f"fit: add a classmethod fit(cls, rows, padded_length, seconds, *, min_samples) -> {name} to it (as "
            "lit_balance.CostModel.fit: seconds of micro-batches of rows x padded_length tokens), or plan with a "
            "lit_balance.CostModel (the sampler's cost_model), or remove CostModelFeedback")


def _coefficients(cost_model: Any, names: tuple[str, ...]) -> list[float]:
    """``cost_model.to_dict()``'s values under ``names``, as floats.

    Raises:
        TypeError: other keys than ``names``, or a value that is not a real number.
    """
    values = cost_model.to_dict()
    if tuple(values) != names or not all(isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
                                         for v in values.values()):
        raise InputTypeError(f"{type(cost_model).__qualname__}.to_dict() must map {list(names)} to real numbers (the "
                             f"coefficients CostModelFeedback fits), got {values!r}", parameter="cost_model")
    return [float(v) for v in values.values()]


def _fitted_class(sampler: BalancedBatchSampler) -> tuple[type, tuple[str, ...]]:
    """The class the sampler's cost model is refitted with, and its coefficients' names (its ``to_dict()`` keys).

    Raises:
        TypeError: the cost model's class has no ``fit``, or its ``to_dict()`` is not of real numbers.
    """
    model = sampler.cost_model
    cost_class = type(model)
    if not callable(getattr(cost_class, "fit", None)):
        raise InputTypeError(_no_fit_message(cost_class), parameter="cost_model")
    names = tuple(model.to_dict())
    _coefficients(model, names)
    return cost_class, names


def fit_cost_and_speeds(window: TimingWindow, *, cost_class: type = CostModel, iterations: int = 5,
                        min_samples: int = 3) -> tuple[CostModelProtocol, list[float]]:
    """Fit a cost model in seconds (of class ``cost_class``) and each rank's relative speed from timed micro-batches.

    Model: rank ``r`` runs a micro-batch of ``rows`` rows padded to ``L`` tokens in
    ``cost(rows, L) / speed[r]`` seconds (a packed micro-batch enters as the shape of
    :func:`lit_balance.lightning.callbacks.straggler.packed_rows_and_length`, so the fit is that of per-document costs,
    ``per_batch + linear * sum(l) + quadratic * sum(l**2)``). Alternating least squares: with speeds fixed, fit the
    cost model to the speed-corrected seconds (``cost_class.fit``, e.g. :meth:`CostModel.fit`); with the cost model
    fixed, ``speed[r]`` is rank
    ``r``'s summed predicted over summed measured seconds (time-weighted, as the straggler gap is: what
    matters is the rank's total time per step, not its typical micro-batch). The alternation starts from each
    rank's padded slots per second, so a slow rank that ran smaller micro-batches is not mistaken for a
    per-micro-batch cost. Speeds are scaled so the fastest rank has 1.0.

    **Which seconds.** Forward + backward of the micro-batches whose backward was local (``backward_s``
    finite: inside DDP ``no_sync``, or a single process) when every rank has at least ``min_samples`` of them;
    then only those micro-batches are used. Otherwise (e.g. ``accumulate_grad_batches=1`` under DDP, where every
    backward waits in the all-reduce) forward seconds of every micro-batch. Backward is most of a micro-batch's
    compute, and a rank can be slower in backward than in forward, so forward alone can overrate a slow rank.

    Args:
        window: the micro-batches of every rank (their ``forward_s``, ``backward_s``, ``rows`` and
            ``padded_length``), e.g. ``TimingWindow.concatenate(monitor.epoch_windows)``; one without backward
            seconds (all NaN) fits forward seconds.
        cost_class: the cost model's class: a classmethod ``fit(rows, padded_length, seconds, *, min_samples)``
            returning an instance (:meth:`CostModel.fit` is the model), and ``batch_cost`` on that instance.
        iterations: alternations (>= 1).
        min_samples: fewest micro-batches per rank.

    Returns:
        ``(cost_model, rank_speeds)``: a ``cost_class`` in seconds (of forward + backward, or of forward, as above)
        and ``num_replicas`` floats in ``(0, 1]``.

    Raises:
        TypeError: ``cost_class`` has no ``fit``; ``iterations`` not an int.
        ValueError: fewer than ``min_samples`` micro-batches, or timings that do not grow with tokens (as
            ``cost_class.fit`` raises them); ``iterations < 1``.
    """
    if not callable(getattr(cost_class, "fit", None)):
        raise InputTypeError(_no_fit_message(cost_class), parameter="cost_class")
    if not isinstance(window, TimingWindow):
        raise InputTypeError(f"window must be a TimingWindow (StragglerMonitor's epoch_windows, joined with "
                             f"TimingWindow.concatenate), got {type(window).__name__}", parameter="window")
    if window.num_micro_batches < min_samples:
        raise InputValueError(f"need at least {min_samples} timed micro-batches per rank, got "
                              f"{window.num_micro_batches} on each of {window.num_replicas} ranks")
    rows, length, seconds = window.rows, window.padded_length, window.forward_s
    use = np.ones(rows.shape, dtype=bool)
    local = np.isfinite(window.backward_s)
    if (local.sum(axis=1) >= min_samples).all():
        use = local
        seconds = seconds + np.where(local, window.backward_s, 0.0)
    rows, length, seconds = (np.where(use, a, 0.0) for a in (rows, length, seconds))
    # Start from each rank's padded slots per second. Starting from equal speeds, the first cost fit explains a
    # slow rank that ran smaller micro-batches (as the plan for its speed gives it) by a per-micro-batch cost, and
    # the alternation stays near that wrong split.
    slots, total = (rows * length).sum(axis=1), seconds.sum(axis=1)
    speeds = np.where((slots > 0) & (total > 0), slots / np.maximum(total, 1e-300), 1.0)
    speeds = np.maximum(speeds, 1e-12) / max(float(speeds.max()), 1e-12)
    iterations = check_int("iterations", iterations, 1, "set the alternations of the fit, e.g. 5")
    cost = None
    for _ in range(iterations):
        cost = cost_class.fit(rows[use], length[use], (seconds * speeds[:, None])[use], min_samples=min_samples)
        predicted = np.where(use, np.asarray(cost.batch_cost(rows, length), dtype=np.float64), 0.0)
        measured = seconds.sum(axis=1)
        speeds = np.where(measured > 0, predicted.sum(axis=1) / np.maximum(measured, 1e-300), 1.0)
        speeds = np.maximum(speeds, 1e-12) / max(float(speeds.max()), 1e-12)
    return cost, [float(s) for s in speeds]


class CostModelFeedback(L.Callback):
    """At the end of each training epoch, plan the next epoch with measured seconds instead of assumed cost.

    Takes the epoch's micro-batch timings gathered by a :class:`StragglerMonitor` (which must be in the
    Trainer's callbacks; its windows are the same on every rank), fits a cost model in seconds and each
    rank's relative speed (:func:`fit_cost_and_speeds`) on data-parallel rank 0, broadcasts them over the
    data-parallel ranks (:func:`lit_balance.world.data_parallel_world`; one broadcast per epoch, so every rank hands
    the sampler bit-identical numbers and computes the same plan), and calls
    ``sampler.set_cost_model(cost_model, rank_speeds)`` on the training sampler handed to the Trainer (by
    :class:`~lit_balance.BalancedTextDataModule`, ``balanced_dataloader(..., trainer=self.trainer)`` or
    :func:`~lit_balance.use_training_sampler`). The sampler uses them from the next epoch's plan on; the
    current epoch's plan never changes, so mid-epoch resume stays exact.

    **Which cost model.** The fit is of the class of the sampler's cost model (``type(sampler.cost_model)``, its
    classmethod ``fit``, as :meth:`lit_balance.CostModel.fit`), so a custom cost model
    (:class:`lit_balance.plan.CostModelBase` subclass) stays one across epochs and resume; its ``to_dict()`` values
    are the fitted coefficients (real numbers), broadcast, smoothed and rebuilt with ``from_dict``.

    Logs ``balance/rank_speed_rank{r}`` and ``balance/cost_{name}`` per coefficient of the fitted model's
    ``to_dict()``: for :class:`lit_balance.CostModel`, ``balance/cost_linear``, ``balance/cost_quadratic``,
    ``balance/cost_per_batch`` (seconds per padded token, per squared length per row, per micro-batch).

    From the second fit on, the handed-over values are ``smoothing * previous + (1 - smoothing) * new``
    (coefficients and speeds alike): one epoch's timings are noisy on a busy machine, and a rank's speed
    does not change from one epoch to the next. The first fit replaces the assumed cost outright.

    Args:
        min_samples: fewest timed micro-batches per rank in an epoch before fitting.
        fit_speeds: also hand the sampler rank speeds (else only the cost model).
        smoothing: weight of the previous values, in ``[0, 1)``; 0 uses each epoch's fit alone.
        speed_tolerance: relative speed gap, in ``[0, 1)``, within which the ranks are planned as equal: when every
            (smoothed) speed is at least ``1 - speed_tolerance``, the sampler gets equal speeds (the logged
            ``balance/rank_speed_rank{r}`` stay the fitted ones). Planning for unequal speeds lengthens the epoch
            (the fast ranks' larger shares must stay within ``max_tokens``), and every extra micro-batch costs a
            per-micro-batch overhead the fitted forward-time cost model does not see, so a small measured gap
            can cost more than it saves. 0 plans every measured difference.

    The hand-over is what the planner handles well: a fit that is not finite and positive is skipped (with a
    warning), and a rank measured below :data:`~lit_balance.sampler.sampler.MIN_RANK_SPEED_RATIO` of the fastest rank's
    speed is handed over at that ratio (with a warning naming it).

    Unequal rank speeds can give the next epoch more micro-batches than the first (the fast ranks' larger shares
    must stay within ``max_tokens``), and Lightning reads the epoch length only when it reloads the train
    dataloader: with ``fit_speeds=True`` the Trainer must have ``reload_dataloaders_every_n_epochs=1`` (checked
    at fit start), or Lightning would end the longer epoch early.

    Raises:
        TypeError: ``min_samples`` not an int; ``fit_speeds`` not a bool; ``smoothing`` or ``speed_tolerance`` not
            a real number; (at fit start) a sampler whose cost model's class has no classmethod ``fit``, or whose
            ``to_dict()`` values are not all real numbers (naming the class and what to add); (at an epoch end,
            on every rank) a fit whose ``to_dict()`` is not of the sampler's cost model's coefficients.
        ValueError: ``min_samples < 3``; ``smoothing`` or ``speed_tolerance`` outside ``[0, 1)`` (or NaN).
        RuntimeError: (at fit start) no StragglerMonitor in the Trainer's callbacks; ``fit_speeds=True`` without
            ``Trainer(reload_dataloaders_every_n_epochs=1)``; no training sampler handed to the Trainer (naming the
            ways to hand one over).

    Example:
        >>> from lit_balance.callbacks import StragglerMonitor
        >>> trainer = L.Trainer(callbacks=[StragglerMonitor(), CostModelFeedback()], logger=False,
        ...                     reload_dataloaders_every_n_epochs=1)
    """

    def __init__(self, min_samples: int = 8, fit_speeds: bool = True, smoothing: float = 0.5,
                 speed_tolerance: float = 0.05) -> None:
        self.min_samples = check_int("min_samples", min_samples, 3, "set the fewest timed micro-batches per rank")
        self.fit_speeds = check_bool("fit_speeds", fit_speeds)
        self.smoothing = check_number("smoothing", smoothing, 0, 1, "set the previous fit's weight, e.g. 0.5 "
                                      "(0: each epoch's fit alone)", high_open=True)
        self.speed_tolerance = check_number("speed_tolerance", speed_tolerance, 0, 1, "set the relative speed gap "
                                            "planned as equal, e.g. 0.05 (0: plan every difference)", high_open=True)
        self._previous: tuple[type, tuple[str, ...], np.ndarray] | None = None
        #: ``(cost_model, rank_speeds)`` handed to the sampler at the last epoch end, or None.
        self.last_fit: tuple[CostModelProtocol, list[float] | None] | None = None
        self._monitor: StragglerMonitor | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitors = [c for c in trainer.callbacks if isinstance(c, StragglerMonitor)]
        if not monitors:
            raise RuntimeError("CostModelFeedback needs a StragglerMonitor in Trainer(callbacks=[...]); add one")
        reload = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        if self.fit_speeds and reload != 1:
            raise RuntimeError(
                "CostModelFeedback(fit_speeds=True) plans unequal rank speeds, which can give an epoch more "
                "micro-batches (the fast ranks' larger shares must stay within max_tokens); Lightning reads the "
                f"epoch length only when it reloads the train dataloader, and reload_dataloaders_every_n_epochs is "
                f"{reload}: pass Trainer(reload_dataloaders_every_n_epochs=1), or CostModelFeedback(fit_speeds=False)"
            )
        # no sampler to hand the fit to, or a cost model that cannot be refitted, fails now, not after an epoch
        _fitted_class(needed_sampler(trainer, "CostModelFeedback"))
        self._monitor = monitors[0]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        monitor.flush(trainer, pl_module)  # the epoch's last partial window, if the monitor has not yet
        if not monitor.epoch_windows:
            return
        window = TimingWindow.concatenate(monitor.epoch_windows)
        sampler = needed_sampler(trainer, "CostModelFeedback")  # the loader may be rebuilt every epoch
        cost_class, names = _fitted_class(sampler)
        world = data_parallel_world(trainer)
        payload = torch.zeros(1 + len(names) + window.num_replicas, dtype=torch.float64)  # [status, *coefs, *speeds]
        if world.rank == 0:
            payload = self._fit(window, cost_class, names)
        values = world.broadcast(payload, src=0).tolist()
        status, coefs, fitted_speeds = values[0], values[1:1 + len(names)], values[1 + len(names):]
        if status == _FIT_MISMATCH:  # the same payload on every rank: every rank raises
            raise InputTypeError(
                f"{cost_class.__qualname__}.fit returned a cost model whose to_dict() is not the real-number "
                f"coefficients {list(names)} of the sampler's cost model; make fit return a {cost_class.__qualname__} "
                "described by the same to_dict() keys", parameter="cost_model")
        if status != _FITTED:  # rank 0 could not fit this epoch (and warned)
            return
        cost = self._checked_fit(trainer, cost_class, names, coefs, fitted_speeds)
        if cost is None:
            return
        speeds = self._planned_speeds(trainer, fitted_speeds) if self.fit_speeds else None
        sampler.set_cost_model(cost, speeds)
        self.last_fit = (cost, speeds)
        metrics = {f"balance/cost_{name}": value for name, value in zip(names, coefs)}
        for r, s in enumerate(fitted_speeds):
            metrics[f"balance/rank_speed_rank{r}"] = s
        last = self._monitor.last_window if self._monitor is not None else None
        emit(trainer, metrics, step=last.last_step if last is not None else None)

    def _fit(self, window: TimingWindow, cost_class: type, names: tuple[str, ...]) -> torch.Tensor:
        """On data-parallel rank 0: ``[status, *coefficients, *rank speeds]``, smoothed with the previous fit."""
        try:
            cost, speeds = fit_cost_and_speeds(window, cost_class=cost_class, min_samples=self.min_samples)
        except ValueError as error:
            warnings.warn(f"CostModelFeedback: no fit this epoch: {error}", RuntimeWarning, stacklevel=3)
            return torch.zeros(1 + len(names) + window.num_replicas, dtype=torch.float64)
        try:
            new = np.array([*_coefficients(cost, names), *speeds], dtype=np.float64)
        except (TypeError, ValueError):
            return torch.tensor([_FIT_MISMATCH] + [0.0] * (len(names) + window.num_replicas), dtype=torch.float64)
        previous = self._previous
        if previous is not None and previous[:2] == (cost_class, names) and previous[2].shape == new.shape:
            new = self.smoothing * previous[2] + (1 - self.smoothing) * new
            new[len(names):] /= new[len(names):].max()
        self._previous = (cost_class, names, new)
        return torch.from_numpy(np.concatenate([[_FITTED], new]))

    def _checked_fit(self, trainer: L.Trainer, cost_class: type, names: tuple[str, ...], coefs: list[float],
                     speeds: list[float]) -> CostModelProtocol | None:
        """The broadcast cost model, or None (warned) when it is not finite and positive or its class refuses it."""
        if not all(np.isfinite([*coefs, *speeds])) or min(speeds) <= 0:
            if trainer.is_global_zero:
                warnings.warn(f"CostModelFeedback: the fit is not finite and positive (cost {coefs}, rank speeds "
                              f"{speeds}); the sampler keeps its cost model and speeds this epoch",
                              RuntimeWarning, stacklevel=3)
            return None
        try:
            return cost_class.from_dict(dict(zip(names, coefs)))
        except (TypeError, ValueError) as error:
            if trainer.is_global_zero:
                warnings.warn(f"CostModelFeedback: {cost_class.__qualname__}.from_dict refused the fit "
                              f"{dict(zip(names, coefs))} ({error}); the sampler keeps its cost model and speeds "
                              "this epoch", RuntimeWarning, stacklevel=3)
            return None

    def _planned_speeds(self, trainer: L.Trainer, speeds: list[float]) -> list[float]:
        """The rank speeds handed to the sampler: equal within ``speed_tolerance``, at least MIN_RANK_SPEED_RATIO."""
        if min(speeds) >= 1.0 - self.speed_tolerance:
            return [1.0] * len(speeds)  # within tolerance: the equal-speed plan, no longer epoch
        if min(speeds) < MIN_RANK_SPEED_RATIO:
            slow = ", ".join(f"rank {r} at {s:.3g}" for r, s in enumerate(speeds) if s < MIN_RANK_SPEED_RATIO)
            if trainer.is_global_zero:
                warnings.warn(f"CostModelFeedback: {slow} of the fastest rank's speed; planned at "
                              f"MIN_RANK_SPEED_RATIO={MIN_RANK_SPEED_RATIO:g} (one row per micro-batch); check that "
                              "rank's timings or hardware", RuntimeWarning, stacklevel=3)
            return [max(s, MIN_RANK_SPEED_RATIO) for s in speeds]
        return list(speeds)
