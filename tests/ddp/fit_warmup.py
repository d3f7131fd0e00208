"""A 2-rank CPU fit under a length warm-up (``max_length_schedule``): uninterrupted, stopped mid-stage with a
checkpoint, or resumed from it on another number of ranks; every rank records the pieces it trained.

Run: python tests/ddp/fit_warmup.py OUT_DIR full|stop|resume DEVICES
``full`` trains epoch 0; ``stop`` saves OUT_DIR/mid.ckpt after STOP_AT micro-batches (an optimizer step's end, inside
the schedule's first stage) and stops; ``resume`` continues from OUT_DIR/mid.ckpt to the end of epoch 0. Each rank
writes OUT_DIR/{phase}_rank{r}.json: per micro-batch (``batch_idx``), the ``[document, start, length]`` of every real
row. Document ``d``'s token ``i`` is ``i + 1``, so a row's first id names where its piece starts.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 6  # micro-batches: 3 optimizer steps of ACCUMULATE, inside the first stage
ACCUMULATE = 2
SCHEDULE = [[0, 32], [5, 96], [8, 192]]
MAX_TOKENS = 192


def corpus() -> list[np.ndarray]:
    """Documents whose token ``i`` is ``i + 1`` (lengths 1 .. 400, seeded)."""
    lengths = np.random.default_rng(5).integers(1, 400, size=48)
    return [np.arange(1, n + 1) for n in lengths.tolist()]


def datamodule(out: Path) -> BalancedTextDataModule:
    return BalancedTextDataModule(corpus(), max_tokens=MAX_TOKENS, max_length=None, max_length_schedule=SCHEDULE,
                                  val_fraction=0.0, vocab_size=401, seed=3, cache_dir=out / "cache")


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches = out, stop, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = []
        for i, (doc, fill) in enumerate(zip(batch["indices"].tolist(), batch["is_fill"].tolist())):
            n = int(batch["attention_mask"][i].sum())
            if not fill:
                rows.append([doc, int(batch["input_ids"][i, 0]) - 1, n])
        self.batches[batch_idx] = rows
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")
            trainer.should_stop = True


def main() -> None:
    out, phase, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dm = datamodule(out)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=120)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[rec], max_epochs=1,
                        accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": rec.batches, "len": len(dm.train_sampler),
        "lengths": dm.train_dataset.lengths.tolist()}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
