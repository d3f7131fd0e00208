"""What a fit leaves on disk: the metrics file, the logger's directories, the checkpoint, the plot of the figures."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

__all__ = ["hydra_resume_command", "report_outputs", "run_outputs", "shown_path"]


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_outputs(trainer: L.Trainer, since: float | None = None) -> dict[str, list[Path]]:
    """The files and directories a finished fit wrote, by kind (paths as the Trainer holds them; only those that
    exist; with ``since``, checkpoints modified at or after that time only: a resumed fit's ModelCheckpoint still holds
    the path of the checkpoint it loaded).

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
    out = {kind: [p for p in paths if p.exists()] for kind, paths in out.items()}
    if since is not None:
        out["checkpoint"] = [p for p in out["checkpoint"] if p.stat().st_mtime >= since]
    return out


def report_outputs(trainer: L.Trainer, plot: bool = True, since: float | None = None) -> list[str]:
    """Lines naming what the fit wrote (:func:`run_outputs`); with ``plot=True``, first draws the figures of each
    metrics file into ``training.png`` beside it (:func:`lit_balance.report.save_training_plot`). Rank 0 only.

    Args:
        trainer: the Trainer after ``fit`` returned.
        plot: draw ``training.png``.
        since: the time (``time.time()``) the fit started: checkpoints older than that were not written by it.

    Returns:
        One line per file, e.g. ``metrics file (CSV, the logged figures by step): outputs/train/.../metrics.csv``;
        a line saying that none was kept when the Trainer has no logger or no checkpointing.
    """
    outputs = run_outputs(trainer, since)
    if getattr(trainer, "fast_dev_run", False):
        return ["no metrics file and no checkpoint: fast_dev_run turns the loggers and checkpointing off"]
    lines = [f"metrics file (CSV, the logged figures by step): {shown_path(p)}" for p in outputs["metrics"]]
    lines += [f"logger directory: {shown_path(p)}" for p in outputs["logs"]]
    if not outputs["metrics"] and not outputs["logs"]:
        lines.append("no metrics file: the Trainer has no logger (set trainer.logger)" if not trainer.loggers else
                     "no metrics file: nothing was logged")
    lines += [f"checkpoint: {shown_path(p)}" for p in outputs["checkpoint"]]
    if not outputs["checkpoint"]:
        lines.append("no checkpoint was written: trainer.enable_checkpointing is false, or no checkpoint callback\n"
                     "saved; add lit_balance.callbacks.LastStepCheckpoint to keep the last step however\n"
                     "training ends")
    if plot:
        from lit_balance.report import save_training_plot

        for path in outputs["metrics"]:
            lines.append(f"training figures per rank over steps: {shown_path(save_training_plot(path))}")
    return lines


def hydra_resume_command(script: str, overrides: Sequence[str], ckpt_path: str, max_steps: int | None = None,
                         config_dir: str | None = None, config_name: str | None = None) -> str:
    """The shell command that resumes a Hydra recipe's run from ``ckpt_path``: the run's own overrides (Hydra's
    ``HydraConfig.get().overrides.task``, as typed), less its ``ckpt_path`` and, when ``max_steps`` is given, its
    ``trainer.max_steps``; then ``ckpt_path=<ckpt_path>`` and ``trainer.max_steps=<max_steps>``. Each argument is
    quoted for a POSIX shell where it needs it (``'callbacks=[run_summary]'``).

    Args:
        script: the recipe as it was run, e.g. ``recipes/train.py``.
        overrides: the run's command-line overrides.
        ckpt_path: the checkpoint to resume from.
        max_steps: a new ``trainer.max_steps`` (to train further than a run that reached its own); None keeps the
            run's.
        config_dir, config_name: the run's ``--config-dir`` / ``--config-name`` when given (None: the recipe's own).

    Example:
        >>> hydra_resume_command("recipes/train.py", ["data=arrow", "callbacks=[run_summary]", "ckpt_path=a.ckpt"],
        ...                      "out/last.ckpt", max_steps=80)
        "python recipes/train.py data=arrow 'callbacks=[run_summary]' ckpt_path=out/last.ckpt trainer.max_steps=80"
    """
    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    dropped = {"ckpt_path"} | ({"trainer.max_steps"} if max_steps is not None else set())
    args = [o for o in overrides if key(o) not in dropped]
    args.append(f"ckpt_path={ckpt_path}")
    if max_steps is not None:
        args.append(f"trainer.max_steps={max_steps}")
    flags = [*(["--config-dir", config_dir] if config_dir else []), *(["--config-name", config_name] if config_name else [])]
    return shlex.join(["python", script, *flags, *args])
