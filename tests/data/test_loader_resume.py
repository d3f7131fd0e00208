"""Resume of a plain training loop (torchrun-style, no Lightning) through BalancedDataLoader, with 2 persistent
DataLoader workers reading ahead: each rank simulated in this process; nothing skipped, nothing repeated."""

import io
from collections import Counter

import numpy as np
import pytest
import torch

from lit_balance import (
    BalancedBatchSampler,
    BalancedDataLoader,
    MicroBatchDataset,
    PadFieldsCollator,
    balanced_dataloader,
)

WORLD, MAX_TOKENS, CUT = 2, 64, 5


def _train_set() -> MicroBatchDataset:
    rng = np.random.default_rng(11)
    items = [{"input_ids": rng.integers(1, 50, size=int(n)).tolist()} for n in rng.integers(1, 30, 160)]
    return MicroBatchDataset(items, length="input_ids")


def _loader(train, rank, **kwargs) -> BalancedDataLoader:
    sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, num_replicas=WORLD, rank=rank, seed=2)
    return balanced_dataloader(train, sampler, PadFieldsCollator(["input_ids"], pad_token_id=0), **kwargs)


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.slow  # DataLoader worker processes
def test_plain_loop_resumes_exactly_with_two_persistent_workers():
    train = _train_set()
    whole, resumed, states = [], [], []
    for rank in range(WORLD):
        whole += [b["indices"].tolist() for b in _loader(train, rank)]
        loader = _loader(train, rank, num_workers=2, persistent_workers=True)
        iterator = iter(loader)
        trained = [next(iterator)["indices"].tolist() for _ in range(CUT)]  # the loop's training steps
        states.append(_roundtrip(loader.state_dict()))  # the workers have fetched beyond CUT by now
        fresh = _loader(train, rank, num_workers=2, persistent_workers=True)
        fresh.load_state_dict(states[-1])
        resumed += trained + [b["indices"].tolist() for b in fresh]
    assert states[0] == states[1]  # rank-independent: rank 0 alone writes the checkpoint
    assert states[0]["sampler"]["segments"] == [[WORLD, CUT]]
    docs = Counter(i for batch in resumed for i in batch)
    assert docs == Counter(i for batch in whole for i in batch)  # nothing skipped, nothing repeated
    assert sorted(docs) == list(range(len(train)))


def test_the_count_follows_the_pass_and_the_epoch():
    train = _train_set()
    loader = _loader(train, 0)
    assert loader.batches_consumed == 0
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    assert loader.batches_consumed == 3
    fresh = _loader(train, 0)
    fresh.load_state_dict(loader.state_dict())
    assert fresh.batches_consumed == 3  # restored, nothing handed out yet
    rest = list(fresh)
    assert fresh.batches_consumed == len(fresh) == 3 + len(rest)
    fresh.balanced_sampler.set_epoch(1)
    assert fresh.batches_consumed == 0 and fresh.state_dict()["sampler"]["epoch"] == 1


def test_a_state_of_another_kind_is_refused():
    loader = _loader(_train_set(), 0)
    with pytest.raises(ValueError, match=r"keys \['sampler', 'version'\].*sampler.load_state_dict"):
        loader.load_state_dict(loader.balanced_sampler.state_dict())
    with pytest.raises(TypeError, match="BalancedBatchSampler"):
        BalancedDataLoader(list(range(4)), batch_size=2)
