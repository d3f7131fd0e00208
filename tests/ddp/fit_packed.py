"""Fit the demo LM on packed micro-batches, 2 CPU ranks (gloo), with the monitors; record what each rank saw.

Run: python tests/ddp/fit_packed.py OUT_DIR CACHE_DIR MODE
MODE "fixed": BalancedTextDataModule(packing=True), Trainer(accumulate_grad_batches=2) (plan loss divisor),
PaddingRatioMonitor, StragglerMonitor and CostModelFeedback, 2 epochs.
MODE "adaptive": the same with AdaptiveGradAccumulation (all-reduce loss divisor) instead of a fixed value.
Each rank writes OUT_DIR/rank{r}.json.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.callbacks import (AdaptiveGradAccumulation, CostModelFeedback, PaddingRatioMonitor, StragglerMonitor,
                                   TimingWindow)
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)


class Model(DemoTransformerLM):
    def __init__(self, vocab_size):
        super().__init__(vocab_size=vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32, lr=3e-3)
        # per training micro-batch: [epoch, rows, N, documents, real tokens, padded slots, sum l, sum l^2]
        self.seen = []
        self.indices = {}  # epoch -> dataset indices of real (non-fill) documents seen on this rank
        self.step_losses = []
        self.modes = []
        self.epoch_cost_models = []  # the training sampler's cost model at each epoch's start

    def on_train_epoch_start(self):
        self.epoch_cost_models.append(self.trainer.train_dataloader.sampler.cost_model.to_dict())

    def training_step(self, batch, batch_idx):
        assert "attention_mask" not in batch
        epoch = self.current_epoch
        lengths = (batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).double()
        self.seen.append([epoch, batch["input_ids"].shape[0], batch["input_ids"].shape[1], len(batch["indices"]),
                          batch["num_real_tokens"], batch["num_padded_tokens"], float(lengths.sum()),
                          float((lengths ** 2).sum())])
        self.indices.setdefault(epoch, []).extend(batch["indices"][~batch["is_fill"]].tolist())
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        mode = self.step_loss.mode
        super().on_before_optimizer_step(optimizer)
        self.modes.append(mode)
        self.step_losses.append(float(self.trainer.callback_metrics["train/loss"]))


def main():
    out, cache, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    # learnable documents: each counts up from a random start by its own stride (1 to 3), modulo the vocabulary
    corpus = [((rng.integers(0, 63) + rng.integers(1, 4) * np.arange(int(n))) % 63 + 1).tolist()
              for n in rng.integers(1, 60, size=300)]
    dm = BalancedTextDataModule(corpus, max_tokens=256, max_length=None, val_fraction=0.1, packing=True, seed=1,
                                cache_dir=cache)
    adaptive = mode == "adaptive"
    padding, straggler = PaddingRatioMonitor(log_every_n_micro_batches=4), StragglerMonitor(log_every_n_micro_batches=4)
    callbacks = [padding, straggler]
    if adaptive:
        callbacks.append(AdaptiveGradAccumulation(target_tokens_per_step=1500))
    else:
        feedback = CostModelFeedback(min_samples=4)
        callbacks.append(feedback)
    model = Model(dm.vocab_size)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=callbacks, max_epochs=2, accumulate_grad_batches=1 if adaptive else 2,
                        reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    record = {
        "seen": model.seen, "indices": {str(k): v for k, v in model.indices.items()},
        "num_train": len(dm.train_dataset), "len_sampler": len(dm.train_sampler), "modes": model.modes,
        "step_losses": model.step_losses, "corrected_steps": model.step_loss.num_corrected_steps,
        "padding_metrics": padding.last_metrics,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "cost_fit": None if adaptive or feedback.last_fit is None else feedback.last_fit[0].to_dict(),
        "cost_column": TimingWindow.concatenate(straggler.epoch_windows).cost.tolist(),
        "epoch_cost_models": model.epoch_cost_models,
        "rows_column": TimingWindow.concatenate(straggler.epoch_windows).rows.tolist(),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, 2)
