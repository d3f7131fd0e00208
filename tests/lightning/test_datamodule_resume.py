"""Resume through Lightning checkpoints in one process, with DataLoader workers running ahead of training."""

import signal
import warnings

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_balance import BalancedBatchSampler, BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM


class Recorder(L.Callback):
    def __init__(self):
        self.batches = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.setdefault(trainer.current_epoch, []).append(batch["indices"].tolist())


def _fit(tmp_path, *, ckpt_path=None, max_steps=-1, callbacks=()):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, 240)]
    dm = BalancedTextDataModule(docs, max_tokens=128, max_length=None, val_fraction=0.05, num_workers=2,
                                cache_dir=tmp_path / "cache", seed=3)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, val_check_interval=4,
                        limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, *callbacks], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return rec, dm


def test_checkpoint_at_validation_end_resumes_exactly_with_workers(tmp_path):
    # ModelCheckpoint saves at validation end (4 micro-batches in); 2 workers have fetched further by then
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="mid")
    first, dm = _fit(tmp_path, max_steps=4, callbacks=[checkpoint])
    second, _ = _fit(tmp_path, ckpt_path=tmp_path / "ckpt" / "mid.ckpt")
    plan = dm.train_sampler.plan(0)
    expected = [plan.batch(int(b))[0].tolist() for b in plan.assignment[:, 0]]
    assert len(first.batches[0]) == 4
    assert first.batches[0] + second.batches[0] == expected  # nothing replayed, nothing skipped


class FailingLM(DemoTransformerLM):
    """Records every micro-batch training_step starts on; raises ``error`` at micro-batch ``fail_at`` of epoch 0."""

    started, fail_at, error = None, None, None  # set on the instance (not hyperparameters: kept out of checkpoints)

    def training_step(self, batch, batch_idx):
        self.started.append((self.current_epoch, tuple(batch["indices"].tolist())))
        if self.fail_at is not None and self.current_epoch == 0 and batch_idx == self.fail_at:
            raise self.error
        return super().training_step(batch, batch_idx)


def _fit_failing(tmp_path, workers, *, ckpt_path=None, fail_at=None, error=None):
    """Fit 2 epochs; returns the (epoch, indices) of every micro-batch training_step started on, in order."""
    started = []
    try:
        _fit_into(started, tmp_path, workers, ckpt_path=ckpt_path, fail_at=fail_at, error=error)
    except BaseException as exc:
        exc.started = started
        raise
    return started


def _fit_into(started, tmp_path, workers, *, ckpt_path, fail_at, error):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, 120)]
    dm = BalancedTextDataModule(docs, max_tokens=128, max_length=None, val_fraction=0.05, num_workers=workers,
                                cache_dir=tmp_path / "cache", seed=5)
    model = FailingLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    model.started, model.fail_at, model.error = started, fail_at, error
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, val_check_interval=3, limit_val_batches=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[OnExceptionCheckpoint(tmp_path / "ckpt")],
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)


@pytest.mark.slow
@pytest.mark.parametrize(("error", "workers"), [(RuntimeError("CUDA out of memory (simulated)"), 0),
                                                (KeyboardInterrupt(), 0), (RuntimeError("boom"), 2)],
                         ids=["exception", "sigint", "exception-2-persistent-workers"])
def test_resume_from_on_exception_checkpoint_reruns_only_the_failed_micro_batch(tmp_path, error, workers):
    fail_at = 4  # after a mid-epoch validation (val_check_interval=3), before the next
    expected = _fit_failing(tmp_path / "whole", workers)
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning answers KeyboardInterrupt (Ctrl-C) with the on_exception hooks, then sys.exit(1)
        with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else type(error)) as failed:
            _fit_failing(tmp_path, workers, fail_at=fail_at, error=error)
    finally:
        signal.signal(signal.SIGINT, handler)
    first = failed.value.started
    second = _fit_failing(tmp_path, workers, ckpt_path=tmp_path / "ckpt" / "on_exception.ckpt")
    assert first[-1] == expected[fail_at]  # the failed micro-batch
    assert first + second == expected[:fail_at + 1] + expected[fail_at:]  # it alone runs twice


def _words_dm(tmp_path, docs=None, **kwargs):
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 60, 40)] if docs is None else docs
    kwargs = {"max_tokens": 128, "max_length": 48, "val_fraction": 0.1, "seed": 1, **kwargs}
    dm = BalancedTextDataModule(docs, cache_dir=tmp_path / "cache", **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(("change", "named"), [
    ({"seed": 2}, "seed: saved 1, now 2"),
    ({"val_fraction": 0.2}, "val_fraction: saved 0.1, now 0.2"),
    ({"max_length": 40}, "max_length: saved 48, now 40"),
    ({"max_length": None}, "max_length: saved 48, now None"),
])
def test_resume_after_a_changed_setting_names_it(tmp_path, change, named):
    saved = _words_dm(tmp_path).state_dict()
    dm = _words_dm(tmp_path, **change)
    with pytest.raises(ValueError, match="cannot resume") as err:
        dm.load_state_dict(saved)
        dm.train_dataloader()
    assert named in str(err.value), str(err.value)
    assert "other lengths than this one" not in str(err.value)


def test_resume_on_another_corpus_names_the_corpus(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 60, 40)]
    saved = _words_dm(tmp_path, docs).state_dict()
    dm = _words_dm(tmp_path, docs[:-1])
    with pytest.raises(ValueError, match=r"cannot resume.*corpus: saved 40 documents, now 39") as err:
        dm.load_state_dict(saved)
        dm.train_dataloader()
    assert "tokenizer" in str(err.value)


def test_sampler_resume_with_equal_count_and_other_lengths_says_the_lengths_differ():
    from lit_balance import BalancedBatchSampler

    saved = BalancedBatchSampler([3, 5, 7, 9], 16, num_replicas=1, rank=0).state_dict()
    sampler = BalancedBatchSampler([3, 5, 7, 8], 16, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"same number of samples \(4\).*lengths differ"):
        sampler.load_state_dict(saved)


def test_malformed_data_record_is_refused_and_a_record_of_earlier_versions_is_optional(tmp_path):
    dm = _words_dm(tmp_path)
    saved = dm.state_dict()
    assert set(saved) == {"train_sampler", "data"} and saved["data"]["seed"] == 1
    with pytest.raises(ValueError, match=r"'data' must have keys .*got \['seed'\]"):
        dm.load_state_dict({**saved, "data": {"seed": 1}})
    dm.load_state_dict({"train_sampler": saved["train_sampler"]})  # saved before the record existed
    assert len(dm.train_dataloader()) == len(dm.train_sampler)


class PlainLoaderDataModule(BalancedTextDataModule):
    """The same batches through a plain DataLoader, which Lightning cannot tell resumes through its sampler."""

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        loader = super().train_dataloader()
        return DataLoader(loader.dataset, sampler=loader.sampler, batch_size=None, collate_fn=loader.collate_fn)


def _fit_small(tmp_path, dm_class, *, max_steps=-1, ckpt_path=None, callbacks=()):
    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, 80)]
    dm = dm_class(docs, max_tokens=128, max_length=None, val_fraction=0, cache_dir=tmp_path / "cache", seed=3)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(("dm_class", "warned"), [(BalancedTextDataModule, False), (PlainLoaderDataModule, True)])
def test_a_mid_epoch_resume_is_not_called_unresumable_and_leaves_the_warning_filters_alone(tmp_path, dm_class,
                                                                                           warned):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="mid", every_n_train_steps=3, save_top_k=-1)
    first = _fit_small(tmp_path, dm_class, max_steps=3, callbacks=[checkpoint])
    assert first.num_training_batches > 3  # the checkpoint is inside the epoch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        second = _fit_small(tmp_path, dm_class, ckpt_path=tmp_path / "ckpt" / "mid.ckpt")
        assert warnings.filters == filters  # nothing filtered for the rest of the process
    assert second.global_step == first.num_training_batches  # the resume finished the epoch
    shown = [str(w.message) for w in caught if "not resumable" in str(w.message)]
    assert bool(shown) is warned, shown  # the plain DataLoader shows that the resume above is one Lightning checks


def _resume_with(tmp_path, saved_trainer, resumed_trainer, resumed_kwargs=None):
    """Save the state of a DataModule set up under ``saved_trainer``; load it into one under ``resumed_trainer``."""
    first = BalancedTextDataModule(_words_docs(), cache_dir=tmp_path / "cache", **_WORDS_KWARGS)
    first.trainer = saved_trainer
    first.setup("fit")
    state = first.state_dict()
    second = BalancedTextDataModule(_words_docs(), cache_dir=tmp_path / "cache", **(resumed_kwargs or _WORDS_KWARGS))
    second.trainer = resumed_trainer
    second.setup("fit")
    second.load_state_dict(state)
    return second


_WORDS_KWARGS = {"max_tokens": 128, "max_length": 48, "val_fraction": 0.1, "seed": 1}


def _words_docs():
    rng = np.random.default_rng(2)
    return [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 60, 40)]


def _trainer(accumulate):
    return L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=accumulate, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def test_resume_after_changing_the_trainers_accumulation_names_the_trainer_setting(tmp_path):
    second = _resume_with(tmp_path, _trainer(2), _trainer(1))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches: saved 2, now 1.*set "
                                         r"Trainer\(accumulate_grad_batches=2\)") as refused:
        second.train_dataloader()
    assert "construct the sampler" not in str(refused.value)  # a DataModule user builds no sampler


def test_resume_after_changing_a_batching_setting_names_the_data_module_keyword(tmp_path):
    second = _resume_with(tmp_path, _trainer(1), _trainer(1),
                          resumed_kwargs={**_WORDS_KWARGS, "max_tokens": 96})
    with pytest.raises(ValueError, match=r"max_tokens: saved 128, now 96.*construct BalancedTextDataModule with the "
                                         r"saved max_tokens=128"):
        second.train_dataloader()


def test_a_sampler_resume_with_other_settings_names_the_sampler_keywords():
    saved = BalancedBatchSampler([5, 9, 3, 7] * 5, 32, num_replicas=1, rank=0, accumulate_grad_batches=2)
    fresh = BalancedBatchSampler([5, 9, 3, 7] * 5, 32, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"construct the sampler with the saved settings "
                                         r"\(BalancedBatchSampler\(\.\.\., accumulate_grad_batches=2\)"):
        fresh.load_state_dict(saved.state_dict())


@pytest.mark.parametrize("workers", [0, 1])
def test_the_training_loader_alone_resumes_exactly_in_a_plain_loop(tmp_path, workers):
    """No Trainer (a Fabric or torchrun loop): the DataModule's own training loader saves and restores its position."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, 120)]

    def loader():
        dm = BalancedTextDataModule(docs, max_tokens=96, max_length=None, val_fraction=0, num_workers=workers,
                                    cache_dir=tmp_path / "cache", seed=3)
        dm.prepare_data()
        dm.setup("fit")
        return dm, dm.train_dataloader()

    _, whole = loader()
    expected = [b["indices"].tolist() for b in whole]
    dm, first = loader()
    it = iter(first)
    trained = [next(it)["indices"].tolist() for _ in range(3)]
    state, dm_state = first.state_dict(), dm.state_dict()
    del it
    fresh_dm, fresh = loader()
    fresh.load_state_dict(state)
    rest = [b["indices"].tolist() for b in fresh]
    assert trained + rest == expected and len(expected) > 6  # nothing replayed, nothing skipped
    assert dm_state["train_sampler"] == state["sampler"]  # the DataModule's state says the same position
    with pytest.raises(ValueError, match=r"dm\.state_dict\(\)"):
        fresh.load_state_dict({})  # an empty state outside Trainer.fit would restart the epoch: refused
