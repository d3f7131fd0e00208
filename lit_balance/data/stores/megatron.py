"""Megatron ``.bin/.idx`` stores read in place: :class:`MegatronSource` and :class:`MegatronStore`.

Megatron's ``preprocess_data.py``, NeMo Curator and datatrove's Megatron writer all write this pair through
megatron-core's ``IndexedDatasetBuilder``: the ``.bin`` holds every sequence's token ids back to back, the ``.idx``
(layout of ``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter`` / ``_IndexReader``)::

    9 bytes   b"MMIDIDX\\x00\\x00"
    <Q        version (1)
    <B        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    <Q        sequence count S
    <Q        document count D (entries of the document index: documents + 1)
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offsets into the .bin)
    int64[D]  document index: document d is sequences [index[d], index[d + 1])
    int8[S]   sequence modes (multimodal stores only; ignored here)

A document is Megatron's document (its sequences are contiguous in the ``.bin``; ``--split-sentences`` makes one
sequence per sentence), so its length is the sum of its sequences' lengths. The index is memory-mapped with NumPy;
the ``.bin`` is read per document with ``os.pread`` (a descriptor per process) and only the tokens of the documents
read are touched. Opening checks the index in one pass (see :class:`MegatronStore`); reading checks that neither file
changed on disk since (:mod:`lit_balance.data.stores._files`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.data.stores._files import FileStamp, TokenFile, check_distinct
from lit_balance.data.stores.base import StoreSource, TokenStore
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["MEGATRON_DTYPES", "MegatronSource", "MegatronStore"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = np.dtype([("magic", "S9"), ("version", "<u8"), ("code", "u1"), ("sequences", "<u8"), ("documents", "<u8")])
#: megatron-core's ``DType`` codes of the ``.idx`` header and the NumPy dtype each stands for.
MEGATRON_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
                   5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
_BLOCK = 1 << 22  # index entries checked per step (no temporary as large as a 100M-entry index)


def _prefix(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"a Megatron store is named by its path prefix (str or os.PathLike, the .bin/.idx pair "
                             f"without suffix), got {type(path).__name__} {path!r:.80}", parameter="corpus")
    text = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


class _Index:
    """One ``.idx`` file, checked, its arrays memory-mapped."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise InputFileNotFoundError(f"Megatron store {prefix!r}: {path} does not exist (a store is the pair "
                                             "PREFIX.bin and PREFIX.idx; pass the prefix)", parameter="corpus")
        self.idx_stamp, self.bin_stamp = FileStamp(self.idx_path), FileStamp(self.bin_path)
        idx_size, self.bin_size = self.idx_stamp.size, self.bin_stamp.size
        if idx_size < _HEADER.itemsize:
            raise InputValueError(f"{self.idx_path} is not a Megatron index: {idx_size} bytes, shorter than the "
                                  f"{_HEADER.itemsize}-byte header", parameter="corpus")
        header = np.fromfile(self.idx_path, dtype=_HEADER, count=1)[0]
        if bytes(header["magic"]).ljust(9, b"\x00") != _MAGIC:
            raise InputValueError(f"{self.idx_path} is not a Megatron index: it starts with "
                                  f"{bytes(header['magic'])!r}, expected {_MAGIC!r}", parameter="corpus")
        version, code = int(header["version"]), int(header["code"])
        if version != 1:
            raise InputValueError(f"{self.idx_path} is a Megatron index of version {version}; only version 1 (what "
                                  "megatron-core's IndexedDatasetBuilder writes) is read", parameter="corpus")
        if code not in MEGATRON_DTYPES:
            raise InputValueError(f"{self.idx_path} has the dtype code {code}, which is none of megatron-core's "
                                  f"{sorted(MEGATRON_DTYPES)}", parameter="corpus")
        self.dtype = MEGATRON_DTYPES[code]
        if self.dtype.kind not in "iu":
            raise InputValueError(f"{self.idx_path} holds {self.dtype} values, not token ids (an integer dtype)",
                                  parameter="corpus")
        s, d = int(header["sequences"]), int(header["documents"])
        plain = _HEADER.itemsize + 12 * s + 8 * d
        if idx_size not in (plain, plain + s):  # + s: the sequence modes of a multimodal store
            raise InputValueError(f"{self.idx_path} is {idx_size} bytes, but its header ({s} sequences, {d} document "
                                  f"index entries) needs {plain}: the file is truncated or not a Megatron index",
                                  parameter="corpus")
        if d < 1:
            raise InputValueError(f"{self.idx_path} has an empty document index (it must hold at least 0)",
                                  parameter="corpus")
        self.num_sequences, self.num_entries = s, d
        self._check()
        self._map()

    def _map(self) -> None:
        """Memory-map the three arrays (no byte is read until an entry is)."""
        s, d, offset = self.num_sequences, self.num_entries, _HEADER.itemsize
        self.sequence_lengths = np.memmap(self.idx_path, np.int32, "r", offset, (s,)) if s else np.zeros(0, np.int32)
        self.pointers = np.memmap(self.idx_path, np.int64, "r", offset + 4 * s, (s,)) if s else np.zeros(0, np.int64)
        self.documents = np.memmap(self.idx_path, np.int64, "r", offset + 12 * s, (d,))

    def __getstate__(self) -> dict[str, Any]:  # the maps are reopened, not pickled (a memmap pickles as a copy)
        skip = ("sequence_lengths", "pointers", "documents", "_doc_lengths")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._doc_lengths = None
        self._map()

    def _block(self, dtype: Any, base: int, start: int, count: int) -> np.ndarray:
        """``count`` entries from entry ``start`` of the array at byte ``base``, read with a plain file read (pages
        of a read are not kept mapped, so a pass over a large index does not grow the resident memory)."""
        dtype = np.dtype(dtype)
        return np.fromfile(self.idx_path, dtype=dtype, count=count, offset=base + start * dtype.itemsize)

    def _check(self) -> None:
        """One pass over the index in blocks: the document index runs from 0 to S without decreasing, no length is
        negative, the pointers end where the lengths say, the .bin is as long as the tokens; the document lengths of
        a store with one sequence per document (``preprocess_data.py`` without ``--split-sentences``) on the way."""
        s, d, header = self.num_sequences, self.num_entries, _HEADER.itemsize
        lengths_at, pointers_at, documents_at = header, header + 4 * s, header + 12 * s
        first, last = self._block(np.int64, documents_at, 0, 1)[0], self._block(np.int64, documents_at, d - 1, 1)[0]
        if int(first) != 0 or int(last) != s:
            raise InputValueError(f"{self.idx_path}: the document index runs from {int(first)} to {int(last)}, "
                                  f"expected 0 to the sequence count {s}", parameter="corpus")
        one_each = d == s + 1
        doc_lengths = np.empty(s if one_each else 0, dtype=np.int64)
        total, previous, itemsize = 0, 0, self.dtype.itemsize
        for start in range(0, max(s, d - 1), _BLOCK):
            entries = self._block(np.int64, documents_at, start + 1, min(_BLOCK, d - 1 - start)) if start < d - 1 \
                else np.zeros(0, np.int64)
            if entries.size:
                steps = np.diff(entries, prepend=previous)
                if steps.min() < 0:
                    raise InputValueError(f"{self.idx_path}: the document index decreases", parameter="corpus")
                one_each = one_each and bool(steps.min() == 1)
                previous = int(entries[-1])
            seq = self._block(np.int32, lengths_at, start, min(_BLOCK, s - start)) if start < s \
                else np.zeros(0, np.int32)
            if seq.size and seq.min() < 0:
                bad = start + int(np.argmax(seq < 0))
                raise InputValueError(f"{self.idx_path}: sequence {bad} has the negative length {int(seq.min())}",
                                      parameter="corpus")
            if seq.size:  # megatron-core writes the sequences back to back: pointer i = bytes of sequences before i
                pointers = self._block(np.int64, pointers_at, start, seq.size)
                expected = (total + np.cumsum(seq, dtype=np.int64) - seq) * itemsize
                if not np.array_equal(pointers, expected):
                    self._pointer_error(start + int(np.argmax(pointers != expected)), pointers, expected, start)
            total += int(seq.sum(dtype=np.int64))
            if one_each:
                doc_lengths[start:start + seq.size] = seq
        self.one_sequence_per_document = one_each
        self._doc_lengths = doc_lengths if one_each else None
        expected = total * itemsize
        end = 0
        if s:
            end = int(self._block(np.int64, pointers_at, s - 1, 1)[0]) + \
                int(self._block(np.int32, lengths_at, s - 1, 1)[0]) * itemsize
        if end != expected:
            raise InputValueError(f"{self.idx_path}: the sequence pointers end at byte {end} but the lengths add up "
                                  f"to {total} tokens of {self.dtype} ({expected} bytes): the index is inconsistent, "
                                  "or its dtype is not the one the .bin was written with", parameter="corpus")
        if self.bin_size != expected:
            what = "truncated" if self.bin_size < expected else "longer than its index says"
            raise InputValueError(f"{self.bin_path} is {self.bin_size} bytes but its index {self.idx_path} says "
                                  f"{total} tokens of {self.dtype} ({expected} bytes): the .bin is {what}, or the "
                                  "pair was written with another dtype; rewrite the store", parameter="corpus")
        self.num_tokens = total

    def _pointer_error(self, sequence: int, pointers: np.ndarray, expected: np.ndarray, start: int) -> None:
        documents = np.fromfile(self.idx_path, dtype=np.int64, count=self.num_entries,
                                offset=_HEADER.itemsize + 12 * self.num_sequences)
        doc = int(np.searchsorted(documents, sequence, side="right")) - 1
        got, want = int(pointers[sequence - start]), int(expected[sequence - start])
        tokens = expected // self.dtype.itemsize
        other = [k for k in (1, 2, 4, 8) if k != self.dtype.itemsize and np.array_equal(pointers, tokens * k)]
        if other:
            raise InputValueError(f"{self.idx_path}: the sequence pointers are those of {other[0]}-byte tokens but "
                                  f"the header says {self.dtype} ({self.dtype.itemsize} bytes): its dtype is not the "
                                  "one the .bin was written with; rewrite the store", parameter="corpus")
        raise InputValueError(f"{self.idx_path}: sequence {sequence} (document {doc}) points at byte {got} of "
                              f"{self.bin_path}, but the lengths before it add up to byte {want}: the index's "
                              "pointers disagree with its lengths (a hand-edited or corrupted .idx), so documents "
                              "would read other documents' tokens; rewrite the store", parameter="corpus")

    def document_lengths(self) -> np.ndarray:
        """int64 ``[documents]``: tokens per document (handed over once: the index keeps no copy)."""
        if self._doc_lengths is not None:
            lengths, self._doc_lengths = self._doc_lengths, None
            return lengths
        cumulative = np.zeros(self.num_sequences + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=cumulative[1:])
        docs = np.asarray(self.documents)
        return cumulative[docs[1:]] - cumulative[docs[:-1]]


class MegatronStore(TokenStore):
    """One or several Megatron ``.bin/.idx`` pairs as one corpus (documents of the first pair first).

    Args:
        prefixes: path prefixes (``PREFIX.bin`` and ``PREFIX.idx``; a path ending in ``.bin`` or ``.idx`` is taken
            as its prefix).
        dtype: the token dtype expected (e.g. ``"uint16"``), or None to take each header's; a header that says
            another is a ValueError.

    Raises:
        FileNotFoundError: a ``.bin`` or ``.idx`` is missing.
        ValueError: an ``.idx`` of another format, version or dtype, or inconsistent with itself (a document index
            that does not run from 0 to the sequence count without decreasing, a negative length, a sequence pointer
            that is not the bytes of the sequences before it: checked in one vectorised pass over the index), a
            ``.bin`` whose size is not what its index says (truncated), pairs of different dtypes, a pair named
            twice (``PREFIX`` and ``PREFIX.bin``); each naming the file.
        StoreChangedError: (on reading) a ``.bin`` or ``.idx`` whose size or modification time changed since the
            store was opened (checked when a process first reads it and before every read).

    Example:
        >>> store = MegatronStore(["data/shard_0", "data/shard_1"])  # doctest: +SKIP
        >>> store.lengths[:3], store.read(0, 5)  # doctest: +SKIP
    """

    process_local = ("_bins",)

    def __init__(self, prefixes: Sequence[str | os.PathLike], dtype: Any = None) -> None:
        self.prefixes = [_prefix(p) for p in prefixes]
        if not self.prefixes:
            raise InputValueError("a Megatron store needs at least one path prefix", parameter="corpus")
        check_distinct([p + ".bin" for p in self.prefixes if os.path.isfile(p + ".bin")], "Megatron store",
                       "corpus")
        indexes = [_Index(p) for p in self.prefixes]
        expected = None if dtype is None else np.dtype(dtype)
        first = indexes[0]
        for index in indexes:
            if expected is not None and index.dtype != expected:
                raise InputValueError(f"{index.idx_path} holds {index.dtype} token ids, but dtype={expected} was "
                                      "asked for: the store was written with another dtype; check the prefix or "
                                      "the dtype setting", parameter="dtype")
            if index.dtype != first.dtype:
                raise InputValueError(f"{index.idx_path} holds {index.dtype} token ids but {first.idx_path} holds "
                                      f"{first.dtype}: the prefixes of one corpus must share a dtype",
                                      parameter="corpus")
        self._dtype = first.dtype
        parts = [index.document_lengths() for index in indexes]
        self._lengths = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._starts = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)  # first document of each pair
        self._sizes = [(index.idx_path, index.idx_stamp.size, index.bin_size) for index in indexes]
        self._indexes = indexes
        self._bins: list[Any] | None = None
        self._idx_files = [TokenFile(index.idx_stamp, np.uint8) for index in indexes]

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens per document, from the ``.idx`` files."""
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """The token dtype of the ``.idx`` headers."""
        return self._dtype

    @property
    def description(self) -> str:
        """E.g. ``"Megatron store corpus.bin (1,000 documents)"``."""
        names = ", ".join(Path(p).name + ".bin" for p in self.prefixes[:3]) + (", ..." if len(self.prefixes) > 3
                                                                                else "")
        return f"Megatron store {names} ({len(self._lengths):,} documents)"

    def _locate(self, doc: int) -> tuple[int, int]:
        part = int(np.searchsorted(self._starts, doc, side="right")) - 1
        return part, doc - int(self._starts[part])

    def where(self, doc: int) -> str:
        """E.g. ``"document 3 of /data/corpus.bin"`` (the document's index within its own pair)."""
        part, local = self._locate(doc)
        return f"document {local} of {self.prefixes[part]}.bin"

    def _open_bin(self, part: int) -> TokenFile:
        """The ``.bin`` of pair ``part`` as token ids read by slices (``os.pread``; the file is checked against its
        size and modification time at opening when the store was opened, when a process first reads it and before
        every read)."""
        return TokenFile(self._indexes[part].bin_stamp, self._dtype)

    def _token_start(self, part: int, local: int) -> int:
        """First token of document ``local`` of pair ``part`` in its ``.bin``, read from the ``.idx`` (16 bytes)."""
        index, idx = self._indexes[part], self._idx_files[part]
        s = index.num_sequences
        sequence = int(idx.read_at(_HEADER.itemsize + 12 * s + 8 * local, 1, "<i8")[0])
        if sequence >= s:
            return 0  # an empty document at the end
        return int(idx.read_at(_HEADER.itemsize + 4 * s + 8 * sequence, 1, "<i8")[0]) // self._dtype.itemsize

    def read(self, doc: int, length: int) -> tuple[np.ndarray, None]:
        """The first ``length`` tokens of document ``doc``, read from the ``.bin`` (a copy); no labels."""
        doc, length = self._check_read(doc, length)
        if length == 0:
            return np.zeros(0, self._dtype), None
        part, local = self._locate(doc)
        if self._bins is None:
            self._bins = [None] * len(self.prefixes)
        if self._bins[part] is None:
            self._bins[part] = self._open_bin(part)
        start = self._token_start(part, local)
        ids = np.array(self._bins[part][start:start + length])
        if len(ids) != length:
            raise InputValueError(f"{self.where(doc)}: the .bin ends after {len(ids)} of the {length} tokens its index "
                                  "promises: the file was truncated after the store was opened", parameter="corpus")
        return ids, None

    def identity(self) -> list[str]:
        """File names and sizes of every pair, the dtype, and the sha256 of the document lengths."""
        digest = hashlib.sha256(np.ascontiguousarray(self._lengths, dtype="<i8").tobytes()).hexdigest()
        parts = [f"{Path(idx).name}:{idx_size}:{bin_size}" for idx, idx_size, bin_size in self._sizes]
        return [*parts, str(self._dtype), digest]


class MegatronSource(StoreSource):
    """A Megatron ``.bin/.idx`` store (one path prefix or several, making one corpus), read in place.

    Lengths come from the ``.idx`` files; tokens are read from the memory-mapped ``.bin`` files for the micro-batches
    a rank runs, when it runs them. The ``.idx`` does not say the vocabulary size or the padding id: give
    ``vocab_size`` and ``pad_token_id`` (or a tokenizer) to the DataModule.

    Args:
        prefixes: one path prefix (str or os.PathLike) or a list of them; ``PREFIX.bin`` and ``PREFIX.idx`` must exist.
        dtype: the token dtype expected, or None to take the header's.

    Raises:
        As :class:`MegatronStore`, when the store is first opened (:attr:`store`, at the DataModule's construction).

    Example:
        >>> source = MegatronSource("data/corpus_text_document")  # doctest: +SKIP
        >>> BalancedTextDataModule(corpus=source, vocab_size=50257, pad_token_id=50256)  # doctest: +SKIP
    """

    kind = "megatron"

    def __init__(self, prefixes: Sequence[str | os.PathLike] | str | os.PathLike, dtype: Any = None) -> None:
        if isinstance(prefixes, (str, os.PathLike)):
            prefixes = [prefixes]
        if not isinstance(prefixes, Sequence) or not prefixes:
            raise InputValueError(f"prefixes must be a path prefix or a non-empty list of them, got {prefixes!r:.80}",
                                  parameter="corpus")
        self.prefixes = [_prefix(p) for p in prefixes]
        self.dtype = None if dtype is None else np.dtype(dtype)

    def open_store(self) -> MegatronStore:
        """Read and check the ``.idx`` files (and the ``.bin`` sizes)."""
        return MegatronStore(self.prefixes, self.dtype)
