"""Tests for TokenDataset: lengths, truncation, list indexing and bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lit_balance.data.collate import PadCollator
from lit_balance.data.dataset import TokenDataset
from lit_balance.sampler.sampler import MicroBatch

# documents: [1 2 3] [4 5] [6 7 8 9 10 11] [12]
TOKENS = np.arange(1, 13, dtype=np.int32)
OFFSETS = np.array([0, 3, 5, 11, 12])


def test_documented_example():
    ds = TokenDataset(np.array([1, 2, 3, 4, 5]), np.array([0, 3, 5]), np.array([1, 0]), max_length=2)
    assert ds.lengths.tolist() == [2, 2]
    assert ds[1]["input_ids"].tolist() == [1, 2]
    assert ds[0]["input_ids"].tolist() == [4, 5]


def test_lengths_and_items_follow_doc_ids():
    ds = TokenDataset(TOKENS, OFFSETS, np.array([2, 0, 3]))
    assert len(ds) == 3
    assert ds.lengths.tolist() == [6, 3, 1]
    assert ds.lengths.dtype == np.int64
    item = ds[0]
    assert item["input_ids"].tolist() == [6, 7, 8, 9, 10, 11]
    assert item["input_ids"].dtype == np.int32
    assert item["index"] == 0
    assert item["is_fill"] is False
    assert ds[1]["input_ids"].tolist() == [1, 2, 3]
    assert ds[2]["input_ids"].tolist() == [12]
    assert ds[np.int64(2)]["index"] == 2


def test_max_length_truncates_items_and_lengths():
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4), max_length=2)
    assert ds.lengths.tolist() == [2, 2, 2, 1]
    assert [ds[i]["input_ids"].tolist() for i in range(4)] == [[1, 2], [4, 5], [6, 7], [12]]
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4), max_length=100)
    assert ds.lengths.tolist() == [3, 2, 6, 1]
    for i in range(4):
        assert len(ds[i]["input_ids"]) == ds.lengths[i]


def test_list_indexing_returns_items_in_order():
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4))
    items = ds[[3, 0, 3]]
    assert isinstance(items, list)
    assert [it["index"] for it in items] == [3, 0, 3]
    assert [it["input_ids"].tolist() for it in items] == [[12], [1, 2, 3], [12]]
    assert [it["is_fill"] for it in items] == [False, False, False]
    assert [it["index"] for it in ds[(1, 2)]] == [1, 2]
    assert [it["index"] for it in ds[torch.tensor([2, 1])]] == [2, 1]
    assert ds[[]] == []


def test_numpy_array_of_indices():
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4))
    items = ds[np.array([1, 2])]
    assert [it["index"] for it in items] == [1, 2]
    assert [it["input_ids"].tolist() for it in items] == [[4, 5], [6, 7, 8, 9, 10, 11]]
    assert [it["is_fill"] for it in items] == [False, False]


def test_microbatch_fill_mask_is_carried():
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4))
    items = ds[MicroBatch([2, 1], [False, True])]
    assert [it["index"] for it in items] == [2, 1]
    assert [it["is_fill"] for it in items] == [False, True]
    items = ds.__getitems__(MicroBatch([0, 1, 2], [True, False, True]))
    assert [it["is_fill"] for it in items] == [True, False, True]


def test_out_of_range_index_raises_index_error():
    ds = TokenDataset(TOKENS, OFFSETS, np.array([0, 1]))
    with pytest.raises(IndexError, match="index 2"):
        ds[2]
    with pytest.raises(IndexError, match="index 5"):
        ds[[0, 5]]
    with pytest.raises(IndexError):
        ds[MicroBatch([7])]


def test_bad_construction():
    with pytest.raises(ValueError, match=r"\[0, 4\).*max 4"):
        TokenDataset(TOKENS, OFFSETS, np.array([0, 4]))
    with pytest.raises(ValueError, match=r"min -1"):
        TokenDataset(TOKENS, OFFSETS, np.array([-1, 0]))
    with pytest.raises(ValueError, match=r"max_length.*0"):
        TokenDataset(TOKENS, OFFSETS, np.array([0]), max_length=0)


def test_empty_split():
    ds = TokenDataset(TOKENS, OFFSETS, np.array([], dtype=np.int64))
    assert len(ds) == 0
    assert ds.lengths.tolist() == []
    with pytest.raises(IndexError):
        ds[0]


def test_dataloader_uses_list_indexing():
    ds = TokenDataset(TOKENS, OFFSETS, np.arange(4))
    loader = DataLoader(ds, batch_sampler=[MicroBatch([2, 3], [False, True]), [0, 1]], collate_fn=PadCollator(0))
    first, second = list(loader)
    assert first["indices"].tolist() == [2, 3]
    assert first["is_fill"].tolist() == [False, True]
    assert first["labels"][1].tolist() == [-100] * 6
    assert second["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]


@settings(deadline=None, max_examples=100)
@given(
    doc_lengths=st.lists(st.integers(1, 30), min_size=1, max_size=30),
    data=st.data(),
    max_length=st.one_of(st.none(), st.integers(1, 30)),
)
def test_property_items_match_documents(doc_lengths, data, max_length):
    offsets = np.concatenate([[0], np.cumsum(doc_lengths)])
    tokens = np.arange(int(offsets[-1]), dtype=np.int64) * 3 + 1
    doc_ids = np.array(data.draw(st.lists(st.integers(0, len(doc_lengths) - 1), max_size=20)), dtype=np.int64)
    ds = TokenDataset(tokens, offsets, doc_ids, max_length=max_length)
    assert len(ds) == len(doc_ids)
    for i, d in enumerate(doc_ids):
        doc = tokens[offsets[d] : offsets[d + 1]]
        want = doc if max_length is None else doc[:max_length]
        assert ds.lengths[i] == len(want)
        assert ds[i]["input_ids"].tolist() == want.tolist()
    if len(ds):
        batch = PadCollator(0)(ds[list(range(len(ds)))])
        assert batch["num_real_tokens"] == int(ds.lengths.sum())


def test_micro_batch_step_totals_are_carried_into_items():
    import numpy as np

    from lit_balance.data.dataset import TokenDataset
    from lit_balance.sampler.sampler import MicroBatch

    ds = TokenDataset(np.arange(10), np.array([0, 4, 10]), np.array([0, 1]))
    mb = MicroBatch([1, 0], [False, True])
    mb.step_real_tokens, mb.step_rows = 17, 3
    items = ds[mb]
    assert [(i["index"], i["is_fill"], i["step_real_tokens"], i["step_rows"]) for i in items] == [
        (1, False, 17, 3), (0, True, 17, 3)]
    assert "step_rows" not in ds[[0]][0]
