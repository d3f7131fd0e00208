"""The data-parallel world of a Fabric run on 2 CPU processes (gloo): DDP, or tensor parallel (dp=1 × tp=2).

Run: python tests/ddp/fabric_world.py OUT_DIR MODE   (MODE "ddp" or "tp"); each process writes OUT_DIR/rank{r}.json.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from lit_balance import BalancedBatchSampler
from lit_balance.world import data_parallel_world

from launch import run_as_ranks  # launch.py (the repository root)

LENGTHS = np.random.default_rng(0).integers(1, 300, 80)


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "ddp":
        strategy = DDPStrategy(timeout=timedelta(seconds=120))
    else:
        strategy = ModelParallelStrategy(lambda model, mesh: model, data_parallel_size=1, tensor_parallel_size=2,
                                         timeout=timedelta(seconds=120))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    world = data_parallel_world(fabric)
    me = torch.tensor([float(fabric.global_rank + 1)])
    sampler = BalancedBatchSampler(LENGTHS, 512, num_replicas=world.num_replicas, rank=world.rank, seed=2)
    record = {"world": [world.rank, world.num_replicas], "gathered": world.all_gather(me).reshape(-1).tolist(),
              "summed": float(world.all_reduce_sum(me)), "broadcast": float(world.broadcast(me, src=0)),
              "indices": [list(map(int, b)) for b in sampler]}
    fabric.barrier()
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, 2)
