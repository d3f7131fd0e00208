"""DDP batch samplers and packers side by side on real token-length distributions: padding, budget, rank balance,
useful compute, planning time.

Run:
    python -m benchmarks.bench_samplers            # every strategy and workload at 8 and 64 ranks
    python -m benchmarks.bench_samplers --quick    # first 3,000 documents of each distribution, 8 ranks
    python -m benchmarks.bench_samplers --ranks 8 --strategies sort_fill lit_padded --distributions fortunes
    pip install -e ".[bench]"                      # optional peers: transformers, lhotse

Every strategy (the padded and packed peers of :mod:`benchmarks.peers`, and lit_balance's padded and packed plans
for several costs and with static shapes: ``padded_shapes=K``, ``static_packing``) plans epochs 0 and 1 of each
workload (a shipped distribution capped at ``--max-length``; the long-documents workloads capped at
``--max-tokens``) for every rank count, in one process; every figure comes from :func:`lit_balance.plan_stats`,
:func:`lit_balance.plan.batch_persistence` and :func:`lit_balance.plan.epoch_shapes`. How it measures, and the
figures of its runs: ``docs/benchmarks/reports/2026-11-29-samplers.md`` (padded),
``docs/benchmarks/reports/2026-12-02-packed-micro-batches.md`` (packed), ``docs/compiling.md`` (static shapes).
Planning time at scale: ``benchmarks/scale.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import peers
from benchmarks._harness import (DISTRIBUTIONS, load_lengths, markdown_table, positive_int, timed, versions,
                                 write_report)
from benchmarks.peers import BenchConfig, PeerUnavailable, StrategyRun
from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel, EpochPlan
from lit_balance.plan import PLANNERS, RankBatches, batch_persistence, epoch_shapes, plan_stats, planner_for

#: The costs every row is evaluated on (and lit_balance plans for, one strategy each).
COSTS = {"tokens": CostModel(), "attn_1.2e-4": CostModel(linear=1.0, quadratic=1.2e-4),
         "attn_1e-3": CostModel(linear=1.0, quadratic=1e-3)}
#: lit_balance's strategies: name -> (packing, the cost it plans for, other settings).
OURS = {"lit_padded": (False, "tokens", {}), "lit_padded_attn_1e-3": (False, "attn_1e-3", {}),
        **{f"lit_padded_K{k}": (False, "tokens", {"padded_shapes": k}) for k in (8, 16, 32)},
        "lit_packed": (True, "tokens", {}), "lit_packed_attn_1.2e-4": (True, "attn_1.2e-4", {}),
        "lit_packed_attn_1e-3": (True, "attn_1e-3", {}),
        "lit_packed_static": (True, "tokens", {"static_packing": True})}
PADDED_PEERS = {"distributed_fixed": peers.run_distributed_fixed, "hf_length_grouped": peers.run_hf_length_grouped,
                "hf_batch_rebalance": peers.run_hf_batch_rebalance, "lhotse_dynamic": peers.run_lhotse_dynamic,
                "sort_fill": peers.run_sort_fill}
STRATEGIES = (*PADDED_PEERS, *peers.PACKING_PEERS, *OURS)


def lit_sampler(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, *, packing: bool, cost: str,
                **settings: Any) -> BalancedBatchSampler:
    """Rank 0's :class:`lit_balance.BalancedBatchSampler` of ``lengths``, planned for ``COSTS[cost]`` with ``settings``
    (``BatchingSettings`` fields); its ``plan(epoch)`` is every rank's (each rank computes it alone, keeps its part)."""
    settings = BatchingSettings(max_tokens=max_tokens, seed=seed, packing=packing, **settings)
    return BalancedBatchSampler(lengths, settings=settings, num_replicas=num_replicas, rank=0,
                                cost_model=COSTS[cost])


def _whole_plan(plan: Callable[[int], RankBatches | EpochPlan]) -> StrategyRun:
    """A run of a plan of every rank that each rank computes alone (``plan(epoch)``): epoch 0 timed once."""
    epoch0, seconds = timed(lambda: plan(0))
    return StrategyRun({0: epoch0, 1: plan(1)}, [seconds], timing="one plan of all ranks")


def run_strategy(name: str, lengths: np.ndarray, num_replicas: int, cfg: BenchConfig, cuts: Any = None,
                 ) -> StrategyRun:
    """Epochs 0 and 1 of a strategy on ``lengths`` (``cuts``: lhotse's, built once)."""
    if name == "lhotse_dynamic":
        return peers.run_lhotse_dynamic(lengths, num_replicas, cfg, cuts=cuts)
    if name in PADDED_PEERS:
        return PADDED_PEERS[name](lengths, num_replicas, cfg)
    if name in peers.PACKING_PEERS:
        return _whole_plan(lambda e: peers.PACKING_PEERS[name](lengths, cfg.max_tokens, num_replicas, cfg.seed, e))
    packing, cost, settings = OURS[name]  # timed: the sampler built (static shapes chosen) and epoch 0 planned
    (sampler, epoch0), seconds = timed(lambda: (s := lit_sampler(lengths, cfg.max_tokens, num_replicas, cfg.seed,
                                                                 packing=packing, cost=cost, **settings), s.plan(0)))
    return StrategyRun({0: epoch0, 1: sampler.plan(1)}, [seconds], "one plan of all ranks", settings=sampler.settings)


def row_figures(run: StrategyRun, lengths: np.ndarray, max_tokens: int, packed: bool) -> dict[str, Any]:
    """Every figure of one row from epochs 0 and 1 of one strategy (one optimizer step per micro-batch; repeated
    documents count as padding, marked fill rows of lit_balance's plans apart from unmarked repeats); for
    lit_balance's plans also their input shapes as collated (:func:`shape_figures`)."""
    epoch0, lengths = run.batches[0], np.asarray(lengths, dtype=np.int64)
    planner = PLANNERS["packed" if packed else "padded"] if run.settings is None else planner_for(run.settings)
    pad = 1 if run.settings is None else run.settings.pad_to_multiple_of
    stats = {name: plan_stats(epoch0, lengths, cost, planner=planner, max_tokens=max_tokens, pad_to_multiple_of=pad)
             for name, cost in COSTS.items()}
    tok = stats["tokens"]
    counts = tok.rank_micro_batches
    marked = int(epoch0.is_fill.sum()) if isinstance(epoch0, EpochPlan) else 0
    out: dict[str, Any] = {
        "steps_min": int(counts.min()), "steps_max": int(counts.max()),
        "equal_counts": bool(counts.min() == counts.max()),
        "micro_batches": int(counts.sum()), "budget_fill_ratio": tok.budget_fill_ratio(max_tokens),
        "padding_ratio": tok.padding_ratio, "over_budget_ratio": tok.over_budget_ratio(max_tokens),
        "max_batch_tokens": tok.max_batch_tokens, "max_batch_ratio": tok.max_batch_tokens / max_tokens,
        "dropped": tok.dropped_samples, "duplicated_marked": marked,
        "duplicated_unmarked": tok.duplicated_rows - marked,
        "persistence": batch_persistence(epoch0, run.batches[1]), "plan_s": float(sum(run.rank_plan_s)),
        "plan_rank_s": float(max(run.rank_plan_s, default=0.0)), "plan_timing": run.timing, "notes": list(run.notes)}
    for name, st in stats.items():
        imbalance = st.step_imbalance
        out[f"U_{name}"], out[f"U_bound_{name}"] = st.useful_fraction, st.useful_fraction_bound
        out[f"imbalance_{name}_mean"] = float(imbalance.mean()) if imbalance.size else 1.0
        out[f"imbalance_{name}_p99"] = float(np.percentile(imbalance, 99)) if imbalance.size else 1.0
    return out if run.settings is None else {**out, **shape_figures(run.batches, lengths, run.settings)}


def shape_figures(plans: dict[int, EpochPlan], lengths: np.ndarray, settings: BatchingSettings) -> dict[str, Any]:
    """Epoch 0's real-token fraction as collated (real tokens over the token slots of every micro-batch: its
    shape's ``rows x length``, or the packed row), its distinct input shapes (a packed row's counts its
    ``cu_seq_lens`` entries too) and those of epochs 0 and 1 (:func:`lit_balance.plan.epoch_shapes`); with ``K``
    padded shapes, the most that fraction can be (every sample padded to its shape's length, no empty row)."""
    shapes = [epoch_shapes(plans[e], lengths, settings, planner_for(settings)) for e in (0, 1)]
    bound = None
    if isinstance(settings.padded_shapes, tuple):
        edges = np.array([t for _, t in settings.padded_shapes])
        bound = float(lengths.sum() / edges[np.searchsorted(edges, lengths)].sum())
    return {"real_token_fraction": shapes[0]["real_token_fraction"], "distinct_shapes": shapes[0]["distinct_shapes"],
            "distinct_shapes_two_epochs": len(set(shapes[0]["shapes"]) | set(shapes[1]["shapes"])),
            "length_padding_bound": bound}


def collator_check(rank_batches: RankBatches, lengths: np.ndarray) -> dict[str, int]:
    """Run Hugging Face's ``DataCollatorWithFlattening`` on every micro-batch: the longest row it builds, and the
    micro-batches whose row length or ``cu_seq_lens`` differ from the documents' lengths (expected 0)."""
    longest, mismatched = 0, 0
    for batch in (b for rank in rank_batches for b in rank):
        out = peers.flatten_with_collator(batch, lengths)
        n = int(out["input_ids"].shape[1])
        longest = max(longest, n)
        mismatched += n != int(lengths[batch].sum()) or list(np.diff(out["cu_seq_lens_q"])) != lengths[batch].tolist()
    return {"collator_longest_row": longest, "collator_mismatches": mismatched}


def run_row(workload: dict[str, Any], lengths: np.ndarray, name: str, num_replicas: int, cfg: BenchConfig,
            cuts: Any = None) -> dict[str, Any]:
    """One row: plan epochs 0 and 1 of ``name`` (epoch 0 timed), then its figures. A peer that is not installed
    gives a row of that status; one that refuses the inputs (e.g. verl's split with fewer documents than ranks, an
    assertion of a Hugging Face sampler) a row of status ``"refused"`` and the reason."""
    packed = name in peers.PACKING_PEERS or (name in OURS and OURS[name][0])
    planned_for = OURS[name][1] if name in OURS else "verl workload" if name == "kk_balanced" else "-"
    row: dict[str, Any] = {"workload": workload["name"], "strategy": name, "ranks": num_replicas, "packed": packed,
                           "planned_for": planned_for, "fixed_batch_size": cfg.fixed_batch_size}
    try:
        run = run_strategy(name, lengths, num_replicas, cfg, cuts)
    except PeerUnavailable as exc:
        return {**row, "status": exc.status, "reason": exc.reason}
    except (AssertionError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        return {**row, "status": "refused", "reason": f"{type(exc).__name__}: {exc}"}
    row.update(status="ok", reason="", **row_figures(run, lengths, cfg.max_tokens, packed))
    if name == "hf_flattening":
        row.update(docs_per_batch=peers.flattening_batch_size(lengths, cfg.max_tokens),
                   **collator_check(run.batches[0], lengths))
    return row


def window_tradeoff(lengths: np.ndarray, ranks: Sequence[int], windows: Sequence[float], cfg: BenchConfig,
                    ) -> list[dict[str, Any]]:
    """``shuffle_window`` (the knob that trades padding for randomness): padding, U and persistence per value."""
    rows = []
    for num_replicas in ranks:
        for window in windows:
            sampler = lit_sampler(lengths, cfg.max_tokens, num_replicas, cfg.seed, packing=False, cost="tokens",
                                  shuffle_window=window)
            p0, p1 = sampler.plan(0), sampler.plan(1)
            token, attention = (plan_stats(p0, sampler.lengths, COSTS[c]) for c in ("tokens", "attn_1e-3"))
            rows.append({"ranks": num_replicas, "shuffle_window": window, "padding_ratio": token.padding_ratio,
                         "U_token": token.useful_fraction, "U_attention_with_token_plan": attention.useful_fraction,
                         "persistence": batch_persistence(p0, p1)})
    return rows


HEADER = ["strategy", "planned for", "ranks", "steps", "budget fill", "largest / budget", "over budget", "padding",
          "imbalance tok mean / p99", "U tok", "U attn 1.2e-4", "U attn 1e-3", "bound attn 1e-3", "dropped",
          "dup. marked / unmarked", "persistence", "plan s (all / rank)", "real-token fraction as collated (bound)",
          "shapes (epoch / two epochs)"]

LEGEND = """\
steps: micro-batches per rank (bold range: ranks differ, which hangs DDP). budget fill: mean tokens per micro-batch
/ budget (padded: rows x longest; packed: the row's tokens). largest / budget: the largest micro-batch over the
budget. over budget: share of micro-batches past it (bold where any). padding: 1 - real tokens / token slots
(repeated documents count as padding). imbalance: per step, max / mean cost over ranks (a rank without a
micro-batch costs 0). U: real-document cost / sum over micro-steps of (ranks x the slowest rank's cost), for the
token cost CostModel() and the attention costs L + q L^2 (q = 1.2e-4, 1e-3). bound: the most U any plan with as many
micro-steps could reach on the attention cost q = 1e-3. dropped: documents in no micro-batch of epoch 0. dup. marked
/ unmarked: extra rows of repeated documents, marked as fill rows (the loss ignores them) / trained again.
persistence: mean share of a document's epoch-0 batch-mates that are its batch-mates again in epoch 1. plan s:
seconds to produce every rank's epoch 0 in one process / the slowest rank's share (a plan of all ranks, as
lit_balance's, the packers' and lhotse's, is repeated by every rank). Of lit_balance's plans: the real-token fraction
as collated (real tokens / the token slots of each micro-batch's shape; K padded shapes: in brackets the most that K
lengths allow) and the distinct input shapes of epoch 0 / of epochs 0 and 1 (static shapes: what a compiler sees)."""


def fmt_row(r: dict[str, Any]) -> list[str]:
    """The table's cells of one row."""
    head = [r["strategy"], r["planned_for"], str(r["ranks"])]
    if r["status"] != "ok":
        return head + [f"{r['status']}: {r['reason']}"] + [""] * (len(HEADER) - 4)
    steps = str(r["steps_min"]) if r["equal_counts"] else f"**{r['steps_min']}-{r['steps_max']}**"
    over = f"{r['over_budget_ratio']:.3f}"
    return head + [steps, f"{r['budget_fill_ratio']:.3f}", f"{r['max_batch_ratio']:.2f}",
                   f"**{over}**" if r["over_budget_ratio"] else over, f"{r['padding_ratio']:.3f}",
                   f"{r['imbalance_tokens_mean']:.2f} / {r['imbalance_tokens_p99']:.2f}", f"{r['U_tokens']:.4f}",
                   f"{r['U_attn_1.2e-4']:.4f}", f"{r['U_attn_1e-3']:.4f}", f"{r['U_bound_attn_1e-3']:.4f}",
                   str(r["dropped"]), f"{r['duplicated_marked']} / {r['duplicated_unmarked']}",
                   f"{r['persistence']:.3f}", f"{r['plan_s']:.2f} / {r['plan_rank_s']:.3f}"] + ([
        f"{r['real_token_fraction']:.4f}" + ("" if r["length_padding_bound"] is None
                                             else f" ({r['length_padding_bound']:.4f})"),
        f"{r['distinct_shapes']} / {r['distinct_shapes_two_epochs']}"] if "distinct_shapes" in r else ["-", "-"])


def render(results: dict[str, Any]) -> str:
    """The markdown report of a run: a table per workload and the shuffle-window table."""
    out = [f"Wall {results['wall_s']:.0f} s; versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}",
           "", LEGEND, ""]
    for w in results["workloads"]:
        rows = [r for r in results["rows"] if r["workload"] == w["name"]]
        out += [(f"**{w['name']}**: {w['documents']} documents, {w['tokens']} tokens ({w['capped']} capped), budget "
                 f"{results['config']['max_tokens']} tokens per micro-batch per rank, fixed batch size "
                 f"{w['fixed_batch_size']}"), "", markdown_table(HEADER, [fmt_row(r) for r in rows]), ""]
        out += [f"- {r['strategy']}: {r['notes'][0]} (at {r['ranks']} ranks)" for r in rows
                if r["status"] == "ok" and r["notes"] and r["ranks"] == rows[0]["ranks"]] + [""]
    if results["shuffle_window_tradeoff"]:
        out += ["**lit_balance shuffle_window**: padding for randomness (padded plans, token cost)", "", markdown_table(
            ["workload", "ranks", "shuffle_window", "padding", "U tok", "persistence"],
            [[t["workload"], str(t["ranks"]), f"{t['shuffle_window']:g}", f"{t['padding_ratio']:.3f}",
              f"{t['U_token']:.3f}", f"{t['persistence']:.3f}"] for t in results["shuffle_window_tradeoff"]]), ""]
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="first 3,000 documents of each distribution, 8 ranks")
    p.add_argument("--ranks", type=positive_int, nargs="+", default=None, help="rank counts (default 8 64; quick 8)")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="token slots per micro-batch per rank")
    p.add_argument("--max-length", type=positive_int, default=512, help="documents capped at this (short workloads)")
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--long-distributions", nargs="*", choices=DISTRIBUTIONS,
                   default=["stdlib_docstrings", "pydocs_paragraphs"],
                   help="capped at --max-tokens instead (the long-documents workloads); none: skip")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--num-samples", type=positive_int, default=None, help="first N documents of each distribution")
    p.add_argument("--shuffle-windows", type=float, nargs="*", default=[0.0, 0.25, 1.0, 2.0, 4.0],
                   help="lit_balance shuffle_window values of the padding / randomness table (none: skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of every strategy (>= 0)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/bench_samplers"))
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write ``results.md`` and ``results.json``; return the results."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.ranks, args.distributions, args.strategies = (list(dict.fromkeys(v)) if v else v for v in  # drop repeats
                                                       (args.ranks, args.distributions, args.strategies))
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length ({args.max_length}) must be <= --max-tokens ({args.max_tokens}): a capped "
                     "document must fit one micro-batch; lower --max-length or raise --max-tokens")
    ranks = args.ranks or ([8] if args.quick else [8, 64])
    num_samples = args.num_samples or (3000 if args.quick else None)
    start = time.perf_counter()
    workloads = [(f"{d} cap {args.max_length}", d, args.max_length) for d in args.distributions]
    workloads += [(f"{d} cap {args.max_tokens} (long documents)", d, args.max_tokens) for d in args.long_distributions]
    rows, described, tradeoff = [], [], []
    for name, distribution, cap in workloads:
        lengths = load_lengths(distribution, cap, num_samples)
        cfg = BenchConfig(args.max_tokens, args.seed, peers.fixed_batch_size(args.max_tokens, int(lengths.max())))
        described.append({"name": name, "distribution": distribution, "max_length": cap, "documents": int(lengths.size),
                          "tokens": int(lengths.sum()), "fixed_batch_size": cfg.fixed_batch_size,
                          "capped": int((load_lengths(distribution, None, num_samples) > cap).sum())})
        print(f"{name}: {lengths.size} documents", flush=True)
        try:
            cuts = peers.lhotse_cuts(lengths) if "lhotse_dynamic" in args.strategies else None
        except ImportError:
            cuts = None  # run_lhotse_dynamic says it is not installed
        for num_replicas in ranks:
            for strategy in args.strategies:
                rows.append(run_row(described[-1], lengths, strategy, num_replicas, cfg, cuts))
                print("  " + " | ".join(fmt_row(rows[-1])), flush=True)
        if cap == args.max_length:
            tradeoff += [{"workload": name, **t} for t in window_tradeoff(lengths, ranks, args.shuffle_windows, cfg)]
    results = {"versions": versions(), "config": {**vars(args), "ranks": ranks, "num_samples": num_samples,
                                                  "costs": {k: asdict(v) for k, v in COSTS.items()}},
               "workloads": described, "rows": rows, "shuffle_window_tradeoff": tradeoff,
               "wall_s": time.perf_counter() - start}
    report = render(results)
    print("\n" + report)
    return write_report(args.output_dir, "benchmarks.bench_samplers", argv, results, markdown=report)


if __name__ == "__main__":
    main()
