"""The plan report and a training run's logged figures as PNG plots (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.report.figures import PlanReport

__all__ = ["mixture_figure", "read_metrics_csv", "save_mixture_plot", "save_plots", "save_training_plot",
           "training_figure", "training_plot_data"]


def save_plots(report: PlanReport, output_dir: str | Path, *, dpi: int = 80) -> list[Path]:
    """Write ``lengths_histogram.png`` and ``step_cost.png`` into ``output_dir`` (created if missing); for a mixture
    also ``mixture_shares.png`` (:func:`save_mixture_plot`).

    ``lengths_histogram.png``: samples per length (log-spaced bins, log axes) with the edges of the budget's
    length buckets (``max_tokens / k``: ``k`` rows per micro-batch fit at or below the edge).
    ``step_cost.png``: each rank's cost in each optimizer
    step for both plans (one line per rank up to 8 ranks, else the min-max band and the mean).

    Returns:
        The paths written.
    """
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    s = report.settings
    lengths = report.lengths

    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.add_subplot()
    lo, hi = max(int(lengths.min()), 1), int(lengths.max())
    bins = np.unique(np.geomspace(lo, hi + 1, 60).astype(int)) if hi > lo else np.array([lo, lo + 1])
    ax.hist(lengths, bins=bins, color="#4878a8")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo * 0.9, hi * 1.15)
    largest = max(s["max_tokens"]) if isinstance(s["max_tokens"], (list, tuple)) else s["max_tokens"]
    for edge in report.bucket_edges:
        k = round(largest / edge)
        ax.axvline(edge, color="#d08020", lw=0.8, alpha=0.8)
        ax.text(edge, 1.0, f"{k}", transform=ax.get_xaxis_transform(), ha="right", va="top", fontsize=7,
                color="#a06010")
    ax.set_xlabel("tokens per sample (as planned); orange: max_tokens / k, at or below which k rows fit (k on top)",
                  fontsize=8)
    ax.set_ylabel("samples")
    ax.set_title(f"{lengths.size} samples, p50 {int(np.median(lengths))}, p99 {int(np.percentile(lengths, 99))}, "
                 f"max {hi} tokens; max_tokens={s['max_tokens']}", fontsize=10)
    hist_path = output_dir / "lengths_histogram.png"
    _save_png(fig, hist_path, dpi)

    fig = Figure(figsize=(8, 5), layout="constrained")
    axes = fig.subplots(2, 1, sharey=True)
    summary = report.summary()
    top = 1.05 * max(float(report.balanced.rank_cost.max(initial=0)), float(report.baseline.rank_cost.max(initial=0)))
    for ax, stats, key, name in (
            (axes[0], report.balanced, "balanced", "BalancedBatchSampler"),
            (axes[1], report.baseline, "distributed_sampler",
             f"DistributedSampler, batch_size={report.baseline_batch_size}")):
        cost = stats.rank_cost
        steps = np.arange(cost.shape[0])
        if cost.shape[1] <= 8:
            for r in range(cost.shape[1]):
                ax.plot(steps, cost[:, r], lw=0.8, label=f"rank {r}")
        else:
            ax.fill_between(steps, cost.min(axis=1), cost.max(axis=1), alpha=0.4, label="min-max over ranks")
            ax.plot(steps, cost.mean(axis=1), lw=0.8, label="mean over ranks")
        fig_ = summary[key]
        ax.set_title(f"{name}: useful compute {fig_['useful_fraction']:.1%}, padding {fig_['padding_ratio']:.1%}, "
                     f"mean step imbalance {fig_['mean_step_imbalance']:.2f}", fontsize=9)
        ax.set_ylabel(f"cost ({report.cost_unit})", fontsize=8)
        ax.set_ylim(0, top or 1.0)
    axes[0].legend(fontsize=7, loc="lower right", ncols=min(report.balanced.rank_cost.shape[1], 8))
    axes[1].set_xlabel("optimizer step")
    fig.suptitle(f"per-step, per-rank cost: {s['num_replicas']} ranks, max_tokens={s['max_tokens']}", fontsize=10)
    cost_path = output_dir / "step_cost.png"
    _save_png(fig, cost_path, dpi)
    written = [hist_path, cost_path]
    if report.mixture is not None:
        title = f"{s['num_replicas']} ranks, max_tokens={s['max_tokens']}, epoch {s['epoch']}"
        written.append(save_mixture_plot(report.mixture, output_dir / "mixture_shares.png", title=title, dpi=dpi))
    return written


def save_mixture_plot(mixture: dict[str, Any], output_path: str | Path, *, title: str = "", dpi: int = 80) -> Path:
    """Plot each mixture component's realized share of every optimizer step against its target, as a PNG
    (:func:`mixture_figure`).

    Args:
        mixture: :func:`~lit_balance.report.figures.mixture_shares` (or a plan report's ``mixture``).
        output_path: the PNG to write (its directory is created if missing).
        title: what the plan is (ranks, budget), appended to the figure's title.
        dpi: resolution of the PNG.

    Returns:
        The path written.
    """
    fig = mixture_figure(mixture, title=title)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    _save_png(fig, output_path, dpi)
    return output_path


def mixture_figure(mixture: dict[str, Any], *, title: str = "") -> Any:
    """The matplotlib ``Figure`` of :func:`save_mixture_plot`: each component's realized share against its target.

    Top panel: per component, its share of each step's units (the mixture's unit, all ranks) as a solid line over the
    optimizer steps (label ``<name>: max .. pp, p95 .. pp``, its largest and 95th-percentile deviation) and its
    target as a dashed line of the same colour (label ``<name> target``): under a weight schedule
    (``mixture["step_targets"]`` not None) the step's scheduled share, drawn as steps; with fixed weights the
    mixture's share. Bottom panel: each step's share minus its target, in percentage points.

    Args:
        mixture: :func:`~lit_balance.report.figures.mixture_shares` (or a plan report's ``mixture``).
        title: what the plan is (ranks, budget), appended to the figure's title.

    Returns:
        A ``matplotlib.figure.Figure`` (not attached to pyplot).
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = mixture["names"]
    shares = np.asarray(mixture["step_shares"], dtype=np.float64).reshape(-1, len(names))
    steps = np.arange(shares.shape[0])
    scheduled = mixture.get("step_targets") is not None
    if scheduled:
        targets = np.asarray(mixture["step_targets"], dtype=np.float64).reshape(shares.shape)
    else:
        targets = np.broadcast_to(np.asarray(mixture["target"], dtype=np.float64), shares.shape)
    fig = Figure(figsize=(8, 5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    marker = "." if steps.size < 40 else None
    for c, name in enumerate(names):
        line, = top.plot(steps, shares[:, c], lw=1.0, marker=marker,
                         label=f"{name}: max {mixture['max_deviation_pp'][c]:.2f} pp, "
                               f"p95 {mixture['p95_deviation_pp'][c]:.2f} pp")
        top.plot(steps, targets[:, c], color=line.get_color(), ls="--", lw=0.9,
                 drawstyle="steps-mid" if scheduled else "default", label=f"{name} target")
        bottom.plot(steps, 100.0 * (shares[:, c] - targets[:, c]), lw=0.9, color=line.get_color(), marker=marker)
    what = "scheduled share" if scheduled else "target"
    top.set_ylim(0, 1)
    top.set_ylabel(f"share of the step's {mixture['unit'].replace('_', ' ')}\n(dashed: {what})", fontsize=8)
    top.legend(fontsize=7, loc="best", ncols=min(len(names), 3))
    bottom.axhline(0.0, color="black", lw=0.6)
    bottom.set_ylabel(f"share - {what} (pp)", fontsize=8)
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"mixture: realized share per optimizer step against {what}" + (f" ({title})" if title else ""),
                 fontsize=10)
    return fig


def read_metrics_csv(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every column of a metrics file as written by Lightning's ``CSVLogger``, as ``{key: (steps, values)}``.

    The file holds one row per logged point, a ``step`` column and one column per metric key, empty where a row
    does not log that key; each key gets only its own points (float64 ``[n]`` each, in file order).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file without a ``step`` column.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if "step" not in (reader.fieldnames or []):
            raise InputValueError(f"expected a CSVLogger metrics file with a 'step' column, got the columns "
                             f"{reader.fieldnames} in {path}")
        points: dict[str, list[tuple[float, float]]] = {}
        for row in reader:
            step = float(row["step"])
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    points.setdefault(key, []).append((step, float(value)))
    return {key: (np.array([p[0] for p in pts]), np.array([p[1] for p in pts])) for key, pts in points.items()}


#: panels of the training plot: (per-rank key pattern, or global keys, y label)
_TRAINING_PANELS = (
    (r"balance/compute_s_rank(\d+)", "compute s per window\n(forward, backward, optimizer)"),
    (r"balance/data_wait_s_rank(\d+)", "data wait s per window\n(fetching and moving batches)"),
    (r"balance/rank_wait_s_rank(\d+)", "rank wait s per window\n(waiting for the other ranks)"),
    (r"balance/other_s_rank(\d+)", "other s per window (validation,\ncheckpointing, logging, callbacks)"),
    (r"balance/padding_ratio_rank(\d+)", "padding ratio\n(epoch so far)"),
    ("balance/real_tokens_per_s", "real tokens/s (all ranks)"),
)
_STRAGGLER = "balance/straggler_ratio"
#: the straggler axis starts at 1.0 (no straggler) and spans at least this much, so noise is not magnified
STRAGGLER_MIN_SPAN = 0.2


def training_plot_data(metrics: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[str, list[tuple[str, np.ndarray,
                                                                                                     np.ndarray]]]]:
    """What :func:`save_training_plot` draws: per panel, its y label and its series ``(label, steps, values)``.

    ``metrics``: :func:`read_metrics_csv` of a metrics file. Per-rank panels hold one series per rank (``rank 0``,
    ``rank 1``, ... at most 16); the sixth panel holds ``real tokens/s`` and, when logged, ``straggler ratio`` (drawn
    on its own axis). A mixture's file (:class:`lit_balance.callbacks.MixtureMonitor`'s ``train/share/<name>``) adds
    two panels, one series per component: its share of each optimizer step and its real tokens in it. Steps and values
    are those of the file, unchanged.
    """
    panels = []
    for pattern, label in _TRAINING_PANELS:
        ranks = sorted((int(m[1]), key) for key in metrics if (m := re.fullmatch(pattern, key)) and m.groups())
        if ranks:
            series = [(f"rank {r}", *metrics[key]) for r, key in ranks][:16]
        else:
            series = [("real tokens/s", *metrics[pattern])] if pattern in metrics else []
            if pattern == "balance/real_tokens_per_s" and _STRAGGLER in metrics:
                series.append(("straggler ratio", *metrics[_STRAGGLER]))
        panels.append((label, series))
    names = [m[1] for key in metrics if (m := re.fullmatch(r"train/share/(.+)", key))]
    if names:  # a mixture (MixtureMonitor): each component's share and real tokens per optimizer step, all ranks
        panels.append((_SHARE_PANEL, [(name, *metrics[f"train/share/{name}"]) for name in names]))
        panels.append((_TOKENS_PANEL,
                       [(name, *metrics[key]) for name in names if (key := f"train/tokens/{name}") in metrics]))
    return panels


_SHARE_PANEL = "share of each optimizer step\nper component (all ranks)"
_TOKENS_PANEL = "real tokens per optimizer step\nper component (all ranks)"


def save_training_plot(metrics_csv: str | Path, output_path: str | Path | None = None, *, dpi: int = 80) -> Path:
    """Plot a training run's figures per rank over optimizer steps, from its metrics file, as a PNG.

    Reads the file of Lightning's ``CSVLogger`` (:func:`read_metrics_csv`) holding what
    :class:`lit_balance.callbacks.StragglerMonitor` and :class:`lit_balance.callbacks.PaddingRatioMonitor` log, and
    draws six panels over the logged step (Lightning's ``global_step`` at the start of the micro-batch, the step
    ``metrics.csv`` holds for every key): where each rank's time went in each timing window (compute, data wait, rank
    wait and other seconds: ``balance/{compute_s,data_wait_s,rank_wait_s,other_s}_rank{r}``), each rank's padding
    ratio (``balance/padding_ratio_rank{r}``), and real tokens per second of all ranks
    (``balance/real_tokens_per_s``, axis from 0) with the straggler ratio of each window (``balance/straggler_ratio``,
    its own axis from 1.0, spanning at least :data:`STRAGGLER_MIN_SPAN`); for a mixture
    (:class:`lit_balance.callbacks.MixtureMonitor`), two more: each component's share of every optimizer step
    (``train/share/<name>``, axis 0 to 1) and its real tokens in it (``train/tokens/<name>``). Every panel has a
    legend; a panel whose keys were not logged says so. The series are :func:`training_plot_data`'s.

    Args:
        metrics_csv: the ``metrics.csv`` of a ``CSVLogger``.
        output_path: the PNG to write; default ``training.png`` beside ``metrics_csv``.
        dpi: resolution of the PNG.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: no file at ``metrics_csv``.
        ValueError: a file without a ``step`` column.
    """
    output_path = Path(output_path) if output_path is not None else Path(metrics_csv).with_name("training.png")
    fig = training_figure(read_metrics_csv(metrics_csv))
    output_path.parent.mkdir(parents=True, exist_ok=True)
    _save_png(fig, output_path, dpi)
    return output_path


def training_figure(metrics: dict[str, tuple[np.ndarray, np.ndarray]]) -> Any:
    """The matplotlib ``Figure`` that :func:`save_training_plot` saves, from :func:`read_metrics_csv`'s ``metrics``:
    six panels (axes 0-5; eight, 0-7, for a mixture), then the straggler ratio's own axis when logged."""
    from matplotlib.figure import Figure

    panels = training_plot_data(metrics)
    rows = -(-len(panels) // 2)
    fig = Figure(figsize=(10, 8 * rows / 3), layout="constrained")
    axes = fig.subplots(rows, 2, sharex=True).ravel()
    for ax, (label, series) in zip(axes, panels):
        lines = []
        for name, steps, values in series:
            marker = "." if steps.size < 40 else None
            if name == "straggler ratio":
                twin = ax.twinx()
                lines += twin.plot(steps, values, lw=1.0, ls="--", color="black", marker="x" if marker else None,
                                   label=name)
                top = max(1.0 + STRAGGLER_MIN_SPAN, float(np.nanmax(values)) * 1.02 if values.size else 0.0)
                twin.set_ylim(1.0, top)
                twin.set_ylabel("straggler ratio per window\n(max / median compute s)", fontsize=8)
            elif name == "real tokens/s":
                lines += ax.plot(steps, values, lw=1.2, color="black", marker=marker, label=name)
                ax.set_ylim(0, max(float(np.nanmax(values)) * 1.1, 1.0) if values.size else 1.0)
            else:
                lines += ax.plot(steps, values, lw=1.0, marker=marker, label=name)
        if series and series[0][0].startswith("rank "):
            ax.set_ylim(bottom=0)  # after every line: seconds and ratios from 0
        if label == _SHARE_PANEL:
            ax.set_ylim(0, 1)
        elif label == _TOKENS_PANEL and series:
            ax.set_ylim(bottom=0)
        if not series:
            ax.text(0.5, 0.5, "not logged (add the monitor to the callbacks)", transform=ax.transAxes, ha="center",
                    fontsize=8)
        else:
            ax.legend(handles=lines, fontsize=7, loc="best", ncols=min(len(lines), 4))
        ax.set_ylabel(label, fontsize=8)
    for ax in axes[-2:]:
        ax.set_xlabel("step (Lightning's global_step, as in metrics.csv)", fontsize=8)
    loss = metrics.get("train/loss")
    title = "training figures per rank"
    if loss is not None and loss[1].size and math.isfinite(float(loss[1][-1])):
        title += f" (last train/loss {float(loss[1][-1]):.3f} at step {int(loss[0][-1])})"
    fig.suptitle(title, fontsize=10)
    return fig


def _save_png(fig: Any, path: Path, dpi: int) -> None:
    """Save a figure as a small PNG: rendered at ``dpi``, then reduced to a 64-colour palette."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=64).save(path, optimize=True)
