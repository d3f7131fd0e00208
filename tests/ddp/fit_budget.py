"""Fit on 2 CPU ranks with max_tokens="auto", rank 1's model running out of memory above a micro-batch size.

Run: python tests/ddp/fit_budget.py OUT_DIR OOM_ABOVE
Rank 1's training_step raises torch.OutOfMemoryError on micro-batches of more than OOM_ABOVE token slots (0: every
one), as a smaller device would; with OOM_ABOVE -1 it returns None instead of the loss (the probe cannot
measure). Each rank writes OUT_DIR/rank{r}.json: the token budget it trained with, the largest
training micro-batch it ran and the micro-batches it ran, or the error it stopped with.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)


class SmallDeviceLM(DemoTransformerLM):
    """The demo model; on rank 1, out of memory on micro-batches of more than ``oom_above`` token slots."""

    def __init__(self, *args, oom_above: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.oom_above = oom_above
        self.largest_trained = 0
        self.trained = 0

    def training_step(self, batch, batch_idx):
        slots = int(batch["input_ids"].numel())
        if self.global_rank == 1 and self.oom_above < 0:
            return None
        if self.global_rank == 1 and slots > self.oom_above:
            raise torch.OutOfMemoryError(f"simulated: {slots} token slots on rank 1")
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx):  # the training loop's micro-batches only, not the probe's
        self.largest_trained = max(self.largest_trained, int(batch["input_ids"].numel()))
        self.trained += 1


def main() -> None:
    out, oom_above = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 48, 80)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", memory_limit=8 * 2**30, max_length=None, val_fraction=0.1,
                                cache_dir=out / "cache", seed=7)
    model = SmallDeviceLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32,
                          oom_above=oom_above)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    record = {}
    try:
        trainer.fit(model, datamodule=dm)
        record = {"token_budget": dm.token_budget.to_dict(), "max_tokens": dm.max_tokens,
                  "sampler_max_tokens": dm.train_sampler.settings.max_tokens,
                  "largest_trained": model.largest_trained, "trained": model.trained,
                  "micro_batches": len(dm.train_sampler)}
    except BaseException as exc:
        record = {"error": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, 2)
