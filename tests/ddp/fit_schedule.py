"""Train a mixture of two components under a weight schedule on CPU ranks: stop mid-epoch with a checkpoint, resume
from it on another number of ranks, or run the epoch uninterrupted.

Run: python tests/ddp/fit_schedule.py OUT_DIR stop|resume|full DEVICES
``stop`` trains epoch 0 up to STOP_AT micro-batches per rank (before the schedule's transition at TRANSITION), saves
OUT_DIR/mid.ckpt, then raises at the next training_step; ``resume`` continues epoch 0 from mid.ckpt on DEVICES ranks,
across the transition; ``full`` runs epoch 0 uninterrupted. Each rank writes OUT_DIR/{phase}_rank{r}.json: per trained
micro-batch (one per optimizer step), each real row's (component, document, tokens), and the steps' scheduled shares.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule, Mixture
from stopping_lm import StoppingLM  # tests/ddp/stopping_lm.py

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 3
TRANSITION = 5
SCHEDULE = {"points": [[0, {"short": 0.8, "long": 0.2}], [TRANSITION, {"short": 0.3, "long": 0.7}]]}


def _docs(num, low, high, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, size=int(rng.integers(low, high))).tolist() for _ in range(num)]


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches = out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dm = trainer.datamodule
        indices = batch["indices"].tolist()
        located = dm.train_sampler.layout.locate(indices).tolist()
        tokens = batch["attention_mask"].sum(dim=1).tolist()
        self.batches.append([[c, d, t] for (c, d), t, fill in zip(located, tokens, batch["is_fill"].tolist())
                             if not fill])
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


def main() -> None:
    out, phase, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mixture = Mixture({"short": {"corpus": _docs(120, 4, 20, 0), "weight": 1},
                       "long": {"corpus": _docs(60, 30, 60, 1), "weight": 1}})
    dm = BalancedTextDataModule(mixture, vocab_size=100, pad_token_id=0, max_tokens=192, max_length=64,
                                val_fraction=0.0, num_workers=0, cache_dir=out / "cache", seed=11,
                                weights_schedule=SCHEDULE)
    model = StoppingLM(dm.vocab_size, stop_at=STOP_AT if phase == "stop" else None)
    recorder = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        callbacks=[recorder], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    targets = dm.train_sampler.step_targets()
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": recorder.batches, "targets": targets.tolist(),
        "first_step": dm.train_sampler.schedule_start(0)[0]}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
