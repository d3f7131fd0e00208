"""Train one corpus under a tokens-per-step ramp on CPU ranks, recording each optimizer step's documents, the model's
parameters before it, its gradient and its logged loss.

Run: python tests/ddp/fit_step_tokens.py OUT_DIR LAYOUT DEVICES [PHASE]   (LAYOUT: padded or packed)
PHASE ``full`` (default) runs the epoch; ``stop`` saves OUT_DIR/mid.ckpt at the end of optimizer step STOP_STEPS - 1,
then raises in the next training_step; ``resume`` continues from OUT_DIR/mid.ckpt on DEVICES ranks.
Each rank writes OUT_DIR/rank{r}.json: per micro-batch (global_step, batch_idx, real document indices); rank 0 also
writes OUT_DIR/steps.pt: per optimizer step the parameters before it, the gradient the optimizer stepped with and the
loss StepTokenLoss returned.
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

from lit_balance import BatchingSettings, TokenDataset, TokensPerStepSampler
from lit_balance.callbacks import TokensPerStepAccumulation
from lit_balance.data.collate import collator_for
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

MAX_TOKENS = 64
STOP_STEPS = 3
#: global real tokens per optimizer step: 3 ranks x 64 at step 0 (the resume runs on 3 ranks), 3x that at step 6
RAMP = {"points": [[0, 192], [6, 576]], "interpolation": "linear"}


def corpus():
    rng = np.random.default_rng(4)
    lengths = rng.integers(2, 60, size=90)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(1, 50, size=int(offsets[-1]))
    return lengths, tokens, offsets


class Stopper(L.Callback):
    def __init__(self, out, sampler):
        self.out, self.sampler = out, sampler

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == int(self.sampler.step_bounds()[STOP_STEPS]) - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")
            pl_module.stop_at = batch_idx + 1


class Recording(DemoTransformerLM):
    stop_at = None

    def training_step(self, batch, batch_idx):
        if batch_idx == self.stop_at:
            raise RuntimeError("simulated stop inside training_step")
        return super().training_step(batch, batch_idx)

    def on_train_start(self):
        self.records = []  # (params before the step, grads, loss)
        self.micro = []
        self._before = None

    def on_train_batch_start(self, batch, batch_idx):
        if self._before is None:
            self._before = {k: v.detach().clone() for k, v in self.named_parameters()}
        real = [i for i, f in zip(batch["indices"].tolist(), batch["is_fill"].tolist()) if not f]
        self._current = [int(self.trainer.global_step), batch_idx, real]  # kept once the micro-batch has trained

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.micro.append(self._current)

    def on_before_optimizer_step(self, optimizer):
        loss = self.step_loss.finish_step(self)  # rescales the gradients to the step's token mean
        grads = {k: v.grad.detach().clone() for k, v in self.named_parameters()}
        self.records.append((self._before, grads, float(loss)))
        self._before = None


def main() -> None:
    out, layout, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    phase = sys.argv[4] if len(sys.argv) > 4 else "full"
    torch.manual_seed(0)
    lengths, tokens, offsets = corpus()
    dataset = TokenDataset(tokens, offsets, np.arange(len(lengths)))
    settings = BatchingSettings(max_tokens=MAX_TOKENS, packing=layout == "packed", seed=2)
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    model = Recording(vocab_size=50, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    sampler = TokensPerStepSampler(lengths, settings, RAMP, num_replicas=trainer.world_size, rank=trainer.global_rank)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None,
                        collate_fn=collator_for(settings, pad_token_id=0))
    callback = TokensPerStepAccumulation(sampler)
    trainer.callbacks.append(callback)
    if phase == "stop":
        trainer.callbacks.append(Stopper(out, sampler))
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    plan = sampler.plan()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "micro": model.micro, "history": callback.history, "global_step": int(trainer.global_step),
        "step_micro_batches": plan.step_micro_batches.tolist(), "step_tokens": plan.step_tokens.tolist(),
        "first_step": plan.first_step}))
    if trainer.global_rank == 0 and phase == "full":
        torch.save(model.records, out / "steps.pt")


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
