"""A torchrun loop without Lightning on a (dp=2, tp=2) device mesh: the data-parallel world, its collectives, the
sampler's defaults and a metric, over the mesh's ``dp`` dimension.

Run: python -m torch.distributed.run --nproc-per-node 4 tests/ddp/torchrun_world.py OUT_DIR
Each process writes OUT_DIR/rank{r}.json.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lit_balance import BalancedBatchSampler, TokenMeanLoss
from lit_balance.world import data_parallel_world

LENGTHS = np.random.default_rng(0).integers(1, 300, 120)


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = data_parallel_world(mesh=mesh)
    by_group = data_parallel_world(process_group=mesh["dp"].get_group())
    me = torch.tensor([float(dist.get_rank())])
    sampler = BalancedBatchSampler(LENGTHS, 512, process_group=world.process_group, seed=1)
    metric = TokenMeanLoss(process_group=world.process_group)
    metric.update(10.0 * (dist.get_rank() + 1), 2 * (dist.get_rank() + 1))  # a mean loss of 5 over 2 * (g + 1) tokens
    metric.update(float(dist.get_rank()), 1)
    record = {
        "world": [world.rank, world.num_replicas], "by_group": [by_group.rank, by_group.num_replicas],
        "gathered": world.all_gather(me).reshape(-1).tolist(), "summed": float(world.all_reduce_sum(me)),
        "broadcast": float(world.broadcast(me, src=1)), "sampler": [sampler.rank, sampler.num_replicas],
        "indices": [list(map(int, b)) for b in sampler], "metric": float(metric.compute()),
    }
    dist.barrier()
    dist.destroy_process_group()
    (out / f"rank{record['gathered'][world.rank]:.0f}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
