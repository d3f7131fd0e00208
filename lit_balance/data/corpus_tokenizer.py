"""The tokenizer and vocabulary of a corpus, and the DataModule's checks of the related arguments.

:class:`~lit_balance.BalancedTextDataModule` resolves its tokenizer once, at construction, through
:func:`corpus_tokenizer`: the given (or built-in) tokenizer for text, or the vocabulary of a token-id corpus.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lit_balance._checks import check_int
from lit_balance.data.cache import default_cache_dir
from lit_balance.data.stores import StoreSource, store_tokenizer
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.errors import InputTypeError, InputValueError

if TYPE_CHECKING:
    from lit_balance.data.sources import CorpusSource

__all__ = ["check_cache_dir", "corpus_tokenizer"]


def check_cache_dir(cache_dir: Any) -> Path:
    """``cache_dir`` as a Path (the default cache directory for None)."""
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise InputTypeError(f"cache_dir must be a directory path (str or os.PathLike) or None, got {cache_dir!r} "
                             f"of type {type(cache_dir).__name__}", parameter="cache_dir")
    if Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise InputValueError(f"cache_dir {str(cache_dir)!r} exists and is not a directory; pass a directory path",
                              parameter="cache_dir")
    return Path(cache_dir)


def _check_vocab_size(vocab_size: Any) -> int | None:
    if vocab_size is None:
        return None
    return check_int("vocab_size", vocab_size, 1, "token ids of a token-id corpus without a tokenizer, or None (the "
                     "default: largest id + 1, or the tokenizer's)", maximum=2**31)


def _check_pad_token_id(pad_token_id: Any) -> int | None:
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise InputTypeError(f"pad_token_id must be an int or None, got {type(pad_token_id).__name__} "
                             f"{pad_token_id!r}", parameter="pad_token_id")
    return pad_token_id


def _token_id_tokenizer(source: CorpusSource, vocab_size: int | None, pad_token_id: int | None) -> TokenizerAdapter:
    """The vocabulary of a token-id corpus without a tokenizer: ``vocab_size``, or its largest id + 1."""
    pad = 0 if pad_token_id is None else pad_token_id
    if source.key_after_reading and vocab_size is None:
        raise InputValueError("a Hugging Face IterableDataset of token ids is read once, into the cache, so its "
                              "largest id is not known in advance: pass vocab_size= (or a tokenizer)",
                              parameter="vocab_size")
    # an IterableDataset's ids are checked against vocab_size when it is read into the cache
    largest = 0 if source.key_after_reading else max(
        (int(np.max(d)) for d in source.load_token_ids() if len(d)), default=0)
    if vocab_size is None:
        vocab_size = max(largest, pad) + 1
    # validates vocab_size and pad_token_id now, not at prepare_data
    adapter = TokenizerAdapter.for_token_ids(vocab_size=vocab_size, pad_token_id=pad)
    if largest >= adapter.vocab_size:
        raise InputValueError(f"token id {largest} is outside vocab_size={vocab_size}; raise vocab_size",
                              parameter="vocab_size")
    return adapter


def corpus_tokenizer(source: CorpusSource, tokenizer: Any, *, vocab_size: Any, pad_token_id: Any,
                     add_special_tokens: bool) -> TokenizerAdapter:
    """The tokenizer of ``source``: the given one (or the built-in one), or a token-id corpus' vocabulary.

    Raises:
        TypeError, ValueError: a bad ``vocab_size`` or ``pad_token_id``; ``add_special_tokens`` with token ids; a
            ``vocab_size`` that disagrees with the tokenizer's, or below a token id of the corpus.
    """
    vocab_size, pad_token_id = _check_vocab_size(vocab_size), _check_pad_token_id(pad_token_id)
    if source.holds_token_ids and add_special_tokens:
        raise InputValueError("add_special_tokens=True applies to text corpora only: a token-id corpus is used as "
                              "given (never re-encoded, with or without a tokenizer), so add the special ids to each "
                              "document yourself, or leave add_special_tokens=False", parameter="add_special_tokens")
    if isinstance(source, StoreSource):  # a tokenized store: its own metadata, or what is given
        return store_tokenizer(source, tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id)
    if source.holds_token_ids and tokenizer is None:
        return _token_id_tokenizer(source, vocab_size, pad_token_id)
    adapter = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id, add_special_tokens=add_special_tokens)
    if vocab_size is not None and vocab_size != adapter.vocab_size:
        with_what = "the built-in tokenizer" if tokenizer is None else "the given tokenizer"
        raise InputValueError(
            f"vocab_size={vocab_size} conflicts with {with_what}'s vocabulary of {adapter.vocab_size} "
            f"token ids ({source.kind} corpus); the vocabulary is the tokenizer's, and vocab_size only "
            "sets it for token-id corpora without a tokenizer: leave vocab_size unset (None)", parameter="vocab_size")
    return adapter
