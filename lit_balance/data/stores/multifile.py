"""Several files as one store: :class:`MultiFileStore`, over one :class:`StoreFile` per file of a format.

A format says how to open one file of its kind (a :class:`StoreFile`: read and check its index, read a document's
tokens); :class:`MultiFileStore` does the rest once for every format: documents of the first file first, a document
located by a binary search over the files' first documents, messages that name the file and the document within it
(:meth:`MultiFileStore.where`), the dtype and labels the files share, and the identity from the indexes alone. A file
opens what it reads (descriptors, memory maps) on first use in each process: the handles named by
:attr:`StoreFile.process_local` are dropped when it is pickled (e.g. to a DataLoader worker) and reopened there.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores._files import FileStamp
from lit_balance.data.stores.base import TokenStore
from lit_balance.data.tokenizer_identity import TokenizerIdentity, one_tokenizer
from lit_balance.errors import InputFileNotFoundError, InputValueError

__all__ = ["MultiFileStore", "StoreFile", "choose_labels", "same_kind"]


class StoreFile(abc.ABC):
    """One file of a store (with the files beside it: its index, a label mask), opened and checked once.

    A subclass sets :attr:`name`, :attr:`stamp`, :attr:`lengths`, :attr:`dtype` (and :attr:`has_labels`) when it is
    opened, and defines :meth:`read` (and :meth:`open_tokens`, for :attr:`tokens`); it may override
    :meth:`identity` and :meth:`supervised` (a cheaper count of targets).

    Attributes:
        name: the path that messages name (``"document 3 of <name>"``).
        stamp: the file's :class:`~lit_balance.data.stores._files.FileStamp` (size, modification time) at opening.
        lengths: int64 ``[documents]``: tokens per document, from the index only.
        dtype: the token dtype on disk.
        has_labels: whether :meth:`read` returns labels.
        tokenizer_identity: the tokenizer the file says it was written with, or None
            (:mod:`lit_balance.data.tokenizer_identity`); the store's is the one of its files (two differ: ValueError).
        process_local: attributes holding descriptors or memory maps, dropped when pickled and reopened lazily
            (:meth:`handle`; ``"_tokens"``, :attr:`tokens` as :meth:`open_tokens` opens it, is one).
    """

    name: str
    stamp: FileStamp
    lengths: np.ndarray
    dtype: np.dtype
    has_labels: bool = False
    tokenizer_identity: TokenizerIdentity | None = None
    process_local: ClassVar[tuple[str, ...]] = ("_tokens",)

    @abc.abstractmethod
    def read(self, local: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``length`` tokens (and labels) of document ``local`` of this file (in range: checked by the
        store), as :meth:`~lit_balance.data.stores.TokenStore.read` returns them."""

    def identity(self) -> str:
        """The file's name and size, ``"<name>:<bytes>"`` (never its tokens; from :attr:`stamp`, the file's
        :class:`~lit_balance.data.stores._files.FileStamp` when opened)."""
        return f"{Path(self.name).name}:{self.stamp.size}"

    def supervised(self, local: int, length: int) -> int:
        """Next-token targets among the first ``length`` tokens of document ``local`` (labels ``1 .. length-1`` that
        are not ``-100``); the base class reads the labels."""
        if length <= 1:
            return 0
        labels = self.read(local, length)[1]
        return length - 1 if labels is None else int(np.count_nonzero(np.asarray(labels)[1:] != IGNORE_INDEX))

    def open_tokens(self) -> Any:
        """Open the token file for reading by slices (``tokens[start:stop]``), once per process (:attr:`tokens`)."""
        raise NotImplementedError(f"{type(self).__qualname__} reads its tokens its own way")

    @property
    def tokens(self) -> Any:
        """The token file as :meth:`open_tokens` opens it, on first use in this process (dropped when pickled)."""
        return self.handle("_tokens", self.open_tokens)

    def handle(self, name: str, opener: Callable[[], Any]) -> Any:
        """The process-local attribute ``name`` (one of :attr:`process_local`), opened with ``opener()`` on first use
        in this process."""
        value = self.__dict__.get(name)
        if value is None:
            value = opener()
            setattr(self, name, value)
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self.process_local:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def same_kind(files: Sequence[StoreFile], key: Callable[[StoreFile], Any],
              message: Callable[[StoreFile, StoreFile], str], parameter: str = "corpus") -> None:
    """Raise a ValueError (``message(first, other)``) when ``key`` differs between the first file and another."""
    for other in files[1:]:
        if key(other) != key(files[0]):
            raise InputValueError(message(files[0], other), parameter=parameter)


def choose_labels(files: Sequence[StoreFile], labels: bool | None, mixed: Callable[[StoreFile, StoreFile], str],
                  missing: Callable[[StoreFile], str]) -> bool:
    """Whether the store reads labels: ``labels`` when given (True needs every file to have them: else a
    FileNotFoundError, ``missing(file)``), else whether every file has them (some with and some without: a
    ValueError, ``mixed(with, without)``); sets each file's ``has_labels``."""
    have = [f.has_labels for f in files]
    if labels is None and any(have) and not all(have):
        raise InputValueError(mixed(files[have.index(True)], files[have.index(False)]), parameter="labels")
    if labels and not all(have):
        raise InputFileNotFoundError(missing(files[have.index(False)]), parameter="labels")
    chosen = all(have) if labels is None else bool(labels)
    for file in files:
        file.has_labels = chosen
    return chosen


class MultiFileStore(TokenStore):
    """Files of one format as one store, in the order given: what every multi-file format shares.

    Args:
        files: the opened files (at least one).
        dtype: the token dtype of the store (None: the first file's).

    Attributes:
        files_opened: the :class:`StoreFile` objects, in corpus order.
        noun: what a document is called in messages (``"document"``, ``"row"``).
        title, shown: the description's first words and how many file names it shows.
    """

    noun: ClassVar[str] = "document"
    title: ClassVar[str] = "store"  # the description's first words, e.g. "Megatron store"
    shown: ClassVar[int] = 3  # files the description names

    def __init__(self, files: Sequence[StoreFile], dtype: Any = None) -> None:
        self.files_opened = list(files)
        self._dtype = np.dtype(files[0].dtype if dtype is None else dtype)
        parts = [np.asarray(f.lengths, dtype=np.int64) for f in self.files_opened]
        self._lengths = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._lengths.flags.writeable = False
        self._file_docs = np.cumsum([0, *(len(p) for p in parts)], dtype=np.int64)  # first document of each file
        self.has_labels = all(f.has_labels for f in self.files_opened)
        self.tokenizer_identity = one_tokenizer([(f.name, f.tokenizer_identity) for f in self.files_opened], "corpus")

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]`` (read-only): tokens per document, the files' indexes one after the other."""
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """The token dtype."""
        return self._dtype

    @property
    def files(self) -> tuple[str, ...]:
        """The files' names, in corpus order."""
        return tuple(f.name for f in self.files_opened)

    @property
    def description(self) -> str:
        """E.g. ``"Megatron store a.bin, b.bin (1,000 documents)"``."""
        names = ", ".join(Path(f).name for f in self.files[:self.shown]) + ", ..." * (len(self.files) > self.shown)
        return f"{self.title} {names} ({len(self):,} documents)"

    def _locate(self, doc: int) -> tuple[int, int]:
        """``(file number, document number within the file)`` of store document ``doc``."""
        file = int(np.searchsorted(self._file_docs, doc, side="right")) - 1
        return file, doc - int(self._file_docs[file])

    def where(self, doc: int) -> str:
        """E.g. ``"document 3 of /data/part_1.bin"`` (numbered within its file)."""
        file, local = self._locate(doc)
        return f"{self.noun} {local} of {self.files_opened[file].name}"

    def locate_documents(self, docs: np.ndarray) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """As :meth:`TokenStore.locate_documents`: each document's file (of :attr:`files`) and number within it."""
        docs = np.asarray(docs, dtype=np.int64)
        file = np.searchsorted(self._file_docs, docs, side="right") - 1
        return self.files, file.astype(np.int32), docs - self._file_docs[file]

    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``length`` tokens (and labels) of document ``doc``, read from its file (see
        :meth:`TokenStore.read`)."""
        doc, length = self._check_read(doc, length)
        if length == 0:  # nothing to read: no file is opened
            return np.zeros(0, self._dtype), (np.zeros(0, np.int32) if self.has_labels else None)
        file, local = self._locate(doc)
        return self.files_opened[file].read(local, length)

    def supervised(self, doc: int, length: int) -> int:
        """As :meth:`TokenStore.supervised`, counted by the document's file (:meth:`StoreFile.supervised`)."""
        doc, length = self._check_read(doc, length)
        file, local = self._locate(doc)
        return self.files_opened[file].supervised(local, length)

    def lengths_digest(self) -> str:
        """sha256 hex digest of the lengths (little-endian int64)."""
        return hashlib.sha256(np.ascontiguousarray(self._lengths, dtype="<i8").tobytes()).hexdigest()

    def identity(self) -> list[str]:
        """Each file's :meth:`StoreFile.identity`, the dtype and the sha256 of the lengths (never the tokens)."""
        return [*(f.identity() for f in self.files_opened), str(self._dtype), self.lengths_digest()]
