"""Where a corpus' vocabulary size and padding id are decided: :func:`decide_vocabulary`, the one place.

Three things can say them: the tokenizer given (or the built-in one), what a tokenized store's own files say
(:class:`StoreVocabulary`: the size and pad id its writer recorded, or the ``tokenizer.json`` it names), and the
user's ``vocab_size`` / ``pad_token_id``. :func:`decide_vocabulary` weighs them, checks that they agree, and returns
the :class:`~lit_balance.data.tokenizer.TokenizerAdapter` that the cache, the datasets (ids must lie below its
``vocab_size``) and the collators (``pad_token_id``) use. A store's own files are read by
:func:`store_vocabulary` (called by the stores that record a tokenizer, e.g. datatrove's), and a mixture's components
must agree (:func:`components_vocabulary`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.data.tokenizer_identity import TokenizerIdentity, check_store_tokenizer, identity_of_adapter
from lit_balance.errors import InputValueError

__all__ = ["StoreVocabulary", "components_vocabulary", "decide_vocabulary", "store_vocabulary"]


class StoreVocabulary(NamedTuple):
    """What a tokenized store's own files say about its vocabulary (each None when they do not say it).

    Attributes:
        vocab_size: number of token ids the writer's tokenizer has.
        pad_token_id: its padding id.
        where: the store, for messages (its description).
        tokenizer: the tokenizer its writer used (:class:`~lit_balance.data.tokenizer_identity.TokenizerIdentity`),
            or None when its files do not say it.
    """

    vocab_size: int | None
    pad_token_id: int | None
    where: str
    tokenizer: TokenizerIdentity | None = None


def store_vocabulary(vocab_size: int | None, pad_token_id: int | None, *, tokenizer_file: str | None = None,
                     id_limit: int | None = None, token_size: int | None = None) -> tuple[int | None, int | None]:
    """A store's own vocabulary size and padding id: those given, else those of the ``tokenizer.json`` its metadata
    names (when it is a local file), else None.

    Args:
        vocab_size, pad_token_id: given for the store (None: not given).
        tokenizer_file: the tokenizer its writer recorded, or None.
        id_limit: ids its token dtype can hold (e.g. 65,536 for 2-byte tokens), or None.
        token_size: bytes per token, for the message.

    Raises:
        ValueError: ``vocab_size < 1`` or above ``id_limit``; ``pad_token_id`` outside ``[0, vocab_size)``.
    """
    if vocab_size is not None and vocab_size < 1:
        raise InputValueError(f"vocab_size must be >= 1, got {vocab_size}", parameter="vocab_size")
    if (vocab_size is None or pad_token_id is None) and tokenizer_file and os.path.isfile(tokenizer_file):
        try:
            adapter = resolve_tokenizer(tokenizer_file, pad_token_id=pad_token_id)
        except (ValueError, TypeError):
            adapter = None  # a tokenizer without a padding token: its vocabulary size alone
            import tokenizers

            try:
                found = tokenizers.Tokenizer.from_file(tokenizer_file).get_vocab_size(with_added_tokens=True)
            except Exception:  # noqa: BLE001  an unreadable file says nothing
                found = None
            vocab_size = vocab_size if vocab_size is not None else found
        if adapter is not None:
            vocab_size = vocab_size if vocab_size is not None else adapter.vocab_size
            pad_token_id = adapter.pad_token_id
    if vocab_size is not None and id_limit is not None and vocab_size > id_limit:
        raise InputValueError(f"vocab_size={vocab_size} does not fit the store's {token_size}-byte tokens (at most "
                              f"{id_limit} ids); the store was written for another tokenizer", parameter="vocab_size")
    if pad_token_id is not None and vocab_size is not None and not 0 <= pad_token_id < vocab_size:
        raise InputValueError(f"pad_token_id={pad_token_id} lies outside the vocabulary [0, {vocab_size})",
                              parameter="pad_token_id")
    return (None if vocab_size is None else int(vocab_size)), (None if pad_token_id is None else int(pad_token_id))


def _for_store(declared: StoreVocabulary, tokenizer: Any, vocab_size: int | None,
               pad_token_id: int | None, allow_tokenizer_mismatch: bool) -> TokenizerAdapter:
    where = declared.where
    if tokenizer is not None:
        adapter = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id)
        check_store_tokenizer(declared.tokenizer, identity_of_adapter(adapter), where,
                              allow_mismatch=allow_tokenizer_mismatch)
        if vocab_size is not None and vocab_size != adapter.vocab_size:
            raise InputValueError(f"vocab_size={vocab_size} conflicts with the given tokenizer's vocabulary of "
                                  f"{adapter.vocab_size} token ids ({where}); leave vocab_size unset (None) or leave "
                                  "the tokenizer out", parameter="vocab_size")
    else:
        vocab = vocab_size if vocab_size is not None else declared.vocab_size
        if vocab is None:
            raise InputValueError(f"{where} does not say its vocabulary size: pass vocab_size= (the model's "
                                  "vocabulary; every id must be below it) or tokenizer=", parameter="vocab_size")
        pad = pad_token_id if pad_token_id is not None else declared.pad_token_id
        if pad is None:
            raise InputValueError(f"{where} does not say its padding id: pass pad_token_id= (an id in "
                                  f"[0, {vocab}), e.g. the tokenizer's end-of-text id) or tokenizer=",
                                  parameter="pad_token_id")
        adapter = TokenizerAdapter.for_token_ids(vocab_size=vocab, pad_token_id=pad)
    if declared.vocab_size is not None and declared.vocab_size > adapter.vocab_size:
        raise InputValueError(f"{where} was written with a vocabulary of {declared.vocab_size} token ids, more than "
                              f"the {adapter.vocab_size} trained with; raise vocab_size to at least "
                              f"{declared.vocab_size}", parameter="vocab_size")
    return adapter


def _for_token_ids(largest_id: Callable[[], int] | None, vocab_size: int | None,
                   pad_token_id: int | None) -> TokenizerAdapter:
    """The vocabulary of token ids without a tokenizer: ``vocab_size``, or the largest id + 1."""
    pad = 0 if pad_token_id is None else pad_token_id
    if largest_id is None and vocab_size is None:
        raise InputValueError("a Hugging Face IterableDataset of token ids is read once, into the cache, so its "
                              "largest id is not known in advance: pass vocab_size= (or a tokenizer)",
                              parameter="vocab_size")
    # an IterableDataset's ids are checked against vocab_size when it is read into the cache
    largest = 0 if largest_id is None else largest_id()
    if vocab_size is None:
        vocab_size = max(largest, pad) + 1
    adapter = TokenizerAdapter.for_token_ids(vocab_size=vocab_size, pad_token_id=pad)  # checks both now
    if largest >= adapter.vocab_size:
        raise InputValueError(f"token id {largest} is outside vocab_size={vocab_size}; raise vocab_size",
                              parameter="vocab_size")
    return adapter


def decide_vocabulary(tokenizer: Any = None, *, vocab_size: int | None = None, pad_token_id: int | None = None,
                      store: StoreVocabulary | None = None, holds_token_ids: bool = False,
                      largest_id: Callable[[], int] | None = None, add_special_tokens: bool = False,
                      kind: str = "text", allow_tokenizer_mismatch: bool = False) -> TokenizerAdapter:
    """The vocabulary size and padding id a corpus trains with, as a tokenizer adapter: the one place they are decided.

    * A tokenized store (``store`` given): with a tokenizer, the tokenizer's (``vocab_size`` must equal it, and the
      tokenizer must be the one the store was written with when the store says it:
      :func:`~lit_balance.data.tokenizer_identity.check_store_tokenizer`); else
      ``vocab_size`` / ``pad_token_id`` given, else the store's own (:func:`store_vocabulary`); never below the
      store's own vocabulary.
    * Token ids without a tokenizer: ``vocab_size``, else the largest id + 1 (``largest_id()``); pad id given or 0.
    * Otherwise (text, or token ids with a tokenizer): the tokenizer's (the built-in one for None); a ``vocab_size``
      given must equal it.

    Args:
        tokenizer: None, a tokenizer object or a ``tokenizer.json`` path.
        vocab_size, pad_token_id: the user's (None: not given), already type-checked.
        store: what a store's files say, or None for a corpus that is not a store.
        holds_token_ids: the corpus is token ids (never re-encoded).
        largest_id: returns the corpus' largest id (read on call), or None when it cannot be known in advance.
        add_special_tokens: the tokenization option (text only).
        kind: the corpus' kind, for messages.
        allow_tokenizer_mismatch: train a store with a tokenizer other than the one it was written with (a warning
            instead of the ValueError).

    Returns:
        The :class:`~lit_balance.data.tokenizer.TokenizerAdapter` (``vocab_size``, ``pad_token_id``, fingerprint).

    Raises:
        ValueError: ``add_special_tokens`` with token ids; no vocabulary size or pad id known for a store; a
            ``vocab_size`` that disagrees with the tokenizer's or lies below an id of the corpus or the store's own;
            a tokenizer other than the store's (naming both), unless ``allow_tokenizer_mismatch``.
    """
    if holds_token_ids and add_special_tokens:
        raise InputValueError("add_special_tokens=True applies to text corpora only: a token-id corpus is used as "
                              "given (never re-encoded, with or without a tokenizer), so add the special ids to each "
                              "document yourself, or leave add_special_tokens=False", parameter="add_special_tokens")
    if store is not None:
        return _for_store(store, tokenizer, vocab_size, pad_token_id, allow_tokenizer_mismatch)
    if holds_token_ids and tokenizer is None:
        return _for_token_ids(largest_id, vocab_size, pad_token_id)
    adapter = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id, add_special_tokens=add_special_tokens)
    if vocab_size is not None and vocab_size != adapter.vocab_size:
        with_what = "the built-in tokenizer" if tokenizer is None else "the given tokenizer"
        raise InputValueError(
            f"vocab_size={vocab_size} conflicts with {with_what}'s vocabulary of {adapter.vocab_size} "
            f"token ids ({kind} corpus); the vocabulary is the tokenizer's, and vocab_size only "
            "sets it for token-id corpora without a tokenizer: leave vocab_size unset (None)", parameter="vocab_size")
    return adapter


def components_vocabulary(names: Sequence[str], adapters: Sequence[TokenizerAdapter]) -> TokenizerAdapter:
    """The one vocabulary of a mixture's components (each decided by :func:`decide_vocabulary`): they must agree.

    The order of the components never matters: when they agree, the vocabulary returned is one that can encode text
    whenever any component's can (a tokenizer's, not the bare vocabulary of a store or of token ids without a
    tokenizer), so a text component is tokenized whichever component comes first.

    Raises:
        ValueError: two components whose vocabulary sizes or pad ids differ (naming both).
    """
    chosen = next((i for i, a in enumerate(adapters) if a.backend is not None), 0)
    first = adapters[chosen]
    for name, adapter in zip(names, adapters):
        if (adapter.vocab_size, adapter.pad_token_id) != (first.vocab_size, first.pad_token_id):
            raise InputValueError(
                f"mixture components {names[chosen]!r} and {name!r} differ in vocabulary or pad id: "
                f"vocab_size {first.vocab_size} vs {adapter.vocab_size}, pad_token_id {first.pad_token_id} vs "
                f"{adapter.pad_token_id}; tokenize every component with one tokenizer (or pass vocab_size and "
                "pad_token_id for token-id components)", parameter="corpus")
    return first
