"""One corpus interface: the tokenization cache is a TokenStore (a FlatStore over its arrays), one TokenizedCorpus and
one TokenDataset serve it and every store, and a multi-file store locates and reads every document as the producer's
own reader does (megatron-core's ``IndexedDataset``), across file boundaries and after pickling."""

from __future__ import annotations

import pickle
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_balance import BalancedTextDataModule
from lit_balance.data.cache import load_or_build, open_corpus
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.stores import FlatStore, MegatronSource, MegatronStore, MultiFileStore, TokenStore
from lit_balance.data.tokenizer import resolve_tokenizer
from lit_balance.data.vocabulary import decide_vocabulary
from tests.data._stores import write_megatron


def _entry_arrays(cache_dir: Path) -> dict[str, np.ndarray]:
    """The cache entry's arrays as written (read with np.load, not through the store)."""
    (entry,) = [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return {p.stem: np.load(p) for p in entry.glob("*.npy")}


@pytest.mark.parametrize("masked", [False, True])
def test_the_cache_read_through_the_token_store_interface_equals_its_arrays(tmp_path, masked):
    if masked:  # prompt-completion records: the entry holds labels (-100 on the prompts)
        records = tmp_path / "records.jsonl"
        records.write_text('{"prompt": "say hi", "completion": " hi there"}\n'
                           '{"prompt": "count", "completion": " one two three"}\n', encoding="utf-8")
        source = resolve_corpus(records)
    else:
        source = resolve_corpus(["the cat sat on the mat", "", "a dog ran far away", "hello world again and again"])
    corpus = load_or_build(source, resolve_tokenizer(), tmp_path / "cache")
    arrays = _entry_arrays(tmp_path / "cache")
    assert ("labels" in arrays) == masked
    assert isinstance(corpus.store, FlatStore) and isinstance(corpus.store, TokenStore)
    assert corpus.store.ids_in_vocabulary and len(corpus.store) == len(arrays["offsets"]) - 1
    np.testing.assert_array_equal(corpus.lengths, np.diff(arrays["offsets"]))
    np.testing.assert_array_equal(corpus.source_index, arrays["source_index"])
    dataset = TokenDataset.of(corpus)
    for doc in range(len(corpus)):
        start, end = arrays["offsets"][doc], arrays["offsets"][doc + 1]
        for length in (end - start, (end - start) // 2):
            ids, labels = corpus.store.read(doc, int(length))
            np.testing.assert_array_equal(ids, arrays["token_ids"][start:start + length])
            if "labels" in arrays:
                np.testing.assert_array_equal(labels, arrays["labels"][start:start + length])
            else:
                assert labels is None
        item = dataset[doc]
        np.testing.assert_array_equal(item["input_ids"], arrays["token_ids"][start:end])
        assert item["input_ids"].dtype == np.int32 and ("labels" in item) == ("labels" in arrays)
    labels = arrays.get("labels")
    expected = [int(np.count_nonzero(labels[a + 1:b] != -100)) if masked else b - a - 1
                for a, b in zip(arrays["offsets"][:-1], arrays["offsets"][1:])]
    assert dataset.supervised_lengths().tolist() == expected


def test_a_store_and_the_cache_give_one_corpus_and_dataset_class(tmp_path):
    docs = [[5, 6, 7], [], [8, 9], [10]]
    prefix = write_megatron(tmp_path / "corpus", docs)
    tok = decide_vocabulary(None, vocab_size=50, pad_token_id=0, holds_token_ids=True)
    in_place = open_corpus(MegatronSource(prefix), tok, tmp_path / "cache")
    cached = open_corpus(resolve_corpus(docs), tok, tmp_path / "cache")
    assert type(in_place) is type(cached)
    assert isinstance(in_place.store, MegatronStore) and isinstance(cached.store, FlatStore)
    assert not (tmp_path / "cache").exists() or [p.name for p in (tmp_path / "cache").iterdir()] != []
    np.testing.assert_array_equal(in_place.lengths, cached.lengths)
    np.testing.assert_array_equal(in_place.source_index, cached.source_index)  # the empty document dropped by both
    for dataset_a, dataset_b in [(TokenDataset.of(in_place, [2, 0], 2), TokenDataset.of(cached, [2, 0], 2))]:
        assert type(dataset_a) is type(dataset_b)
        assert [dataset_a[i]["input_ids"].tolist() for i in range(2)] == [[10], [5, 6]]
        assert [dataset_b[i]["input_ids"].tolist() for i in range(2)] == [[10], [5, 6]]


def test_a_mixture_corpus_and_one_corpus_build_one_datamodule_class(tmp_path):
    from lit_balance import Mixture

    common = {"cache_dir": tmp_path, "max_tokens": 64}
    spec = {"components": {"a": {"corpus": ["one two", "three"], "weight": 1}, "b": (["four five six"], 1)}}
    for corpus in (Mixture(spec["components"]), spec):
        dm = BalancedTextDataModule(corpus=corpus, **common)
        assert type(dm) is BalancedTextDataModule and dm.mixture.names == ("a", "b")
        restored = pickle.loads(pickle.dumps(dm))
        assert type(restored) is BalancedTextDataModule and restored.mixture.names == ("a", "b")
    one = BalancedTextDataModule(["one two"], **common)
    assert type(one) is BalancedTextDataModule and one.mixture.names == ("train",)


def _reference_documents(prefix: str) -> list[np.ndarray]:
    """Every document of ``prefix`` as megatron-core's IndexedDataset reads it (its sequences concatenated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine and Apex are missing
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [np.concatenate([dataset[s] for s in range(bounds[d], bounds[d + 1])]) if bounds[d + 1] > bounds[d]
            else np.zeros(0, np.int64) for d in range(len(bounds) - 1)]


# files of 1-6 documents (empty ones too; megatron-core's reader cannot map an empty .bin: each file holds a token)
_FILES = st.lists(st.lists(st.lists(st.integers(0, 999), max_size=12), min_size=1, max_size=6).filter(
    lambda docs: any(docs)), min_size=1, max_size=4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=_FILES, cut=st.floats(0, 1), dtype=st.sampled_from([np.uint16, np.int32]))
def test_a_multi_file_store_reads_every_document_as_megatron_core_does(files, cut, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = [str(write_megatron(Path(tmp) / f"part_{k}", docs, dtype=dtype)) for k, docs in enumerate(files)]
        store = MegatronStore(prefixes)
        assert isinstance(store, MultiFileStore)
        expected = [(k, local, doc) for k, prefix in enumerate(prefixes)
                    for local, doc in enumerate(_reference_documents(prefix))]
        assert len(store) == len(expected) == sum(len(docs) for docs in files)
        clone = pickle.loads(pickle.dumps(store))  # a worker's copy: its own descriptors, opened on first read
        for doc, (k, local, want) in enumerate(expected):
            assert int(store.lengths[doc]) == len(want)
            assert store.where(doc) == f"document {local} of {prefixes[k]}.bin"
            length = int(round(cut * len(want)))
            for reader in (store, clone):
                ids, labels = reader.read(doc, length)
                assert labels is None and ids.tolist() == want[:length].tolist()
        with pytest.raises(IndexError, match="out of range"):
            store.read(len(store), 0)
