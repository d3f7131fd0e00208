"""Fit a tiny LM on 2 CPU ranks (gloo) with the measuring and adapting callbacks; record what each rank did.

Run: python tests/ddp/fit_callbacks.py OUT_DIR MODE
MODE "adaptive": AdaptiveGradAccumulation (straggler timings on) + PaddingRatioMonitor + StragglerMonitor (all-reduce
loss divisor).
MODE "fixed": Trainer(accumulate_grad_batches=2) and a sampler planned for 2 (plan loss divisor), StragglerMonitor.
Each rank writes OUT_DIR/rank{r}.json and, for the first optimizer step, OUT_DIR/step0_rank{r}.pt
(its micro-batches and the gradients the optimizer saw); rank 0 writes OUT_DIR/init.pt (initial weights).
The monitors read a per-process scripted clock that only the model advances (forward + loss, backward), so
the timings, and the accumulation values chosen from them, do not depend on the machine's speed.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lit_balance import BalancedBatchSampler, PadCollator, TokenDataset, use_training_sampler
from lit_balance.demo import DemoTransformerLM
from lit_balance.callbacks import AdaptiveGradAccumulation, PaddingRatioMonitor, StragglerMonitor, TimingWindow
from lit_balance.data.training_sampler import training_sampler_of

from launch import run_as_ranks  # launch.py (the repository root)


class ScriptedClock:
    """Seconds that pass only when the model says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def tick(self, seconds):
        self.t += seconds


CLOCK = ScriptedClock()


class Data(L.LightningDataModule):
    def __init__(self, accumulate_grad_batches):
        super().__init__()
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 40, size=240)
        self.tokens = rng.integers(1, 100, size=int(lengths.sum()))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.acc = accumulate_grad_batches

    def setup(self, stage=None):
        self.ds = TokenDataset(self.tokens, self.offsets, np.arange(len(self.offsets) - 1))
        self.sampler = BalancedBatchSampler(self.ds.lengths, 160, num_replicas=self.trainer.world_size,
                                            rank=self.trainer.global_rank, seed=3,
                                            accumulate_grad_batches=self.acc)

    def train_dataloader(self):
        # a plain DataLoader: the callbacks and the loss read the sampler this hands to the Trainer
        use_training_sampler(self.trainer, self.sampler)
        return DataLoader(self.ds, sampler=self.sampler, batch_size=None, collate_fn=PadCollator(0))


class Model(DemoTransformerLM):
    def __init__(self, out):
        super().__init__(vocab_size=100, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
        self.out = out
        self.first_step_batches = []
        self.step_losses = []
        self.modes = []

    def on_fit_start(self):
        if self.global_rank == 0:
            torch.save(self.state_dict(), self.out / "init.pt")

    def training_step(self, batch, batch_idx):
        # forward + loss: ranks take turns being slow, so only steps of an even count of micro-batches balance
        CLOCK.tick(0.04 if self.trainer.world_size > 1 and (batch_idx + self.global_rank) % 2 == 0 else 0.01)
        if self.trainer.global_step == 0 and self.trainer.current_epoch == 0:
            self.first_step_batches.append({k: batch[k].clone() for k in ("input_ids", "attention_mask", "labels")})
        return super().training_step(batch, batch_idx)

    def backward(self, loss, *args, **kwargs):
        super().backward(loss, *args, **kwargs)
        CLOCK.tick(0.02)

    def on_before_optimizer_step(self, optimizer):
        mode = self.step_loss.mode
        step_loss = self.step_loss
        super().on_before_optimizer_step(optimizer)
        self.modes.append(mode)
        self.step_losses.append(float(self.trainer.callback_metrics["train/loss"]))
        if self.trainer.global_step == 0 and self.trainer.current_epoch == 0:
            grads = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
            torch.save({"batches": self.first_step_batches, "grads": grads, "loss": self.step_losses[-1],
                        "tokens": step_loss.last_step_tokens}, self.out / f"step0_rank{self.global_rank}.pt")


class Counter(L.Callback):
    """Counts micro-batches per optimizer step, zero_grad calls and the accumulate_grad_batches of each step."""

    def __init__(self):
        self.steps = []  # [epoch, first batch_idx, micro-batches, accumulate_grad_batches at the step]
        self.zero_grads = []
        self._since = 0
        self._first = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._since == 0:
            self._first = batch_idx
        self._since += 1

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.zero_grads.append([trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append([trainer.current_epoch, self._first, self._since, trainer.accumulate_grad_batches])
        self._since = 0


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    adaptive = mode == "adaptive"
    data = Data(accumulate_grad_batches=1 if adaptive else 2)
    model = Model(out)
    counter = Counter()
    callbacks = [counter]
    acc_cb = None
    monitor = StragglerMonitor(log_every_n_micro_batches=6, clock=CLOCK)
    if adaptive:
        # straggler timings on (off by default): Model makes the ranks take turns being slow, so steps of an odd
        # number of micro-batches are imbalanced and the value changes mid-run, which is what this run checks
        acc_cb = AdaptiveGradAccumulation(target_tokens_per_step=900, lookahead=4, tolerance=0.0,
                                          target_straggler_ratio=1.05)
        callbacks += [PaddingRatioMonitor(log_every_n_micro_batches=5, clock=CLOCK), monitor, acc_cb]
    else:
        callbacks.append(monitor)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=callbacks, max_epochs=2, accumulate_grad_batches=1 if adaptive else 2,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    record = {
        "steps": counter.steps, "zero_grads": counter.zero_grads, "modes": model.modes,
        "step_losses": model.step_losses, "num_batches": len(data.sampler),
        "history": acc_cb.history if acc_cb else None,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "final_accumulate_grad_batches": trainer.accumulate_grad_batches,
        "handed_over": training_sampler_of(trainer) is data.sampler,  # what the callbacks and the loss read
        # the last epoch's gathered local-backward seconds, [world_size, micro-batches] (NaN: synced backward)
        "backward_s": TimingWindow.concatenate(monitor.epoch_windows).backward_s.tolist(),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, 2)
