"""MixtureWeightsHook: set a mixture's weights from the training itself (online mixing), the same on every rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L

from lit_balance.errors import InputValueError
from lit_balance.lightning.callbacks._common import emit

__all__ = ["MixtureWeightsHook"]


class MixtureWeightsHook(L.Callback):
    """A callback whose :meth:`set_weights` sets new mixture weights during training, as DoReMi-style online mixing
    does, from rank 0's values, from the next epoch's first optimizer step on.

    Use it with :class:`~lit_balance.BalancedTextDataModule` over a :class:`~lit_balance.Mixture` with a
    ``weights_schedule`` and ``Trainer(reload_dataloaders_every_n_epochs=1)``; call :meth:`set_weights` on **every**
    rank at the same point of training (e.g. in another callback's ``on_train_batch_end``, or ``training_step``), with
    the weights rank 0 computed (the other ranks' values are replaced by rank 0's: one broadcast). The weight schedule
    is edited from the first optimizer step of the next epoch (:meth:`MixtureBatchSampler.set_weights_from
    <lit_balance.sampler.mixture.MixtureBatchSampler.set_weights_from>`): every rank plans the same steps with the
    same weights; the epoch in progress keeps its plan.

    **Checkpoint.** The edits (``[step, weights]``) are saved in the callback's state, and the sampler's state saves
    the edited schedule; a resume with the same callback re-applies the edits to the fresh sampler before its state
    is restored, so the resumed run plans what the uninterrupted one did (the DataModule's own ``weights_schedule``
    stays the one configured).

    Logs ``mixture/weights_set/<name>`` (the normalised weights) at the optimizer step where they were set.

    Raises:
        RuntimeError: no DataModule, or its training sampler is not a mixture with a weight schedule (at
            :meth:`set_weights` or at fit start when restoring edits).
        ValueError: as :meth:`~lit_balance.sampler.mixture.MixtureBatchSampler.set_weights_from`.

    Example:
        >>> hook = MixtureWeightsHook()   # Trainer(callbacks=[hook, ...], reload_dataloaders_every_n_epochs=1)
        >>> hook.edits
        []
    """

    def __init__(self) -> None:
        #: ``[(step, {component: weight}), ...]``: the weights set so far and the run's step from which each holds.
        self.edits: list[tuple[int, dict[str, float]]] = []
        self._pending: list[tuple[int, dict[str, float]]] | None = None

    @staticmethod
    def _sampler(trainer: L.Trainer) -> Any:
        datamodule = trainer.datamodule
        sampler = None if datamodule is None else datamodule.train_sampler
        if sampler is None or sampler.num_components < 2 or sampler.weights_schedule is None:
            raise RuntimeError("MixtureWeightsHook sets the weights of a BalancedTextDataModule over a Mixture with a "
                               "weights_schedule (set after setup); pass weights_schedule (e.g. the mixture's weights "
                               "as one point) and train with that DataModule")
        return sampler

    def set_weights(self, trainer: L.Trainer, weights: Mapping[str, float]) -> int:
        """Set new weights from the next epoch's first optimizer step on, the same on every rank.

        A collective: call it on every rank at the same point (rank 0's ``weights`` are broadcast to the others).

        Args:
            trainer: the Trainer.
            weights: ``{component: weight}`` naming every component (normalised per step).

        Returns:
            The run's optimizer step from which the weights hold.

        Raises:
            RuntimeError, ValueError: see the class.
        """
        if not isinstance(weights, Mapping):
            raise InputValueError(f"set_weights takes {{component: weight}}, got {type(weights).__name__}",
                                  parameter="weights")
        weights = trainer.strategy.broadcast({str(k): float(v) for k, v in weights.items()}, src=0)
        sampler = self._sampler(trainer)
        step = int(sampler.schedule_start(sampler.epoch + 1)[0])
        sampler.set_weights_from(step, weights)
        self.edits.append((step, dict(weights)))
        total = sum(weights.values())
        emit(trainer, {f"mixture/weights_set/{k}": v / total for k, v in weights.items()})
        return step

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "edits": [[step, {component: weight}], ...]}``."""
        return {"version": 1, "edits": [[step, dict(w)] for step, w in self.edits]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved edits; re-applied to the DataModule's sampler at the fit's start.

        Raises:
            ValueError: other keys or version.
        """
        if set(state_dict) != {"version", "edits"} or state_dict["version"] != 1:
            raise InputValueError(f"a MixtureWeightsHook state holds ['edits', 'version'] of version 1, got "
                                  f"{sorted(state_dict)}")
        self._pending = [(int(step), {str(k): float(v) for k, v in w.items()}) for step, w in state_dict["edits"]]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._pending:
            return
        sampler = self._sampler(trainer)  # built at setup; its saved state is restored later, at train_dataloader()
        for step, weights in self._pending:
            sampler.set_weights_from(step, weights, check_step=False)
        self.edits, self._pending = list(self._pending), None
