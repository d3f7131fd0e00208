"""BalancedTextDataModule.plan_summary: the training split's plan, previewed without a Trainer or the CLI."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.plan.cost import CostModel
from lit_balance.plan.stats import plan_stats


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("world_size,accumulate", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_plan_summary_matches_the_sampler_built_at_setup(tmp_path, world_size, accumulate):
    dm = BalancedTextDataModule(_texts(300), max_tokens=256, max_length=48, val_fraction=0.1, seed=3,
                                pad_to_multiple_of=8, cache_dir=tmp_path)
    summary = dm.plan_summary(num_replicas=world_size, accumulate_grad_batches=accumulate)
    assert dm.train_sampler is None and dm.train_dataset is None  # the preview leaves no state behind
    assert summary["settings"]["num_replicas"] == world_size
    assert summary["settings"]["accumulate_grad_batches"] == accumulate

    dm.trainer = SimpleNamespace(world_size=world_size, global_rank=0, current_epoch=0,
                                 strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world_size,
                                                                                      "rank": 0}),
                                 accumulate_grad_batches=accumulate)
    dm.prepare_data()
    dm.setup("fit")
    sampler = dm.train_sampler
    figures = summary["balanced"]
    assert figures["micro_batches_per_rank"] == len(sampler)
    assert summary["num_samples"] == len(dm.train_dataset)
    stats = plan_stats(sampler.plan(), sampler.lengths, CostModel(), pad_to_multiple_of=8,
                       accumulate_grad_batches=accumulate)
    assert figures["padding_ratio"] == stats.padding_ratio
    assert figures["useful_fraction"] == stats.useful_fraction
    assert figures["optimizer_steps"] == stats.rank_cost.shape[0]


def test_plan_summary_keeps_a_setup_done_before(tmp_path):
    dm = BalancedTextDataModule(_texts(50), max_tokens=256, max_length=48, val_fraction=0.1, cache_dir=tmp_path)
    dm.setup("fit")
    sampler, dataset = dm.train_sampler, dm.train_dataset
    dm.plan_summary(num_replicas=4)
    assert dm.train_sampler is sampler and dm.train_dataset is dataset


def test_plan_summary_rejects_a_bad_accumulate(tmp_path):
    dm = BalancedTextDataModule(_texts(20), max_tokens=256, max_length=48, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        dm.plan_summary(num_replicas=2, accumulate_grad_batches=0)


@pytest.mark.parametrize("after_setup", [False, True])
def test_the_preview_leaves_every_attribute_as_it_was_and_runs_no_setup(tmp_path, monkeypatch, after_setup):
    dm = BalancedTextDataModule(_texts(60), max_tokens=256, max_length=48, val_fraction=0.1, cache_dir=tmp_path)
    if after_setup:
        dm.setup("fit")
    monkeypatch.setattr(dm, "setup", lambda *args, **kwargs: pytest.fail("the preview must not run setup"))
    before = dict(vars(dm))
    summary = dm.plan_summary(num_replicas=2, accumulate_grad_batches=2)
    assert summary["num_samples"] == 60 - round(0.1 * 60)  # the training split
    after = vars(dm)
    assert after.keys() == before.keys()
    changed = [name for name, value in before.items() if after[name] is not value]
    assert changed == []


def test_the_preview_saves_and_restores_nothing():
    import inspect

    from lit_balance.lightning import datamodule

    assert "__dict__" not in inspect.getsource(datamodule)
