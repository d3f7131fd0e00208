"""The ledger's cost: writing it for 1M and 10M documents on 8 ranks (time, documents per second, file size), and
LedgerCheck's time per optimizer step over the step time of the fit of :mod:`benchmarks.bench_callbacks`, checking
against a ledger and recording for a later ``lit-balance ledger check`` (``record=``, its file written at the epoch's
end included).

Run: ``python -m benchmarks.ledger`` (smallest: ``--documents 20000 --fit-docs 300 --reps 1``). The planning of an
epoch in windows (``plan_parts()``, which training pays anyway) is timed apart and left out of ``ledger_docs_per_s``;
LedgerCheck's per-step hooks (its gather included) are timed, and reading the ledger at the epoch's start apart.
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
from lit_balance import BalancedBatchSampler, use_training_sampler
from lit_balance.callbacks import LedgerCheck
from lit_balance.demo import DemoTransformerLM
from lit_balance.ledger import write_ledger


def writing(documents: int, out: Path, compression: str) -> dict:
    """Time and size of the ledger of ``documents`` documents on 8 ranks."""
    sampler = BalancedBatchSampler(np.resize(load_lengths("pydocs_paragraphs", 2048), documents), max_tokens=16384,
                                   num_replicas=8, rank=0)
    _, plan_s = timed(lambda: sum(p.num_micro_steps for p in sampler.plan_parts()))
    header, total_s = timed(lambda: write_ledger(out / "ledger.parquet", sampler, compression=compression))
    ledger_s = total_s - plan_s if sampler.windows is not None else total_s  # planned again as it is laid out
    return {"documents": documents, "rows": header["rows"], "plan_s": plan_s, "ledger_s": ledger_s,
            "ledger_docs_per_s": header["rows"] / ledger_s, "bytes": os.path.getsize(out / "ledger.parquet")}


def _timer(callback: L.Callback, hooks: tuple[str, ...]) -> list[float]:
    """Wrap ``hooks`` of ``callback``: their wall seconds add up in the returned one-element list."""
    total = [0.0]
    for name in hooks:
        def wrapper(*args, _method=getattr(callback, name), **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start
        setattr(callback, name, wrapper)
    return total


def fit(args: argparse.Namespace, dm, ledger: Path | None, record: Path | None = None
        ) -> tuple[float, float, float, int]:
    """``(fit s, LedgerCheck's s reading the ledger, its s in the per-step hooks, optimizer steps)`` of one epoch;
    with ``record``, LedgerCheck records instead of checking (the per-step hooks then include writing the record)."""
    torch.manual_seed(0)
    model = DemoTransformerLM(512, d_model=64, num_heads=4, num_layers=2, dim_feedforward=256)
    callbacks = [LedgerCheck(ledger, record=record)] if ledger is not None or record is not None else []
    load, steps = ([_timer(callbacks[0], hooks) for hooks in (("on_train_epoch_start",), (
        "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end"))] if callbacks else ([0.0], [0.0]))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    use_training_sampler(trainer, dm.train_sampler)  # the loader is passed to fit: LedgerCheck reads its sampler
    return timed(lambda: trainer.fit(model, train_dataloaders=loader))[1], load[0], steps[0], int(trainer.global_step)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=positive_int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--compression", default="zstd")
    p.add_argument("--reps", type=positive_int, default=3, help="interleaved pairs of fits (default: %(default)s)")
    p.add_argument("--fit-docs", type=positive_int, default=1500, help="documents of the fits (default: %(default)s)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/ledger"), help="results.json goes here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_ledger-") as tmp:
        rows = [writing(n, Path(tmp), args.compression) for n in [1000, *args.documents]][1:]  # first: warm-up
        (dm := fit_data(args.fit_docs, 1024, str(Path(tmp) / "cache"))).prepare_data()
        dm.setup("fit")
        write_ledger(Path(tmp) / "fit.parquet", dm.train_sampler)
        fit(args, dm, None)  # warm-up: imports, allocator, kernels
        triples = [(fit(args, dm, None), fit(args, dm, Path(tmp) / "fit.parquet"),
                    fit(args, dm, None, record=Path(tmp) / f"record{i}")) for i in range(args.reps)]
    steps, step_s = triples[0][0][3], [base[0] / base[3] for base, _, _ in triples]
    check_s, load_s = [c[2] / c[3] for _, c, _ in triples], [c[1] for _, c, _ in triples]
    record_s = [r[2] / r[3] for _, _, r in triples]
    ratios = [c / s for c, s in zip(check_s, step_s)]
    record_ratios = [r / s for r, s in zip(record_s, step_s)]
    line = (f"LedgerCheck: {1e6 * statistics.median(check_s):.0f} us per optimizer step = "
            f"{100 * statistics.median(ratios):.3f} % of a step ({1e3 * statistics.median(step_s):.1f} ms, {steps} "
            f"steps), and {1e3 * statistics.median(load_s):.0f} ms per epoch reading the ledger; recording "
            f"(record=, its file included): {1e6 * statistics.median(record_s):.0f} us per optimizer step = "
            f"{100 * statistics.median(record_ratios):.3f} % of a step (median of {args.reps})")
    table = markdown_table(["documents (8 ranks)", "plan s", "ledger s", "M documents/s", "MB", "bytes/row"],
                           [[f"{r['documents']:,}", f"{r['plan_s']:.2f}", f"{r['ledger_s']:.2f}",
                             f"{r['ledger_docs_per_s'] / 1e6:.2f}", f"{r['bytes'] / 1e6:.1f}",
                             f"{r['bytes'] / r['rows']:.2f}"] for r in rows]) + f"\n\n{line}"
    print(table)
    return write_report(args.output_dir, "benchmarks.ledger", argv, {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "writing": rows,
        "fit_optimizer_steps": steps, "step_s": step_s, "check_s_per_step": check_s, "check_step_ratio": ratios,
        "check_load_s": load_s, "record_s_per_step": record_s, "record_step_ratio": record_ratios}, markdown=table)


if __name__ == "__main__":
    main()
