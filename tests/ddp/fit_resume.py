"""Stop a 2-rank CPU fit mid-epoch with a checkpoint, or resume it; record every training batch per rank.

Run: python tests/ddp/fit_resume.py OUT_DIR stop|resume|resume_fail DEVICES NUM_WORKERS [ACCUMULATE_GRAD_BATCHES]
``stop`` trains epoch 0 up to STOP_AT micro-batches, saves OUT_DIR/mid.ckpt from on_train_batch_end (with
accumulation 2, inside an optimizer step's window), then fails: training_step raises at the next micro-batch on
every rank and OnExceptionCheckpoint saves OUT_DIR/fail.ckpt;
``resume`` (from mid.ckpt) and ``resume_fail`` (from fail.ckpt) continue with Trainer.fit(ckpt_path=...) to the
end of epoch 1.
Each rank writes OUT_DIR/{phase}_rank{r}.json with the batches it trained on (on_train_batch_end), those
training_step started on, each batch's step_supervised_tokens, and its plans.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 3


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.epochs, self.step_tokens = out, stop, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs.setdefault(trainer.current_epoch, []).append(batch["indices"].tolist())
        self.step_tokens.setdefault(trainer.current_epoch, {})[batch_idx] = int(batch["step_supervised_tokens"])
        if self.stop and trainer.current_epoch == 0 and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


class FailingLM(DemoTransformerLM):
    fail, started = False, None  # set on the instance, not hyperparameters

    def training_step(self, batch, batch_idx):
        self.started.setdefault(self.current_epoch, []).append(batch["indices"].tolist())
        if self.fail and self.current_epoch == 0 and batch_idx == STOP_AT:
            raise RuntimeError("simulated failure inside training_step")
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, phase, devices, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    accumulate = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    lengths = np.load(Path(__file__).resolve().parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")[:301]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=min(int(n), 48)) for n in lengths]
    dm = BalancedTextDataModule(docs, max_tokens=256, max_length=None, val_fraction=0.0, num_workers=workers,
                                cache_dir=out / "cache", seed=7)
    model = FailingLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    model.fail, model.started = phase == "stop", {}
    rec = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=120)) if devices > 1 else "auto"
    callbacks = [rec, OnExceptionCheckpoint(out, filename="fail")] if phase == "stop" else [rec]
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks, max_epochs=2,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=phase == "stop",
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    ckpt = {"resume": out / "mid.ckpt", "resume_fail": out / "fail.ckpt"}.get(phase)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    except RuntimeError:
        if phase != "stop":
            raise
    sampler = dm.train_sampler
    plans = {}
    for e in (0, 1):
        p = sampler.plan(e) if e > 0 else None
        plans[e] = None if p is None else [[p.batch(int(b))[0].tolist() for b in p.assignment[:, r]]
                                           for r in range(trainer.world_size)]
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "epochs": rec.epochs, "started": model.started, "plans": plans, "num_train": len(dm.train_dataset),
        "len": len(sampler), "step_tokens": rec.step_tokens,
    }))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
