"""The map-style path (MicroBatchDataset + balanced_dataloader) resumes exactly under Lightning with 2 persistent
DataLoader workers: the loader saves the micro-batches training consumed, not those its workers fetched ahead; it
takes the fit loop's count from the Trainer handed to it (trainer=self.trainer; no callback), under the standalone
pytorch_lightning package too, and a CombinedLoader of such loaders resumes exactly (mode min_size) or is refused before
training. Without a Trainer its own count resumes a mid-epoch checkpoint exactly, and a checkpoint written while a
failed step's exception is handled warns that it skips that micro-batch."""

import logging
import warnings
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader
from lit_balance.lightning import fit_batches_consumed

MAX_TOKENS, SEED = 64, 4


def _items() -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"input_ids": rng.integers(1, 64, size=int(n)).tolist(), "label": int(i % 2)}
            for i, n in enumerate(rng.integers(1, 30, 150))]


def _loader(trainer, num_workers=2, seed=SEED, hand_trainer=True, **kwargs):
    train = MicroBatchDataset(_items(), length="input_ids")
    sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=seed, num_replicas=trainer.world_size,
                                   rank=trainer.global_rank)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
    if hand_trainer:
        kwargs["trainer"] = trainer
    return balanced_dataloader(train, sampler, collate,
                               num_workers=num_workers, persistent_workers=num_workers > 0, **kwargs)


class _ClassifierSteps:
    """A tiny classifier on map-style micro-batches; records the indices of every micro-batch it trained."""

    def __init__(self, count_from_trainer: bool = False, fail_at: int | None = None, hand_trainer: bool = True) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 4), torch.nn.Linear(4, 2)
        self.count_from_trainer, self.fail_at, self.hand_trainer = count_from_trainer, fail_at, hand_trainer
        self.trained: list[list[int]] = []

    def train_dataloader(self):
        kwargs = {"batches_consumed": lambda: fit_batches_consumed(self.trainer)} if self.count_from_trainer else {}
        return _loader(self.trainer, hand_trainer=self.hand_trainer, **kwargs)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise RuntimeError("boom (simulated)")
        logits = self.head(self.embed(batch["input_ids"]).mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained.append(batch["indices"].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Classifier(_ClassifierSteps, L.LightningModule):
    pass


def _fit(tmp_path, model, *, callbacks=(), max_steps=-1, ckpt_path=None, trainer_class=L.Trainer) -> list[list[int]]:
    trainer = trainer_class(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, logger=False,
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


@pytest.mark.slow  # two in-process fits with DataLoader worker processes
@pytest.mark.parametrize("hand_trainer", [True, False], ids=["fit_count", "own_count"])
def test_mid_epoch_checkpoint_resumes_exactly_with_two_persistent_workers(tmp_path, hand_trainer):
    expected = _epoch_plan()
    assert len(expected) > 12  # far more micro-batches than the workers fetch ahead (2 workers x prefetch 2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="mid")
    first = _fit(tmp_path, Classifier(hand_trainer=hand_trainer), callbacks=[checkpoint], max_steps=5)
    second = _fit(tmp_path, Classifier(hand_trainer=hand_trainer), ckpt_path=tmp_path / "ckpt" / "mid.ckpt")
    assert len(first) == 5
    assert _documents(first + second) == _documents(expected)  # nothing skipped, nothing repeated
    assert first + second == expected


@pytest.mark.slow  # two in-process fits with DataLoader worker processes
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


def test_a_trainer_gets_no_callback_from_the_package_and_logs_nothing_of_it(caplog):
    with caplog.at_level(logging.INFO):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert "lit_balance" not in caplog.text and "entry point" not in caplog.text, caplog.text
    assert not any(type(c).__module__.startswith("lit_balance") for c in trainer.callbacks), trainer.callbacks


@pytest.mark.slow  # two in-process fits with DataLoader worker processes
def test_the_trainer_handed_to_the_loader_gives_its_count_so_a_failed_step_runs_again(tmp_path):
    expected = _epoch_plan()
    fail_at = 5
    model = Classifier(fail_at=fail_at)  # balanced_dataloader(..., trainer=self.trainer), no batches_consumed
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, model, callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")])
    first = model.trained
    resumed = Classifier()
    second = _fit(tmp_path, resumed, ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt")
    assert len(first) == fail_at
    assert second[0] == expected[fail_at]  # the failed micro-batch runs again
    assert first + second == expected  # nothing else twice, nothing skipped
    assert _documents(first + second) == _documents(expected)


@pytest.mark.slow  # two in-process fits with DataLoader worker processes
def test_the_standalone_pytorch_lightning_trainer_gives_its_count_too(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class PLClassifier(_ClassifierSteps, pl.LightningModule):
        pass

    expected = _epoch_plan()
    model = PLClassifier(fail_at=5)  # balanced_dataloader(..., trainer=self.trainer), no batches_consumed
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, model, callbacks=[pl.callbacks.OnExceptionCheckpoint(tmp_path / "ckpt")],
             trainer_class=pl.Trainer)
    second = _fit(tmp_path, PLClassifier(), ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt", trainer_class=pl.Trainer)
    assert model.trained + second == expected  # the failed micro-batch runs again; nothing else twice, none skipped


@pytest.mark.slow  # an in-process fit with DataLoader worker processes
def test_without_a_trainer_a_checkpoint_written_while_a_failed_step_is_handled_warns_that_it_skips_it(tmp_path):
    model = Classifier(fail_at=5, hand_trainer=False)
    with pytest.raises(RuntimeError, match="boom"), pytest.warns(RuntimeWarning) as caught:
        _fit(tmp_path, model, callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")])
    messages = [str(w.message) for w in caught if "BalancedDataLoader.state_dict()" in str(w.message)]
    assert len(messages) == 1 and "saving 6 micro-batches consumed" in messages[0], messages
    assert "trainer=self.trainer" in messages[0] and "skips it" in messages[0]
    assert len(model.trained) == 5 and (tmp_path / "ckpt" / "on_exception.ckpt").exists()  # still written


def test_a_state_saved_outside_an_exception_does_not_warn():
    class OneRank:
        world_size, global_rank = 1, 0

    loader = _loader(OneRank(), num_workers=0, hand_trainer=False)
    iterator = iter(loader)
    next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.state_dict()["sampler"] is not None
    try:
        raise KeyError("handled")
    except KeyError:
        with pytest.warns(RuntimeWarning, match="saving 1 micro-batches consumed"):
            loader.state_dict()


class TwoCorpora(Classifier):
    """Two BalancedDataLoaders (other seeds: other epochs) in one CombinedLoader of ``mode``; records each one's."""

    def __init__(self, mode: str, fail_at: int | None = None) -> None:
        super().__init__(fail_at=fail_at)
        self.mode = mode

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        return CombinedLoader({"a": _loader(self.trainer, num_workers=0, seed=SEED), "b": _short(self.trainer)},
                              mode=self.mode)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise RuntimeError("boom (simulated)")
        return sum(super(TwoCorpora, self).training_step(b, batch_idx) for b in batch.values() if b is not None)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained.append({k: None if b is None else b["indices"].tolist() for k, b in batch.items()})


def _short(trainer):
    """A BalancedDataLoader over the first 60 items: fewer micro-batches than the other."""
    train = MicroBatchDataset(_items()[:60], length="input_ids")
    sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=1, num_replicas=trainer.world_size,
                                   rank=trainer.global_rank)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
    return balanced_dataloader(train, sampler, collate, trainer=trainer)


@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size", "sequential"])
def test_a_combined_loader_whose_count_is_not_each_loaders_is_refused_before_training(tmp_path, mode):
    model = TwoCorpora(mode)
    # Lightning's fit loop refuses mode "sequential" itself, as clearly, before the first batch
    with pytest.raises(ValueError, match="mode='min_size'" if mode != "sequential" else 'mode="sequential"'):
        _fit(tmp_path, model)
    assert model.trained == []  # refused before any training step


@pytest.mark.slow  # two in-process fits
def test_a_min_size_combined_loader_resumes_each_loader_exactly_after_a_failed_step(tmp_path):
    whole = TwoCorpora("min_size")
    _fit(tmp_path / "whole", whole)
    failed = TwoCorpora("min_size", fail_at=3)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, failed, callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")])
    second = _fit(tmp_path, TwoCorpora("min_size"), ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt")
    assert len(failed.trained) == 3 and failed.trained + second == whole.trained
