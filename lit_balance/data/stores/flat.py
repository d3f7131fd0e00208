"""Documents as one flat array of token ids with offsets: :class:`FlatStore`, the tokenization cache's store.

The tokenization cache (:mod:`lit_balance.data.cache`) writes a corpus as ``token_ids.npy`` (all documents back to
back), ``offsets.npy`` and, for masked corpora, ``labels.npy``, and loads them memory-mapped: a :class:`FlatStore`
over those maps is a :class:`~lit_balance.data.stores.TokenStore` like any store read in place, whose
:meth:`~FlatStore.read` slices the arrays.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from lit_balance.data.records import supervised_counts
from lit_balance.data.stores.base import TokenStore
from lit_balance.errors import InputValueError

__all__ = ["FlatStore"]

_CHECK_BLOCK = 1 << 20  # offsets checked per step (no temporary as large as the corpus)


class FlatStore(TokenStore):
    """Documents of one flat token array: document ``d`` is ``token_ids[offsets[d]:offsets[d + 1]]``.

    Reads are slices of the arrays (views of the memory maps the cache loads; nothing is copied until a micro-batch
    is collated). The ids were checked against the vocabulary when the cache was written
    (:attr:`ids_in_vocabulary`), so they are not checked again on every read.

    Args:
        token_ids: int ``[num_tokens]``, every document back to back.
        offsets: int ``[num_docs + 1]``, non-decreasing, from 0 to ``num_tokens``.
        labels: int ``[num_tokens]`` aligned with ``token_ids`` (unshifted; ``-100``: no target), or None when every
            token is a target.

    Raises:
        ValueError: arrays that are not 1-D, offsets that do not run from 0 to ``len(token_ids)`` without
            decreasing, ``labels`` not shaped like ``token_ids``.

    Example:
        >>> store = FlatStore(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
        >>> store.lengths.tolist(), store.read(0, 1)[0].tolist()
        ([2, 1], [5])
    """

    ids_in_vocabulary = True

    def __init__(self, token_ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray | None = None) -> None:
        if labels is not None and np.shape(labels) != np.shape(token_ids):
            raise InputValueError(f"labels must be shaped like token_ids {np.shape(token_ids)}, got {np.shape(labels)}")
        offsets = np.asarray(offsets)
        if offsets.dtype != np.int64:
            offsets = offsets.astype(np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(token_ids):
            raise InputValueError(f"offsets must run from 0 to len(token_ids)={len(token_ids)}, "
                                  f"got {offsets[:1].tolist()}..{offsets[-1:].tolist()}")
        for begin in range(0, len(offsets) - 1, _CHECK_BLOCK):
            block = np.asarray(offsets[begin:begin + _CHECK_BLOCK + 1])
            if np.any(block[1:] < block[:-1]):
                raise InputValueError("offsets must be non-decreasing")
        self._token_ids, self.offsets, self._labels = token_ids, offsets, labels
        # plain views of the maps for reads: slicing a numpy.memmap costs a subclass finalizer on every item
        self._ids_view = np.asarray(token_ids)
        self._labels_view = None if labels is None else np.asarray(labels)
        self.has_labels = labels is not None
        self._lengths: np.ndarray | None = None
        self._num_docs = len(offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens per document (the differences of the offsets, computed once)."""
        if self._lengths is None:
            self._lengths = np.diff(np.asarray(self.offsets))
        return self._lengths

    @property
    def token_ids(self) -> np.ndarray:
        """int ``[num_tokens]``: every document back to back (the cache's memory map)."""
        return self._token_ids

    @property
    def dtype(self) -> np.dtype:
        """The dtype of ``token_ids`` (int32 in the cache)."""
        return self._ids_view.dtype

    @property
    def num_tokens(self) -> int:
        """Tokens of every document."""
        return len(self.token_ids)

    @property
    def description(self) -> str:
        """E.g. ``"flat token store (1,000 documents, 51,200 tokens)"``."""
        return f"flat token store ({len(self):,} documents, {self.num_tokens:,} tokens)"

    def labels_of(self, docs: np.ndarray | None) -> Any:
        """The flat ``labels`` array for every document (``docs`` None), else as :meth:`TokenStore.labels_of`."""
        return self._labels if docs is None else super().labels_of(docs)

    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``length`` ids (and labels) of document ``doc``: slices of the arrays (views, not copies)."""
        doc, length = int(doc), int(length)
        start = int(self.offsets[doc]) if 0 <= doc < self._num_docs else -1
        if start < 0 or not 0 <= length <= int(self.offsets[doc + 1]) - start:
            self._check_read(doc, length)  # raises, naming the document (checked inline: this is every item's path)
        labels = None if self._labels_view is None else self._labels_view[start:start + length]
        return self._ids_view[start:start + length], labels

    def supervised_lengths(self, lengths: np.ndarray, docs: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`TokenStore.supervised_lengths`, counted on the flat labels in one vectorised pass."""
        docs = np.arange(len(self), dtype=np.int64) if docs is None else np.asarray(docs, dtype=np.int64)
        return supervised_counts(self._labels, self.offsets, docs, np.asarray(lengths, dtype=np.int64))

    def identity(self) -> list[str]:
        """The document and token counts and the sha256 of the offsets (never the tokens)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.offsets, dtype="<i8").tobytes()).hexdigest()
        return ["flat", str(len(self)), str(self.num_tokens), digest]
