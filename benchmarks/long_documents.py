"""Packed plans of long documents on many ranks: U of whole source and documentation files, with and without the
exchange stage of the packed planner, side by side in one run.

Run:
    python -m benchmarks.long_documents                       # 8 and 64 ranks; budgets 4,096, 16,384, 32,768
    python -m benchmarks.long_documents --ranks 64 --max-tokens 4096

Each document is capped at the budget (as the long-document workloads of ``benchmarks/bench_samplers.py`` are), one
micro-batch per rank and optimizer step, equal rank speeds, epochs 0 and 1. *U*: useful compute fraction
(:attr:`lit_balance.PlanStats.useful_fraction`, real-token cost over the slowest rank's cost times the ranks, summed
over steps) of the plan made for the token cost, under that cost, and of the plan made for an attention cost
(``CostModel(quadratic=1e-4)``), under that cost; *without exchanges*: the same plan with stage 5 of
:mod:`lit_balance.plan.packed` left out. Every plan is checked: each document once, every micro-batch within the
budget, equal counts on every rank. How it measures and its figures: ``docs/benchmarks.md`` (packed plans of long
documents).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from benchmarks._harness import load_lengths, markdown_table, positive_int, write_report
from lit_balance import BatchingSettings, CostModel, plan_epoch, plan_stats
from lit_balance.plan import EpochPlan, planner_for

__all__ = ["LONG_DISTRIBUTIONS", "main", "u_of_plans"]

#: The shipped distributions of whole files (``lit_balance/data/lengths/SOURCE.md``).
LONG_DISTRIBUTIONS = ("stdlib_sources", "linux_docs")
ATTENTION = CostModel(quadratic=1e-4)


def _check(plan: EpochPlan, lengths: np.ndarray, max_tokens: int) -> None:
    real = plan.rows[~plan.is_fill]
    if real.shape[0] != lengths.shape[0] or np.unique(real).shape[0] != lengths.shape[0]:
        raise AssertionError("not every document exactly once")
    tokens = np.add.reduceat(lengths[plan.rows], plan.batch_offsets[:-1]) if plan.rows.size else np.zeros(0)
    if (tokens > max_tokens).any():
        raise AssertionError(f"{int((tokens > max_tokens).sum())} micro-batch(es) over {max_tokens} tokens")


def u_of_plans(lengths: np.ndarray, max_tokens: int, num_replicas: int, exchanges: bool = True,
               epochs: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """U (token and attention cost) of packed plans of ``lengths`` capped at ``max_tokens``, each epoch, and the CPU
    seconds of planning them; ``exchanges=False`` leaves out stage 5 of the packed planner."""
    capped = np.minimum(np.asarray(lengths, dtype=np.int64), max_tokens)
    settings = BatchingSettings(max_tokens=max_tokens, packing=True, seed=0)
    planner = planner_for(settings)
    u_tok, u_att, steps, cpu = [], [], set(), 0.0
    off = mock.patch("lit_balance.plan.packed._polish", lambda length, cost, bin_of, *args: bin_of)
    with contextlib.nullcontext() if exchanges else off:
        for epoch in epochs:
            for cost, out in ((None, u_tok), (ATTENTION, u_att)):
                start = time.process_time()
                plan = plan_epoch(capped, settings, num_replicas=num_replicas, epoch=epoch, cost_model=cost)
                cpu += time.process_time() - start
                _check(plan, capped, max_tokens)
                steps.add(plan.num_micro_steps)
                out.append(plan_stats(plan, capped, cost, planner=planner, max_tokens=max_tokens).useful_fraction)
    return {"u_tokens": [float(u) for u in u_tok], "u_attention": [float(u) for u in u_att],
            "micro_steps": sorted(steps), "plan_cpu_s": cpu}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=positive_int, nargs="*", default=[8, 64], help="numbers of ranks")
    p.add_argument("--max-tokens", type=positive_int, nargs="*", default=[4096, 16384, 32768],
                   help="budgets (tokens per micro-batch per rank); documents are capped at each")
    p.add_argument("--distributions", nargs="*", choices=LONG_DISTRIBUTIONS, default=list(LONG_DISTRIBUTIONS))
    p.add_argument("--output-dir", type=Path, default=Path("outputs/long_documents"), help="results.json goes here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a markdown table; write ``results.json`` and ``results.md``; return the results."""
    args = _parser().parse_args(argv)
    rows = []
    for name in args.distributions:
        lengths = load_lengths(name)
        for max_tokens in args.max_tokens:
            for num_replicas in args.ranks:
                new = u_of_plans(lengths, max_tokens, num_replicas)
                old = u_of_plans(lengths, max_tokens, num_replicas, exchanges=False)
                rows.append({"distribution": name, "documents": int(lengths.shape[0]), "max_tokens": max_tokens,
                             "capped_documents": int((lengths >= max_tokens).sum()), "ranks": num_replicas,
                             **new, **{f"without_exchanges_{k}": v for k, v in old.items()}})
    table = markdown_table(
        ["distribution", "budget", "ranks", "micro-steps", "U tokens (epochs 0, 1)", "without exchanges",
         "U attention", "without exchanges", "plan CPU s (4 plans)", "without exchanges"],
        [[r["distribution"], f"{r['max_tokens']:,}", str(r["ranks"]), "/".join(map(str, r["micro_steps"])),
          ", ".join(f"{u:.4f}" for u in r["u_tokens"]),
          ", ".join(f"{u:.4f}" for u in r["without_exchanges_u_tokens"]),
          ", ".join(f"{u:.4f}" for u in r["u_attention"]),
          ", ".join(f"{u:.4f}" for u in r["without_exchanges_u_attention"]),
          f"{r['plan_cpu_s']:.2f}", f"{r['without_exchanges_plan_cpu_s']:.2f}"] for r in rows])
    print(table)
    return write_report(args.output_dir, "benchmarks.long_documents", argv, {"rows": rows}, markdown=table)


if __name__ == "__main__":
    main()
