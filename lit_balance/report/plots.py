"""The plan report as PNG plots (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.report.figures import PlanReport

__all__ = ["save_plots"]


def save_plots(report: PlanReport, output_dir: str | Path, *, dpi: int = 80) -> list[Path]:
    """Write ``lengths_histogram.png`` and ``step_cost.png`` into ``output_dir`` (created if missing).

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
    return [hist_path, cost_path]


def _save_png(fig: Any, path: Path, dpi: int) -> None:
    """Save a figure as a small PNG: rendered at ``dpi``, then reduced to a 64-colour palette."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=64).save(path, optimize=True)
