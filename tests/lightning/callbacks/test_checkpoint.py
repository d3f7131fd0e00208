"""LastStepCheckpoint: a signal during training stops at the end of the optimizer step, which it saves."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from test_progress import _batches, _Tiny

from lit_balance.callbacks import LastStepCheckpoint


class _SignalAt(L.Callback):
    """Sends ``signum`` to this process at the start of micro-batch ``batch_idx`` (inside the step, as a user's Ctrl-C
    or a scheduler's SIGTERM arrives)."""

    def __init__(self, signum: int, batch_idx: int) -> None:
        self.signum, self.batch_idx = signum, batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.batch_idx and batch_idx == self.batch_idx % 4:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_at_the_end_of_the_step_and_keeps_it(tmp_path, signum):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    last = LastStepCheckpoint(dirpath=tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[_SignalAt(signum, 5), last])
    trainer.fit(_Tiny(), torch.utils.data.DataLoader(_batches(), batch_size=None))  # returns: no exception
    assert trainer.global_step == 6 and last.stopped_by == signal.Signals(signum).name  # the step it arrived in ends
    assert last.last_model_path == str(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 6
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the process's handlers are back

    # a resume trains the remaining steps, and names the file it wrote, not the one it loaded
    resumed = LastStepCheckpoint(dirpath=tmp_path / "again")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[resumed])
    trainer.fit(_Tiny(), torch.utils.data.DataLoader(_batches(), batch_size=None), ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 12 and resumed.stopped_by is None
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # also after a fit that was not stopped
    assert resumed.last_model_path == str(tmp_path / "again" / "last.ckpt")


def test_without_stop_on_signal_the_handlers_are_lightnings():
    last = LastStepCheckpoint(stop_on_signal=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=True, callbacks=[last])
    before = signal.getsignal(signal.SIGINT)
    last.on_train_start(trainer, None)
    assert signal.getsignal(signal.SIGINT) is before


class _SignalAgain(L.Callback):
    """Sends ``signum`` to this process once, in ``hook``: while the stop saves (``on_save_checkpoint``) or while the
    end table prints (``on_fit_end``, after Lightning set its own signal handlers back)."""

    def __init__(self, signum: int, hook: str) -> None:
        self.signum, self.sent = signum, False
        setattr(self, hook, self._send)

    def _send(self, *args) -> None:
        if not self.sent and args[0].global_step > 0:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def _fit_keeping_handlers(trainer, *args, **kwargs):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        trainer.fit(*args, **kwargs)
    finally:  # Lightning ignores SIGINT for good after a KeyboardInterrupt
        changed = {s: signal.getsignal(s) for s in handlers} != handlers
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert not changed  # the process's handlers are back after the fit


@pytest.mark.parametrize("hook", ["on_save_checkpoint", "on_fit_end"])
def test_a_second_ctrl_c_while_the_stop_saves_or_the_table_prints_waits_for_it(tmp_path, hook, capfd):
    from lit_balance.callbacks import RunSummary

    last = LastStepCheckpoint(dirpath=tmp_path)
    summary = RunSummary()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        callbacks=[_SignalAgain(signal.SIGINT, hook), summary, _SignalAt(signal.SIGINT, 5), last])
    _fit_keeping_handlers(trainer, _Tiny(), torch.utils.data.DataLoader(_batches(), batch_size=None))  # no exit
    assert trainer.global_step == 6 and last.stopped_by == "SIGINT"
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6
    out, err = capfd.readouterr()
    assert "total       6 " in out  # the table, of the 6 trained steps
    assert "SIGINT again: every rank is stopping at the end of this optimizer step and writing last.ckpt" in err


class _TinyWithValidation(_Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", (self.w * batch["input_ids"].float()).mean())


class _SignalInValidation(L.Callback):
    """Sends ``signum`` to this process at the first validation micro-batch inside training."""

    def __init__(self, signum: int) -> None:
        self.signum, self.sent = signum, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def test_sigterm_during_validation_stops_when_validation_ends(tmp_path):
    last = LastStepCheckpoint(dirpath=tmp_path)
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=4, limit_val_batches=2,
                        num_sanity_val_steps=1, callbacks=[_SignalInValidation(signal.SIGTERM), last])
    _fit_keeping_handlers(trainer, _TinyWithValidation(), loader, loader)
    assert trainer.global_step == 4 and last.stopped_by == "SIGTERM"  # no step after the validation at step 4
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_ctrl_c_before_training_starts_is_the_previous_handlers(tmp_path):
    class _SignalInSetup(L.Callback):
        def setup(self, trainer, pl_module, stage):
            os.kill(os.getpid(), signal.SIGINT)

    last = LastStepCheckpoint(dirpath=tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[last, _SignalInSetup()])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit):  # Lightning's answer to KeyboardInterrupt: nothing trained, nothing to keep
            trainer.fit(_Tiny(), torch.utils.data.DataLoader(_batches(), batch_size=None))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert not (tmp_path / "last.ckpt").exists() and last.stopped_by is None
