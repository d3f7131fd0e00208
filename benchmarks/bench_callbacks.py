"""Overhead of the measuring and adapting callbacks: the same small fit with and without them, side by side.

Run:
    python -m benchmarks.bench_callbacks                  # 5 interleaved pairs of 1-epoch fits, 1 CPU process
    python -m benchmarks.bench_callbacks --reps 3 --num-docs 400

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-01-callback-overhead.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from benchmarks._harness import load_lengths, positive_int, write_report
from lit_balance import BalancedTextDataModule, use_training_sampler
from lit_balance.callbacks import AdaptiveGradAccumulation, CostModelFeedback, PaddingRatioMonitor, StragglerMonitor
from lit_balance.demo import DemoTransformerLM

VOCAB_SIZE = 512
HOOKS = ("on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_backward", "on_after_backward",
         "on_train_batch_end", "on_train_epoch_end", "on_train_end")


def data(num_docs: int, max_tokens: int, cache_dir: str) -> BalancedTextDataModule:
    """The fits' DataModule: random token ids (seeded) with the lengths of the first ``num_docs`` documents of
    ``fortunes``, capped at ``max_tokens``; no validation."""
    lengths = load_lengths("fortunes", max_tokens, num_docs)
    tokens = np.random.default_rng(0).integers(1, VOCAB_SIZE, size=int(lengths.sum()))
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    return BalancedTextDataModule(docs, max_tokens=max_tokens, max_length=max_tokens, val_fraction=0, seed=0,
                                  vocab_size=VOCAB_SIZE, pad_token_id=0, cache_dir=cache_dir)


def timed(callbacks: list[L.Callback]) -> list[float]:
    """Wrap every hook of ``callbacks``: its [wall, CPU] seconds add up in the returned two-element list."""
    total = [0.0, 0.0]
    for cb in callbacks:
        for name in HOOKS:
            method = getattr(cb, name)

            @functools.wraps(method)
            def wrapper(*args, _method=method, **kwargs):
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _method(*args, **kwargs)
                finally:
                    total[0] += time.perf_counter() - start
                    total[1] += time.thread_time() - cpu

            setattr(cb, name, wrapper)
    return total


def fit(args, dm: BalancedTextDataModule, with_callbacks: bool) -> tuple[float, float, list[float], int]:
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=VOCAB_SIZE, d_model=args.d_model, num_heads=4, num_layers=2,
                              dim_feedforward=4 * args.d_model)
    callbacks: list[L.Callback] = []
    hook_s = [0.0, 0.0]
    if with_callbacks:
        callbacks = [PaddingRatioMonitor(), StragglerMonitor(log_every_n_micro_batches=50), CostModelFeedback(),
                     AdaptiveGradAccumulation(target_tokens_per_step=1)]
        hook_s = timed(callbacks)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, logger=False,
                        reload_dataloaders_every_n_epochs=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dm.setup("fit")  # a fresh sampler every fit (CostModelFeedback hands the sampler its fit)
    dl = dm.train_dataloader()
    use_training_sampler(trainer, dm.train_sampler)  # the loader is passed to fit: hand its sampler to the callbacks
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, train_dataloaders=dl)
    return time.perf_counter() - start, time.process_time() - cpu, hook_s, len(dl)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=positive_int, default=5, help="interleaved pairs of fits (default: %(default)s)")
    p.add_argument("--num-docs", type=positive_int, default=1500, help="documents (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=1024,
                   help="padded slots per micro-batch (default: %(default)s)")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width (default: %(default)s)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/bench_callbacks"), help="results.json goes here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_callbacks-") as cache_dir:
        dm = data(args.num_docs, args.max_tokens, cache_dir)
        dm.prepare_data()
        fit(args, dm, False)  # warm-up: imports, allocator, kernels
        runs = [(fit(args, dm, False), fit(args, dm, True)) for _ in range(args.reps)]
    base, with_cb, hooks_wall, hooks_cpu, cpu_ratios = [], [], [], [], []
    for (t0, c0, _, steps), (t1, c1, h, _) in runs:
        base.append(t0)
        with_cb.append(t1)
        hooks_wall.append(h[0] / t1)
        hooks_cpu.append(h[1] / c1)
        cpu_ratios.append(c1 / c0)
    ratios = [b / a for a, b in zip(base, with_cb)]
    print(f"{steps} micro-batches per fit, {args.reps} interleaved pairs, 1 CPU thread")
    print(f"fit s without callbacks: {' '.join(f'{t:.2f}' for t in base)}")
    print(f"fit s with callbacks:    {' '.join(f'{t:.2f}' for t in with_cb)}")
    print(f"step time without callbacks: {1e3 * statistics.median(base) / steps:.1f} ms (median)")
    print(f"hook time / fit time, CPU s: median {100 * statistics.median(hooks_cpu):.3f} %, "
          f"max {100 * max(hooks_cpu):.3f} %")
    print(f"hook time / fit time, wall s: median {100 * statistics.median(hooks_wall):.3f} %, "
          f"max {100 * max(hooks_wall):.3f} %")
    print(f"fit time ratio (with / without), wall s: median {statistics.median(ratios):.4f} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f}); CPU s: median {statistics.median(cpu_ratios):.4f}")
    return write_report(args.output_dir, "benchmarks.bench_callbacks", argv, {
        "settings": vars(args), "micro_batches_per_fit": steps, "fit_s_without": base, "fit_s_with": with_cb,
        "hook_cpu_share": hooks_cpu, "hook_wall_share": hooks_wall, "fit_wall_ratio": ratios,
        "fit_cpu_ratio": cpu_ratios})


if __name__ == "__main__":
    main()
