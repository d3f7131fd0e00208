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
sequence per sentence), so its length is the sum of its sequences' lengths. Opening checks the index in one pass
(:func:`~lit_balance.data.stores._checks.check_sequence_table`); the ``.bin`` is read per document with ``os.pread``,
checking that neither file changed on disk since (:mod:`~lit_balance.data.stores._files`). Several pairs are one
corpus (:class:`~lit_balance.data.stores.MultiFileStore`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.data.stores._checks import check_data_size, check_sequence_table
from lit_balance.data.stores._files import FileStamp, TokenFile, check_distinct
from lit_balance.data.stores.multifile import MultiFileStore, StoreFile, same_kind
from lit_balance.data.stores.source import StoreSource, path_list
from lit_balance.data.tokenizer_identity import SIDECAR_SUFFIX, read_sidecar
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["MEGATRON_DTYPES", "MegatronSource", "MegatronStore"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = np.dtype([("magic", "S9"), ("version", "<u8"), ("code", "u1"), ("sequences", "<u8"), ("documents", "<u8")])
#: megatron-core's ``DType`` codes of the ``.idx`` header and the NumPy dtype each stands for.
MEGATRON_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
                   5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}


def _prefix(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"a Megatron store is named by its path prefix (str or os.PathLike, the .bin/.idx pair "
                             f"without suffix), got {type(path).__name__} {path!r:.80}", parameter="corpus")
    text = os.fspath(path)
    return next((text[: -len(s)] for s in (".bin", ".idx") if text.endswith(s)), text)


class MegatronFile(StoreFile):
    """One ``.bin/.idx`` pair: the ``.idx`` read and checked at opening, the ``.bin`` read per document."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.idx_path, self.name = prefix, prefix + ".idx", prefix + ".bin"
        for path in (self.idx_path, self.name):
            if not os.path.isfile(path):
                raise InputFileNotFoundError(f"Megatron store {prefix!r}: {path} does not exist (a store is the pair "
                                             "PREFIX.bin and PREFIX.idx; pass the prefix)", parameter="corpus")
        self.idx_stamp, self.bin_stamp = FileStamp(self.idx_path), FileStamp(self.name)
        self.tokenizer_identity = read_sidecar(prefix + SIDECAR_SUFFIX)  # the store's own files never say it
        idx_size = self.idx_stamp.size
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
        self.num_sequences = s
        lengths_at, pointers_at, documents_at = _HEADER.itemsize, _HEADER.itemsize + 4 * s, _HEADER.itemsize + 12 * s
        tokens, lengths = check_sequence_table(self.idx_path, sequences=s, entries=d, lengths_at=lengths_at,
                                               pointers_at=pointers_at, documents_at=documents_at, dtype=self.dtype,
                                               data_path=self.name)
        check_data_size(self.name, self.bin_stamp.size, tokens, self.dtype, self.idx_path)
        if lengths is None:  # several sequences per document: sum them (the index memory-mapped only for this)
            cumulative = np.zeros(s + 1, dtype=np.int64)
            np.cumsum(np.memmap(self.idx_path, np.int32, "r", lengths_at, (s,)), out=cumulative[1:])
            docs = np.asarray(np.memmap(self.idx_path, np.int64, "r", documents_at, (d,)))
            lengths = cumulative[docs[1:]] - cumulative[docs[:-1]]
        self.lengths, self.num_tokens = lengths, tokens
        self._idx = TokenFile(self.idx_stamp, np.uint8)  # os.pread: a descriptor per process, opened on first read

    def open_tokens(self) -> TokenFile:  # the .bin by slices (os.pread), checked against its stamp before every read
        return TokenFile(self.bin_stamp, self.dtype)

    def read(self, local: int, length: int) -> tuple[np.ndarray, None]:
        """The first ``length`` tokens of document ``local``: its pointer from the ``.idx``, then the ``.bin``."""
        s = self.num_sequences
        sequence = int(self._idx.read_at(_HEADER.itemsize + 12 * s + 8 * local, 1, "<i8")[0])
        start = int(self._idx.read_at(_HEADER.itemsize + 4 * s + 8 * sequence, 1, "<i8")[0]) // self.dtype.itemsize
        ids = np.array(self.tokens[start:start + length])
        if len(ids) != length:
            raise InputValueError(f"document {local} of {self.name}: the .bin ends after {len(ids)} of the {length} "
                                  "tokens its index promises: the file was truncated after the store was opened",
                                  parameter="corpus")
        return ids, None

    def identity(self) -> str:  # "<name>.idx:<idx bytes>:<bin bytes>"
        return f"{Path(self.idx_path).name}:{self.idx_stamp.size}:{self.bin_stamp.size}"


class MegatronStore(MultiFileStore):
    """One or several Megatron ``.bin/.idx`` pairs as one corpus (documents of the first pair first).

    ``description`` reads e.g. ``"Megatron store corpus.bin (1,000 documents)"``.

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

    title = "Megatron store"

    def __init__(self, prefixes: Sequence[str | os.PathLike], dtype: Any = None) -> None:
        self.prefixes = [_prefix(p) for p in prefixes]
        if not self.prefixes:
            raise InputValueError("a Megatron store needs at least one path prefix", parameter="corpus")
        check_distinct([p + ".bin" for p in self.prefixes if os.path.isfile(p + ".bin")], "Megatron store", "corpus")
        files = [MegatronFile(p) for p in self.prefixes]
        expected = None if dtype is None else np.dtype(dtype)
        for f in files:
            if expected is not None and f.dtype != expected:
                raise InputValueError(f"{f.idx_path} holds {f.dtype} token ids, but dtype={expected} was asked for: "
                                      "the store was written with another dtype; check the prefix or the dtype "
                                      "setting", parameter="dtype")
        same_kind(files, lambda f: f.dtype, lambda first, f: f"{f.idx_path} holds {f.dtype} token ids but "
                  f"{first.idx_path} holds {first.dtype}: the prefixes of one corpus must share a dtype")
        super().__init__(files)


class MegatronSource(StoreSource):
    """A Megatron ``.bin/.idx`` store (one path prefix or several, making one corpus), read in place.

    Lengths come from the ``.idx`` files; tokens are read from the ``.bin`` files for the micro-batches a rank runs.
    The ``.idx`` says neither vocabulary size nor padding id (give them, or a tokenizer); a sidecar says the tokenizer.

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
        self.prefixes = [_prefix(p) for p in path_list(prefixes, "prefixes", "a path prefix")]
        self.dtype = None if dtype is None else np.dtype(dtype)

    def open_store(self) -> MegatronStore:
        """Read and check the ``.idx`` files (and the ``.bin`` sizes)."""
        return MegatronStore(self.prefixes, self.dtype)
