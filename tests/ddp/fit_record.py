"""Fit a tiny LM with BalancedTextDataModule on 2 CPU ranks and record every training batch per rank.

Run: python tests/ddp/fit_record.py OUT_DIR USE_DISTRIBUTED_SAMPLER(0|1) NUM_WORKERS
Each rank writes OUT_DIR/rank{r}.json: {"epochs": {epoch: [[indices], [is_fill]] ...}, "plan": ...}.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.epochs: dict[int, list] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs.setdefault(trainer.current_epoch, []).append(
            [batch["indices"].tolist(), batch["is_fill"].tolist(), int(batch["num_padded_tokens"])]
        )


def main() -> None:
    out, use_ds, workers = Path(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
    lengths = np.load(Path(__file__).resolve().parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")[:301]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=min(int(n), 48)) for n in lengths]
    dm = BalancedTextDataModule(docs, max_tokens=256, max_length=None, val_fraction=0.05, num_workers=workers,
                                cache_dir=out / "cache", seed=7)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=[rec],
                        max_epochs=2, use_distributed_sampler=use_ds, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    trainer.fit(model, datamodule=dm)
    sampler = dm.train_sampler
    plans = {}
    for e in (0, 1):
        p = sampler.plan(e)
        plans[e] = [p.batch(int(b))[0].tolist() for b in p.assignment[:, trainer.global_rank]]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "epochs": rec.epochs, "plans": plans, "len": len(sampler), "num_train": len(dm.train_dataset),
        "world_size": trainer.world_size, "sampler_type": type(trainer.train_dataloader.sampler).__name__,
    }))


if __name__ == "__main__":
    run_as_ranks(main, 2)
