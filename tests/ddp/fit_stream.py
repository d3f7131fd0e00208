"""A Lightning DDP fit from a stream (StreamBatches through StreamLoader): to the stream's end with no len(), or
stopped by a checkpoint at an optimizer step and resumed from it on another number of ranks.

Run: python tests/ddp/fit_stream.py OUT_DIR PHASE DEVICES   (PHASE: full | stop | resume; forked into DEVICES ranks)
Each rank writes OUT_DIR/{PHASE}_rank{r}.json: the micro-batches it trained ([global step, indices, is_fill]).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BatchingSettings
from lit_balance.demo import DemoTransformerLM
from lit_balance.stream import StreamBatches, StreamCorpus, StreamLoader
from lit_balance.world import data_parallel_world

from launch import run_as_ranks  # launch.py (the repository root)

NUM_DOCUMENTS, VOCAB, STOP_STEP = 150, 64, 3


def documents():
    rng = np.random.default_rng(5)
    for _ in range(NUM_DOCUMENTS):
        yield rng.integers(1, VOCAB, int(rng.integers(2, 40)))


class StreamData(L.LightningDataModule):
    def train_dataloader(self):
        world = data_parallel_world(self.trainer)
        batches = StreamBatches(StreamCorpus(documents), BatchingSettings(max_tokens=96, accumulate_grad_batches=2),
                                window_documents=24, num_replicas=world.num_replicas, rank=world.rank)
        return StreamLoader(batches, trainer=self.trainer)


class Recorder(L.Callback):
    def __init__(self, out, stop):
        self.out, self.stop, self.batches = out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append([trainer.global_step, batch["indices"].tolist(), batch["is_fill"].tolist()])
        if self.stop and trainer.global_step == STOP_STEP and len(self.batches) == 2 * STOP_STEP:
            trainer.save_checkpoint(self.out / "mid.ckpt")


def main() -> None:
    out, phase, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    model = DemoTransformerLM(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    recorder = Recorder(out, stop=phase == "stop")
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[recorder],
                        max_epochs=1, max_steps=STOP_STEP + 2 if phase == "stop" else -1, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=StreamData(), ckpt_path=out / "mid.ckpt" if phase == "resume" else None)
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({"batches": recorder.batches,
                                                                            "global_step": trainer.global_step}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[3]))
