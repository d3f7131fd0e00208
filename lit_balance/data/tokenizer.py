"""Tokenizers reduced to what the cache needs: ids, vocabulary size, padding id and a fingerprint."""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from lit_balance._fingerprint import sha256_of as _sha256
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["TokenizerAdapter", "builtin_tokenizer", "resolve_tokenizer"]


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer_json() -> str:
    return (importlib.resources.files("lit_balance") / "data/tokenizer/tokenizer.json").read_text("utf-8")


def _plain_copy(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    copy = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def builtin_tokenizer() -> tokenizers.Tokenizer:
    """Return the vendored BERT-uncased WordPiece tokenizer, truncation and padding disabled.

    Returns:
        A fresh ``tokenizers.Tokenizer`` (30,522 tokens, ``[PAD]`` = 0); callers may mutate it.

    Example:
        >>> builtin_tokenizer().encode("hello world", add_special_tokens=False).ids
        [7592, 2088]
    """
    tokenizer = tokenizers.Tokenizer.from_str(_builtin_tokenizer_json())  # a new object each call
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclass(frozen=True)
class TokenizerAdapter:
    """A tokenizer reduced to what the cache needs: ids, vocabulary size, padding id, fingerprint.

    Build one with :func:`resolve_tokenizer` (or :meth:`for_token_ids` for pre-tokenized corpora).

    Attributes:
        vocab_size: number of token ids, added tokens included; every id is in ``[0, vocab_size)``.
        pad_token_id: id used for padding, in ``[0, vocab_size)``.
        fingerprint: sha256 hex identifying the tokenizer's behaviour (and the two numbers above).
        backend: the wrapped ``tokenizers.Tokenizer`` or Hugging Face tokenizer, or None when the
            adapter only describes pre-tokenized ids.
        add_special_tokens: whether :meth:`encode_batch` adds the tokenizer's own special tokens to each
            document, as ``tokenizer(text, add_special_tokens=True)`` does in Hugging Face (the built-in
            BERT tokenizer: ``[CLS] ... [SEP]``; Llama-style: a BOS; GPT-2 adds none). Part of the cache key.
        name: where the tokenizer came from, for messages (its path, Hugging Face name, or "the built-in
            tokenizer"); None for bare token ids.

    Example:
        >>> adapter = resolve_tokenizer()
        >>> adapter.vocab_size, adapter.pad_token_id, adapter.encode_batch(["hello world"])
        (30522, 0, [[7592, 2088]])
    """

    vocab_size: int
    pad_token_id: int
    fingerprint: str
    backend: Any = field(default=None, repr=False, compare=False)
    add_special_tokens: bool = False
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.add_special_tokens, (bool, np.bool_)):
            raise InputTypeError("add_special_tokens must be True or False, got "
                                 f"{type(self.add_special_tokens).__name__} "
                                 f"{self.add_special_tokens!r}")
        object.__setattr__(self, "add_special_tokens", bool(self.add_special_tokens))
        for name in ("vocab_size", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))
        if not 1 <= self.vocab_size <= 2**31:
            raise InputValueError(f"vocab_size must be in [1, 2**31], got {self.vocab_size}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise InputValueError(
                f"pad_token_id must be in [0, vocab_size={self.vocab_size}), got {self.pad_token_id}; "
                "pass a pad_token_id inside the vocabulary"
            )
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise InputTypeError(f"fingerprint must be a non-empty str, got {self.fingerprint!r}")

    @classmethod
    def for_token_ids(cls, vocab_size: int, pad_token_id: int = 0) -> TokenizerAdapter:
        """Describe pre-tokenized ids that come with no tokenizer.

        Args:
            vocab_size: number of token ids; every id in the corpus must be below it.
            pad_token_id: padding id, in ``[0, vocab_size)``.

        Returns:
            An adapter with no backend; its :meth:`encode_batch` raises.

        Example:
            >>> TokenizerAdapter.for_token_ids(vocab_size=100).pad_token_id
            0
        """
        return cls(vocab_size, pad_token_id, _sha256("token_ids", str(vocab_size), str(pad_token_id)))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize texts without truncation or padding; special tokens only if :attr:`add_special_tokens`.

        Args:
            texts: the documents.

        Returns:
            One list of token ids per text (possibly empty).

        Raises:
            TypeError: the adapter has no tokenizer (it was made for pre-tokenized ids).

        Example:
            >>> resolve_tokenizer().encode_batch(["hello", ""])
            [[7592], []]
        """
        return [ids if type(ids) is list else list(ids) for ids in self._encoded_rows(texts)()]

    def encode_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize texts as :meth:`encode_batch` does, returning all ids in one flat array.

        This is what the cache builds from: one array per chunk instead of one Python list (and one array) per
        document. The same as ``encode_batch_deferred(texts)()``.

        Args:
            texts: the documents.

        Returns:
            ``(sizes, ids)``: int64 ``[len(texts)]``, tokens per text; the ids of all texts concatenated, int32
            ``[sizes.sum()]`` (int64 if an id does not fit in int32, which only a tokenizer emitting ids outside
            any int32 vocabulary does).

        Raises:
            TypeError: the adapter has no tokenizer (it was made for pre-tokenized ids).

        Example:
            >>> sizes, ids = resolve_tokenizer().encode_batch_flat(["hello world", "", "hello"])
            >>> sizes.tolist(), ids.tolist(), ids.dtype.name
            ([2, 0, 1], [7592, 2088, 7592], 'int32')
        """
        return self.encode_batch_deferred(texts)()

    def encode_batch_deferred(self, texts: list[str]) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Tokenize texts now; return a function that turns the tokenizer's output into :meth:`encode_batch_flat`'s.

        The two halves can run in different threads: a ``tokenizers`` tokenizer encodes with the GIL released, on
        its own thread pool, while turning its output into Python ids holds the GIL. The cache calls this in an
        encoding thread and the returned function in the thread that writes the arrays, so that the next chunk is
        encoded while this one's ids are converted.

        Args:
            texts: the documents.

        Returns:
            A function of no arguments returning ``(sizes, ids)`` as :meth:`encode_batch_flat` does.

        Raises:
            TypeError: the adapter has no tokenizer (it was made for pre-tokenized ids).

        Example:
            >>> finish = resolve_tokenizer().encode_batch_deferred(["hello world", ""])
            >>> [a.tolist() for a in finish()]
            [[2, 0], [7592, 2088]]
        """
        rows = self._encoded_rows(texts)
        return lambda: flat_ids(rows())

    def _encoded_rows(self, texts: list[str]) -> Callable[[], Any]:
        """Run the tokenizer on ``texts`` now; return a function giving one id sequence per text (the part that
        holds the GIL: a ``tokenizers`` encoding's ids become a Python list only when asked for)."""
        if self.backend is None:
            raise InputTypeError("this TokenizerAdapter describes pre-tokenized ids and cannot encode text; "
                                 "pass a tokenizer to resolve_tokenizer()")
        texts = list(texts)
        if isinstance(self.backend, tokenizers.Tokenizer):
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            encodings = encode(texts, add_special_tokens=self.add_special_tokens)
            return lambda: [encoding.ids for encoding in encodings]
        out = self.backend(texts, add_special_tokens=self.add_special_tokens, truncation=False, padding=False,
                           return_attention_mask=False, return_token_type_ids=False)
        return lambda: out["input_ids"]


def flat_ids(rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """Tokens per row (int64 ``[len(rows)]``) and the rows' integer ids concatenated (int32, else int64).

    ``rows`` is a sized, re-iterable sequence of integer sequences (lists of ints, arrays).
    """
    sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    ids: list[Any] = []
    extend = ids.extend
    for row in rows:  # one list, then one conversion: faster than numpy.fromiter over a chain of the rows
        extend(row)
    try:
        return sizes, np.array(ids, dtype=np.int32)
    except OverflowError:  # an id outside int32: keep it, so that the range check can name it
        return sizes, np.array(ids, dtype=np.int64)


def _looks_like_hf(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, "get_vocab") and hasattr(obj, "pad_token_id") and hasattr(obj, "__len__")


def _not_a_file_message(name: str) -> str:
    return (
        f"tokenizer {name!r} is not a file: a str or path tokenizer must name an existing tokenizer.json "
        "(Hugging Face model names are not looked up). To use a Hugging Face tokenizer offline, load it "
        f"yourself and pass the object: tokenizer=transformers.AutoTokenizer.from_pretrained({name!r}, "
        "local_files_only=True); or pass the path of its tokenizer.json (e.g. the one inside "
        "~/.cache/huggingface/hub/models--<org>--<name>/snapshots/<revision>/, or a directory written by "
        "save_pretrained())"
    )


def resolve_tokenizer(tokenizer: Any = None, *, pad_token_id: int | None = None,
                      add_special_tokens: bool = False) -> TokenizerAdapter:
    """Wrap a tokenizer into a :class:`TokenizerAdapter`.

    The padding id is, in order: the ``pad_token_id`` argument; the tokenizer's own (for
    ``tokenizers.Tokenizer``: its padding ``pad_id`` if padding is configured, else the id of
    ``[PAD]`` or ``<pad>``; for Hugging Face tokenizers: ``pad_token_id``).

    Args:
        tokenizer: None for :func:`builtin_tokenizer`; a ``tokenizers.Tokenizer`` (copied, never
            mutated); a Hugging Face ``transformers`` tokenizer, fast or slow; a path (str or
            ``os.PathLike``) to a ``tokenizer.json``; or a :class:`TokenizerAdapter` (returned as is).
        pad_token_id: padding id to use; required when the tokenizer defines none.
        add_special_tokens: add the tokenizer's own special tokens to each document (see
            :attr:`TokenizerAdapter.add_special_tokens`); for a given adapter, True returns a copy with it set.

    Returns:
        The adapter.

    Raises:
        FileNotFoundError: the tokenizer path is not a file (e.g. a Hugging Face model name such as
            ``"bert-base-uncased"``); the message says how to load such a tokenizer offline.
        ValueError: the file is not a valid tokenizer, no padding id is known, or ``pad_token_id``
            conflicts with a given adapter or lies outside the vocabulary.
        TypeError: the tokenizer is of an unsupported type.

    Example:
        >>> resolve_tokenizer(None).vocab_size
        30522
    """
    if not isinstance(add_special_tokens, (bool, np.bool_)):
        raise InputTypeError(f"add_special_tokens must be True or False, got {type(add_special_tokens).__name__} "
                             f"{add_special_tokens!r}")
    if isinstance(tokenizer, TokenizerAdapter):
        if pad_token_id is not None and pad_token_id != tokenizer.pad_token_id:
            raise InputValueError(f"pad_token_id={pad_token_id!r} conflicts with the given TokenizerAdapter's "
                                  f"pad_token_id={tokenizer.pad_token_id}; drop one of them")
        return dataclasses.replace(tokenizer, add_special_tokens=True) if add_special_tokens else tokenizer
    fresh = tokenizer is None  # builtin_tokenizer() returns a new plain object: no copy needed
    name = "the built-in tokenizer" if fresh else (
        os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else
        getattr(tokenizer, "name_or_path", None) or f"a {type(tokenizer).__name__} object")
    if fresh:
        tokenizer = builtin_tokenizer()
    elif isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
            raise InputValueError(f"tokenizer path {str(path)!r} is a directory; pass the tokenizer.json inside it")
        if not path.is_file():
            raise InputFileNotFoundError(_not_a_file_message(str(tokenizer)))
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:
            raise InputValueError(f"tokenizer file {str(path)!r} is not a valid tokenizer.json: {error}") from error
    if isinstance(tokenizer, tokenizers.Tokenizer):
        backend = tokenizer if fresh else _plain_copy(tokenizer)
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        found = tokenizer.padding["pad_id"] if tokenizer.padding else None
        for token in ("[PAD]", "<pad>"):
            found = backend.token_to_id(token) if found is None else found
        identity = ["tokenizers", backend.to_str()]
    elif _looks_like_hf(tokenizer):
        backend = tokenizer
        vocab_size = len(tokenizer)
        found = tokenizer.pad_token_id
        inner = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(inner, tokenizers.Tokenizer):
            identity = ["hf-fast", type(tokenizer).__name__, _plain_copy(inner).to_str()]
        else:
            vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
            identity = ["hf-slow", type(tokenizer).__name__, vocab]
    else:
        raise InputTypeError(
            f"tokenizer must be None, a tokenizers.Tokenizer, a Hugging Face tokenizer, a path to a "
            f"tokenizer.json or a TokenizerAdapter, got {type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
        )
    pad = pad_token_id if pad_token_id is not None else found
    if pad is None:
        raise InputValueError(f"the tokenizer ({type(tokenizer).__name__}) defines no padding token; pass "
                              "pad_token_id=")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)):
        raise InputTypeError(f"pad_token_id must be an int, got {type(pad).__name__} {pad!r}")
    fingerprint = _sha256(*identity, str(vocab_size), str(int(pad)))
    return TokenizerAdapter(vocab_size, int(pad), fingerprint, backend, bool(add_special_tokens), str(name))
