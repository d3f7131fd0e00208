"""Tests of BalancedTextDataModule in a single process (multi-process DDP runs live in tests/ddp)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_balance import IGNORE_INDEX, BalancedTextDataModule
from lit_balance.data.sources import builtin as corpus_module
from lit_balance.data.training_sampler import training_sampler_of
from lit_balance.data.tokenizer import TokenizerAdapter, builtin_tokenizer
from lit_balance.demo import DemoTransformerLM

BATCH_KEYS = {"input_ids", "attention_mask", "labels", "indices", "is_fill", "num_real_tokens", "num_padded_tokens",
              "step_real_tokens", "step_rows", "step_supervised_tokens"}

WORDS = (
    "the quick brown fox jumps over a lazy dog while small models read long documents about data and "
    "tokens in every batch of text on each rank for one epoch after another with some padding left"
).split()

SAMPLE_TEXT = "Return the SUM of a and b. Héllo, naïve Café! x**2 >= 3.14 — don't stop; 中文 (tokens) [x]"


def synthetic_texts(n: int, max_words: int = 30, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def encode(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in builtin_tokenizer().encode_batch(texts, add_special_tokens=False)]


def ready(dm: BalancedTextDataModule) -> BalancedTextDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def cache_entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if not p.name.startswith("."))


def row(batch: dict, i: int) -> list[int]:
    return batch["input_ids"][i, : int(batch["attention_mask"][i].sum())].tolist()


def check_batch(batch: dict, max_tokens: int, pad_token_id: int, pad_to_multiple_of: int = 1) -> None:
    """Structural invariants every batch must satisfy."""
    assert set(batch) == BATCH_KEYS
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    b, t = ids.shape
    for name in ("input_ids", "attention_mask", "labels"):
        assert batch[name].dtype == torch.long and batch[name].shape == (b, t), name
    assert batch["indices"].dtype == torch.long and batch["indices"].shape == (b,)
    assert batch["is_fill"].dtype == torch.bool and batch["is_fill"].shape == (b,)
    lengths = mask.sum(1)
    assert bool((lengths >= 1).all())
    # pad to the longest row (rounded up to the multiple), never to a model maximum
    assert t == -(-int(lengths.max()) // pad_to_multiple_of) * pad_to_multiple_of
    # the mask is a prefix of ones
    assert torch.equal(mask, (torch.arange(t)[None, :] < lengths[:, None]).long())
    assert bool((ids[mask == 0] == pad_token_id).all())
    real_rows = ~batch["is_fill"]
    assert torch.equal(labels[real_rows], ids[real_rows].masked_fill(mask[real_rows] == 0, IGNORE_INDEX))
    assert bool((labels[batch["is_fill"]] == IGNORE_INDEX).all())
    assert batch["num_real_tokens"] == int(lengths.sum())
    assert batch["num_padded_tokens"] == b * t
    assert batch["num_padded_tokens"] <= max_tokens


def expected_doc(dm: BalancedTextDataModule, dataset, index: int, limit: int | None) -> list[int]:
    doc = dm.corpus.document(int(dataset.doc_ids[index])).tolist()
    return doc[:limit] if limit is not None else doc


# --------------------------------------------------------------------------------------------------
# Built-in corpus and tokenizer


@pytest.fixture(scope="module")
def builtin_dm(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("builtin_cache")
    dm = BalancedTextDataModule(cache_dir=cache_dir)
    before = {"vocab_size": dm.vocab_size, "pad_token_id": dm.pad_token_id, "corpus": dm.corpus,
              "cache": sorted(cache_dir.iterdir())}
    ready(dm)
    return dm, before, cache_dir


def test_defaults_known_before_prepare_data(builtin_dm):
    dm, before, _ = builtin_dm
    assert before == {"vocab_size": 30522, "pad_token_id": 0, "corpus": None, "cache": []}
    assert (dm.vocab_size, dm.pad_token_id) == (30522, 0)
    assert (dm.max_tokens, dm.max_length, dm.val_fraction) == (4096, 512, 0.05)


def test_builtin_corpus_split_and_lengths(builtin_dm):
    dm, _, _ = builtin_dm
    n = len(dm.corpus)
    assert n > 2000
    assert len(dm.val_dataset) == round(0.05 * n)
    assert len(dm.train_dataset) + len(dm.val_dataset) == n
    assert len(dm.train_dataset) > 2000
    assert int(dm.corpus.lengths.min()) >= 1
    assert int(dm.train_dataset.lengths.min()) >= 1
    # max_length=512 truncates the long docstrings of the standard library
    assert int(dm.corpus.lengths.max()) > 512
    assert int(dm.train_dataset.lengths.max()) == 512
    expected = np.minimum(dm.corpus.lengths[dm.train_dataset.doc_ids], 512)
    assert np.array_equal(dm.train_dataset.lengths, expected)
    assert dm.corpus.vocab_size == 30522
    assert int(dm.corpus.token_ids.max()) < 30522


def test_builtin_train_batch(builtin_dm):
    dm, _, _ = builtin_dm
    dm.train_sampler.set_epoch(0)
    batch = next(iter(dm.train_dataloader()))
    check_batch(batch, 4096, 0)
    assert batch["input_ids"].shape[1] <= 512
    for i, index in enumerate(batch["indices"].tolist()):
        assert row(batch, i) == expected_doc(dm, dm.train_dataset, index, 512)


def test_builtin_every_epoch_covers_train_once(builtin_dm):
    dm, _, _ = builtin_dm
    num_train = len(dm.train_dataset)
    orders = []
    for epoch in (0, 1):
        dm.train_sampler.set_epoch(epoch)
        loader = dm.train_dataloader()
        batches = list(loader)
        assert len(batches) == len(loader) == len(dm.train_sampler)
        seen = []
        for batch in batches:
            assert set(batch) == BATCH_KEYS
            assert batch["num_padded_tokens"] <= 4096
            assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max()) <= 512
            assert not bool(batch["is_fill"].any())
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(num_train))
        orders.append(seen)
    assert orders[0] != orders[1]
    # little padding with length bucketing
    dm.train_sampler.set_epoch(0)


def test_builtin_val_loader_covers_val_once(builtin_dm):
    dm, _, _ = builtin_dm
    batches = list(dm.val_dataloader()[0])
    seen = [i for b in batches for i in b["indices"].tolist()]
    assert sorted(seen) == list(range(len(dm.val_dataset)))
    for batch in batches:
        check_batch(batch, 4096, 0)


def test_second_builtin_datamodule_reads_the_cache(builtin_dm, monkeypatch):
    dm, _, cache_dir = builtin_dm
    entries = cache_entries(cache_dir)
    assert len(entries) == 1

    def fail(*args, **kwargs):
        raise AssertionError("the corpus was read and tokenized again")

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", fail)
    monkeypatch.setattr(corpus_module, "stdlib_docstrings", fail)
    again = ready(BalancedTextDataModule(cache_dir=cache_dir))
    assert cache_entries(cache_dir) == entries
    assert np.array_equal(again.corpus.token_ids, dm.corpus.token_ids)
    assert np.array_equal(again.train_dataset.doc_ids, dm.train_dataset.doc_ids)


# --------------------------------------------------------------------------------------------------
# User corpora


def test_list_of_strings_content_and_empty_documents(tmp_path):
    texts = synthetic_texts(60)
    texts[3], texts[10], texts[17], texts[40] = "   ", "\u200b", "", "\u200b \t\u200b"
    assert encode(["   ", "\u200b", "", "\u200b \t\u200b"]) == [[], [], [], []]
    dm = ready(BalancedTextDataModule(texts, max_tokens=256, val_fraction=0.2, cache_dir=tmp_path))
    kept = [i for i in range(60) if i not in (3, 10, 17, 40)]
    assert dm.num_empty_documents == 4
    assert len(dm.corpus) == 56
    assert dm.corpus.source_index.tolist() == kept
    ids = encode(texts)
    for d in range(len(dm.corpus)):
        assert dm.corpus.document(d).tolist() == ids[kept[d]]
    dm.train_sampler.set_epoch(0)
    seen = []
    for batch in dm.train_dataloader():
        check_batch(batch, 256, 0)
        for i, index in enumerate(batch["indices"].tolist()):
            source = kept[int(dm.train_dataset.doc_ids[index])]
            assert row(batch, i) == ids[source]
        seen += batch["indices"].tolist()
    assert sorted(seen) == list(range(len(dm.train_dataset)))


def test_text_files_one_document_per_line(tmp_path):
    first = synthetic_texts(12, seed=1)
    second = synthetic_texts(7, seed=2)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(first[:5]) + "\n\n   \n" + "\r\n".join(first[5:]) + "\r\n", encoding="utf-8")
    b.write_bytes(b"\xef\xbb\xbf" + "\n".join(second).encode("utf-8"))
    expected = encode(first + second)
    dm = ready(BalancedTextDataModule([a, b], max_tokens=128, val_fraction=0, cache_dir=tmp_path / "cache"))
    assert len(dm.corpus) == 19
    assert dm.num_empty_documents == 0
    assert [dm.corpus.document(d).tolist() for d in range(19)] == expected
    single = ready(BalancedTextDataModule(str(a), max_tokens=128, val_fraction=0, cache_dir=tmp_path / "cache"))
    assert [single.corpus.document(d).tolist() for d in range(12)] == expected[:12]
    assert len(single.corpus) == 12


def test_jsonl_with_text_key(tmp_path):
    texts = synthetic_texts(15, seed=3)
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(texts)) + "\n\n",
                    encoding="utf-8")
    dm = ready(BalancedTextDataModule(path, text_key="body", max_tokens=128, val_fraction=0,
                                      cache_dir=tmp_path / "cache"))
    assert [dm.corpus.document(d).tolist() for d in range(len(dm.corpus))] == encode(texts)
    with pytest.raises(ValueError, match="'text'"):
        ready(BalancedTextDataModule(path, max_tokens=128, val_fraction=0, cache_dir=tmp_path / "cache"))


def test_token_id_corpus_defaults(tmp_path):
    docs = [[5, 6, 7], [8, 9], [1], [3, 3, 3, 3]]
    dm = BalancedTextDataModule(docs, max_tokens=64, val_fraction=0, cache_dir=tmp_path)
    assert (dm.vocab_size, dm.pad_token_id) == (10, 0)
    ready(dm)
    batches = list(dm.train_dataloader())
    rows = {}
    for batch in batches:
        check_batch(batch, 64, 0)
        for i, index in enumerate(batch["indices"].tolist()):
            rows[index] = row(batch, i)
    assert rows == {0: [5, 6, 7], 1: [8, 9], 2: [1], 3: [3, 3, 3, 3]}


def test_token_id_corpus_given_vocab_and_pad(tmp_path):
    docs = [np.array([5, 6, 7]), torch.tensor([8, 9]), (1,), [], [2, 2, 2, 2, 2]]
    dm = BalancedTextDataModule(docs, max_tokens=64, val_fraction=0, vocab_size=100, pad_token_id=4,
                                cache_dir=tmp_path)
    assert (dm.vocab_size, dm.pad_token_id) == (100, 4)
    ready(dm)
    assert dm.num_empty_documents == 1
    assert dm.corpus.source_index.tolist() == [0, 1, 2, 4]
    batch = next(iter(dm.train_dataloader()))
    check_batch(batch, 64, 4)
    assert sorted(batch["indices"].tolist()) == [0, 1, 2, 3]
    assert bool((batch["input_ids"][batch["attention_mask"] == 0] == 4).all())
    assert bool((batch["attention_mask"] == 0).any())
    # a pad id above every token id widens the default vocabulary
    wide = BalancedTextDataModule([[1, 2], [3]], pad_token_id=50, cache_dir=tmp_path)
    assert (wide.vocab_size, wide.pad_token_id) == (51, 50)
    with pytest.raises(ValueError, match="30"):
        BalancedTextDataModule([[1, 2], [30]], vocab_size=10, cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [({"pad_token_id": -1}, "-1"), ({"pad_token_id": 5, "vocab_size": 3}, "5"), ({"vocab_size": 2**40}, str(2**40))],
)
def test_token_id_corpus_rejects_bad_pad_or_vocab_at_construction(tmp_path, kwargs, shown):
    # vocab_size and pad_token_id are public right after construction, so they must be consistent there
    with pytest.raises((ValueError, TypeError), match=shown):
        BalancedTextDataModule([[1, 2], [0]], val_fraction=0, cache_dir=tmp_path, **kwargs)


def _word_level_tokenizer(pad_id: int | None) -> tokenizers.Tokenizer:
    """A whitespace word-level tokenizer over WORDS, with ``[PAD]`` at ``pad_id`` (or no padding token)."""
    tokens = ["[UNK]", "[X]", "[Y]"] + sorted(set(WORDS))
    if pad_id is not None:
        tokens.insert(pad_id, "[PAD]")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok


def test_tokenizers_tokenizer_object_and_json_path(tmp_path):
    tok = _word_level_tokenizer(pad_id=2)
    assert tok.token_to_id("[PAD]") == 2
    texts = synthetic_texts(30, seed=4)
    expected = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    dm = BalancedTextDataModule(texts, tok, max_tokens=128, val_fraction=0, cache_dir=tmp_path)
    assert (dm.vocab_size, dm.pad_token_id) == (tok.get_vocab_size(), 2)
    ready(dm)
    assert [dm.corpus.document(d).tolist() for d in range(30)] == expected
    for batch in dm.train_dataloader():
        check_batch(batch, 128, 2)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    for given_path in (path, str(path)):
        from_file = ready(BalancedTextDataModule(texts, given_path, max_tokens=128, val_fraction=0, cache_dir=tmp_path))
        assert (from_file.vocab_size, from_file.pad_token_id) == (tok.get_vocab_size(), 2)
        assert [from_file.corpus.document(d).tolist() for d in range(30)] == expected


def test_tokenizer_without_padding_token_needs_pad_token_id(tmp_path):
    tok = _word_level_tokenizer(pad_id=None)
    with pytest.raises(ValueError, match="pad_token_id"):
        BalancedTextDataModule(["the dog"], tok, cache_dir=tmp_path)
    dm = BalancedTextDataModule(["the dog", "a fox"], tok, pad_token_id=1, val_fraction=0, cache_dir=tmp_path)
    assert dm.pad_token_id == 1


def test_builtin_tokenizer_json_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    builtin_tokenizer().save(str(path))
    texts = [SAMPLE_TEXT, "hello world"]
    dm = ready(BalancedTextDataModule(texts, str(path), val_fraction=0, cache_dir=tmp_path / "cache"))
    assert (dm.vocab_size, dm.pad_token_id) == (30522, 0)
    assert dm.corpus.document(1).tolist() == [7592, 2088]
    assert dm.corpus.document(0).tolist() == encode([SAMPLE_TEXT])[0]


def test_huggingface_fast_tokenizer(tmp_path):
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=builtin_tokenizer(), pad_token="[PAD]")
    texts = [SAMPLE_TEXT] + synthetic_texts(20, seed=5)
    dm = BalancedTextDataModule(texts, hf, max_tokens=256, val_fraction=0, cache_dir=tmp_path)
    assert (dm.vocab_size, dm.pad_token_id) == (30522, 0)
    ready(dm)
    expected = encode(texts)
    assert hf(SAMPLE_TEXT, add_special_tokens=False)["input_ids"] == expected[0]
    assert [dm.corpus.document(d).tolist() for d in range(len(texts))] == expected
    for batch in dm.train_dataloader():
        check_batch(batch, 256, 0)


def _slow_bert_tokenizer(vocab_file: Path):
    # transformers 5 moved the pure-Python WordPiece tokenizer to BertTokenizerLegacy (BertTokenizer
    # is backed by the tokenizers library there and ignores vocab_file); transformers 4 calls it BertTokenizer.
    cls = getattr(transformers, "BertTokenizerLegacy", None) or transformers.BertTokenizer
    return cls(vocab_file=str(vocab_file))


def test_huggingface_slow_bert_tokenizer(tmp_path):
    vocab = builtin_tokenizer().get_vocab()
    assert sorted(vocab.values()) == list(range(30522))
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])), encoding="utf-8")
    slow = _slow_bert_tokenizer(vocab_file)
    assert not isinstance(getattr(slow, "backend_tokenizer", None), tokenizers.Tokenizer)
    assert len(slow) == 30522
    texts = [SAMPLE_TEXT] + synthetic_texts(20, seed=6)
    dm = BalancedTextDataModule(texts, slow, max_tokens=256, val_fraction=0, cache_dir=tmp_path / "cache")
    assert (dm.vocab_size, dm.pad_token_id) == (30522, 0)
    ready(dm)
    expected = encode(texts)
    assert [dm.corpus.document(d).tolist() for d in range(len(texts))] == expected
    for batch in dm.train_dataloader():
        check_batch(batch, 256, 0)


# --------------------------------------------------------------------------------------------------
# Tokenize once, into a cache keyed by corpus and tokenizer


def test_tokenizes_once_and_cache_keyed_by_tokenizer(tmp_path, monkeypatch):
    calls: list[int] = []
    original = TokenizerAdapter.encode_batch_deferred

    def counting(self, texts):
        texts = list(texts)
        calls.append(len(texts))
        return original(self, texts)

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", counting)
    texts = synthetic_texts(50, seed=7)
    first = BalancedTextDataModule(texts, val_fraction=0.1, cache_dir=tmp_path)
    assert calls == [] and cache_entries(tmp_path) == []
    first.prepare_data()
    assert sum(calls) == 50
    first.setup("fit")
    first.setup("validate")
    assert sum(calls) == 50
    assert len(cache_entries(tmp_path)) == 1

    second = ready(BalancedTextDataModule(texts, val_fraction=0.1, cache_dir=tmp_path))
    assert sum(calls) == 50
    assert np.array_equal(second.corpus.token_ids, first.corpus.token_ids)
    assert np.array_equal(second.train_dataset.doc_ids, first.train_dataset.doc_ids)
    assert len(cache_entries(tmp_path)) == 1

    other = ready(BalancedTextDataModule(texts, _word_level_tokenizer(pad_id=0), val_fraction=0.1, cache_dir=tmp_path))
    assert sum(calls) == 100
    assert len(cache_entries(tmp_path)) == 2
    assert other.vocab_size != first.vocab_size
    assert not np.array_equal(np.asarray(other.corpus.token_ids), np.asarray(first.corpus.token_ids))

    changed = ready(BalancedTextDataModule(texts[:-1], val_fraction=0.1, cache_dir=tmp_path))
    assert sum(calls) == 149
    assert len(cache_entries(tmp_path)) == 3
    assert len(changed.corpus) == 49


def test_setup_without_prepare_data_builds_the_cache(tmp_path):
    dm = BalancedTextDataModule(synthetic_texts(10), val_fraction=0, cache_dir=tmp_path)
    dm.setup("fit")
    assert len(dm.train_dataset) == 10
    assert len(cache_entries(tmp_path)) == 1


# --------------------------------------------------------------------------------------------------
# Bad input


def test_missing_corpus_path(tmp_path):
    missing = tmp_path / "nowhere" / "corpus.txt"
    for given_path in (missing, str(missing), [missing]):
        with pytest.raises(FileNotFoundError, match=str(missing)):
            BalancedTextDataModule(given_path, cache_dir=tmp_path)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt.*UTF-8"):
        ready(BalancedTextDataModule(path, cache_dir=tmp_path / "cache"))


def test_empty_corpora(tmp_path):
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("", encoding="utf-8")
    blank_file = tmp_path / "blank.txt"
    blank_file.write_text("\n   \n\t\n", encoding="utf-8")
    for corpus in ([], (), empty_file, blank_file, ["   ", "\u200b", ""]):
        with pytest.raises(ValueError, match="empty"):
            ready(BalancedTextDataModule(corpus, cache_dir=tmp_path / "cache"))


def test_directory_corpus(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        BalancedTextDataModule(tmp_path, cache_dir=tmp_path / "cache")


def test_unsupported_corpus_and_tokenizer_types(tmp_path):
    with pytest.raises(TypeError):
        BalancedTextDataModule(42, cache_dir=tmp_path)
    with pytest.raises(TypeError):
        BalancedTextDataModule(["a", Path("b.txt")], cache_dir=tmp_path)
    with pytest.raises(TypeError):
        BalancedTextDataModule(["a"], tokenizer=3.5, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        BalancedTextDataModule(["a"], tokenizer=tmp_path / "missing.json", cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("val_fraction", 1.0),
        ("val_fraction", -0.1),
        ("val_fraction", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -8),
        ("max_length", 0),
        ("num_workers", -1),
        ("too_long", "bogus"),
        ("pad_to_multiple_of", 8192),
        ("pad_to_multiple_of", 0),
        ("max_batch_size", 0),
        ("seed", -1),
    ],
)
def test_bad_settings_raise_at_construction_with_the_value(tmp_path, name, value):
    with pytest.raises((ValueError, TypeError)) as excinfo:
        BalancedTextDataModule(["the dog"], cache_dir=tmp_path, **{name: value})
    message = str(excinfo.value)
    assert repr(value) in message or str(value) in message
    assert name in message
    assert not tmp_path.exists() or cache_entries(tmp_path) == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("val_fraction", True), ("val_fraction", "0.1"), ("max_tokens", "4096"), ("max_tokens", 1.5),
     ("max_length", 2.5), ("num_workers", 1.0), ("max_tokens", True)],
)
def test_wrongly_typed_settings_raise_at_construction(tmp_path, name, value):
    with pytest.raises((ValueError, TypeError), match=name):
        BalancedTextDataModule(["the dog"], cache_dir=tmp_path, **{name: value})


def test_corpus_too_small_for_val_fraction(tmp_path):
    dm = BalancedTextDataModule(["the dog"], val_fraction=0.5, cache_dir=tmp_path)
    dm.prepare_data()
    with pytest.raises(ValueError, match="val_fraction"):
        dm.setup("fit")


def test_loaders_and_counts_before_setup(tmp_path):
    dm = BalancedTextDataModule(["the dog", "a fox"], cache_dir=tmp_path)
    with pytest.raises(RuntimeError):
        dm.train_dataloader()
    with pytest.raises(RuntimeError):
        dm.val_dataloader()
    with pytest.raises(RuntimeError):
        dm.num_empty_documents


# --------------------------------------------------------------------------------------------------
# Split, epochs, truncation


def test_setup_without_trainer_is_world_size_one(tmp_path):
    dm = ready(BalancedTextDataModule(synthetic_texts(40), max_tokens=128, val_fraction=0.2, cache_dir=tmp_path))
    assert dm.trainer is None
    assert (dm.train_sampler.num_replicas, dm.train_sampler.rank) == (1, 0)
    assert (dm.val_sampler.num_replicas, dm.val_sampler.rank) == (1, 0)


def test_val_fraction_zero_has_no_validation(tmp_path):
    dm = ready(BalancedTextDataModule(synthetic_texts(20), val_fraction=0, cache_dir=tmp_path))
    assert dm.val_dataloader() == []
    assert dm.val_dataset is None
    assert len(dm.train_dataset) == 20


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    texts = synthetic_texts(200, seed=8)
    texts[5] = "\u200b"

    def split(seed):
        dm = ready(BalancedTextDataModule(texts, max_tokens=128, val_fraction=0.25, seed=seed, cache_dir=tmp_path))
        return dm, dm.train_dataset.doc_ids.tolist(), dm.val_dataset.doc_ids.tolist()

    dm, train, val = split(0)
    assert len(dm.corpus) == 199
    assert len(val) == round(0.25 * 199)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(199))
    _, train_again, val_again = split(0)
    assert (train_again, val_again) == (train, val)
    _, train_other, val_other = split(1)
    assert val_other != val
    assert sorted(train_other + val_other) == list(range(199))


def test_every_epoch_yields_each_train_index_once(tmp_path):
    texts = synthetic_texts(150, max_words=60, seed=9)
    dm = ready(BalancedTextDataModule(texts, max_tokens=200, val_fraction=0.1, pad_to_multiple_of=8,
                                      cache_dir=tmp_path))
    loader = dm.train_dataloader()
    epochs = []
    for epoch in range(3):
        dm.train_sampler.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader) > 1
        seen = []
        for batch in batches:
            check_batch(batch, 200, 0, pad_to_multiple_of=8)
            assert not bool(batch["is_fill"].any())
            for i, index in enumerate(batch["indices"].tolist()):
                assert row(batch, i) == expected_doc(dm, dm.train_dataset, index, 512)
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(len(dm.train_dataset)))
        epochs.append([b["indices"].tolist() for b in batches])
    assert epochs[0] != epochs[1]
    dm.train_sampler.set_epoch(0)
    assert [b["indices"].tolist() for b in loader] == epochs[0]


def test_max_length_truncates_rows(tmp_path):
    texts = synthetic_texts(40, max_words=40, seed=10)
    dm = ready(BalancedTextDataModule(texts, max_tokens=64, max_length=7, val_fraction=0.1, cache_dir=tmp_path))
    assert int(dm.corpus.lengths.max()) > 7
    long_rows = 0
    for loader in (dm.train_dataloader(), dm.val_dataloader()[0]):
        dataset = dm.train_dataset if loader.dataset is dm.train_dataset else dm.val_dataset
        for batch in loader:
            check_batch(batch, 64, 0)
            assert batch["input_ids"].shape[1] <= 7
            for i, index in enumerate(batch["indices"].tolist()):
                assert row(batch, i) == expected_doc(dm, dataset, index, 7)
                long_rows += len(row(batch, i)) == 7
    assert long_rows > 0


def test_too_long_truncate_without_max_length(tmp_path):
    texts = synthetic_texts(60, max_words=120, seed=11)
    max_tokens = 48
    dm = ready(BalancedTextDataModule(texts, max_tokens=max_tokens, max_length=None, too_long="truncate",
                                      pad_to_multiple_of=5, val_fraction=0.2, cache_dir=tmp_path))
    truncate_to = dm.train_sampler.truncate_to
    assert truncate_to == 45
    assert int(dm.train_dataset.lengths.max()) > max_tokens
    truncated = 0
    for loader, dataset in ((dm.train_dataloader(), dm.train_dataset), (dm.val_dataloader()[0], dm.val_dataset)):
        seen = []
        for batch in loader:
            check_batch(batch, max_tokens, 0, pad_to_multiple_of=5)
            for i, index in enumerate(batch["indices"].tolist()):
                full = expected_doc(dm, dataset, index, None)
                assert row(batch, i) == full[:truncate_to]
                truncated += len(full) > truncate_to
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(len(dataset)))
    assert truncated > 0


def test_too_long_error_and_skip(tmp_path):
    texts = synthetic_texts(60, max_words=120, seed=11)
    with pytest.raises(ValueError, match="max_tokens=48"):
        ready(BalancedTextDataModule(texts, max_tokens=48, max_length=None, val_fraction=0, cache_dir=tmp_path))
    dm = ready(BalancedTextDataModule(texts, max_tokens=48, max_length=None, too_long="skip", val_fraction=0,
                                      cache_dir=tmp_path))
    long_docs = set(np.flatnonzero(dm.train_dataset.lengths > 48).tolist())
    assert long_docs and dm.train_sampler.num_skipped == len(long_docs)
    seen = []
    for batch in dm.train_dataloader():
        check_batch(batch, 48, 0)
        seen += batch["indices"].tolist()
    assert sorted(seen) == sorted(set(range(len(dm.train_dataset))) - long_docs)


# --------------------------------------------------------------------------------------------------
# Simulated ranks


def _rank_modules(corpus, world_size: int, cache_dir: Path, **kwargs) -> list[BalancedTextDataModule]:
    modules = []
    for rank in range(world_size):
        dm = BalancedTextDataModule(corpus, cache_dir=cache_dir, **kwargs)
        # a Trainer of world_size ranks as data_parallel_world reads it; no process group: ranks are not compared
        dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=0,
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world_size,
                                                                                          "rank": rank}),
                                     accumulate_grad_batches=1)
        modules.append(ready(dm))
    return modules


def _check_ranks(modules: list[BalancedTextDataModule], epochs=(0, 1)) -> int:
    """Check the per-epoch contract over simulated ranks; return the number of fill rows seen."""
    world_size = len(modules)
    max_tokens = modules[0].max_tokens
    num_train = len(modules[0].train_dataset)
    fills = 0
    for dm in modules:
        assert np.array_equal(dm.train_dataset.doc_ids, modules[0].train_dataset.doc_ids)
        assert dm.train_sampler.num_replicas == world_size
    for epoch in epochs:
        per_rank = []
        for dm in modules:
            dm.train_sampler.set_epoch(epoch)
            loader = dm.train_dataloader()
            batches = list(loader)
            assert len(batches) == len(loader)
            per_rank.append(batches)
        assert len({len(b) for b in per_rank}) == 1  # equal step counts on every rank
        real, fill = [], []
        for dm, batches in zip(modules, per_rank):
            for batch in batches:
                check_batch(batch, max_tokens, dm.pad_token_id, dm.pad_to_multiple_of)
                for i, (index, is_fill) in enumerate(zip(batch["indices"].tolist(), batch["is_fill"].tolist())):
                    (fill if is_fill else real).append(index)
                    if is_fill:
                        assert bool((batch["labels"][i] == IGNORE_INDEX).all())
        assert sorted(real) == list(range(num_train))
        assert len(fill) <= world_size - 1
        assert set(fill) <= set(real)
        fills += len(fill)
    return fills


def test_three_simulated_ranks_cover_every_train_index(tmp_path):
    texts = synthetic_texts(120, max_words=50, seed=12)
    modules = _rank_modules(texts, 3, tmp_path, max_tokens=128, val_fraction=0.1)
    assert [dm.train_sampler.rank for dm in modules] == [0, 1, 2]
    assert len(modules[0].train_dataloader()) > 3
    _check_ranks(modules)
    # validation is sharded too and covers every validation index
    val = [i for dm in modules for b in dm.val_dataloader()[0] for i, f in zip(b["indices"].tolist(),
                                                                            b["is_fill"].tolist()) if not f]
    assert sorted(val) == list(range(len(modules[0].val_dataset)))


def test_three_simulated_ranks_with_too_few_documents_use_fill_rows(tmp_path):
    modules = _rank_modules(["the quick dog", "a lazy fox jumps"], 3, tmp_path, max_tokens=64, val_fraction=0)
    assert _check_ranks(modules, epochs=(0,)) == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    world_size=st.integers(1, 4),
    max_tokens=st.integers(40, 160),
    max_length=st.sampled_from([None, 5, 17]),
    val_fraction=st.sampled_from([0, 0.2]),
    seed=st.integers(0, 3),
)
def test_simulated_ranks_property(tmp_path, lengths, world_size, max_tokens, max_length, val_fraction, seed):
    rng = np.random.default_rng(len(lengths))
    docs = [rng.integers(1, 50, size=n).tolist() for n in lengths]
    if val_fraction and len(docs) - max(1, round(val_fraction * len(docs))) < 1:
        val_fraction = 0
    modules = _rank_modules(docs, world_size, tmp_path, max_tokens=max_tokens, max_length=max_length,
                            val_fraction=val_fraction, seed=seed)
    for dm in modules:
        limit = max_length
        for index in range(len(dm.train_dataset)):
            assert dm.train_dataset[index]["input_ids"].tolist() == expected_doc(dm, dm.train_dataset, index, limit)
    _check_ranks(modules)


# --------------------------------------------------------------------------------------------------
# Workers and a real fit


def test_worker_processes_give_the_same_batches(tmp_path):
    texts = synthetic_texts(80, max_words=40, seed=13)
    dm = ready(BalancedTextDataModule(texts, max_tokens=96, val_fraction=0.1, cache_dir=tmp_path))
    workers = ready(BalancedTextDataModule(texts, max_tokens=96, val_fraction=0.1, num_workers=2, cache_dir=tmp_path))
    loader = workers.train_dataloader()
    assert loader.num_workers == 2
    for epoch in (0, 1):
        dm.train_sampler.set_epoch(epoch)
        workers.train_sampler.set_epoch(epoch)
        expected, got = list(dm.train_dataloader()), list(loader)
        assert len(expected) == len(got) > 1
        for a, b in zip(expected, got):
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    assert torch.equal(a[key], b[key]), key
                else:
                    assert a[key] == b[key], key
    val_expected, val_got = list(dm.val_dataloader()[0]), list(workers.val_dataloader()[0])
    assert [b["indices"].tolist() for b in val_expected] == [b["indices"].tolist() for b in val_got]
    del loader


class _RecordingLM(DemoTransformerLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[list[int], int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch["indices"].tolist(), int(batch["num_padded_tokens"])))
        return super().training_step(batch, batch_idx)


def test_short_fit(tmp_path):
    texts = synthetic_texts(120, max_words=40, seed=14)
    dm = BalancedTextDataModule(texts, max_tokens=128, val_fraction=0.1, cache_dir=tmp_path / "cache")
    L.seed_everything(0, verbose=False)
    model = _RecordingLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert trainer.world_size == 1
    assert dm.train_sampler.num_replicas == 1
    assert trainer.train_dataloader.sampler is dm.train_sampler
    assert training_sampler_of(trainer) is dm.train_sampler  # handed to the Trainer for the callbacks and the loss
    loss = trainer.callback_metrics["train/loss"]
    assert math.isfinite(float(loss)) and float(loss) > 0
    assert len(model.seen) == 3
    assert all(padded <= 128 for _, padded in model.seen)
    dm.trainer = None  # detached: train_dataloader() keeps the epoch set here (attached, it follows the trainer's)
    dm.train_sampler.set_epoch(0)
    planned = [b["indices"].tolist() for b in list(dm.train_dataloader())[:3]]
    assert [indices for indices, _ in model.seen] == planned


# ---------------------------------------------------------------------------------------------------
# Errors that name the corpus document and the setting to change


def test_too_long_error_names_corpus_document_and_max_length(tmp_path):
    docs = [("w " * (i % 7 + 1)).strip() for i in range(20)]
    docs[13] = "long " * 50
    dm = BalancedTextDataModule(docs, max_tokens=16, max_length=None, val_fraction=0.25, cache_dir=tmp_path)
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"document 13: 50 tokens.*set max_length <= 16"):
        dm.setup("fit")
    # with max_length the same corpus fits
    dm = ready(BalancedTextDataModule(docs, max_tokens=16, max_length=16, val_fraction=0.25, cache_dir=tmp_path))
    assert int(dm.train_dataset.lengths.max()) <= 16


def test_unplannable_validation_split_is_named(tmp_path):
    docs = ["a b"] * 19 + ["x " * 100]
    dm = BalancedTextDataModule(docs, max_tokens=16, max_length=None, too_long="skip", val_fraction=0.05,
                                seed=31, cache_dir=tmp_path)
    dm.prepare_data()
    held_out = np.random.default_rng(np.random.SeedSequence([31, 0x5EED])).permutation(20)[:1]
    assert held_out.tolist() == [19]  # the seed puts the long document alone in validation
    with pytest.raises(ValueError, match=r"validation split \(1 documents, val_fraction=0.05\).*exceed max_tokens"):
        dm.setup("fit")


def test_numpy_int_settings_and_cache_dir_that_is_a_file(tmp_path):
    dm = BalancedTextDataModule(["a b c"], max_tokens=np.int64(64), max_length=np.int32(8), val_fraction=0,
                                cache_dir=tmp_path)
    assert dm.max_tokens == 64 and dm.max_length == 8
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="cache_dir .*not_a_dir.* is not a directory"):
        BalancedTextDataModule(["a"], cache_dir=a_file)
    with pytest.raises(TypeError, match="shuffle must be True or False, got 'false'"):
        BalancedTextDataModule(["a"], shuffle="false", cache_dir=tmp_path)


def test_list_of_file_paths_is_refused_not_trained_as_text(tmp_path):
    paths = []
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("one line\nanother line\n")
        paths.append(str(tmp_path / name))
    with pytest.raises(ValueError, match="all name existing files.*pathlib.Path objects or a glob"):
        BalancedTextDataModule(paths, cache_dir=tmp_path)
    dm = ready(BalancedTextDataModule(str(tmp_path / "*.txt"), val_fraction=0, cache_dir=tmp_path / "cache"))
    assert len(dm.corpus) == 4


def test_demo_model_starts_near_uniform_loss():
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=30522)
    ids = torch.randint(0, 30522, (4, 32))
    loss = model._loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    assert abs(float(loss) - math.log(30522)) < 1.5


def test_train_dataloader_length_counts_rank_speeds_handed_over_for_the_new_epoch(tmp_path):
    """Lightning reads len(loader) before set_epoch: a loader built for epoch 1 must already count its plan."""
    dm = BalancedTextDataModule(synthetic_texts(400), max_tokens=256, val_fraction=0.0, cache_dir=tmp_path)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=0, current_epoch=0,
                                 strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    ready(dm)
    sampler = dm.train_sampler
    before = len(dm.train_dataloader())
    sampler.set_cost_model(sampler.cost_model, rank_speeds=[1.0, 0.1])  # applies from epoch 1
    dm.trainer.current_epoch = 1
    loader = dm.train_dataloader()
    assert sampler.epoch == 1 and sampler.rank_speeds is not None
    assert len(loader) == sampler.plan(1).num_micro_steps == sum(1 for _ in loader)
    assert len(loader) > before  # the slow rank's small share lengthens this epoch
    dm.trainer.current_epoch = 0  # never moved back (a restored sampler can be ahead of the trainer)
    dm.train_dataloader()
    assert sampler.epoch == 1


@pytest.mark.parametrize(
    ("tokenizer", "vocab_size", "error", "words"),
    [
        (None, -3, ValueError, ["vocab_size", "-3"]),
        (None, "x", TypeError, ["vocab_size", "'x'", "str"]),
        (None, 2.0, TypeError, ["vocab_size", "2.0", "float"]),
        (None, 5, ValueError, ["vocab_size=5", "conflicts", "30522", "leave vocab_size unset"]),
        ("word_level", 7, ValueError, ["vocab_size=7", "conflicts", "given tokenizer"]),
    ],
)
def test_vocab_size_is_checked_and_cannot_contradict_the_tokenizer(tmp_path, tokenizer, vocab_size, error, words):
    tok = _word_level_tokenizer(pad_id=0) if tokenizer else None
    with pytest.raises(error) as excinfo:
        BalancedTextDataModule(["the cat sat", "a dog ran far away"], tok, vocab_size=vocab_size, cache_dir=tmp_path)
    for word in words:
        assert word in str(excinfo.value)


def test_vocab_size_equal_to_the_tokenizers_is_accepted_and_token_ids_honour_it(tmp_path):
    dm = BalancedTextDataModule(["the cat sat"], vocab_size=30522, val_fraction=0, cache_dir=tmp_path)
    assert dm.vocab_size == 30522
    assert BalancedTextDataModule([[1, 2], [3]], vocab_size=np.int64(64), cache_dir=tmp_path).vocab_size == 64
    with pytest.raises(ValueError, match="vocab_size must be in .*got 0"):
        BalancedTextDataModule([[1, 2], [3]], vocab_size=0, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="vocab_size must be an int .*got True"):
        BalancedTextDataModule([[1, 2], [3]], vocab_size=True, cache_dir=tmp_path)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"pin_memory": "yes"}, ["pin_memory", "True or False", "'yes'"]),
    ({"pin_memory": 1}, ["pin_memory", "True or False", "int"]),
    ({"cache_dir": 5}, ["cache_dir", "directory path", "5", "int"]),
])
def test_pin_memory_and_cache_dir_types(tmp_path, kwargs, words):
    with pytest.raises(TypeError) as excinfo:
        BalancedTextDataModule(["the dog"], **{"cache_dir": tmp_path, **kwargs})
    for word in words:
        assert word in str(excinfo.value)


def test_load_state_dict_needs_a_dict(tmp_path):
    dm = BalancedTextDataModule(["the dog"], val_fraction=0, cache_dir=tmp_path)
    for bad in ([1, 2], "train_sampler", None):
        with pytest.raises(TypeError, match=r"expects the dict returned by state_dict\(\).*got .* of type"):
            dm.load_state_dict(bad)
    with pytest.raises(ValueError, match="unknown keys"):
        dm.load_state_dict({"other": 1})
    dm.load_state_dict({})  # a state saved before setup


def test_glob_pattern_in_a_list_is_refused_not_trained_as_text(tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "one document"}) + "\n", encoding="utf-8")
    pattern = str(folder / "*.jsonl")
    with pytest.raises(ValueError, match="glob patterns matching files.*a single str, not a list"):
        BalancedTextDataModule([pattern], max_tokens=64, val_fraction=0, cache_dir=tmp_path / "cache")
    dm = ready(BalancedTextDataModule(pattern, max_tokens=64, val_fraction=0, cache_dir=tmp_path / "cache"))
    assert len(dm.corpus) == 1
