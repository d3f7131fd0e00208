"""Train a small transformer LM on the built-in corpus with token-budgeted, rank-balanced micro-batches.

Run:
    python recipes/train.py                                  # conf/train.yaml, 2 CPU ranks
    python recipes/train.py trainer.devices=4 data.max_tokens=8192
    python recipes/train.py --config my.yaml trainer.max_steps=100

Prints, at the end, per rank and in total: micro-batches, real tokens, padded slots, padding ratio
and wall time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
from omegaconf import OmegaConf

from lit_balance import BalancedTextDataModule, TransformerLM
from lit_balance.callbacks import RunSummary

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "conf" / "train.yaml"


def main(argv: list[str] | None = None) -> RunSummary:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.devices=4")
    args = parser.parse_args(argv)
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))

    L.seed_everything(cfg.seed, verbose=False)
    dm = BalancedTextDataModule(seed=cfg.seed, **OmegaConf.to_container(cfg.data, resolve=True))
    model = TransformerLM(vocab_size=dm.vocab_size, **OmegaConf.to_container(cfg.model, resolve=True))
    summary = RunSummary()
    trainer = L.Trainer(callbacks=[summary], **OmegaConf.to_container(cfg.trainer, resolve=True))
    if trainer.is_global_zero:
        print(
            f"world size {trainer.world_size} | per-rank budget {dm.max_tokens} padded slots per micro-batch | "
            f"global budget {dm.max_tokens * trainer.world_size} padded slots per optimizer step | "
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
    return summary


if __name__ == "__main__":
    main()
