"""max_tokens="auto", then real training at the chosen budget, in a process of its own: does the process's peak
resident memory stay under the memory limit?

Run: python tests/lightning/budget_limit.py TMP_DIR ROOM_MIB SEED [SEED ...]. The seeds run one after the other in
this process, each a fresh model, DataModule and Trainer; the limit is the process's resident size just before each
``Trainer.fit`` and ROOM_MIB more. One JSON line per seed: the budget, the limit, the peak resident memory of the
training after the probe (forward, backward, AdamW steps, the real loader; VmHWM reset when the first epoch starts), and
the steps trained.
"""

import ctypes
import gc
import json
import re
import sys
from pathlib import Path

import lightning as L
import numpy as np

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

LENGTHS = np.load(Path(__import__("lit_balance").__path__[0]) / "data" / "lengths" / "lengths_fortunes.npy")


def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"{key}:\s+(\d+)", handle.read()).group(1)) * 1024


class TrainingPeak(L.Callback):
    """Peak resident memory from the first training epoch's start (after the probe) to the end of training."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.start_rss = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")

    def on_train_end(self, trainer, pl_module):
        self.peak = _status("VmHWM")


def main(tmp: Path, room_mib: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 8000, size=int(n)) for n in LENGTHS[rng.permutation(LENGTHS.size)[:1500]]]
    L.seed_everything(seed)
    model = DemoTransformerLM(8000, d_model=64, num_heads=2, num_layers=2, dim_feedforward=256)
    limit = _status("VmRSS") + room_mib * 2**20
    dm = BalancedTextDataModule(docs, max_tokens="auto", memory_limit=limit, max_length=128, val_fraction=0,
                                vocab_size=8000, cache_dir=tmp / "cache", seed=seed)
    peak = TrainingPeak()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, max_steps=25, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[peak])
    trainer.fit(model, datamodule=dm)
    return {"max_tokens": dm.token_budget.max_tokens, "limit": limit, "peak": peak.peak,
            "target": int(dm.token_budget.memory_fraction * limit), "steps": trainer.global_step,
            "probe_seconds": dm.token_budget.probe_seconds, "start_rss": peak.start_rss,
            "probe_peaks": [m.peak_bytes for m in dm.token_budget.measurements]}


if __name__ == "__main__":
    for seed in sys.argv[3:]:
        print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(seed))), flush=True)
        gc.collect()  # the next seed's limit starts from what this process then holds
        ctypes.CDLL("libc.so.6").malloc_trim(0)
