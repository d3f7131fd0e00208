"""PackedCollator: one row per micro-batch with Hugging Face's flattening keys, exact tensors, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.data.collate import IGNORE_INDEX, PackedCollator


def sample(ids, index, is_fill=None, **extra):
    s = {"input_ids": ids, "index": index, **extra}
    if is_fill is not None:
        s["is_fill"] = is_fill
    return s


def test_exact_tensors_keys_and_dtypes():
    batch = PackedCollator(pad_token_id=0)([sample([11, 12, 13], 7), sample([21], 2), sample([31, 32], 4)])
    assert set(batch) == {"input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                          "max_length_k", "indices", "is_fill", "num_real_tokens", "num_padded_tokens"}
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 31, 32]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, -100, 32]]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 4, 6]
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    assert batch["indices"].tolist() == [7, 2, 4]
    assert batch["is_fill"].tolist() == [False, False, False]
    assert batch["num_real_tokens"] == batch["num_padded_tokens"] == 6
    for key in ("input_ids", "position_ids", "labels", "indices"):
        assert batch[key].dtype == torch.long, key
    assert batch["cu_seq_lens_q"].dtype == batch["cu_seq_lens_k"].dtype == torch.int32
    assert batch["is_fill"].dtype == torch.bool
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["labels"].shape == (1, 6)
    assert all(type(batch[k]) is int for k in ("max_length_q", "max_length_k", "num_real_tokens", "num_padded_tokens"))
    # the two cu_seq_lens are separate tensors: a model that edits one in place leaves the other alone
    assert batch["cu_seq_lens_q"].data_ptr() != batch["cu_seq_lens_k"].data_ptr()


def test_fill_documents_labels_and_step_totals():
    samples = [sample([1, 2, 3], 0, step_real_tokens=40, step_rows=6), sample([4, 5], 1, True, step_real_tokens=40,
                                                                             step_rows=6)]
    batch = PackedCollator(0)(samples)
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100]]  # every token of the fill document masked
    assert batch["is_fill"].tolist() == [False, True]
    assert batch["num_real_tokens"] == 5  # fill tokens are computed, so counted (as PadCollator does)
    assert (batch["step_real_tokens"], batch["step_rows"], batch["step_supervised_tokens"]) == (40, 6, 34)


def test_dataset_labels_are_honoured_and_first_token_still_masked():
    samples = [sample([1, 2, 3, 4], 0, labels=[-100, -100, 3, 4], step_real_tokens=6, step_rows=2,
                      step_supervised_tokens=3),
               sample([5, 6], 1, labels=[5, 6], step_real_tokens=6, step_rows=2, step_supervised_tokens=3)]
    batch = PackedCollator(0)(samples)
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, -100, 6]]
    assert batch["step_supervised_tokens"] == 3  # the plan's own count with label masks, not rows subtracted


def test_pad_to_multiple_of_pads_the_row_tail_inside_the_last_segment():
    batch = PackedCollator(pad_token_id=9, pad_to_multiple_of=4)([sample([1, 2, 3], 0), sample([4, 5], 1)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8]
    assert batch["max_length_q"] == 5
    assert (batch["num_real_tokens"], batch["num_padded_tokens"]) == (5, 8)
    exact = PackedCollator(0, pad_to_multiple_of=4)([sample([1, 2, 3, 4], 0)])
    assert exact["num_padded_tokens"] == 4 and exact["cu_seq_lens_q"].tolist() == [0, 4]


def test_max_length_truncates_documents_and_their_labels():
    batch = PackedCollator(0, max_length=2)([sample([1, 2, 3], 0, labels=[1, -100, 3]), sample([4], 1)])
    assert batch["input_ids"].tolist() == [[1, 2, 4]]
    assert batch["labels"].tolist() == [[-100, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 3]


@pytest.mark.parametrize(("samples", "message"), [
    ([], "empty micro-batch"),
    ([sample([1], 0), sample([], 3)], "dataset index 3 has no tokens"),
    ([sample([1, 2], 5, labels=[1])], "dataset index 5 has 1 labels for 2 input_ids"),
])
def test_bad_micro_batches_raise_naming_the_problem(samples, message):
    with pytest.raises(ValueError, match=message):
        PackedCollator(0)(samples)


@pytest.mark.parametrize("kwargs", [{"pad_token_id": -1}, {"pad_token_id": 0, "pad_to_multiple_of": 0},
                                    {"pad_token_id": 0, "max_length": 0}, {"pad_token_id": True}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        PackedCollator(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=12), min_size=1, max_size=8),
       st.booleans())
def test_equals_hugging_face_data_collator_with_flattening(docs, with_labels):
    from transformers import DataCollatorWithFlattening

    rng = np.random.default_rng(len(docs))
    labels = [[t if rng.random() < 0.6 else IGNORE_INDEX for t in d] for d in docs]
    ours = PackedCollator(0)([sample(d, i, **({"labels": lab} if with_labels else {}))
                              for i, (d, lab) in enumerate(zip(docs, labels))])
    features = [{"input_ids": d, **({"labels": lab} if with_labels else {})} for d, lab in zip(docs, labels)]
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features, return_tensors="pt")
    for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["max_length_q"] == theirs["max_length_q"] and ours["max_length_k"] == theirs["max_length_k"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=10), st.integers(1, 16), st.data())
def test_invariants(lengths, multiple, data):
    fills = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    docs = [list(range(100 * i + 1, 100 * i + 1 + n)) for i, n in enumerate(lengths)]
    batch = PackedCollator(0, pad_to_multiple_of=multiple)([sample(d, i, f) for i, (d, f) in
                                                            enumerate(zip(docs, fills))])
    n = batch["num_padded_tokens"]
    assert n % multiple == 0 and sum(lengths) <= n < sum(lengths) + multiple
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == n and len(cu) == len(lengths) + 1
    assert cu[1:-1] == np.cumsum(lengths)[:-1].tolist()
    pos, labels, ids = batch["position_ids"][0], batch["labels"][0], batch["input_ids"][0]
    assert pos[cu[:-1]].tolist() == [0] * len(lengths)
    # supervised tokens: l - 1 per real document, none in fills or the tail, and never a document's first token
    assert int((labels != IGNORE_INDEX).sum()) == sum(n_ - 1 for n_, f in zip(lengths, fills) if not f)
    assert (labels[cu[:-1]] == IGNORE_INDEX).all()
    real = labels != IGNORE_INDEX
    assert torch.equal(labels[real], ids[real])
