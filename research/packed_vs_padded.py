"""End-to-end packed versus padded micro-batches: the main job's model and corpus, 2 CPU DDP ranks, interleaved pairs.

Run:
    python -m research.packed_vs_padded            # 3 pairs, 3,000 documents of the built-in corpus, 1 epoch each
    python -m research.packed_vs_padded --quick    # 3 pairs, 400 documents (about 5 minutes on 2 busy cores)
    python -m research.packed_vs_padded --pairs 5 --num-docs 0   # every document of the corpus

Each run trains :class:`lit_balance.demo.DemoTransformerLM` (the main job's ``small`` size, token-weighted loss,
AdamW) through :class:`lit_balance.BalancedTextDataModule` with the main job's settings (``max_tokens=1024``,
``max_length=256``): **padded** (``packing=False``: :class:`lit_balance.PadCollator` rows, at most 1,024 padded
slots per micro-batch) or **packed** (``packing=True``: one :class:`lit_balance.PackedCollator` row of whole
documents, at most 1,024 real tokens; the model attends within each document). Both train every training document
once per epoch, so a pair trains the same real tokens (checked and reported). The documents are a seeded subset of
the main job's corpus (Python standard-library docstrings, BERT-uncased WordPiece; ``--num-docs 0``: all of them),
passed to the DataModule as token ids.

Runs alternate, padded then packed, ``--pairs`` times, so both variants meet the same machine load (this machine
is shared); pair ``i`` uses seed ``i`` for both (split, plan and model initialisation). Each run is one job of
``--devices`` ranks under torch's launcher (:func:`research._runs.launch_run`, with a timeout).

Measured per run (:mod:`research._training`): ``real_tokens_per_s``, real training tokens of all ranks (fill
documents excluded) over the slowest rank's training seconds per epoch (first ``on_train_batch_start`` to last
``on_train_batch_end``; start-up and validation excluded), over every epoch; ``padding_ratio``; micro-batches and
optimizer steps; ``val_loss`` after the last epoch, the exact mean over every validation token of all ranks.

Figures: per pair ``speedup = packed / padded real_tokens_per_s``; the median over pairs with min and max (the
target: median > 1). Validation loss: :data:`NOISE_RULE`. Outputs in ``--output-dir``: ``results.json`` (one object
per run), ``summary.json`` and ``results.md`` (the table), ``logs/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np

from benchmarks._harness import machine, positive_int
from research._runs import commit_label, launch_run
from research._training import MODEL_SIZES, CompareLM, Meter, corpus_documents, make_trainer, run_stats
from lit_balance import BalancedTextDataModule
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer

VARIANTS = ("padded", "packed")
#: Defaults of a run and of ``--quick``: corpus documents (a seeded subset; 0 = all), epochs, pairs.
FULL = {"num_docs": 3000, "epochs": 1, "pairs": 3}
QUICK = {"num_docs": 400, "epochs": 1, "pairs": 3}
NOISE_RULE = ("noise = sample standard deviation (ddof=1) over pairs of the padded runs' validation loss (each pair "
              "has its own seed: split, plan and initialisation); packed equals padded within noise when the mean "
              "over pairs of (packed - padded) is at most twice that noise in absolute value")
_WORKER_FLAG = "--_worker"


def documents(num_docs: int, cache_dir: str | None) -> list[np.ndarray]:
    """Token ids of a seeded subset of ``num_docs`` documents of the main job's corpus (0: every document)."""
    if num_docs:  # a seeded subset (:func:`benchmarks._training.split_documents`), the same for every run
        return corpus_documents(num_docs, 0.0, cache_dir)[0]
    corpus = load_or_build(resolve_corpus(None), resolve_tokenizer(None), cache_dir)
    return [corpus.document(d) for d in range(len(corpus))]


def run_worker(spec_path: Path) -> None:
    """Train one run as described by the JSON spec at ``spec_path``; rank 0 writes ``spec["result_path"]``."""
    spec = json.loads(Path(spec_path).read_text())
    L.seed_everything(spec["seed"], verbose=False)
    tokenizer = resolve_tokenizer(None)
    dm = BalancedTextDataModule(documents(spec["num_docs"], spec["cache_dir"]), max_tokens=spec["max_tokens"],
                                max_length=spec["max_length"], val_fraction=spec["val_fraction"], seed=spec["seed"],
                                packing=spec["variant"] == "packed", vocab_size=tokenizer.vocab_size,
                                pad_token_id=tokenizer.pad_token_id, cache_dir=spec["cache_dir"])
    model = CompareLM(vocab_size=dm.vocab_size, lr=spec["lr"], **MODEL_SIZES[spec["model_size"]])
    meter = Meter()
    trainer = make_trainer(spec, [meter])
    trainer.fit(model, datamodule=dm)
    if not trainer.is_global_zero:
        return
    stats = run_stats(meter.gathered, meter.epoch_intervals, meter.peak_memory_mb, spec["max_tokens"],
                      headline_from_epoch=0)
    result = {k: spec[k] for k in ("run", "variant", "pair", "seed")}
    result.update(status="ok", real_tokens_per_s=stats["real_tokens_per_s"], padding_ratio=stats["padding_ratio"],
                  train_real_tokens=stats["train_real_tokens"], train_slots=stats["train_padded_slots"],
                  micro_batches_per_rank=stats["micro_batches_per_rank"], optimizer_steps=stats["optimizer_steps"],
                  epoch_train_s=stats["epoch_train_s"], peak_memory_mb=stats["peak_memory_mb"],
                  val_loss=model.val_losses[-1][2] if model.val_losses else float("nan"),
                  train_documents=len(dm.train_dataset))
    Path(spec["result_path"]).write_text(json.dumps(result))


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-pair speedups, their median with min and max, equal real tokens, and the validation-loss verdict.

    Args:
        results: run dicts (``pair``, ``variant``, ``status``, ``real_tokens_per_s``, ``train_real_tokens``,
            ``val_loss``); pairs with a failed run are left out and counted.

    Example:
        >>> runs = [{"pair": p, "variant": v, "status": "ok", "real_tokens_per_s": t, "train_real_tokens": 9,
        ...          "val_loss": l} for p, v, t, l in [(0, "padded", 100, 6.0), (0, "packed", 110, 6.01),
        ...                                            (1, "padded", 90, 6.1), (1, "packed", 108, 6.08)]]
        >>> s = summarise(runs)
        >>> s["speedups"], s["median_speedup"], s["faster"], s["val_loss_equal_within_noise"]
        ([1.1, 1.2], 1.15, True, True)
    """
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        pairs.setdefault(int(r["pair"]), {})[r["variant"]] = r
    complete = {p: v for p, v in sorted(pairs.items())
                if all(v.get(k, {}).get("status") == "ok" for k in VARIANTS)}
    speedups = [v["packed"]["real_tokens_per_s"] / v["padded"]["real_tokens_per_s"] for v in complete.values()]
    padded_val = [v["padded"]["val_loss"] for v in complete.values()]
    diffs = [v["packed"]["val_loss"] - v["padded"]["val_loss"] for v in complete.values()]
    noise = statistics.stdev(padded_val) if len(padded_val) > 1 else float("nan")
    mean_diff = statistics.fmean(diffs) if diffs else float("nan")
    return {
        "pairs": len(complete), "failed_pairs": len(pairs) - len(complete),
        "speedups": [round(s, 4) for s in speedups],
        "median_speedup": round(statistics.median(speedups), 4) if speedups else None,
        "min_speedup": round(min(speedups), 4) if speedups else None,
        "max_speedup": round(max(speedups), 4) if speedups else None,
        "faster": bool(speedups) and statistics.median(speedups) > 1.0,
        "same_real_tokens": all(v["packed"]["train_real_tokens"] == v["padded"]["train_real_tokens"]
                                for v in complete.values()),
        "val_loss_mean_difference": mean_diff, "val_loss_noise": noise,
        "val_loss_equal_within_noise": bool(diffs) and len(padded_val) > 1 and abs(mean_diff) <= 2 * noise,
        "noise_rule": NOISE_RULE,
    }


def markdown_table(results: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The per-run table (in run order) and the summary lines."""
    lines = [("| run | real tokens | real tokens/s | padding ratio | micro-batches per rank | optimizer steps | "
              "val loss | load before |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['run']} | {r['status']} | | | | | | |")
            continue
        lines.append(f"| {r['run']} | {r['train_real_tokens']:,} | {r['real_tokens_per_s']:,.0f} | "
                     f"{r['padding_ratio']:.4f} | {r['micro_batches_per_rank']} | {r['optimizer_steps']} | "
                     f"{r['val_loss']:.4f} | {r['load_avg_1min_before']:.1f} |")
    s = summary
    if s["median_speedup"] is not None:
        lines += ["", (f"packed / padded real tokens/s: median {s['median_speedup']:.3f} (min {s['min_speedup']:.3f}, "
                       f"max {s['max_speedup']:.3f}) over {s['pairs']} interleaved pairs "
                       f"({', '.join(f'{x:.3f}' for x in s['speedups'])}); same real tokens in every pair: "
                       f"{'yes' if s['same_real_tokens'] else 'NO'}; packed faster: {'yes' if s['faster'] else 'no'}"),
                  (f"validation loss, packed - padded: mean {s['val_loss_mean_difference']:+.4f}, noise "
                   f"{s['val_loss_noise']:.4f}; equal within noise: "
                   f"{'yes' if s['val_loss_equal_within_noise'] else 'no'}")]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("packed_vs_padded_out"), help="where results go")
    p.add_argument("--quick", action="store_true", help=f"defaults {QUICK} instead of {FULL}")
    p.add_argument("--pairs", type=positive_int, default=None, help="interleaved (padded, packed) pairs, >= 3 for "
                   "the target's median")
    p.add_argument("--num-docs", type=int, default=None, help="documents of the main job's corpus (seeded subset); "
                   "0 = all")
    p.add_argument("--epochs", type=positive_int, default=None, help="epochs per run")
    p.add_argument("--max-tokens", type=positive_int, default=1024, help="per-rank budget (default: %(default)s, "
                   "the main job's): padded slots, or real tokens of the packed row")
    p.add_argument("--max-length", type=positive_int, default=256, help="tokens kept per document (default: "
                   "%(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="documents held out (default: %(default)s)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small", help="default: %(default)s")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default: %(default)s)")
    p.add_argument("--devices", type=positive_int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--timeout-s", type=positive_int, default=1800, help="per run (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="tokenization cache (default: lit_balance's)")
    p.add_argument(_WORKER_FLAG, dest="worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Parse the command line; run the pairs (parent) or one run (hidden worker flag). Returns the summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        run_worker(args.worker)
        return None
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_docs < 0:
        parser.error(f"--num-docs must be >= 0 (0 = every document), got {args.num_docs}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    out_dir = args.output_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m research.packed_vs_padded " + " ".join(argv if argv is not None else sys.argv[1:])
    docs = documents(args.num_docs, args.cache_dir)  # tokenizes the corpus once, here
    print(f"{len(docs)} documents ({sum(min(len(d), args.max_length) for d in docs):,} tokens after truncation) | "
          f"{args.devices} {args.accelerator} ranks | max_tokens {args.max_tokens} | {args.epochs} epoch(s) | "
          f"{args.pairs} interleaved pairs", flush=True)
    common = {k: getattr(args, k) for k in ("num_docs", "epochs", "max_tokens", "max_length", "val_fraction",
                                            "model_size", "lr", "accelerator", "devices", "cache_dir")}
    common["ddp_timeout_s"] = 120
    start, results = time.perf_counter(), []
    for pair in range(args.pairs):
        for variant in VARIANTS:
            spec = {**common, "run": f"pair{pair}_{variant}", "variant": variant, "pair": pair, "seed": pair}
            r = launch_run(spec, out_dir, args.timeout_s, ["-m", "research.packed_vs_padded", _WORKER_FLAG],
                           keys=("run", "variant", "pair", "seed"))
            results.append(r)
            print(f"{r['run']:>14}: " + (f"{r['real_tokens_per_s']:8.0f} real tokens/s | {r['train_real_tokens']} "
                                         f"tokens | val loss {r['val_loss']:.4f} | {r['subprocess_wall_s']:.0f} s"
                                         if r["status"] == "ok" else f"{r['status']} (see logs/{r['run']}.log)"),
                  flush=True)
    summary = summarise(results)
    summary.update(command=command, date_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   commit=commit_label(), machine=machine(), wall_s=time.perf_counter() - start,
                   settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"})
    text = markdown_table(results, summary)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "results.md").write_text(text + "\n")
    print(text + f"\n\nwall time {summary['wall_s']:.0f} s; results in {out_dir}", flush=True)
    return summary


if __name__ == "__main__":
    main()
