"""The fast paths of tokenizing into the cache agree with the plain ones they replace.

* reading corpus files in blocks (:func:`lit_balance.data.sources.files._file_line_blocks`) gives the lines, line numbers and
  UTF-8 errors of reading them line by line, wherever the blocks are cut;
* JSONL lines parsed by the decoder's scanner give the records and errors of ``json.loads``;
* flat ids (:meth:`TokenizerAdapter.encode_batch_flat`, :func:`encode_chunk_flat`) equal the per-document ids
  and the per-document prompt masks.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_balance.data.records import IGNORE_INDEX, encode_chunk_flat
from lit_balance.data.sources import CorpusChunk
from lit_balance.data.sources import files as files_module
from lit_balance.data.sources.files import _file_lines, _jsonl_record, _jsonl_records
from lit_balance.data.tokenizer import flat_ids, resolve_tokenizer

_BOM = b"\xef\xbb\xbf"


def _lines_one_by_one(path: Path) -> list[tuple[int, str]]:
    """The reference: the file read line by line (binary lines, each decoded alone), as the cache read it before."""
    out, number, offset = [], 0, 0
    with open(path, "rb") as handle:
        for raw in handle:
            skip = len(_BOM) if offset == 0 and raw.startswith(_BOM) else 0
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as error:
                out.append(("error", f"is not valid UTF-8 at byte {offset + skip + error.start};"))
                return out
            offset += len(raw)
            text = text.replace("\r\n", "\n").replace("\r", "\n").removesuffix("\n")
            for line in text.split("\n"):
                number += 1
                out.append((number, line))
    return out


def _lines_in_blocks(path: Path) -> list[tuple[int, str]]:
    out = []
    try:
        for item in _file_lines(path):
            out.append(item)  # noqa: PERF402  (the lines before an error are kept)
    except ValueError as error:
        message = str(error)
        out.append(("error", message[message.index("is not valid"):message.index("re-encode")].strip()))
    return out


_PIECES = st.sampled_from([b"a", b"bc", b"\n", b"\r", b"\r\n", b" ", "é".encode(), "€".encode(), "😀".encode(),
                           b"\xff", b"\xe2\x82", b'{"text": "x"}', b"\n\n", _BOM])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_PIECES, max_size=30), bom=st.booleans(), block=st.integers(1, 9))
def test_lines_read_in_blocks_equal_lines_read_one_by_one(tmp_path, monkeypatch, pieces, bom, block):
    path = tmp_path / "lines.txt"
    path.write_bytes((_BOM if bom else b"") + b"".join(pieces))
    monkeypatch.setattr(files_module, "_READ_BLOCK", block)
    assert _lines_in_blocks(path) == _lines_one_by_one(path)


def test_a_bad_byte_names_its_offset_after_the_lines_before_it(tmp_path, monkeypatch):
    path = tmp_path / "bad.txt"
    path.write_bytes(_BOM + b"one\r\ntwo\n" + "é".encode() + b"x\xffy\nfour\n")  # 3 + 5 + 4 + 2 + 1 bytes before
    monkeypatch.setattr(files_module, "_READ_BLOCK", 1 << 20)  # the whole file in one block
    lines = _file_lines(path)
    assert [next(lines), next(lines)] == [(1, "one"), (2, "two")]
    with pytest.raises(ValueError, match=r"is not valid UTF-8 at byte 15; re-encode it as UTF-8"):
        next(lines)


_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                    max_size=3), max_leaves=6)
_RECORDS = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=8)),
    st.builds(lambda p, c: {"prompt": p, "completion": c}, st.text(max_size=4), st.text(max_size=4)),
    st.dictionaries(st.sampled_from(["text", "prompt", "completion", "body"]), _VALUES, max_size=3),
    _VALUES,
)
_LINE = st.one_of(
    st.builds(lambda value, left, right: left + json.dumps(value, ensure_ascii=False) + right, _RECORDS,
              st.sampled_from(["", " ", "\t", "\ufeff"]), st.sampled_from(["", " ", " x", ", 1", "}"])),
    st.text(max_size=10),
)


def _outcome(call):
    try:
        return call()
    except (ValueError, RecursionError) as error:
        return type(error).__name__, str(error)


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINE, max_size=6), st.sampled_from(["text", "body"]))
def test_jsonl_lines_parsed_by_the_scanner_equal_json_loads(lines, text_key):
    path = Path("corpus.jsonl")

    def reference():
        return [_jsonl_record(line, f"corpus file {str(path)!r}, line {n}", text_key)
                for n, line in enumerate(lines, 7) if line.strip()]

    assert _outcome(lambda: _jsonl_records(path, lines, 7, text_key)) == _outcome(reference)


def test_flat_ids_keep_an_id_outside_int32():
    sizes, ids = flat_ids([[1, 2**31], [], [3]])
    assert sizes.tolist() == [2, 0, 1] and ids.tolist() == [1, 2**31, 3] and ids.dtype == np.int64
    sizes, ids = flat_ids([[1, 2], [3]])
    assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3]


@functools.cache
def _tokenizer(special: bool = False):
    """The built-in tokenizer's adapter, built once per value (examples only read it)."""
    return resolve_tokenizer(add_special_tokens=special)


_TEXT = st.lists(st.sampled_from(list("ab cé,.\n") + ["hello", "world", "😀"]), max_size=8).map("".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(_TEXT, max_size=8), st.booleans())
def test_encode_batch_flat_is_encode_batch_concatenated(texts, special):
    tok = _tokenizer(special)
    sizes, ids = tok.encode_batch_flat(texts)
    rows = tok.encode_batch(texts)
    assert sizes.dtype == np.int64 and ids.dtype == np.int32
    assert sizes.tolist() == [len(r) for r in rows]
    assert ids.tolist() == [i for r in rows for i in r]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=8))
def test_flat_prompt_labels_mask_each_documents_common_prefix(pairs):
    tok = _tokenizer()
    sizes, ids, labels = encode_chunk_flat(CorpusChunk(3, pairs=pairs), tok)
    expected_ids, expected_labels = [], []
    for prompt, completion in pairs:  # one document at a time, as TRL masks a prompt
        full, alone = tok.encode_batch([prompt + completion, prompt])
        common = 0
        while common < min(len(full), len(alone)) and full[common] == alone[common]:
            common += 1
        expected_ids += full
        expected_labels += [IGNORE_INDEX] * common + full[common:]
    assert sizes.sum() == len(ids) == len(labels)
    assert ids.tolist() == expected_ids and labels.tolist() == expected_labels


def test_token_id_labels_of_another_length_name_the_document():
    chunk = CorpusChunk(5, token_ids=[np.array([1, 2]), np.array([3])], labels=[None, np.array([3, 4])])
    with pytest.raises(ValueError, match=r"document 6 has 2 labels for 1 tokens"):
        encode_chunk_flat(chunk, None)
