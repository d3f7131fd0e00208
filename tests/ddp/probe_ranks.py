"""The token budget probe alone on 2 CPU processes over gloo (no Trainer): do ranks of equal devices share a budget?

Run: python tests/ddp/probe_ranks.py OUT_DIR MODE, MODE ``cpu`` (both ranks measure their peak resident memory under
the same memory limit), ``scripted`` (a scripted meter: ``a + b * slots`` bytes, rank 1's capacity twice rank 0's) or
``collective`` (scripted, capacities 2000 and 300 MiB, and a ``torch.distributed.all_reduce`` inside ``training_step``).
Each rank writes OUT_DIR/rank{r}.json: the budget (``TokenBudget.to_dict``), the ``max_tokens`` the plan uses and the
passes its ``training_step`` ran.
"""

import json
import os
import re
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.budget import AutoTokenBudget
from lit_balance.world import data_parallel_world

MIB = 2**20


class RecordingLM(DemoTransformerLM):
    """The demo model, remembering the token slots of its last micro-batch (what the scripted meter reads)."""

    last_slots = 0
    passes = 0
    reduce = False  # all_reduce the loss in training_step (a collective every rank must reach)

    def training_step(self, batch, batch_idx):
        self.last_slots = int(batch["input_ids"].numel())
        self.passes += 1
        loss = super().training_step(batch, batch_idx)
        if self.reduce:
            dist.all_reduce(loss.detach().clone())
        return loss


class ScriptedMeter:
    """``100 MiB + 100 KiB per token slot`` of the model's last micro-batch, against ``capacity`` bytes."""

    device_kind = "cpu"

    def __init__(self, model: RecordingLM, capacity: int) -> None:
        self.model, self.capacity = model, capacity

    def reset(self) -> None:
        self.model.last_slots = 0

    def peak(self) -> int:
        return 100 * MIB + 100 * 1024 * self.model.last_slots


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


def worker(rank: int, out: Path, mode: str) -> None:
    # a collective of one rank left waiting fails after this timeout instead of hanging
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60 if mode == "collective"
                                                                                 else 120))
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=int(n)) for n in rng.integers(20, 120, 600)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", max_length=None, val_fraction=0, vocab_size=500,
                                cache_dir=out / "cache", seed=3)
    if rank == 0:
        dm.prepare_data()
    dist.barrier()
    dm.setup("fit")
    torch.manual_seed(0)
    model = RecordingLM(500, d_model=32, num_heads=2, num_layers=1, dim_feedforward=64)
    world = data_parallel_world()
    if mode == "cpu":  # the same limit on both ranks: the larger process, and 200 MiB more
        limit = int(world.all_gather(torch.tensor([float(_rss())])).max()) + 200 * MIB
        auto = AutoTokenBudget(memory_limit=limit)
    elif mode == "collective":
        model.reduce = True
        auto = AutoTokenBudget(meter=ScriptedMeter(model, (2000, 300)[rank] * MIB))
    else:
        auto = AutoTokenBudget(meter=ScriptedMeter(model, 2**30 * (1 + rank)))
    budget = auto.probe(model, world=world, **dm.probe_inputs())
    planned = budget.plan_max_tokens(world.num_replicas)
    record = {"token_budget": budget.to_dict(), "planned": planned, "line": budget.describe(world.num_replicas),
              "passes": model.passes}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # forked from this already-imported process: two processes of their own, without importing torch again
    mp.start_processes(worker, args=(Path(sys.argv[1]), sys.argv[2]), nprocs=2, start_method="fork")
