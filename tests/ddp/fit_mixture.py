"""Train on a mixture of three components (a Megatron store, an Arrow file, a JSONL file) on CPU ranks: stop
mid-epoch with a checkpoint, or resume from it, or run the epoch uninterrupted.

Run: python tests/ddp/fit_mixture.py OUT_DIR DATA_DIR stop|resume|full DEVICES [LAYOUT]
LAYOUT (default padded): padded, packed, static_packed or padded_shapes (the batching keywords of LAYOUTS).
DATA_DIR holds ``megatron`` (.bin/.idx prefix), ``docs.arrow`` and ``docs.jsonl`` (test_mixture_ddp.py writes them).
``stop`` trains epoch 0 up to STOP_AT micro-batches per rank, saves OUT_DIR/mid.ckpt, then raises at the next
training_step; ``resume`` continues epoch 0 from mid.ckpt on DEVICES ranks; ``full`` runs epoch 0 uninterrupted.
Each rank writes OUT_DIR/{phase}_rank{r}.json: per trained micro-batch, each real row's (component, document index in
the component's training split), the metrics logged at the end, and (rank 0) every MixtureMonitor figure it logged.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.callbacks import MixtureMonitor
from lit_balance.data.stores import ArrowSource, MegatronSource
from stopping_lm import StoppingLM  # tests/ddp/stopping_lm.py

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 3
LAYOUTS = {"padded": {}, "packed": {"packing": True}, "static_packed": {"packing": True, "static_packing": True},
           "padded_shapes": {"padded_shapes": 3}}
TOKENIZER = Path(__file__).resolve().parents[2] / "lit_balance/data/tokenizer/tokenizer.json"


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches, self.shapes = out, stop, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dm = trainer.datamodule
        indices = batch["indices"].tolist()
        self.shapes.append(list(batch["input_ids"].shape))
        located = dm.train_sampler.layout.locate(indices).tolist()
        self.batches.append([pair for pair, fill in zip(located, batch["is_fill"].tolist()) if not fill])
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


class ListLogger(Logger):
    """Keeps every MixtureMonitor figure logged (global rank 0), by step."""

    name, version = "list", 0

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        kept = {k: float(v) for k, v in metrics.items() if k.startswith(("train/tokens/", "train/supervised_tokens/"))}
        if kept:
            self.points.append((step, kept))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def main() -> None:
    out, data, phase, devices = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    layout = LAYOUTS[sys.argv[5] if len(sys.argv) > 5 else "padded"]
    mixture = Mixture({"megatron": {"corpus": MegatronSource(str(data / "megatron")), "weight": 0.5},
                       "arrow": {"corpus": ArrowSource(data / "docs.arrow"), "weight": 0.2},
                       "jsonl": {"corpus": data / "docs.jsonl", "weight": 0.3}})
    dm = BalancedTextDataModule(mixture, str(TOKENIZER), max_tokens=160, max_length=40, val_fraction=0.1,
                                num_workers=1, cache_dir=out / "cache", seed=11, **layout)
    model = StoppingLM(dm.vocab_size, stop_at=STOP_AT if phase == "stop" else None)
    recorder = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    logger = ListLogger()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=logger,
                        callbacks=[recorder, MixtureMonitor(log_every_n_steps=1)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": recorder.batches, "metrics": sorted(trainer.logged_metrics),
        "names": list(dm.mixture.names), "val_names": dm.val_names, "logged": logger.points,
        "shapes": recorder.shapes, "budget": dm.train_sampler.settings.rank_max_tokens(devices)[trainer.global_rank],
        "padded_shapes": [list(s) for s in dm.train_sampler.settings.padded_shapes or ()],
    }))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[4]))
