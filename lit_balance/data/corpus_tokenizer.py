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
from lit_balance.data.tokenizer import TokenizerAdapter
from lit_balance.data.vocabulary import decide_vocabulary
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


def corpus_tokenizer(source: CorpusSource, tokenizer: Any, *, vocab_size: Any, pad_token_id: Any,
                     add_special_tokens: bool, allow_tokenizer_mismatch: bool = False) -> TokenizerAdapter:
    """The tokenizer of ``source`` (:func:`lit_balance.data.vocabulary.decide_vocabulary`, with what the source's own
    files say, :attr:`CorpusSource.store_vocabulary`): the given one (or the built-in one), a token-id corpus'
    vocabulary, or a tokenized store's. A store written with another tokenizer than the given one is refused unless
    ``allow_tokenizer_mismatch`` (:func:`lit_balance.data.tokenizer_identity.check_store_tokenizer`).

    Raises:
        TypeError, ValueError: a bad ``vocab_size`` or ``pad_token_id``; ``add_special_tokens`` with token ids; a
            ``vocab_size`` that disagrees with the tokenizer's, or below a token id of the corpus; a store written
            with another tokenizer (without ``allow_tokenizer_mismatch``).
    """
    vocab_size, pad_token_id = _check_vocab_size(vocab_size), _check_pad_token_id(pad_token_id)
    largest = None if source.key_after_reading else (
        lambda: max((int(np.max(d)) for d in source.load_token_ids() if len(d)), default=0))
    return decide_vocabulary(tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                             store=source.store_vocabulary, holds_token_ids=source.holds_token_ids,
                             largest_id=largest, add_special_tokens=add_special_tokens, kind=source.kind,
                             allow_tokenizer_mismatch=allow_tokenizer_mismatch)
