"""In-memory texts as a corpus: a list or tuple of strings, one document each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from lit_balance._fingerprint import sha256_of
from lit_balance.data.sources.base import CorpusSource
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["TextsSource"]


class TextsSource(CorpusSource):
    """Documents given as strings, kept in memory as given (empty strings are documents too).

    Its identity is the texts themselves (hashed once, when the source is created).

    Args:
        texts: the documents, in corpus order.

    Raises:
        ValueError: ``texts`` is empty.
        TypeError: an item is not a ``str``.

    Example:
        >>> source = TextsSource(["first document", "second one"])
        >>> source.kind, source.description, source.load_texts()
        ('texts', '2 text documents', ['first document', 'second one'])
    """

    kind = "texts"

    def __init__(self, texts: Sequence[str]) -> None:
        texts = tuple(texts)
        if not texts:
            raise InputValueError("corpus is empty: the list holds no documents")
        bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if bad is not None:
            raise InputTypeError(f"corpus item {bad} is a {type(texts[bad]).__name__}; a TextsSource holds str "
                                 "documents only")
        self._texts = texts
        self._fingerprint = sha256_of(self.kind, *texts)

    @property
    def texts(self) -> tuple[str, ...]:
        """The documents."""
        return self._texts

    def read_records(self) -> Iterator[str]:
        """The texts, as given (the chunks refer to the same strings)."""
        return iter(self._texts)

    def identity(self) -> tuple[str, ...]:
        """The texts."""
        return self._texts

    @property
    def fingerprint(self) -> str:
        """sha256 of ``"texts"`` and the texts (as :meth:`CorpusSource.fingerprint`, computed once)."""
        return self._fingerprint

    @property
    def description(self) -> str:
        """E.g. ``"3 text documents"``."""
        return f"{len(self._texts)} text documents"

    @property
    def num_documents(self) -> int:
        """Number of texts."""
        return len(self._texts)
