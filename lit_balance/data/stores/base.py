"""What a tokenized store read in place is: :class:`TokenStore` (the source that is one:
:class:`~lit_balance.data.stores.StoreSource`).

A tokenized store is a corpus that a distributed engine already tokenized and wrote with an index of every
document's length: Megatron ``.bin/.idx``, datatrove's ``*.ds`` with ``*.ds.index``, Arrow / Parquet with an
``input_ids`` list column, and this library's own tokenization cache (:class:`~lit_balance.data.stores.FlatStore`).
Several files of one format are one store through :class:`~lit_balance.data.stores.MultiFileStore`. The DataModule
plans from :attr:`TokenStore.lengths` (read from the index or the list offsets only) and reads a document's tokens
(:meth:`TokenStore.read`) when a rank builds the micro-batch that holds it; nothing is tokenized, written to the
tokenization cache or copied.

A store is picklable: the memory maps and open files it keeps in the attributes named by
:attr:`TokenStore.process_local` (for a multi-file store, each file's
:attr:`~lit_balance.data.stores.StoreFile.process_local`) are dropped when it is pickled (e.g. to a DataLoader
worker) and reopened on first use in the process that unpickles it.

A store is a file other tools wrote, read for days: the built-in stores check at opening what is cheap (index
consistency in one vectorised pass, sizes, a file named twice, nulls) and refuse a file that changed on disk since
(size or modification time, :class:`~lit_balance.data.stores._files.StoreChangedError`) when a process opens it and
before every read; ids and labels outside the vocabulary are refused when read, naming the file and document.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.tokenizer_identity import TokenizerIdentity

__all__ = ["TokenStore"]


class TokenStore(abc.ABC):
    """Token ids of a corpus stored on disk with an index of document lengths, read in place.

    A subclass defines :attr:`lengths`, :attr:`dtype`, :meth:`read` and :meth:`identity`, and may set
    :attr:`vocab_size`, :attr:`pad_token_id`, :attr:`tokenizer_identity` and :attr:`has_labels` (class attributes or
    properties) and override
    :attr:`description`, :meth:`where` and :meth:`supervised_lengths`.

    Attributes:
        vocab_size: number of token ids when the store's own metadata says it (e.g. the tokenizer's vocabulary
            recorded by the writer), else None: every id lies in ``[0, vocab_size)``.
        pad_token_id: padding id when the store's metadata says it, else None.
        tokenizer_identity: the tokenizer the store was written with
            (:class:`~lit_balance.data.tokenizer_identity.TokenizerIdentity`) when its files say it, else None; a run
            with another tokenizer is refused (:func:`~lit_balance.data.tokenizer_identity.check_store_tokenizer`).
        has_labels: whether :meth:`read` returns labels (a label mask or column stored beside the ids).
        ids_in_vocabulary: whether the ids were checked against the vocabulary trained with when they were written
            (the tokenization cache's :class:`~lit_balance.data.stores.FlatStore`); else the dataset checks every
            document it reads.
        process_local: names of attributes holding memory maps or open files: set to None when the store is
            pickled, reopened lazily (by the subclass's accessors) in the process that uses them.
    """

    vocab_size: int | None = None
    pad_token_id: int | None = None
    tokenizer_identity: TokenizerIdentity | None = None
    has_labels: bool = False
    ids_in_vocabulary: bool = False
    process_local: ClassVar[tuple[str, ...]] = ()

    # -- what a subclass defines ------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens per document, from the index (or list offsets) only, never the token bytes."""

    @property
    @abc.abstractmethod
    def dtype(self) -> np.dtype:
        """NumPy dtype of the token ids on disk (e.g. ``uint16``, ``int32``)."""

    @abc.abstractmethod
    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Read the first ``length`` tokens of document ``doc`` from the memory-mapped files.

        Only ``length`` tokens' bytes (and their labels') are read: a document truncated to ``max_length`` costs
        ``max_length`` tokens.

        Args:
            doc: document index in ``[0, len(self))``.
            length: tokens to read, in ``[0, lengths[doc]]``.

        Returns:
            ``(ids, labels)``: ``ids`` a 1-D integer array ``[length]`` (a copy, the store's dtype or wider);
            ``labels`` int32 ``[length]``, unshifted, ``-100`` where a token has no target, or None when the store
            has no labels (every token a target).

        Raises:
            IndexError: ``doc`` or ``length`` out of range.
            ValueError: the file is shorter than its index says (naming the file).
        """

    @abc.abstractmethod
    def identity(self) -> list[str]:
        """Fingerprint parts from the index only: file names, sizes and a hash of the lengths (never the tokens).

        Returns:
            Strings that change whenever the documents' files or lengths change.
        """

    # -- what a subclass may override ---------------------------------------------------------------------------

    @property
    def files(self) -> tuple[str, ...]:
        """The files holding the store's tokens, in corpus order (none for a store held in memory)."""
        return ()

    @property
    def description(self) -> str:
        """Human-readable summary, e.g. ``"Megatron store corpus (2 files, 1,000 documents)"``."""
        return f"{type(self).__qualname__} ({len(self):,} documents)"

    def where(self, doc: int) -> str:
        """Where document ``doc`` lives, for error messages, e.g. ``"document 3 of /data/corpus.bin"``."""
        return f"document {doc} of {self.description}"

    def locate_documents(self, docs: np.ndarray) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """Where documents ``docs`` live, for many at once (the ledger of a run records it per document).

        Args:
            docs: int ``[n]``, store document indices.

        Returns:
            ``(files, file, local)``: the names of the store's files (one, :attr:`description`, for a store that is
            not split in files), int32 ``[n]`` each document's file (a position in ``files``) and int64 ``[n]`` its
            number within that file (a row of an Arrow file, a document of a Megatron or datatrove file).
        """
        docs = np.asarray(docs, dtype=np.int64)
        return (self.description,), np.zeros(docs.shape[0], dtype=np.int32), docs

    def supervised_lengths(self, lengths: np.ndarray, docs: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[n]``: next-token targets of documents ``docs`` cut to ``lengths`` tokens, as a causal LM counts.

        Labels ``1 .. length-1`` that are not ``-100``; without labels, ``length - 1``. Each document is counted by
        :meth:`supervised`; a store with a cheaper way for many documents (labels held flat) overrides this method.

        Args:
            lengths: int ``[n]``, tokens kept of each document.
            docs: int ``[n]``, the documents (None: every document, ``n = len(self)``).
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if not self.has_labels:
            return np.maximum(lengths - 1, 0)
        docs = np.arange(len(self), dtype=np.int64) if docs is None else np.asarray(docs, dtype=np.int64)
        out = np.zeros(len(lengths), dtype=np.int64)
        for i, (doc, length) in enumerate(zip(docs.tolist(), lengths.tolist())):
            out[i] = self.supervised(doc, length)
        return out

    def supervised(self, doc: int, length: int) -> int:
        """Next-token targets of document ``doc`` cut to ``length`` tokens, for a store with labels: the base class
        reads its labels (:meth:`read`); a store with a cheaper way (a label-mask file) overrides it."""
        if length <= 1:
            return 0
        _, labels = self.read(doc, length)
        return int(np.count_nonzero(np.asarray(labels)[1:] != IGNORE_INDEX))

    def labels_of(self, docs: np.ndarray | None) -> Any:
        """The labels of documents ``docs`` (None: every document) back to back, as an array-like read in full only
        when converted (``np.asarray``): the rare checks that need every label use it; None without labels."""
        if not self.has_labels:
            return None
        return _ConcatenatedLabels(self, np.arange(len(self), dtype=np.int64) if docs is None else docs)

    @property
    def token_ids(self) -> np.ndarray:
        """The flat array of every id, for stores that keep one (:class:`~lit_balance.data.stores.FlatStore`)."""
        raise AttributeError(f"{self.description} is read per document (read(doc, length)); it holds no flat token "
                             "array")

    # -- shared ---------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(len(self.lengths))

    def _check_read(self, doc: int, length: int) -> tuple[int, int]:
        """``(doc, length)`` as ints, or IndexError when outside the store."""
        n = len(self)
        if not 0 <= doc < n:
            raise IndexError(f"document {doc} is out of range for {self.description} ({n} documents)")
        full = int(self.lengths[doc])
        if not 0 <= length <= full:
            raise IndexError(f"cannot read {length} tokens of {self.where(doc)}: it holds {full}")
        return int(doc), int(length)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self.process_local:
            if name in state:
                state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _ConcatenatedLabels:
    """Labels of some documents of a store back to back (read in full when converted)."""

    def __init__(self, store: TokenStore, docs: np.ndarray) -> None:
        self.store, self.docs = store, np.asarray(docs, dtype=np.int64)

    def __len__(self) -> int:
        return int(np.asarray(self.store.lengths)[self.docs].sum())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        lengths = np.asarray(self.store.lengths)
        parts = [np.asarray(self.store.read(d, int(lengths[d]))[1], dtype=np.int32) for d in self.docs.tolist()]
        out = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return out if dtype is None else out.astype(dtype)
