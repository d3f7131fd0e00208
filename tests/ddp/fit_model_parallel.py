"""Fit a tiny LM with ModelParallelStrategy (FSDP2 on the data-parallel dimension, tensor parallel on the other) on
CPU ranks (gloo) through BalancedTextDataModule; record what every process trained and every optimizer step's update.

Run: python tests/ddp/fit_model_parallel.py OUT_DIR DP TP SHARDING
DP × TP processes; ``ModelParallelStrategy(data_parallel_size=DP, tensor_parallel_size=TP)``. SHARDING "tp": the MLP
is split over the device mesh's ``tensor_parallel`` dimension (``parallelize_module``: column-wise, then row-wise),
and FSDP2 (``fully_shard``) shards the model over its ``data_parallel`` dimension when DP > 1; "fsdp2": FSDP2 alone.
Plain SGD, ``accumulate_grad_batches=2``, one epoch, the plan divisor of StepTokenLoss. Each process writes
OUT_DIR/rank{r}.json (its data-parallel world, the micro-batches it trained, each step's loss and token count, what
RunSummary, StragglerMonitor and a TokenMeanLoss over the data-parallel group gathered) and OUT_DIR/rank{r}.pt
(its micro-batches' tensors, by optimizer step); global rank 0 also writes OUT_DIR/params.pt: the full parameters
before training and after every optimizer step.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from lit_balance import BalancedTextDataModule, TokenMeanLoss
from lit_balance.callbacks import RunSummary, StragglerMonitor
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum
from lit_balance.world import data_parallel_world

from launch import run_as_ranks  # launch.py (the repository root)

VOCAB, D_MODEL, HIDDEN = 48, 8, 16
LR = 0.5
ACCUMULATE = 2


def documents(n=36, seed=0):
    """Pre-tokenized documents of 3 to 20 ids below VOCAB."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(length)).tolist() for length in rng.integers(3, 21, n)]


class TinyLM(nn.Module):
    """Embedding, one residual MLP (the tensor-parallel part), a linear head: ``[B, T]`` ids -> ``[B, T, VOCAB]``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.up = nn.Linear(D_MODEL, HIDDEN)
        self.down = nn.Linear(HIDDEN, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


def full_parameters(module):
    """``{name: full tensor}`` (a collective for sharded parameters: every process calls it alike)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


class Model(L.LightningModule):
    def __init__(self, out, sharding):
        super().__init__()
        self.out, self.sharding = out, sharding
        self.model = TinyLM()
        self.step_loss = StepTokenLoss()
        self.train_loss = TokenMeanLoss()
        self.params, self.micro_batches, self.tensors, self.steps = [], [], [], []
        self._recorded = 0

    def configure_model(self):
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if self.sharding == "tp":
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(self.model, mesh["tensor_parallel"], plan)
        if mesh["data_parallel"].size() > 1:
            fully_shard(self.model, mesh=mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_fit_start(self):
        # the token-mean loss sums over the data-parallel ranks only (tensor-parallel peers hold the same tokens)
        self.train_loss.process_group = data_parallel_world(self.trainer).process_group

    def on_train_start(self):
        params = full_parameters(self.model)
        if self.global_rank == 0:
            self.params.append(params)

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.micro_batches.append([step, batch["indices"].tolist(), batch["is_fill"].tolist(),
                                   int(batch["num_real_tokens"])])
        self.tensors.append({"step": step, "input_ids": batch["input_ids"].clone(), "labels": batch["labels"].clone()})
        loss_sum, n = token_loss_sum(self.model(batch["input_ids"]), batch["labels"])
        self.train_loss.update(loss_sum, n)
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer):
        mode = self.step_loss.mode
        loss = self.step_loss.finish_step(self)
        self.steps.append({"mode": mode, "loss": float(loss), "tokens": self.step_loss.last_step_tokens})

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step > self._recorded:  # an optimizer step ran: its parameters after the update
            self._recorded = self.trainer.global_step
            params = full_parameters(self.model)
            if self.global_rank == 0:
                self.params.append(params)

    def on_train_end(self):
        self.train_mean_loss = float(self.train_loss.compute())


def main():
    out, dp, tp, sharding = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    data = BalancedTextDataModule(documents(), max_tokens=64, max_length=None, val_fraction=0, seed=5,
                                  cache_dir=out / "cache")
    model = Model(out, sharding)
    summary = RunSummary()
    straggler = StragglerMonitor(log_every_n_micro_batches=4)
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, timeout=timedelta(seconds=120))
    trainer = L.Trainer(accelerator="cpu", devices=dp * tp, strategy=strategy, max_epochs=1,
                        accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[summary, straggler])
    trainer.fit(model, datamodule=data)
    world = data_parallel_world(trainer)
    rank = trainer.global_rank
    torch.save(model.tensors, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(model.params, out / "params.pt")
    record = {"global_rank": rank, "world_size": trainer.world_size, "dp_rank": world.rank,
              "num_replicas": world.num_replicas, "sampler_kwargs": trainer.strategy.distributed_sampler_kwargs,
              "micro_batches": model.micro_batches, "steps": model.steps, "num_train": len(data.train_dataset),
              "num_batches": len(data.train_sampler), "summary_rows": len(summary.rows),
              "summary_real_tokens": summary.total["real_tokens"], "train_mean_loss": model.train_mean_loss,
              "straggler_windows": [{name: getattr(w, name).tolist() for name in ("forward_s", "real_tokens", "compute_s",
                                                                                   "other_s")}
                                    for w in straggler.epoch_windows]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[2]) * int(sys.argv[3]))
