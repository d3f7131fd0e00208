"""Raw text to tokens: datatrove's ``DocumentTokenizer`` with 2 workers against the library's tokenization cache.

Run:
    python -m benchmarks.tokenize_datatrove                          # 150 MiB, 3 pairs
    python -m benchmarks.tokenize_datatrove --single-thread-tokenizer
    python -m benchmarks.tokenize_datatrove --size-mb 5 --pairs 1    # a quick look

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-02-tokenizing.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import machine, number, positive_int, run_child, write_report

__all__ = ["run", "split_lines", "table"]

_CHILD_TIMEOUT_S = 3 * 3600
_MB = 1 << 20


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


def _child_datatrove(folder: Path, output: Path, workers: int) -> dict[str, Any]:
    from lit_balance.cli.tokenize import tokenize_corpus

    start = time.perf_counter()
    result = tokenize_corpus(folder, output, tasks=workers, workers=workers, glob_pattern="*.jsonl")
    seconds = time.perf_counter() - start
    lengths = np.concatenate([np.diff(np.fromfile(f + ".index", dtype="<u8").astype(np.int64), prepend=0)
                              for f in result.files])
    return {"seconds": seconds, "executor_s": result.seconds, "num_docs": result.num_documents,
            "num_tokens": result.num_tokens, "lengths_digest": _lengths_digest(lengths)}


def _child_cache(files: list[Path], cache_dir: Path) -> dict[str, Any]:
    from lit_balance import BalancedTextDataModule
    from lit_balance.data import load_or_build

    module = BalancedTextDataModule(corpus=list(files), cache_dir=cache_dir)
    start = time.perf_counter()
    module.prepare_data()
    seconds = time.perf_counter() - start
    built = load_or_build(module.source, module.tokenizer, cache_dir)
    lengths = np.diff(np.asarray(built.offsets, dtype=np.int64))
    return {"seconds": seconds, "num_docs": len(built), "num_empty": built.num_empty,
            "num_tokens": int(built.offsets[-1]), "lengths_digest": _lengths_digest(lengths)}


def _lengths_digest(lengths: np.ndarray) -> str:
    """sha256 of the sorted non-zero lengths: equal for the same documents in any order."""
    import hashlib

    kept = np.sort(lengths[lengths > 0]).astype("<i8")
    return hashlib.sha256(kept.tobytes()).hexdigest()


def _run_child(*args: str) -> dict[str, Any]:
    return run_child("benchmarks.tokenize_datatrove", *args, timeout_s=_CHILD_TIMEOUT_S)


def run(size_mb: float = 150.0, work_dir: str | Path | None = None, *, pairs: int = 3, workers: int = 2,
        seed: int = 0) -> dict[str, Any]:
    """Measure both paths on one corpus; return the row (see the module docstring).

    Returns:
        ``corpus_mb``, ``bytes``, ``num_docs`` (lines), ``num_tokens``, ``workers``, ``pairs``, per pair
        ``datatrove_s``, ``cache_s``, ``ratio`` (lists in pair order, pair 1 runs datatrove first), and
        ``datatrove_tokens_per_s``, ``cache_tokens_per_s``, ``ratio`` (medians over pairs).

    Raises:
        RuntimeError: a subprocess failed, or the two paths tokenized different documents.
    """
    from benchmarks.scale_text import make_corpus

    base = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tokenize_datatrove-", dir=base))
    try:
        corpus = root / "corpus.jsonl"
        made = make_corpus(corpus, size_mb, seed)
        files = split_lines(corpus, root / "input", workers)
        corpus.unlink()
        rows = []
        for pair in range(1, pairs + 1):
            output, cache_dir = root / f"store_{pair}", root / f"cache_{pair}"
            order = ("datatrove", "cache") if pair % 2 else ("cache", "datatrove")
            args = {"datatrove": (str(root / "input"), str(output), str(workers)),
                    "cache": (str(cache_dir), *map(str, files))}
            got = {kind: _run_child(kind, *args[kind]) for kind in order}
            store, cache = got["datatrove"], got["cache"]
            if (store["num_tokens"], store["lengths_digest"]) != (cache["num_tokens"], cache["lengths_digest"]):
                raise RuntimeError(f"datatrove wrote {store['num_tokens']} tokens in {store['num_docs']} documents, "
                                   f"the cache {cache['num_tokens']} in {cache['num_docs']} (+{cache['num_empty']} "
                                   "empty): the two paths tokenized different documents")
            rows.append({"pair": pair, "first": order[0], "datatrove_s": store["seconds"],
                         "datatrove_executor_s": store["executor_s"], "cache_s": cache["seconds"],
                         "ratio": cache["seconds"] / store["seconds"], "num_tokens": store["num_tokens"],
                         "store_docs": store["num_docs"], "cache_docs": cache["num_docs"],
                         "cache_empty": cache["num_empty"]})
            shutil.rmtree(output, ignore_errors=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tokens = rows[0]["num_tokens"]
    return {"corpus_mb": size_mb, "bytes": made["bytes"], "num_docs": made["num_docs"], "num_tokens": tokens,
            "workers": workers, "pairs": rows,
            "datatrove_tokens_per_s": statistics.median(tokens / r["datatrove_s"] for r in rows),
            "cache_tokens_per_s": statistics.median(tokens / r["cache_s"] for r in rows),
            "ratio": statistics.median(r["ratio"] for r in rows)}


def table(row: dict[str, Any]) -> str:
    """The result as a Markdown table: one line per pair, then the medians."""
    lines = ["| pair | first | datatrove (2 workers) | cache (prepare_data) | ratio of tokens/s |",
             "|---|---|---|---|---|"]
    for r in row["pairs"]:
        lines.append(f"| {r['pair']} | {r['first']} | {r['datatrove_s']:.1f} s | {r['cache_s']:.1f} s | "
                     f"{r['ratio']:.2f} |")
    lines.append(f"| median | | {row['datatrove_tokens_per_s']:,.0f} tokens/s | {row['cache_tokens_per_s']:,.0f} "
                 f"tokens/s | {row['ratio']:.2f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=number(lambda v: v > 0, "a size in MiB > 0"), default=150.0)
    p.add_argument("--pairs", type=positive_int, default=3, help="pairs of runs, alternating which goes first")
    p.add_argument("--workers", type=positive_int, default=2, help="datatrove tasks and workers (input files)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document sampling")
    p.add_argument("--work-dir", type=Path, default=None, help="temporary files go in a folder inside it")
    p.add_argument("--single-thread-tokenizer", action="store_true",
                   help="TOKENIZERS_PARALLELISM=false in both subprocesses (one tokenizing thread per process)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/tokenize_datatrove"),
                   help="results.json goes here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a Markdown table; write ``results.json``; return the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        if argv[1] == "datatrove":
            out = _child_datatrove(Path(argv[2]), Path(argv[3]), int(argv[4]))
        else:
            out = _child_cache([Path(a) for a in argv[3:]], Path(argv[2]))
        print(json.dumps(out))
        return out
    args = _parser().parse_args(argv)
    if args.single_thread_tokenizer:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by both subprocesses (run_child copies os.environ)
    started = time.perf_counter()
    load_before = machine()["load_average"]
    row = run(args.size_mb, args.work_dir, pairs=args.pairs, workers=args.workers, seed=args.seed)
    print(table(row))
    return write_report(args.output_dir, "benchmarks.tokenize_datatrove", argv, {
        "load_average_before": load_before, "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
        "row": row, "wall_s": time.perf_counter() - started})


if __name__ == "__main__":
    main()
