"""The vectorised planner against plain reference implementations, and bad-input regressions."""

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.planning import _cut_points, _split_to
from lit_balance.sampler import MAX_TOKENS_LIMIT, BalancedBatchSampler


def _greedy_reference(pl, max_tokens, max_batch_size):
    """One micro-batch at a time: take as many rows as the first (longest) row allows."""
    ends, i = [], 0
    while i < len(pl):
        i = min(i + min(max_tokens // int(pl[i]), max_batch_size), len(pl))
        ends.append(i)
    return ends


def _split_reference(starts, ends, target):
    """Split the largest micro-batch (ties: earliest) in half until there are target, over all of them."""
    heap = [(-(e - s), s, e) for s, e in zip(starts, ends)]
    heapq.heapify(heap)
    while len(heap) < target and -heap[0][0] >= 2:
        size, lo, hi = heapq.heappop(heap)
        mid = lo + (-size + 1) // 2
        heapq.heappush(heap, (lo - mid, lo, mid))
        heapq.heappush(heap, (mid - hi, mid, hi))
    return sorted((s, e) for _, s, e in heap)


@settings(deadline=None, max_examples=300)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300),
    max_tokens=st.integers(64, 512),
    max_batch_size=st.integers(1, 40),
    num_replicas=st.integers(1, 40),
)
def test_vectorised_planner_matches_references(lengths, max_tokens, max_batch_size, num_replicas):
    pl = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    ends = _cut_points(pl, max_tokens, max_batch_size)
    assert ends.tolist() == _greedy_reference(pl, max_tokens, max_batch_size)
    starts = np.concatenate([[0], ends[:-1]])
    target = -(-len(starts) // num_replicas) * num_replicas
    got_s, got_e = _split_to(starts, ends, target)
    assert list(zip(got_s.tolist(), got_e.tolist())) == _split_reference(starts.tolist(), ends.tolist(), target)


@pytest.mark.parametrize(
    ("lengths", "pattern"),
    [
        ([3, float("nan")], r"index 1 holds nan"),
        ([3, float("inf")], r"index 1 holds inf"),
        ([True, 2, 3], r"index 0 holds the bool True"),
        ([np.bool_(True), 2], r"index 0 holds the bool"),
        ([2**63 - 1, 5], r"index 0: 9223372036854775807"),
        (np.array([5, 2**64 - 1], dtype=np.uint64), r"index 1: 18446744073709551615"),
        ([5, 2**70], r"index 1 holds 1180591620717411303424"),
        (torch.tensor([3.0, 4.5], dtype=torch.bfloat16), r"index 1 holds 4.5"),
    ],
)
def test_odd_lengths_raise_naming_the_value(lengths, pattern):
    with pytest.raises(ValueError, match=pattern):
        BalancedBatchSampler(lengths, 10, num_replicas=1, rank=0, pad_to_multiple_of=2, too_long="skip")


def test_object_array_of_ints_is_accepted():
    sampler = BalancedBatchSampler(np.array([3, 4], dtype=object), 10, num_replicas=1, rank=0)
    assert sampler.lengths.tolist() == [3, 4] and sampler.lengths.dtype == np.int64


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"shuffle": "false"}, TypeError, "shuffle must be True or False, got 'false'"),
        ({"drop_last": "false"}, TypeError, "drop_last must be True or False"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"seed": 1.0}, TypeError, "seed must be an int >= 0, got 1.0"),
    ],
)
def test_flag_and_seed_types(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        BalancedBatchSampler([3, 4], 10, num_replicas=1, rank=0, **kwargs)


def test_limits_on_max_tokens_and_epoch():
    with pytest.raises(ValueError, match=rf"max_tokens must be in \[1, {MAX_TOKENS_LIMIT}\], got {2**63}"):
        BalancedBatchSampler([3], 2**63, num_replicas=1, rank=0)
    sampler = BalancedBatchSampler([3], 10, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -5"):
        sampler.plan(-5)


def _compositions(sampler, epoch):
    sampler.set_epoch(epoch)
    return {frozenset(b) for b in sampler}


def test_length_tolerance_changes_composition_of_distinct_lengths():
    lengths = np.arange(100, 400)  # no two lengths equal
    moving = BalancedBatchSampler(lengths, 2048, num_replicas=1, rank=0, seed=3)
    frozen = BalancedBatchSampler(lengths, 2048, num_replicas=1, rank=0, seed=3, length_tolerance=0.0)
    assert _compositions(moving, 0) != _compositions(moving, 1)
    assert _compositions(frozen, 0) == _compositions(frozen, 1)  # only the order of steps changes
    for sampler in (moving, frozen):
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert all(len(b) * int(lengths[b].max()) <= 2048 for b in sampler)
            assert sorted(i for b in sampler for i in b) == list(range(300))


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.1"])
def test_length_tolerance_rejects_bad_values(value):
    with pytest.raises(ValueError, match="length_tolerance must be a number in"):
        BalancedBatchSampler([3, 4], 10, num_replicas=1, rank=0, length_tolerance=value)
