"""Train from a tokenized store read in place on CPU ranks: stop mid-epoch with a checkpoint, or resume from it.

Run: python tests/ddp/fit_store.py OUT_DIR KIND STORE_PATH stop|resume|full DEVICES
KIND is ``megatron`` (STORE_PATH: the .bin/.idx prefix) or ``datatrove`` (STORE_PATH: the tokenized folder, when
lit_balance.data.stores has a DatatroveSource). ``stop`` trains epoch 0 up to STOP_AT micro-batches per rank, saves
OUT_DIR/mid.ckpt from on_train_batch_end, then raises at the next training_step; ``resume`` continues epoch 0 from
mid.ckpt (on DEVICES ranks, which may differ from the stop's); ``full`` runs epoch 0 uninterrupted.
Each rank writes OUT_DIR/{phase}_rank{r}.json: per trained micro-batch, each row's document index and its token ids.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from stopping_lm import StoppingLM  # tests/ddp/stopping_lm.py

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 3
VOCAB = 500


def source_for(kind: str, path: str):
    import lit_balance.data.stores as stores

    if kind == "megatron":
        return stores.MegatronSource(path)
    if kind == "datatrove":
        return stores.DatatroveSource(path)
    raise SystemExit(f"unknown store kind {kind!r}")


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches = out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = []
        for row, index in enumerate(batch["indices"].tolist()):
            length = int(batch["attention_mask"][row].sum()) if "attention_mask" in batch else None
            rows.append([index, batch["input_ids"][row, :length].tolist()])
        self.batches.append(rows)
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


def main() -> None:
    out, kind, path, phase, devices = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    dm = BalancedTextDataModule(source_for(kind, path), vocab_size=VOCAB, pad_token_id=0, max_tokens=128,
                                max_length=40, val_fraction=0.0, num_workers=1, cache_dir=out / "cache", seed=11)
    model = StoppingLM(dm.vocab_size, stop_at=STOP_AT if phase == "stop" else None)
    recorder = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[recorder], max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": recorder.batches, "num_train": len(dm.train_dataset),
        "cache_written": (out / "cache").exists(),
    }))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[5]))
