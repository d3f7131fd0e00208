"""Fit on 2 CPU ranks whose corpora differ (rank 1's lacks one document, as with a stale per-node copy).

Run: python tests/ddp/fit_disagree.py OUT_DIR
Each rank tokenizes into its own cache (OUT_DIR/cache{rank}) and writes OUT_DIR/rank{r}.txt: the error it
stopped with (type and message), or "finished" when its fit ended without one.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from launch import run_as_ranks  # launch.py (the repository root)


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set for each rank by run_as_ranks
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 48, 60)]
    if rank == 1:
        docs = docs[:17] + docs[18:]
    dm = BalancedTextDataModule(docs, max_tokens=256, max_length=None, val_fraction=0.1,
                                cache_dir=out / f"cache{rank}", seed=7)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(model, datamodule=dm)
    except BaseException as exc:
        (out / f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    (out / f"rank{rank}.txt").write_text("finished")


if __name__ == "__main__":
    run_as_ranks(main, 2)
