"""Static shapes: how close ``padded_shapes=K`` comes to the best ``K`` lengths, and the graphs ``torch.compile``
builds in a 2-rank Lightning run.

Run:
    python -m benchmarks.static_shapes                                   # everything (about 4 minutes on 2 cores)
    python -m benchmarks.static_shapes --distributions fortunes --ranks 2 --ks 8 --layouts static   # smallest

Plans (no training): each shipped real length distribution capped at ``--max-length`` tokens, ``max_tokens``
slots per micro-batch, ``--ranks`` ranks, ``padded_shapes=K`` for each ``--ks``: epoch 0's real-token fraction as
collated (real tokens over the slots of every micro-batch's shape, :func:`lit_balance.plan.epoch_shapes`) against
the bound, the real-token fraction of the best ``K`` lengths (every sample padded to the next chosen length, rows
per shape not counted: an exact dynamic program over every distinct length, computed here independently of the
library's own choice), and the shapes' own length bound (the library's chosen lengths, no empty row).

Graphs: the 2-rank gloo fit of ``tests/ddp/fit_compiled.py`` (the demo LM, ``torch.compile(model, dynamic=False)``
handed to ``Trainer.fit``, 2 epochs with validation, ``max_tokens=256``) for each ``--layouts``: ``static``
(``static_packing``), ``shapesK`` (``padded_shapes=K``), ``free`` (padded, free shapes); graphs counted by a
``CompileCounter`` backend: after the first training epoch (training only), at the end, and the times dynamo hit
its recompile limit (then the step runs eagerly).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, ROOT, load_lengths, markdown_table, positive_int, write_report
from lit_balance import BalancedBatchSampler
from lit_balance.plan import epoch_shapes

OUTPUT = ROOT / "docs" / "benchmarks" / "static_shapes"
LAYOUTS = ("static", "shapes8", "shapes32", "free")


def best_lengths_fraction(lengths: np.ndarray, k: int) -> float:
    """The real-token fraction of the best ``k`` lengths for ``lengths``: every sample padded up to the next chosen
    length, rows not counted (an exact dynamic program over every distinct length, ``O(k x distinct**2)``)."""
    values, counts = np.unique(lengths, return_counts=True)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    n = values.shape[0]
    slots = values[None, :].astype(np.float64) * (cum[None, 1:] - cum[:n, None])
    slots[np.tril_indices(n, -1)] = np.inf
    best = slots[0].copy()
    for _ in range(k - 1):
        best = np.minimum(best, (np.concatenate([[np.inf], best[:-1]])[:, None] + slots).min(axis=0))
    return float(lengths.sum() / best[-1])


def plan_rows(distributions, max_length: int, max_tokens: int, ranks, ks) -> list[dict[str, Any]]:
    rows = []
    for name in distributions:
        lengths = load_lengths(name, max_length)
        for k in ks:
            bound = best_lengths_fraction(lengths, k)
            for num_replicas in ranks:
                sampler = BalancedBatchSampler(lengths, max_tokens=max_tokens, padded_shapes=k,
                                               num_replicas=num_replicas, rank=0)
                shapes = epoch_shapes(sampler.plan(0), lengths, sampler.settings)
                rows.append({"distribution": name, "max_length": max_length, "max_tokens": max_tokens, "k": k,
                             "ranks": num_replicas, "real_token_fraction": shapes["real_token_fraction"],
                             "bound": bound, "shapes_length_bound": shapes["real_token_fraction_bound"],
                             "gap_points": 100 * (bound - shapes["real_token_fraction"]),
                             "distinct_shapes": shapes["distinct_shapes"],
                             "micro_batches": int(sampler.plan(0).num_batches)})
    return rows


def graph_rows(layouts, timeout_s: float) -> dict[str, Any]:
    from launch import run_ranks  # launch.py (the repository root)

    script = ROOT / "tests" / "ddp" / "fit_compiled.py"
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: (Path(tmp) / name, [str(Path(tmp) / "cache" / name), name]) for name in layouts}
        for out, _ in runs.values():
            out.mkdir(parents=True)
        start = time.perf_counter()
        records = run_ranks(script, runs, timeout_s)
        wall = time.perf_counter() - start
    out = {}
    for name, ranks in records.items():
        out[name] = [{"train_graphs_epoch0": max(f for e, f, *_ in r["train_frames"] if e == 0),
                      "graphs": r["frames"], "train_shapes": len({(a, b) for *_, a, b in r["train_frames"]}),
                      "val_shapes": len(r["val_shapes"]), "declared_shapes": len(r["declared"]),
                      "recompile_limit_hits": r["recompile_limit_hits"], "graph_breaks": r["graph_breaks"],
                      "val_loss": r["val_loss"]} for r in ranks]
    return {"runs": out, "wall_s": wall}


def markdown(plans: list[dict[str, Any]], graphs: dict[str, Any] | None) -> str:
    text = markdown_table(
        ["distribution", "cap", "max_tokens", "K", "ranks", "real-token fraction", "best K lengths (bound)",
         "gap (points)", "distinct shapes", "micro-batches"],
        [[r["distribution"], str(r["max_length"]), str(r["max_tokens"]), str(r["k"]), str(r["ranks"]),
          f"{r['real_token_fraction']:.4f}", f"{r['bound']:.4f}", f"{r['gap_points']:.2f}", str(r["distinct_shapes"]),
          str(r["micro_batches"])] for r in plans])
    if graphs:
        text += "\n\n" + markdown_table(
            ["layout", "rank", "graphs after training epoch 0", "graphs at the end (with validation)",
             "training shapes", "validation shapes", "recompile limit hit", "graph breaks"],
            [[name, str(i), str(r["train_graphs_epoch0"]), str(r["graphs"]), str(r["train_shapes"]),
              str(r["val_shapes"]), str(r["recompile_limit_hits"]), str(r["graph_breaks"])]
             for name, ranks in graphs["runs"].items() for i, r in enumerate(ranks)])
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    parser.add_argument("--max-length", type=positive_int, default=4096, help="tokens kept per document")
    parser.add_argument("--max-tokens", type=positive_int, default=8192, help="token slots per micro-batch")
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--ks", type=positive_int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS),
                        help="compiled 2-rank fits: static, shapesK, free (none: plans only)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit of the compiled fits together")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: docs/benchmarks/static_shapes/DATE")
    args = parser.parse_args(argv)
    for name in args.layouts:
        if name not in ("static", "free") and not (name.startswith("shapes") and name[6:].isdigit()):
            parser.error(f"--layouts: expected static, free or shapesK (K an int), got {name!r}")
    plans = plan_rows(args.distributions, args.max_length, args.max_tokens, args.ranks, args.ks)
    graphs = graph_rows(args.layouts, args.timeout_s) if args.layouts else None
    output = args.output_dir or OUTPUT / time.strftime("%Y-%m-%d")
    results = {"plans": plans, "graphs": graphs}
    write_report(output, "benchmarks.static_shapes", argv, results, markdown(plans, graphs))
    print(markdown(plans, graphs))
    return results


if __name__ == "__main__":
    main()
