"""Planning at scale: a hundred million documents, planned in windows from memory-mapped lengths.

Run:
    python -m benchmarks.scale                       # 1M, 10M, 100M documents, padded micro-batches
    python -m benchmarks.scale --sizes 1000000 10000000 --packing
    python -m benchmarks.scale --quick               # small sizes with small windows, for tests

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-02-planning-at-scale.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (DISTRIBUTIONS, child_main, load_lengths, positive_int, run_child, status_kib,
                                 write_report)
from lit_balance import CostModel
from lit_balance.plan import planner_for

FULL_SIZES = (1_000_000, 10_000_000, 100_000_000)
QUICK_SIZES = (20_000, 200_000)
QUICK_PLAN_WINDOW = 50_000  # --quick: windows of this many samples, so that the windowed path runs
_MIB = 1 << 20


def pooled_lengths(max_length: int) -> np.ndarray:
    """int32: every shipped distribution's lengths, concatenated and capped at ``max_length`` tokens."""
    return np.concatenate([load_lengths(name, max_length) for name in DISTRIBUTIONS]).astype(np.int32)


def write_lengths(path: Path, pool: np.ndarray, num_samples: int, seed: int, chunk: int = 1 << 22) -> None:
    """Write ``num_samples`` lengths drawn from ``pool`` (seeded, with replacement) as an int32 ``.npy``, in chunks."""
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(num_samples,))
    for start in range(0, num_samples, chunk):
        stop = min(start + chunk, num_samples)
        out[start:stop] = pool[rng.integers(0, pool.shape[0], stop - start)]
    out.flush()
    del out


def _u_sums(plan: Any, lengths: np.ndarray, settings: Any, num_replicas: int) -> tuple[float, float]:
    """(real tokens, sum over micro-steps of num_replicas x the longest rank's token slots) of one plan part.

    With the token cost and one micro-batch per optimizer step, their ratio over all parts is U
    (:attr:`lit_balance.PlanStats.useful_fraction`). Summed here part by part: :func:`lit_balance.plan_stats` of each
    window's part would count every sample of the corpus (dropped and repeated samples) once per window.
    """
    if not plan.num_batches:
        return 0.0, 0.0
    slots = planner_for(settings).batch_costs(np.asarray(lengths, dtype=np.int64), plan.rows, plan.batch_offsets,
                                              settings.pad_to_multiple_of, CostModel())[1]
    real = np.asarray(lengths[plan.rows[~plan.is_fill]], dtype=np.int64).sum()
    return float(real), float(slots[plan.assignment].max(axis=1).sum() * num_replicas)


def _useful_fraction(sampler: Any, lengths: np.ndarray, num_replicas: int, epoch: int | None = None) -> float:
    """U of the sampler's plan of ``epoch`` (default: its current one), summed part by part (:func:`_u_sums`)."""
    sums = np.array([_u_sums(part, lengths, sampler.settings, num_replicas) for part in sampler.plan_parts(epoch)])
    return float(sums[:, 0].sum() / sums[:, 1].sum())


def _child_plan(path: str, num_replicas: str, max_tokens: str, packing: str, plan_window: str | None = None,
                ) -> dict[str, Any]:
    import lit_balance
    from lit_balance import BalancedBatchSampler, BatchingSettings

    lengths, num_replicas = np.load(path, mmap_mode="r"), int(num_replicas)
    rss_after_import = status_kib("VmRSS")
    window = {} if plan_window is None else {"plan_window": int(plan_window)}
    settings = BatchingSettings(max_tokens=int(max_tokens), packing=packing == "packed", **window)
    start, cpu = time.perf_counter(), time.process_time()
    sampler = BalancedBatchSampler(lengths, settings=settings, num_replicas=num_replicas, rank=0)
    construct_s, construct_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    length = len(sampler)
    start, cpu = time.perf_counter(), time.process_time()
    sampler.set_epoch(1)
    iterator = iter(sampler)
    next(iterator)
    first_s, first_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    count = 1 + sum(1 for _ in iterator)
    epoch_s, epoch_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    peak_after_epoch = status_kib("VmHWM")
    if count != length:
        raise RuntimeError(f"rank 0 yielded {count} micro-batches, len() said {length}")
    return {"version": lit_balance.__version__,
            "windows": 1 if sampler.windows is None else sampler.windows.num_windows,
            "micro_batches_per_rank": length, "construct_s": construct_s, "first_batch_s": first_s,
            "epoch_s": epoch_s, "construct_cpu_s": construct_cpu_s, "first_batch_cpu_s": first_cpu_s,
            "epoch_cpu_s": epoch_cpu_s, "useful_fraction": _useful_fraction(sampler, lengths, num_replicas),
            "rss_after_import_kib": rss_after_import, "peak_rss_kib": peak_after_epoch}


def _child_argsort(path: str) -> dict[str, Any]:
    lengths = np.load(path)
    start, cpu = time.perf_counter(), time.process_time()
    np.argsort(lengths)
    return {"argsort_s": time.perf_counter() - start, "argsort_cpu_s": time.process_time() - cpu}


def _child_lhotse(path: str, num_replicas: str, max_tokens: str, seed: str) -> dict[str, Any]:
    from benchmarks.peers import BenchConfig, lhotse_cuts, run_lhotse_dynamic

    lengths, num_replicas = np.load(path).astype(np.int64), int(num_replicas)
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    cuts = lhotse_cuts(lengths)
    cuts_s = time.perf_counter() - start
    run = run_lhotse_dynamic(lengths, num_replicas, BenchConfig(max_tokens=int(max_tokens), seed=int(seed),
                                                                fixed_batch_size=1), cuts=cuts)
    return {"cuts_s": cuts_s, "epoch_s": run.rank_plan_s[0], "timing": run.timing, "rss_before_kib": rss_before,
            "peak_rss_kib": status_kib("VmHWM")}


def _run_child(*args: str, timeout_s: float) -> dict[str, Any]:
    return run_child("benchmarks.scale", *args, timeout_s=timeout_s)


def run_lengths(sizes: list[int], work_dir: Path, *, num_replicas: int = 8, max_tokens: int = 4096,
                max_length: int = 512, seed: int = 0, whole_up_to: int = 10_000_000, lhotse: bool = True,
                plan_window: int | None = None, timeout_s: float = 3600.0, packing: bool = False,
                ) -> list[dict[str, Any]]:
    """Measure planning at each size, of packed or padded micro-batches; one row per size."""
    pool, layout = pooled_lengths(max_length), "packed" if packing else "padded"
    rows = []
    for size in sizes:
        path = work_dir / f"lengths_{size}.npy"
        write_lengths(path, pool, size, seed)
        window = [] if plan_window is None else [str(plan_window)]
        windowed = _run_child("plan", str(path), str(num_replicas), str(max_tokens), layout, *window,
                              timeout_s=timeout_s)
        sorted_ = _run_child("argsort", str(path), timeout_s=timeout_s)
        lengths_mb = size * 4 / _MIB
        row: dict[str, Any] = {
            "num_samples": size, "num_replicas": num_replicas, "max_tokens": max_tokens, "layout": layout,
            "lengths_mb": lengths_mb,
            "windows": windowed["windows"], "micro_batches_per_rank": windowed["micro_batches_per_rank"],
            "construct_s": windowed["construct_s"], "first_batch_s": windowed["first_batch_s"],
            "epoch_s": windowed["epoch_s"], "epoch_s_per_million": windowed["epoch_s"] / (size / 1e6),
            "construct_cpu_s": windowed["construct_cpu_s"], "first_batch_cpu_s": windowed["first_batch_cpu_s"],
            "epoch_cpu_s": windowed["epoch_cpu_s"],
            "useful_fraction": windowed["useful_fraction"],
            "rss_after_import_mb": windowed["rss_after_import_kib"] / 1024,
            "peak_rss_mb": windowed["peak_rss_kib"] / 1024,
            "peak_beyond_lengths_mb": (windowed["peak_rss_kib"] - windowed["rss_after_import_kib"]) / 1024
            - lengths_mb,
            "argsort_s": sorted_["argsort_s"], "ratio_to_argsort": windowed["epoch_s"] / sorted_["argsort_s"],
            "argsort_cpu_s": sorted_["argsort_cpu_s"],
            "cpu_ratio_to_argsort": windowed["epoch_cpu_s"] / max(sorted_["argsort_cpu_s"], 1e-9),
        }
        if size <= whole_up_to:
            whole = _run_child("plan", str(path), str(num_replicas), str(max_tokens), layout, str(size),
                               timeout_s=timeout_s)
            row.update(whole_epoch_s=whole["epoch_s"], whole_first_batch_s=whole["first_batch_s"],
                       whole_epoch_cpu_s=whole["epoch_cpu_s"],
                       whole_useful_fraction=whole["useful_fraction"], whole_peak_rss_mb=whole["peak_rss_kib"] / 1024,
                       whole_peak_beyond_lengths_mb=(whole["peak_rss_kib"] - whole["rss_after_import_kib"]) / 1024
                       - lengths_mb)
        if lhotse and not packing and size == min(sizes):
            try:
                peer = _run_child("lhotse", str(path), str(num_replicas), str(max_tokens), str(seed),
                                  timeout_s=timeout_s)
                row.update(lhotse_cuts_s=peer["cuts_s"], lhotse_epoch_s=peer["epoch_s"],
                           lhotse_rss_before_mb=peer["rss_before_kib"] / 1024,
                           lhotse_peak_rss_mb=peer["peak_rss_kib"] / 1024, lhotse_timing=peer["timing"])
            except RuntimeError as exc:
                row.update(lhotse_error=str(exc)[-500:])
        rows.append(row)
        path.unlink()
    return rows


def u_by_distribution(num_samples: int, *, num_replicas: int = 8, max_tokens: int = 4096, max_length: int = 512,
                      seed: int = 0, plan_window: int | None = None, packing: bool = False) -> list[dict[str, Any]]:
    """U of the windowed and the whole-epoch plan of ``num_samples`` lengths drawn from each shipped distribution."""
    from lit_balance import BalancedBatchSampler, BatchingSettings

    rows = []
    for name in DISTRIBUTIONS:
        pool = load_lengths(name, max_length)
        lengths = pool[np.random.default_rng(seed).integers(0, pool.shape[0], num_samples)].astype(np.int32)
        row: dict[str, Any] = {"distribution": name, "num_samples": num_samples}
        windowed = {} if plan_window is None else {"plan_window": plan_window}
        for label, settings in (("windowed", BatchingSettings(max_tokens=max_tokens, packing=packing, **windowed)),
                                ("whole", BatchingSettings(max_tokens=max_tokens, packing=packing,
                                                           plan_window=num_samples))):
            sampler = BalancedBatchSampler(lengths, settings=settings, num_replicas=num_replicas, rank=0)
            row[f"{label}_windows"] = 1 if sampler.windows is None else sampler.windows.num_windows
            row[f"{label}_useful_fraction"] = _useful_fraction(sampler, lengths, num_replicas, 1)
        row["u_difference"] = row["whole_useful_fraction"] - row["windowed_useful_fraction"]
        rows.append(row)
    return rows


def _lengths_table(rows: list[dict[str, Any]]) -> str:
    lines = [("| documents | windows | micro-batches / rank | construction (CPU) | first micro-batch (CPU) | "
              "epoch per rank (CPU) | per million (CPU) | ratio to argsort (CPU) | peak RSS beyond lengths | U | "
              "whole epoch: s (CPU) / peak beyond lengths / U |"), "|" + "---|" * 11]
    for r in rows:
        whole = (f"{r['whole_epoch_s']:.2f} s ({r['whole_epoch_cpu_s']:.2f} s) / "
                 f"{r['whole_peak_beyond_lengths_mb']:,.0f} MiB / {r['whole_useful_fraction']:.4f}"
                 ) if "whole_epoch_s" in r else "not run"
        million = r["num_samples"] / 1e6
        lines.append(f"| {r['num_samples']:,} | {r['windows']} | {r['micro_batches_per_rank']:,} | "
                     f"{r['construct_s']:.2f} s ({r['construct_cpu_s']:.2f} s) | "
                     f"{r['first_batch_s']:.2f} s ({r['first_batch_cpu_s']:.2f} s) | "
                     f"{r['epoch_s']:.2f} s ({r['epoch_cpu_s']:.2f} s) | "
                     f"{r['epoch_s_per_million']:.2f} s ({r['epoch_cpu_s'] / million:.2f} s) | "
                     f"{r['ratio_to_argsort']:.0f} ({r['cpu_ratio_to_argsort']:.0f}) | "
                     f"{r['peak_beyond_lengths_mb']:,.0f} MiB | {r['useful_fraction']:.4f} | {whole} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=positive_int, nargs="*", default=[],
                   help=f"documents per lengths run (default {list(FULL_SIZES)}; --quick: {list(QUICK_SIZES)})")
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes, windows of {QUICK_PLAN_WINDOW} samples, small text corpora")
    p.add_argument("--num-replicas", type=positive_int, default=8, help="ranks the plan is made for")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="padded token slots per micro-batch")
    p.add_argument("--max-length", type=positive_int, default=512, help="lengths are capped at this many tokens")
    p.add_argument("--whole-up-to", type=positive_int, default=10_000_000,
                   help="also plan the whole epoch at once for sizes up to this")
    p.add_argument("--u-size", type=int, default=4_000_000,
                   help="documents per distribution in the U table (0 skips it)")
    p.add_argument("--packing", action="store_true", help="packed micro-batches (lhotse, padded only, is skipped)")
    p.add_argument("--no-lhotse", action="store_true", help="skip the lhotse peer")
    p.add_argument("--seed", type=int, default=0, help="seed of the length sampling")
    p.add_argument("--work-dir", type=Path, default=None, help="the lengths files go here (temporary)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/scale"), help="results.json goes here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print markdown tables; write ``results.json``; return the results."""
    if (out := child_main(argv, {"plan": _child_plan, "argsort": _child_argsort, "lhotse": _child_lhotse})) is not None:
        return out
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.u_size < 0:
        parser.error(f"--u-size must be >= 0 (0 skips the U table), got {args.u_size}")
    started = time.perf_counter()
    base = args.work_dir if args.work_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=base))
    plan_window = QUICK_PLAN_WINDOW if args.quick else None
    results: dict[str, Any] = {}
    try:
        sizes = list(dict.fromkeys(args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)))
        rows = run_lengths(sizes, work, num_replicas=args.num_replicas, max_tokens=args.max_tokens,
                           max_length=args.max_length, seed=args.seed, whole_up_to=args.whole_up_to,
                           lhotse=not args.no_lhotse, plan_window=plan_window, packing=args.packing)
        results["lengths"] = rows
        print(_lengths_table(rows) + "\n")
        u_size = min(args.u_size, 100_000) if args.quick else args.u_size
        if u_size:
            results["u_by_distribution"] = u_by_distribution(
                u_size, num_replicas=args.num_replicas, max_tokens=args.max_tokens, max_length=args.max_length,
                seed=args.seed, plan_window=QUICK_PLAN_WINDOW // 2 if args.quick else None, packing=args.packing)
            for r in results["u_by_distribution"]:
                print(f"{r['distribution']}: U windowed {r['windowed_useful_fraction']:.4f} "
                      f"({r['windowed_windows']} windows), whole {r['whole_useful_fraction']:.4f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    results["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return write_report(args.output_dir, "benchmarks.scale", argv, results)


if __name__ == "__main__":
    main()
