"""Fit a model on a map-style dataset of dicts (balanced_dataloader) on 2 CPU ranks; record every training batch.

Run: python tests/ddp/fit_mapstyle.py OUT_DIR TASK(classify|seq2seq) USE_DISTRIBUTED_SAMPLER(0|1) NUM_WORKERS
Each rank writes OUT_DIR/rank{r}.json: the batches of each epoch, the sampler's plan column of each epoch, the
rows each optimizer step's loss was divided by, and what Lightning did with the sampler.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import (BalancedBatchSampler, BatchingSettings, MicroBatchDataset, PadFieldsCollator, StepTokenLoss,
                         balanced_dataloader, token_loss_sum)

from launch import run_as_ranks  # launch.py (the repository root)

VOCAB, CLASSES, MAX_TOKENS = 50, 3, 96


def items(task: str) -> list[dict]:
    """Deterministic data: a class label that the token ids reveal, or a source and a target of other lengths."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(90):
        source = rng.integers(4, VOCAB, size=int(rng.integers(1, 30))).tolist()
        if task == "classify":
            label = i % CLASSES
            out.append({"input_ids": [label + 1, *source], "label": label, "text": f"document {i}"})
        else:
            out.append({"input_ids": source, "labels": rng.integers(4, VOCAB, size=int(rng.integers(1, 30))).tolist()})
    return out


class Classifier(L.LightningModule):
    """Mean-pooled embeddings and a linear head; the loss is the mean over the optimizer step's rows, all ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, CLASSES)
        self.step_loss = StepTokenLoss()
        self.divisors: list[int] = []

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        # one "token" per row: labels [B, 1], no shift; fill rows carry -100 and count for nothing
        loss_sum, n = token_loss_sum(logits.unsqueeze(1), batch["label"].unsqueeze(1), shift=False)
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer):
        self.step_loss.finish_step(self)
        self.divisors.append(self.step_loss.last_step_tokens)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SourceTarget(Classifier):
    """The mean-pooled source added to each target token's embedding predicts the next target token."""

    def __init__(self) -> None:
        super().__init__()
        self.target_embed = torch.nn.Embedding(VOCAB, 16)
        self.lm_head = torch.nn.Linear(16, VOCAB)
        del self.head  # no class head here

    def training_step(self, batch, batch_idx):
        mask = batch["attention_mask"].unsqueeze(-1).float()
        source = (self.embed(batch["input_ids"]) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        targets = batch["labels"].clamp(min=0)
        logits = self.lm_head(self.target_embed(targets) + source)
        loss_sum, n = token_loss_sum(logits, batch["labels"])
        return self.step_loss.micro_batch(self, batch, loss_sum, n)


class MapStyleData(L.LightningDataModule):
    """The user's side: a list of dicts, the sampler built from the trainer's world, balanced_dataloader."""

    def __init__(self, task: str, num_workers: int) -> None:
        super().__init__()
        self.task, self.num_workers = task, num_workers

    def setup(self, stage=None):
        if self.task == "classify":
            self.train = MicroBatchDataset(items(self.task), length="input_ids")
            self.collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"],
                                             drop_fields=["text"], pad_to_multiple_of=4)
        else:  # the longer of source and target bounds both fields' padded slots
            self.train = MicroBatchDataset(items(self.task), length=["input_ids", "labels"])
            self.collate = PadFieldsCollator(["input_ids", "labels"], pad_token_id=0, pad_to_multiple_of=4)
        self.sampler = BalancedBatchSampler(
            self.train.lengths, settings=BatchingSettings(max_tokens=MAX_TOKENS, seed=5, pad_to_multiple_of=4),
            num_replicas=self.trainer.world_size, rank=self.trainer.global_rank)

    def train_dataloader(self):
        return balanced_dataloader(self.train, self.sampler, self.collate, num_workers=self.num_workers)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.epochs: dict[int, list] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        fields = {k: v.tolist() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        fields["num_padded_tokens"] = int(batch["num_padded_tokens"])
        self.epochs.setdefault(trainer.current_epoch, []).append(fields)


def main() -> None:
    out, task, use_ds, workers = Path(sys.argv[1]), sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4])
    dm = MapStyleData(task, workers)
    model = Classifier() if task == "classify" else SourceTarget()
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=[rec], max_epochs=2, use_distributed_sampler=use_ds, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    sampler = dm.sampler
    plans = {}
    for e in (0, 1):
        p = sampler.plan(e)
        plans[e] = [p.batch(int(b))[0].tolist() for b in p.assignment[:, trainer.global_rank]]
    loader = trainer.train_dataloader
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "epochs": rec.epochs, "plans": plans, "len": len(sampler), "world_size": trainer.world_size,
        "sampler_is_ours": loader.sampler is sampler, "sampler_epoch": sampler.epoch,
        "divisors": model.divisors, "items": items(task),
    }))


if __name__ == "__main__":
    run_as_ranks(main, 2)
