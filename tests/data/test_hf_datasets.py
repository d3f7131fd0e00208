"""Hugging Face datasets as corpora: Dataset, DatasetDict, IterableDataset and Column, small and in memory."""

from __future__ import annotations

import sys

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance._fingerprint import sha256_of
from lit_balance.data.cache import cache_key, load_or_build
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer

datasets = pytest.importorskip("datasets")  # the "datasets" extra; part of the test extra

TEXTS = ["the cat sat", "a dog ran far away", "hello world", "one two three four five", "red house"]


@pytest.fixture(scope="module")
def tok() -> TokenizerAdapter:
    return resolve_tokenizer()


def _setup(corpus, tmp_path, **kwargs) -> BalancedTextDataModule:
    kwargs = {"max_tokens": 256, "cache_dir": tmp_path / "cache", **kwargs}
    dm = BalancedTextDataModule(corpus, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _rows(dataset) -> list[tuple[list[int], list[int] | None]]:
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        out.append((item["input_ids"].tolist(), item["labels"].tolist() if "labels" in item else None))
    return out


def test_a_dataset_with_a_text_column_trains_on_its_texts(tmp_path, tok):
    dm = _setup(datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(5))}), tmp_path, val_fraction=0)
    assert dm.source.kind == "datasets" and not dm.source.holds_token_ids
    assert sorted(ids for ids, _ in _rows(dm.train_dataset)) == sorted(tok.encode_batch(TEXTS))
    assert all(labels is None for _, labels in _rows(dm.train_dataset))  # plain texts: no labels array
    entry = next(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "offsets.npy", "source_index.npy", "token_ids.npy"]


def test_text_key_names_the_column_and_a_missing_one_is_named(tmp_path, tok):
    ds = datasets.Dataset.from_dict({"body": TEXTS})
    dm = _setup(ds, tmp_path, val_fraction=0, text_key="body")
    assert sorted(ids for ids, _ in _rows(dm.train_dataset)) == sorted(tok.encode_batch(TEXTS))
    with pytest.raises(ValueError, match=r"columns \['body'\].*'text'.*text_key="):
        BalancedTextDataModule(ds)


def test_a_pre_tokenized_dataset_with_labels_reaches_the_batches_as_given(tmp_path):
    ids = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    labels = [[-100, -100, 7, 8], [9, 10], [-100, 12, -100]]
    dm = _setup(datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}), tmp_path, val_fraction=0)
    assert dm.source.holds_token_ids and dm.vocab_size == 14
    assert sorted(_rows(dm.train_dataset)) == sorted(zip(ids, labels))
    batch = next(iter(dm.train_dataloader()))
    for row, index in enumerate(batch["indices"].tolist()):
        expected = labels[int(dm.corpus.source_index[dm.train_dataset.doc_ids[index]])]
        got = batch["labels"][row].tolist()
        assert got[: len(expected)] == expected and set(got[len(expected):]) <= {-100}
    # targets after the shift: labels 1.. that are not -100
    assert batch["step_supervised_tokens"] == 2 + 1 + 1


def test_a_pre_tokenized_dataset_without_labels_has_every_token_as_target(tmp_path):
    ids = [[5, 6, 7], [9, 10]]
    dm = _setup(datasets.Dataset.from_dict({"input_ids": ids}), tmp_path, val_fraction=0)
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == sorted(ids)
    assert dm.corpus.labels is None
    batch = next(iter(dm.train_dataloader()))
    assert batch["step_supervised_tokens"] == 3


@pytest.mark.parametrize(("ids", "labels", "match"), [
    ([[1, 2], [3]], [[1], [3]], "labels has 1 entries but input_ids has 2"),
    ([[1, 2, 3], [3, 4]], [[1, -5, 3], [3, 4]], "label -5, outside"),
    ([[1, 2, 3], [3, 4]], [[1, 2, 99], [3, 4]], "label 99, outside"),
])
def test_bad_labels_are_named(tmp_path, ids, labels, match):
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    with pytest.raises(ValueError, match=match):
        _setup(ds, tmp_path, val_fraction=0, vocab_size=10)


def test_a_dataset_dict_trains_on_train_and_validates_on_validation(tmp_path, tok):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:3]}),
                               "validation": datasets.Dataset.from_dict({"text": TEXTS[3:]}),
                               "test": datasets.Dataset.from_dict({"text": ["never read"]})})
    dm = _setup(dd, tmp_path)
    assert dm.source.split_sizes == (3, 2) and dm.val_fraction == 0.0
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == sorted(tok.encode_batch(TEXTS[:3]))
    assert sorted(i for i, _ in _rows(dm.val_dataset)) == sorted(tok.encode_batch(TEXTS[3:]))
    assert len(dm.val_dataloader()) >= 1


def test_a_dataset_dict_without_validation_uses_val_fraction(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS * 4})})
    dm = _setup(dd, tmp_path, val_fraction=0.25)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (15, 5)


def test_val_fraction_beside_a_validation_split_is_refused_and_says_what_to_pass():
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                               "validation": datasets.Dataset.from_dict({"text": TEXTS[:1]})})
    for value in (0.1, 0):
        with pytest.raises(ValueError, match=r"val_fraction=.* conflicts .*validation.*val_fraction=None.*\['train'\]"):
            BalancedTextDataModule(dd, val_fraction=value)


def test_a_dataset_dict_without_a_train_split_names_its_splits():
    dd = datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": TEXTS})})
    with pytest.raises(ValueError, match=r"splits \['validation'\] and no 'train'"):
        BalancedTextDataModule(dd)


def test_the_cache_key_follows_the_dataset_fingerprint(tok):
    a = datasets.Dataset.from_dict({"text": TEXTS})
    same = datasets.Dataset.from_dict({"text": list(TEXTS)})
    other = datasets.Dataset.from_dict({"text": TEXTS[:-1] + ["blue house"]})
    mapped = a.map(lambda row: {"text": row["text"].upper()})
    keys = [cache_key(resolve_corpus(d), tok) for d in (a, same, other, mapped)]
    assert keys[0] == keys[1] and len(set(keys)) == 3
    source = resolve_corpus(a)
    assert source.identity() == ("texts", "text", a._fingerprint, "5")
    assert source.fingerprint == sha256_of("datasets", *source.identity()) and resolve_corpus(source) is source


class _Counting:
    """A generator function for IterableDataset.from_generator that counts how often it is read."""

    def __init__(self, texts):
        self.texts, self.reads = texts, 0

    def __call__(self):
        self.reads += 1
        yield from ({"text": t} for t in self.texts)


def test_an_iterable_dataset_is_read_once_into_the_cache_keyed_by_its_content(tmp_path, tok, monkeypatch):
    gen = _Counting(TEXTS)
    it = datasets.IterableDataset.from_generator(gen)
    source = resolve_corpus(it, max_documents=100)
    assert source.key_after_reading
    reads = gen.reads  # describing it may peek at the first row (columns of a generator without features)
    corpus = load_or_build(source, tok, tmp_path)
    assert gen.reads == reads + 1 and not source.key_after_reading
    assert sorted(corpus.document(i).tolist() for i in range(len(corpus))) == sorted(tok.encode_batch(TEXTS))
    load_or_build(source, tok, tmp_path)  # the same process: the key is known, nothing is read again
    assert gen.reads == reads + 1
    entries = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    # the same content in another process (a fresh source) finds the same entry; other content makes another
    load_or_build(resolve_corpus(datasets.IterableDataset.from_generator(_Counting(list(TEXTS))), max_documents=100), tok,
                  tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == entries
    load_or_build(resolve_corpus(datasets.IterableDataset.from_generator(_Counting(TEXTS[:2])), max_documents=100), tok,
                  tmp_path)
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2


def test_an_iterable_dataset_through_the_data_module(tmp_path, tok):
    dm = _setup(datasets.Dataset.from_dict({"text": TEXTS}).to_iterable_dataset(), tmp_path, val_fraction=0,
                max_documents=100)
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == sorted(tok.encode_batch(TEXTS))


def test_an_iterable_dataset_of_token_ids_needs_vocab_size(tmp_path):
    it = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).to_iterable_dataset()
    with pytest.raises(ValueError, match="pass vocab_size="):
        BalancedTextDataModule(it, max_documents=10)
    dm = _setup(it, tmp_path, val_fraction=0, vocab_size=8, max_documents=10)
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == [[1, 2], [3]]


def test_a_column_is_a_corpus(tmp_path, tok):
    ds = datasets.Dataset.from_dict({"body": TEXTS, "input_ids": [[1, 2]] * 5})
    dm = _setup(ds["body"], tmp_path, val_fraction=0)
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == sorted(tok.encode_batch(TEXTS))
    dm = _setup(ds["input_ids"], tmp_path, val_fraction=0)
    assert dm.source.holds_token_ids and [i for i, _ in _rows(dm.train_dataset)] == [[1, 2]] * 5


def test_prompt_completion_columns_mask_the_prompt(tmp_path, tok):
    ds = datasets.Dataset.from_dict({"prompt": ["hello"], "completion": [" world again"]})
    dm = _setup(ds, tmp_path, val_fraction=0)
    (ids, labels), = _rows(dm.train_dataset)
    assert ids == tok.encode_batch(["hello world again"])[0]
    assert labels == [-100] + ids[1:]


def test_an_empty_dataset_and_unusable_columns_are_refused():
    with pytest.raises(ValueError, match="empty"):
        BalancedTextDataModule(datasets.Dataset.from_dict({"text": []}))
    with pytest.raises(ValueError, match=r"columns \['prompt'\].*'prompt' and 'completion'"):
        BalancedTextDataModule(datasets.Dataset.from_dict({"prompt": ["a"]}))
    with pytest.raises(TypeError, match="row 1.*expected a string"):
        _ = resolve_corpus(datasets.Dataset.from_dict({"text": ["a", None]})).load_texts()


def test_without_datasets_installed_the_error_names_the_extra(monkeypatch):
    fake = type("Dataset", (), {"__module__": "datasets.arrow_dataset"})()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[datasets\]"'):
        resolve_corpus(fake)


def _endless():
    """A stream that never ends, as a large ``load_dataset(..., streaming=True)`` is to a reader."""
    i = 0
    while True:
        yield {"text": f"document number {i}"}
        i += 1


def test_an_iterable_dataset_without_a_bound_is_refused_naming_max_documents(tmp_path):
    endless = datasets.IterableDataset.from_generator(_endless)
    with pytest.raises(ValueError, match=r"IterableDataset.*max_documents=") as refused:
        BalancedTextDataModule(endless, cache_dir=tmp_path)
    assert refused.value.parameter == "max_documents"
    with pytest.raises(ValueError, match=r"max_documents=3 bounds .*IterableDataset"):
        BalancedTextDataModule(TEXTS, max_documents=3, cache_dir=tmp_path)  # a corpus with an end takes no bound


def test_reading_an_endless_iterable_dataset_stops_at_max_documents(tmp_path, tok):
    dm = _setup(datasets.IterableDataset.from_generator(_endless), tmp_path, val_fraction=0, max_documents=30)
    expected = tok.encode_batch([f"document number {i}" for i in range(30)])
    assert len(dm.corpus) == 30
    assert sorted(i for i, _ in _rows(dm.train_dataset)) == sorted(expected)
