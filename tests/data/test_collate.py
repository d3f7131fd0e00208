"""Tests for PadCollator: pad to the longest row, labels, counts, truncation and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.data.collate import IGNORE_INDEX, PadCollator


def sample(ids, index, is_fill=None):
    s = {"input_ids": ids, "index": index}
    if is_fill is not None:
        s["is_fill"] = is_fill
    return s


def test_ignore_index_matches_cross_entropy_default():
    assert IGNORE_INDEX == -100
    logits = torch.randn(3, 5)
    target = torch.tensor([1, IGNORE_INDEX, 2])
    full = torch.nn.functional.cross_entropy(logits, target)
    kept = torch.nn.functional.cross_entropy(logits[[0, 2]], target[[0, 2]])
    assert torch.allclose(full, kept)


def test_shapes_dtypes_and_values():
    collate = PadCollator(pad_token_id=99)
    batch = collate([sample([1, 2, 3], 7), sample([4, 5, 6, 7, 8], 2), sample([9, 10], 4)])
    assert set(batch) == {
        "input_ids", "attention_mask", "labels", "indices", "is_fill", "num_real_tokens", "num_padded_tokens"
    }
    assert batch["input_ids"].shape == (3, 5)
    assert batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].dtype == torch.long
    assert batch["labels"].dtype == torch.long
    assert batch["indices"].dtype == torch.long
    assert batch["is_fill"].dtype == torch.bool
    assert batch["input_ids"].tolist() == [[1, 2, 3, 99, 99], [4, 5, 6, 7, 8], [9, 10, 99, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100, -100], [4, 5, 6, 7, 8], [9, 10, -100, -100, -100]]
    assert batch["indices"].tolist() == [7, 2, 4]
    assert batch["is_fill"].tolist() == [False, False, False]
    assert batch["num_real_tokens"] == 10
    assert batch["num_padded_tokens"] == 15
    assert type(batch["num_real_tokens"]) is int and type(batch["num_padded_tokens"]) is int


def test_pads_to_longest_not_to_a_fixed_maximum():
    collate = PadCollator(0, max_length=512)
    assert collate([sample([1, 2], 0), sample([3], 1)])["input_ids"].shape == (2, 2)
    assert collate([sample([5], 0)])["input_ids"].shape == (1, 1)


@pytest.mark.parametrize(
    ("lengths", "multiple", "width"), [([3, 5], 4, 8), ([8, 1], 8, 8), ([9], 8, 16), ([1], 64, 64)]
)
def test_pad_to_multiple_of(lengths, multiple, width):
    collate = PadCollator(0, pad_to_multiple_of=multiple)
    batch = collate([sample(list(range(1, n + 1)), i) for i, n in enumerate(lengths)])
    assert batch["input_ids"].shape == (len(lengths), width)
    assert batch["num_padded_tokens"] == len(lengths) * width
    assert batch["num_real_tokens"] == sum(lengths)
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths


def test_documented_example():
    collate = PadCollator(pad_token_id=0, pad_to_multiple_of=4)
    batch = collate([{"input_ids": [5, 6, 7], "index": 3}, {"input_ids": [8], "index": 9}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["num_real_tokens"] == 4
    assert batch["num_padded_tokens"] == 8


def test_fill_rows_have_no_labels():
    collate = PadCollator(0)
    batch = collate([sample([1, 2, 3], 0, False), sample([4, 5], 1, True), sample([6], 2)])
    assert batch["is_fill"].tolist() == [False, True, False]
    assert batch["labels"].tolist() == [[1, 2, 3], [-100, -100, -100], [6, -100, -100]]
    # the fill row's tokens are still there and still count as real tokens
    assert batch["input_ids"][1].tolist() == [4, 5, 0]
    assert batch["attention_mask"][1].tolist() == [1, 1, 0]
    assert batch["num_real_tokens"] == 6
    assert batch["num_padded_tokens"] == 9


def test_all_fill_batch_is_fully_ignored():
    collate = PadCollator(0)
    batch = collate([sample([1, 2], 0, True)])
    assert (batch["labels"] == IGNORE_INDEX).all()
    loss = torch.nn.functional.cross_entropy(
        torch.randn(2, 10), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    assert loss.item() == 0.0


def test_max_length_truncates_rows():
    collate = PadCollator(0, max_length=4)
    batch = collate([sample([1, 2, 3], 0), sample([4, 5, 6, 7, 8, 9], 1), sample([10, 11], 2)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7], [10, 11, 0, 0]]
    assert batch["num_real_tokens"] == 9
    assert batch["num_padded_tokens"] == 12
    # truncation applies before rounding to the multiple
    collate = PadCollator(0, pad_to_multiple_of=8, max_length=10)
    batch = collate([sample(list(range(1, 21)), 0)])
    assert batch["input_ids"].shape == (1, 16)
    assert batch["attention_mask"].sum().item() == 10
    assert batch["input_ids"][0, :10].tolist() == list(range(1, 11))


@pytest.mark.parametrize(
    "make",
    [list, lambda x: np.asarray(x, dtype=np.int32), lambda x: np.asarray(x, dtype=np.int64), torch.tensor, tuple],
)
def test_input_container_types(make):
    collate = PadCollator(0)
    batch = collate([sample(make([3, 4, 5]), 0), sample(make([6]), np.int64(1))])
    assert batch["input_ids"].tolist() == [[3, 4, 5], [6, 0, 0]]
    assert batch["indices"].tolist() == [0, 1]


def test_errors_at_call_time():
    collate = PadCollator(0)
    with pytest.raises(ValueError, match="empty micro-batch"):
        collate([])
    with pytest.raises(ValueError, match="index 12"):
        collate([sample([1], 3), sample([], 12)])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"pad_token_id": -1}, r"pad_token_id.*-1"),
        ({"pad_token_id": 1.0}, r"pad_token_id"),
        ({"pad_token_id": 0, "pad_to_multiple_of": 0}, r"pad_to_multiple_of.*0"),
        ({"pad_token_id": 0, "pad_to_multiple_of": True}, r"pad_to_multiple_of"),
        ({"pad_token_id": 0, "max_length": 0}, r"max_length.*0"),
        ({"pad_token_id": 0, "max_length": 2.5}, r"max_length.*2\.5"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PadCollator(**kwargs)


@settings(deadline=None, max_examples=150)
@given(
    rows=st.lists(st.lists(st.integers(1, 50000), min_size=1, max_size=40), min_size=1, max_size=12),
    fills=st.lists(st.booleans(), min_size=12, max_size=12),
    multiple=st.sampled_from([1, 2, 8, 64]),
    max_length=st.one_of(st.none(), st.integers(1, 50)),
    pad_id=st.integers(0, 3),
)
def test_property_collate(rows, fills, multiple, max_length, pad_id):
    collate = PadCollator(pad_id, pad_to_multiple_of=multiple, max_length=max_length)
    samples = [sample(r, 100 + i, fills[i]) for i, r in enumerate(rows)]
    batch = collate(samples)
    kept = [r if max_length is None else r[:max_length] for r in rows]
    longest = max(len(r) for r in kept)
    width = -(-longest // multiple) * multiple
    assert batch["input_ids"].shape == (len(rows), width)
    assert width - longest < multiple
    assert batch["num_real_tokens"] == sum(len(r) for r in kept) == int(batch["attention_mask"].sum())
    assert batch["num_padded_tokens"] == len(rows) * width
    assert batch["indices"].tolist() == [100 + i for i in range(len(rows))]
    assert batch["is_fill"].tolist() == fills[: len(rows)]
    for i, r in enumerate(kept):
        n = len(r)
        assert batch["input_ids"][i, :n].tolist() == r
        assert (batch["input_ids"][i, n:] == pad_id).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
        if fills[i]:
            assert (batch["labels"][i] == IGNORE_INDEX).all()
        else:
            assert batch["labels"][i, :n].tolist() == r
            assert (batch["labels"][i, n:] == IGNORE_INDEX).all()


def test_step_totals_of_the_plan_reach_the_batch():
    from lit_balance.data.collate import PadCollator

    collate = PadCollator(pad_token_id=0)
    samples = [{"input_ids": [5, 6, 7], "index": 0, "step_real_tokens": 40, "step_rows": 6},
               {"input_ids": [8], "index": 1, "step_real_tokens": 40, "step_rows": 6}]
    batch = collate(samples)
    assert (batch["step_real_tokens"], batch["step_rows"], batch["step_supervised_tokens"]) == (40, 6, 34)
    assert "step_supervised_tokens" not in collate([{"input_ids": [5], "index": 0}])
