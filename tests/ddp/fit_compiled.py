"""Fit the demo LM compiled as Lightning documents (``torch.compile(model, dynamic=False)`` handed to
``Trainer.fit``) on 2 CPU ranks (gloo), counting the graphs compiled with a ``CompileCounter`` backend.

Run: python tests/ddp/fit_compiled.py OUT_DIR CACHE_DIR LAYOUT
LAYOUT "static": packing=True, static_packing=True (every micro-batch [1, max_tokens]); "shapesK": padded_shapes=K;
"free": padded micro-batches of free shapes. 2 epochs with a validation epoch after each, plan loss divisor
(accumulate_grad_batches=2), dynamo's recompile limit raised from 8 to 64 so that every shape met compiles. Each rank
writes OUT_DIR/rank{r}.json: the counter's frames after each training micro-batch (with its epoch and input shape), at each validation epoch's end and at the end, the validation input
shapes, the declared shapes, the graph breaks dynamo counted, the validation loss and the loss divisor's path.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

LAYOUTS = {"static": {"packing": True, "static_packing": True}, "free": {}}


def layout(name):
    return LAYOUTS[name] if name in LAYOUTS else {"padded_shapes": int(name.removeprefix("shapes"))}


class Record(L.Callback):
    """The counter's frames after every training micro-batch and validation epoch (hooks run outside the graph)."""

    def __init__(self, counter):
        self.counter, self.train, self.val, self.shapes = counter, [], [], set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append([trainer.current_epoch, self.counter.frame_count, *batch["input_ids"].shape])

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.shapes.add(tuple(batch["input_ids"].shape))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val.append(self.counter.frame_count)


def main():
    out, cache, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    corpus = [((rng.integers(0, 63) + rng.integers(1, 4) * np.arange(int(n))) % 63 + 1).tolist()
              for n in rng.integers(1, 60, size=240)]
    dm = BalancedTextDataModule(corpus, max_tokens=256, max_length=None, val_fraction=0.1, seed=1, cache_dir=cache,
                                **layout(name))
    model = DemoTransformerLM(dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32, lr=3e-3,
                              packed_attention="sdpa_mask")
    torch._dynamo.config.recompile_limit = 64  # every shape met compiles: the count is the graphs a compiler keeps
    counter = CompileCounter()
    record = Record(counter)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=[record], max_epochs=2, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(torch.compile(model, dynamic=False, backend=counter), datamodule=dm)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "train_frames": record.train, "val_frames": record.val, "frames": counter.frame_count,
        "val_shapes": sorted(record.shapes),
        "declared": [list(s) for s in dm.train_sampler.settings.padded_shapes or []],
        "recompile_limit_hits": sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k),
        "graph_breaks": sum(counters["graph_break"].values()),
        "val_loss": float(trainer.callback_metrics["val/loss"]), "mode": model.step_loss.mode}))


if __name__ == "__main__":
    run_as_ranks(main, 2)
