"""Train on a datatrove token store on CPU ranks: uninterrupted, stopped mid-epoch with a checkpoint, or resumed.

Run: python tests/ddp/fit_datatrove.py OUT_DIR full|stop|resume DEVICES NUM_WORKERS STORE_DIR
``full`` trains one epoch; ``stop`` saves OUT_DIR/mid.ckpt after STOP_AT micro-batches (on_train_batch_end) and
ends the fit there; ``resume`` continues from OUT_DIR/mid.ckpt to the end of the epoch. Each rank writes
OUT_DIR/rank<r>.json: per trained micro-batch, its rows' dataset indices and token ids (padding cut), and
``num_train``.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.data.stores.datatrove import DatatroveSource
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 3
MAX_LENGTH = 48


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches = out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = []
        for row, index in enumerate(batch["indices"].tolist()):
            ids = batch["input_ids"][row]
            rows.append([index, ids[batch["attention_mask"][row].bool()].tolist()])
        self.batches.append(rows)
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")
            trainer.should_stop = True


def main() -> None:
    out, phase, devices, workers, store = (Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                           sys.argv[5])
    dm = BalancedTextDataModule(DatatroveSource(store), max_tokens=256, max_length=MAX_LENGTH, val_fraction=0.0,
                                num_workers=workers, seed=7)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[rec], max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": rec.batches, "num_train": len(dm.train_dataset), "world_size": trainer.world_size}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
