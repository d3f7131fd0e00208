"""The cache builder streams: chunked reading, tokenizing and appending give the in-memory build's entry,
byte for byte, while holding one chunk of the corpus at a time."""

from __future__ import annotations

import gc
import json
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
from _inmemory_cache import in_memory_arrays, whole_file_documents
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.data import cache as cache_module
from lit_balance.data.cache import _ARRAYS, build_cache, load_or_build
from lit_balance.data.sources import CorpusChunk, CorpusSource, resolve_corpus
from lit_balance.data.sources import base as base_module
from lit_balance.data.sources import files as files_module
from lit_balance.data.stores import flat as flat_module
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer

TOK = resolve_tokenizer()
IDS = TokenizerAdapter.for_token_ids(vocab_size=50)

# Documents that exercise the readers: unicode, tabs, a control character the tokenizer drops (an empty
# document after tokenization), and a long one that fills a chunk by itself.
DOCS = ["Hello world.", "naïve café – ünïcode", "\ttabbed  text", "\x07", "x " * 80, "short", "a, b; c."]


def _write_files(tmp_path: Path) -> dict[str, CorpusSource]:
    first = tmp_path / "a.jsonl"
    first.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps({"text": d, "n": i}) for i, d in enumerate(DOCS))
                      .encode() + b"\n\n")
    second = tmp_path / "b.jsonl"
    second.write_text("\n".join(json.dumps({"text": d[::-1]}) for d in DOCS * 3), encoding="utf-8")
    txt = tmp_path / "c.txt"
    txt.write_bytes("\n".join(DOCS).encode() + b"\r\n\r\n  \nsecond\rparagraph\r\rthird\n" + b"\n".join(
        d.encode() for d in DOCS * 2))
    return {
        "jsonl files": resolve_corpus([first, second]),
        "txt lines": resolve_corpus(txt),
        "txt paragraphs": resolve_corpus(txt, txt_documents="paragraph"),
    }


def _sources(tmp_path: Path, kind: str) -> tuple[CorpusSource, TokenizerAdapter]:
    if kind == "texts":
        return resolve_corpus(DOCS * 5 + [""]), TOK
    if kind == "token ids":
        rng = np.random.default_rng(0)
        return resolve_corpus([rng.integers(0, 50, size=n) for n in (3, 0, 1, 40, 7, 0, 12) * 4]), IDS
    if kind == "builtin":
        return resolve_corpus(None), TOK
    return _write_files(tmp_path)[kind], TOK


def _assert_entry_equals(entry: Path, reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    for name in _ARRAYS:
        np.testing.assert_array_equal(np.load(entry / f"{name}.npy"), reference[name], err_msg=name)
        expected = tmp_path / f"expected-{name}.npy"
        np.save(expected, reference[name], allow_pickle=False)
        assert (entry / f"{name}.npy").read_bytes() == expected.read_bytes(), f"{name}.npy differs from np.save"


@pytest.mark.parametrize("kind", ["jsonl files", "txt lines", "txt paragraphs", "texts", "token ids", "builtin"])
def test_the_streamed_entry_equals_the_in_memory_build(tmp_path, monkeypatch, kind):
    source, tokenizer = _sources(tmp_path, kind)
    reference = in_memory_arrays(source, tokenizer)
    if kind != "builtin":  # small chunks: many chunk boundaries, a document larger than max_chars alone
        monkeypatch.setattr(base_module, "_CHUNK_DOCS", 3)
        monkeypatch.setattr(base_module, "_CHUNK_CHARS", 40)
    entry = build_cache(source, tokenizer, tmp_path / "cache")
    _assert_entry_equals(entry, reference, tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    num_docs = len(reference["source_index"])
    assert (meta["num_docs"], meta["num_tokens"]) == (num_docs, len(reference["token_ids"]))
    total = sum(len(chunk) for chunk in source.iter_chunks())
    assert meta["num_empty"] == total - num_docs
    if kind in ("texts", "token ids", "jsonl files"):
        assert meta["num_empty"] >= 1  # the corpus holds documents that are empty after tokenization
    corpus = load_or_build(source, tokenizer, tmp_path / "cache")
    np.testing.assert_array_equal(corpus.offsets, reference["offsets"])


_PIECES = st.sampled_from(["a", "é", "word", " ", "\t", "\n", "\r", "\r\n", "\n\n", "x y", "—"])


@settings(max_examples=60)
@given(pieces=st.lists(_PIECES, max_size=60), bom=st.booleans(), mode=st.sampled_from(["line", "paragraph"]),
       max_docs=st.integers(1, 5), max_chars=st.integers(1, 12))
def test_files_read_line_by_line_give_the_whole_file_documents(tmp_path_factory, pieces, bom, mode, max_docs,
                                                               max_chars):
    path = tmp_path_factory.mktemp("read") / "corpus.txt"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(pieces).encode())
    expected = whole_file_documents(path, txt_documents=mode)
    if not expected:
        with pytest.raises(ValueError, match="corpus is empty: (no non-blank lines|every file is empty)"):
            list(resolve_corpus(path, txt_documents=mode).iter_chunks(max_docs, max_chars))
        return
    chunks = list(resolve_corpus(path, txt_documents=mode).iter_chunks(max_docs, max_chars))
    assert [doc for chunk in chunks for doc in chunk.texts] == expected
    assert [chunk.start for chunk in chunks] == np.cumsum([0] + [len(c) for c in chunks[:-1]]).tolist()
    for chunk in chunks:
        assert 1 <= len(chunk) <= max_docs
        assert len(chunk) == 1 or sum(map(len, chunk.texts)) <= max_chars


@settings(max_examples=25)
@given(texts=st.lists(st.sampled_from(DOCS + ["", "  ", "more words here"]), min_size=1, max_size=30),
       max_docs=st.integers(1, 8), max_chars=st.integers(1, 100))
def test_any_chunking_gives_the_in_memory_entry(tmp_path_factory, texts, max_docs, max_chars):
    source = resolve_corpus(texts)
    reference = in_memory_arrays(source, TOK)
    tmp_path = tmp_path_factory.mktemp("build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base_module, "_CHUNK_DOCS", max_docs)
        patch.setattr(base_module, "_CHUNK_CHARS", max_chars)
        if not len(reference["source_index"]):
            with pytest.raises(ValueError, match=f"all {len(texts)} documents .* are empty after tokenization"):
                build_cache(source, TOK, tmp_path / "cache")
            assert not list((tmp_path / "cache").iterdir())
            return
        entry = build_cache(source, TOK, tmp_path / "cache")
    _assert_entry_equals(entry, reference, tmp_path)


def _jsonl(path: Path, num_docs: int) -> Path:
    rng = np.random.default_rng(num_docs)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(num_docs):
            handle.write(json.dumps({"text": " ".join(DOCS[j] for j in rng.integers(0, len(DOCS), 3))}) + "\n")
    return path


def test_the_builder_holds_one_chunk_at_a_time(tmp_path, monkeypatch):
    """Every chunk the builder took is released once it has taken the next (counted with weak references)."""
    source = resolve_corpus(_jsonl(tmp_path / "corpus.jsonl", 170))  # 11 chunks, more than the builder may hold
    alive: list[weakref.ref] = []
    most_alive = 0
    original = CorpusSource.iter_chunks

    def counting(self, max_docs=None, max_chars=None):
        nonlocal most_alive
        for chunk in original(self, 16, max_chars):
            gc.collect()
            alive.append(weakref.ref(chunk))
            most_alive = max(most_alive, sum(ref() is not None for ref in alive))
            yield chunk

    monkeypatch.setattr(CorpusSource, "iter_chunks", counting)
    # what was alive before is frozen, so each collection walks only what the build made (the chunks among it)
    gc.collect()
    gc.freeze()
    try:
        build_cache(source, TOK, tmp_path / "cache")
    finally:
        gc.unfreeze()
    assert len(alive) == 170 // 16 + 1
    # the chunk just read, those being encoded, the one being written; none older
    assert most_alive <= cache_module._IN_FLIGHT + 2


def _traced_peak(source: CorpusSource, cache_dir: Path) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        build_cache(source, TOK, cache_dir)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_traced_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """Python and numpy allocations (tracemalloc) peak alike on corpora 10x apart; the in-memory build's grow."""
    monkeypatch.setattr(base_module, "_CHUNK_DOCS", 64)
    for module in (files_module, cache_module):  # hashing reads blocks of this size: keep them small here
        monkeypatch.setattr(module, "_HASH_BLOCK", 1 << 14)
    monkeypatch.setattr(files_module, "_READ_BLOCK", 1 << 12)  # and so does reading the documents
    small = resolve_corpus(_jsonl(tmp_path / "small.jsonl", 400))
    large = resolve_corpus(_jsonl(tmp_path / "large.jsonl", 4000))
    peaks = [_traced_peak(source, tmp_path / f"cache{i}") for i, source in enumerate((small, large))]
    assert peaks[1] < 2 * peaks[0], peaks
    gc.collect()
    tracemalloc.start()
    try:
        in_memory_arrays(large, TOK)
        in_memory_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert in_memory_peak > 4 * peaks[1], (in_memory_peak, peaks)  # what the measurement tells apart


def test_the_progress_bar_counts_documents_and_tokens(tmp_path, capsys):
    source = resolve_corpus(DOCS)
    entry = build_cache(source, TOK, tmp_path / "cache", progress=True)
    meta = json.loads((entry / "meta.json").read_text())
    err = capsys.readouterr().err
    assert f"{len(DOCS)}/{len(DOCS)}" in err and "doc/s" in err
    assert f"{meta['num_tokens']:,} tokens" in err and "tokens/s" in err


def test_a_bad_line_after_many_chunks_leaves_no_entry(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "corpus.jsonl", 300)
    with open(path, "ab") as handle:
        handle.write(b'\r{"text": "fine"}\r\n{"text": 5}\n')
    monkeypatch.setattr(base_module, "_CHUNK_DOCS", 10)
    with pytest.raises(ValueError, match=r"corpus\.jsonl', line 303: 'text' is int, expected a string"):
        build_cache(resolve_corpus(path), TOK, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_invalid_utf8_is_reported_at_its_byte_in_the_file(tmp_path):
    path = tmp_path / "late.txt"
    path.write_bytes(b"\xef\xbb\xbffirst line\r\nsecond \xe9 line\n")
    with pytest.raises(ValueError, match=r"not valid UTF-8 at byte 22; re-encode it as UTF-8"):
        list(resolve_corpus(path).iter_chunks())


def test_chunks_that_are_not_consecutive_are_refused(tmp_path, monkeypatch):
    def skipping(self, max_docs=None, max_chars=None):
        yield CorpusChunk(0, texts=["one", "two"])
        yield CorpusChunk(3, texts=["four"])

    monkeypatch.setattr(CorpusSource, "iter_chunks", skipping)
    with pytest.raises(RuntimeError, match="chunk starting at document 3 after 2 documents"):
        build_cache(resolve_corpus(["x"]), TOK, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_chunk_arguments_are_checked():
    with pytest.raises(ValueError, match="max_docs must be an int >= 1, got 0"):
        resolve_corpus(["a"]).iter_chunks(max_docs=0)
    with pytest.raises(ValueError, match="max_chars must be an int >= 1, got 2.5"):
        resolve_corpus(["a"]).iter_chunks(max_chars=2.5)
    with pytest.raises(ValueError, match="exactly one of texts, token_ids and pairs, got texts and token_ids"):
        CorpusChunk(0, texts=["a"], token_ids=[np.zeros(1, np.int64)])
    with pytest.raises(ValueError, match="exactly one of texts, token_ids and pairs, got none"):
        CorpusChunk(0)
    with pytest.raises(ValueError, match="labels go with token_ids"):
        CorpusChunk(0, texts=["a"], labels=[None])
    with pytest.raises(ValueError, match="start must be an int >= 0, got -1"):
        CorpusChunk(-1, texts=["a"])


@pytest.mark.parametrize("bad_at", [1, 2, 3, 4])
def test_decreasing_offsets_are_found_in_any_block(monkeypatch, bad_at):
    monkeypatch.setattr(flat_module, "_CHECK_BLOCK", 2)  # the cache's arrays are a FlatStore, checked in blocks
    offsets = np.array([0, 1, 2, 3, 4, 5])
    offsets[bad_at] = offsets[bad_at + 1] + 1 if bad_at < 4 else 0
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        cache_module.TokenizedCorpus(np.zeros(5, np.int32), offsets, np.arange(5), num_empty=0, vocab_size=10,
                                     pad_token_id=0)
    cache_module.TokenizedCorpus(np.zeros(5, np.int32), np.arange(6), np.arange(5), num_empty=0, vocab_size=10,
                                 pad_token_id=0)
