"""Parquet against Arrow IPC as a store read in place: time per micro-batch, the same ids from each.

One corpus of ``--documents`` documents (lengths uniform in ``[1, --longest]``, ids uniform below 30,522, seeded) is
written twice with pyarrow: a Parquet file in ``--row-groups`` row groups (``pyarrow.parquet.write_table``, default
compression) and an Arrow IPC file. Each is given to ``BalancedTextDataModule(ArrowSource(path), ...)`` (one rank,
``max_tokens``, ``val_fraction=0``, shuffled plan of epoch 0); the Parquet file's construction includes its one-time
copy to Arrow IPC (``construct_s``). Then ``--micro-batches`` micro-batches are built from each store, alternating
(Arrow, Parquet, Arrow, ...) so both see the same machine load: each is ``dataset.__getitems__`` of the sampler's
indices and the collator (what a DataLoader without workers does per micro-batch). Reported: median and p90 seconds
per micro-batch of each, and the ratio of the medians (Parquet over Arrow).

Run:
    python -m benchmarks.store_parquet                       # 200k documents, 8 row groups
    python -m benchmarks.store_parquet --documents 20000 --micro-batches 20   # quick
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import positive_int, status_kib, write_report

VOCAB = 30522


def write_corpus(work: Path, documents: int, longest: int, row_groups: int, seed: int) -> tuple[Path, Path, int]:
    """``(parquet, arrow, tokens)``: the same ``input_ids`` lists as Parquet (``row_groups`` row groups) and IPC."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=documents)
    offsets = np.zeros(documents + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, VOCAB, size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    table = pa.table({"input_ids": column})
    parquet, arrow = work / "corpus.parquet", work / "corpus.arrow"
    pq.write_table(table, parquet, row_group_size=-(-documents // row_groups))
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=-(-documents // row_groups))
    assert pq.ParquetFile(parquet).num_row_groups == row_groups
    return parquet, arrow, int(offsets[-1])


def _module(path: Path, cache_dir: Path, max_tokens: int, seed: int) -> tuple[Any, float]:
    from lit_balance import BalancedTextDataModule
    from lit_balance.data.stores import ArrowSource

    start = time.perf_counter()
    dm = BalancedTextDataModule(ArrowSource(path, cache_dir=cache_dir), vocab_size=VOCAB, pad_token_id=0,
                                max_tokens=max_tokens, max_length=None, val_fraction=0.0, seed=seed,
                                cache_dir=cache_dir / "tokenized")
    construct_s = time.perf_counter() - start
    dm.setup("fit")
    dm.train_sampler.set_epoch(0)
    return dm, construct_s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=positive_int, default=200_000)
    parser.add_argument("--row-groups", type=positive_int, default=8)
    parser.add_argument("--longest", type=positive_int, default=512, help="longest document, tokens")
    parser.add_argument("--max-tokens", type=positive_int, default=16384, help="padded token slots per micro-batch")
    parser.add_argument("--micro-batches", type=positive_int, default=60, help="micro-batches timed per store")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/store_parquet"))
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="parquet_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        parquet, arrow, tokens = write_corpus(work, args.documents, args.longest, args.row_groups, args.seed)
        write_s = time.perf_counter() - start
        stores = {}
        for name, path in (("arrow", arrow), ("parquet", parquet)):
            dm, construct_s = _module(path, work / f"cache_{name}", args.max_tokens, args.seed)
            stores[name] = {"dm": dm, "construct_s": construct_s, "batches": iter(dm.train_sampler), "times": []}
        rss_after_setup_mb = status_kib("VmRSS") / 1024
        for _ in range(args.micro_batches):
            for name in ("arrow", "parquet"):
                store = stores[name]
                indices = next(store["batches"])
                dataset, collate = store["dm"].train_dataset, store["dm"].collator
                began = time.perf_counter()
                batch = collate(dataset.__getitems__(indices))
                store["times"].append(time.perf_counter() - began)
                store.setdefault("rows", []).append(int(batch["input_ids"].shape[0]))
        rows = {}
        for name, store in stores.items():
            times = np.asarray(store["times"])
            rows[name] = {"construct_s": store["construct_s"], "median_s": float(np.median(times)),
                          "p90_s": float(np.quantile(times, 0.9)), "mean_rows": float(np.mean(store["rows"]))}
        ratio = rows["parquet"]["median_s"] / rows["arrow"]["median_s"]
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = {"rows": rows, "parquet_over_arrow_median": ratio, "num_tokens": tokens, "write_s": write_s,
               "rss_after_setup_mb": rss_after_setup_mb, "peak_rss_mb": status_kib("VmHWM") / 1024,
               "settings": {k: str(v) for k, v in vars(args).items()}}
    print(f"median s per micro-batch: Arrow {rows['arrow']['median_s']:.4f}, Parquet {rows['parquet']['median_s']:.4f} "
          f"(ratio {ratio:.2f})")
    return write_report(args.output_dir, "benchmarks.store_parquet", argv, results)


if __name__ == "__main__":
    main()
