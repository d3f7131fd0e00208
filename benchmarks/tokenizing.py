"""Tokenizing raw text: the library's cache (``prepare_data``) against a peer on the same JSONL corpus, in pairs.

Run:
    python -m benchmarks.tokenizing                           # against encode_batch: 150 MB and 1.5 GB (about an hour)
    python -m benchmarks.tokenizing --quick                   # 5 MB and 20 MB
    python -m benchmarks.tokenizing --sizes-mb 150 --pairs 5  # 5 interleaved pairs (about 6 min quiet)
    python -m benchmarks.tokenizing --peer datatrove --sizes-mb 150 --pairs 3 [--single-thread-tokenizer]

Each size's corpus is sampled (seeded) from the built-in one. Per pair, one fresh process runs
``BalancedTextDataModule(corpus=...).prepare_data()`` and another the peer, alternating which goes first: the
tokenizer's own ``encode_batch`` on the same stream (``--peer encode_batch``), or datatrove's ``DocumentTokenizer``
(``lit_balance.cli.tokenize.tokenize_corpus``) with ``--workers`` tasks on the corpus split into as many files of
consecutive lines (``--peer datatrove``); both must produce the same tokens (token count and sorted non-empty
lengths). Reported per size: the cache's peak resident memory above the process after import, and tokens/s of both
with their ratio (the cache's over the peer's; the median over pairs). How it measures, and the figures of its runs:
``docs/benchmarks/reports/2026-12-02-tokenizing.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import child_main, machine, number, positive_int, run_child, status_kib, write_report
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer, stdlib_docstrings

__all__ = ["make_corpus", "run", "split_lines", "table"]

FULL_SIZES_MB = (150.0, 1500.0)
QUICK_SIZES_MB = (5.0, 20.0)
PEERS = ("encode_batch", "datatrove")
_CHILD_TIMEOUT_S = 6 * 3600
_MB = 1 << 20


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> dict[str, int]:
    """Write a JSONL corpus of at least ``size_mb`` MiB (then stop at the next line) sampled from the built-in one.

    Documents are drawn uniformly with replacement (``numpy.random.default_rng(seed)``), so a given size and seed
    always give the same file.

    Returns:
        ``{"bytes": file size, "num_docs": lines written}``.
    """
    lines = [(json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8") for doc in stdlib_docstrings()]
    rng = np.random.default_rng(seed)
    target, written, num_docs = int(size_mb * _MB), 0, 0
    with open(path, "wb") as handle:
        while written < target:
            for index in rng.integers(0, len(lines), size=4096):
                handle.write(lines[index])
                written += len(lines[index])
                num_docs += 1
                if written >= target:
                    break
    return {"bytes": written, "num_docs": num_docs}


def split_lines(corpus: Path, folder: Path, parts: int) -> list[Path]:
    """Write the lines of ``corpus`` into ``parts`` files of consecutive lines (``part-00000.jsonl``, ...) in
    ``folder``, as even in lines as integer division allows; return their paths."""
    with open(corpus, "rb") as handle:
        lines = handle.readlines()
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(lines), parts + 1).astype(int)
    paths = []
    for part in range(parts):
        path = folder / f"part-{part:05d}.jsonl"
        with open(path, "wb") as handle:
            handle.writelines(lines[bounds[part]:bounds[part + 1]])
        paths.append(path)
    return paths


def _digest(lengths: np.ndarray | list[int]) -> str:
    """sha256 of the sorted non-zero lengths: equal for the same documents in any order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return hashlib.sha256(np.sort(lengths[lengths > 0]).astype("<i8").tobytes()).hexdigest()


def _child_cache(cache_dir: str, *files: str) -> dict[str, Any]:
    from lit_balance import BalancedTextDataModule  # the baseline: the package and the DataModule imported

    rss_after_import = status_kib("VmRSS")
    paths = [Path(f) for f in files]
    module = BalancedTextDataModule(corpus=paths[0] if len(paths) == 1 else paths, cache_dir=cache_dir)
    start = time.perf_counter()
    module.prepare_data()
    seconds, peak = time.perf_counter() - start, status_kib("VmHWM")
    built = load_or_build(module.source, module.tokenizer, cache_dir)  # the entry just built, read back
    return {"seconds": seconds, "num_tokens": int(built.offsets[-1]), "num_docs": len(built) + built.num_empty,
            "lengths_digest": _digest(np.diff(np.asarray(built.offsets, dtype=np.int64))),
            "rss_after_import_kib": rss_after_import, "peak_rss_kib": peak}


def _child_encode_batch(corpus: str) -> dict[str, Any]:
    backend = resolve_tokenizer().backend
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    seconds, lengths, start = 0.0, [], time.perf_counter()
    for chunk in resolve_corpus(Path(corpus)).iter_chunks():
        texts = list(chunk.texts)
        before = time.perf_counter()
        encodings = encode(texts, add_special_tokens=False)
        seconds += time.perf_counter() - before
        lengths += map(len, encodings)
    return {"seconds": seconds, "wall_s": time.perf_counter() - start, "num_docs": len(lengths),
            "num_tokens": int(sum(lengths)), "lengths_digest": _digest(lengths)}


def _child_datatrove(folder: str, output: str, workers: str) -> dict[str, Any]:
    from lit_balance.cli.tokenize import tokenize_corpus

    start = time.perf_counter()
    result = tokenize_corpus(Path(folder), Path(output), tasks=int(workers), workers=int(workers),
                             glob_pattern="*.jsonl")
    seconds = time.perf_counter() - start
    lengths = np.concatenate([np.diff(np.fromfile(f + ".index", dtype="<u8").astype(np.int64), prepend=0)
                              for f in result.files])
    return {"seconds": seconds, "executor_s": result.seconds, "num_docs": result.num_documents,
            "num_tokens": result.num_tokens, "lengths_digest": _digest(lengths)}


def _run_child(kind: str, *args: str) -> dict[str, Any]:
    return run_child("benchmarks.tokenizing", kind, *args, timeout_s=_CHILD_TIMEOUT_S)


def _pair(peer: str, pair: int, corpus: Path, inputs: list[Path], work: Path) -> dict[str, Any]:
    """One pair on one corpus: the cache and the peer, each in a fresh process, the cache first in odd pairs."""
    cache_dir, output = work / f"cache_{pair}", work / f"store_{pair}"
    args = {"cache": (str(cache_dir), *map(str, inputs)), "encode_batch": (str(corpus),),
            "datatrove": (str(inputs[0].parent), str(output), str(len(inputs)))}
    order = ("cache", peer) if pair % 2 else (peer, "cache")
    got = {kind: _run_child(kind, *args[kind]) for kind in order}
    cache, other = got["cache"], got[peer]
    if (cache["num_tokens"], cache["lengths_digest"]) != (other["num_tokens"], other["lengths_digest"]):
        raise RuntimeError(f"the cache tokenized {cache['num_tokens']} tokens in {cache['num_docs']} documents, "
                           f"{peer} {other['num_tokens']} in {other['num_docs']}: different documents")
    shutil.rmtree(output, ignore_errors=True)
    return {"pair": pair, "first": order[0], "cache_s": cache["seconds"], "peer_s": other["seconds"],
            "ratio": other["seconds"] / cache["seconds"], "num_tokens": cache["num_tokens"],
            "cache_dir": str(cache_dir),
            "cache_docs": cache["num_docs"], "peer_docs": other["num_docs"],
            "peak_above_import_mb": (cache["peak_rss_kib"] - cache["rss_after_import_kib"]) / 1024,
            "rss_after_import_mb": cache["rss_after_import_kib"] / 1024, "peak_rss_mb": cache["peak_rss_kib"] / 1024,
            **{f"peer_{k}": v for k, v in other.items() if k in ("wall_s", "executor_s")}}


def run(sizes_mb: list[float] | tuple[float, ...], work_dir: str | os.PathLike | None = None, quick: bool = False,
        *, peer: str = "encode_batch", pairs: int = 1, workers: int = 2, seed: int = 0, keep: bool = False,
        ) -> list[dict[str, Any]]:
    """Measure the cache against ``peer`` on JSONL corpora of the given sizes; one row per size.

    Args:
        sizes_mb: corpus sizes in MiB, each > 0; empty: :data:`QUICK_SIZES_MB` with ``quick``, else
            :data:`FULL_SIZES_MB`.
        work_dir: where a temporary folder of the corpora and caches goes (removed unless ``keep``); None: the
            system's temporary directory.
        peer: ``"encode_batch"`` or ``"datatrove"`` (with ``workers`` tasks and input files).
        pairs: runs of both, alternating which goes first. seed: seed of the document sampling.

    Returns:
        One row per size: the corpus, tokens, every pair (``cache_s``, ``peer_s``, ``ratio``: the cache's tokens/s
        over the peer's, the cache's memory), the medians of both rates and of the ratio, the largest peak memory above
        the post-import process (MiB).

    Raises:
        ValueError: a size is not a positive number; ``pairs`` or ``workers`` not a positive int; an unknown peer.
        RuntimeError: a subprocess failed, or the two paths saw different documents.
    """
    sizes = list(sizes_mb) or list(QUICK_SIZES_MB if quick else FULL_SIZES_MB)
    if bad := [s for s in sizes if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0]:
        raise ValueError(f"sizes_mb must be positive numbers of MiB, got {bad}")
    for name, value in (("pairs", pairs), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")
    base = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tokenizing-", dir=base))
    rows = []
    try:
        for size in sizes:
            work = root / f"{size:g}MB"
            work.mkdir()
            corpus = work / "corpus.jsonl"
            made = make_corpus(corpus, size, seed)
            inputs = split_lines(corpus, work / "input", workers) if peer == "datatrove" else [corpus]
            measured = []
            for pair in range(1, pairs + 1):
                measured.append(_pair(peer, pair, corpus, inputs, work))
                if not keep:
                    shutil.rmtree(measured[-1]["cache_dir"], ignore_errors=True)
            tokens = measured[0]["num_tokens"]
            rows.append({"corpus_mb": size, "peer": peer, **made, "num_tokens": tokens, "pairs": measured,
                         "cache_tokens_per_s": statistics.median(tokens / p["cache_s"] for p in measured),
                         "peer_tokens_per_s": statistics.median(tokens / p["peer_s"] for p in measured),
                         "ratio": statistics.median(p["ratio"] for p in measured),
                         "peak_above_import_mb": max(p["peak_above_import_mb"] for p in measured),
                         **({"corpus": str(corpus)} if keep else {})})
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`run` as a Markdown table (every pair's ratio in brackets when there are several)."""
    lines = ["| corpus | documents | tokens | peer | peak above import | cache tokens/s | peer tokens/s | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = f" ({', '.join(format(p['ratio'], '.2f') for p in r['pairs'])})" if len(r["pairs"]) > 1 else ""
        lines.append(f"| {r['bytes'] / _MB:,.0f} MiB | {r['num_docs']:,} | {r['num_tokens']:,} | {r['peer']} | "
                     f"{r['peak_above_import_mb']:,.0f} MiB | {r['cache_tokens_per_s']:,.0f} | "
                     f"{r['peer_tokens_per_s']:,.0f} | {r['ratio']:.2f}{each} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a Markdown table; write ``results.json``; return the results."""
    if (out := child_main(argv, {"cache": _child_cache, "encode_batch": _child_encode_batch,
                                 "datatrove": _child_datatrove})) is not None:
        return out
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--peer", choices=PEERS, default="encode_batch", help="what the cache is measured against")
    p.add_argument("--sizes-mb", type=number(lambda v: v > 0, "a size in MiB > 0"), nargs="*", default=[],
                   help=f"corpus sizes in MiB (default {list(FULL_SIZES_MB)}; --quick: {list(QUICK_SIZES_MB)})")
    p.add_argument("--quick", action="store_true", help="small default sizes")
    p.add_argument("--pairs", type=positive_int, default=1, help="pairs of runs, alternating which goes first")
    p.add_argument("--workers", type=positive_int, default=2, help="datatrove tasks and workers (input files)")
    p.add_argument("--single-thread-tokenizer", action="store_true",
                   help="TOKENIZERS_PARALLELISM=false in every subprocess (one tokenizing thread per process)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document sampling")
    p.add_argument("--work-dir", type=Path, default=None, help="temporary files go in a folder inside it")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/tokenizing"), help="results.json goes here")
    args = p.parse_args(argv)
    if args.single_thread_tokenizer:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by the subprocesses (run_child copies os.environ)
    started, load_before = time.perf_counter(), machine()["load_average"]
    rows = run(args.sizes_mb, args.work_dir, args.quick, peer=args.peer, pairs=args.pairs, workers=args.workers,
               seed=args.seed)
    print(table(rows))
    return write_report(args.output_dir, "benchmarks.tokenizing", argv, {
        "rows": rows, "load_average_before": load_before, "wall_s": time.perf_counter() - started,
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")})


if __name__ == "__main__":
    main()
