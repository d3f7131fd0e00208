"""The tokenized corpus the DataModule plans from, for every store and the cache: :class:`TokenizedCorpus`.

A :class:`TokenizedCorpus` is a :class:`~lit_balance.data.stores.TokenStore` (the tokenization cache's
:class:`~lit_balance.data.stores.FlatStore`, or a store read in place: Megatron, datatrove, Arrow, your own) with the
documents that hold tokens, the vocabulary trained with and the pad id. :func:`lit_balance.data.cache.open_corpus`
gets one from a source (the store itself for a :class:`~lit_balance.data.stores.StoreSource`, read in place; the
cache's for text and token-id sources); :func:`lit_balance.data.splits.split_corpus` turns it into
:class:`~lit_balance.data.dataset.TokenDataset` splits, whose items are read from the store when a micro-batch is
built: the first ``max_length`` tokens of each of its documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores.base import TokenStore
from lit_balance.data.stores.flat import FlatStore
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["TokenizedCorpus", "check_labels"]

_ARRAYS = {"token_ids": np.int32, "offsets": np.int64, "source_index": np.int64}


class TokenizedCorpus:
    """The documents of a :class:`~lit_balance.data.stores.TokenStore` that hold tokens, with the vocabulary and pad
    id they train with: what the DataModule plans from (:attr:`lengths`) and reads (:attr:`store`).

    Built from the tokenization cache's arrays (the constructor: a :class:`~lit_balance.data.stores.FlatStore` over
    them, arrays loaded from the cache are read-only memory maps) or from any store (:meth:`from_store`: its empty
    documents are dropped and counted, as the cache does).

    Args:
        token_ids: int32 ``[num_tokens]``, all kept documents concatenated.
        offsets: int64 ``[num_docs + 1]``, non-decreasing, from 0 to ``num_tokens``.
        source_index: int64 ``[num_docs]``, index of each kept document in the source corpus.
        num_empty: documents dropped because they were empty after tokenization.
        vocab_size: number of token ids of the tokenizer.
        pad_token_id: the tokenizer's padding id.
        labels: int32 ``[num_tokens]``, the (unshifted) label of each token, ``-100`` where it has no target
            (a prompt's tokens), or None when every token is a target (a plain corpus).

    Attributes:
        store: the :class:`~lit_balance.data.stores.TokenStore` read.
        lengths: int64 ``[num_docs]``, tokens per kept document.
        num_empty, vocab_size, pad_token_id: as given.

    Raises:
        ValueError: the arrays have the wrong dtype or shape, or inconsistent offsets.

    Example:
        >>> corpus = TokenizedCorpus(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]),
        ...                          np.array([0, 2]), num_empty=1, vocab_size=10, pad_token_id=0)
        >>> len(corpus), corpus.lengths.tolist(), corpus.document(1).tolist()
        (2, [2, 1], [7])
    """

    def __init__(self, token_ids: np.ndarray, offsets: np.ndarray, source_index: np.ndarray, num_empty: int,
                 vocab_size: int, pad_token_id: int, labels: np.ndarray | None = None) -> None:
        if labels is not None and (not isinstance(labels, np.ndarray) or labels.dtype != np.int32
                                   or labels.shape != token_ids.shape):
            got = (f"{labels.dtype} with shape {labels.shape}" if isinstance(labels, np.ndarray)
                   else type(labels).__name__)
            raise InputValueError(f"labels must be None or an int32 array shaped like token_ids {token_ids.shape}, "
                                  f"got {got}")
        for name, array in (("token_ids", token_ids), ("offsets", offsets), ("source_index", source_index)):
            dtype = _ARRAYS[name]
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                got = (f"{array.dtype} with shape {array.shape}" if isinstance(array, np.ndarray)
                       else type(array).__name__)
                raise InputValueError(f"{name} must be a 1-D {np.dtype(dtype)} array, got {got}")
        store = FlatStore(token_ids, offsets, labels)
        if len(source_index) != len(store):
            raise InputValueError(f"source_index has {len(source_index)} entries, expected {len(store)}")
        if num_empty < 0:
            raise InputValueError(f"num_empty must be >= 0, got {num_empty}")
        self._set(store, None, store.lengths, num_empty, vocab_size, pad_token_id)
        self._source_index = source_index

    def _set(self, store: TokenStore, kept: np.ndarray | None, lengths: np.ndarray, num_empty: int,
             vocab_size: int | None, pad_token_id: int | None) -> None:
        self.store, self._kept, self.lengths, self.num_empty = store, kept, lengths, int(num_empty)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self._source_index: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    @classmethod
    def from_store(cls, store: TokenStore, *, vocab_size: int | None, pad_token_id: int | None,
                   drop_empty: bool = True) -> TokenizedCorpus:
        """The documents of ``store`` that hold tokens (corpus document ``i`` is store document
        ``source_index[i]``), planned from its lengths; no token is read.

        Args:
            store: the store.
            vocab_size: ids must lie in ``[0, vocab_size)`` (checked when a document is read, unless the store
                checked them when it was written), or None (not checked).
            pad_token_id: the padding id.
            drop_empty: drop (and count) empty documents; False keeps every document.

        Raises:
            TypeError: ``store`` is not a :class:`~lit_balance.data.stores.TokenStore`.
            ValueError: every document of the store is empty.
        """
        if not isinstance(store, TokenStore):
            raise InputTypeError(f"store must be a TokenStore, got {type(store).__name__}")
        lengths = np.asarray(store.lengths)
        if lengths.dtype != np.int64:
            lengths = lengths.astype(np.int64)
        empty = int(np.count_nonzero(lengths == 0)) if drop_empty else 0
        if drop_empty and empty == len(lengths):
            raise InputValueError(f"{store.description} holds no token: all {len(lengths)} documents are empty")
        kept = np.flatnonzero(lengths).astype(np.int64) if empty else None
        corpus = cls.__new__(cls)
        corpus._set(store, kept, lengths[kept] if empty else lengths, empty, vocab_size, pad_token_id)
        return corpus

    @property
    def has_labels(self) -> bool:
        """Whether the store gives labels beside the ids."""
        return bool(self.store.has_labels)

    @property
    def source_index(self) -> np.ndarray:
        """int64 ``[num_docs]``: each document's index in the source (for a store: in the store)."""
        if self._source_index is not None:
            return self._source_index
        return self._kept if self._kept is not None else np.arange(len(self.lengths), dtype=np.int64)

    def store_documents(self, docs: np.ndarray | None) -> np.ndarray | None:
        """Store indices of corpus documents ``docs`` (None: every document, None back when none was dropped)."""
        if docs is None:
            return self._kept
        return docs if self._kept is None else self._kept[docs]

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[num_docs + 1]``: where each document starts were the documents concatenated (the cache's
        offsets; for another store computed on first access from the lengths, no token read)."""
        if self._offsets is None:
            offsets = getattr(self.store, "offsets", None) if self._kept is None else None
            if offsets is None:
                offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
                np.cumsum(self.lengths, out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    @property
    def token_ids(self) -> np.ndarray:
        """Every id back to back, for a store that keeps them so (the cache's); else AttributeError."""
        return self.store.token_ids

    @property
    def labels(self) -> Any:
        """The labels of every document back to back (the cache's array, or read in full when converted), or
        None without labels."""
        return self.store.labels_of(self._kept)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens (from the lengths)."""
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(len(self.lengths))

    def document(self, i: int) -> np.ndarray:
        """Read the token ids of document ``i`` (negative indices count from the end).

        Raises:
            IndexError: ``i`` is outside ``[-len, len)``.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document index {i} is out of range for {n} documents")
        i %= n
        doc = int(self._kept[i]) if self._kept is not None else i
        return self.store.read(doc, int(self.lengths[i]))[0]


def check_labels(labels: np.ndarray, where: str) -> np.ndarray:
    """int32 labels, each ``-100`` or ``>= 0``; else a ValueError naming ``where``."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise InputValueError(f"{where}: labels must be integers, got dtype {labels.dtype}")
    bad = np.flatnonzero((labels < 0) & (labels != IGNORE_INDEX))
    if bad.size:
        raise InputValueError(f"{where}: label {int(labels[bad[0]])} at position {int(bad[0])} is negative and not "
                              f"{IGNORE_INDEX} (no target)")
    return labels.astype(np.int32, copy=False)
