"""An epoch that grows after len() was read: under a real Lightning Trainer, never skipped silently.

Lightning reads ``len(train_dataloader)`` when it loads the loader and calls ``set_epoch`` later; a plan that
rank speeds handed over by ``set_cost_model`` make longer is then cut at the old length. One process runs
rank 0's column of a 2-rank plan (explicit ``num_replicas=2, rank=0``): Lightning's order of ``len()``,
``set_epoch`` and ``iter()`` is the same as under DDP, and the plan is the one rank 0 would run.
"""

from __future__ import annotations

import warnings

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lit_balance.plan.cost import CostModel
from lit_balance.sampler.sampler import BalancedBatchSampler

LENGTHS = np.random.default_rng(3).integers(8, 200, 300)
SPEEDS = [1.0, 0.5]


class Rows(Dataset):
    """Indexed by a micro-batch: one float per row (its length)."""

    def __len__(self):
        return LENGTHS.size

    def __getitem__(self, indices):
        return torch.tensor([[float(LENGTHS[i])] for i in indices])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.trained: dict[int, int] = {}

    def training_step(self, batch, batch_idx):
        self.trained[self.current_epoch] = self.trained.get(self.current_epoch, 0) + 1
        return self.layer(batch / 200.0).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HandOverSpeeds(L.Callback):
    """What CostModelFeedback does at an epoch's end: unequal speeds for the next epoch's plan."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.planned: dict[int, int] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        self.planned[trainer.current_epoch] = self.sampler.plan().num_micro_steps

    def on_train_epoch_end(self, trainer, pl_module):
        self.sampler.set_cost_model(CostModel(), SPEEDS)


class BuildsItsLoader(Tiny):
    """The DataModule's way: select the epoch, then return the loader (reloaded every epoch)."""

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def train_dataloader(self):
        self.sampler.set_epoch(self.trainer.current_epoch)
        return DataLoader(Rows(), sampler=self.sampler, batch_size=None)


def _fit(model, callback, loader=None, **kwargs):
    """Fit 2 epochs; return the warnings about micro-batches."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader)
    return [str(w.message) for w in caught if "micro-batches" in str(w.message)]


@pytest.mark.parametrize("reload", [0, 1])
def test_a_user_built_loader_whose_next_epoch_grows_warns_naming_the_fix(reload):
    sampler = BalancedBatchSampler(LENGTHS, 1024, num_replicas=2, rank=0, seed=1)
    loader = DataLoader(Rows(), sampler=sampler, batch_size=None)
    model, callback = Tiny(), HandOverSpeeds(sampler)
    messages = _fit(model, callback, loader, reload_dataloaders_every_n_epochs=reload)
    assert callback.planned[1] > callback.planned[0]  # the speeds lengthened the second epoch
    assert model.trained[0] == callback.planned[0]
    skipped = callback.planned[1] - model.trained[1]
    assert skipped > 0  # Lightning stops at the length it read ...
    assert len(messages) == 1, messages  # ... and it is said, once
    (message,) = messages
    assert f"epoch 1 has {callback.planned[1]} micro-batches" in message and f"skips the last {skipped}" in message
    assert "reload_dataloaders_every_n_epochs=1" in message and "set_epoch" in message
    assert "BalancedTextDataModule" in message


def test_a_loader_built_after_set_epoch_runs_every_planned_micro_batch_without_a_warning():
    sampler = BalancedBatchSampler(LENGTHS, 1024, num_replicas=2, rank=0, seed=1)
    model, callback = BuildsItsLoader(sampler), HandOverSpeeds(sampler)
    messages = _fit(model, callback, reload_dataloaders_every_n_epochs=1)
    assert callback.planned[1] > callback.planned[0]
    assert model.trained == callback.planned  # every planned micro-batch ran
    assert messages == []
