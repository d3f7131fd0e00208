"""Stop a 2-rank CPU fit mid-epoch with a checkpoint, or resume it; record every training batch per rank.

Run: python tests/ddp/fit_resume.py OUT_DIR stop|resume DEVICES NUM_WORKERS [ACCUMULATE_GRAD_BATCHES]
``stop`` trains epoch 0 up to STOP_AT micro-batches, saves OUT_DIR/mid.ckpt from on_train_batch_end and stops
(with accumulation 2, inside an optimizer step's window);
``resume`` continues from it with Trainer.fit(ckpt_path=...) to the end of epoch 1.
Each rank writes OUT_DIR/{phase}_rank{r}.json with the batches it trained on and its plans.
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

STOP_AT = 3


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.epochs, self.step_tokens = out, stop, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs.setdefault(trainer.current_epoch, []).append(batch["indices"].tolist())
        self.step_tokens.setdefault(trainer.current_epoch, {})[batch_idx] = int(batch["step_supervised_tokens"])
        if self.stop and trainer.current_epoch == 0 and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")
            trainer.should_stop = True


def main() -> None:
    out, phase, devices, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    accumulate = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    lengths = np.load(Path(__file__).resolve().parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")[:301]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=min(int(n), 48)) for n in lengths]
    dm = BalancedTextDataModule(docs, max_tokens=256, max_length=None, val_fraction=0.0, num_workers=workers,
                                cache_dir=out / "cache", seed=7)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[rec], max_epochs=2,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    sampler = dm.train_sampler
    plans = {}
    for e in (0, 1):
        p = sampler.plan(e) if e > 0 else None
        plans[e] = None if p is None else [[p.batch(int(b))[0].tolist() for b in p.assignment[:, r]]
                                           for r in range(trainer.world_size)]
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "epochs": rec.epochs, "plans": plans, "num_train": len(dm.train_dataset), "len": len(sampler),
        "step_tokens": rec.step_tokens,
    }))


if __name__ == "__main__":
    main()
