"""The sampler's world: defaults never hand every rank the whole epoch of a distributed run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lit_balance.sampler.sampler import BalancedBatchSampler

LENGTHS = np.random.default_rng(0).integers(1, 300, 120)

#: Variables of the launchers the check reads, cleared before each case.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_SIZE",
                    "PMI_SIZE")

DISTRIBUTED = {
    "torchrun": {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    # what Lightning's DDP launcher sets for the processes it starts (and in its own before fit's setup)
    "lightning": {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29500"},
    "srun": {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"},
    "mpirun": {"OMPI_COMM_WORLD_SIZE": "2"},
}

NOT_DISTRIBUTED = {
    "plain": {},
    "one process": {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
    "sbatch script without srun": {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
    "interactive srun shell": {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"},
    "unreadable": {"WORLD_SIZE": "two"},
}


def _environment(monkeypatch, values):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("launcher", sorted(DISTRIBUTED))
def test_defaults_in_a_distributed_environment_before_the_process_group_raise(monkeypatch, launcher):
    _environment(monkeypatch, DISTRIBUTED[launcher])
    with pytest.raises(RuntimeError, match=r"no torch.distributed process group .*num_replicas.*rank") as error:
        BalancedBatchSampler(LENGTHS, 512)
    message = str(error.value)
    assert "distributed_sampler_kwargs" in message and "process_group=" in message and "setup()" in message
    assert "BalancedTextDataModule" in message
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        BalancedBatchSampler(LENGTHS, 512, num_replicas=2)  # rank left to the default
    # explicit values always win: no look at the environment
    sampler = BalancedBatchSampler(LENGTHS, 512, num_replicas=2, rank=1)
    assert (sampler.num_replicas, sampler.rank) == (2, 1) and len(list(sampler)) == len(sampler)


@pytest.mark.parametrize("case", sorted(NOT_DISTRIBUTED))
def test_defaults_outside_a_distributed_run_are_one_replica(monkeypatch, case):
    _environment(monkeypatch, NOT_DISTRIBUTED[case])
    sampler = BalancedBatchSampler(LENGTHS, 512)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sorted(i for b in sampler for i in b) == list(range(LENGTHS.size))


WORKER = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    import numpy as np
    import torch.distributed as dist
    from lit_balance.sampler.sampler import BalancedBatchSampler

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    lengths = np.random.default_rng(0).integers(1, 300, 120)
    early = BalancedBatchSampler(lengths, 512)  # built before the process group, e.g. in a parent process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    result = {"early_world": [early.num_replicas, early.rank]}
    try:
        result["early_yielded"] = len(list(early))
    except RuntimeError as error:
        result["early_error"] = str(error)
    late = BalancedBatchSampler(lengths, 512)  # built after: the process group's world
    result["late_world"] = [late.num_replicas, late.rank]
    result["late"] = sorted(i for b in late for i in b)
    alone = BalancedBatchSampler(lengths, 512, num_replicas=1, rank=0)  # explicit: e.g. one rank evaluates all
    result["alone"] = len(sorted(i for b in alone for i in b))
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ddp
def test_a_sampler_whose_world_differs_from_the_process_group_raises_on_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, result in enumerate(ranks):
        assert result["early_world"] == [1, 0]
        assert "early_yielded" not in result, f"rank {r} yielded the whole epoch ({result['early_yielded']} batches)"
        message = result["early_error"]
        assert "world size 2" in message and f"rank {r}" in message and "num_replicas=1" in message, message
        assert result["late_world"] == [2, r]
        assert result["alone"] == LENGTHS.size
    assert sorted(ranks[0]["late"] + ranks[1]["late"]) == list(range(LENGTHS.size))
