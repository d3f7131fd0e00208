"""How soon the first micro-batch of a very large corpus comes: from the sampler's construction, and from ``setup()``.

Run:
    python -m benchmarks.first_micro_batch                                   # 100M lengths and a 100M-document store
    python -m benchmarks.first_micro_batch --sizes 10000000 --baseline main  # this code against main, side by side
    python -m benchmarks.first_micro_batch --quick                           # small sizes, small windows, for tests

For each size and layout (padded, packed), in a fresh process each, rank 0 of ``--num-replicas`` ranks plans
memory-mapped int32 lengths (drawn, seeded, from the shipped distributions pooled and capped at ``--max-length``,
as :mod:`benchmarks.scale` draws them). Two orders are measured, each from the start of
``BalancedBatchSampler(...)``:

* ``iterate``: ``set_epoch(0)``, ``iter()``, the first ``next()``; then ``len()``; then the rest of the epoch.
* ``len first`` (what Lightning does: it reads ``len(train_dataloader)`` when it loads the loader): ``len()``, then
  the first micro-batch and the rest of the epoch.

Figures are CPU seconds of the process (``time.process_time``; the machine may be shared, so wall seconds are
reported beside them but not compared), the epoch per million documents, its ratio to ``np.argsort`` of the same
lengths (in its own process of the same run), and peak resident memory (``VmHWM``) beyond the lengths' size.

The store row: a Megatron ``.bin/.idx`` pair of ``--store-sizes`` documents written by
:func:`benchmarks.store_megatron.write_store` (NumPy in megatron-core's layout, checked against megatron-core's
``IndexedDataset`` at a small size first; megatron-core's own ``IndexedDatasetBuilder`` adds one document per Python
call, too slow at 100M), then ``BalancedTextDataModule(MegatronSource(prefix))``: CPU seconds from the start of
``setup("fit")`` to the first micro-batch out of ``train_dataloader()``
(:func:`benchmarks.store_megatron._first_batch`).

With ``--baseline REVISION`` every measurement also runs with the package of that git revision (``git archive``,
imported first on ``sys.path``; the benchmark code is this one), alternately with this checkout's, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import ROOT, child_main, markdown_table, positive_int, status_kib, write_report
from benchmarks.scale import _child_argsort, pooled_lengths, write_lengths
from launch import finish

FULL_SIZES = (100_000_000,)
QUICK_SIZES = (200_000,)
QUICK_PLAN_WINDOW = 50_000
_MIB = 1 << 20
_MODULE = "benchmarks.first_micro_batch"


def _child_lengths(path: str, layout: str, num_replicas: str, max_tokens: str, len_first: str,
                   plan_window: str = "0") -> dict[str, Any]:
    """One sampler over the lengths at ``path``: CPU seconds from its construction to its first micro-batch, etc."""
    import lit_balance
    from lit_balance import BalancedBatchSampler, BatchingSettings

    lengths = np.load(path, mmap_mode="r")
    rss_after_import = status_kib("VmRSS")
    window = {"plan_window": int(plan_window)} if int(plan_window) else {}
    settings = BatchingSettings(max_tokens=int(max_tokens), packing=layout == "packed", **window)
    wall, cpu = time.perf_counter(), time.process_time()
    sampler = BalancedBatchSampler(lengths, settings=settings, num_replicas=int(num_replicas), rank=0)
    construct_cpu_s = time.process_time() - cpu
    length = len_cpu_s = None
    if len_first == "1":
        before = time.process_time()
        length = len(sampler)
        len_cpu_s = time.process_time() - before
    sampler.set_epoch(0)
    iterator = iter(sampler)
    next(iterator)
    first_cpu_s, first_s = time.process_time() - cpu, time.perf_counter() - wall
    if length is None:
        before = time.process_time()
        length = len(sampler)
        len_cpu_s = time.process_time() - before
    count = 1 + sum(1 for _ in iterator)
    epoch_cpu_s, epoch_s = time.process_time() - cpu, time.perf_counter() - wall
    if count != length:
        raise RuntimeError(f"rank 0 yielded {count} micro-batches, len() said {length}")
    return {"version": lit_balance.__version__, "package": str(Path(lit_balance.__file__).parent),
            "windows": 1 if sampler.windows is None else sampler.windows.num_windows,
            "micro_batches_per_rank": length, "construct_cpu_s": construct_cpu_s, "len_cpu_s": len_cpu_s,
            "first_batch_cpu_s": first_cpu_s, "first_batch_s": first_s, "epoch_cpu_s": epoch_cpu_s,
            "epoch_s": epoch_s, "rss_after_import_kib": rss_after_import, "peak_rss_kib": status_kib("VmHWM")}


def _child_store(prefix: str, num_replicas: str, max_tokens: str) -> dict[str, Any]:
    from benchmarks.store_megatron import _child_store as store

    return store(prefix, num_replicas, max_tokens)


def baseline_package(revision: str, into: Path) -> Path:
    """Extract ``lit_balance/`` of git ``revision`` of this repository under ``into``; return the folder to put first
    on ``sys.path``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, "lit_balance"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _run(kind: str, *args: str, package: Path | None, timeout_s: float) -> dict[str, Any]:
    """``kind``'s child in a fresh process, importing ``lit_balance`` from ``package`` (None: this checkout)."""
    first = [] if package is None else [str(package)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*first, str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", _MODULE, "--child", kind, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT if package is None else package)  # -m puts the folder it runs in first
    out = finish(proc, timeout_s)
    if proc.returncode:
        raise RuntimeError(f"the {kind} subprocess failed (exit code {proc.returncode}):\n{out[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(sizes: list[int], store_sizes: list[int], work: Path, *, layouts: list[str], num_replicas: int,
        max_tokens: int, max_length: int, seed: int, plan_window: int, baseline: str | None,
        timeout_s: float) -> dict[str, Any]:
    """Every measurement of the run; one row per (size, layout, order, code)."""
    from benchmarks.store_megatron import check_against_megatron_core, write_store

    codes: list[tuple[str, Path | None]] = [("this", None)]
    if baseline is not None:
        codes.append((baseline, baseline_package(baseline, work / "baseline")))
    pool = pooled_lengths(max_length)
    rows, store_rows = [], []
    for size in sizes:
        path = work / f"lengths_{size}.npy"
        write_lengths(path, pool, size, seed)
        argsort = _run("argsort", str(path), package=None, timeout_s=timeout_s)
        for layout in layouts:
            for len_first in ("0", "1"):
                for code, package in codes:
                    out = _run("lengths", str(path), layout, str(num_replicas), str(max_tokens), len_first,
                               str(plan_window), package=package, timeout_s=timeout_s)
                    lengths_mib = size * 4 / _MIB
                    rows.append({**out, "code": code, "num_samples": size, "layout": layout,
                                 "order": "len first" if len_first == "1" else "iterate",
                                 "num_replicas": num_replicas, "max_tokens": max_tokens,
                                 "argsort_cpu_s": argsort["argsort_cpu_s"],
                                 "epoch_cpu_s_per_million": out["epoch_cpu_s"] / (size / 1e6),
                                 "cpu_ratio_to_argsort": out["epoch_cpu_s"] / max(argsort["argsort_cpu_s"], 1e-9),
                                 "peak_beyond_lengths_mib": (out["peak_rss_kib"] - out["rss_after_import_kib"]) / 1024
                                 - lengths_mib})
                    print(_row_line(rows[-1]), flush=True)
        path.unlink()
    if store_sizes:
        check_against_megatron_core(work, pool)
    for size in store_sizes:
        prefix = work / f"store_{size}"
        write_store(prefix, size, pool, seed)
        for code, package in codes:
            out = _run("store", str(prefix), str(num_replicas), str(max_tokens), package=package,
                       timeout_s=timeout_s)
            store_rows.append({**out, "code": code, "num_documents": size, "num_replicas": num_replicas,
                               "max_tokens": max_tokens})
            print(f"store {size:,} ({code}): setup() to the first micro-batch {out['first_batch_cpu_s']:.2f} s CPU "
                  f"({out['first_batch_s']:.2f} s wall), peak RSS {out['peak_rss_kib'] / 1024:,.0f} MiB", flush=True)
        for suffix in (".idx", ".bin"):
            Path(f"{prefix}{suffix}").unlink()
    return {"lengths": rows, "store": store_rows}


def _row_line(r: dict[str, Any]) -> str:
    return (f"{r['num_samples']:,} {r['layout']} {r['order']} ({r['code']}): first micro-batch "
            f"{r['first_batch_cpu_s']:.2f} s CPU after construction ({r['first_batch_s']:.2f} s wall; construction "
            f"{r['construct_cpu_s']:.2f} s, len() {r['len_cpu_s']:.2f} s), epoch {r['epoch_cpu_s_per_million']:.3f} s "
            f"CPU per million ({r['cpu_ratio_to_argsort']:.1f} x argsort), peak beyond lengths "
            f"{r['peak_beyond_lengths_mib']:,.0f} MiB")


def tables(results: dict[str, Any]) -> str:
    """The run's markdown tables."""
    out = []
    if results["lengths"]:
        out.append(markdown_table(
            ["code", "documents", "layout", "order", "windows", "micro-batches / rank", "construction (CPU)",
             "len() (CPU)", "first micro-batch from construction (CPU)", "epoch per million (CPU)",
             "ratio to argsort (CPU)", "peak RSS beyond lengths"],
            [[r["code"], f"{r['num_samples']:,}", r["layout"], r["order"], str(r["windows"]),
              f"{r['micro_batches_per_rank']:,}", f"{r['construct_cpu_s']:.2f} s", f"{r['len_cpu_s']:.2f} s",
              f"{r['first_batch_cpu_s']:.2f} s", f"{r['epoch_cpu_s_per_million']:.3f} s",
              f"{r['cpu_ratio_to_argsort']:.1f}", f"{r['peak_beyond_lengths_mib']:,.0f} MiB"]
             for r in results["lengths"]]))
    if results["store"]:
        out.append(markdown_table(
            ["code", "documents", "setup() to first micro-batch (CPU)", "(wall)", "micro-batches / rank",
             "peak RSS"],
            [[r["code"], f"{r['num_documents']:,}", f"{r['first_batch_cpu_s']:.2f} s", f"{r['first_batch_s']:.2f} s",
              f"{r['micro_batches_per_rank']:,}", f"{r['peak_rss_kib'] / 1024:,.0f} MiB"] for r in results["store"]]))
    return "\n\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="*", default=None,
                   help=f"documents per lengths run, 0 or none to skip (default {list(FULL_SIZES)}; --quick: "
                        f"{list(QUICK_SIZES)})")
    p.add_argument("--store-sizes", type=int, nargs="*", default=None,
                   help="documents per Megatron store, none to skip (default: as --sizes)")
    p.add_argument("--layouts", nargs="+", choices=("padded", "packed"), default=["padded", "packed"])
    p.add_argument("--quick", action="store_true", help=f"small sizes, windows of {QUICK_PLAN_WINDOW} samples")
    p.add_argument("--num-replicas", type=positive_int, default=8, help="ranks the plan is made for")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="padded token slots per micro-batch")
    p.add_argument("--max-length", type=positive_int, default=512, help="lengths are capped at this many tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the length sampling")
    p.add_argument("--baseline", default=None, metavar="REVISION", help="also measure this git revision's package")
    p.add_argument("--timeout", type=positive_int, default=3600, help="seconds per child process")
    p.add_argument("--work-dir", type=Path, default=None, help="lengths and stores go here (temporary)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/first_micro_batch"),
                   help="results.json and results.md go here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print markdown tables; write ``results.json`` and ``results.md``; return the results."""
    children = {"lengths": _child_lengths, "argsort": _child_argsort, "store": _child_store}
    if (out := child_main(argv, children)) is not None:
        return out
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    sizes = [s for s in (args.sizes if args.sizes is not None else QUICK_SIZES if args.quick else FULL_SIZES) if s]
    store_sizes = [s for s in (args.store_sizes if args.store_sizes is not None else sizes) if s]
    if any(s < 0 for s in sizes + store_sizes):
        parser.error(f"sizes must be >= 0, got {sizes + store_sizes}")
    base = args.work_dir if args.work_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="first-mb-", dir=base))
    try:
        results = run(sizes, store_sizes, work, layouts=args.layouts, num_replicas=args.num_replicas,
                      max_tokens=args.max_tokens, max_length=args.max_length, seed=args.seed,
                      plan_window=QUICK_PLAN_WINDOW if args.quick else 0, baseline=args.baseline,
                      timeout_s=args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    markdown = tables(results)
    print(markdown)
    return write_report(args.output_dir, _MODULE, argv, results, markdown)


if __name__ == "__main__":
    main()
