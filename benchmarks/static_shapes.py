"""Static shapes on real length distributions: real-token fraction, useful compute and distinct shapes per epoch.

Run:
    python -m benchmarks.static_shapes                 # every workload, 8 ranks
    python -m benchmarks.static_shapes --ranks 64 --output-dir /tmp/static_shapes

For each workload (a shipped length distribution capped at ``--max-length``, budget ``--max-tokens`` token slots per
micro-batch per rank) and each layout, epochs 0 and 1 are planned for ``--ranks`` ranks and measured as collated:

* ``padded free`` / ``packed free``: the default planners (every micro-batch its own shape);
* ``padded K=8/16/32``: ``BatchingSettings(padded_shapes=K)``;
* ``packed static``: ``BatchingSettings(packing=True, static_packing=True)``: every micro-batch ``[1, max_tokens]``,
  ``cu_seq_lens`` of the chosen cap + 1.

Figures (epoch 1, all ranks): real-token fraction (real tokens over the token slots of every micro-batch as
collated: its shape's ``rows x length``, or the packed row), ``U`` (:attr:`lit_balance.plan.PlanStats.useful_fraction`
under the token cost: the ranks' busy share of every optimizer step), distinct input shapes (a packed row's shape
counts its ``cu_seq_lens`` entries too) in the epoch and over both epochs, micro-batches per rank; for K shapes, the
bound of the real-token fraction that the shapes' lengths allow (every sample padded to its shape's length, no empty
row: the least padding of any K lengths, which the shapes are chosen for). Goals: packed
static real-token fraction >= 0.975 and U >= 0.99; padded K=32 real-token fraction >= 0.95.

Writes ``results.json`` and ``results.md`` (command, commit, machine, date) to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, load_lengths, positive_int, write_report
from lit_balance import BatchingSettings, CostModel
from lit_balance.plan import epoch_shapes, plan_epoch, plan_stats, planner_for, resolve_static_shapes

LAYOUTS = {"padded free": {}, "padded K=8": {"padded_shapes": 8}, "padded K=16": {"padded_shapes": 16},
           "padded K=32": {"padded_shapes": 32}, "packed free": {"packing": True},
           "packed static": {"packing": True, "static_packing": True}}


def workloads(max_length: int, max_tokens: int) -> dict[str, np.ndarray]:
    """The shipped distributions capped at ``max_length``, and all three pooled, and stdlib's long documents
    (capped at the budget)."""
    raw = {d: load_lengths(d) for d in DISTRIBUTIONS}
    out = {f"{d} cap {max_length}": np.minimum(v, max_length) for d, v in raw.items()}
    out[f"all three pooled cap {max_length}"] = np.concatenate(list(out.values()))
    out[f"stdlib_docstrings cap {max_tokens} (long documents)"] = np.minimum(raw["stdlib_docstrings"], max_tokens)
    return out


def measure(lengths: np.ndarray, layout: dict, max_tokens: int, ranks: int, seed: int) -> dict:
    """One row: plan epochs 0 and 1 with ``layout``'s settings, the figures of epoch 1 (shapes over both)."""
    settings = resolve_static_shapes(lengths, BatchingSettings(max_tokens=max_tokens, seed=seed, **layout))
    start = time.perf_counter()
    plans = [plan_epoch(lengths, settings, num_replicas=ranks, epoch=e) for e in (0, 1)]
    seconds = time.perf_counter() - start
    shapes = [epoch_shapes(p, lengths, settings) for p in plans]
    bound = None
    if isinstance(settings.padded_shapes, tuple):  # every sample padded to its shape's length, no empty row
        edges = np.array([t for _, t in settings.padded_shapes])
        bound = float(lengths.sum() / edges[np.searchsorted(edges, lengths)].sum())
    stats = plan_stats(plans[1], lengths, CostModel(), pad_to_multiple_of=settings.pad_to_multiple_of,
                       planner=planner_for(settings), max_tokens=max_tokens)
    return {"real_token_fraction": shapes[1]["real_token_fraction"], "U": float(stats.useful_fraction),
            "distinct_shapes": shapes[1]["distinct_shapes"],
            "distinct_shapes_two_epochs": len(set(shapes[0]["shapes"]) | set(shapes[1]["shapes"])),
            "micro_batches_per_rank": plans[1].num_batches // ranks, "over_budget": stats.over_budget_ratio(max_tokens),
            "cap": settings.max_batch_size if settings.static_packing else None,
            "shapes": [list(s) for s in settings.padded_shapes] if settings.padded_shapes else None,
            "length_padding_bound": bound, "plan_s": seconds}


def table(rows: list[dict]) -> str:
    """The Markdown table of every row."""
    lines = ["| workload | layout | real-token fraction | its bound | U | distinct shapes (epoch / two epochs) | "
             "micro-batches per rank |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f" (cap {r['cap']})" if r["cap"] else ""
        bound = "-" if r["length_padding_bound"] is None else f"{r['length_padding_bound']:.4f}"
        lines.append(f"| {r['workload']} | {r['layout']}{note} | {r['real_token_fraction']:.4f} | {bound} | "
                     f"{r['U']:.4f} | "
                     f"{r['distinct_shapes']} / {r['distinct_shapes_two_epochs']} | {r['micro_batches_per_rank']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=positive_int, default=512, help="documents capped at this many tokens")
    parser.add_argument("--max-tokens", type=positive_int, default=4096, help="token slots per micro-batch per rank")
    parser.add_argument("--ranks", type=positive_int, default=8, help="data-parallel ranks (simulated in one process)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/static_shapes"))
    args = parser.parse_args(argv)
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length ({args.max_length}) must be <= --max-tokens ({args.max_tokens})")
    rows = []
    for name, lengths in workloads(args.max_length, args.max_tokens).items():
        for layout, kwargs in LAYOUTS.items():
            row = {"workload": name, "layout": layout, **measure(lengths, kwargs, args.max_tokens, args.ranks,
                                                                  args.seed)}
            rows.append(row)
            print(f"{name:45s} {layout:14s} real-token fraction {row['real_token_fraction']:.4f}  U {row['U']:.4f}  "
                  f"shapes {row['distinct_shapes']}", flush=True)
    text = (f"Static shapes: {args.ranks} ranks, budget {args.max_tokens} token slots per micro-batch per rank\n\n"
            + table(rows))
    return write_report(args.output_dir, "benchmarks.static_shapes", argv, {"settings": vars(args), "rows": rows},
                        markdown=text)


if __name__ == "__main__":
    main()
