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
    assert resumed.last_model_path == str(tmp_path / "again" / "last.ckpt")


def test_without_stop_on_signal_the_handlers_are_lightnings():
    last = LastStepCheckpoint(stop_on_signal=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=True, callbacks=[last])
    before = signal.getsignal(signal.SIGINT)
    last.on_train_start(trainer, None)
    assert signal.getsignal(signal.SIGINT) is before
