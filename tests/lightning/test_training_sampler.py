"""The training sampler is handed to the Trainer (use_training_sampler, a BalancedDataLoader given trainer=, the
DataModule), never found by looking into its loader: what is handed over is what the callbacks and the loss read."""

import pickle
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lit_balance import (BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader,
                         use_training_sampler)
from lit_balance.data.training_sampler import training_sampler_of

LENGTHS = [3, 5, 2, 7, 4, 6, 1, 8]


class FakeTrainer(SimpleNamespace):
    """What the hand-over reads of a Trainer (its training loaders), and a weak reference to it (the loader's)."""


def _sampler(seed=0):
    return BalancedBatchSampler(LENGTHS, max_tokens=8, num_replicas=1, rank=0, seed=seed)


def _items(n=40):
    rng = np.random.default_rng(3)
    return [{"input_ids": rng.integers(1, 50, size=int(k)).tolist(), "label": i % 2}
            for i, k in enumerate(rng.integers(1, 12, n))]


def _balanced_loader(trainer, seed=0):
    train = MicroBatchDataset(_items(), length="input_ids")
    sampler = BalancedBatchSampler(train.lengths, max_tokens=32, num_replicas=1, rank=0, seed=seed)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
    return balanced_dataloader(train, sampler, collate, trainer=trainer)


def test_nothing_handed_over_is_none_even_when_the_loader_holds_a_balanced_sampler():
    sampler = _sampler()
    trainer = FakeTrainer(train_dataloader=DataLoader(list(range(8)), sampler=sampler, batch_size=None))
    assert training_sampler_of(trainer) is None  # the loader is not looked into


def test_use_training_sampler_hands_over_replaces_and_withdraws():
    trainer = FakeTrainer(train_dataloader=None)
    first, second = _sampler(), _sampler(seed=1)
    use_training_sampler(trainer, first)
    assert training_sampler_of(trainer) is first
    use_training_sampler(trainer, second)
    assert training_sampler_of(trainer) is second
    use_training_sampler(trainer, None)
    assert training_sampler_of(trainer) is None


@pytest.mark.parametrize("wrong", [object(), torch.utils.data.RandomSampler(range(3)), [1, 2]])
def test_use_training_sampler_refuses_what_is_not_a_balanced_batch_sampler(wrong):
    with pytest.raises(TypeError, match=rf"use_training_sampler takes .*BalancedBatchSampler .*got "
                                        rf"{type(wrong).__name__}"):
        use_training_sampler(FakeTrainer(train_dataloader=None), wrong)


def test_a_loader_given_the_trainer_offers_its_sampler_while_the_trainer_trains_from_it():
    trainer = FakeTrainer(train_dataloader=None)
    train, val = _balanced_loader(trainer), _balanced_loader(trainer, seed=1)  # both were given the Trainer
    assert training_sampler_of(trainer) is None  # the Trainer has loaded no training loader yet
    trainer.train_dataloader = train
    assert training_sampler_of(trainer) is train.balanced_sampler  # not the validation loader's
    trainer.train_dataloader = {"a": [DataLoader(range(3))], "b": train}  # in a CombinedLoader's collection
    assert training_sampler_of(trainer) is train.balanced_sampler
    trainer.train_dataloader = val
    assert training_sampler_of(trainer) is val.balanced_sampler
    by_hand = _sampler()
    use_training_sampler(trainer, by_hand)  # a sampler handed over by hand comes first
    assert training_sampler_of(trainer) is by_hand


def test_what_was_handed_over_travels_with_a_pickled_trainer():
    # ddp_spawn pickles the Trainer to its processes: the sampler handed over by hand goes with it
    trainer = FakeTrainer(train_dataloader=None)
    use_training_sampler(trainer, _sampler())
    copy = pickle.loads(pickle.dumps(trainer))
    assert training_sampler_of(copy) is not None
    assert training_sampler_of(copy).lengths.tolist() == LENGTHS


class _Seen(L.Callback):
    """Records the training sampler handed to the Trainer at the hooks the package's callbacks read it in."""

    def __init__(self):
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        self.seen.append(training_sampler_of(trainer))

    def on_train_epoch_start(self, trainer, pl_module):
        self.seen.append(training_sampler_of(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(training_sampler_of(trainer))


class _Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 4), torch.nn.Linear(4, 2)
        self.loaders = {}

    def train_dataloader(self):
        self.loaders["train"] = _balanced_loader(self.trainer)
        return self.loaders["train"]

    def val_dataloader(self):
        self.loaders["val"] = _balanced_loader(self.trainer, seed=1)  # given the Trainer too, not the training loader
        return self.loaders["val"]

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.head(self.embed(batch["input_ids"]).mean(1)), batch["label"])

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_under_fit_the_callbacks_read_the_training_loaders_sampler_epoch_after_epoch(tmp_path):
    seen, model = _Seen(), _Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=2, limit_val_batches=1,
                        reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
                        default_root_dir=tmp_path)
    trainer.fit(model)
    assert len(seen.seen) == 1 + 2 * (1 + 2)
    assert all(s is not None for s in seen.seen)
    assert seen.seen[-1] is model.loaders["train"].balanced_sampler  # the loader of the last epoch, reloaded
    assert all(s is not model.loaders["val"].balanced_sampler for s in seen.seen)
