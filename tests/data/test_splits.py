"""The train/validation split (lit_balance.data.splits): seeded, disjoint, complete, with clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_balance.data.cache import TokenizedCorpus
from lit_balance.data.splits import DEFAULT_VAL_FRACTION, resolve_val_fraction, split_corpus, split_documents
from lit_balance.errors import InputTypeError, InputValueError


@given(num_documents=st.integers(1, 300), val_fraction=st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.9]),
       seed=st.integers(0, 2**32 - 1))
def test_every_document_lands_in_exactly_one_split_and_the_count_is_the_fraction(num_documents, val_fraction, seed):
    expected_val = max(round(val_fraction * num_documents), 1) if val_fraction > 0 else 0
    if num_documents - expected_val < 1:
        with pytest.raises(InputValueError, match="leaves none for training"):
            split_documents(num_documents, val_fraction=val_fraction, seed=seed)
        return
    train, val = split_documents(num_documents, val_fraction=val_fraction, seed=seed)
    assert len(val) == expected_val
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(num_documents))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)  # sorted, no repeats
    assert train.dtype == val.dtype == np.int64


def test_the_split_is_the_documented_seeded_permutation_and_depends_on_the_seed():
    train, val = split_documents(100, val_fraction=0.2, seed=7)
    perm = np.random.default_rng(np.random.SeedSequence([7, 0x5EED])).permutation(100)
    assert np.array_equal(val, np.sort(perm[:20])) and np.array_equal(train, np.sort(perm[20:]))
    again, _ = split_documents(100, val_fraction=0.2, seed=7)
    other, _ = split_documents(100, val_fraction=0.2, seed=8)
    assert np.array_equal(train, again) and not np.array_equal(train, other)


def test_a_corpus_with_its_own_validation_split_is_split_by_source_index():
    # source rows 0..5 train, 6..8 validate; documents 2 and 7 of the source were empty (not in the corpus)
    source_index = np.array([0, 1, 3, 4, 5, 6, 8])
    train, val = split_documents(7, val_fraction=0.0, seed=0, source_index=source_index, split_sizes=(6, 3))
    assert train.tolist() == [0, 1, 2, 3, 4] and val.tolist() == [5, 6]


@pytest.mark.parametrize(("source_index", "which"), [([6, 7], "training"), ([0, 1], "validation")])
def test_an_own_split_left_empty_after_tokenization_is_named(source_index, which):
    with pytest.raises(InputValueError, match=f"every document of the corpus' {which} split is empty"):
        split_documents(2, val_fraction=0.0, seed=0, source_index=np.array(source_index), split_sizes=(6, 3))


def test_an_own_split_needs_the_source_index():
    with pytest.raises(InputValueError, match="needs source_index") as err:
        split_documents(3, val_fraction=0.0, seed=0, split_sizes=(2, 1))
    assert err.value.parameter == "source_index"


def test_too_few_documents_name_the_setting_and_the_counts():
    with pytest.raises(InputValueError, match=r"has 1 document\(s\); val_fraction=0.5 leaves none") as err:
        split_documents(1, val_fraction=0.5, seed=0)
    assert err.value.parameter == "val_fraction" and "lower val_fraction or add documents" in str(err.value)


def test_resolve_val_fraction_defaults_and_checks():
    assert resolve_val_fraction(None) == DEFAULT_VAL_FRACTION
    assert resolve_val_fraction(None, split_sizes=(10, 2)) == 0.0
    assert resolve_val_fraction(np.float32(0.25)) == 0.25 and type(resolve_val_fraction(0)) is float
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(InputValueError, match=r"val_fraction must be a finite number in \[0, 1\)"):
            resolve_val_fraction(bad)
    for bad in (True, "0.1"):
        with pytest.raises(InputTypeError, match="val_fraction must be a real number"):
            resolve_val_fraction(bad)
    with pytest.raises(InputValueError, match=r"val_fraction=0.1 conflicts with the corpus' own validation split "
                                              r"\(2 rows") as err:
        resolve_val_fraction(0.1, split_sizes=(10, 2))
    assert err.value.parameter == "val_fraction"


def test_split_corpus_builds_truncated_datasets_with_labels():
    lengths = np.array([3, 5, 2, 4])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_ids = np.arange(1, offsets[-1] + 1, dtype=np.int32)
    labels = token_ids.copy()
    labels[0] = -100
    corpus = TokenizedCorpus(token_ids, offsets, np.arange(4), num_empty=0, vocab_size=100, pad_token_id=0,
                             labels=labels)
    train, val = split_corpus(corpus, val_fraction=0.25, seed=1, max_length=3)
    train_docs, val_docs = split_documents(4, val_fraction=0.25, seed=1)
    assert np.array_equal(train.doc_ids, train_docs) and np.array_equal(val.doc_ids, val_docs)
    assert train.lengths.tolist() == np.minimum(lengths[train_docs], 3).tolist()
    assert train.labels is labels and val.labels is labels
    none_held_out = split_corpus(corpus, val_fraction=0.0, seed=1, max_length=None)
    assert none_held_out[1] is None and none_held_out[0].lengths.tolist() == lengths.tolist()
