"""A tokenized store as the DataModule's corpus: :class:`StoreCorpus`, :class:`StoreDataset` and :func:`open_corpus`.

:func:`open_corpus` is where a DataModule gets its tokenized corpus: the tokenization cache's
:class:`~lit_balance.data.cache.TokenizedCorpus` for a text or token-id source, a :class:`StoreCorpus` (lengths
from the store's index, nothing read or written) for a :class:`~lit_balance.data.stores.StoreSource`.
:func:`lit_balance.data.splits.split_corpus` turns a :class:`StoreCorpus` into :class:`StoreDataset` splits, whose
items are read from the store when a micro-batch is built: the first ``max_length`` tokens of each of its documents,
checked against the vocabulary.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from lit_balance.data.cache import load_or_build
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores.base import StoreSource, TokenStore
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["StoreCorpus", "StoreDataset", "open_corpus", "store_tokenizer"]


class StoreCorpus:
    """The documents of a :class:`TokenStore` that hold tokens, planned from its lengths (the surface of
    :class:`~lit_balance.data.cache.TokenizedCorpus` that planning reads; tokens are read per document).

    Empty documents are dropped and counted, as the tokenization cache does: corpus document ``i`` is store
    document ``source_index[i]``.

    Args:
        store: the store.
        vocab_size: ids must lie in ``[0, vocab_size)`` (checked when a document is read).
        pad_token_id: the padding id.

    Attributes:
        store: the store.
        lengths: int64 ``[num_docs]``, tokens per kept document.
        num_empty: store documents dropped because they hold no token.
        vocab_size, pad_token_id: as given.
        labels: None (the labels, if any, are read with the ids: :attr:`has_labels`).

    Raises:
        ValueError: every document of the store is empty.

    Example:
        >>> corpus = StoreCorpus(my_store, vocab_size=32000, pad_token_id=0)  # doctest: +SKIP
    """

    labels = None

    def __init__(self, store: TokenStore, *, vocab_size: int, pad_token_id: int) -> None:
        if not isinstance(store, TokenStore):
            raise InputTypeError(f"store must be a TokenStore, got {type(store).__name__}")
        lengths = np.asarray(store.lengths)
        if lengths.dtype != np.int64:
            lengths = lengths.astype(np.int64)
        empty = int(np.count_nonzero(lengths == 0))
        if empty == len(lengths):
            raise InputValueError(f"{store.description} holds no token: all {len(lengths)} documents are empty")
        self.store = store
        self.num_empty = empty
        self._kept = np.flatnonzero(lengths).astype(np.int64) if empty else None
        self.lengths = lengths[self._kept] if empty else lengths
        self.vocab_size = int(vocab_size)
        self.pad_token_id = int(pad_token_id)
        self._offsets: np.ndarray | None = None

    @property
    def has_labels(self) -> bool:
        """Whether the store gives labels beside the ids."""
        return bool(self.store.has_labels)

    @property
    def source_index(self) -> np.ndarray:
        """int64 ``[num_docs]``: each kept document's index in the store (computed on access when none is empty)."""
        return self._kept if self._kept is not None else np.arange(len(self.lengths), dtype=np.int64)

    def store_documents(self, docs: np.ndarray | None) -> np.ndarray | None:
        """Store indices of corpus documents ``docs`` (None: every document, None back when none was dropped)."""
        if docs is None:
            return self._kept
        return docs if self._kept is None else self._kept[docs]

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[num_docs + 1]``: where each document would start were the kept documents concatenated
        (computed on first access; no token is read)."""
        if self._offsets is None:
            offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=offsets[1:])
            self._offsets = offsets
        return self._offsets

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
        doc = int(self.source_index[i]) if self._kept is not None else i
        return self.store.read(doc, int(self.lengths[i]))[0]


class _FlatLabels:
    """The labels of a store's kept documents as one flat int32 array (read in full when converted: only the rare
    checks that need every label use it)."""

    def __init__(self, corpus: StoreCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return self.corpus.num_tokens

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        store, parts = self.corpus.store, []
        for doc, length in zip(self.corpus.source_index.tolist(), self.corpus.lengths.tolist()):
            parts.append(np.asarray(store.read(doc, length)[1], dtype=np.int32))
        out = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return out if dtype is None else out.astype(dtype)


class StoreDataset(TokenDataset):
    """Documents ``doc_ids`` of a :class:`StoreCorpus`, each truncated to ``max_length`` tokens, read on access.

    Items are those of :class:`~lit_balance.data.dataset.TokenDataset` (``input_ids`` int32, ``labels`` int32 when the
    store has labels, ``index``, ``is_fill`` and the plan's step totals): item ``i`` reads the first ``lengths[i]``
    tokens of its document from the store's memory-mapped files, and only those.

    Args:
        corpus: the store corpus.
        doc_ids: int ``[len(self)]``, corpus documents this dataset holds, or None for every document in order (no
            index array is built).
        max_length: keep at most this many tokens per document, or None.

    Raises:
        ValueError: ``doc_ids`` out of range or ``max_length < 1``; on reading, an id outside
            ``[0, corpus.vocab_size)`` (naming the file and the document) or a file shorter than its index says.
    """

    def __init__(self, corpus: StoreCorpus, doc_ids: np.ndarray | None = None, max_length: int | None = None) -> None:
        if max_length is not None and max_length < 1:
            raise InputValueError(f"max_length must be >= 1 or None, got {max_length}")
        num_docs = len(corpus)
        if doc_ids is not None:
            doc_ids = np.asarray(doc_ids, dtype=np.int64)
            if doc_ids.size and (doc_ids.min() < 0 or doc_ids.max() >= num_docs):
                raise InputValueError(f"doc_ids must lie in [0, {num_docs}), got min {doc_ids.min()} "
                                      f"max {doc_ids.max()}")
        self.corpus = corpus
        self.store = corpus.store
        self._doc_ids = doc_ids
        self._store_docs = corpus.store_documents(doc_ids)
        self.max_length = max_length
        full = corpus.lengths if doc_ids is None else corpus.lengths[doc_ids]
        #: int64 ``[len(self)]``: tokens per item after truncation.
        self.lengths = full if max_length is None else np.minimum(full, max_length)
        self.vocab_size = corpus.vocab_size

    @property
    def doc_ids(self) -> np.ndarray:  # type: ignore[override]
        """int64 ``[len(self)]``: the corpus documents (built on access when the dataset holds all of them)."""
        return self._doc_ids if self._doc_ids is not None else np.arange(len(self.lengths), dtype=np.int64)

    @property
    def offsets(self) -> np.ndarray:  # type: ignore[override]
        """The corpus' :attr:`StoreCorpus.offsets` (computed on first access, from the lengths)."""
        return self.corpus.offsets

    @property
    def labels(self) -> Any:  # type: ignore[override]
        """None without labels; else a flat view of the corpus' labels, read in full only when converted."""
        return _FlatLabels(self.corpus) if self.corpus.has_labels else None

    @property
    def token_ids(self) -> Any:  # type: ignore[override]
        raise AttributeError("a StoreDataset reads tokens per document (dataset[i]); it holds no flat token array")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def supervised_lengths(self, max_length: int | None = None) -> np.ndarray:
        """As :meth:`TokenDataset.supervised_lengths`, from the store (:meth:`TokenStore.supervised_lengths`)."""
        lengths = self.lengths if max_length is None else np.minimum(self.lengths, max_length)
        return self.store.supervised_lengths(lengths, self._store_docs)

    def _store_doc(self, i: int) -> int:
        return i if self._store_docs is None else int(self._store_docs[i])

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} documents")
        doc = self._store_doc(i)
        ids, labels = self.store.read(doc, int(self.lengths[i]))
        ids = np.asarray(ids)
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                position = int(np.flatnonzero(ids == bad)[0])
                raise InputValueError(
                    f"{self.store.where(doc)} holds the token id {bad} at position {position}, outside the vocabulary "
                    f"[0, {self.vocab_size}); train with a model (vocab_size) that covers the store's tokenizer, or "
                    "check that the store was written with the tokenizer you meant", parameter="vocab_size")
        item = {"input_ids": ids.astype(np.int32, copy=False), "index": i, "is_fill": is_fill}
        if labels is not None:
            labels = np.asarray(labels)
            if labels.size and int(labels.max()) >= self.vocab_size:
                position = int(np.argmax(labels >= self.vocab_size))
                raise InputValueError(
                    f"{self.store.where(doc)} holds the label {int(labels[position])} at position {position}, outside "
                    f"the vocabulary [0, {self.vocab_size}) (labels are target token ids, or {IGNORE_INDEX} for no "
                    "target); fix the labels column, or train with a model (vocab_size) that covers them",
                    parameter="vocab_size")
            item["labels"] = labels.astype(np.int32, copy=False)
        return item


def store_tokenizer(source: StoreSource, tokenizer: Any = None, *, vocab_size: int | None = None,
                    pad_token_id: int | None = None) -> TokenizerAdapter:
    """The vocabulary a store trains with: ``vocab_size`` (the model's), the tokenizer's, or the store's own.

    Args:
        source: the store source (its index is read here).
        tokenizer: None, or a tokenizer (object or path): its vocabulary and pad id are used.
        vocab_size: the model's vocabulary size, or None (then the tokenizer's, or the store's metadata).
        pad_token_id: the padding id, or None (then the tokenizer's, or the store's metadata).

    Returns:
        A :class:`~lit_balance.data.tokenizer.TokenizerAdapter` (with no tokenizer: one for token ids).

    Raises:
        ValueError: no vocabulary size or pad id is known (the store does not say them and none was given);
            ``vocab_size`` differs from the tokenizer's; the store's own vocabulary is larger than the one trained
            with.
    """
    store = source.store
    where = store.description
    if tokenizer is not None:
        adapter = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id)
        if vocab_size is not None and vocab_size != adapter.vocab_size:
            raise InputValueError(f"vocab_size={vocab_size} conflicts with the given tokenizer's vocabulary of "
                                  f"{adapter.vocab_size} token ids ({where}); leave vocab_size unset (None) or leave "
                                  "the tokenizer out", parameter="vocab_size")
    else:
        vocab = vocab_size if vocab_size is not None else store.vocab_size
        if vocab is None:
            raise InputValueError(f"{where} does not say its vocabulary size: pass vocab_size= (the model's "
                                  "vocabulary; every id must be below it) or tokenizer=", parameter="vocab_size")
        pad = pad_token_id if pad_token_id is not None else store.pad_token_id
        if pad is None:
            raise InputValueError(f"{where} does not say its padding id: pass pad_token_id= (an id in "
                                  f"[0, {vocab}), e.g. the tokenizer's end-of-text id) or tokenizer=",
                                  parameter="pad_token_id")
        adapter = TokenizerAdapter.for_token_ids(vocab_size=vocab, pad_token_id=pad)
    if store.vocab_size is not None and store.vocab_size > adapter.vocab_size:
        raise InputValueError(f"{where} was written with a vocabulary of {store.vocab_size} token ids, more than the "
                              f"{adapter.vocab_size} trained with; raise vocab_size to at least {store.vocab_size}",
                              parameter="vocab_size")
    return adapter


def open_corpus(source: Any, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike | None = None, *,
                progress: bool = False) -> Any:
    """The tokenized corpus of ``source``: a :class:`StoreCorpus` for a store (read in place: nothing tokenized,
    written or copied), else the tokenization cache's entry (:func:`lit_balance.data.cache.load_or_build`).

    Args:
        source: a :class:`~lit_balance.data.sources.CorpusSource`.
        tokenizer: the tokenizer (for a store: its ``vocab_size`` bounds the ids, its ``pad_token_id`` pads).
        cache_dir: the cache directory (unused for a store).
        progress: show a progress bar while tokenizing.

    Returns:
        A :class:`StoreCorpus` or a :class:`~lit_balance.data.cache.TokenizedCorpus`.
    """
    if isinstance(source, StoreSource):
        return StoreCorpus(source.store, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id)
    return load_or_build(source, tokenizer, cache_dir, progress=progress)


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
