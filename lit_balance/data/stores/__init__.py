"""Tokenized stores read in place: Megatron ``.bin/.idx`` (:class:`MegatronSource`), datatrove ``DocumentTokenizer``
folders (:class:`DatatroveSource`), Arrow / Parquet ``input_ids`` columns (:class:`ArrowSource`), and the interface
other formats implement (:class:`TokenStore`, :class:`StoreSource`). :func:`open_corpus` gives the DataModule a store's
lengths (a :class:`StoreCorpus`) without reading a token; :class:`StoreDataset` reads each document when its
micro-batch is built."""

from lit_balance.data.stores._files import StoreChangedError
from lit_balance.data.stores.arrow import ArrowSource, ArrowStore
from lit_balance.data.stores.base import StoreSource, TokenStore
from lit_balance.data.stores.corpus import StoreCorpus, StoreDataset, open_corpus, store_tokenizer
from lit_balance.data.stores.datatrove import DatatroveSource, DatatroveStore
from lit_balance.data.stores.megatron import MegatronSource, MegatronStore

__all__ = ["ArrowSource", "ArrowStore", "DatatroveSource", "DatatroveStore", "MegatronSource", "MegatronStore",
           "StoreChangedError", "StoreCorpus", "StoreDataset", "StoreSource", "TokenStore", "open_corpus",
           "store_tokenizer"]
