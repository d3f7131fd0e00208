"""Static shapes: ``padded_shapes=K`` against the best ``K`` lengths, and the graphs ``torch.compile`` builds in a
2-rank Lightning run.

Run: ``python -m benchmarks.static_shapes`` (smallest: ``--distributions fortunes --ranks 2 --ks 8 --layouts static``)

Plans: each shipped length distribution (every ``lengths_*.npy`` of ``lit_balance/data/lengths``, short and long
documents) capped at ``--max-length``, ``--max-tokens`` slots, ``--ranks`` ranks (1, 8 and 64 by default),
``padded_shapes=K``: epoch 0's real-token fraction as collated (:func:`lit_balance.plan.epoch_shapes`) against the
best ``K`` lengths' (every sample padded to the next chosen length, rows not counted; an exact dynamic program over
every distinct length, here, apart from the library's choice). Graphs: the 2-rank gloo fit of
``tests/ddp/fit_compiled.py`` (the demo LM compiled with ``dynamic=False`` and handed to ``Trainer.fit``, 2 epochs
with validation) per ``--layouts`` (``static``, ``shapesK``, ``free``), graphs counted by a ``CompileCounter``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import LENGTHS_DIR, ROOT, load_lengths, markdown_table, positive_int, write_report
from lit_balance import BalancedBatchSampler
from lit_balance.plan import epoch_shapes

#: Every length distribution shipped in ``lit_balance/data/lengths`` (``lengths_<name>.npy``).
SHIPPED = tuple(sorted(p.name[len("lengths_"):-len(".npy")] for p in LENGTHS_DIR.glob("lengths_*.npy")))


def best_lengths_fraction(lengths: np.ndarray, k: int) -> float:
    """The real-token fraction of the best ``k`` lengths (exact dynamic program, ``O(k x distinct**2)``)."""
    values, counts = np.unique(lengths, return_counts=True)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    slots = values[None, :].astype(np.float64) * (cum[None, 1:] - cum[:-1, None])  # samples i..j padded to j
    slots[np.tril_indices(values.shape[0], -1)] = np.inf
    best = slots[0].copy()
    for _ in range(k - 1):
        best = np.minimum(best, (np.concatenate([[np.inf], best[:-1]])[:, None] + slots).min(axis=0))
    return float(lengths.sum() / best[-1])


def plan_row(lengths: np.ndarray, name: str, max_tokens: int, k: int, num_replicas: int, bound: float) -> dict:
    sampler = BalancedBatchSampler(lengths, max_tokens=max_tokens, padded_shapes=k, num_replicas=num_replicas, rank=0)
    plan = sampler.plan(0)
    shapes = epoch_shapes(plan, lengths, sampler.settings)
    return {"distribution": name, "k": k, "ranks": num_replicas, "real_token_fraction": shapes["real_token_fraction"],
            "bound": bound, "shapes_length_bound": shapes["real_token_fraction_bound"],
            "gap_points": 100 * (bound - shapes["real_token_fraction"]), "distinct_shapes": shapes["distinct_shapes"],
            "micro_batches": int(plan.num_batches)}


def graph_runs(layouts: list[str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    from launch import run_ranks  # launch.py (the repository root)

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: (Path(tmp) / name, [str(Path(tmp) / "cache" / name), name]) for name in layouts}
        [out.mkdir() for out, _ in runs.values()]
        records = run_ranks(ROOT / "tests" / "ddp" / "fit_compiled.py", runs, timeout_s)
    return {name: [{"train_graphs_epoch0": max(f for e, f, *_ in r["train_frames"] if e == 0), "graphs": r["frames"],
                    "train_shapes": len({(s0, s1) for *_, s0, s1 in r["train_frames"]}),
                    "val_shapes": len(r["val_shapes"]), "recompile_limit_hits": r["recompile_limit_hits"],
                    "graph_breaks": r["graph_breaks"]} for r in ranks] for name, ranks in records.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distributions", nargs="+", choices=SHIPPED, default=list(SHIPPED))
    parser.add_argument("--max-length", type=positive_int, default=4096, help="tokens kept per document")
    parser.add_argument("--max-tokens", type=positive_int, default=8192, help="token slots per micro-batch")
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ks", type=positive_int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--layouts", nargs="*", default=["static", "shapes8", "shapes32", "free"],
                        help="compiled 2-rank fits: static, shapesK, free (none: plans only)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit of the compiled fits together")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/static_shapes"))
    args = parser.parse_args(argv)
    for name in args.layouts:
        if name not in ("static", "free") and not (name.startswith("shapes") and name[6:].isdigit()):
            parser.error(f"--layouts: expected static, free or shapesK (K an int), got {name!r}")
    plans = []
    for name in args.distributions:
        lengths = load_lengths(name, args.max_length)
        for k in args.ks:
            bound = best_lengths_fraction(lengths, k)
            plans += [plan_row(lengths, name, args.max_tokens, k, r, bound) for r in args.ranks]
    graphs = graph_runs(args.layouts, args.timeout_s) if args.layouts else {}
    text = markdown_table(["distribution", "K", "ranks", "real-token fraction", "best K lengths", "gap (points)",
                           "distinct shapes", "micro-batches"],
                          [[r["distribution"], str(r["k"]), str(r["ranks"]), f"{r['real_token_fraction']:.4f}",
                            f"{r['bound']:.4f}", f"{r['gap_points']:.2f}", str(r["distinct_shapes"]),
                            str(r["micro_batches"])] for r in plans]) + "\n\n" + markdown_table(
        ["layout", "rank", "graphs after training epoch 0", "graphs at the end", "training shapes", "validation shapes",
         "recompile limit hits", "graph breaks"],
        [[name, str(i), *(str(r[key]) for key in ("train_graphs_epoch0", "graphs", "train_shapes", "val_shapes",
                                                   "recompile_limit_hits", "graph_breaks"))]
         for name, ranks in graphs.items() for i, r in enumerate(ranks)])
    results = {"max_length": args.max_length, "max_tokens": args.max_tokens, "plans": plans, "graphs": graphs}
    write_report(args.output_dir, "benchmarks.static_shapes", argv, results, text)
    print(text)
    return results


if __name__ == "__main__":
    main()
