"""The map-style dataset of tokenized documents (:class:`TokenDataset`), read from any store or the cache."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores.corpus import TokenizedCorpus
from lit_balance.data.stores.flat import FlatStore
from lit_balance.errors import InputValueError
from lit_balance.plan.types import MicroBatch

__all__ = ["KnownLengths", "MicroBatchItems", "TokenDataset"]

_STEP_KEYS = ("step_real_tokens", "step_rows", "step_supervised_tokens")


class KnownLengths(abc.ABC):
    """Declares that a map-style dataset of dicts knows its items' lengths without reading the items (a store's
    index): :func:`~lit_balance.item_lengths` (and so :class:`~lit_balance.MicroBatchDataset`) asks
    :meth:`lengths_of` before reading any item. A dataset declares it by deriving from this class
    (:class:`TokenDataset` does); any other dataset's items are read.
    """

    @abc.abstractmethod
    def lengths_of(self, fields: Sequence[str]) -> np.ndarray | None:
        """int64 ``[len(self)]``: each item's length in ``fields`` (the longest of them), or None when the dataset does
        not know them without reading its items (then they are read)."""


class MicroBatchItems(Dataset):
    """A map-style dataset whose ``_item(index, is_fill)`` gives one sample's dict: ``dataset[i]`` is that item, and
    ``dataset[micro_batch]`` (``__getitems__``) its micro-batch's items, each with the plan's per-optimizer-step totals
    (global ints) when the sampler attaches them to the :class:`~lit_balance.plan.types.MicroBatch`."""

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, index: int | Sequence[int]) -> Any:
        if isinstance(index, (int, np.integer)):
            return self._item(int(index))
        return self.__getitems__(index)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        is_fill = indices.is_fill if isinstance(indices, MicroBatch) else (False,) * len(indices)
        items = [self._item(int(i), bool(f)) for i, f in zip(indices, is_fill)]
        step = {k: int(getattr(indices, k)) for k in _STEP_KEYS if getattr(indices, k, None) is not None}
        if step:
            for item in items:
                item.update(step)
        return items


class TokenDataset(MicroBatchItems, KnownLengths):
    """Documents ``doc_ids`` of a tokenized corpus, each truncated to ``max_length`` tokens, read on access: the one
    dataset of the cache and of every store.

    Item ``i`` is ``{"input_ids": int32 ndarray [len_i], "index": i, "is_fill": False}``, plus
    ``"labels"`` (int32 ndarray ``[len_i]``, unshifted, ``-100`` where a token has no target) when the
    dataset has labels (a prompt–completion corpus, pre-tokenized labels, a store's label column or mask). Item ``i``
    reads the first ``lengths[i]`` tokens of its document from the corpus' store
    (:meth:`~lit_balance.data.stores.TokenStore.read`), and only those; ids are checked against the corpus'
    vocabulary unless the store checked them when it was written. Indexing with a list of indices (or a
    :class:`lit_balance.MicroBatch`, whose fill mask is carried into ``is_fill``) returns the list of items, so the
    dataset works both with ``DataLoader(batch_sampler=...)`` and with ``DataLoader(sampler=..., batch_size=None)``.
    When the micro-batch carries the plan's ``step_real_tokens``, ``step_rows`` and ``step_supervised_tokens`` (ints,
    over all ranks and micro-batches of its optimizer step), every item of the list carries them too.

    The constructor takes a flat token array (a :class:`~lit_balance.data.stores.FlatStore` is built over it);
    :meth:`of` takes a :class:`~lit_balance.data.stores.TokenizedCorpus` (the cache's or any store's).

    Args:
        token_ids: int ``[num_tokens]``, all documents concatenated.
        offsets: int ``[num_docs + 1]``; document ``d`` is ``token_ids[offsets[d]:offsets[d + 1]]``.
        doc_ids: int ``[len(self)]``, which documents this dataset holds (e.g. a train split).
        max_length: keep at most this many tokens per document, or None.
        labels: int ``[num_tokens]`` aligned with ``token_ids`` (unshifted; ``-100``: no target), or None
            when every token is a target.

    Raises:
        ValueError: ``doc_ids`` out of range, ``max_length < 1``, or ``labels`` not shaped like ``token_ids``; on
            reading, an id outside ``[0, vocab_size)`` (naming the file and the document) or a file shorter than its
            index says.

    Example:
        >>> ds = TokenDataset(np.array([1, 2, 3, 4, 5]), np.array([0, 3, 5]), np.array([1, 0]), max_length=2)
        >>> ds.lengths.tolist(), ds[1]["input_ids"].tolist()
        ([2, 2], [1, 2])
    """

    #: Micro-batches of its documents may be planned shorter than they are (``too_long="truncate"``): the collators
    #: of token documents (:class:`~lit_balance.PadCollator`, :class:`~lit_balance.PackedCollator`, given the
    #: sampler's ``truncate_to`` as ``max_length``) cut them, so :func:`~lit_balance.data.loader.balanced_dataloader`
    #: does not compare the items' lengths with ``truncate_to``.
    cut_by_collator = True

    def __init__(self, token_ids: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, max_length: int | None = None,
                 labels: np.ndarray | None = None) -> None:
        store = FlatStore(token_ids, offsets, labels)
        self._init(TokenizedCorpus.from_store(store, vocab_size=None, pad_token_id=None, drop_empty=False),
                   np.asarray(doc_ids, dtype=np.int64), max_length)

    @classmethod
    def of(cls, corpus: TokenizedCorpus, doc_ids: np.ndarray | None = None,
           max_length: int | None = None) -> TokenDataset:
        """Documents ``doc_ids`` of ``corpus`` (None: every document in order, no index array built), truncated to
        ``max_length`` tokens.

        Raises:
            ValueError: ``doc_ids`` out of range or ``max_length < 1``.
        """
        dataset = cls.__new__(cls)
        dataset._init(corpus, None if doc_ids is None else np.asarray(doc_ids, dtype=np.int64), max_length)
        return dataset

    def _init(self, corpus: TokenizedCorpus, doc_ids: np.ndarray | None, max_length: int | None) -> None:
        num_docs = len(corpus)
        if doc_ids is not None and doc_ids.size and (doc_ids.min() < 0 or doc_ids.max() >= num_docs):
            raise InputValueError(f"doc_ids must lie in [0, {num_docs}), got min {doc_ids.min()} max {doc_ids.max()}")
        if max_length is not None and max_length < 1:
            raise InputValueError(f"max_length must be >= 1 or None, got {max_length}")
        self.corpus, self.store, self._doc_ids, self.max_length = corpus, corpus.store, doc_ids, max_length
        self._store_docs = corpus.store_documents(doc_ids)
        full = corpus.lengths if doc_ids is None else corpus.lengths[doc_ids]
        #: int64 ``[len(self)]``: tokens per item after truncation.
        self.lengths = full if max_length is None else np.minimum(full, max_length)
        self.vocab_size = None if self.store.ids_in_vocabulary else corpus.vocab_size

    @property
    def doc_ids(self) -> np.ndarray:
        """int64 ``[len(self)]``: the corpus documents (built on access when the dataset holds all of them)."""
        return self._doc_ids if self._doc_ids is not None else np.arange(len(self.lengths), dtype=np.int64)

    @property
    def offsets(self) -> np.ndarray:
        """The corpus' :attr:`~lit_balance.data.stores.TokenizedCorpus.offsets`."""
        return self.corpus.offsets

    @property
    def token_ids(self) -> np.ndarray:
        """The corpus' flat token array (the cache's); AttributeError for a store read per document."""
        return self.corpus.token_ids

    @property
    def labels(self) -> Any:
        """None without labels; else the corpus' labels back to back (for a store read in place: read in full only
        when converted)."""
        return self.corpus.labels

    @property
    def has_labels(self) -> bool:
        """Whether items carry ``labels``."""
        return self.corpus.has_labels

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def lengths_of(self, fields: Sequence[str]) -> np.ndarray | None:
        """int64 ``[len(self)]``: the items' lengths in ``fields`` when they are among ``input_ids`` and ``labels``
        (:attr:`lengths`: no token read), else None."""
        return np.array(self.lengths, dtype=np.int64) if set(fields) <= {"input_ids", "labels"} else None

    def supervised_lengths(self, max_length: int | None = None, items: np.ndarray | None = None,
                           full: bool = False) -> np.ndarray:
        """int64 ``[len(self)]``: next-token targets of each item as a causal LM counts them after the shift.

        Labels ``1 .. length-1`` that are not ``-100`` (:func:`lit_balance.data.records.supervised_counts`,
        :meth:`~lit_balance.data.stores.TokenStore.supervised_lengths`); without labels, ``length - 1``. These are the
        per-sample counts a :class:`~lit_balance.BalancedBatchSampler` takes as ``supervised_lengths``.

        Args:
            max_length: count items cut further to this many tokens (e.g. the sampler's ``truncate_to`` with
                ``too_long="truncate"``), or None for :attr:`lengths`.
            items: count only these items (int ``[n]``), or None for every item.
            full: count the whole documents, before the dataset's ``max_length``.
        """
        lengths = self.corpus.lengths[self.doc_ids] if full else self.lengths
        if max_length is not None:
            lengths = np.minimum(lengths, max_length)
        docs = self._store_docs
        if items is not None:
            items = np.asarray(items, dtype=np.int64)
            lengths = lengths[items]
            docs = items if docs is None else docs[items]
        return self.store.supervised_lengths(lengths, docs)

    def document_origins(self, items: np.ndarray) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
        """Where items ``items`` come from, for many at once (what the ledger of a run records per document).

        Args:
            items: int ``[n]``, item indices of this dataset.

        Returns:
            ``(columns, files)``: ``columns`` holds int64 ``[n]`` arrays ``corpus_document`` (the document's index in
            the corpus, before the train/validation split), ``store_document`` (its index in the store, after empty
            documents were left out: what :meth:`~lit_balance.data.stores.TokenStore.read` reads),
            ``document_tokens`` (its whole length, before ``max_length``), int32 ``store_file`` (a position in
            ``files``) and int64 ``file_document`` (its number within that file: an Arrow row, a Megatron or
            datatrove document), from :meth:`~lit_balance.data.stores.TokenStore.locate_documents`.
        """
        items = np.asarray(items, dtype=np.int64)
        corpus_docs = items if self._doc_ids is None else self._doc_ids[items]
        store_docs = items if self._store_docs is None else self._store_docs[items]
        files, file, local = self.store.locate_documents(store_docs)
        return {"corpus_document": corpus_docs, "store_document": store_docs,
                "document_tokens": np.asarray(self.corpus.lengths, dtype=np.int64)[corpus_docs],
                "store_file": file, "file_document": local}, tuple(files)

    def store_document(self, i: int) -> int:
        """The store's index of item ``i``'s document (what :meth:`~lit_balance.data.stores.TokenStore.read` reads)."""
        return i if self._store_docs is None else int(self._store_docs[i])

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} documents")
        doc = i if self._store_docs is None else int(self._store_docs[i])
        ids, labels = self.store.read(doc, int(self.lengths[i]))
        ids = np.asarray(ids)
        vocab = self.vocab_size
        if vocab is not None and ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                position = int(np.flatnonzero(ids == bad)[0])
                raise InputValueError(
                    f"{self.store.where(doc)} holds the token id {bad} at position {position}, outside the vocabulary "
                    f"[0, {vocab}); train with a model (vocab_size) that covers the store's tokenizer, or "
                    "check that the store was written with the tokenizer you meant", parameter="vocab_size")
        item = {"input_ids": ids if ids.dtype == np.int32 else ids.astype(np.int32), "index": i, "is_fill": is_fill}
        if labels is not None:
            labels = np.asarray(labels)
            if vocab is not None and labels.size and int(labels.max()) >= vocab:
                position = int(np.argmax(labels >= vocab))
                raise InputValueError(
                    f"{self.store.where(doc)} holds the label {int(labels[position])} at position {position}, outside "
                    f"the vocabulary [0, {vocab}) (labels are target token ids, or {IGNORE_INDEX} for no "
                    "target); fix the labels column, or train with a model (vocab_size) that covers them",
                    parameter="vocab_size")
            item["labels"] = labels if labels.dtype == np.int32 else labels.astype(np.int32)
        return item
