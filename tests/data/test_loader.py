"""Map-style datasets of dicts: lengths, the micro-batch view, PadFieldsCollator and balanced_dataloader."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lit_balance import (BalancedBatchSampler, BatchingSettings, MicroBatchDataset, PadFieldsCollator,
                         balanced_dataloader, item_lengths)
from lit_balance.data.dataset import KnownLengths
from lit_balance.data.loader import MicroBatchItems
from lit_balance.plan import MicroBatch

PAD = 3


# ------------------------------------------------------------------------------------------ collator (hypothesis)
@st.composite
def _micro_batches(draw):
    """Items with token ids, optional labels of their own length, a scalar label, and the plan's metadata."""
    n = draw(st.integers(1, 6))
    with_labels = draw(st.booleans())
    items, planned = [], []
    for _ in range(n):
        ids = draw(st.lists(st.integers(4, 99), min_size=1, max_size=12))
        item = {"input_ids": ids, "label": draw(st.integers(0, 4)), "text": "x"}
        longest = len(ids)
        if with_labels:
            labels = draw(st.lists(st.integers(0, 99), min_size=0, max_size=12))
            item["labels"] = labels
            longest = max(longest, len(labels))
        items.append(item)
        planned.append(longest + draw(st.integers(0, 3)))  # a plan may count more than the fields hold
    is_fill = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    indices = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    step = draw(st.one_of(st.none(), st.tuples(st.integers(1, 10**5), st.integers(1, 100))))
    meta = MicroBatchItems(items, indices, is_fill, planned, *(step or (None, None)))
    return meta, with_labels, draw(st.integers(1, 8))


@given(_micro_batches())
def test_collator_pads_each_field_to_its_longest_row_and_stacks_scalars(case):
    items, with_labels, multiple = case
    fields = ["input_ids", "labels"] if with_labels else ["input_ids"]
    batch = PadFieldsCollator(fields, pad_token_id=PAD, scalar_fields=["label"], drop_fields=["text"],
                              pad_to_multiple_of=multiple)(items)
    fill = list(items.is_fill)
    for field, pad in (("input_ids", PAD), ("labels", -100)):
        if field not in fields:
            assert field not in batch
            continue
        rows = [item[field] for item in items]
        width = -(-max(len(r) for r in rows) // multiple) * multiple
        assert batch[field].shape == (len(items), width) and batch[field].dtype == torch.long
        for i, row in enumerate(rows):
            got = batch[field][i].tolist()
            expected = row if not (field == "labels" and fill[i]) else [-100] * len(row)
            assert got[: len(row)] == expected
            assert got[len(row):] == [pad if not (field == "labels" and fill[i]) else -100] * (width - len(row))
    lengths = [len(item["input_ids"]) for item in items]
    assert batch["attention_mask"].tolist() == [[1] * n + [0] * (batch["input_ids"].shape[1] - n) for n in lengths]
    assert "labels_attention_mask" not in batch and "text" not in batch
    assert batch["label"].tolist() == [-100 if f else item["label"] for item, f in zip(items, fill)]
    assert batch["indices"].tolist() == list(items.indices) and batch["is_fill"].tolist() == fill
    assert batch["num_real_tokens"] == sum(items.lengths)
    assert batch["num_padded_tokens"] == len(items) * (-(-max(items.lengths) // multiple) * multiple)
    if items.step_rows is None:
        assert "step_real_tokens" not in batch and "step_rows" not in batch
    else:
        assert (batch["step_real_tokens"], batch["step_rows"]) == (items.step_real_tokens, items.step_rows)
    assert "step_supervised_tokens" not in batch  # which tokens carry a loss is the model's business


def test_collator_pad_values_masks_and_dtypes():
    items = [{"decoder_input_ids": [1, 2], "attention_mask": [1, 1, 1], "input_ids": [7, 8, 9], "score": 0.5,
              "features": np.array([0.25, 0.5], dtype=np.float32)},
             {"decoder_input_ids": [4], "attention_mask": [1], "input_ids": [5], "score": 1.5,
              "features": np.array([1.0], dtype=np.float32)}]
    batch = PadFieldsCollator(["input_ids", "attention_mask", "decoder_input_ids", "features"], pad_token_id=0,
                              scalar_fields=["score"], pad_values={"decoder_input_ids": 9})(items)
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]  # the items' own mask, padded with 0
    assert batch["decoder_input_ids"].tolist() == [[1, 2], [4, 9]]
    assert batch["decoder_attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["features"].dtype == torch.float32 and batch["features"].tolist() == [[0.25, 0.5], [1.0, 0.0]]
    assert batch["features_attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["score"].tolist() == [0.5, 1.5]
    assert "indices" not in batch and batch["is_fill"].tolist() == [False, False]  # a plain list: no indices known


@pytest.mark.parametrize(("kwargs", "items", "error", "match"), [
    ({"sequence_fields": ["input_ids"]}, None, ValueError, r"'input_ids' holds token ids .* pad_token_id=tokenizer"),
    ({"sequence_fields": []}, None, ValueError, "sequence_fields is empty"),
    ({"sequence_fields": "input_ids", "pad_token_id": 0}, None, TypeError, "list of field names"),
    ({"sequence_fields": ["input_ids"], "scalar_fields": ["input_ids"], "pad_token_id": 0}, None, ValueError,
     "'input_ids' is listed in both sequence_fields and scalar_fields"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0, "pad_values": {"labels": -100}}, None, ValueError,
     r"pad_values names \['labels'\], which are not in sequence_fields"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0, "pad_to_multiple_of": 0}, None, ValueError,
     "pad_to_multiple_of must be an int >= 1, got 0"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": True}, None, TypeError, "pad_token_id must be an int"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0}, [{"input_ids": [1], "text": "a"}], ValueError,
     r"item 0 has fields \['text'\] that PadFieldsCollator does not list; add them to .*drop_fields"),
    ({"sequence_fields": ["input_ids", "labels"], "pad_token_id": 0}, [{"input_ids": [1]}], ValueError,
     r"item 0 has no field 'labels' \(its fields: \['input_ids'\]\)"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0}, [{"input_ids": [[1, 2]]}], ValueError,
     r"field 'input_ids' has shape \(1, 2\); a sequence field must be 1-D"),
    ({"sequence_fields": ["input_ids", "attention_mask"], "pad_token_id": 0},
     [{"input_ids": [1, 2], "attention_mask": [1]}], ValueError, "a mask must have one entry per token"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0}, [], ValueError, "empty micro-batch"),
    ({"sequence_fields": ["input_ids"], "pad_token_id": 0}, [[1, 2]], TypeError, "expected a mapping"),
])
def test_collator_errors_name_the_field_and_the_fix(kwargs, items, error, match):
    with pytest.raises(error, match=match):
        PadFieldsCollator(**kwargs)(items if items is not None else [{"input_ids": [1]}])


def test_a_row_longer_than_planned_is_refused_naming_the_length_to_use():
    ds = MicroBatchDataset([{"input_ids": [1, 2], "labels": [1, 2, 3, 4]}], "input_ids")
    with pytest.raises(ValueError, match=r"item 0 field 'labels' has 4 tokens but was planned at 2: .*"
                                         r"length=\['input_ids', 'labels'\]"):
        PadFieldsCollator(["input_ids", "labels"], pad_token_id=0)(ds[[0]])


# ------------------------------------------------------------------------------------------------- lengths
def test_item_lengths_from_a_field_an_int_field_several_fields_or_a_function():
    items = [{"input_ids": [1, 2, 3], "labels": [1], "n": 7}, {"input_ids": torch.tensor([4]), "labels": [5, 6],
                                                               "n": np.int64(2)}]
    assert item_lengths(items, "input_ids").tolist() == [3, 1]
    assert item_lengths(items, "n").tolist() == [7, 2]
    assert item_lengths(items, ["input_ids", "labels"]).tolist() == [3, 2]
    assert item_lengths(items, lambda item: len(item["labels"]) + 1).tolist() == [2, 3]
    assert item_lengths(items, "input_ids").dtype == np.int64


class _Items:
    """Items of a map-style dataset that count how often they are read."""

    def __init__(self, lengths):
        self.items = [{"input_ids": list(range(1, n + 1)), "labels": [1] * n} for n in lengths]
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return self.items[i]


class _DeclaresLengths(_Items, KnownLengths):
    """Declares that it knows its lengths (as a store's TokenDataset does)."""

    def lengths_of(self, fields):
        return np.array([len(item["input_ids"]) for item in self.items]) if set(fields) <= {"input_ids"} else None


class _HasLengthsOf(_Items):
    """Has a lengths_of method with the same signature, but declares nothing (and would lie)."""

    def lengths_of(self, fields):
        return np.full(len(self), 99)


class _LooksLikeHuggingFace(_Items):
    """Has a Hugging Face dataset's column_names and with_format, but is not one."""

    column_names = ["input_ids", "labels"]

    def with_format(self, kind):
        raise AssertionError("read as Arrow columns")


def test_item_lengths_asks_only_a_dataset_that_declares_its_lengths():
    declared = _DeclaresLengths([3, 1, 4])
    assert item_lengths(declared, "input_ids").tolist() == [3, 1, 4] and declared.reads == 0  # no item read
    assert item_lengths(declared, ["input_ids", "labels"]).tolist() == [3, 1, 4] and declared.reads == 3  # it did not
    # know them: read
    for undeclared in (_HasLengthsOf([3, 1, 4]), _LooksLikeHuggingFace([3, 1, 4])):  # a method or columns alone
        assert item_lengths(undeclared, "input_ids").tolist() == [3, 1, 4] and undeclared.reads == 3  # decide nothing


@pytest.mark.parametrize(("items", "length", "error", "match"), [
    ([{"ids": [1]}], "input_ids", ValueError, r"item 0 has no field 'input_ids' \(its fields: \['ids'\]\)"),
    ([{"input_ids": [1]}, {"input_ids": []}], "input_ids", ValueError, "item 1 has length 0"),
    ([{"input_ids": [1]}], 3, TypeError, "length must be a field name"),
    ([{"input_ids": [1]}], [], TypeError, "length must be a field name"),
    ([[1, 2]], "input_ids", TypeError, "item 0 is a list, expected a mapping"),
    ([{"input_ids": 1.5}], "input_ids", TypeError, "item 0 field 'input_ids' is a float"),
    ([{"input_ids": [1]}], lambda item: 2.0, TypeError, "the length of item 0 is 2.0"),
])
def test_item_lengths_errors(items, length, error, match):
    with pytest.raises(error, match=match):
        item_lengths(items, length)


# ------------------------------------------------------------------------------------------- dataset view
class _Fetches:
    """A map-style dataset with a batched fetch (as Hugging Face datasets have), counting how it is read."""

    def __init__(self, items):
        self.items, self.batched = items, 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __getitems__(self, indices):
        self.batched += 1
        return [self.items[i] for i in indices]


def test_micro_batch_dataset_fetches_a_micro_batch_at_once_and_leaves_items_unchanged():
    items = [{"input_ids": [1] * (i + 1)} for i in range(5)]
    source = _Fetches(items)
    ds = MicroBatchDataset(source, "input_ids")
    got = ds[MicroBatch([4, 1], is_fill=[False, True], step_real_tokens=40, step_rows=6)]
    assert source.batched == 1 and list(got) == [items[4], items[1]] and got[0] is items[4]
    assert (got.indices, got.is_fill, got.lengths, got.step_real_tokens, got.step_rows) == (
        (4, 1), (False, True), (5, 2), 40, 6)
    assert ds[2] is items[2] and len(ds) == 5 and items[4] == {"input_ids": [1] * 5}
    with pytest.raises(IndexError, match="index 5 out of range for a dataset of 5 items"):
        ds[[5]]


# -------------------------------------------------------------------------------------------- the loader
def _classification_items(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(5, 50, size=int(rng.integers(1, 40))).tolist(), "label": int(i % 3),
             "text": f"doc {i}"} for i in range(n)]


def test_balanced_dataloader_yields_the_samplers_micro_batches_padded():
    ds = MicroBatchDataset(_classification_items(60), "input_ids")
    sampler = BalancedBatchSampler(ds.lengths, max_tokens=64, num_replicas=1, rank=0, seed=1,
                                   pad_to_multiple_of=4)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"], drop_fields=["text"],
                                pad_to_multiple_of=4)
    loader = balanced_dataloader(ds, sampler, collate)
    batches = list(loader)
    assert len(batches) == len(loader) == len(sampler)
    assert [b["indices"].tolist() for b in batches] == [list(mb) for mb in sampler]
    assert sorted(i for b in batches for i in b["indices"].tolist()) == list(range(60))
    for b in batches:
        assert b["input_ids"].numel() <= b["num_padded_tokens"] <= 64
        assert b["attention_mask"].sum() == b["num_real_tokens"]
        assert b["label"].tolist() == [ds[i]["label"] for i in b["indices"].tolist()]


def test_balanced_dataloader_in_worker_processes_matches_the_main_process():
    ds = MicroBatchDataset(_classification_items(40, seed=3), "input_ids")
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"], drop_fields=["text"])

    def run(workers):
        sampler = BalancedBatchSampler(ds.lengths, max_tokens=64, num_replicas=2, rank=1, seed=2)
        return [(b["indices"].tolist(), b["is_fill"].tolist(), b["step_real_tokens"], b["input_ids"].tolist())
                for b in balanced_dataloader(ds, sampler, collate, num_workers=workers)]

    assert run(2) == run(0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_size": 8}, r"got \['batch_size'\]: the sampler forms the micro-batches; set batch_size through "
                        r"max_tokens / max_batch_size"),
    ({"shuffle": True, "drop_last": True}, r"got \['drop_last', 'shuffle'\]"),
])
def test_balanced_dataloader_refuses_arguments_that_replace_the_micro_batches(kwargs, match):
    ds = MicroBatchDataset(_classification_items(10), "input_ids")
    sampler = BalancedBatchSampler(ds.lengths, max_tokens=64, num_replicas=1, rank=0)
    with pytest.raises(TypeError, match=match):
        balanced_dataloader(ds, sampler, PadFieldsCollator(["input_ids"], pad_token_id=0), **kwargs)


def test_balanced_dataloader_checks_dataset_and_sampler_agree():
    items = _classification_items(10)
    ds = MicroBatchDataset(items, "input_ids")
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0)
    with pytest.raises(TypeError, match=r"wrap it: MicroBatchDataset\(dataset, length='input_ids'\)"):
        balanced_dataloader(items, BalancedBatchSampler(ds.lengths, max_tokens=64, num_replicas=1, rank=0), collate)
    with pytest.raises(ValueError, match="the sampler plans 9 samples but the dataset holds 10"):
        balanced_dataloader(ds, BalancedBatchSampler(ds.lengths[:9], max_tokens=64, num_replicas=1, rank=0), collate)
    other = ds.lengths.copy()
    other[3] += 1
    with pytest.raises(ValueError, match=rf"index 3: {other[3]} planned, {ds.lengths[3]} in the dataset"):
        balanced_dataloader(ds, BalancedBatchSampler(other, max_tokens=64, num_replicas=1, rank=0), collate)
    long = MicroBatchDataset([{"input_ids": [1] * 30}, {"input_ids": [1] * 5}], "input_ids")
    with pytest.raises(ValueError, match=r"too_long='truncate' plans 1 sample\(s\) at 16 tokens"):
        balanced_dataloader(long, BalancedBatchSampler(long.lengths, max_tokens=16, too_long="truncate",
                                                       num_replicas=1, rank=0), collate)
    with pytest.raises(TypeError, match="sampler must be a lit_balance.BalancedBatchSampler"):
        balanced_dataloader(ds, range(3), collate)


# ----------------------------------------------------------------------------- two sequences: the budget
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=80),
       max_tokens=st.integers(48, 200), multiple=st.sampled_from([1, 3, 8]), num_replicas=st.integers(1, 3),
       seed=st.integers(0, 5))
def test_source_target_micro_batches_keep_each_fields_padded_slots_within_max_tokens(lengths, max_tokens, multiple,
                                                                                       num_replicas, seed):
    items = [{"input_ids": list(range(1, s + 1)), "labels": list(range(t))} for s, t in lengths]
    ds = MicroBatchDataset(items, ["input_ids", "labels"])
    settings = BatchingSettings(max_tokens=max_tokens, pad_to_multiple_of=multiple, seed=seed)
    collate = PadFieldsCollator(["input_ids", "labels"], pad_token_id=0, pad_to_multiple_of=multiple)
    seen = []
    for rank in range(num_replicas):
        sampler = BalancedBatchSampler(ds.lengths, settings=settings, num_replicas=num_replicas, rank=rank)
        for batch in balanced_dataloader(ds, sampler, collate):
            rows = batch["input_ids"].shape[0]
            for field in ("input_ids", "labels"):
                assert batch[field].numel() <= batch["num_padded_tokens"] <= max_tokens
                assert batch[field].shape[1] % multiple == 0
            # the sum over k = 2 fields: at most 2 x max_tokens (plan with M // 2 to hold it under M)
            assert batch["input_ids"].numel() + batch["labels"].numel() <= 2 * max_tokens
            assert batch["labels"][batch["is_fill"]].eq(-100).all()
            real = batch["indices"][~batch["is_fill"]].tolist()
            for r, i in enumerate(batch["indices"].tolist()):
                s, t = lengths[i]
                assert batch["input_ids"][r, :s].tolist() == list(range(1, s + 1))
                assert batch["attention_mask"][r].sum() == s and rows == len(batch["is_fill"])
            seen.extend(real)
    assert sorted(seen) == list(range(len(items)))  # nothing lost, nothing repeated beyond fill rows


# --------------------------------------------------------------------------------- Hugging Face datasets
def test_hugging_face_dataset_lengths_read_in_arrow_equal_the_item_by_item_reading(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(4)
    items = [{"input_ids": rng.integers(5, 50, size=int(rng.integers(1, 30))).tolist(),
              "labels": rng.integers(5, 50, size=int(rng.integers(1, 30))).tolist(), "n": int(rng.integers(1, 9)),
              "label": i % 2} for i in range(200)]
    ds = datasets.Dataset.from_list(items).shuffle(seed=1).select(range(150))  # an indices mapping over the table
    rows = [ds[i] for i in range(len(ds))]
    for length in ("input_ids", ["input_ids", "labels"], "n", ["n", "input_ids"]):
        assert item_lengths(ds, length).tolist() == item_lengths(rows, length).tolist()
    # recognised by its class, datasets.Dataset: its columns are read in Arrow, no item is read
    loader_module = importlib.import_module("lit_balance.data.loader")
    want, read = item_lengths(rows, ["input_ids", "labels"]).tolist(), []
    monkeypatch.setattr(loader_module, "_length_function", lambda length: lambda item, i: read.append(i))
    assert item_lengths(ds, ["input_ids", "labels"]).tolist() == want and read == []
    monkeypatch.undo()
    # and the whole path: a micro-batch fetched with the dataset's __getitems__
    train = MicroBatchDataset(ds, ["input_ids", "labels"])
    sampler = BalancedBatchSampler(train.lengths, max_tokens=64, num_replicas=1, rank=0)
    collate = PadFieldsCollator(["input_ids", "labels"], pad_token_id=0, scalar_fields=["label", "n"])
    seen = []
    for batch in balanced_dataloader(train, sampler, collate):
        for r, i in enumerate(batch["indices"].tolist()):
            assert batch["input_ids"][r, : len(rows[i]["input_ids"])].tolist() == rows[i]["input_ids"]
            assert batch["label"][r] == rows[i]["label"]
        seen += batch["indices"].tolist()
    assert sorted(seen) == list(range(150))
    empty = datasets.Dataset.from_list([{"input_ids": [1]}, {"input_ids": []}])
    with pytest.raises(ValueError, match="item 1 has length 0"):
        item_lengths(empty, "input_ids")


def test_balanced_dataloader_asks_the_dataset_whether_its_collator_cuts_what_the_sampler_truncates():
    from lit_balance import PadCollator, TokenDataset

    lengths = [30, 5, 12]
    tokens = np.arange(1, 1 + sum(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = TokenDataset(tokens, offsets, np.arange(3), max_length=16)  # its items are cut to 16 tokens
    sampler = BalancedBatchSampler(docs.lengths, max_tokens=16, too_long="truncate", num_replicas=1, rank=0,
                                   shuffle=False)
    assert docs.cut_by_collator and not MicroBatchDataset([{"input_ids": [1]}], "input_ids").cut_by_collator
    loader = balanced_dataloader(docs, sampler, PadCollator(0, max_length=sampler.truncate_to))
    batches = list(loader)
    assert sorted(int(i) for b in batches for i in b["indices"]) == [0, 1, 2]
    assert max(int(b["input_ids"].shape[1]) for b in batches) <= sampler.truncate_to
    # the same lengths as whole items of a MicroBatchDataset are refused: its collator keeps them whole
    whole = TokenDataset(tokens, offsets, np.arange(3))
    items = MicroBatchDataset([{"input_ids": list(whole[i]["input_ids"])} for i in range(3)], "input_ids")
    with pytest.raises(ValueError, match=r"too_long='truncate' plans 1 sample\(s\) at 16 tokens"):
        balanced_dataloader(items, sampler, PadFieldsCollator(["input_ids"], pad_token_id=0))
