"""Fit two BalancedDataLoaders combined by Lightning's CombinedLoader(mode="max_size") on 2 CPU ranks for 2 epochs:
the short loader runs out mid-epoch (None for the rest of it). Stop it with a failed training step after the short
loader ran out (OnExceptionCheckpoint) and resume; record every micro-batch each rank finished, per loader.

Run: python tests/ddp/fit_combined_max_size.py OUT_DIR PHASE, PHASE one of ``whole`` (2 epochs uninterrupted),
``stop`` (training_step raises at batch_idx FAIL_AT of epoch 0 on every rank; OnExceptionCheckpoint writes
OUT_DIR/fail.ckpt) and ``resume`` (Trainer.fit(ckpt_path=OUT_DIR/fail.ckpt) to the end of epoch 1).
Each rank writes OUT_DIR/rank<r>.json: {"finished": [[epoch, {"long": indices or None, "short": ...}], ...],
"lengths": {"long": micro-batches, "short": ...}}.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import CombinedLoader

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader

from launch import run_as_ranks  # launch.py (the repository root)

MAX_TOKENS, FAIL_AT = 64, 14  # FAIL_AT: after the short loader's last micro-batch of epoch 0 (checked by the test)


def items(num: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 64, size=int(n)).tolist(), "label": int(i % 2)}
            for i, n in enumerate(rng.integers(1, 30, num))]


class TwoTasks(L.LightningModule):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 4), torch.nn.Linear(4, 2)
        self.fail = fail
        self.finished: list = []
        self.lengths: dict = {}

    def _loader(self, num: int, seed: int):
        train = MicroBatchDataset(items(num, seed), length="input_ids")
        sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=seed,
                                       **self.trainer.distributed_sampler_kwargs)
        collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
        return balanced_dataloader(train, sampler, collate, num_workers=1, trainer=self.trainer)

    def train_dataloader(self):
        loaders = {"long": self._loader(203, 3), "short": self._loader(70, 5)}
        self.lengths = {k: len(v) for k, v in loaders.items()}
        return CombinedLoader(loaders, mode="max_size")

    def training_step(self, batch, batch_idx):
        if self.fail and self.current_epoch == 0 and batch_idx == FAIL_AT:
            raise RuntimeError("simulated failure inside training_step")
        losses = [torch.nn.functional.cross_entropy(self.head(self.embed(b["input_ids"]).mean(dim=1)), b["label"])
                  for b in batch.values() if b is not None]
        return sum(losses)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.finished.append([self.current_epoch,
                              {k: None if b is None else b["indices"].tolist() for k, b in batch.items()}])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    callbacks = [OnExceptionCheckpoint(out, filename="fail")] if phase == "stop" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)),
                        max_epochs=2, callbacks=callbacks, logger=False, enable_checkpointing=phase == "stop",
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    model = TwoTasks(fail=phase == "stop")
    try:
        trainer.fit(model, ckpt_path=out / "fail.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated failure" not in str(error):
            raise
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"finished": model.finished,
                                                                     "lengths": model.lengths}))


if __name__ == "__main__":
    run_as_ranks(main, 2)
