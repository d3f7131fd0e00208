"""Per-rank budgets: plans with ``max_tokens=[B, ..., B/2, ...]`` against plans with ``B/2`` on every rank.

Run:
    python -m benchmarks.per_rank_budgets                         # 8 ranks, B = 1024, every shipped distribution
    python -m benchmarks.per_rank_budgets --max-tokens 2048 --ranks 16 --distributions fortunes

How it measures: ``docs/benchmarks.md`` (per-rank budgets).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, load_lengths, markdown_table, positive_int, write_report
from lit_balance import BatchingSettings, CostModel, plan_epoch, plan_stats
from lit_balance.plan import EpochPlan, planner_for

__all__ = ["check_plan", "compare", "main", "mixed_budgets"]

#: The target: U of the mixed world at least this share of the uniform world's (speeds = budget).
U_RATIO_TARGET = 0.95


def mixed_budgets(max_tokens: int, num_replicas: int) -> list[int]:
    """The first half of the ranks at ``max_tokens``, the rest at ``max_tokens // 2``."""
    half = num_replicas // 2
    return [max_tokens] * (num_replicas - half) + [max_tokens // 2] * half


def check_plan(plan: EpochPlan, lengths: np.ndarray, settings: BatchingSettings, num_replicas: int) -> None:
    """Raise AssertionError unless every micro-batch is within its rank's budget and every sample appears once."""
    budgets = np.asarray(settings.rank_max_tokens(num_replicas))
    slots = planner_for(settings).batch_costs(lengths, plan.rows, plan.batch_offsets, settings.pad_to_multiple_of,
                                              CostModel())[1]
    over = slots[plan.assignment] > budgets[None, :]
    if over.any():
        raise AssertionError(f"{int(over.sum())} micro-batch(es) over their rank's budget")
    real = plan.rows[~plan.is_fill]
    if real.shape[0] != lengths.shape[0] or np.unique(real).shape[0] != lengths.shape[0]:
        raise AssertionError("not every sample exactly once")


def _figures(lengths: np.ndarray, settings: BatchingSettings, num_replicas: int, speeds: np.ndarray | None,
             epochs: tuple[int, ...]) -> dict[str, Any]:
    us, steps, fills, seconds = [], set(), [], 0.0
    for epoch in epochs:
        start = time.perf_counter()
        plan = plan_epoch(lengths, settings, num_replicas=num_replicas, epoch=epoch, rank_speeds=speeds)
        seconds += time.perf_counter() - start
        check_plan(plan, lengths, settings, num_replicas)
        stats = plan_stats(plan, lengths, pad_to_multiple_of=settings.pad_to_multiple_of,
                           accumulate_grad_batches=settings.accumulate_grad_batches, planner=planner_for(settings),
                           rank_speeds=speeds)
        us.append(stats.useful_fraction)
        steps.add(plan.num_micro_steps)
        fills.append(int(plan.is_fill.sum()))
    return {"U": min(us), "steps": max(steps), "steps_vary": len(steps) > 1, "fill_rows": max(fills),
            "plan_s": seconds / len(epochs)}


def compare(lengths: np.ndarray, max_tokens: int, num_replicas: int, *, packing: bool, speeds: str,
            epochs: tuple[int, ...] = (0, 1), seed: int = 0) -> dict[str, Any]:
    """Figures of the mixed world against the uniform world at ``max_tokens // 2``.

    Args:
        lengths: int64 ``[num_samples]`` tokens per sample, each within ``max_tokens // 2``.
        max_tokens: ``B``, the larger budget.
        num_replicas: ranks of each world.
        packing: packed (else padded) micro-batches.
        speeds: ``"budget"`` (rank speeds proportional to the budgets) or ``"equal"``.
        epochs: the epochs planned (the lower U and the larger count are kept).
        seed: the settings' seed.

    Returns:
        ``U_mixed``, ``U_half``, ``U_ratio``, ``steps_mixed``, ``steps_half``, ``kappa``, ``steps_ideal``
        (``steps_half / kappa``), ``steps_ratio`` (``steps_mixed / steps_ideal``), fill rows and plan seconds.
    """
    budgets = mixed_budgets(max_tokens, num_replicas)
    mixed = BatchingSettings(max_tokens=budgets, packing=packing, seed=seed)
    half = BatchingSettings(max_tokens=max_tokens // 2, packing=packing, seed=seed)
    rank_speeds = np.asarray(budgets, dtype=np.float64) / max_tokens if speeds == "budget" else None
    a = _figures(lengths, mixed, num_replicas, rank_speeds, epochs)
    b = _figures(lengths, half, num_replicas, None, epochs)
    kappa = sum(budgets) / (num_replicas * (max_tokens // 2))
    ideal = b["steps"] / kappa
    return {"U_mixed": a["U"], "U_half": b["U"], "U_ratio": a["U"] / b["U"], "steps_mixed": a["steps"],
            "steps_half": b["steps"], "kappa": kappa, "steps_ideal": ideal, "steps_ratio": a["steps"] / ideal,
            "fill_rows_mixed": a["fill_rows"], "plan_s_mixed": a["plan_s"], "plan_s_half": b["plan_s"],
            "steps_vary": a["steps_vary"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=positive_int, default=1024, help="B, the larger budget (padded slots)")
    parser.add_argument("--ranks", type=positive_int, default=8, help="ranks (half at B, half at B/2)")
    parser.add_argument("--max-length", type=positive_int, default=None, help="cap on document tokens (default B/2)")
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/per_rank_budgets"),
                        help="results.json goes here")
    args = parser.parse_args(argv)
    cap = args.max_length or args.max_tokens // 2
    rows = []
    start = time.perf_counter()
    for name in args.distributions:
        lengths = load_lengths(name, max_length=cap)
        for packing in (False, True):
            for speeds in ("budget", "equal"):
                r = compare(lengths, args.max_tokens, args.ranks, packing=packing, speeds=speeds)
                rows.append({"distribution": name, "layout": "packed" if packing else "padded", "speeds": speeds,
                             **r, "met": bool(r["U_ratio"] >= U_RATIO_TARGET)})
    elapsed = time.perf_counter() - start
    table = markdown_table(
        ["distribution", "layout", "speeds", "U mixed", "U B/2", "U ratio", "steps mixed", "steps B/2",
         "steps B/2 / kappa", "steps ratio", "fill rows"],
        [[r["distribution"], r["layout"], r["speeds"], f"{r['U_mixed']:.4f}", f"{r['U_half']:.4f}",
          f"{r['U_ratio']:.3f}", str(r["steps_mixed"]), str(r["steps_half"]), f"{r['steps_ideal']:.1f}",
          f"{r['steps_ratio']:.3f}", str(r["fill_rows_mixed"])] for r in rows])
    print(f"max_tokens B={args.max_tokens}, {args.ranks} ranks (half B, half B/2), documents capped at {cap}; "
          f"{elapsed:.1f} s")
    print(table)
    return write_report(args.output_dir, "benchmarks.per_rank_budgets", argv, {"settings": vars(args), "rows": rows,
                                                                    "wall_s": elapsed}, markdown=table)


if __name__ == "__main__":
    main()
