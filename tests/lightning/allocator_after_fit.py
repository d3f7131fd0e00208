"""Fit with max_tokens="auto" on a CPU, then measure what the process keeps of freed tensors (as freed_memory.py).

Run: python tests/lightning/allocator_after_fit.py CACHE_DIR. Prints one JSON line: ``retained`` (resident bytes kept
after freeing 128 MiB of 2 MiB blocks between kept 256 KiB ones, after the fit), ``said`` (log lines of the allocator
setting in that fit) and ``said_off`` (in a second fit with ``cpu_mmap_threshold=None``).
"""

import json
import logging
import re
import sys

import lightning as L
import numpy as np
import torch

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM

from freed_memory import rss


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def fit(cache, **kwargs) -> int:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(4, 40, 60)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", memory_limit=rss() + 2**30, val_fraction=0, max_length=None,
                                cache_dir=cache, **kwargs)
    model = DemoTransformerLM(dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    handler = Lines()
    logging.getLogger("lightning.pytorch").addHandler(handler)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, dm)
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    return sum("mmap threshold" in line for line in handler.lines)


if __name__ == "__main__":
    said = fit(sys.argv[1])
    block = torch.ones(2**21)
    del block  # glibc's own adjustment (when on) raises its threshold past 2 MiB here
    before = rss()
    freed, kept = [], []
    for _ in range(64):
        freed.append(torch.ones(2**19))  # 2 MiB, written
        kept.append(torch.ones(2**16))  # 256 KiB kept between them
    del freed
    retained = rss() - before
    print(json.dumps({"retained": retained, "said": said, "said_off": fit(sys.argv[1], cpu_mmap_threshold=None)}))
