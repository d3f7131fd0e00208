"""The ledger's cost: writing it for 1M and 10M documents on 8 ranks (time, documents per second, file size), and the
checking callback's time per optimizer step as a ratio to the step time of a fit.

Run:
    python -m benchmarks.ledger                          # 1M and 10M documents, 8 ranks; 3 pairs of fits
    python -m benchmarks.ledger --documents 20000 --fit-docs 300 --reps 1

Writing: the lengths of ``pydocs_paragraphs`` (capped at 2,048 tokens) repeated to the size, ``max_tokens`` 16,384 per
rank, 8 ranks. An epoch of more than ``plan_window`` documents is planned window by window as the ledger is laid out;
the planning alone (iterating ``sampler.plan_parts()``, what training pays anyway) is timed first and reported beside
the ledger's total, so ``ledger_docs_per_s`` counts only the ledger's own work (columns, Parquet encoding, writing).

Checking: the callbacks benchmark's fit (:mod:`benchmarks.bench_callbacks`: demo LM, one CPU process, one thread),
with and without :class:`~lit_balance.callbacks.LedgerCheck`, interleaved; every hook of the callback is timed (its
gather included: one process, so no collective wait) and divided by the fit's optimizer steps and by the step time of
the fit without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from benchmarks._harness import load_lengths, markdown_table, positive_int, timed, write_report
from benchmarks.bench_callbacks import data as fit_data
from benchmarks.bench_callbacks import timed as timed_hooks
from lit_balance import BalancedBatchSampler
from lit_balance.callbacks import LedgerCheck
from lit_balance.demo import DemoTransformerLM
from lit_balance.ledger import write_ledger

NUM_REPLICAS = 8
MAX_TOKENS = 16384


def writing(documents: int, out: Path, compression: str) -> dict:
    """Time and size of the ledger of ``documents`` documents on 8 ranks."""
    lengths = np.resize(load_lengths("pydocs_paragraphs", 2048), documents)
    sampler = BalancedBatchSampler(lengths, max_tokens=MAX_TOKENS, num_replicas=NUM_REPLICAS, rank=0)
    _, plan_s = timed(lambda: sum(p.num_micro_steps for p in sampler.plan_parts()))
    path = out / f"ledger_{documents}.parquet"
    header, total_s = timed(lambda: write_ledger(path, sampler, compression=compression))
    size = os.path.getsize(path)
    ledger_s = max(total_s - plan_s, 1e-9) if sampler.windows is not None else total_s
    path.unlink()
    return {"documents": documents, "rows": header["rows"], "optimizer_steps": header["optimizer_steps"],
            "windows": sampler.windows is not None, "plan_s": plan_s, "total_s": total_s, "ledger_s": ledger_s,
            "ledger_docs_per_s": header["rows"] / ledger_s, "bytes": size, "bytes_per_row": size / header["rows"]}


def fit(args: argparse.Namespace, dm, ledger: Path | None) -> tuple[float, float, int]:
    """``(fit seconds, LedgerCheck hook seconds, optimizer steps)`` of one epoch."""
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=512, d_model=args.d_model, num_heads=4, num_layers=2,
                              dim_feedforward=4 * args.d_model)
    callbacks = [] if ledger is None else [LedgerCheck(ledger)]
    hooks = timed_hooks(callbacks)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    return time.perf_counter() - start, hooks[0], int(trainer.global_step)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=positive_int, nargs="+", default=[1_000_000, 10_000_000],
                   help="ledger sizes in documents (default: %(default)s)")
    p.add_argument("--compression", default="zstd", help="Parquet codec (default: %(default)s)")
    p.add_argument("--reps", type=positive_int, default=3, help="interleaved pairs of fits (default: %(default)s)")
    p.add_argument("--fit-docs", type=positive_int, default=1500, help="documents of the fits (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=1024, help="the fits' budget (default: %(default)s)")
    p.add_argument("--d-model", type=positive_int, default=64, help="the fits' model width (default: %(default)s)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/ledger"), help="results.json goes here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_ledger-") as tmp:
        tmp = Path(tmp)
        rows = [writing(n, tmp, args.compression) for n in args.documents]
        for r in rows:
            print(f"{r['documents']:>11,} documents: plan {r['plan_s']:.2f} s, ledger {r['ledger_s']:.2f} s "
                  f"({r['ledger_docs_per_s'] / 1e6:.2f} M documents/s), {r['bytes'] / 1e6:.1f} MB "
                  f"({r['bytes_per_row']:.2f} bytes/row)")
        dm = fit_data(args.fit_docs, args.max_tokens, str(tmp / "cache"))
        dm.prepare_data()
        dm.setup("fit")
        ledger = tmp / "fit_ledger.parquet"
        write_ledger(ledger, dm.train_sampler)
        fit(args, dm, None)  # warm-up: imports, allocator, kernels
        pairs = [(fit(args, dm, None), fit(args, dm, ledger)) for _ in range(args.reps)]
    steps = pairs[0][0][2]
    step_s = [base[0] / base[2] for base, _ in pairs]
    check_s = [checked[1] / checked[2] for _, checked in pairs]
    ratios = [c / s for c, s in zip(check_s, step_s)]
    print(f"fit: {steps} optimizer steps, step {1e3 * statistics.median(step_s):.1f} ms; LedgerCheck "
          f"{1e6 * statistics.median(check_s):.0f} us per step = {100 * statistics.median(ratios):.3f} % of a step "
          f"(median of {args.reps})")
    table = markdown_table(
        ["documents (8 ranks)", "plan s", "ledger s", "M documents/s", "MB", "bytes/row"],
        [[f"{r['documents']:,}", f"{r['plan_s']:.2f}", f"{r['ledger_s']:.2f}", f"{r['ledger_docs_per_s'] / 1e6:.2f}",
          f"{r['bytes'] / 1e6:.1f}", f"{r['bytes_per_row']:.2f}"] for r in rows])
    table += (f"\n\nLedgerCheck: {1e6 * statistics.median(check_s):.0f} us per optimizer step, "
              f"{100 * statistics.median(ratios):.3f} % of the step time ({1e3 * statistics.median(step_s):.1f} ms; "
              f"{steps} steps, median of {args.reps} interleaved pairs)")
    return write_report(args.output_dir, "benchmarks.ledger", argv, {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "writing": rows,
        "fit_optimizer_steps": steps, "step_s": step_s, "check_s_per_step": check_s, "check_step_ratio": ratios},
        markdown=table)


if __name__ == "__main__":
    main()
