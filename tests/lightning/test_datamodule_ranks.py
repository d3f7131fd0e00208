"""The ranks' agreement check of BalancedTextDataModule.setup (lit_balance.lightning.agreement), with a stand-in for
the other rank (one process).

The real 2-process run is tests/ddp/test_ranks_agree_ddp.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule
from lit_balance.lightning import agreement


def _docs(n=30):
    rng = np.random.default_rng(0)
    return [rng.integers(1, 100, size=int(k)) for k in rng.integers(1, 30, n)]


def _dm(tmp_path, docs=None, **kwargs):
    kwargs = {"max_tokens": 64, "max_length": None, "val_fraction": 0.1, "seed": 1, **kwargs}
    return BalancedTextDataModule(_docs() if docs is None else docs, cache_dir=tmp_path / "cache", **kwargs)


@pytest.fixture(autouse=True)
def _process_group(monkeypatch):
    """The check runs where a process group exists; here the stand-in strategy below plays it."""
    monkeypatch.setattr(agreement, "_process_group_ready", lambda: True)


def _attach(dm, other_row):
    """A 2-rank Trainer stand-in: this is rank 0, ``other_row(local)`` is what rank 1 contributes."""
    def all_gather(local):
        return torch.stack([local, other_row(local.clone())])

    dm.trainer = SimpleNamespace(world_size=2, global_rank=0, accumulate_grad_batches=1,
                                 strategy=SimpleNamespace(all_gather=all_gather, root_device=torch.device("cpu"),
                                                          distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    return dm


def _fingerprint_of(tmp_path, name, **kwargs):
    dm = _dm(tmp_path / name, **kwargs)
    dm.setup("fit")
    return torch.tensor([0] + [v for _, v, _ in dm._fingerprint()], dtype=torch.int64)


def test_equal_ranks_pass(tmp_path):
    _attach(_dm(tmp_path), lambda row: row).setup("fit")


def test_ranks_simulated_without_a_process_group_are_not_compared(tmp_path, monkeypatch):
    monkeypatch.setattr(agreement, "_process_group_ready", lambda: False)
    _attach(_dm(tmp_path), lambda row: 1 / 0).setup("fit")  # no gather


@pytest.mark.parametrize(("change", "shown"), [
    ({"seed": 2}, "seed: rank 0 has 1, rank 1 has 2"),
    ({"max_length": 20}, "max_length: rank 0 has -1, rank 1 has 20"),
    ({"docs": _docs()[:-1]}, "documents: rank 0 has 30, rank 1 has 29"),
    ({"val_fraction": 0.2}, "val_fraction differ on rank(s) [1]"),
])
def test_a_rank_that_planned_otherwise_is_named_with_the_cause(tmp_path, change, shown):
    other = _fingerprint_of(tmp_path, "other", **change)
    dm = _attach(_dm(tmp_path), lambda row: other)
    with pytest.raises(RuntimeError, match=r"ranks planned different data: rank\(s\) \[1\] differ from rank 0") as err:
        dm.setup("fit")
    message = str(err.value)
    assert shown in message and "per-node corpus copies" in message and "tokenizer" in message, message


def test_a_failed_rank_stops_the_others_and_keeps_its_own_error(tmp_path):
    failed = lambda row: torch.cat([torch.ones(1, dtype=torch.int64), torch.zeros_like(row[1:])])  # noqa: E731
    with pytest.raises(RuntimeError, match=r"setup failed on rank\(s\) \[1\] .*rank 0 stops too"):
        _attach(_dm(tmp_path), failed).setup("fit")
    # the rank whose planning fails raises its own error, after taking part in the gather
    calls = []
    dm = _attach(_dm(tmp_path, docs=_docs(2), val_fraction=0.9), lambda row: calls.append(row) or row)
    with pytest.raises(ValueError, match="leaves none for training"):
        dm.setup("fit")
    assert len(calls) == 1 and calls[0][0] == 1
