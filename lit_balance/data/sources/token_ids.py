"""Pre-tokenized documents as a corpus: sequences of token ids, used as given (never re-encoded)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lit_balance.data.sources.base import CorpusSource
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["TokenIdsSource"]


def _as_ids(item: Any, index: int) -> np.ndarray:
    """Document ``index`` as a read-only int64 1-D array; raises naming it and the first bad value."""
    if hasattr(item, "detach") and hasattr(item, "numpy"):  # a torch tensor, without importing torch
        item = item.detach().cpu().numpy()
    if isinstance(item, (list, tuple)) and not item:
        item = np.zeros(0, dtype=np.int64)
    if isinstance(item, (list, tuple)) and any(isinstance(v, bool) for v in item):
        raise InputTypeError(f"document {index} of the token-id corpus holds a bool "
                             f"({next(v for v in item if isinstance(v, bool))!r}); token ids must be ints")
    try:
        array = np.asarray(item)
    except (ValueError, OverflowError) as error:
        raise InputTypeError(f"document {index} of the token-id corpus is not a sequence of ints: {error}") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        bad = ""
        if isinstance(item, (list, tuple)):
            value = next((v for v in item
                          if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))), None)
            bad = f" (first non-int value: {value!r})"
        raise InputTypeError(f"document {index} of the token-id corpus must be a 1-D sequence of ints, "
                             f"got shape {array.shape} dtype {array.dtype}{bad}")
    if array.size and array.min() < 0:
        raise InputValueError(f"document {index} of the token-id corpus holds the negative id {int(array.min())}; "
                              "token ids must be >= 0")
    if array.size and array.max() > np.iinfo(np.int64).max:
        raise InputValueError(f"document {index} of the token-id corpus holds the id {int(array.max())}, too large")
    array = np.array(array, dtype=np.int64)
    array.flags.writeable = False
    return array


class TokenIdsSource(CorpusSource):
    """Pre-tokenized documents: every token is a target; the ids are checked and copied once, when created.

    Its identity is the sha256 of the ids: each document's length (8 bytes, little-endian) and its ids as
    little-endian int64, after the bytes ``b"token_ids"``.

    Args:
        documents: one sequence of ints per document (lists, tuples, 1-D integer numpy arrays or torch
            tensors), every id ``>= 0``.

    Raises:
        ValueError: no document, or a negative id.
        TypeError: a document that is not a 1-D sequence of ints (bools refused).

    Example:
        >>> source = TokenIdsSource([[5, 6], [7]])
        >>> source.kind, source.description, source.holds_token_ids
        ('token_ids', '2 pre-tokenized documents (3 tokens)', True)
    """

    kind = "token_ids"
    holds_token_ids = True

    def __init__(self, documents: Sequence[Any]) -> None:
        arrays = tuple(_as_ids(item, index) for index, item in enumerate(documents))
        if not arrays:
            raise InputValueError("corpus is empty: the list holds no documents")
        digest = hashlib.sha256(b"token_ids")
        for array in arrays:
            digest.update(len(array).to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
        self._arrays = arrays
        self._fingerprint = digest.hexdigest()
        self._num_tokens = sum(len(array) for array in arrays)

    @property
    def token_ids(self) -> tuple[np.ndarray, ...]:
        """One read-only int64 1-D array per document."""
        return self._arrays

    def read_records(self) -> Iterator[np.ndarray]:
        """The arrays (the chunks refer to the same arrays)."""
        return iter(self._arrays)

    def identity(self) -> tuple[str]:
        """The sha256 of the ids (:attr:`fingerprint`)."""
        return (self._fingerprint,)

    @property
    def fingerprint(self) -> str:
        """The sha256 of the ids described in the class docstring."""
        return self._fingerprint

    @property
    def description(self) -> str:
        """E.g. ``"5 pre-tokenized documents (9 tokens)"``."""
        return f"{len(self._arrays)} pre-tokenized documents ({self._num_tokens} tokens)"

    @property
    def num_documents(self) -> int:
        """Number of documents."""
        return len(self._arrays)
