"""Fakes for callback tests: a trainer with a recording logger, a scripted clock, simulated ranks and custom cost
models."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.profilers import PassThroughProfiler
from scipy.optimize import nnls

from lit_balance import use_training_sampler
from lit_balance.plan.cost import CostModelBase


class RecordingLogger:
    """Records every ``log_metrics`` call exactly."""

    def __init__(self):
        self.calls = []
        self.saved = 0  # calls recorded when save() was last called (what a file logger has written)

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def save(self):
        self.saved = len(self.calls)

    def merged(self):
        out = {}
        for _, m in self.calls:
            out.update(m)
        return out


class FakeStrategy:
    """all_gather stacks this rank's tensor with the other ranks' tensors, given by ``others(local)``."""

    def __init__(self, rank, world_size, others=None):
        self.rank, self.world_size = rank, world_size
        self.others = others or (lambda local: [local] * (world_size - 1))
        self.gathers = 0
        self.handles_gradient_accumulation = False
        self.distributed_sampler_kwargs = {"num_replicas": world_size, "rank": rank}  # DDP: every rank a replica

    def all_gather(self, tensor):
        self.gathers += 1
        rest = list(self.others(tensor))
        return torch.stack([*rest[: self.rank], tensor, *rest[self.rank:]])

    def reduce(self, tensor, reduce_op="sum"):
        return tensor * self.world_size

    def broadcast(self, obj, src=0):
        return obj


class Clock:
    """A clock that advances only when told to."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def tick(self, seconds):
        self.t += seconds


def make_trainer(*, rank=0, world_size=1, others=None, sampler=None, callbacks=(), log_every_n_steps=50,
                 num_training_batches=1000, reload_dataloaders_every_n_epochs=1):
    """A fake Trainer; ``sampler`` (a BalancedBatchSampler, or None) is handed to it as its training sampler, as the
    DataModule and ``balanced_dataloader(..., trainer=...)`` do (its loader holds it too)."""
    logger = RecordingLogger()
    trainer = SimpleNamespace(
        world_size=world_size, global_rank=rank, is_global_zero=rank == 0, global_step=0,
        loggers=[logger], logger=logger, callback_metrics={}, log_every_n_steps=log_every_n_steps,
        strategy=FakeStrategy(rank, world_size, others), train_dataloader=SimpleNamespace(sampler=sampler),
        callbacks=list(callbacks), accumulate_grad_batches=1, current_epoch=0,
        num_training_batches=num_training_batches, reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs,
        profiler=PassThroughProfiler(), lightning_module=None,
    )
    if sampler is not None:
        use_training_sampler(trainer, sampler)
    return trainer, logger


def batch(rows, width, real):
    return {"input_ids": torch.zeros(rows, width, dtype=torch.long), "num_real_tokens": real,
            "num_padded_tokens": rows * width}


MODULE = SimpleNamespace(device=torch.device("cpu"), automatic_optimization=True)


@pytest.fixture
def clock():
    return Clock()


@dataclass(frozen=True)
class RowCost(CostModelBase):
    """A custom cost model: a fixed cost per row (or packed document) plus a cost per token, no quadratic term."""

    per_token: float = 1.0
    per_row: float = 8.0
    per_batch: float = 0.0

    def row_cost(self, length):
        return self.per_row + self.per_token * np.asarray(length, dtype=np.float64)

    @classmethod
    def fit(cls, rows, padded_length, seconds, *, min_samples=3):
        """Non-negative least squares of seconds on ``[rows * L, rows, 1]``."""
        rows, length, seconds = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (rows, padded_length, seconds))
        if rows.size < min_samples:
            raise ValueError(f"RowCost.fit needs {min_samples} micro-batches, got {rows.size}")
        columns = np.stack([rows * length, rows, np.ones_like(rows)], axis=1)
        scale = columns.max(axis=0)
        coef = nnls(columns / scale, seconds)[0] / scale
        return cls(per_token=float(coef[0]), per_row=float(coef[1]), per_batch=float(coef[2]))


@dataclass(frozen=True)
class RowCostWithoutFit(CostModelBase):
    """A custom cost model that cannot be refitted from seconds (no ``fit``)."""

    per_row: float = 8.0
    per_batch: float = 0.0

    def row_cost(self, length):
        return self.per_row + np.asarray(length, dtype=np.float64)
