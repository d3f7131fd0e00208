"""Training from a Megatron store read in place: time from ``setup()`` to the first micro-batch, and peak memory.

Run:
    python -m benchmarks.store_megatron                          # 1M, 10M, 100M documents; the cache at 1M
    python -m benchmarks.store_megatron --sizes 1000000 --cache-sizes 1000000
    python -m benchmarks.store_megatron --quick                  # small sizes, for tests

How it measures: ``docs/benchmarks.md`` (a megatron store read in place).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks._harness import child_main, positive_int, run_child, status_kib, write_report
from benchmarks.scale import pooled_lengths

FULL_SIZES = (1_000_000, 10_000_000, 100_000_000)
QUICK_SIZES = (2_000, 20_000)
_CHUNK = 1 << 22  # index entries written per step
_MIB = 1 << 20
VOCAB = 30522


def write_store(prefix: Path, num_docs: int, pool: np.ndarray, seed: int, dtype: Any = np.uint16) -> int:
    """Write ``prefix.idx`` (megatron-core's layout, with NumPy) and a sparse ``prefix.bin``; return the tokens.

    One sequence per document (``preprocess_data.py`` without ``--split-sentences``): ``num_docs`` sequence lengths
    drawn from ``pool`` (seeded), pointers their byte offsets, the document index ``0..num_docs``.
    """
    from lit_balance.data.stores.megatron import MEGATRON_DTYPES

    code = next(c for c, d in MEGATRON_DTYPES.items() if d == np.dtype(dtype))
    itemsize = np.dtype(dtype).itemsize
    rng = np.random.default_rng(seed)
    total = 0
    with open(f"{prefix}.idx", "wb") as out:  # megatron-core's header: magic, version, dtype code, sequences, documents
        out.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, num_docs, num_docs + 1))
        chunks = []
        for start in range(0, num_docs, _CHUNK):  # lengths, remembered in chunks for the pointers
            lengths = pool[rng.integers(0, len(pool), min(_CHUNK, num_docs - start))].astype(np.int32)
            out.write(lengths.tobytes())
            chunks.append(lengths)
        for lengths in chunks:
            pointers = np.empty(len(lengths), np.int64)
            pointers[0] = total * itemsize
            np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
            pointers[1:] += total * itemsize
            out.write(pointers.tobytes())
            total += int(lengths.sum(dtype=np.int64))
        for start in range(0, num_docs + 1, _CHUNK):
            out.write(np.arange(start, min(start + _CHUNK, num_docs + 1), dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as out:
        out.truncate(total * itemsize)  # sparse: no token byte on disk
    return total


def check_against_megatron_core(work: Path, pool: np.ndarray) -> None:
    """Write a small store with :func:`write_store` and read it back with megatron-core's ``IndexedDataset``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    from lit_balance.data.stores import MegatronSource

    prefix = work / "check"
    write_store(prefix, 5000, pool, seed=1)
    reference = IndexedDataset(str(prefix))
    store = MegatronSource(prefix).store
    if not (np.array_equal(reference.sequence_lengths, store.lengths)
            and np.array_equal(reference.document_indices, np.arange(5001))
            and np.array_equal(reference.index.sequence_pointers[1:],
                               np.cumsum(reference.sequence_lengths[:-1].astype(np.int64)) * 2)):
        raise RuntimeError("the NumPy-written .idx does not read back through megatron-core as written")
    if reference[4999].shape[0] != store.lengths[4999]:
        raise RuntimeError("megatron-core reads another length for the last document")


def _fake_trainer(num_replicas: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=num_replicas, global_rank=0, current_epoch=0, accumulate_grad_batches=1,
                           strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas,
                                                                                "rank": 0}))


def _first_batch(dm: Any, num_replicas: int) -> dict[str, Any]:
    dm.trainer = _fake_trainer(num_replicas)
    start, cpu = time.perf_counter(), time.process_time()
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    loader = dm.train_dataloader()
    dm.train_sampler.set_epoch(0)
    batch = next(iter(loader))
    first_s, first_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {"setup_s": setup_s, "first_batch_s": first_s, "first_batch_cpu_s": first_cpu_s,
            "micro_batches_per_rank": len(dm.train_sampler), "first_batch_rows": int(batch["input_ids"].shape[0]),
            "num_documents": len(dm.train_dataset)}


def _child_store(prefix: str, num_replicas: str, max_tokens: str) -> dict[str, Any]:
    from lit_balance import BalancedTextDataModule
    from lit_balance.data.stores import MegatronSource

    rss_after_import = status_kib("VmRSS")
    start = time.perf_counter()
    dm = BalancedTextDataModule(MegatronSource(prefix), vocab_size=VOCAB, pad_token_id=0, max_tokens=int(max_tokens),
                                max_length=None, val_fraction=0.0, num_workers=0, cache_dir=Path(prefix).parent / "c")
    construct_s = time.perf_counter() - start  # the .idx read and checked, the lengths
    row = _first_batch(dm, int(num_replicas))
    return {**row, "construct_s": construct_s, "rss_after_import_kib": rss_after_import,
            "peak_rss_kib": status_kib("VmHWM"), "cache_written": (Path(prefix).parent / "c").exists()}


def _child_cache(prefix: str, num_replicas: str, max_tokens: str) -> dict[str, Any]:
    from lit_balance import BalancedTextDataModule
    from lit_balance.data.stores import MegatronSource

    rss_after_import = status_kib("VmRSS")
    store = MegatronSource(prefix).store
    docs = [np.zeros(int(n), np.int64) for n in store.lengths]  # the store's ids (zeros: the .bin is sparse)
    del store
    cache = Path(tempfile.mkdtemp(prefix="store_bench_cache_"))
    try:
        dm = BalancedTextDataModule(docs, vocab_size=VOCAB, pad_token_id=0, max_tokens=int(max_tokens), max_length=None,
                                    val_fraction=0.0, num_workers=0, cache_dir=cache)
        start = time.perf_counter()
        dm.prepare_data()
        prepare_s = time.perf_counter() - start
        del docs
        row = _first_batch(dm, int(num_replicas))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {**row, "prepare_data_s": prepare_s, "rss_after_import_kib": rss_after_import,
            "peak_rss_kib": status_kib("VmHWM")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if (out := child_main(argv, {"store": _child_store, "cache": _child_cache})) is not None:
        return out
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=None, help="documents per store")
    parser.add_argument("--cache-sizes", type=positive_int, nargs="*", default=None,
                        help="sizes also run through the tokenization cache (default: the smallest)")
    parser.add_argument("--num-replicas", type=positive_int, default=8, help="ranks of the plan (rank 0 measured)")
    parser.add_argument("--max-tokens", type=positive_int, default=16384, help="padded token slots per micro-batch")
    parser.add_argument("--max-length", type=positive_int, default=4096, help="cap of the sampled lengths, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, for tests")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the stores are written (default: a "
                        "temporary directory, removed after)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/store_megatron"))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    cache_sizes = args.cache_sizes if args.cache_sizes is not None else [min(sizes)]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="store_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    pool = pooled_lengths(args.max_length)
    rows = []
    try:
        check_against_megatron_core(work, pool)
        for size in sizes:
            prefix = work / f"store_{size}"
            start = time.perf_counter()
            tokens = write_store(prefix, size, pool, args.seed)
            write_s = time.perf_counter() - start
            common = [str(args.num_replicas), str(args.max_tokens)]
            kinds = ["store", *(["cache"] if size in cache_sizes else [])]
            for kind in kinds:
                result = run_child("benchmarks.store_megatron", kind, str(prefix), *common, timeout_s=args.timeout_s)
                rows.append({"path": kind, "num_documents": size, "num_tokens": tokens,
                             "idx_mb": os.path.getsize(f"{prefix}.idx") / _MIB, "write_s": write_s,
                             "peak_rss_mb": result.pop("peak_rss_kib") / 1024,
                             "rss_after_import_mb": result.pop("rss_after_import_kib") / 1024, **result})
                print(json.dumps(rows[-1]), flush=True)
            for suffix in (".bin", ".idx"):
                os.remove(f"{prefix}{suffix}")
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("work_dir", "output_dir")}
    return write_report(args.output_dir, "benchmarks.store_megatron", argv, {"rows": rows, "settings": settings})


if __name__ == "__main__":
    main()
