"""benchmarks/peers.py: each packing peer's guarantees (and only those) on small inputs, its algorithm
against an independent reference, and its purity in (lengths, budget, ranks, seed, epoch).

Run:
    python -m pytest tests/benchmarks/test_peers.py -q
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import peers as pk

pytestmark = pytest.mark.benchmark

lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=120).map(lambda v: np.array(v, dtype=np.int64))


def _flat(rank_batches):
    return [i for rank in rank_batches for batch in rank for i in batch]


def _naive_first_fit_decreasing(lengths, max_tokens):
    """First fit by scanning every pack, longest first (ties in dataset order): the textbook algorithm."""
    packs, free = [], []
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for k, room in enumerate(free):
            if room >= lengths[doc]:
                packs[k].append(doc)
                free[k] -= lengths[doc]
                break
        else:
            packs.append([doc])
            free.append(max_tokens - lengths[doc])
    return packs


@settings(deadline=None, max_examples=100)
@given(lengths=lengths_st, extra=st.integers(0, 100))
def test_first_fit_decreasing_equals_the_textbook_scan(lengths, extra):
    max_tokens = int(lengths.max()) + extra
    packs = pk.first_fit_decreasing(lengths, max_tokens)
    assert packs == _naive_first_fit_decreasing(lengths.tolist(), max_tokens)
    assert sorted(i for p in packs for i in p) == list(range(lengths.size))
    assert all(int(lengths[p].sum()) <= max_tokens for p in packs)


@settings(deadline=None, max_examples=100)
@given(lengths=lengths_st, extra=st.integers(0, 100))
def test_greedy_packs_keep_dataset_order_and_cut_only_when_the_next_does_not_fit(lengths, extra):
    max_tokens = int(lengths.max()) + extra
    packs = pk.greedy_packs(lengths, max_tokens)
    assert [i for p in packs for i in p] == list(range(lengths.size))
    assert all(int(lengths[p].sum()) <= max_tokens for p in packs)
    assert all(int(lengths[a].sum() + lengths[b[0]]) > max_tokens for a, b in itertools.pairwise(packs))


def _differencing(values):
    """Karmarkar & Karp's two-way differencing: replace the two largest numbers by their difference."""
    values = sorted(values)
    while len(values) > 1:
        a, b = values.pop(), values.pop()
        values.append(a - b)
        values.sort()
    return values[0]


@settings(deadline=None, max_examples=150)
@given(values=st.lists(st.integers(0, 10_000), min_size=1, max_size=40), k=st.integers(1, 6), equal=st.booleans())
def test_karmarkar_karp_partitions_every_item_and_matches_two_way_differencing(values, k, equal):
    k = min(k, len(values))
    if equal:
        values = values[:len(values) - len(values) % k]
    parts = pk.karmarkar_karp(values, k, equal_size=equal)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(values)))
    if equal:
        assert {len(p) for p in parts} == {len(values) // k}
    if k == 2 and not equal:  # two-way LDM leaves exactly the differencing method's final number as the spread
        sums = sorted(sum(values[i] for i in p) for p in parts)
        assert sums[1] - sums[0] == _differencing(values)


def test_karmarkar_karp_rejects_impossible_requests():
    with pytest.raises(ValueError, match=r"k must be in \[1, 3\].*got 4"):
        pk.karmarkar_karp([1, 2, 3], 4, equal_size=False)
    with pytest.raises(ValueError, match="multiple of k, got 5 items and k=2"):
        pk.karmarkar_karp([1, 2, 3, 4, 5], 2, equal_size=True)


peer_args = st.tuples(lengths_st, st.integers(0, 200), st.integers(1, 6), st.integers(0, 3), st.integers(0, 2))


@settings(deadline=None, max_examples=60)
@given(args=peer_args)
def test_every_peer_is_a_pure_function_of_its_arguments(args):
    lengths, extra, num_replicas, seed, epoch = args
    max_tokens = int(lengths.max()) + extra
    for name, peer in pk.PACKING_PEERS.items():
        if name == "kk_balanced" and lengths.size < num_replicas:  # verl cannot give every rank a document
            with pytest.raises(ValueError, match=f"each of {num_replicas} ranks a document"):
                peer(lengths, max_tokens, num_replicas, seed, epoch)
            continue
        first = peer(lengths, max_tokens, num_replicas, seed, epoch)
        assert len(first) == num_replicas, name
        assert peer(lengths.copy(), max_tokens, num_replicas, seed, epoch) == first, name


@settings(deadline=None, max_examples=60)
@given(args=peer_args)
def test_packing_peers_within_budget_cover_every_document(args):
    lengths, extra, num_replicas, seed, epoch = args
    max_tokens = int(lengths.max()) + extra
    for name in ("greedy_sequential", "ffd_round_robin", "ffd_repacked"):
        batches = pk.PACKING_PEERS[name](lengths, max_tokens, num_replicas, seed, epoch)
        assert all(int(lengths[b].sum()) <= max_tokens for rank in batches for b in rank), name
        assert set(_flat(batches)) == set(range(lengths.size)), name
    ffd = pk.ffd_round_robin(lengths, max_tokens, num_replicas, seed, epoch)
    assert sorted(_flat(ffd)) == list(range(lengths.size))  # round-robin: no repeats, counts may differ by one
    assert max(map(len, ffd)) - min(map(len, ffd)) <= 1
    greedy = pk.greedy_sequential(lengths, max_tokens, num_replicas, seed, epoch)
    packs = pk.greedy_packs(lengths, max_tokens)
    assert len({len(r) for r in greedy}) == 1  # DistributedSampler evens counts by repeating whole packs
    assert sum(map(len, greedy)) == -(-len(packs) // num_replicas) * num_replicas
    assert all(sorted(b) in [sorted(p) for p in packs] for rank in greedy for b in rank)


@settings(deadline=None, max_examples=60)
@given(args=peer_args)
def test_hf_flattening_takes_fixed_counts_and_repeats_only_to_even_ranks(args):
    lengths, extra, num_replicas, seed, epoch = args
    max_tokens = int(lengths.max()) + extra
    size = pk.flattening_batch_size(lengths, max_tokens)
    batches = pk.hf_flattening(lengths, max_tokens, num_replicas, seed, epoch)
    per_rank = -(-lengths.size // num_replicas)
    assert all(sum(map(len, rank)) == per_rank for rank in batches)
    assert all(len(b) == size for rank in batches for b in rank[:-1])  # only a rank's last may be short
    counts = Counter(_flat(batches))
    assert set(counts) == set(range(lengths.size))
    assert sum(counts.values()) - lengths.size == per_rank * num_replicas - lengths.size  # DistributedSampler's repeats


@settings(deadline=None, max_examples=60)
@given(args=peer_args, per_step=st.one_of(st.none(), st.integers(1, 60)))
def test_kk_balanced_gives_equal_counts_within_budget_and_drops_only_the_remainder(args, per_step):
    lengths, extra, num_replicas, seed, epoch = args
    max_tokens = int(lengths.max()) + extra
    step = (per_step or lengths.size) - (per_step or lengths.size) % num_replicas
    if step < num_replicas or step > lengths.size:
        if step < num_replicas:
            with pytest.raises(ValueError, match="raise docs_per_step or use fewer ranks"):
                pk.kk_balanced(lengths, max_tokens, num_replicas, seed, epoch, per_step)
        return
    batches = pk.kk_balanced(lengths, max_tokens, num_replicas, seed, epoch, per_step)
    assert len({len(r) for r in batches}) == 1
    assert all(int(lengths[b].sum()) <= max_tokens and b for rank in batches for b in rank)
    docs = _flat(batches)
    assert len(docs) == len(set(docs)) == lengths.size // step * step  # each once; the last partial batch dropped
    assert all(sum(len(b) for b in rank) == len(docs) // num_replicas for rank in batches)  # equal_size split


def test_kk_balanced_uses_the_fewest_micro_batches_that_fit():
    one_rank = [b for b in pk.kk_balanced(np.array([3, 3, 3, 3]), 6, 1, 0, 0)[0]]
    assert sorted(map(len, one_rank)) == [2, 2]  # ceil(12 / 6) = 2 micro-batches fit
    assert sorted(map(sorted, pk.kk_balanced(np.array([5, 4, 3]), 7, 1, 0, 0)[0])) == [[0], [1, 2]]
    assert len(pk.kk_balanced(np.array([4, 4, 4]), 7, 1, 0, 0)[0]) == 3  # 2 = ceil(12 / 7) cannot fit: a pair is 8


def test_flatten_with_collator_builds_one_row_per_micro_batch():
    pytest.importorskip("transformers")
    lengths = np.array([3, 1, 2])
    out = pk.flatten_with_collator([2, 0, 1], lengths)
    assert out["input_ids"].tolist() == [[2, 2, 0, 0, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0]]
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 5, 6] and out["max_length_q"] == 3


def test_peers_reject_documents_past_the_budget():
    for peer in pk.PACKING_PEERS.values():
        with pytest.raises(ValueError, match="does not fit max_tokens=4"):
            peer(np.array([3, 5]), 4, 2, 0, 0)
