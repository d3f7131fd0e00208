"""Train a two-component mixture for two epochs on CPU ranks, setting new weights from the training itself
(MixtureWeightsHook) in epoch 0; each rank passes other weights, rank 0's hold.

Run: python tests/ddp/fit_online_weights.py OUT_DIR full|stop|resume DEVICES
``stop`` saves OUT_DIR/mid.ckpt after micro-batch STOP_AT - 1 of epoch 1 and raises at the next training_step;
``resume`` continues from it. Each rank writes OUT_DIR/{phase}_rank{r}.json: per trained micro-batch its epoch and
real rows' (component, document, tokens); epoch 1's scheduled shares per step; the hook's edits.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.callbacks import MixtureWeightsHook
from stopping_lm import StoppingLM  # tests/ddp/stopping_lm.py

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 2
SET_AT = 1  # micro-batch of epoch 0 after which the weights are set
SCHEDULE = [[0, {"short": 0.8, "long": 0.2}]]
RANK0_WEIGHTS = {"short": 0.25, "long": 0.75}


def _docs(num, low, high, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, size=int(rng.integers(low, high))).tolist() for _ in range(num)]


class Online(L.Callback):
    """What a user's online-mixing callback does: compute weights (here: fixed, other on every rank) and set them."""

    def __init__(self, hook, out, stop):
        self.hook, self.out, self.stop, self.batches = hook, out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dm = trainer.datamodule
        located = dm.train_sampler.layout.locate(batch["indices"].tolist()).tolist()
        tokens = batch["attention_mask"].sum(dim=1).tolist()
        self.batches.append([int(trainer.current_epoch), [[c, d, t] for (c, d), t, fill in
                                                          zip(located, tokens, batch["is_fill"].tolist()) if not fill]])
        if trainer.current_epoch == 0 and batch_idx == SET_AT:
            weights = RANK0_WEIGHTS if trainer.global_rank == 0 else {"short": 1.0, "long": 0.0}
            self.hook.set_weights(trainer, weights)
        if self.stop and trainer.current_epoch == 1 and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


def main() -> None:
    out, phase, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mixture = Mixture({"short": {"corpus": _docs(120, 4, 20, 0), "weight": 1},
                       "long": {"corpus": _docs(60, 30, 60, 1), "weight": 1}})
    dm = BalancedTextDataModule(mixture, vocab_size=100, pad_token_id=0, max_tokens=192, max_length=64,
                                val_fraction=0.0, num_workers=0, cache_dir=out / "cache", seed=11,
                                weights_schedule=SCHEDULE)
    model = StoppingLM(dm.vocab_size, stop_at=STOP_AT if phase == "stop" else None, stop_epoch=1)
    hook = MixtureWeightsHook()
    online = Online(hook, out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        callbacks=[hook, online], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0,
                        reload_dataloaders_every_n_epochs=1)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    sampler = dm.train_sampler
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": online.batches, "targets_epoch1": sampler.step_targets(1).tolist(),
        "first_step_epoch1": int(sampler.schedule_start(1)[0]), "edits": hook.edits,
        "schedule": sampler.weights_schedule.to_dict()}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
