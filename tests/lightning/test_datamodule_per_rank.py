"""BalancedTextDataModule with per-rank budgets (``max_tokens`` a list): each rank's loader, built for its rank of a
2-rank world (a Trainer stand-in, one process), yields batches within its own budget, the same number on both ranks,
every training document once."""

import collections
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule


def _docs(n=60):
    rng = np.random.default_rng(3)
    return [rng.integers(1, 100, size=int(k)) for k in rng.integers(1, 250, n)]


def _rank_batches(tmp_path, rank, **kwargs):
    dm = BalancedTextDataModule(_docs(), max_tokens=[256, 128], max_length=None, val_fraction=0.1, seed=1,
                                cache_dir=tmp_path / "cache", **kwargs)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, accumulate_grad_batches=1, current_epoch=0,
                                 strategy=SimpleNamespace(root_device=torch.device("cpu"),
                                                          distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}))
    dm.setup("fit")
    return dm, list(dm.train_dataloader())


@pytest.mark.parametrize("packing", [False, True])
def test_each_rank_gets_batches_within_its_own_budget(tmp_path, packing):
    runs = [_rank_batches(tmp_path, rank, packing=packing) for rank in (0, 1)]
    (dm, _), budgets = runs[0], (256, 128)
    assert dm.max_tokens == (256, 128) and len(runs[0][1]) == len(runs[1][1])
    longest = max(int(b["input_ids"].shape[1]) for b in runs[0][1] + runs[1][1])
    assert longest > 128 or packing  # some document only rank 0's budget holds (padded: one row of it)
    seen = collections.Counter()
    for rank, (_, batches) in enumerate(runs):
        for batch in batches:
            assert batch["input_ids"].numel() <= budgets[rank]
            assert int(batch["num_padded_tokens"]) <= budgets[rank]
            seen.update(int(i) for i, fill in zip(batch["indices"], batch["is_fill"]) if not fill)
    assert set(seen.values()) == {1} and len(seen) == len(dm.train_dataset)


def test_a_list_of_another_length_than_the_world_is_refused(tmp_path):
    dm = BalancedTextDataModule(_docs(), max_tokens=[256, 128, 128], max_length=None, val_fraction=0.1,
                                cache_dir=tmp_path / "cache")
    dm.trainer = SimpleNamespace(world_size=2, global_rank=0, accumulate_grad_batches=1,
                                 strategy=SimpleNamespace(root_device=torch.device("cpu"),
                                                          distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    with pytest.raises(ValueError, match=r"max_tokens holds 3 per-rank budgets \[256, 128, 128\], but the "
                                         r"data-parallel world has num_replicas=2 ranks"):
        dm.setup("fit")
