"""The corpus source that is a tokenized store: :class:`StoreSource` (a subclass says how to open its store)."""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lit_balance.data.sources.base import CorpusSource, TokenIds
from lit_balance.data.stores.base import TokenStore
from lit_balance.data.stores.corpus import TokenizedCorpus
from lit_balance.data.vocabulary import StoreVocabulary
from lit_balance.errors import InputValueError

__all__ = ["StoreSource", "path_list"]


def path_list(paths: Any, name: str = "paths", what: str = "a path", parameter: str = "corpus") -> list[Any]:
    """``paths`` as a non-empty list (one path becomes a list of one), or a ValueError naming ``name``."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not isinstance(paths, Sequence) or isinstance(paths, (bytes, str)) or not paths:
        raise InputValueError(f"{name} must be {what} or a non-empty list of them, got {paths!r:.80}",
                              parameter=parameter)
    return list(paths)


class StoreSource(CorpusSource):
    """A corpus source that is a tokenized store: planned from its index, read in place.

    A subclass defines :meth:`open_store`. The DataModule (:func:`lit_balance.data.cache.open_corpus`) plans from
    the store and reads tokens per micro-batch; the generic path (:meth:`read_records`, e.g. the tokenization
    cache) still works and yields :class:`~lit_balance.data.sources.TokenIds` per document.

    The store is opened once per process (:attr:`store`); the source pickles without it.
    """

    holds_token_ids = True

    @abc.abstractmethod
    def open_store(self) -> TokenStore:
        """Open the store: read and check its index (never the token bytes).

        Raises:
            FileNotFoundError: a file of the store is missing.
            ValueError: a file is not what its format says (naming the file and what is wrong).
        """

    @property
    def store(self) -> TokenStore:
        """The store, opened on first access (:meth:`open_store`) and kept."""
        store = self.__dict__.get("_store")
        if store is None:
            store = self.open_store()
            if not isinstance(store, TokenStore):
                raise InputValueError(f"{type(self).__qualname__}.open_store() must return a TokenStore, got "
                                      f"{type(store).__name__}")
            self.__dict__["_store"] = store
        return store

    def read_records(self) -> Iterator[TokenIds]:
        """Every document in store order as :class:`~lit_balance.data.sources.TokenIds` (ids and labels)."""
        store = self.store
        for doc, length in enumerate(store.lengths.tolist()):
            ids, labels = store.read(doc, length)
            yield TokenIds(np.asarray(ids, dtype=np.int64), labels)

    @property
    def store_vocabulary(self) -> StoreVocabulary:
        """The vocabulary size, pad id and tokenizer the store's own files say (each None when they do not)."""
        store = self.store
        return StoreVocabulary(store.vocab_size, store.pad_token_id, store.description, store.tokenizer_identity)

    def open_in_place(self, tokenizer: Any) -> Any:
        """The store's documents that hold tokens as a :class:`~lit_balance.data.stores.TokenizedCorpus`, planned
        from the index: nothing is tokenized, written to the cache or copied."""
        return TokenizedCorpus.from_store(self.store, vocab_size=tokenizer.vocab_size,
                                          pad_token_id=tokenizer.pad_token_id)

    def identity(self) -> list[str]:
        """The store's :meth:`TokenStore.identity` (its index: names, sizes, lengths), never its tokens."""
        return list(self.store.identity())

    @property
    def files(self) -> tuple[str, ...]:
        """The store's token files (:attr:`TokenStore.files <lit_balance.data.stores.TokenStore.files>`)."""
        return tuple(self.store.files)

    @property
    def description(self) -> str:
        """The store's description."""
        return self.store.description

    @property
    def num_documents(self) -> int:
        """Documents of the store (empty ones included)."""
        return len(self.store)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_store", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
