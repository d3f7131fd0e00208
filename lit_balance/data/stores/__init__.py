"""Tokenized stores read in place: Megatron ``.bin/.idx`` (:class:`MegatronSource`), datatrove ``DocumentTokenizer``
folders (:class:`DatatroveSource`), Arrow / Parquet ``input_ids`` columns (:class:`ArrowSource`), the tokenization
cache's flat arrays (:class:`FlatStore`), and the interface they implement (:class:`TokenStore`, :class:`StoreSource`;
several files of a format as one store: :class:`MultiFileStore` over one :class:`StoreFile` each).
:func:`lit_balance.data.cache.open_corpus` gives the DataModule a corpus' :class:`TokenizedCorpus` (a store's: its
lengths, without reading a token); :class:`~lit_balance.data.dataset.TokenDataset` reads each document when its
micro-batch is built."""

from lit_balance.data.stores._files import StoreChangedError
from lit_balance.data.stores.arrow import ArrowSource, ArrowStore
from lit_balance.data.stores.base import TokenStore
from lit_balance.data.stores.corpus import TokenizedCorpus
from lit_balance.data.stores.datatrove import DatatroveSource, DatatroveStore
from lit_balance.data.stores.flat import FlatStore
from lit_balance.data.stores.megatron import MegatronSource, MegatronStore
from lit_balance.data.stores.multifile import MultiFileStore, StoreFile
from lit_balance.data.stores.source import StoreSource

__all__ = ["ArrowSource", "ArrowStore", "DatatroveSource", "DatatroveStore", "FlatStore", "MegatronSource",
           "MegatronStore", "MultiFileStore", "StoreChangedError", "StoreFile", "StoreSource", "TokenStore",
           "TokenizedCorpus"]
