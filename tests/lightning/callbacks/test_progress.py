"""BalanceProgressBar: the rendered text of a real (one-process) fit shows the epoch, the step and the live figures."""

from __future__ import annotations

import io
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar

from lit_balance.callbacks import BalanceProgressBar, PaddingRatioMonitor, StragglerMonitor
from lit_balance.lightning.callbacks.progress import _rate, live_figures

# four micro-batches per epoch: (rows, padded length, real tokens)
SHAPES = [(2, 8, 12), (1, 8, 8), (4, 4, 14), (2, 5, 10)]


def _batches():
    return [{"input_ids": torch.ones(rows, length, dtype=torch.long), "num_real_tokens": torch.tensor(real),
             "num_padded_tokens": torch.tensor(rows * length)} for rows, length, real in SHAPES]


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        loss = (self.w * batch["input_ids"].float()).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(bar, max_steps: int, max_epochs: int | None, monitors: bool = True) -> str:
    callbacks = [PaddingRatioMonitor(log_every_n_micro_batches=2), StragglerMonitor(log_every_n_micro_batches=2)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=max_epochs, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[*(callbacks if monitors else []), bar])
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    trainer.fit(_Tiny(), loader)
    return trainer


def _rendered(buffer: io.StringIO) -> str:
    """The bar's last frame as one line (a narrow console wraps the metrics column over several lines)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())
    frame = text[text.rindex("Epoch"):]
    return " ".join(frame.split())


def _bar(buffer: io.StringIO, cls=BalanceProgressBar) -> RichProgressBar:
    return cls(console_kwargs={"file": buffer, "width": 100, "force_terminal": False})


def test_bar_shows_epoch_step_and_the_monitors_figures_with_max_epochs_minus_one():
    buffer = io.StringIO()
    trainer = _fit(_bar(buffer), max_steps=6, max_epochs=-1)  # two epochs of 4 micro-batches; stops in the 2nd
    line = _rendered(buffer)
    assert trainer.global_step == 6  # (current_epoch reads 2 once the fit has stopped)
    assert line.startswith("Epoch 1 ") and "/-2" not in line, line
    assert "step: 6/6" in line, line
    # epoch 1 so far: micro-batches 0 and 1 (real 12 + 8 of padded 16 + 8); one rank: straggler ratio exactly 1
    assert "padding (epoch): 0.167" in line and "straggler: 1.00" in line, line
    # the StragglerMonitor's last window: micro-batches 4 and 5 (steps 4 and 5), 12 + 8 real tokens over its seconds
    window = next(c for c in trainer.callbacks if isinstance(c, StragglerMonitor)).last_window
    assert "window: steps 4-5 " in line and (window.first_step, window.last_step) == (4, 5), line
    seconds = float(window.compute_s[0] + window.data_wait_s[0] + window.rank_wait_s[0] + window.other_s[0])
    # tokens/s: the figure PaddingRatioMonitor logged last, which metrics.csv holds
    logged = next(c for c in trainer.callbacks if isinstance(c, PaddingRatioMonitor)).last_metrics
    tokens = re.search(r"tokens/s: ([\d,]+) ", line)
    assert tokens and tokens[1] == f"{logged['balance/real_tokens_per_s']:,.0f}", line
    shares = re.search(r"compute: (\d+)% data wait: (\d+)% rank wait: (\d+)% other: (\d+)%", line)
    assert shares and shares[3] == "0" and abs(sum(map(int, shares.groups())) - 100) <= 2, line  # one rank: no wait
    assert shares[1] == f"{100 * window.compute_s[0] / seconds:.0f}", line
    figures = live_figures(trainer)
    assert figures["balance/padding_ratio"] == pytest.approx(1 - 20 / 24)
    # micro-batches of this epoch (Lightning counts to the last one max_steps leaves), a real rate
    assert re.search(r" 2/2 \S+ • \S+ \d+\.\d\d(it/s|s/it) ", line), line
    assert "0.00it/s" not in line and "train/loss:" in line


def test_each_name_and_value_stay_on_one_line_at_40_columns():
    buffer = io.StringIO()
    _fit(BalanceProgressBar(console_kwargs={"file": buffer, "width": 40, "force_terminal": False}), max_steps=6,
         max_epochs=-1)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())
    frame = text[text.rindex("Epoch"):]
    lines = frame.splitlines()
    for label in ("train/loss", "step", "window", "tokens/s", "straggler", "compute", "data wait", "rank wait",
                  "other", "padding (epoch)"):
        assert any(re.search(rf"{re.escape(label)}: \S", line) for line in lines), (label, frame)
    assert all(not line.rstrip().endswith(":") for line in lines), frame
    assert max(len(line.rstrip()) for line in lines) <= 40, frame


def test_bar_counts_epochs_up_to_max_epochs_minus_one():
    buffer = io.StringIO()
    _fit(_bar(buffer), max_steps=-1, max_epochs=2)
    line = _rendered(buffer)
    assert line.startswith("Epoch 1/1 ") and "step: 8" in line and "step: 8/" not in line, line


def test_without_monitors_the_bar_shows_the_step_only():
    buffer = io.StringIO()
    _fit(_bar(buffer), max_steps=3, max_epochs=-1, monitors=False)
    line = _rendered(buffer)
    assert line.startswith("Epoch 0 ") and "step: 3/3" in line and "tokens/s" not in line and "padding" not in line


def test_lightnings_own_rich_bar_shows_what_this_one_fixes():
    # the display BalanceProgressBar replaces: max_epochs=-1 reads as a last epoch of -2
    buffer = io.StringIO()
    _fit(_bar(buffer, RichProgressBar), max_steps=3, max_epochs=-1, monitors=False)
    assert _rendered(buffer).startswith("Epoch 0/-2 ")


@pytest.mark.parametrize("completed,elapsed,text", [
    (10, 4.0, "2.50it/s"), (2, 5.0, "2.50s/it"), (1, 1.0, "1.00it/s"), (0, 3.0, "-- it/s"), (3, None, "-- it/s"),
])
def test_rate_is_micro_batches_per_second_or_seconds_per_micro_batch(completed, elapsed, text):
    assert _rate(completed, elapsed) == text
