"""Fit on 2 CPU ranks from a Megatron store in which one document, read by rank 1 only, holds an id beyond the
vocabulary.

Run: python tests/ddp/fit_bad_store.py OUT_DIR STORE_PREFIX NUM_WORKERS
Each rank writes OUT_DIR/rank{r}.json: ``error``, the error it stopped with (type and message, or "finished"), and
``time``, when it left ``trainer.fit`` (``time.time()``).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.data.stores import MegatronSource
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)

VOCAB, MAX_TOKENS, SEED = 500, 128, 11  # as test_store_errors_ddp.py
PG_TIMEOUT_S = 40


def datamodule(prefix: str, workers: int = 0) -> BalancedTextDataModule:
    return BalancedTextDataModule(MegatronSource(prefix), vocab_size=VOCAB, pad_token_id=0, max_tokens=MAX_TOKENS,
                                  max_length=None, val_fraction=0.0, num_workers=workers, seed=SEED)


def main() -> None:
    out, prefix, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    dm = datamodule(prefix, workers)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=PG_TIMEOUT_S)),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=dm)
    except BaseException as exc:
        (out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                                          "time": time.time()}))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps({"error": "finished", "time": time.time()}))


if __name__ == "__main__":
    run_as_ranks(main, 2)
