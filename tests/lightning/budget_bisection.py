"""The token budget probe on a real CPU run of a small demo transformer under a memory limit, in a process of its own
(peak resident memory is a whole process's: allocations left by earlier work in the same process would move it).

Run by ``tests/lightning/test_budget.py``: ``python budget_bisection.py TMP_DIR`` prints one JSON line with the probe's
budget, the bisection's optimum over the same measurements, the probe's budget inside ``Trainer.fit``, the epoch's
peak resident memory and the limit.
"""

import json
import re
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.budget import TokenBudget, TokenBudgetProbe

LENGTHS = np.load(__import__("lit_balance").__path__[0] + "/data/lengths/lengths_fortunes.npy")


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


def _hwm() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmHWM:\s+(\d+)", handle.read()).group(1)) * 1024


class _EpochPeak(L.Callback):
    """Peak resident set size of the process over the training epoch (VmHWM reset at its start)."""

    def on_train_epoch_start(self, trainer, pl_module):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def on_train_epoch_end(self, trainer, pl_module):
        self.peak = _hwm()


def run(tmp_path: Path) -> dict:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 8000, size=int(n)) for n in LENGTHS[:400]]

    def make_dm(max_tokens="auto", limit=None):
        return BalancedTextDataModule(docs, max_tokens=max_tokens, memory_limit=limit, max_length=128,
                                      val_fraction=0, vocab_size=8000, cache_dir=tmp_path / "cache", seed=3)

    torch.manual_seed(0)
    model = DemoTransformerLM(8000, d_model=64, num_heads=2, num_layers=2, dim_feedforward=256)
    dm = make_dm(limit=1)
    dm.prepare_data()
    dm.setup("fit")
    limit = _rss() + 400 * 2**20  # the process as it is, and 400 MiB more
    probe = TokenBudgetProbe(model, **dm.probe_inputs(), memory_limit=limit)  # the layout; its budget is not read
    chosen = TokenBudget.measure(probe).max_tokens

    def fits(budget):
        return all(probe.measure(budget, shape).status == "ok" for shape in probe.shapes)

    with probe.probing():  # bisection on the same measurements: the largest budget that measures under target
        # bracketed from below, as the probe goes: passes far above the limit leave retained memory behind them
        lo, hi = probe.min_budget, min(probe.max_budget, 2 * chosen)
        floor_fits = fits(lo)
        if fits(hi):
            lo = hi
        while hi - lo > max(1, lo // 200):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    log = "\n".join(f"{m.budget} {m.shape} {m.slots} {m.peak_bytes >> 20} MiB {m.status}" for m in probe.measurements)

    # the same probe inside Trainer.fit, then a whole epoch at its budget
    dm = make_dm(limit=limit)
    peak = _EpochPeak()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[peak])
    trainer.fit(model, datamodule=dm)
    budget = dm.token_budget
    return {"chosen": chosen, "optimum": lo, "floor_fits": floor_fits, "min_budget": probe.min_budget,
            "target_mib": probe.target >> 20, "log": log, "fit_max_tokens": budget.max_tokens,
            "fit_per_rank": list(budget.per_rank), "sampler_max_tokens": dm.train_sampler.settings.max_tokens,
            "completed": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
            "micro_batches": len(dm.train_sampler), "peak": peak.peak, "limit": limit,
            "probe_seconds": budget.probe_seconds}


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]))))
