"""Fit a tiny model on 2 CPU ranks (gloo) with known sleeps; record where the monitors put each rank's time.

Run: python tests/lightning/callbacks/fit_phases.py OUT_DIR DATA_S VALIDATION_S CHECKPOINT_S
8 micro-batches per rank in the epoch, one per optimizer step, 7 steps (max_steps, so one validation only);
StragglerMonitor windows of 2 micro-batches (logged at steps 1, 3, 5, and 6 for the last, which ends the fit) and
RunSummary. The sleeps: DATA_S on rank 1 only, split over fetching micro-batches 2 and 3; VALIDATION_S on
both ranks, split over the two validation_step calls of the validation after step 4; CHECKPOINT_S on both ranks in a
callback's on_save_checkpoint, when ModelCheckpoint saves after step 2. Rank 0 writes OUT_DIR/result.json (the
RunSummary rows) and Lightning's CSVLogger writes OUT_DIR/logs/metrics.csv.
"""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lit_balance.callbacks import RunSummary, StragglerMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ddp"))
from launch import run_as_ranks  # launch.py (the repository root)


class Items(Dataset):
    """``n`` micro-batches of 4 tokens; on rank 1, fetching items ``sleepy`` (in this rank's order) sleeps."""

    def __init__(self, n, sleep_s=0.0, sleepy=()):
        self.n, self.sleep_s, self.sleepy, self.fetched = n, sleep_s, set(sleepy), 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1 and self.fetched in self.sleepy:
            time.sleep(self.sleep_s)
        self.fetched += 1
        ids = torch.arange(4) % 16
        return {"input_ids": ids, "num_real_tokens": 4, "num_padded_tokens": 4}


class Tiny(L.LightningModule):
    def __init__(self, validation_s):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16)
        self.validation_s = validation_s

    def _loss(self, batch):
        ids = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), ids.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.trainer.global_step == 4:
            time.sleep(self.validation_s / 2)
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowSave(L.Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == 2:
            time.sleep(self.seconds)


def main(out_dir, data_s, validation_s, checkpoint_s):
    out_dir = Path(out_dir)
    summary = RunSummary(print_table=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)), max_steps=7,
        val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0,
        logger=CSVLogger(out_dir, name="logs", version=""), log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[summary, StragglerMonitor(log_every_n_micro_batches=2), SlowSave(checkpoint_s),
                   ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=2, save_top_k=-1)],
    )
    train = DataLoader(Items(16, data_s / 2, sleepy=(2, 3)), batch_size=1)
    val = DataLoader(Items(4), batch_size=1)
    trainer.fit(Tiny(validation_s), train, val)
    if trainer.is_global_zero:
        (out_dir / "result.json").write_text(json.dumps({"rows": summary.rows}))


if __name__ == "__main__":
    run_as_ranks(lambda: main(sys.argv[1], *map(float, sys.argv[2:5])), 2)
