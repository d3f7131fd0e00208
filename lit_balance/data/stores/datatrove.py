"""datatrove token stores read in place: the output folder of datatrove's ``DocumentTokenizer``.

The format is datatrove's own (``datatrove.pipeline.tokens.tokenizer.TokenizedFile``). Each task writes:

* ``NAME.ds``: the documents' token ids back to back, little-endian ``uint16`` (token size 2, vocabularies of at
  most 65,536 ids) or ``uint32`` (token size 4);
* ``NAME.ds.index``: one little-endian ``uint64`` per document, the token offset of its end (cumulative);
* ``NAME.ds.loss`` (with ``save_loss_metadata=True``): one byte per token, 1 when it is a target, 0 when not;
* ``NAME.ds.metadata`` (with ``save_final_metadata=True``, datatrove's default): three lines, ``TOKENIZER|TOKEN_SIZE``,
  the token count, and the same count for humans.

:class:`DatatroveStore` reads several tasks' files as one corpus (:class:`~lit_balance.data.stores.MultiFileStore`),
lengths from the ``.ds.index`` files alone. Raw text becomes such a folder with ``lit-balance tokenize`` or any
datatrove pipeline ending in ``DocumentTokenizer`` (``docs/store_datatrove.md``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores._checks import check_options, read_ends
from lit_balance.data.stores._files import FileStamp, TokenFile, expand_files
from lit_balance.data.stores.multifile import MultiFileStore, StoreFile, choose_labels, same_kind
from lit_balance.data.stores.source import StoreSource, path_list
from lit_balance.data.tokenizer_identity import datatrove_tokenizer
from lit_balance.data.vocabulary import store_vocabulary
from lit_balance.errors import InputValueError

__all__ = ["DatatroveSource", "DatatroveStore", "read_metadata"]

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def read_metadata(path: str | os.PathLike) -> tuple[str, int, int]:
    """``(tokenizer name or path, token size in bytes, token count)`` of a ``.ds.metadata`` file, or a ValueError."""
    lines = (text := Path(path).read_text(encoding="utf-8")).splitlines()
    name, bar, size = lines[0].rpartition("|") if lines else ("", "", "")
    try:
        token_size, count = int(size), int(lines[1])
    except (IndexError, ValueError):
        token_size = count = -1
    if not bar or token_size not in _DTYPES or count < 0:
        raise InputValueError(f"{path}: expected datatrove's .ds.metadata (a line 'TOKENIZER|TOKEN_SIZE' with "
                              f"TOKEN_SIZE 2 or 4, then the token count), got {text[:120]!r}")
    return name, token_size, count


class DatatroveFile(StoreFile):
    """One ``.ds`` file with its ``.ds.index`` (read and checked at opening), ``.ds.metadata`` and ``.ds.loss``."""

    process_local = ("_tokens", "_mask")

    def __init__(self, ds: Path, token_size: int | None) -> None:
        index = Path(f"{ds}.index")
        self.ends = read_ends(str(index), "paths", missing=f"{ds} has no index: expected {index.name} beside it "
                              "(datatrove writes it with save_index=True, its default)")
        num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.tokenizer, size = None, token_size
        metadata = Path(f"{ds}.metadata")
        if metadata.is_file():
            self.tokenizer, size, count = read_metadata(metadata)
            if token_size is not None and token_size != size:
                raise InputValueError(f"token_size={token_size} but {metadata} says {size} bytes per token; leave "
                                      "token_size out", parameter="token_size")
            if count != num_tokens:
                raise InputValueError(f"{metadata} counts {count} tokens but {ds.name}.index ends at {num_tokens}; "
                                      "the files come from different runs", parameter="paths")
        elif size is None:
            raise InputValueError(f"{ds} has no {metadata.name} saying its token size; pass token_size=2 "
                                  "(vocabularies up to 65,536 ids) or 4", parameter="token_size")
        self.name, self.dtype, self.stamp = str(ds), _DTYPES[size], FileStamp(ds)
        self.tokenizer_identity = datatrove_tokenizer(ds, self.tokenizer)  # a sidecar, else the metadata's tokenizer
        if self.stamp.size != num_tokens * size:
            raise InputValueError(f"{ds}: expected {num_tokens} tokens x {size} bytes = {num_tokens * size} bytes as "
                                  f"{index.name} says, got {self.stamp.size} bytes (truncated, or another token size)",
                                  parameter="paths")
        loss = Path(f"{ds}.loss")
        self.has_labels, self.loss_stamp = loss.is_file(), FileStamp(loss) if loss.is_file() else None
        if self.has_labels and self.loss_stamp.size != num_tokens:
            raise InputValueError(f"{loss}: expected {num_tokens} bytes (one per token, as {index.name} says), got "
                                  f"{self.loss_stamp.size}", parameter="paths")
        self.lengths = np.diff(self.ends.astype(np.int64), prepend=0)
        self.starts = self.ends.astype(np.int64) - self.lengths  # first token of each document

    def open_tokens(self) -> TokenFile:  # os.pread, a descriptor per process, the stamps checked before every read
        return TokenFile(self.stamp, self.dtype)

    def open_mask(self) -> TokenFile:  # the .ds.loss bytes, opened as the tokens are
        return TokenFile(self.loss_stamp, np.uint8)

    def read(self, local: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:  # ids int64; -100: mask 0
        start = int(self.starts[local])
        ids = np.array(self.tokens[start:start + length], dtype=np.int64)
        if not self.has_labels:
            return ids, None
        mask = np.asarray(self.handle("_mask", self.open_mask)[start:start + length])
        return ids, np.where(mask != 0, ids, IGNORE_INDEX).astype(np.int32)

    def supervised(self, local: int, length: int) -> int:  # from the .ds.loss mask alone (no token byte)
        start, mask = int(self.starts[local]), self.handle("_mask", self.open_mask)
        return int(np.count_nonzero(mask[start + 1:start + length])) if length > 1 else 0


class DatatroveStore(MultiFileStore):
    """The ``.ds`` files of datatrove's ``DocumentTokenizer``, read in place as one corpus (opening reads each
    ``.ds.index`` and ``.ds.metadata`` and the sizes of the ``.ds`` and ``.ds.loss`` files; no token byte).

    Args:
        paths: ``.ds`` files, folders (their ``*.ds`` files, sorted) or glob patterns, in corpus order.
        token_size: bytes per token (2 or 4) for files without ``.ds.metadata`` (which wins, and must agree).
        vocab_size, pad_token_id: default: those of the ``tokenizer.json`` the metadata names, if local
            (:func:`~lit_balance.data.vocabulary.store_vocabulary`), else None. A read id ``>= vocab_size`` raises.
        labels: read the ``.ds.loss`` label masks (default: when every file has one).

    Raises:
        FileNotFoundError: a path missing, no ``.ds`` file, a ``.ds`` without ``.ds.index`` (``.ds.loss``: labels=True).
        ValueError: sizes that disagree (index, ``.ds``, ``.ds.loss``, metadata), decreasing document ends, files of
            different token sizes, some with a ``.ds.loss`` and some without, no token size known; naming the file.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, token_size: int | None = None,
                 vocab_size: int | None = None, pad_token_id: int | None = None, labels: bool | None = None) -> None:
        paths = path_list(paths, "paths", "a .ds file or folder", "paths")
        check_options({"token_size": token_size, "vocab_size": vocab_size, "pad_token_id": pad_token_id},
                      {"labels": labels})
        if token_size is not None and token_size not in _DTYPES:
            raise InputValueError(f"token_size must be 2 or 4 (bytes per token), got {token_size}",
                                  parameter="token_size")
        files = [DatatroveFile(ds, token_size) for ds in expand_files(
            paths, suffix=".ds", what="datatrove store", sidecars=(".ds.index", ".ds.metadata", ".ds.loss"),
            hint="; pass the DocumentTokenizer's output_folder")]
        same_kind(files, lambda f: f.dtype, lambda first, f: f"the .ds files of one corpus must share a token size: "
                  f"{first.name} has {first.dtype.itemsize} bytes per token, {f.name} {f.dtype.itemsize}", "paths")
        choose_labels(files, labels, lambda with_, without: f"{with_.name} has a .ds.loss label mask but "
                      f"{without.name} has none; pass labels=False to train on every token of every file, or give "
                      "files of one kind", lambda f: f"labels=True but {f.name} has no .ds.loss beside it (datatrove "
                      "writes it with save_loss_metadata=True)")
        super().__init__(files)
        self._index_digest = hashlib.sha256(b"".join(len(f.ends).to_bytes(8, "little") + f.ends.astype("<u8").tobytes()
                                                     for f in files)).hexdigest()
        names = {f.tokenizer for f in files if f.tokenizer is not None}  # the metadata's: None if none, or several
        self.tokenizer = names.pop() if len(names) == 1 else None
        self.vocab_size, self.pad_token_id = store_vocabulary(  # given, else the metadata's tokenizer file's
            vocab_size, pad_token_id, tokenizer_file=self.tokenizer, id_limit=1 << (8 * self.dtype.itemsize),
            token_size=self.dtype.itemsize)

    @property
    def description(self) -> str:
        """E.g. ``"datatrove store (2 files, 1,000 documents, 51,200 tokens)"``."""
        n, tokens = len(self.files_opened), int(self.lengths.sum())
        return f"datatrove store ({n} file{'s' * (n != 1)}, {len(self):,} documents, {tokens:,} tokens)"

    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """As :meth:`MultiFileStore.read`; an id ``>= vocab_size`` raises, naming the file and document."""
        ids, labels = super().read(doc, length)
        if self.vocab_size is not None and len(ids) and int(ids.max()) >= self.vocab_size:
            raise InputValueError(f"{self.where(doc)} holds the id {int(ids.max())}, beyond the vocabulary of "
                                  f"{self.vocab_size} ids: the store was tokenized with another tokenizer; pass the "
                                  "model's vocab_size and a store made with its tokenizer", parameter="vocab_size")
        return ids, labels

    def identity(self) -> list[str]:
        """The token size, labels, a sha256 of the document ends, the files' names and sizes (never the tokens)."""
        return ["datatrove", f"token_size={self.dtype.itemsize}", f"labels={self.has_labels}",
                f"index={self._index_digest}", *(f.identity() for f in self.files_opened)]


class DatatroveSource(StoreSource):
    """A datatrove ``DocumentTokenizer`` output folder as a corpus, read in place (:class:`DatatroveStore`).

    Args:
        paths, token_size, vocab_size, pad_token_id, labels: as :class:`DatatroveStore` (opened at the DataModule's
            construction).

    Example:
        >>> source = DatatroveSource("data/tokens", vocab_size=30522)  # doctest: +SKIP
        >>> BalancedTextDataModule(corpus=source, max_tokens=4096)  # doctest: +SKIP
    """

    kind = "datatrove"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, token_size: int | None = None,
                 vocab_size: int | None = None, pad_token_id: int | None = None,
                 labels: bool | None = None) -> None:
        self.paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        self.token_size, self.vocab_size, self.pad_token_id, self.labels = token_size, vocab_size, pad_token_id, labels

    def open_store(self) -> DatatroveStore:
        """Read the index files (:class:`DatatroveStore`)."""
        return DatatroveStore(self.paths, token_size=self.token_size, vocab_size=self.vocab_size,
                              pad_token_id=self.pad_token_id, labels=self.labels)

    def __repr__(self) -> str:
        return f"DatatroveSource({self.paths!r})"
