"""BalanceProgressBar: Lightning's Rich progress bar with the right epoch and step and the monitors' live figures."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from lit_balance.lightning.callbacks.padding import PaddingRatioMonitor
from lit_balance.lightning.callbacks.straggler import StragglerMonitor

__all__ = ["BalanceProgressBar", "live_figures"]

#: logged metric key -> (label in the bar, format)
FIGURES = {
    "balance/real_tokens_per_s": ("tokens/s", "{:,.0f}"),
    "balance/padding_ratio": ("padding", "{:.3f}"),
    "balance/straggler_ratio": ("straggler", "{:.2f}"),
}


def live_figures(trainer: L.Trainer) -> dict[str, float]:
    """The last values the trainer's :class:`PaddingRatioMonitor` and :class:`StragglerMonitor` logged (keys as logged,
    e.g. ``balance/real_tokens_per_s``; global figures, the same on every rank); empty before their first window."""
    figures: dict[str, float] = {}
    for callback in trainer.callbacks:
        if isinstance(callback, (PaddingRatioMonitor, StragglerMonitor)):
            figures.update(callback.last_metrics)
    return figures


def _rate(completed: float, elapsed: float | None) -> str:
    """Micro-batches per second as ``it/s``, or seconds per micro-batch as ``s/it`` below one per second."""
    if not elapsed or completed <= 0:
        return "-- it/s"
    rate = completed / elapsed
    return f"{rate:.2f}it/s" if rate >= 1 else f"{1 / rate:.2f}s/it"


class BalanceProgressBar(RichProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`, showing the optimizer step and the live
    figures of the balancing monitors, with an epoch display that is right when ``max_epochs`` is -1 or None.

    On global rank 0, the training bar reads ``Epoch 3`` (``Epoch 3/9`` when ``max_epochs=10``; Lightning's own bar
    prints ``Epoch 3/-2`` for ``max_epochs=-1``), its micro-batches done in this epoch, the elapsed and remaining
    time, and the average rate of this epoch's micro-batches (``it/s``, or ``s/it`` below one per second; Rich's
    windowed speed reads ``0.00it/s`` when micro-batches take long). The metrics after it are the LightningModule's
    ``prog_bar`` metrics, then ``step: 12/40`` (optimizer steps done, global; ``/max_steps`` when set) and the last
    window's figures of the trainer's monitors (:func:`live_figures`): ``tokens/s`` (real tokens per second, all ranks,
    :class:`PaddingRatioMonitor`), ``padding`` (padding ratio of this epoch so far, all ranks) and ``straggler``
    (slowest rank's compute seconds over the median's, :class:`StragglerMonitor`). A figure appears once its monitor
    has logged; the same figures go to every logger of the Trainer.

    Args:
        refresh_rate, leave, theme, console_kwargs: as :class:`~lightning.pytorch.callbacks.RichProgressBar`
            (``console_kwargs={"file": f}`` draws into another stream; the default is stdout).

    Example:
        >>> from lit_balance.callbacks import PaddingRatioMonitor, StragglerMonitor
        >>> trainer = L.Trainer(callbacks=[BalanceProgressBar(), PaddingRatioMonitor(), StragglerMonitor()],
        ...                     logger=False, max_steps=40)
    """

    def configure_columns(self, trainer: L.Trainer) -> list:
        columns = super().configure_columns(trainer)
        speed = [i for i, c in enumerate(columns) if type(c).__name__ == "ProcessingSpeedColumn"]
        if speed:
            columns[speed[0]] = _RateColumn(self.theme.processing_speed)
        return columns

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), (int, float)):  # the logger's version: 3, not 3.000
            items["v_num"] = f"{items['v_num']:g}"
        max_steps = trainer.max_steps
        step = trainer.global_step
        items["step"] = f"{step}/{max_steps}" if max_steps and max_steps > 0 else str(step)
        figures = live_figures(trainer)
        for key, (label, fmt) in FIGURES.items():
            if key in figures:
                items[label] = fmt.format(figures[key])
        return items


def _RateColumn(style: Any) -> Any:  # a Rich column; rich is imported when the bar is drawn
    """A Rich column: the average micro-batches per second of the bar's task (completed / elapsed)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def __init__(self, style: Any) -> None:
            self.style = style
            super().__init__()

        def render(self, task: Any) -> Text:
            return Text(_rate(task.completed, task.elapsed), style=self.style)

    return RateColumn(style)
