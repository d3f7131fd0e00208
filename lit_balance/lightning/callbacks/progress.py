"""BalanceProgressBar: Lightning's Rich progress bar with the right epoch and step and the monitors' live figures."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import RichProgressBar

from lit_balance.lightning.callbacks.mixture import MixtureMonitor
from lit_balance.lightning.callbacks.padding import PaddingRatioMonitor
from lit_balance.lightning.callbacks.straggler import StragglerMonitor

__all__ = ["BalanceProgressBar", "bar_figures", "live_figures"]


def live_figures(trainer: L.Trainer) -> dict[str, float]:
    """The last values the trainer's :class:`PaddingRatioMonitor`, :class:`StragglerMonitor` and
    :class:`MixtureMonitor` logged (keys as logged, e.g. ``balance/real_tokens_per_s``, ``train/tokens/<name>``; the
    same on every rank); empty before their first window."""
    figures: dict[str, float] = {}
    for callback in trainer.callbacks:
        if isinstance(callback, (PaddingRatioMonitor, StragglerMonitor, MixtureMonitor)):
            figures.update(callback.last_metrics)
    return figures


def bar_figures(trainer: L.Trainer) -> dict[str, str]:
    """The monitors' figures as the bar shows them, label -> value, each label saying what it covers.

    From the trainer's :class:`StragglerMonitor`'s last window (``window: steps a-b``, Lightning's ``global_step`` of
    its first and last micro-batch, as in ``metrics.csv``): ``straggler`` (the window's largest compute seconds over
    the median; the :class:`RunSummary` table's ``straggler ratio`` is the same over the whole run), and where the
    ranks' time went (``compute``, ``data wait``, ``rank wait``, ``other``: shares of the window's seconds summed over
    ranks, as the per-rank columns of ``metrics.csv``). From :class:`PaddingRatioMonitor`: ``padding (epoch)``, the
    padding ratio of the epoch so far (all ranks), and ``tokens/s``, the ``balance/real_tokens_per_s`` it logged last
    (real tokens of all ranks over the slowest rank's wall seconds since its previous log): the figure
    ``metrics.csv`` and ``training.png`` hold, of the same window when both monitors log at the same micro-batches
    (the shipped configs). Without a PaddingRatioMonitor, ``tokens/s`` is the StragglerMonitor window's real tokens
    of all ranks over the slowest rank's seconds. From :class:`MixtureMonitor` (a mixture only), the last optimizer
    step it logged, one item per component ``<name>``: its real tokens in that step (all ranks), its share of the step
    in the mixture's unit and its target share (``train/target/<name>``: under a weight schedule the step's
    scheduled share), e.g. ``web: 3,210 tokens (share 0.612, target 0.600)``.
    """
    items: dict[str, str] = {}
    window = None
    padding: dict[str, float] = {}
    for callback in trainer.callbacks:
        if isinstance(callback, StragglerMonitor) and callback.last_window is not None:
            window = callback.last_window
        if isinstance(callback, PaddingRatioMonitor):
            padding = callback.last_metrics
    logged_rate = padding.get("balance/real_tokens_per_s")
    if window is not None:
        items["window"] = f"steps {window.first_step}-{window.last_step}"
        wall = window.compute_s + window.data_wait_s + window.rank_wait_s + window.other_s  # [num_replicas]
        slowest = float(wall.max())
        if logged_rate is not None:  # the figure metrics.csv and training.png hold
            items["tokens/s"] = f"{logged_rate:,.0f}"
        else:
            items["tokens/s"] = f"{float(window.real_tokens.sum()) / slowest:,.0f}" if slowest > 0 else "--"
        median = float(np.median(window.compute_s))
        items["straggler"] = f"{float(window.compute_s.max()) / median:.2f}" if median > 0 else "1.00"
        total = float(wall.sum())
        for label, phase in (("compute", window.compute_s), ("data wait", window.data_wait_s),
                             ("rank wait", window.rank_wait_s), ("other", window.other_s)):
            items[label] = f"{100 * float(phase.sum()) / total:.0f}%" if total > 0 else "--"
    elif logged_rate is not None:
        items["tokens/s"] = f"{logged_rate:,.0f}"
    if "balance/padding_ratio" in padding:
        items["padding (epoch)"] = f"{padding['balance/padding_ratio']:.3f}"
    for callback in trainer.callbacks:
        if isinstance(callback, MixtureMonitor) and callback.last_metrics:
            figures = callback.last_metrics
            for name, target in zip(callback.names, callback.targets.tolist()):
                target = figures.get(f"train/target/{name}", target)  # the step's scheduled share, as logged
                items[name] = (f"{figures[f'train/tokens/{name}']:,.0f} tokens (share "
                               f"{figures[f'train/share/{name}']:.3f}, target {target:.3f})")
    return items


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
    prints ``Epoch 3/-2`` for ``max_epochs=-1``), its micro-batches done in this epoch over the epoch's (after a
    mid-epoch resume, counted from the epoch's start, the total no smaller than the count), the time elapsed in this
    epoch in this process and the time remaining, and the average rate of this epoch's micro-batches in this process
    (``it/s``, or ``s/it`` below one per second; Rich's windowed speed reads ``0.00it/s`` when micro-batches take
    long). Below it, ``name: value`` items on lines as wide as the terminal, never splitting an item: the
    LightningModule's ``prog_bar`` metrics, ``step: 12/40`` (optimizer steps done, global; ``/max_steps`` when set)
    and the monitors' figures (:func:`bar_figures`: the window they cover, tokens/s, straggler ratio, where the
    ranks' time went, padding ratio of the epoch). A figure appears once its monitor has logged; the same figures go to every logger.

    The bar closes at ``on_train_end``, before anything printed after training (:class:`RunSummary`'s table). While it
    is drawn, what would write over it goes above it instead: on rank 0, log lines of ``logging`` handlers that write
    to the terminal (Lightning's "`Trainer.fit` stopped: ..." line; a Hydra recipe's console log) go through the bar's
    console, as Rich does for ``print``; on the other ranks, which share the terminal but not the bar, Python
    warnings are held and printed once each, prefixed ``rank N:``, after the bar has closed (at ``on_train_end``,
    where every process takes part in two barriers around them).

    Args:
        refresh_rate, leave, theme, console_kwargs: as :class:`~lightning.pytorch.callbacks.RichProgressBar`
            (``console_kwargs={"file": f}`` draws into another stream; the default is stdout).

    Example:
        >>> from lit_balance.callbacks import PaddingRatioMonitor, StragglerMonitor
        >>> trainer = L.Trainer(callbacks=[BalanceProgressBar(), PaddingRatioMonitor(), StragglerMonitor()],
        ...                     logger=False, max_steps=40)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._items: dict[str, str] = {}  # set on the training thread, drawn by Rich's
        self._epoch_offset: int | None = 0  # batch_idx of the first micro-batch this process ran in this epoch
        self._epoch_start_step = 0  # global_step when this process started the epoch
        self._columns: tuple = ()  # the progress's columns (configure_columns)
        self._description: str | None = None  # the training bar's description this epoch (train_description)
        self._streams: list[tuple[logging.StreamHandler, Any]] = []  # handlers sent through the bar, their streams
        self._held: list[str] | None = None  # warnings of a rank > 0 while rank 0 draws the bar
        self._showwarning: Any = None

    def configure_columns(self, trainer: L.Trainer) -> list:
        """The bar's columns, built here from Rich's public classes: the description, the bar, micro-batches done over
        the total, the time elapsed and remaining, and the average rate (:func:`_rate`)."""
        self._columns = _columns(self)
        return list(self._columns)

    def _own_columns(self) -> None:
        """Draw the ``name: value`` items on full-width lines below the bars (Rich's ``Progress.get_renderables``, its
        hook for a layout of one's own), instead of the text column Lightning appends to :meth:`configure_columns`'s,
        which wraps them in a narrow cell: the progress keeps the columns built here only."""
        progress = self.progress
        if progress is not None:
            progress.columns = tuple(self._columns)
            progress.get_renderables = lambda: self._renderables(progress)
            self._route_logging()

    def _route_logging(self, hold: bool = False) -> None:
        """Send the ``logging`` handlers that write to the terminal through the bar's console while it is drawn (Rich
        replaces ``sys.stdout`` and ``sys.stderr`` by its proxies then; a handler keeps the stream it was made with),
        or, with ``hold`` (a rank > 0), into the held lines."""
        if self._streams or (not hold and sys.stdout is sys.__stdout__):  # routed, or Rich draws to no terminal
            return
        if hold:
            proxies = {id(sys.__stdout__): _Held(self), id(sys.__stderr__): _Held(self)}
        else:
            proxies = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
        loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                          if isinstance(v, logging.Logger))]
        for logger in loggers:
            for handler in logger.handlers:
                stream = getattr(handler, "stream", None)
                if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                        and id(stream) in proxies):
                    try:
                        self._streams.append((handler, handler.setStream(proxies[id(stream)])))
                    except AttributeError:  # a handler whose stream is a read-only property (it follows sys.stderr)
                        pass

    def _unroute_logging(self) -> None:
        while self._streams:
            handler, stream = self._streams.pop()
            handler.setStream(stream)

    def _hold_warning(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                      line: str | None = None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        if self._held is not None and text not in self._held:
            self._held.append(text)

    def _release_warnings(self, trainer: L.Trainer) -> None:
        """Restore the warnings and log handlers of a rank > 0 and print what they held."""
        if self._showwarning is None:
            return
        self._unroute_logging()
        warnings.showwarning, self._showwarning = self._showwarning, None
        held, self._held = self._held or [], None
        if held:
            sys.stderr.write("".join(f"rank {trainer.global_rank}: {text}\n" for text in held))
            sys.stderr.flush()

    def _renderables(self, progress: Any) -> Any:
        yield progress.make_tasks_table(progress.tasks)
        texts = [f"{name}: {value}" for name, value in dict(self._items).items()]
        if texts and any(t.id == self.train_progress_bar_id and t.visible for t in progress.tasks):
            yield _Items(texts, self.theme.metrics)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and int(trainer.global_rank) > 0 and int(trainer.world_size) > 1 and self._showwarning is None:
            self._held, self._showwarning = [], warnings.showwarning  # from the sanity check on, rank 0 draws a bar
            warnings.showwarning = self._hold_warning
            self._route_logging(hold=True)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._route_logging()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._own_columns()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._own_columns()

    @property
    def total_train_batches(self) -> int | float:
        """Micro-batches of this epoch the bar counts to, from the epoch's start (also after a mid-epoch resume).

        The epoch's micro-batches, or fewer when ``max_steps`` ends training first: the batch index this process
        started the epoch at plus the micro-batches of the optimizer steps left (Lightning's own bar takes the steps
        left for micro-batches from the epoch's start, and shows ``24/3`` after a resume late in an epoch).
        """
        total = self.trainer.num_training_batches
        max_steps = self.trainer.max_steps
        if max_steps is not None and max_steps > 0:
            left = max(max_steps - self._epoch_start_step, 0) * max(int(self.trainer.accumulate_grad_batches), 1)
            total = min(total, (self._epoch_offset or 0) + left)
        return total

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start_step, self._epoch_offset = int(trainer.global_step), None
        self._description = self.train_description(trainer.current_epoch)
        super().on_train_epoch_start(trainer, pl_module)
        self._own_columns()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        progress, task = self.progress, self.train_progress_bar_id
        if progress is None or task is None:
            return
        if self._epoch_offset is None:  # the first micro-batch this process runs in this epoch: 0, or a resume's
            self._epoch_offset = batch_idx
            progress.update(task, total=self.total_train_batches)
        total = next((t.total for t in progress.tasks if t.id == task), None)
        if total is not None and batch_idx + 1 > total:  # accumulation changed on the way: never count past the total
            progress.update(task, total=batch_idx + 1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.teardown(trainer, pl_module, "fit")  # closes the bar: what is printed next comes below its last frame
        if int(trainer.world_size) > 1:  # every process: once rank 0's bar is closed, the others print what they held
            trainer.strategy.barrier("BalanceProgressBar: bar closed")
            self._release_warnings(trainer)
            trainer.strategy.barrier("BalanceProgressBar: held warnings printed")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._unroute_logging()
        self._release_warnings(trainer)  # ranks may be anywhere: no collective
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._showwarning is None:  # a rank > 0 keeps holding until on_train_end's barriers
            self._unroute_logging()
        super().teardown(trainer, pl_module, stage)

    def train_description(self, current_epoch: int) -> str:
        """The training bar's description: ``Epoch 3``, or ``Epoch 3/9`` when ``max_epochs=10``, padded as wide as
        the validation bar's (no flicker). Drawn by the bar's own description column (:meth:`configure_columns`), in
        place of the text Lightning gives the training task (set at each ``on_train_epoch_start``)."""
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), (int, float)):  # the logger's version: 3, not 3.000
            items["v_num"] = f"{items['v_num']:g}"
        max_steps = trainer.max_steps
        step = trainer.global_step
        items["step"] = f"{step}/{max_steps}" if max_steps and max_steps > 0 else str(step)
        items.update(bar_figures(trainer))
        self._items = {name: _shown(value, self.theme.metrics_format) for name, value in items.items()}
        return items


def _shown(value: Any, fmt: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return f"{value:{fmt}}"
    except (TypeError, ValueError):
        return str(value)


class _Held:
    """A text stream of a rank > 0's log handlers while rank 0 draws the bar: each line is held (once) with the
    rank's warnings."""

    def __init__(self, bar: BalanceProgressBar) -> None:
        self.bar, self.pending = bar, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line and self.bar._held is not None and line not in self.bar._held:
                self.bar._held.append(line)
        return len(text)

    def flush(self) -> None:
        pass


class _Items:
    """A Rich renderable: ``name: value`` items on as few lines as fit the width, never splitting an item."""

    def __init__(self, texts: list[str], style: Any) -> None:
        self.texts, self.style = texts, style

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        widths = [len(t) for t in self.texts] or [0]
        return Measurement(max(widths), sum(widths) + len(widths) - 1)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        lines: list[str] = []
        for text in self.texts:
            if lines and len(lines[-1]) + 1 + len(text) <= options.max_width:
                lines[-1] += " " + text
            else:
                lines.append(text)
        yield Text("\n".join(lines), style=self.style, no_wrap=True, overflow="ellipsis")


def _columns(bar: BalanceProgressBar) -> tuple:
    """Rich columns (rich is imported when the bar is drawn): the description, the bar, ``done/total`` micro-batches,
    ``elapsed • remaining`` and the average micro-batches per second this process ran in the bar's task (after a
    resume, those since the resume)."""
    from datetime import timedelta

    from rich.markup import escape
    from rich.progress import BarColumn, ProgressColumn
    from rich.text import Text

    theme = bar.theme

    def clock(seconds: float | None) -> str:
        return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))

    class CountColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = "--" if task.total is None or task.total == float("inf") else f"{int(task.total)}"
            return Text(f"{int(task.completed)}/{total}", style=theme.batch_progress)

    class TimeColumn(ProgressColumn):
        max_refresh = 0.5  # seconds: no jitter

        def render(self, task: Any) -> Text:
            elapsed = task.finished_time if task.finished else task.elapsed
            return Text(f"{clock(elapsed)} • {clock(task.time_remaining)}", style=theme.time)

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            offset = (bar._epoch_offset or 0) if task.id == bar.train_progress_bar_id else 0
            return Text(_rate(task.completed - offset, task.elapsed), style=theme.processing_speed)

    class DescriptionColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.id != bar.train_progress_bar_id:
                return Text.from_markup(f"[progress.description]{task.description}")
            # a fit resumed mid-epoch makes the training task at its first batch, with no on_train_epoch_start
            description = bar._description
            if description is None:
                description = bar._description = bar.train_description(bar.trainer.current_epoch)
            text = escape(description)
            styled = f"[{theme.description}]{text}" if theme.description else text
            return Text.from_markup(f"[progress.description]{styled}")

    return (DescriptionColumn(),
            BarColumn(complete_style=theme.progress_bar, finished_style=theme.progress_bar_finished,
                      pulse_style=theme.progress_bar_pulse),
            CountColumn(), TimeColumn(), RateColumn())
