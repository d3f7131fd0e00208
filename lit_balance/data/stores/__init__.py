"""Tokenized stores read in place: Megatron ``.bin/.idx``, Arrow / Parquet ``input_ids`` columns (and the interface,
:class:`TokenStore` and :class:`StoreSource`, that other formats implement)."""

from lit_balance.data.stores.base import StoreSource, TokenStore

__all__ = ["StoreSource", "TokenStore"]
