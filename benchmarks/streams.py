"""Streams planned window by window against the same corpus planned whole: the useful compute fraction U, the
micro-batches over budget, the token ids that move between ranks, and the time to plan one window.

Run: ``python -m benchmarks.streams`` (smallest: ``--documents 5000 --ranks 2 --window 1000``)

A stream of ``--documents`` documents whose lengths are drawn (seeded, with replacement) from a shipped real length
distribution, capped at ``--max-length``: planned whole (:func:`lit_balance.plan_epoch`) and in windows of ``--window``
documents (:func:`lit_balance.stream.plan_window`, what every rank of a :class:`~lit_balance.stream.StreamBatches`
computes), for each layout and number of simulated ranks. ``moved_token_share``: the tokens trained by another rank
than the one that tokenized them (``position % ranks``), over all tokens: what the token-id exchange sends. Every rank
reads the whole stream and tokenizes ``1 / ranks`` of it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import load_lengths, markdown_table, positive_int, write_report
from lit_balance import BatchingSettings, plan_epoch
from lit_balance.plan import planner_for, plan_stats
from lit_balance.plan.types import EpochPlan
from lit_balance.stream import plan_window


def windowed(lengths: np.ndarray, settings: BatchingSettings, num_replicas: int, window: int) -> dict[str, Any]:
    """The stream planned window by window, as one plan in stream positions, with the moved tokens and timings."""
    rows, fills, offsets, assignments = [], [], [np.zeros(1, np.int64)], []
    num_rows = num_batches = moved = 0
    seconds = []
    for k, lo in enumerate(range(0, lengths.shape[0], window)):
        part = lengths[lo:lo + window]
        started = time.perf_counter()
        plan = plan_window(part, settings, num_replicas=num_replicas, epoch=0, window=k,
                           last=lo + window >= lengths.shape[0])
        seconds.append(time.perf_counter() - started)
        trainer = np.repeat(np.argsort(plan.assignment.reshape(-1)) % num_replicas, np.diff(plan.batch_offsets))
        real = ~plan.is_fill
        moved += int(part[plan.rows[real]][(plan.rows[real] % num_replicas) != trainer[real]].sum())
        rows.append(plan.rows + lo)
        fills.append(plan.is_fill)
        offsets.append(plan.batch_offsets[1:] + num_rows)
        assignments.append(plan.assignment + num_batches)
        num_rows += plan.rows.shape[0]
        num_batches += plan.num_batches
    whole = EpochPlan(rows=np.concatenate(rows), is_fill=np.concatenate(fills), batch_offsets=np.concatenate(offsets),
                      assignment=np.concatenate(assignments), dropped=np.zeros(0, np.int64),
                      accumulate_grad_batches=settings.accumulate_grad_batches)
    return {"plan": whole, "moved_token_share": moved / int(lengths.sum()), "window_plan_s": float(np.median(seconds)),
            "windows": len(seconds)}


def row(lengths: np.ndarray, layout: str, num_replicas: int, window: int, max_tokens: int) -> dict[str, Any]:
    settings = BatchingSettings(max_tokens=max_tokens, packing=layout == "packed")
    planner = planner_for(settings)
    started = time.perf_counter()
    whole = plan_epoch(lengths, settings, num_replicas=num_replicas, epoch=0)
    whole_s = time.perf_counter() - started
    streamed = windowed(lengths, settings, num_replicas, window)
    stats = {name: plan_stats(plan, lengths, planner=planner, max_tokens=max_tokens)
             for name, plan in (("whole", whole), ("windows", streamed["plan"]))}
    trained = np.sort(streamed["plan"].rows[~streamed["plan"].is_fill])
    return {"layout": layout, "ranks": num_replicas, "window": window,
            "u_whole": stats["whole"].useful_fraction, "u_windows": stats["windows"].useful_fraction,
            "over_budget_windows": int((stats["windows"].batch_padded_tokens > max_tokens).sum()),
            "every_document_once": bool(np.array_equal(trained, np.arange(lengths.shape[0]))),
            "fill_rows_windows": int(streamed["plan"].is_fill.sum()),
            "moved_token_share": streamed["moved_token_share"], "window_plan_s": streamed["window_plan_s"],
            "whole_plan_s": whole_s, "windows": streamed["windows"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distribution", default="pydocs_paragraphs")
    parser.add_argument("--documents", type=positive_int, default=1_000_000)
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[8, 64])
    parser.add_argument("--window", type=positive_int, default=65_536)
    parser.add_argument("--max-tokens", type=positive_int, default=4096)
    parser.add_argument("--max-length", type=positive_int, default=2048)
    parser.add_argument("--layouts", nargs="+", default=["padded", "packed"], choices=["padded", "packed"])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/streams"), help="results.json goes here")
    args = parser.parse_args(argv)
    source = load_lengths(args.distribution, max_length=args.max_length)
    lengths = np.random.default_rng(0).choice(source, size=args.documents).astype(np.int64)
    rows = [row(lengths, layout, r, args.window, args.max_tokens) for layout in args.layouts for r in args.ranks]
    table = markdown_table(
        ["layout", "ranks", "U whole", "U windows", "over budget", "every doc once", "fill rows", "moved tokens",
         "plan a window (s)", "plan whole (s)"],
        [[r["layout"], str(r["ranks"]), f"{r['u_whole']:.4f}", f"{r['u_windows']:.4f}", str(r["over_budget_windows"]),
          str(r["every_document_once"]), str(r["fill_rows_windows"]), f"{r['moved_token_share']:.3f}",
          f"{r['window_plan_s']:.3f}", f"{r['whole_plan_s']:.2f}"] for r in rows])
    results = {"distribution": args.distribution, "documents": args.documents, "window": args.window,
               "max_tokens": args.max_tokens, "max_length": args.max_length, "rows": rows}
    write_report(args.output_dir, "benchmarks.streams", argv, results, markdown=table)
    print(table)
    return results


if __name__ == "__main__":
    main()
