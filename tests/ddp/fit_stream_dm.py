"""A stream of JSONL files as the corpus of BalancedTextDataModule, fitted as users start it: this script with
``Trainer(devices=N, strategy="ddp")``, whose launcher starts it again for every other rank (nothing forks here).

Run: python tests/ddp/fit_stream_dm.py DATA_DIR OUT_DIR PHASE DEVICES LAYOUT
  PHASE ``stop``: trains until optimizer step 3 (a checkpoint there, OUT_DIR/mid.ckpt, from the DataModule's state) and
  two more steps, then stops (max_steps); ``resume``: resumes from OUT_DIR/mid.ckpt to the stream's end.
  LAYOUT: ``padded`` or ``packed``.
Each rank writes OUT_DIR/{PHASE}_rank{r}.json: the micro-batches it trained ([global step, indices, is_fill, padded
slots]), its validation losses, and the global step at the end.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM
from lit_balance.stream import StreamCorpus

VOCAB, STOP_STEP, ACC, MAX_TOKENS, HELD_OUT = 64, 3, 2, 96, 6


class Recorder(L.Callback):
    def __init__(self, out, stop):
        self.out, self.stop, self.batches, self.val = out, stop, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        slots = int(batch["input_ids"].numel())
        self.batches.append([trainer.global_step, batch["indices"].tolist(), batch["is_fill"].tolist(), slots])
        if self.stop and trainer.global_step == STOP_STEP and len(self.batches) == ACC * STOP_STEP:
            trainer.save_checkpoint(self.out / "mid.ckpt")

    def on_validation_epoch_end(self, trainer, pl_module):
        if "val/loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val/loss"]))


def main() -> None:
    data, out, phase, devices, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5]
    corpus = StreamCorpus(str(data / "*.jsonl"))  # the files, read lazily in sorted order
    dm = BalancedTextDataModule(corpus, max_tokens=MAX_TOKENS, vocab_size=VOCAB, pad_token_id=0, window_documents=20,
                                val_documents=HELD_OUT, packing=layout == "packed", max_length=None,
                                cache_dir=out / "cache")
    model = DemoTransformerLM(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    recorder = Recorder(out, stop=phase == "stop")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=[recorder], max_epochs=1, max_steps=STOP_STEP + 2 if phase == "stop" else -1,
                        accumulate_grad_batches=ACC, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps(
        {"batches": recorder.batches, "val": recorder.val, "global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
