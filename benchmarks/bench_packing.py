"""Packed micro-batches: lit_balance's packed plans beside the packing peers on real length distributions.

Run:
    python -m benchmarks.bench_packing            # every workload at 8 and 64 ranks, plan time of 1M documents
    python -m benchmarks.bench_packing --quick    # first 3,000 documents, 8 ranks, 200,000 documents timed

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-02-packed-micro-batches.md``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, load_lengths, markdown_table, positive_int, timed, versions, write_report
from benchmarks.packing_peers import PACKING_PEERS, flatten_with_collator, flattening_batch_size
from lit_balance.plan import PLANNERS
from lit_balance import BatchingSettings, CostModel, EpochPlan, plan_epoch
from lit_balance.plan import RankBatches, batch_persistence, plan_stats

#: The costs every row is evaluated on (and lit_balance plans for, one row each).
COSTS = {"tokens": CostModel(), "attn_1.2e-4": CostModel(linear=1.0, quadratic=1.2e-4),
         "attn_1e-3": CostModel(linear=1.0, quadratic=1e-3)}
#: lit_balance rows: name -> (packing, the cost it plans for).
OURS = {"lit_packed": (True, "tokens"), "lit_packed_attn_1.2e-4": (True, "attn_1.2e-4"),
        "lit_packed_attn_1e-3": (True, "attn_1e-3"), "lit_padded": (False, "tokens"),
        "lit_padded_attn_1e-3": (False, "attn_1e-3")}
STRATEGIES = (*PACKING_PEERS, *OURS)


@dataclass(frozen=True)
class Workload:
    """One length array and budget: ``distribution`` capped at ``max_length``, ``max_tokens`` per micro-batch."""

    name: str
    distribution: str
    max_length: int
    max_tokens: int
    long_documents: bool


def lit_plan(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, epoch: int, *, packing: bool,
             cost: str) -> EpochPlan:
    """lit_balance's plan of one epoch (:func:`lit_balance.plan_epoch`), packed or padded, for ``COSTS[cost]``."""
    settings = BatchingSettings(max_tokens=max_tokens, seed=seed, packing=packing)
    return plan_epoch(lengths, settings, num_replicas=num_replicas, epoch=epoch, cost_model=COSTS[cost])


def strategy(name: str) -> tuple[Callable[[np.ndarray, int, int, int, int], RankBatches | EpochPlan], bool, str]:
    """``(plan(lengths, max_tokens, num_replicas, seed, epoch), packed, planned for)`` of a strategy name."""
    if name in PACKING_PEERS:
        return PACKING_PEERS[name], True, "verl workload" if name == "kk_balanced" else "-"
    packing, cost = OURS[name]
    return (lambda *args: lit_plan(*args, packing=packing, cost=cost)), packing, cost


def row_figures(epochs: Sequence[RankBatches | EpochPlan], lengths: np.ndarray, max_tokens: int, packed: bool,
                ) -> dict[str, Any]:
    """Every figure of one row from epochs 0 and 1 of one strategy (all from :func:`lit_balance.plan_stats` and
    :func:`lit_balance.plan.batch_persistence`)."""
    planner = PLANNERS["packed" if packed else "padded"]
    stats = {name: plan_stats(epochs[0], lengths, cost, planner=planner, max_tokens=max_tokens)
             for name, cost in COSTS.items()}
    tok = stats["tokens"]
    counts = tok.rank_micro_batches
    marked = int(epochs[0].is_fill.sum()) if isinstance(epochs[0], EpochPlan) else 0
    out = {
        "steps_min": int(counts.min()), "steps_max": int(counts.max()),
        "equal_counts": bool(counts.min() == counts.max()),
        "budget_fill_ratio": tok.budget_fill_ratio(max_tokens), "padding_ratio": tok.padding_ratio,
        "over_budget_ratio": tok.over_budget_ratio(max_tokens), "max_batch_tokens": tok.max_batch_tokens,
        "max_batch_ratio": tok.max_batch_tokens / max_tokens,
        "dropped": tok.dropped_samples, "duplicated_marked": marked,
        "duplicated_unmarked": tok.duplicated_rows - marked,
        "persistence": batch_persistence(epochs[0], epochs[1]),
    }
    for name, st in stats.items():
        out[f"U_{name}"] = st.useful_fraction
        out[f"U_bound_{name}"] = st.useful_fraction_bound
        out[f"imbalance_{name}_mean"] = float(st.step_imbalance.mean()) if st.step_imbalance.size else 1.0
    return out


def collator_check(rank_batches: RankBatches, lengths: np.ndarray) -> dict[str, int]:
    """Run Hugging Face's ``DataCollatorWithFlattening`` on every micro-batch: the longest row it builds, and the
    micro-batches whose row length or ``cu_seq_lens`` differ from the documents' lengths (expected 0)."""
    longest, mismatched = 0, 0
    for batch in (b for rank in rank_batches for b in rank):
        out = flatten_with_collator(batch, lengths)
        n = int(out["input_ids"].shape[1])
        longest = max(longest, n)
        mismatched += n != int(lengths[batch].sum()) or list(np.diff(out["cu_seq_lens_q"])) != lengths[batch].tolist()
    return {"collator_longest_row": longest, "collator_mismatches": mismatched}


def run_row(workload: Workload, lengths: np.ndarray, name: str, num_replicas: int, seed: int) -> dict[str, Any]:
    """One row: plan epochs 0 and 1 of ``name`` (epoch 0 timed), then its figures.

    A strategy that refuses the inputs (``ValueError``, e.g. verl's split with fewer documents than ranks) gives a
    row of status ``"refused"`` and the reason instead of figures.
    """
    row: dict[str, Any] = {"workload": workload.name, "strategy": name, "ranks": num_replicas,
                           "long_documents": workload.long_documents}
    plan, packed, planned_for = strategy(name)
    row.update(packed=packed, planned_for=planned_for)
    try:
        epoch0, seconds = timed(lambda: plan(lengths, workload.max_tokens, num_replicas, seed, 0))
        epoch1 = plan(lengths, workload.max_tokens, num_replicas, seed, 1)
    except ValueError as exc:
        return {**row, "status": "refused", "reason": str(exc)}
    row.update(status="ok", plan_s=seconds, **row_figures((epoch0, epoch1), lengths, workload.max_tokens, packed))
    if name == "hf_flattening":
        row.update(docs_per_batch=flattening_batch_size(lengths, workload.max_tokens),
                   **collator_check(epoch0, lengths))
    return row


def _clocked(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of one call of ``fn``, the garbage collector paused."""
    cpu = time.process_time()
    _, wall = timed(fn)
    return wall, time.process_time() - cpu


def plan_seconds_per_million(pool: np.ndarray, num_documents: int, ranks: Sequence[int], max_tokens: int, seed: int,
                             repeats: int) -> list[dict[str, Any]]:
    """lit_balance's planning time of ``num_documents`` lengths drawn from ``pool``, scaled to a million: packed and,
    side by side as a reference for the machine's load, padded; wall and CPU seconds, each the best of ``repeats``
    (one plan of all ranks, which every rank computes alone)."""
    big = np.random.default_rng(seed).choice(pool, num_documents)
    rows = []
    for num_replicas in ranks:
        for packing, cost in ((True, "tokens"), (True, "attn_1e-3"), (False, "tokens")):
            def plan(packing: bool = packing, cost: str = cost, num_replicas: int = num_replicas) -> EpochPlan:
                return lit_plan(big, max_tokens, num_replicas, seed, 0, packing=packing, cost=cost)

            clocks = [_clocked(plan) for _ in range(repeats)]
            wall, cpu = min(c[0] for c in clocks), min(c[1] for c in clocks)
            rows.append({"ranks": num_replicas, "packing": packing, "cost": cost, "status": "ok",
                         "documents": num_documents, "plan_s": wall, "plan_cpu_s": cpu,
                         "plan_s_per_million": wall * 1e6 / num_documents,
                         "plan_cpu_s_per_million": cpu * 1e6 / num_documents})
    return rows


# Tables.


HEADER = ["strategy", "planned for", "ranks", "steps", "budget fill", "largest / budget", "over budget", "padding",
          "U tok", "U attn 1.2e-4", "U attn 1e-3", "bound attn 1e-3", "dropped", "dup. marked / unmarked",
          "persistence", "plan s"]


def _fmt_row(r: dict[str, Any]) -> list[str]:
    head = [r["strategy"], r["planned_for"], str(r["ranks"])]
    if r["status"] != "ok":
        return head + [f"{r['status']}: {r['reason']}"] + [""] * (len(HEADER) - 4)
    steps = str(r["steps_min"]) if r["equal_counts"] else f"**{r['steps_min']}-{r['steps_max']}**"
    over = f"{r['over_budget_ratio']:.3f}"
    return head + [steps, f"{r['budget_fill_ratio']:.3f}", f"{r['max_batch_ratio']:.2f}",
                   f"**{over}**" if r["over_budget_ratio"] else over, f"{r['padding_ratio']:.3f}",
                   f"{r['U_tokens']:.4f}", f"{r['U_attn_1.2e-4']:.4f}", f"{r['U_attn_1e-3']:.4f}",
                   f"{r['U_bound_attn_1e-3']:.4f}", str(r["dropped"]),
                   f"{r['duplicated_marked']} / {r['duplicated_unmarked']}", f"{r['persistence']:.3f}",
                   f"{r['plan_s']:.2f}"]


LEGEND = """\
steps: micro-batches per rank (bold range: ranks differ, which hangs DDP). budget fill: mean tokens per micro-batch
/ budget (packed: the row's tokens; padded: rows x longest). largest / budget: the largest micro-batch over the
budget. over budget: share of micro-batches past the budget (bold where any). padding: 1 - real tokens / token
slots (packed rows: repeated documents only). U: real-document cost / sum over micro-steps of (ranks x the slowest
rank's cost), for the token cost and the attention costs. bound: lit_balance.useful_fraction_bound, the most U any
plan with as many micro-steps could reach on the attention cost q = 1e-3. dropped: documents in no micro-batch of
epoch 0. dup. marked / unmarked: extra rows of repeated documents, marked as fill rows (the loss ignores them) /
trained again. persistence: mean share of a document's epoch-0 batch-mates that are its batch-mates again in epoch 1.
plan s: seconds to plan epoch 0 for every rank in one process (lit_balance, FFD, KK and the greedy packs are one
global computation that every rank repeats; DistributedSampler-based peers split theirs over ranks)."""


def render(results: dict[str, Any]) -> str:
    """The markdown report of a run: a table per workload and the plan time per million documents."""
    out = [f"Wall {results['wall_s']:.0f} s; versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}",
           "", LEGEND, ""]
    for w in results["workloads"]:
        rows = [r for r in results["rows"] if r["workload"] == w["name"]]
        out += [(f"**{w['name']}**: {w['documents']} documents, {w['tokens']} tokens, capped at {w['max_length']} "
                f"({w['capped']} capped), budget {w['max_tokens']} tokens per micro-batch per rank"), "",
                markdown_table(HEADER, [_fmt_row(r) for r in rows]), ""]
    if results["plan_seconds_per_million"]:
        out += [("**lit_balance planning time** (documents drawn from every shipped distribution, capped at "
                f"{results['config']['max_length']}; best of the repeats; the padded planner side by side as a "
                "reference for the machine's load; CPU: this process's CPU time)"), "", markdown_table(
                    ["ranks", "plan", "planned for", "documents", "wall s per million", "CPU s per million"],
                    [[str(m["ranks"]), "packed" if m["packing"] else "padded", m["cost"], str(m.get("documents", "-")),
                      f"{m['plan_s_per_million']:.2f}" if m["status"] == "ok" else m["status"],
                      f"{m['plan_cpu_s_per_million']:.2f}" if m["status"] == "ok" else "-"]
                     for m in results["plan_seconds_per_million"]]), ""]
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="first 3,000 documents of each distribution, 8 ranks, 200,000 documents timed once")
    p.add_argument("--ranks", type=positive_int, nargs="+", default=None, help="rank counts (default 8 64; quick 8)")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="tokens per micro-batch per rank")
    p.add_argument("--max-length", type=positive_int, default=512, help="documents capped at this (short workloads)")
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--long-distributions", nargs="*", choices=DISTRIBUTIONS,
                   default=["stdlib_docstrings", "pydocs_paragraphs"],
                   help="capped at --max-tokens instead (the long-documents workload); none: skip")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--num-samples", type=positive_int, default=None, help="first N documents of each distribution")
    p.add_argument("--million", type=positive_int, default=None,
                   help="documents in the planning-time run (default 1,000,000; quick 200,000)")
    p.add_argument("--skip-million", action="store_true", help="skip the planning-time run")
    p.add_argument("--seed", type=int, default=0, help="seed of every strategy (>= 0)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/bench_packing"))
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write ``results.md`` and ``results.json``; return the results."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length ({args.max_length}) must be <= --max-tokens ({args.max_tokens}): a capped "
                     "document must fit one micro-batch")
    ranks = args.ranks or ([8] if args.quick else [8, 64])
    num_samples = args.num_samples or (3000 if args.quick else None)
    million = args.million or (200_000 if args.quick else 1_000_000)
    start = time.perf_counter()
    workloads = [Workload(f"{d} cap {args.max_length}", d, args.max_length, args.max_tokens, False)
                 for d in args.distributions]
    workloads += [Workload(f"{d} cap {args.max_tokens} (long documents)", d, args.max_tokens, args.max_tokens, True)
                  for d in args.long_distributions]
    rows, described = [], []
    for w in workloads:
        lengths = load_lengths(w.distribution, w.max_length, num_samples)
        raw = load_lengths(w.distribution, 1 << 40, num_samples)
        described.append({**asdict(w), "documents": int(lengths.size), "tokens": int(lengths.sum()),
                          "capped": int((raw > w.max_length).sum())})
        print(f"{w.name}: {lengths.size} documents", flush=True)
        for num_replicas in ranks:
            for name in args.strategies:
                row = run_row(w, lengths, name, num_replicas, args.seed)
                rows.append(row)
                print("  " + " | ".join(_fmt_row(row)), flush=True)
    pool = np.concatenate([load_lengths(d, args.max_length) for d in DISTRIBUTIONS])
    per_million = ([] if args.skip_million else
                   plan_seconds_per_million(pool, million, ranks, args.max_tokens, args.seed, 1 if args.quick else 3))
    results = {
        "versions": versions(),
        "config": {**vars(args), "ranks": ranks, "num_samples": num_samples, "million": million,
                   "costs": {k: asdict(v) for k, v in COSTS.items()}},
        "workloads": described, "rows": rows, "plan_seconds_per_million": per_million,
        "wall_s": time.perf_counter() - start,
    }
    report = render(results)
    print("\n" + report)
    return write_report(args.output_dir, "benchmarks.bench_packing", argv, results, markdown=report)


if __name__ == "__main__":
    main()
