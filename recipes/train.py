"""Train a small transformer LM on the built-in corpus with token-budgeted, rank-balanced micro-batches.

Run:
    python recipes/train.py                                  # conf/config.yaml: 2 CPU ranks, 40 steps
    python recipes/train.py trainer.devices=4 data.max_tokens=8192
    python recipes/train.py trainer=gpu_ddp experiment=budget_4k
    python recipes/train.py --config-dir my_conf --config-name config trainer.max_steps=100

Overrides use Hydra's syntax (see lit_balance.config): ``key=value`` for an existing key, ``group=option``
to pick another file of ``conf/<group>/``, ``+key=value`` to add a key. Prints the derived budget first
and, at the end, per rank and in total: micro-batches, real tokens, padded slots, padding ratio and
wall time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L

from lit_balance.callbacks import RunSummary
from lit_balance.config import compose, instantiate

CONFIG_DIR = Path(__file__).resolve().parent.parent / "conf"


def main(argv: list[str] | None = None) -> RunSummary | None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR, help="config directory (default: %(default)s)")
    parser.add_argument("--config-name", default="config", help="primary config, without .yaml (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="overrides, e.g. trainer.devices=4 or trainer=gpu_ddp")
    args = parser.parse_args(argv)
    cfg = compose(args.config_name, args.overrides, config_dir=args.config_dir)

    L.seed_everything(cfg.seed, verbose=False)
    dm = instantiate(cfg.data)
    model = instantiate(cfg.model, vocab_size=dm.vocab_size)
    callbacks = list((instantiate(cfg.callbacks) or {}).values()) if "callbacks" in cfg else []
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    if trainer.is_global_zero:
        print(
            f"world size {trainer.world_size} | per-rank budget {dm.max_tokens} padded slots per micro-batch | "
            f"global budget {dm.max_tokens * trainer.world_size * trainer.accumulate_grad_batches} padded slots "
            "per optimizer step | "
            f"max_length {dm.max_length} tokens | corpus: {dm.source.description}",
            flush=True,
        )
    trainer.fit(model, datamodule=dm)
    if trainer.is_global_zero:
        sampler = dm.train_sampler
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print(
            f"train documents {len(dm.train_dataset)} (empty after tokenization, dropped: {dm.num_empty_documents}) | "
            f"micro-batches per rank per epoch {len(sampler)} | fill rows this epoch {sampler.num_fill_rows} | "
            f"last train/loss {metrics['train/loss']:.3f} | "
            + (f"val/loss {metrics['val/loss']:.3f} | " if "val/loss" in metrics else "validation not run | ")
            + f"script wall time {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    return next((c for c in callbacks if isinstance(c, RunSummary)), None)


if __name__ == "__main__":
    main()
