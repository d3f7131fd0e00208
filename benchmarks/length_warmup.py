"""Length warm-up by pieces against warm-up by truncation: U per stage, tokens discarded, on real lengths.

A warm-up 256 -> 4096 tokens over the first 10 % of an epoch's optimizer steps (doubling stages, or a linear ramp),
8 ranks, ``max_tokens`` 4096 per micro-batch, 2 micro-batches per rank per optimizer step (64k-token steps), each
distribution repeated to about 30M tokens. For every stage of constant planned length: the optimizer steps, U
(real tokens over the slowest rank's cost per step times the ranks; padded cost = padded slots, packed = tokens),
micro-batches over budget, and the tokens a truncating warm-up (composer's ``SeqLengthWarmup``, DeepSpeed's
curriculum) would discard from the same documents. Plans only: nothing is trained.

Run:
    python -m benchmarks.length_warmup            # about a minute
    python -m benchmarks.length_warmup --tokens 2000000 --distributions fortunes
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, ROOT, load_lengths, markdown_table, positive_int, write_report
from lit_balance import BatchingSettings, CostModel, plan_length_warmup
from lit_balance.plan import planner_for

OUTPUT_DIR = ROOT / "docs" / "benchmarks" / "length_warmup"
STAGES = (256, 512, 1024, 2048, 4096)


def schedule(kind: str, warm_steps: int):
    """``step -> max_length``: doubling stages 256 .. 2048 over ``warm_steps``, then 4096; or a linear ramp."""
    if kind == "linear":
        return lambda g: int(256 + (4096 - 256) * min(g, warm_steps) / max(warm_steps, 1))
    return lambda g: STAGES[min(g * (len(STAGES) - 1) // max(warm_steps, 1), len(STAGES) - 1)]


def stage_rows(lengths: np.ndarray, packing: bool, kind: str, ranks: int, max_tokens: int, acc: int) -> list[dict]:
    """One row per stage of constant planned length (per quarter of the ramp for ``linear``)."""
    settings = BatchingSettings(max_tokens=max_tokens, accumulate_grad_batches=acc, packing=packing)
    warm = max(1, int(0.1 * lengths.sum() / (max_tokens * ranks * acc)))
    start = time.perf_counter()
    w = plan_length_warmup(lengths, settings, num_replicas=ranks, epoch=0, max_length=schedule(kind, warm))
    plan_s = time.perf_counter() - start
    plan = w.plan
    cost, slots = planner_for(settings).batch_costs(w.piece_length, plan.rows, plan.batch_offsets, 1, CostModel())
    real = plan.real_tokens_per_batch(w.piece_length)
    assert int(real.sum()) == int(lengths.sum()), "a token was lost"
    doc_step = np.full(lengths.shape[0], -1)
    for s in range(plan.num_micro_steps):
        for b in plan.assignment[s]:
            pieces, _ = plan.batch(int(b))
            doc_step[w.piece_doc[pieces]] = s // acc  # the step of a document's last piece
    if kind == "linear":
        edges = [0, warm // 4, warm // 2, 3 * warm // 4, warm, w.num_steps]
    else:
        change = np.flatnonzero(np.diff(w.step_max_length)) + 1
        edges = [0, *change.tolist(), w.num_steps]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi <= lo:
            continue
        micro = np.arange(lo * acc, min(hi * acc, plan.num_micro_steps))
        batches = plan.assignment[micro]
        per_step = np.add.reduceat(cost[batches], np.arange(0, micro.size, acc), axis=0)
        docs = (doc_step >= lo) & (doc_step < hi)
        cut = np.maximum(lengths[docs] - w.step_max_length[doc_step[docs]], 0)
        rows.append({"layout": "packed" if packing else "padded", "schedule": kind, "steps": f"{lo}-{hi - 1}",
                     "max_length": f"{int(w.step_max_length[lo])}..{int(w.step_max_length[hi - 1])}",
                     "u": round(float(real[batches].sum() / (per_step.max(axis=1).sum() * ranks)), 4),
                     "over_budget": int((slots[batches] > max_tokens).sum()),
                     "truncation_discards": int(cut.sum()), "tokens": int(lengths[docs].sum()),
                     "plan_s": round(plan_s, 2)})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distributions", nargs="*", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--tokens", type=positive_int, default=30_000_000, help="tokens per corpus (repeats)")
    p.add_argument("--ranks", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=4096)
    p.add_argument("--accumulate", type=positive_int, default=2)
    p.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = p.parse_args(argv)
    rows = []
    for name in args.distributions:
        lengths = load_lengths(name).astype(np.int64)
        lengths = np.tile(lengths, max(1, args.tokens // int(lengths.sum())))
        for packing in (False, True):
            for kind in ("stages", "linear"):
                for row in stage_rows(lengths, packing, kind, args.ranks, args.max_tokens, args.accumulate):
                    rows.append({"distribution": name, **row})
    headers = ["distribution", "layout", "schedule", "steps", "max_length", "u", "over_budget",
               "truncation_discards", "tokens", "plan_s"]
    markdown = markdown_table(headers, [[f"{r[h]:,}" if isinstance(r[h], int) else str(r[h]) for h in headers]
                                        for r in rows])
    return write_report(args.output_dir, "benchmarks.length_warmup", argv, {"rows": rows}, markdown)


if __name__ == "__main__":
    main()
