"""Real 2-process CPU DDP runs (gloo) of BalancedTextDataModule through Trainer.fit."""

import json
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_record.py")
SETTINGS = [(False, 0), (True, 2)]  # (use_distributed_sampler, num_workers)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both settings, run side by side (each is 2 ranks); returns {setting: out_dir}."""
    outs = {(use_ds, workers): tmp_path_factory.mktemp(f"ds{int(use_ds)}_w{workers}") for use_ds, workers in SETTINGS}
    run_scripts(SCRIPT, {(use_ds, workers): [out, int(use_ds), workers] for (use_ds, workers), out in outs.items()},
                240)
    return outs


@pytest.mark.parametrize(("use_distributed_sampler", "num_workers"), SETTINGS)
def test_two_rank_fit_covers_each_epoch_once(runs, use_distributed_sampler, num_workers):
    tmp_path = runs[use_distributed_sampler, num_workers]
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
