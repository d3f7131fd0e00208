"""The plan report as rich tables: each plan per rank, and the epoch's figures side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_balance.report.figures import PlanReport

__all__ = ["format_report", "mixture_table"]


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.5g}"


def format_report(report: PlanReport, title: str = "") -> list[Any]:
    """Rich renderables: a per-rank table for each plan and a table comparing the epoch's figures.

    Per rank: micro-batches, real tokens, padded slots, padding ratio and cost (in ``report.cost_unit``).
    Epoch: padding ratio, epoch rank imbalance (slowest rank's total cost over the mean), mean and worst
    per-step imbalance (max over mean rank cost in one optimizer step), useful compute fraction. For a mixture
    (``report.mixture``), a table of each component's share per optimizer step against its target.
    """
    from rich import box
    from rich.table import Table

    summary = report.summary()
    out: list[Any] = []
    names = (("balanced", "BalancedBatchSampler"),
             ("distributed_sampler", f"DistributedSampler, batch_size={report.baseline_batch_size}"))
    for key, name in names:
        fig = summary[key]
        table = Table(title=f"{name}: per rank, epoch {report.settings['epoch']}", box=box.SIMPLE_HEAD,
                      title_justify="left")
        columns = ("rank", "micro-batches", "real tokens", "padded slots", "padding ratio",
                   f"cost ({report.cost_unit})")
        for col in columns:
            table.add_column(col, justify="right")
        for r in fig["ranks"]:
            table.add_row(str(r["rank"]), str(r["micro_batches"]), str(r["real_tokens"]), str(r["padded_tokens"]),
                          f"{r['padding_ratio']:.4f}", _number(r["cost"]))
        real = sum(r["real_tokens"] for r in fig["ranks"])
        padded = sum(r["padded_tokens"] for r in fig["ranks"])
        table.add_row("total", str(sum(r["micro_batches"] for r in fig["ranks"])), str(real), str(padded),
                      f"{fig['padding_ratio']:.4f}", _number(sum(r["cost"] for r in fig["ranks"])), style="bold")
        out.append(table)
    comparison = Table(title=title or "epoch figures (global)", box=box.SIMPLE_HEAD, title_justify="left")
    comparison.add_column("figure")
    comparison.add_column("BalancedBatchSampler", justify="right")
    comparison.add_column(f"DistributedSampler (batch_size={report.baseline_batch_size})", justify="right")
    rows = (("padding ratio", "padding_ratio", "{:.4f}"),
            ("epoch rank imbalance (max/mean rank cost)", "epoch_rank_imbalance", "{:.4f}"),
            ("mean step imbalance (max/mean per step)", "mean_step_imbalance", "{:.4f}"),
            ("worst step imbalance (max/mean per step)", "max_step_imbalance", "{:.4f}"),
            ("useful compute fraction", "useful_fraction", "{:.4f}"),
            ("its bound for these steps (stats.useful_fraction_bound)", "useful_fraction_bound", "{:.4f}"),
            ("micro-batches per rank", "micro_batches_per_rank", "{}"),
            ("optimizer steps", "optimizer_steps", "{}"),
            (f"largest micro-batch (padded slots, budget {report.settings['max_tokens']})", "max_batch_tokens", "{}"))
    for label, key, fmt in rows:
        comparison.add_row(label, fmt.format(summary["balanced"][key]), fmt.format(summary["distributed_sampler"][key]))
    out.append(comparison)
    if report.shapes is not None:
        out.append(_shapes_table(report.shapes))
    if report.mixture is not None:
        out.append(mixture_table(report.mixture))
    return out


def mixture_table(mixture: dict[str, Any]) -> Any:
    """A rich table of :func:`~lit_balance.report.figures.mixture_shares`: per component its target share, its share
    of the epoch, the smallest and largest share of an optimizer step, and the largest and 95th-percentile deviation
    of a step's share from the target (percentage points), with its units in the epoch (global)."""
    from rich import box
    from rich.table import Table

    shares = np.asarray(mixture["step_shares"], dtype=np.float64).reshape(-1, len(mixture["names"]))
    units = np.asarray(mixture["step_units"], dtype=np.int64).reshape(shares.shape)
    unit = mixture["unit"].replace("_", " ")
    against = ("the target" if mixture.get("step_targets") is None else
               "each step's scheduled share (a weight schedule; target: their mean)")
    table = Table(title=f"mixture: each component's share of {unit} per optimizer step ({shares.shape[0]} steps, "
                        f"all ranks; deviation from {against} in percentage points)",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("component", "target", "epoch share", "min step share", "max step share", "max deviation (pp)",
                "p95 deviation (pp)", f"{unit} (epoch)"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for c, name in enumerate(mixture["names"]):
        low = f"{shares[:, c].min():.4f}" if shares.size else "--"
        high = f"{shares[:, c].max():.4f}" if shares.size else "--"
        table.add_row(name, f"{mixture['target'][c]:.4f}", f"{mixture['epoch_shares'][c]:.4f}", low, high,
                      f"{mixture['max_deviation_pp'][c]:.2f}", f"{mixture['p95_deviation_pp'][c]:.2f}",
                      str(int(units[:, c].sum())))
    return table


def _shapes_table(shapes: dict[str, Any], most: int = 12) -> Any:
    """The input shapes of the balanced plan's micro-batches (rows x tokens), the most used first, and the epoch's
    real-token fraction: what a compiler keeps one program for (docs/compiling.md)."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"BalancedBatchSampler: {shapes['distinct_shapes']} distinct micro-batch shapes this epoch "
                        f"(all ranks), real-token fraction {shapes['real_token_fraction']:.4f}"
                        + ("" if shapes.get("real_token_fraction_bound") is None else
                           f" (bound of the shapes' lengths {shapes['real_token_fraction_bound']:.4f}: every sample "
                           "padded to its shape's length, no empty row)"),
                  box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("shape (rows x tokens)")
    table.add_column("micro-batches", justify="right")
    ranked = sorted(shapes["shapes"].items(), key=lambda kv: (-kv[1], kv[0]))
    for shape, count in ranked[:most]:
        table.add_row(shape, str(count))
    if len(ranked) > most:
        table.add_row(f"... {len(ranked) - most} more", str(sum(c for _, c in ranked[most:])))
    return table
