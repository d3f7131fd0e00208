"""Compare DDP batch samplers on real token-length distributions: padding, budget, rank balance, useful compute.

Run:
    python -m benchmarks.bench_samplers                                # 8 and 64 ranks, every strategy
    python -m benchmarks.bench_samplers --ranks 8 --strategies sort_fill lit_balance --distributions fortunes
    pip install -e ".[bench]"                                          # optional peers: transformers, lhotse

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-11-29-samplers.md``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, LENGTHS_DIR, load_lengths, machine, positive_int, timed, write_report
from benchmarks.peers import (
    BenchConfig,
    PeerUnavailable,
    StrategyRun,
    as_lists,
    fixed_batch_size,
    lhotse_cuts,
    per_rank_epochs,
    run_distributed_fixed,
    run_hf_batch_rebalance,
    run_hf_length_grouped,
    run_lhotse_dynamic,
    run_sort_fill,
)
from lit_balance import BalancedBatchSampler, CostModel
from lit_balance.plan import batch_persistence, plan_stats

STRATEGIES = ("distributed_fixed", "hf_length_grouped", "hf_batch_rebalance", "lhotse_dynamic", "sort_fill",
              "lit_balance", "lit_balance_attention")
#: Cost of a micro-batch in padded token slots, and with an attention term (per row ``L + 1e-3 L^2``).
TOKEN_COST = CostModel()
ATTENTION_COST = CostModel(linear=1.0, quadratic=1e-3)
COST_MODELS = {"tokens": TOKEN_COST, "attention": ATTENTION_COST}


# Every strategy is measured from its per-rank lists of micro-batches, by lit_balance.plan_stats.


def sampler_metrics(run: StrategyRun, lengths: np.ndarray, max_tokens: int) -> dict[str, Any]:
    """Every figure of the table for one strategy at one rank count (epoch 0; persistence epoch 0 -> 1).

    All come from :func:`lit_balance.plan_stats` and :func:`lit_balance.plan.batch_persistence` of the per-rank
    lists (one optimizer step per micro-batch; repeated indices count as padding).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    epoch0 = run.batches[0]
    counts = [len(b) for b in epoch0]
    stats = {name: plan_stats(epoch0, lengths, cm) for name, cm in COST_MODELS.items()}
    tok = stats["tokens"]
    out: dict[str, Any] = {
        "steps": max(counts, default=0),
        "batches_per_rank_min": min(counts, default=0),
        "batches_per_rank_max": max(counts, default=0),
        "uneven_batch_counts": len(set(counts)) > 1,
        "micro_batches": int(sum(counts)),
        "budget_fill_ratio": tok.budget_fill_ratio(max_tokens),
        "padding_ratio": tok.padding_ratio,
        "over_budget_ratio": tok.over_budget_ratio(max_tokens),
        "max_batch_slots": tok.max_batch_tokens,
    }
    for name, st in stats.items():
        imbalance = st.step_imbalance
        out[f"imbalance_{name}_mean"] = float(imbalance.mean()) if imbalance.size else 1.0
        out[f"imbalance_{name}_p99"] = float(np.percentile(imbalance, 99)) if imbalance.size else 1.0
        out[f"useful_fraction_{name}"] = st.useful_fraction
    out["dropped"], out["duplicated"] = tok.dropped_samples, tok.duplicated_rows
    out["persistence"] = batch_persistence(epoch0, run.batches[1])
    out["plan_s"] = float(sum(run.rank_plan_s))
    out["plan_rank_s"] = float(max(run.rank_plan_s, default=0.0))
    out["plan_timing"] = run.timing
    out["notes"] = list(run.notes)
    return out


# lit_balance's own strategies (the peers are in benchmarks.peers).


def run_lit_balance(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig, cost_model: CostModel = TOKEN_COST,
                    ) -> StrategyRun:
    """:class:`lit_balance.BalancedBatchSampler` with ``cost_model`` (defaults otherwise)."""
    def build(rank: int) -> BalancedBatchSampler:
        return BalancedBatchSampler(lengths, cfg.max_tokens, num_replicas=num_replicas, rank=rank, seed=cfg.seed,
                                    cost_model=cost_model)

    def epoch(e: int, sampler: BalancedBatchSampler) -> list[list[int]]:
        sampler.set_epoch(e)
        return as_lists(sampler)

    batches, times = per_rank_epochs(num_replicas, build, epoch)
    return StrategyRun(batches, times, notes=[f"cost_model={cost_model}"])


RUNNERS: dict[str, Callable[..., StrategyRun]] = {
    "distributed_fixed": run_distributed_fixed,
    "hf_length_grouped": run_hf_length_grouped,
    "hf_batch_rebalance": run_hf_batch_rebalance,
    "lhotse_dynamic": run_lhotse_dynamic,
    "sort_fill": run_sort_fill,
    "lit_balance": run_lit_balance,
    "lit_balance_attention": functools.partial(run_lit_balance, cost_model=ATTENTION_COST),
}


# Command line, table, JSON.


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[8, 64], help="rank counts to simulate")
    p.add_argument("--max-tokens", type=positive_int, default=4096,
                   help="budget: padded token slots (rows x longest row) per micro-batch, per rank")
    p.add_argument("--max-length", type=positive_int, default=512,
                   help="documents are capped at this many tokens (must be <= --max-tokens)")
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS),
                   help=f"length arrays from {LENGTHS_DIR}")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--num-samples", type=positive_int, default=None,
                   help="use only the first N documents of each distribution (quick runs)")
    p.add_argument("--seed", type=int, default=0, help="base seed of every sampler (>= 0)")
    p.add_argument("--shuffle-windows", type=float, nargs="*", default=[0.0, 0.25, 1.0, 2.0, 4.0],
                   help="lit_balance shuffle_window values for the padding / randomness trade-off table (none: skip)")
    p.add_argument("--skip-million", action="store_true", help="skip the plan time of a million samples")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/bench_samplers"),
                   help="results.json is written here")
    return p


def _fmt(row: dict[str, Any]) -> list[str]:
    if row["status"] != "ok":
        return [row["strategy"], str(row["ranks"]), f"{row['status']}: {row['reason']}"] + [""] * 11
    counts = (str(row["batches_per_rank_min"]) if not row["uneven_batch_counts"]
              else f"**{row['batches_per_rank_min']}-{row['batches_per_rank_max']}**")
    return [
        row["strategy"], str(row["ranks"]), counts,
        f"{row['budget_fill_ratio']:.2f}", f"{row['padding_ratio']:.3f}", f"{row['over_budget_ratio']:.3f}",
        f"{row['imbalance_tokens_mean']:.2f} / {row['imbalance_tokens_p99']:.2f}",
        f"{row['imbalance_attention_mean']:.2f} / {row['imbalance_attention_p99']:.2f}",
        f"{row['useful_fraction_tokens']:.3f}", f"{row['useful_fraction_attention']:.3f}",
        str(row["dropped"]), str(row["duplicated"]), f"{row['persistence']:.3f}",
        f"{row['plan_s']:.2f} / {row['plan_rank_s']:.3f}" + ("*" if row["plan_timing"] != "each rank timed" else ""),
    ]


HEADER = ["strategy", "ranks", "steps (batches/rank)", "budget fill", "padding", "over budget",
          "imbalance tok mean / p99", "imbalance attn mean / p99", "U tok", "U attn", "dropped", "duplicated",
          "persistence", "plan s (sum / rank)"]

LEGEND = """\
steps: micro-batches per rank (bold range: ranks differ, which hangs DDP). budget fill: mean padded slots per
micro-batch / max_tokens. padding: 1 - real / padded slots (repeated samples count as padding). over budget:
share of micro-batches with rows x longest > max_tokens. imbalance: per step, max / mean cost over ranks (a rank
without a micro-batch costs 0); tok = CostModel() (padded slots), attn = CostModel(linear=1, quadratic=1e-3).
U: real-token cost / sum over steps of (ranks x slowest rank's cost); one optimizer step per micro-batch.
dropped / duplicated: samples never seen / extra rows of repeated samples in epoch 0. persistence: mean share of
a sample's epoch-0 batch-mates that are its batch-mates again in epoch 1. plan s: seconds to build the sampler and
produce epoch 0, summed over ranks / slowest rank (* rank 0 timed; every rank repeats the same work)."""


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table of result rows (any distributions)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(_fmt(r)) + " |" for r in rows]
    return "\n".join(lines)


def window_tradeoff(lengths: np.ndarray, ranks: Sequence[int], windows: Sequence[float], cfg: BenchConfig,
                    ) -> list[dict[str, Any]]:
    """``shuffle_window`` (the knob that trades padding for randomness): padding, U and persistence per value."""
    rows = []
    for num_replicas in ranks:
        for window in windows:
            sampler = BalancedBatchSampler(lengths, cfg.max_tokens, num_replicas=num_replicas, rank=0, seed=cfg.seed,
                                           shuffle_window=window)
            p0, p1 = sampler.plan(0), sampler.plan(1)
            token, attention = plan_stats(p0, sampler.lengths, TOKEN_COST), plan_stats(p0, sampler.lengths,
                                                                                       ATTENTION_COST)
            rows.append({"ranks": num_replicas, "shuffle_window": window, "padding_ratio": token.padding_ratio,
                         "U_token": token.useful_fraction, "U_attention_with_token_plan": attention.useful_fraction,
                         "persistence": batch_persistence(p0, p1)})
    return rows


def plan_seconds_per_million(lengths: np.ndarray, ranks: Sequence[int], cfg: BenchConfig, repeats: int = 3,
                             ) -> list[dict[str, Any]]:
    """One rank's planning time for a million samples drawn from ``lengths`` (best of ``repeats``)."""
    big = np.random.default_rng(cfg.seed).choice(lengths, 1_000_000)
    rows = []
    for num_replicas in ranks:
        def plan(num_replicas: int = num_replicas) -> Any:
            return BalancedBatchSampler(big, cfg.max_tokens, num_replicas=num_replicas, rank=0, seed=cfg.seed).plan(0)

        best = min(timed(plan)[1] for _ in range(repeats))
        rows.append({"ranks": num_replicas, "plan_s_per_million": best})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print one markdown table per distribution; write ``results.json``; return the results."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.ranks, args.distributions, args.strategies = (list(dict.fromkeys(v)) for v in  # drop repeats, keep order
                                                       (args.ranks, args.distributions, args.strategies))
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length ({args.max_length}) must be <= --max-tokens ({args.max_tokens}): a capped document "
                     "must fit one micro-batch; lower --max-length or raise --max-tokens")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"--output-dir {args.output_dir} exists and is not a directory; pass a directory path")
    start = time.perf_counter()
    print(f"lit_balance sampler benchmark: max_tokens={args.max_tokens} padded slots per micro-batch per rank, "
          f"documents capped at {args.max_length} tokens, ranks {args.ranks}, seed {args.seed}")
    print(f"machine: {machine()}\n")
    print(LEGEND + "\n")
    rows: list[dict[str, Any]] = []
    for dist_name in args.distributions:
        lengths = load_lengths(dist_name, args.max_length, args.num_samples)
        cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed,
                          fixed_batch_size=fixed_batch_size(args.max_tokens, int(lengths.max())))
        print(f"## {dist_name}: {lengths.size} documents, {int(lengths.sum())} tokens after capping at "
              f"{args.max_length} ({int((lengths == args.max_length).sum())} capped), p50 {int(np.median(lengths))}, "
              f"fixed batch size {cfg.fixed_batch_size}\n")
        cuts = None
        dist_rows = []
        for num_replicas in args.ranks:
            for strategy in args.strategies:
                row: dict[str, Any] = {"distribution": dist_name, "strategy": strategy, "ranks": num_replicas,
                                       "num_samples": int(lengths.size), "fixed_batch_size": cfg.fixed_batch_size}
                try:
                    if strategy == "lhotse_dynamic":
                        if cuts is None:
                            try:
                                cuts = lhotse_cuts(lengths)
                            except ImportError as exc:
                                raise PeerUnavailable("not installed",
                                                      f"lhotse ({exc}); pip install -e '.[bench]'") from exc
                        run = run_lhotse_dynamic(lengths, num_replicas, cfg, cuts=cuts)
                    else:
                        run = RUNNERS[strategy](lengths, num_replicas, cfg)
                    row.update(status="ok", reason="", **sampler_metrics(run, lengths, args.max_tokens))
                except PeerUnavailable as exc:
                    row.update(status=exc.status, reason=exc.reason)
                except (AssertionError, ValueError, TypeError, RuntimeError, IndexError) as exc:
                    # a peer refusing these inputs (hf samplers assert on their arguments) is a result, not a crash
                    row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
                dist_rows.append(row)
        print(markdown_table(dist_rows) + "\n")
        for row in dist_rows:
            if row["status"] == "ok" and row["uneven_batch_counts"]:
                print(f"- {row['strategy']} at {row['ranks']} ranks: ranks get {row['batches_per_rank_min']} to "
                      f"{row['batches_per_rank_max']} micro-batches; DDP would hang at the end of the epoch")
        rows += dist_rows
        print()
    notes = {}
    for row in rows:
        if row["status"] == "ok" and row["notes"]:
            notes.setdefault(row["strategy"], f"{row['notes'][0]} (at {row['ranks']} ranks)")
    print("Notes:\n" + "\n".join(f"- {name}: {note}" for name, note in notes.items()) + "\n")
    cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed, fixed_batch_size=1)  # lit_balance alone below
    tradeoff: list[dict[str, Any]] = []
    if args.shuffle_windows:
        print("## lit_balance shuffle_window: padding for randomness (token cost)\n")
        print("| distribution | ranks | shuffle_window | padding | U tok | persistence |\n|---|---|---|---|---|---|")
        for dist_name in args.distributions:
            lengths = load_lengths(dist_name, args.max_length, args.num_samples)
            for row in window_tradeoff(lengths, args.ranks, args.shuffle_windows, cfg):
                tradeoff.append({"distribution": dist_name, **row})
                print(f"| {dist_name} | {row['ranks']} | {row['shuffle_window']:g} | {row['padding_ratio']:.3f} | "
                      f"{row['U_token']:.3f} | {row['persistence']:.3f} |")
        print()
    million: list[dict[str, Any]] = []
    if not args.skip_million:
        lengths = load_lengths(args.distributions[-1], args.max_length)
        million = plan_seconds_per_million(lengths, args.ranks, cfg)
        print("lit_balance plan time of 1,000,000 samples drawn from " + args.distributions[-1] + " (one rank; "
              "every rank plans alone): " + ", ".join(f"{r['plan_s_per_million']:.2f} s at {r['ranks']} ranks"
                                                     for r in million) + "\n")
    return write_report(args.output_dir, "benchmarks.bench_samplers", argv, {
        "config": {**vars(args), "cost_models": {k: asdict(v) for k, v in COST_MODELS.items()}},
        "rows": rows, "shuffle_window_tradeoff": tradeoff,
        "plan_seconds_per_million": million, "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    main()
