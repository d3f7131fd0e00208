"""The map-style path (MicroBatchDataset + balanced_dataloader) resumes exactly under Lightning with 2 persistent
DataLoader workers: the loader saves the micro-batches training consumed, not those its workers fetched ahead."""

from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader
from lit_balance.lightning import FitLoopCount, fit_batches_consumed

pytestmark = pytest.mark.slow  # in-process fits with DataLoader worker processes, ~10 s each

MAX_TOKENS, SEED = 64, 4


def _items() -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"input_ids": rng.integers(1, 64, size=int(n)).tolist(), "label": int(i % 2)}
            for i, n in enumerate(rng.integers(1, 30, 150))]


class Classifier(L.LightningModule):
    """A tiny classifier on map-style micro-batches; records the indices of every micro-batch it trained."""

    def __init__(self, count_from_trainer: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 4), torch.nn.Linear(4, 2)
        self.count_from_trainer, self.fail_at = count_from_trainer, fail_at
        self.trained: list[list[int]] = []

    def train_dataloader(self):
        train = MicroBatchDataset(_items(), length="input_ids")
        sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=SEED,
                                       num_replicas=self.trainer.world_size, rank=self.trainer.global_rank)
        kwargs = {"batches_consumed": lambda: fit_batches_consumed(self.trainer)} if self.count_from_trainer else {}
        return balanced_dataloader(train, sampler, PadFieldsCollator(["input_ids"], pad_token_id=0,
                                                                     scalar_fields=["label"]),
                                   num_workers=2, persistent_workers=True, **kwargs)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise RuntimeError("boom (simulated)")
        logits = self.head(self.embed(batch["input_ids"]).mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained.append(batch["indices"].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, model, *, callbacks=(), max_steps=-1, ckpt_path=None) -> list[list[int]]:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        default_root_dir=tmp_path)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.trained


def _epoch_plan() -> list[list[int]]:
    """The uninterrupted epoch 0 of the one rank, from the plan."""
    sampler = BalancedBatchSampler(MicroBatchDataset(_items(), length="input_ids").lengths, max_tokens=MAX_TOKENS,
                                   seed=SEED, num_replicas=1, rank=0)
    plan = sampler.plan(0)
    return [plan.batch(int(b))[0].tolist() for b in plan.assignment[:, 0]]


def _documents(batches: list[list[int]]) -> Counter:
    return Counter(i for batch in batches for i in batch)


def test_mid_epoch_checkpoint_resumes_exactly_with_two_persistent_workers(tmp_path):
    expected = _epoch_plan()
    assert len(expected) > 12  # far more micro-batches than the workers fetch ahead (2 workers x prefetch 2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="mid")
    first = _fit(tmp_path, Classifier(), callbacks=[checkpoint], max_steps=5)
    second = _fit(tmp_path, Classifier(), ckpt_path=tmp_path / "ckpt" / "mid.ckpt")
    assert len(first) == 5
    assert _documents(first + second) == _documents(expected)  # nothing skipped, nothing repeated
    assert first + second == expected


def test_a_checkpoint_after_a_failed_step_reruns_it_with_the_trainers_count(tmp_path):
    expected = _epoch_plan()
    fail_at = 6
    model = Classifier(count_from_trainer=True, fail_at=fail_at)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, model, callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")])
    first = model.trained
    second = _fit(tmp_path, Classifier(count_from_trainer=True), ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt")
    assert len(first) == fail_at  # the failed micro-batch did not finish
    assert first + second == expected  # it runs after the resume; nothing else twice, nothing skipped


def test_every_trainer_gets_the_fit_loop_count():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert any(isinstance(c, FitLoopCount) for c in trainer.callbacks), (
        "FitLoopCount is added by the package's lightning.pytorch.callbacks_factory entry point: reinstall the package "
        "(pip install -e .) so that its metadata lists it")


def test_default_arguments_take_the_trainers_count_so_a_failed_step_runs_again(tmp_path):
    expected = _epoch_plan()
    fail_at = 5
    model = Classifier(fail_at=fail_at)  # balanced_dataloader with no batches_consumed
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, model, callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")])
    first = model.trained
    resumed = Classifier()
    second = _fit(tmp_path, resumed, ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt")
    assert len(first) == fail_at
    assert second[0] == expected[fail_at]  # the failed micro-batch runs again
    assert first + second == expected  # nothing else twice, nothing skipped
    assert _documents(first + second) == _documents(expected)
