"""Resume through Lightning checkpoints in one process, with DataLoader workers running ahead of training."""

import signal

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_balance import BalancedTextDataModule
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
