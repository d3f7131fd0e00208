"""Tests of corpus sources, tokenizer adapters and the tokenization cache."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance._fingerprint import sha256_of
from lit_balance.data import cache as cache_module
from lit_balance.data.cache import (
    TokenizedCorpus,
    build_cache,
    cache_key,
    default_cache_dir,
    load_cache,
    load_or_build,
)
from lit_balance.data.sources import (
    BUILTIN_CORPUS,
    CorpusSource,
    resolve_corpus,
    stdlib_docstrings,
)
from lit_balance.data.sources import builtin as builtin_module
from lit_balance.data.tokenizer import TokenizerAdapter, builtin_tokenizer, resolve_tokenizer

HELLO_WORLD = [7592, 2088]


@pytest.fixture(scope="module")
def stdlib_docs() -> list[str]:
    return stdlib_docstrings()


@pytest.fixture(scope="module")
def tok() -> TokenizerAdapter:
    return resolve_tokenizer()


def _entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir())


def _forbid_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self, texts):
        raise AssertionError("the corpus was tokenized again")

    monkeypatch.setattr(TokenizerAdapter, "encode_batch", fail)


# ------------------------------------------------------------------------------------------------
# Tokenizers


def test_builtin_tokenizer_has_no_special_tokens_truncation_or_padding():
    t = builtin_tokenizer()
    assert t.get_vocab_size(with_added_tokens=True) == 30522
    assert t.token_to_id("[PAD]") == 0
    assert t.padding is None and t.truncation is None
    assert t.encode("hello world", add_special_tokens=False).ids == HELLO_WORLD


def test_resolved_builtin_tokenizer(tok):
    assert (tok.vocab_size, tok.pad_token_id) == (30522, 0)
    assert len(tok.fingerprint) == 64
    three, long = tok.encode_batch(["hello world again", " ".join(["word"] * 300)])
    assert three == [7592, 2088, 2153]
    assert long == [2773] * 300
    assert tok.encode_batch(["", "   "]) == [[], []]
    assert resolve_tokenizer(tok) is tok
    assert resolve_tokenizer(tok, pad_token_id=0) is tok
    with pytest.raises(ValueError, match="pad_token_id=3 conflicts"):
        resolve_tokenizer(tok, pad_token_id=3)


def test_user_tokenizer_is_not_mutated():
    user = tokenizers.Tokenizer.from_str(builtin_tokenizer().to_str())
    user.enable_truncation(max_length=4)
    user.enable_padding(length=8, pad_id=0, pad_token="[PAD]")
    before = user.to_str()
    adapter = resolve_tokenizer(user)
    assert adapter.encode_batch(["a b c d e f"]) == [[1037, 1038, 1039, 1040, 1041, 1042]]
    assert user.to_str() == before
    assert user.truncation["max_length"] == 4
    # still truncates to 4 and pads to 8 per its own settings
    assert user.encode("a b c d e f", add_special_tokens=False).ids == [1037, 1038, 1039, 1040, 0, 0, 0, 0]
    # truncation and padding do not change the ids we produce, hence neither the fingerprint
    assert adapter.fingerprint == resolve_tokenizer().fingerprint


def test_tokenizer_from_path_and_pad_rules(tmp_path):
    path = tmp_path / "tokenizer.json"
    builtin_tokenizer().save(str(path))
    assert resolve_tokenizer(path).fingerprint == resolve_tokenizer().fingerprint
    assert resolve_tokenizer(str(path), pad_token_id=5).pad_token_id == 5

    wordlevel = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="pad_token_id="):
        resolve_tokenizer(wordlevel)
    adapter = resolve_tokenizer(wordlevel, pad_token_id=2)
    assert (adapter.vocab_size, adapter.pad_token_id) == (3, 2)
    assert adapter.encode_batch(["a b c"]) == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"pad_token_id must be in \[0, vocab_size=3\), got 7"):
        resolve_tokenizer(wordlevel, pad_token_id=7)
    wordlevel.enable_padding(pad_id=1, pad_token="b")
    assert resolve_tokenizer(wordlevel).pad_token_id == 1


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        resolve_tokenizer(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="is a directory"):
        resolve_tokenizer(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        resolve_tokenizer(bad)
    with pytest.raises(TypeError, match="builtins.int"):
        resolve_tokenizer(42)
    with pytest.raises(TypeError, match="pre-tokenized"):
        TokenizerAdapter.for_token_ids(vocab_size=10).encode_batch(["x"])


class _FakeFastHF:
    """Duck-typed stand-in for a Hugging Face fast tokenizer."""

    def __init__(self, pad_token_id=0):
        self.backend_tokenizer = builtin_tokenizer()
        self.pad_token_id = pad_token_id
        self.calls = []

    def __len__(self):
        return 30524  # two added tokens

    def get_vocab(self):
        return self.backend_tokenizer.get_vocab()

    def __call__(self, texts, **kwargs):
        self.calls.append(kwargs)
        return {"input_ids": [e.ids for e in self.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]}


class _FakeSlowHF:
    """Duck-typed stand-in for a Hugging Face slow (pure Python) tokenizer."""

    pad_token_id = None

    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def __call__(self, texts, **kwargs):
        return {"input_ids": [[self.vocab[w] for w in text.split()] for text in texts]}


def test_hugging_face_tokenizers_are_duck_typed():
    fast = _FakeFastHF()
    adapter = resolve_tokenizer(fast)
    assert (adapter.vocab_size, adapter.pad_token_id) == (30524, 0)
    assert adapter.encode_batch(["hello world"]) == [HELLO_WORLD]
    assert fast.calls[0]["add_special_tokens"] is False and fast.calls[0]["truncation"] is False
    assert adapter.fingerprint != resolve_tokenizer().fingerprint

    slow = _FakeSlowHF({"x": 0, "y": 1, "<pad>": 2})
    with pytest.raises(ValueError, match="pad_token_id="):
        resolve_tokenizer(slow)
    adapter = resolve_tokenizer(slow, pad_token_id=2)
    assert adapter.encode_batch(["y x y"]) == [[1, 0, 1]]
    other = resolve_tokenizer(_FakeSlowHF({"x": 0, "y": 2, "<pad>": 1}), pad_token_id=2)
    assert adapter.fingerprint != other.fingerprint


# ------------------------------------------------------------------------------------------------
# Built-in corpus


def test_stdlib_docstrings_plausible_and_deterministic(stdlib_docs):
    assert 5_000 <= len(stdlib_docs) <= 30_000
    assert all(isinstance(d, str) and d.strip() for d in stdlib_docs)
    assert not any(d.startswith("\n") or d.endswith("\n") for d in stdlib_docs)  # cleaned
    assert any(d.startswith("Heap queue algorithm") for d in stdlib_docs)  # heapq's module docstring
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # results must not depend on warning filters
        again = stdlib_docstrings()
    assert again == stdlib_docs


def test_builtin_source(stdlib_docs):
    source = resolve_corpus()
    assert resolve_corpus(BUILTIN_CORPUS) == source
    assert source.kind == "builtin" and "standard library docstrings" in source.description
    assert len(source.fingerprint) == 64


def test_builtin_corpus_builds(tmp_path, tok, stdlib_docs, monkeypatch):
    monkeypatch.setattr(builtin_module, "stdlib_docstrings", lambda: list(stdlib_docs))  # extracted once already
    corpus = load_or_build(resolve_corpus(), tok, tmp_path)
    assert len(corpus) + corpus.num_empty == len(stdlib_docs)
    assert corpus.document(0).tolist() == tok.encode_batch([stdlib_docs[corpus.source_index[0]]])[0]
    assert corpus.lengths.min() >= 1 and corpus.lengths.max() > 128


# ------------------------------------------------------------------------------------------------
# Sources


def test_texts_source():
    source = resolve_corpus(("alpha", "", "beta gamma"))
    assert source.kind == "texts" and source.description == "3 text documents"
    assert source.load_texts() == ["alpha", "", "beta gamma"]
    assert resolve_corpus(["alpha", "", "beta gamma"]).fingerprint == source.fingerprint
    assert resolve_corpus(["alpha", "", "beta gammA"]).fingerprint != source.fingerprint
    assert resolve_corpus(["ab", "c"]).fingerprint != resolve_corpus(["a", "bc"]).fingerprint
    with pytest.raises(TypeError, match="load_texts"):
        source.load_token_ids()


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_bytes(b"first line\r\n\n   \nsecond line\nthird")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "json one", "id": 1}\n\n{"text": "json two"}\n', encoding="utf-8")
    single = resolve_corpus(str(txt))
    assert single.kind == "files" and single.description == "1 file: a.txt"
    assert single.load_texts() == ["first line", "second line", "third"]
    both = resolve_corpus([txt, jsonl])
    assert both.description == "2 files: a.txt, b.jsonl"
    assert both.load_texts() == ["first line", "second line", "third", "json one", "json two"]
    other_key = tmp_path / "c.jsonl"
    other_key.write_text('{"body": "x"}\n', encoding="utf-8")
    assert resolve_corpus(other_key, text_key="body").load_texts() == ["x"]
    # the fingerprint follows the file's content (size, mtime)
    before = single.fingerprint
    txt.write_text("changed content here", encoding="utf-8")
    os.utime(txt, ns=(1, 1))
    assert resolve_corpus(txt).fingerprint != before


def test_utf8_bom_is_not_part_of_the_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfhello\n")
    assert resolve_corpus(path).load_texts() == ["hello"]


def test_token_id_sources():
    docs = [[1, 2, 3], (4,), np.array([5, 6], dtype=np.uint16), torch.tensor([7, 8, 9]), []]
    source = resolve_corpus(docs)
    assert source.kind == "token_ids" and source.description == "5 pre-tokenized documents (9 tokens)"
    loaded = source.load_token_ids()
    assert [d.tolist() for d in loaded] == [[1, 2, 3], [4], [5, 6], [7, 8, 9], []]
    assert all(d.dtype == np.int64 and not d.flags.writeable for d in loaded)
    assert resolve_corpus([[1, 2], [3]]).fingerprint != resolve_corpus([[1], [2, 3]]).fingerprint
    with pytest.raises(TypeError, match="load_token_ids"):
        source.load_texts()


# ------------------------------------------------------------------------------------------------
# Source errors


def test_missing_path(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        resolve_corpus(str(missing))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        resolve_corpus([missing])


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"ok line\ncaf\xe9\n")
    source = resolve_corpus(path)
    with pytest.raises(ValueError, match=r"latin1\.txt.*not valid UTF-8 at byte 11; re-encode it as UTF-8"):
        source.load_texts()


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ('{"text": "ok"}\n\n{"text": oops}\n', r"bad\.jsonl', line 3: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"line 2: no key 'text'.*text_key="),
        ('{"text": 5}\n', r"line 1: 'text' is int, expected a string"),
        ('["text"]\n', r"line 1: expected a JSON object, got list"),
    ],
)
def test_bad_jsonl(tmp_path, content, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=pattern):
        resolve_corpus(path).load_texts()


def test_directory_and_json_rejected(tmp_path):
    with pytest.raises(ValueError, match="is a directory; pass the files"):
        resolve_corpus(tmp_path)
    path = tmp_path / "data.json"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.json is not supported"):
        resolve_corpus(path)


def test_unreadable_file(tmp_path):
    # A UNIX socket exists and is not a directory, but open() fails on it for every user, root included.
    path = tmp_path / "secret.txt"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        with pytest.raises(ValueError, match=r"secret\.txt.*cannot be read"):
            resolve_corpus(path)
    finally:
        server.close()


def test_empty_corpora(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        resolve_corpus([])
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="corpus is empty.*empty.txt"):
        resolve_corpus(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="corpus is empty.*blank.txt"):
        resolve_corpus([blank, empty]).load_texts()


def test_all_empty_after_tokenization(tmp_path, tok):
    with pytest.raises(ValueError, match="all 2 documents .* are empty after tokenization"):
        build_cache(resolve_corpus(["   ", "\t"]), tok, tmp_path)
    with pytest.raises(ValueError, match="all 2 documents"):
        load_or_build(resolve_corpus([[], []]), tok, tmp_path)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    ("corpus", "error", "pattern"),
    [
        (42, TypeError, "got int"),
        ({"a": 1}, TypeError, "got dict"),
        (["a", Path("b")], TypeError, "item 0 is texts but item 1 is files"),
        ([[1, 2], "a"], TypeError, "item 1 is texts"),
        ([1, 2], TypeError, "corpus item 0 is a int"),
        ([[1, 2.5]], TypeError, "document 0 .*first non-int value: 2.5"),
        ([[1], [True]], TypeError, "document 1 .* bool"),
        ([[1], np.zeros((2, 2), dtype=np.int64)], TypeError, r"document 1 .* shape \(2, 2\)"),
        ([[0], [3, -4]], ValueError, "document 1 .* negative id -4"),
        ([torch.tensor([0.5])], TypeError, "document 0 .* float32"),
    ],
)
def test_wrong_corpus_types(corpus, error, pattern):
    with pytest.raises(error, match=pattern):
        resolve_corpus(corpus)


def test_token_id_outside_vocabulary(tmp_path):
    with pytest.raises(ValueError, match=r"document 2 holds the token id 12, outside \[0, vocab_size=10\)"):
        build_cache(resolve_corpus([[1], [], [3, 12]]), TokenizerAdapter.for_token_ids(10), tmp_path)


def test_cache_functions_check_types(tmp_path, tok):
    with pytest.raises(TypeError, match="CorpusSource"):
        build_cache(["a"], tok, tmp_path)
    with pytest.raises(TypeError, match="TokenizerAdapter"):
        load_cache(resolve_corpus(["a"]), None, tmp_path)


# ------------------------------------------------------------------------------------------------
# Tokenized corpus and cache


def test_empty_documents_dropped_and_counted(tmp_path, tok):
    source = resolve_corpus(["hello world", "", "  ", "again", "\n"])
    corpus = load_or_build(source, tok, tmp_path)
    assert len(corpus) == 2 and corpus.num_empty == 3
    assert corpus.source_index.tolist() == [0, 3]
    assert corpus.offsets.tolist() == [0, 2, 3]
    assert corpus.token_ids.tolist() == HELLO_WORLD + [2153]
    assert corpus.token_ids.dtype == np.int32 and corpus.offsets.dtype == np.int64
    assert corpus.lengths.tolist() == [2, 1]
    assert corpus.document(-1).tolist() == [2153]
    assert (corpus.vocab_size, corpus.pad_token_id) == (30522, 0)
    with pytest.raises(IndexError):
        corpus.document(2)


def test_token_id_corpus_cache(tmp_path):
    adapter = TokenizerAdapter.for_token_ids(vocab_size=100, pad_token_id=99)
    corpus = load_or_build(resolve_corpus([[5, 6], [], np.array([7])]), adapter, tmp_path)
    assert corpus.token_ids.tolist() == [5, 6, 7]
    assert corpus.source_index.tolist() == [0, 2]
    assert (corpus.num_empty, corpus.vocab_size, corpus.pad_token_id) == (1, 100, 99)


def test_build_then_load_and_meta(tmp_path, tok):
    source = resolve_corpus(["one two three", "four", ""])
    entry = build_cache(source, tok, tmp_path)
    assert entry == tmp_path / cache_key(source, tok)
    assert _entries(tmp_path) == [entry.name]  # no temporary directory left
    assert _entries(entry) == ["meta.json", "offsets.npy", "source_index.npy", "token_ids.npy"]
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    assert (meta["num_docs"], meta["num_tokens"], meta["num_empty"]) == (2, 4, 1)
    assert meta["key"] == entry.name and set(meta["sha256"]) == {"token_ids.npy", "offsets.npy", "source_index.npy"}
    loaded = load_cache(source, tok, tmp_path)
    assert loaded.token_ids.tolist() == np.load(entry / "token_ids.npy").tolist()
    assert loaded.token_ids.tolist() == tok.encode_batch(["one two three"])[0] + tok.encode_batch(["four"])[0]
    # building again while a valid entry exists keeps that entry and leaves no temporary directory
    assert build_cache(source, tok, tmp_path) == entry
    assert _entries(tmp_path) == [entry.name]
    assert load_cache(resolve_corpus(["something else"]), tok, tmp_path) is None


def test_second_load_does_not_tokenize(tmp_path, tok, monkeypatch):
    source = resolve_corpus(["cached text", "more text"])
    first = load_or_build(source, tok, tmp_path)
    _forbid_encoding(monkeypatch)
    second = load_or_build(source, tok, tmp_path)
    assert second.token_ids.tolist() == first.token_ids.tolist()
    assert second.offsets.tolist() == first.offsets.tolist()


def _corrupt_truncate(entry: Path) -> None:
    path = entry / "token_ids.npy"
    path.write_bytes(path.read_bytes()[:-4])


def _corrupt_overwrite(entry: Path) -> None:
    path = entry / "token_ids.npy"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\xff\xff\xff\x7f"
    path.write_bytes(bytes(data))


def _corrupt_meta(entry: Path) -> None:
    (entry / "meta.json").write_text("{truncated", encoding="utf-8")


def _missing_meta(entry: Path) -> None:
    (entry / "meta.json").unlink()


def _stale_format(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    meta["format"] = -1
    (entry / "meta.json").write_text(json.dumps(meta), encoding="utf-8")


def _inconsistent_offsets(entry: Path) -> None:
    # valid checksum, wrong content: offsets decrease
    np.save(entry / "offsets.npy", np.array([0, 3, 1, 4], dtype=np.int64))
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    meta["sha256"]["offsets.npy"] = cache_module._array_sha256(entry / "offsets.npy")
    (entry / "meta.json").write_text(json.dumps(meta), encoding="utf-8")


def _wrong_dtype(entry: Path) -> None:
    np.save(entry / "token_ids.npy", np.load(entry / "token_ids.npy").astype(np.int64))
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    meta["sha256"]["token_ids.npy"] = cache_module._array_sha256(entry / "token_ids.npy")
    (entry / "meta.json").write_text(json.dumps(meta), encoding="utf-8")


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_truncate, _corrupt_overwrite, _corrupt_meta, _missing_meta, _stale_format, _inconsistent_offsets,
     _wrong_dtype],
)
def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, tok, corrupt):
    source = resolve_corpus(["a b c", "d", "e f g h"])
    entry = build_cache(source, tok, tmp_path)
    expected = load_cache(source, tok, tmp_path).token_ids.tolist()
    corrupt(entry)
    assert load_cache(source, tok, tmp_path) is None
    assert not entry.exists()  # the broken entry was removed
    corrupt(build_cache(source, tok, tmp_path))
    rebuilt = load_or_build(source, tok, tmp_path)
    assert rebuilt.token_ids.tolist() == expected
    assert rebuilt.offsets.tolist() == [0, 3, 4, 8]
    assert _entries(tmp_path) == [entry.name]


def test_different_tokenizer_different_key(tmp_path, tok):
    source = resolve_corpus(["hello world"])
    modified = builtin_tokenizer()
    modified.add_tokens(["hello world"])
    other = resolve_tokenizer(modified)
    assert other.vocab_size == 30523
    assert cache_key(source, other) != cache_key(source, tok)
    assert cache_key(source, resolve_tokenizer(pad_token_id=100)) != cache_key(source, tok)
    assert cache_key(source, tok) == cache_key(resolve_corpus(["hello world"]), resolve_tokenizer())
    first = load_or_build(source, tok, tmp_path)
    second = load_or_build(source, other, tmp_path)
    assert first.token_ids.tolist() == HELLO_WORLD
    assert second.token_ids.tolist() == [30522]
    assert len(_entries(tmp_path)) == 2


def test_progress_bar(tmp_path, tok, capsys):
    load_or_build(resolve_corpus(["a", "b", "c"]), tok, tmp_path, progress=True)
    assert "3/3" in capsys.readouterr().err


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("LIT_BALANCE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lit_balance"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "lit_balance"


def test_load_or_build_uses_default_cache_dir(monkeypatch, tmp_path, tok):
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "c"))
    source = resolve_corpus(["default dir"])
    load_or_build(source, tok)
    assert _entries(tmp_path / "c") == [cache_key(source, tok)]


def test_tokenized_corpus_validates_arrays():
    ids = np.array([1, 2, 3], dtype=np.int32)
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        TokenizedCorpus(ids.astype(np.int64), np.array([0, 3]), np.array([0]), 0, 10, 0)
    with pytest.raises(ValueError, match="offsets must run from 0"):
        TokenizedCorpus(ids, np.array([0, 2]), np.array([0]), 0, 10, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        TokenizedCorpus(ids, np.array([0, 2, 1, 3]), np.array([0, 1, 2]), 0, 10, 0)
    with pytest.raises(ValueError, match="source_index has 2 entries, expected 1"):
        TokenizedCorpus(ids, np.array([0, 3]), np.array([0, 1]), 0, 10, 0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 49), max_size=6), min_size=1, max_size=12).filter(lambda d: any(d)))
def test_token_id_round_trip(docs):
    adapter = TokenizerAdapter.for_token_ids(vocab_size=50)
    with tempfile.TemporaryDirectory() as cache_dir:
        corpus = load_or_build(resolve_corpus(docs), adapter, cache_dir)
        kept = [i for i, d in enumerate(docs) if d]
        assert corpus.source_index.tolist() == kept
        assert corpus.num_empty == len(docs) - len(kept)
        assert [corpus.document(j).tolist() for j in range(len(corpus))] == [docs[i] for i in kept]


# Runs in a spawned child through builtins.exec; the tokenizer comes from its file, and the parent
# checks that both children got the entry of the same key.
_CONCURRENT_WORKER = """
import numpy as np
from lit_balance.data.cache import load_or_build
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import resolve_tokenizer
source = resolve_corpus(texts)
tokenizer = resolve_tokenizer(tokenizer_path)
barrier.wait(timeout=60)
result = load_or_build(source, tokenizer, cache_dir)
np.savez(out, token_ids=result.token_ids, offsets=result.offsets, source_index=result.source_index)
"""


@pytest.mark.slow
def test_concurrent_builders_agree(tmp_path, tok):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    texts = [f"document number {i} " * (i % 7 + 1) for i in range(3000)] + [""]
    cache_dir = tmp_path / "cache"
    module_path = Path(cache_module.__file__)
    outs = [tmp_path / f"out{i}.npz" for i in range(2)]
    procs = [
        ctx.Process(target=exec, args=(_CONCURRENT_WORKER, {
            "tokenizer_path": str(module_path.parent / "tokenizer/tokenizer.json"),
            "texts": texts, "cache_dir": str(cache_dir), "out": str(out), "barrier": barrier}))
        for out in outs
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    source = resolve_corpus(texts)
    assert _entries(cache_dir) == [cache_key(source, tok)]  # one entry, no temporary directories
    here = load_cache(source, tok, cache_dir)
    assert here is not None and len(here) == 3000 and here.num_empty == 1
    for out in outs:
        got = np.load(out)
        for name in ("token_ids", "offsets", "source_index"):
            assert np.array_equal(got[name], getattr(here, name))


def test_corpus_source_refuses_a_bad_or_built_in_kind():
    with pytest.raises(TypeError, match="CorpusSource cannot be created: a CorpusSource subclass must define "
                                        "identity.* and read_records"):
        CorpusSource()
    with pytest.raises(ValueError, match=r"_Texts.kind = 'texts' is the kind of the built-in source TextsSource; "
                                         "choose another name"):
        class _Texts(CorpusSource):
            kind = "texts"
    for bad in ("", " ", 3):
        with pytest.raises(TypeError, match=rf"_Bad.kind must be a non-empty str .*got {bad!r}"):
            class _Bad(CorpusSource):
                kind = bad


def test_built_in_sources_are_keyed_by_their_kind_and_identity_and_pass_through(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x\n\ny\n", encoding="utf-8")
    sources = [resolve_corpus(), resolve_corpus(["a", "b"]), resolve_corpus(path),
               resolve_corpus(path, txt_documents="paragraph"), resolve_corpus([[1, 2], [3]])]
    assert [type(s).__name__ for s in sources] == ["StdlibDocstringsSource", "TextsSource", "FilesSource",
                                                   "FilesSource", "TokenIdsSource"]
    for source in sources[:-1]:
        assert source.fingerprint == sha256_of(source.kind, *source.identity())
    assert sources[-1].identity() == (sources[-1].fingerprint,)  # the sha256 of the ids themselves
    assert len({s.fingerprint for s in sources}) == len(sources)
    for source in sources:
        assert resolve_corpus(source) is source


def test_glob_pattern_and_universal_newlines(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first\rsecond\r\nthird\n")
    (tmp_path / "b.txt").write_text("fourth\n", encoding="utf-8")
    source = resolve_corpus(str(tmp_path / "*.txt"))
    assert source.kind == "files" and source.load_texts() == ["first", "second", "third", "fourth"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        resolve_corpus(str(tmp_path / "*.jsonl"))
    with pytest.raises(ValueError, match="corpus is an empty string"):
        resolve_corpus("")


def test_list_items_that_are_globs_matching_files_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    for corpus in (["*.txt"], [str(tmp_path / "*.jsonl")], ("a.txt", "*.jsonl"), ["[ab].txt"]):
        with pytest.raises(ValueError, match="glob patterns matching files.*pathlib.Path objects or a glob"):
            resolve_corpus(corpus)
    # globs matching nothing and documents that merely hold glob characters are documents
    for corpus in (["*.csv"], ["see [1] and 2 * 3", "*.txt"], ["*\0"]):
        assert resolve_corpus(corpus).kind == "texts"
