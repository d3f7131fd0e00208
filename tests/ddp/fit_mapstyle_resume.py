"""Fit a map-style dataset through balanced_dataloader(..., trainer=self.trainer) on 2 CPU ranks, 2 persistent workers each;
stop it mid-epoch, resume it; record every micro-batch each rank started and finished.

Run: python tests/ddp/fit_mapstyle_resume.py OUT_DIR PHASE, PHASE one of
``whole`` (epoch 0 uninterrupted), ``stop`` (ModelCheckpoint writes OUT_DIR/mid.ckpt after MID micro-batches, then
training_step raises at batch_idx FAIL_AT on every rank and OnExceptionCheckpoint writes OUT_DIR/fail.ckpt),
``resume_mid`` / ``resume_fail`` (Trainer.fit(ckpt_path=OUT_DIR/mid.ckpt or fail.ckpt) to the end of epoch 0).
Each rank writes OUT_DIR/rank<r>.json: {"started": [...], "finished": [...], "callbacks": [...]}, lists of the dataset
indices of each micro-batch.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader

from launch import run_as_ranks  # launch.py (the repository root)

MAX_TOKENS, SEED, MID, FAIL_AT = 64, 4, 3, 5


def items() -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"input_ids": rng.integers(1, 64, size=int(n)).tolist(), "label": int(i % 2)}
            for i, n in enumerate(rng.integers(1, 30, 203))]


class Classifier(L.LightningModule):
    """A tiny classifier whose train_dataloader is balanced_dataloader handed the Trainer (no batches_consumed)."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 4), torch.nn.Linear(4, 2)
        self.fail = fail
        self.started: list[list[int]] = []
        self.finished: list[list[int]] = []

    def train_dataloader(self):
        train = MicroBatchDataset(items(), length="input_ids")
        sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=SEED,
                                       **self.trainer.distributed_sampler_kwargs)
        collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
        return balanced_dataloader(train, sampler, collate, num_workers=2, persistent_workers=True,
                                   trainer=self.trainer)

    def training_step(self, batch, batch_idx):
        self.started.append(batch["indices"].tolist())
        if self.fail and batch_idx == FAIL_AT:
            raise RuntimeError("simulated failure inside training_step")
        logits = self.head(self.embed(batch["input_ids"]).mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.finished.append(batch["indices"].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    callbacks = []
    if phase == "stop":
        callbacks = [ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=MID, save_top_k=-1),
                     OnExceptionCheckpoint(out, filename="fail")]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)),
                        max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=phase == "stop",
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    model = Classifier(fail=phase == "stop")
    ckpt = {"resume_mid": out / "mid.ckpt", "resume_fail": out / "fail.ckpt"}.get(phase)
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except RuntimeError as error:
        if phase != "stop" or "simulated failure" not in str(error):
            raise
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "started": model.started, "finished": model.finished,
        "callbacks": [type(c).__name__ for c in trainer.callbacks]}))


if __name__ == "__main__":
    run_as_ranks(main, 2)
