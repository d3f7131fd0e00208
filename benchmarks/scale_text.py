"""Tokenizing large corpora: peak memory and speed of ``prepare_data`` beside the tokenizer's own ``encode_batch``.

Run:
    python -m benchmarks.scale_text                    # 150 MB and 1.5 GB (about an hour on 2 busy cores)
    python -m benchmarks.scale_text --quick            # 5 MB and 20 MB
    python -m benchmarks.scale_text --sizes-mb 150 --pairs 5   # 5 interleaved pairs (about 6 min quiet)
    python -m benchmarks.scale_text --sizes-mb 150 --work-dir /big/tmp --output-dir outputs/scale_text

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

from benchmarks._harness import number, positive_int, run_child, status_kib, write_report
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer, stdlib_docstrings

__all__ = ["make_corpus", "run", "table"]

FULL_SIZES_MB = (150.0, 1500.0)
QUICK_SIZES_MB = (5.0, 20.0)
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


def _child_prepare(corpus: Path, cache_dir: Path) -> dict[str, Any]:
    from lit_balance import BalancedTextDataModule  # the baseline: the package and the DataModule imported

    rss_after_import = status_kib("VmRSS")
    module = BalancedTextDataModule(corpus=corpus, cache_dir=cache_dir)
    start = time.perf_counter()
    module.prepare_data()
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    built = load_or_build(module.source, module.tokenizer, cache_dir)  # the entry just built, read back
    return {"rss_after_import_kib": rss_after_import, "peak_rss_kib": peak, "seconds": seconds,
            "num_docs": len(built) + built.num_empty, "num_tokens": int(built.offsets[-1])}


def _child_encode(corpus: Path) -> dict[str, Any]:
    backend = resolve_tokenizer().backend
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encode_s, num_docs, num_tokens, start = 0.0, 0, 0, time.perf_counter()
    for chunk in resolve_corpus(corpus).iter_chunks():
        texts = list(chunk.texts)
        before = time.perf_counter()
        encodings = encode(texts, add_special_tokens=False)
        encode_s += time.perf_counter() - before
        num_docs += len(encodings)
        num_tokens += sum(map(len, encodings))
    return {"seconds": encode_s, "wall_s": time.perf_counter() - start, "num_docs": num_docs,
            "num_tokens": num_tokens}


def _run_child(*args: str) -> dict[str, Any]:
    return run_child("benchmarks.scale_text", *args, timeout_s=_CHILD_TIMEOUT_S)


def run(sizes_mb: list[float] | tuple[float, ...], work_dir: str | os.PathLike | None = None, quick: bool = False,
        *, keep: bool = False, seed: int = 0, pairs: int = 1) -> list[dict[str, Any]]:
    """Measure ``prepare_data`` and ``encode_batch`` on JSONL corpora of the given sizes; one row per size.

    Args:
        sizes_mb: corpus sizes in MiB, each > 0; empty: :data:`QUICK_SIZES_MB` with ``quick``, else
            :data:`FULL_SIZES_MB`.
        work_dir: where a temporary folder of the corpora and caches goes (removed unless ``keep``); None: the
            system's temporary directory.
        seed: seed of the document sampling; pairs: runs of both subprocesses, alternating which goes first.

    Returns:
        One row per size: the corpus, the peak memory above the post-import process (MiB), the token rates of both
        paths and their ratio (of the pair with the median ratio; every pair's in ``ratio_per_pair``).

    Raises:
        ValueError: a size is not a positive number; ``pairs`` not a positive int.
        RuntimeError: a subprocess failed, or the two runs saw different documents or token counts.
    """
    sizes = list(sizes_mb) or list(QUICK_SIZES_MB if quick else FULL_SIZES_MB)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0]
    if bad:
        raise ValueError(f"sizes_mb must be positive numbers of MiB, got {bad}")
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
        raise ValueError(f"pairs must be a positive int, got {pairs!r}")
    base = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="scale_text-", dir=base))
    rows = []
    try:
        for size in sizes:
            corpus = root / f"corpus_{size:g}MB.jsonl"
            start = time.perf_counter()
            made = make_corpus(corpus, size, seed)
            make_s = time.perf_counter() - start
            measured = []
            for pair in range(1, pairs + 1):
                cache_dir = root / f"cache_{size:g}MB_pair{pair}"
                order = ("prepare", "encode") if pair % 2 else ("encode", "prepare")
                child_args = {"prepare": (str(corpus), str(cache_dir)), "encode": (str(corpus),)}
                got = {kind: _run_child(kind, *child_args[kind]) for kind in order}
                prepared, encoded = {**got["prepare"], "cache_dir": str(cache_dir)}, got["encode"]
                if (prepared["num_docs"], prepared["num_tokens"]) != (encoded["num_docs"], encoded["num_tokens"]):
                    raise RuntimeError(f"prepare_data saw {prepared['num_docs']} documents / "
                                       f"{prepared['num_tokens']} tokens but encode_batch {encoded['num_docs']} / "
                                       f"{encoded['num_tokens']}")
                ratio = (prepared["num_tokens"] / prepared["seconds"]) / (encoded["num_tokens"] / encoded["seconds"])
                measured.append((ratio, prepared, encoded))
                if not keep and pair < pairs:
                    shutil.rmtree(cache_dir, ignore_errors=True)
            ratios = [m[0] for m in measured]
            median = statistics.median(ratios)
            _, prepared, encoded = min(measured, key=lambda m: abs(m[0] - median))  # the median pair (odd counts)
            tokens_per_s = prepared["num_tokens"] / prepared["seconds"]
            encode_rate = encoded["num_tokens"] / encoded["seconds"]
            peak = max(measured, key=lambda m: m[1]["peak_rss_kib"] - m[1]["rss_after_import_kib"])[1]
            rows.append({
                "corpus_mb": size, "bytes": made["bytes"], "num_docs": made["num_docs"],
                "num_tokens": prepared["num_tokens"],
                "rss_after_import_mb": peak["rss_after_import_kib"] / 1024,
                "peak_rss_mb": peak["peak_rss_kib"] / 1024,
                "peak_above_import_mb": (peak["peak_rss_kib"] - peak["rss_after_import_kib"]) / 1024,
                "tokenize_s": prepared["seconds"], "tokens_per_s": tokens_per_s,
                "encode_batch_s": encoded["seconds"], "encode_batch_wall_s": encoded["wall_s"],
                "encode_batch_tokens_per_s": encode_rate, "ratio_to_encode_batch": median,
                "ratio_per_pair": ratios, "pairs": pairs,
                "make_corpus_s": make_s,
                **({"corpus": str(corpus), "cache_dir": prepared["cache_dir"]} if keep else {}),
            })
            if not keep:
                corpus.unlink()
                shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`run` as a Markdown table (the ratio of every pair in brackets when there are several)."""
    lines = [("| corpus | documents | tokens | RSS after import | peak RSS | peak above import | prepare_data | "
              "tokens/s | encode_batch tokens/s | ratio |"), "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['bytes'] / _MB:,.0f} MiB | {r['num_docs']:,} | {r['num_tokens']:,} | "
                     f"{r['rss_after_import_mb']:,.0f} MiB | {r['peak_rss_mb']:,.0f} MiB | "
                     f"{r['peak_above_import_mb']:,.0f} MiB | {r['tokenize_s']:,.1f} s | {r['tokens_per_s']:,.0f} | "
                     f"{r['encode_batch_tokens_per_s']:,.0f} | {r['ratio_to_encode_batch']:.2f}"
                     + (f" ({', '.join(f'{x:.2f}' for x in r['ratio_per_pair'])})" if r.get("pairs", 1) > 1 else "")
                     + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", type=number(lambda v: v > 0, "a size in MiB > 0"), nargs="*", default=[],
                   help=f"corpus sizes in MiB (default {list(FULL_SIZES_MB)}; --quick: {list(QUICK_SIZES_MB)})")
    p.add_argument("--quick", action="store_true", help="small default sizes")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="corpora and caches go in a temporary directory inside it (default: the system's temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document sampling")
    p.add_argument("--pairs", type=positive_int, default=1,
                   help="runs of prepare_data and encode_batch per size, alternating which goes first; the ratio "
                        "is the median over pairs")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/scale_text"), help="results.json goes here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a markdown table; write ``results.json``; return the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        if argv[1] == "prepare":
            out = _child_prepare(Path(argv[2]), Path(argv[3]))
        else:
            out = _child_encode(Path(argv[2]))
        print(json.dumps(out))
        return out
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    rows = run(args.sizes_mb, args.work_dir, args.quick, seed=args.seed, pairs=args.pairs)
    print(table(rows))
    return write_report(args.output_dir, "benchmarks.scale_text", argv, {"rows": rows, "wall_s": time.perf_counter() - started})


if __name__ == "__main__":
    main()
