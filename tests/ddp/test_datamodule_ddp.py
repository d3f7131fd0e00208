"""Real 2-process CPU DDP runs (gloo) of BalancedTextDataModule through Trainer.fit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, > 10 s each

SCRIPT = Path(__file__).with_name("fit_record.py")


@pytest.mark.parametrize(("use_distributed_sampler", "num_workers"), [(False, 0), (True, 2)])
def test_two_rank_fit_covers_each_epoch_once(tmp_path, use_distributed_sampler, num_workers):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(int(use_distributed_sampler)), str(num_workers)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    num_train = ranks[0]["num_train"]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # Lightning kept our sampler under both settings of use_distributed_sampler
    assert [r["sampler_type"] for r in ranks] == ["BalancedBatchSampler"] * 2
    for epoch in ("0", "1"):
        per_rank = [r["epochs"][epoch] for r in ranks]
        # both ranks took the same number of steps, the sampler's length
        assert len(per_rank[0]) == len(per_rank[1]) == ranks[0]["len"] > 1
        # set_epoch reached the sampler: each rank trained exactly on its column of that epoch's plan
        for r, rank in enumerate(ranks):
            assert [b[0] for b in per_rank[r]] == rank["plans"][epoch]
            assert all(b[2] <= 256 for b in per_rank[r])
        real = [[i for b in rb for i, f in zip(b[0], b[1]) if not f] for rb in per_rank]
        # disjoint within the epoch, together covering it
        assert not set(real[0]) & set(real[1])
        assert sorted(real[0] + real[1]) == list(range(num_train))
    # epoch 1 differs from epoch 0
    for rank in ranks:
        assert rank["epochs"]["0"] != rank["epochs"]["1"]
