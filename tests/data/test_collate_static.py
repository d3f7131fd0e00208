"""Static shapes in the collators: packed rows of exactly row_length with max_documents + 1 boundaries, padded
micro-batches padded to their shape; the collator chosen by the planner of the settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BatchingSettings
from lit_balance.data.collate import IGNORE_INDEX, PackedCollator, PadCollator, collator_for


def sample(ids, index, is_fill=False):
    return {"input_ids": ids, "index": index, "is_fill": is_fill}


def test_static_packed_row_exact_tensors():
    batch = PackedCollator(9, row_length=10, max_documents=4)([sample([1, 2, 3], 0), sample([4, 5], 1)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9, 9, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]  # the tail restarts at 0
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5] + [-100] * 5]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 10, 10]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 10
    assert (batch["num_real_tokens"], batch["num_padded_tokens"]) == (5, 10)
    assert batch["indices"].tolist() == [0, 1]


def test_static_packed_row_with_cap_documents_closes_the_last_segment():
    batch = PackedCollator(0, row_length=8, max_documents=2)([sample([1, 2, 3], 0), sample([4, 5], 1)])
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    full = PackedCollator(0, row_length=5, max_documents=3)([sample([1, 2, 3], 0), sample([4, 5], 1)])
    assert full["cu_seq_lens_q"].tolist() == [0, 3, 5, 5]  # no tail: a zero-length segment


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(0, 30), st.integers(0, 4))
def test_static_packed_invariants(lengths, extra_tokens, extra_docs):
    row, cap = sum(lengths) + extra_tokens, len(lengths) + extra_docs
    docs = [sample(list(range(100 * i + 1, 100 * i + 1 + n)), i) for i, n in enumerate(lengths)]
    batch = PackedCollator(0, row_length=row, max_documents=cap)(docs)
    free = PackedCollator(0)(docs)
    real = sum(lengths)
    assert batch["input_ids"].shape == (1, row) and batch["cu_seq_lens_q"].shape == (cap + 1,)
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == row and all(b >= a for a, b in zip(cu, cu[1:]))
    assert cu[:len(lengths)] == free["cu_seq_lens_q"].tolist()[:len(lengths)]
    # the documents are the free batch's, and nothing past them has a target or extends a document's positions
    assert torch.equal(batch["input_ids"][:, :real], free["input_ids"])
    assert torch.equal(batch["labels"][:, :real], free["labels"])
    assert (batch["labels"][:, real:] == IGNORE_INDEX).all()
    assert torch.equal(batch["position_ids"][:, :real], free["position_ids"])
    assert batch["position_ids"][0, real:].tolist() == list(range(row - real))


def test_static_packed_errors_name_the_setting():
    with pytest.raises(ValueError, match="cap of 1 documents") as info:
        PackedCollator(0, row_length=10, max_documents=1)([sample([1], 0), sample([2], 1)])
    assert info.value.parameter == "max_batch_size"
    with pytest.raises(ValueError, match="exceeds the static row of 3 tokens") as info:
        PackedCollator(0, row_length=3, max_documents=4)([sample([1, 2], 0), sample([2, 3], 1)])
    assert info.value.parameter == "max_tokens"
    with pytest.raises(ValueError, match="go together"):
        PackedCollator(0, row_length=3)
    with pytest.raises(ValueError, match="max_documents must be"):
        PackedCollator(0, row_length=3, max_documents=0)


def test_padded_shapes_pad_to_the_smallest_shape_that_holds_the_batch():
    collate = PadCollator(0, shapes=[(2, 8), (4, 4)])
    small = collate([sample([1, 2, 3], 5), sample([4], 6, is_fill=True)])
    assert small["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [0] * 4, [0] * 4]
    assert small["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0] * 4, [0] * 4]
    assert small["labels"].tolist() == [[1, 2, 3, -100], [-100] * 4, [-100] * 4, [-100] * 4]
    assert small["indices"].tolist() == [5, 6] and small["is_fill"].tolist() == [False, True]
    assert (small["num_real_tokens"], small["num_padded_tokens"]) == (4, 16)
    long = collate([sample([1, 2, 3, 4, 5], 0)])
    assert long["input_ids"].shape == (2, 8)
    with pytest.raises(ValueError, match="fits none of the padded_shapes") as info:
        collate([sample([1] * 9, 0)])
    assert info.value.parameter == "padded_shapes"
    with pytest.raises(ValueError, match="shapes must be"):
        PadCollator(0, shapes=[(0, 4)])


def test_collator_is_chosen_by_the_planner_of_the_settings():
    assert type(collator_for(BatchingSettings(max_tokens=64), 0)) is PadCollator
    assert type(collator_for(BatchingSettings(max_tokens=64, packing=True), 0)) is PackedCollator
    assert type(collator_for(BatchingSettings(max_tokens=[64, 32], packing=True), 0)) is PackedCollator
    static = collator_for(BatchingSettings(max_tokens=64, packing=True, static_packing=True, max_batch_size=5), 0)
    assert (static.row_length, static.max_documents) == (64, 5)
    shaped = collator_for(BatchingSettings(max_tokens=64, padded_shapes=[(4, 16), (2, 32)]), 0, max_length=30)
    assert shaped.shapes == ((4, 16), (2, 32)) and shaped.max_length == 30
    with pytest.raises(RuntimeError, match="resolve_static_shapes"):
        collator_for(BatchingSettings(max_tokens=64, padded_shapes=3), 0)
    with pytest.raises(TypeError, match="BatchingSettings"):
        collator_for("packed", 0)
