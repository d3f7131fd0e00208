"""What a fit leaves on disk: the metrics file, the logger's directories, the checkpoint, the plot of the figures."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

__all__ = ["report_outputs", "run_outputs", "shown_path"]


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_outputs(trainer: L.Trainer) -> dict[str, list[Path]]:
    """The files and directories a finished fit wrote, by kind (paths as the Trainer holds them; only those that
    exist).

    Keys: ``metrics`` (each ``CSVLogger``'s ``metrics.csv``), ``logs`` (the directory of every other logger, e.g.
    TensorBoard's event files), ``checkpoint`` (the best or, without a monitored metric, the latest checkpoint of
    each ``ModelCheckpoint``, its ``last.ckpt`` when it keeps one, and the file of a
    :class:`lit_balance.callbacks.LastStepCheckpoint`). Call it after ``trainer.fit`` returns (the
    loggers write their last rows when the fit ends), on global rank 0, which writes them.
    """
    out: dict[str, list[Path]] = {"metrics": [], "logs": [], "checkpoint": []}
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            out["metrics"].append(Path(logger.experiment.metrics_file_path))
        elif getattr(logger, "log_dir", None):
            out["logs"].append(Path(logger.log_dir))
    for callback in trainer.checkpoint_callbacks:
        for name in ("best_model_path", "last_model_path"):
            path = getattr(callback, name, "")
            if path and Path(path) not in out["checkpoint"]:
                out["checkpoint"].append(Path(path))
    return {kind: [p for p in paths if p.exists()] for kind, paths in out.items()}


def report_outputs(trainer: L.Trainer, plot: bool = True) -> list[str]:
    """Lines naming what the fit wrote (:func:`run_outputs`); with ``plot=True``, first draws the figures of each
    metrics file into ``training.png`` beside it (:func:`lit_balance.report.save_training_plot`). Rank 0 only.

    Returns:
        One line per file, e.g. ``metrics file (CSV, one row per logged step): outputs/train/.../metrics.csv``;
        a line saying that none was kept when the Trainer has no logger or no checkpointing.
    """
    outputs = run_outputs(trainer)
    if getattr(trainer, "fast_dev_run", False):
        return ["no metrics file and no checkpoint: fast_dev_run turns the loggers and checkpointing off"]
    lines = [f"metrics file (CSV, one row per logged step): {shown_path(p)}" for p in outputs["metrics"]]
    lines += [f"logger directory: {shown_path(p)}" for p in outputs["logs"]]
    if not outputs["metrics"] and not outputs["logs"]:
        lines.append("no metrics file: the Trainer has no logger (set trainer.logger)" if not trainer.loggers else
                     "no metrics file: nothing was logged")
    lines += [f"checkpoint: {shown_path(p)}" for p in outputs["checkpoint"]]
    if not outputs["checkpoint"]:
        lines.append("no checkpoint was written: trainer.enable_checkpointing is false, or no checkpoint callback\n"
                     "saved; add lit_balance.callbacks.LastStepCheckpoint to keep the last step however training ends")
    if plot:
        from lit_balance.report import save_training_plot

        for path in outputs["metrics"]:
            lines.append(f"training figures per rank over steps: {shown_path(save_training_plot(path))}")
    return lines
