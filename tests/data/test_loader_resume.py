"""Resume of a plain training loop (torchrun-style, no Lightning) through BalancedDataLoader, with 2 persistent
DataLoader workers reading ahead: each rank simulated in this process; nothing skipped, nothing repeated."""

import copy
import io
import pickle
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from lit_balance import (
    BalancedBatchSampler,
    BalancedDataLoader,
    MicroBatch,
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


def _epoch_length(train) -> int:
    return len(BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, num_replicas=WORLD, rank=0, seed=2))


BAD_COUNTS = [(2.7, TypeError, "2.7"), ("3", TypeError, "'3'"), (True, TypeError, "True"), (-1, ValueError, "-1"),
              ("past the end", ValueError, None)]


@pytest.mark.parametrize("value, error, shown", BAD_COUNTS, ids=[str(v) for v, _, _ in BAD_COUNTS])
def test_a_count_from_a_batches_consumed_function_that_is_not_a_count_is_refused(value, error, shown):
    train = _train_set()
    past_the_end = value == "past the end"
    if past_the_end:
        value = _epoch_length(train) + 1
        shown = f"must be in [0, {value - 1}] for epoch 0"
    loader = _loader(train, 0, batches_consumed=lambda: value)
    with pytest.raises(error) as raised:
        loader.state_dict()
    message = str(raised.value)
    assert "batches_consumed" in message and shown in message and f"{value}" in message
    assert "the batches_consumed function given to BalancedDataLoader" in message  # where the count came from
    if not past_the_end:  # the count itself is refused where it is read, whatever the epoch holds
        with pytest.raises(error, match="batches_consumed must be an int >= 0"):
            loader.batches_consumed


@pytest.mark.parametrize("value, error, shown", BAD_COUNTS, ids=[str(v) for v, _, _ in BAD_COUNTS])
def test_a_count_passed_to_the_samplers_state_dict_that_is_not_a_count_is_refused(value, error, shown):
    train = _train_set()
    sampler = _loader(train, 0).balanced_sampler
    if value == "past the end":
        value = len(sampler) + 1
        shown = f"must be in [0, {len(sampler)}] for epoch 0"
    with pytest.raises(error) as raised:
        sampler.state_dict(batches_consumed=value)
    assert "batches_consumed" in str(raised.value) and str(shown) in str(raised.value)


def test_the_count_source_is_checked_and_an_explicit_function_wins():
    train = _train_set()
    loader = _loader(train, 0)
    loader.set_count_source(lambda: 2.0)
    with pytest.raises(TypeError, match=r"batches_consumed must be an int.*the loader's count source.*returned 2\.0"):
        loader.state_dict()
    loader.set_count_source(lambda: 4)
    assert loader.batches_consumed == 4 and loader.state_dict()["sampler"]["segments"] == [[WORLD, 4]]
    loader.set_count_source(lambda: None)  # no count (e.g. a trainer that is not fitting): the loader's own
    iterator = iter(loader)
    next(iterator)
    assert loader.batches_consumed == 1
    explicit = _loader(train, 0, batches_consumed=lambda: 2)
    explicit.set_count_source(lambda: 4)
    assert explicit.batches_consumed == 2
    with pytest.raises(TypeError, match="count source must be a function"):
        loader.set_count_source(3)


@pytest.mark.slow  # DataLoader worker processes
def test_the_samplers_own_state_refuses_a_position_ahead_of_what_its_loader_handed_to_the_loop():
    train = _train_set()
    loader = _loader(train, 0, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    for _ in range(CUT):
        next(iterator)
    with pytest.raises(RuntimeError, match=r"without batches_consumed while a BalancedDataLoader with num_workers=2 "
                                           r"reads this sampler: the sampler has handed out \d+ micro-batches of epoch "
                                           r"0, training has consumed 5.*sampler.state_dict\(batches_consumed=5\)"):
        loader.balanced_sampler.state_dict()
    assert loader.balanced_sampler.state_dict(batches_consumed=CUT)["segments"] == [[WORLD, CUT]]
    rest = list(iterator)
    assert CUT + len(rest) == len(loader)
    assert loader.balanced_sampler.state_dict()["epoch"] == 1  # the whole epoch trained: the default is right


@pytest.mark.slow  # DataLoader worker processes
def test_the_samplers_own_state_warns_once_while_a_plain_dataloaders_workers_read_it():
    train = _train_set()
    sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, num_replicas=WORLD, rank=0, seed=2)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=2,
                                         collate_fn=PadFieldsCollator(["input_ids"], pad_token_id=0))
    iterator = iter(loader)
    for _ in range(CUT):
        next(iterator)
    with pytest.warns(RuntimeWarning, match=r"worker processes read this sampler ahead of training.*sampler.state_dict"
                                            r"\(batches_consumed=sampler.start_micro_step \+ trained\)"):
        state = sampler.state_dict()
    assert state["segments"][0][1] > CUT  # the position the warning is about: ahead of the steps trained
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.state_dict()  # once per sampler
    single = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, num_replicas=WORLD, rank=0, seed=2)
    iterator = iter(torch.utils.data.DataLoader(train, batch_sampler=single,
                                                collate_fn=PadFieldsCollator(["input_ids"], pad_token_id=0)))
    for _ in range(CUT):
        next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no workers: the default count is what the loop took
        assert single.state_dict()["segments"] == [[WORLD, CUT]]


def test_a_sampler_that_a_loader_read_still_pickles_and_copies():
    train = _train_set()
    loader = _loader(train, 0)
    iterator = iter(loader)
    batch = next(iterator)
    sampler = loader.balanced_sampler
    micro_batch = next(iter(sampler))
    assert type(pickle.loads(pickle.dumps(micro_batch))) is MicroBatch  # what a worker process receives
    assert type(copy.deepcopy(micro_batch)) is MicroBatch and copy.copy(micro_batch) == micro_batch
    clone = pickle.loads(pickle.dumps(sampler))  # the loader that reads it is not part of it
    assert clone.state_dict(batches_consumed=1) == sampler.state_dict(batches_consumed=1)
    assert batch["indices"].tolist() == list(next(iter(clone)))


def test_the_loader_reads_its_sampler_where_the_dataloader_draws_batches_from():
    train = _train_set()
    sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, num_replicas=1, rank=0)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0)
    as_sampler = BalancedDataLoader(train, sampler=sampler, batch_size=None, collate_fn=collate)
    as_batch_sampler = BalancedDataLoader(train, batch_sampler=sampler, collate_fn=collate)
    assert as_sampler.balanced_sampler is sampler and as_batch_sampler.balanced_sampler is sampler
    # batch_size=1 (the DataLoader's default) wraps each micro-batch into a batch of one: refused, naming the fix
    with pytest.raises(TypeError, match=r"as its sampler \(with batch_size=None\).*batch_sampler=BatchSampler"):
        BalancedDataLoader(train, sampler=sampler, collate_fn=collate)
