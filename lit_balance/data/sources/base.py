"""What every input source is: :class:`CorpusSource`, the records it reads and the chunks it yields.

A source says two things: how to read its documents (:meth:`CorpusSource.read_records`, yielding one record per
document in corpus order) and what identifies them (:meth:`CorpusSource.identity`, hashed with its
:attr:`~CorpusSource.kind` into the cache key). Everything the tokenization cache (:mod:`lit_balance.data.cache`)
and the DataModule read comes from this base class: chunks of bounded size (:meth:`CorpusSource.iter_chunks`,
:class:`CorpusChunk`), the checks of each record, :meth:`~CorpusSource.load_texts` and
:meth:`~CorpusSource.load_token_ids`. A record is one of:

* a ``str``: a text, tokenized by the DataModule's tokenizer;
* a :class:`PromptCompletion`: tokenized as ``prompt + completion``, only the completion's tokens carrying loss
  (:func:`lit_balance.data.records.encode_chunk`);
* a 1-D integer ``numpy.ndarray`` or a :class:`TokenIds` (ids with optional labels): pre-tokenized, used as given;
  a source of these sets ``holds_token_ids = True``.

The design follows lhotse's samplers and torchtitan's data components: one small object per kind of input behind
one protocol, so that adding an input format is one subclass (see ``docs/extending.md``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from lit_balance._fingerprint import sha256_of
from lit_balance.errors import InputTypeError, InputValueError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CorpusChunk", "CorpusSource", "PromptCompletion", "TokenIds"]

_CHUNK_DOCS = 4096  # most documents per chunk of CorpusSource.iter_chunks
_CHUNK_CHARS = 1 << 21  # most characters (or token ids) per chunk, unless one document is larger
_PACKAGE = __name__.rpartition(".")[0]  # lit_balance.data.sources: where the built-in sources live
_BUILTIN_KINDS: dict[str, str] = {}  # kind -> class name, of the sources defined in lit_balance.data.sources


class PromptCompletion(NamedTuple):
    """A prompt–completion record: tokenized as ``prompt + completion``, the prompt's tokens labelled ``-100``.

    Example:
        >>> PromptCompletion("2 + 2 =", " 4").completion
        ' 4'
    """

    prompt: str
    completion: str


class TokenIds(NamedTuple):
    """A pre-tokenized document: token ids and, optionally, one (unshifted) label per token.

    Attributes:
        ids: 1-D integer array (or sequence) of token ids, each in ``[0, vocab_size)``.
        labels: 1-D integer array as long as ``ids``, ``-100`` where a token has no target; None when every token
            is a target.

    Example:
        >>> TokenIds([5, 6, 7], labels=[-100, 6, 7]).labels
        [-100, 6, 7]
    """

    ids: Any
    labels: Any = None


@dataclass(frozen=True, eq=False)
class CorpusChunk:
    """Consecutive documents of a corpus, all of one form: one step of :meth:`CorpusSource.iter_chunks`.

    Exactly one of ``texts``, ``pairs`` and ``token_ids`` is set.

    Attributes:
        start: index in the corpus of the chunk's first document (documents count from 0, empty ones too).
        texts: the documents as strings, for text corpora (tokenized by the cache builder).
        token_ids: one 1-D integer array per document, for pre-tokenized corpora (used as given).
        pairs: ``(prompt, completion)`` strings per document, for prompt–completion records (tokenized as
            ``prompt + completion``, the prompt's tokens labelled -100: :func:`lit_balance.data.records.encode_chunk`).
        labels: with ``token_ids``, one 1-D integer array of the same length per document (unshifted labels,
            -100 where a token has no target) or None for a document whose every token is a target; None when
            no document of the chunk has labels.

    Raises:
        ValueError: ``start`` is negative, not exactly one of ``texts``, ``pairs`` and ``token_ids`` is given, or
            ``labels`` come without ``token_ids`` or with another number of entries.

    Example:
        >>> chunk = CorpusChunk(start=2, texts=["a", "b"])
        >>> len(chunk), chunk.token_ids is None
        (2, True)
    """

    start: int
    texts: Sequence[str] | None = None
    token_ids: Sequence[np.ndarray] | None = None
    pairs: Sequence[tuple[str, str]] | None = None
    labels: Sequence[np.ndarray | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, (int, np.integer)) or self.start < 0:
            raise InputValueError(f"start must be an int >= 0, got {self.start!r}")
        given = [name for name in ("texts", "token_ids", "pairs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise InputValueError("a CorpusChunk holds exactly one of texts, token_ids and pairs, got "
                                  f"{' and '.join(given) if given else 'none'}")
        if self.labels is not None and (self.token_ids is None or len(self.labels) != len(self.token_ids)):
            raise InputValueError("labels go with token_ids, one entry (an array or None) per document")

    def __len__(self) -> int:
        docs = next(d for d in (self.texts, self.token_ids, self.pairs) if d is not None)
        return len(docs)


def _check_limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputValueError(f"{name} must be an int >= 1, got {value!r}", parameter=name)
    return int(value)


class CorpusSource(abc.ABC):
    """Where the documents of a corpus come from: subclass it to read a new input format.

    :func:`lit_balance.data.sources.resolve_corpus` builds the built-in sources (the standard library's docstrings,
    in-memory texts, text and JSONL files, token ids, Hugging Face datasets) and passes an instance of any subclass
    through as it is, so ``BalancedTextDataModule(corpus=MySource(...))`` trains on a source of one's own.

    A subclass defines:

    * :meth:`read_records`: the documents in corpus order, one record each (a ``str``, a
      :class:`PromptCompletion`, a 1-D integer ``numpy.ndarray`` or a :class:`TokenIds`);
    * :meth:`identity`: strings (or bytes) that identify the documents: the cache key hashes them with
      :attr:`kind`, so equal identities must mean equal documents (e.g. the sha256 of a file's bytes and the
      settings that pick its documents);

    and may set :attr:`kind` (default: the class's module and qualified name), ``holds_token_ids = True`` (a
    source of token ids), and override :attr:`description` and the other properties.

    Attributes:
        kind: names the kind of source in the cache key: ``"builtin"``, ``"texts"``, ``"files"``, ``"token_ids"``
            and ``"datasets"`` for the built-in sources (reserved for them), a class's own otherwise.

    Raises:
        TypeError: creating an instance of a class that lacks :meth:`read_records` or :meth:`identity`, or
            defining a subclass whose ``kind`` is not a non-empty str.
        ValueError: defining a subclass outside :mod:`lit_balance.data.sources` whose ``kind`` is a built-in one.

    Example:
        >>> class Lines(CorpusSource):
        ...     kind = "lines"
        ...     def __init__(self, text):
        ...         self.text = text
        ...     def read_records(self):
        ...         return iter(self.text.splitlines())
        ...     def identity(self):
        ...         return [self.text]
        >>> [list(chunk.texts) for chunk in Lines("a\\nb\\nc").iter_chunks(max_docs=2)]
        [['a', 'b'], ['c']]
    """

    kind: ClassVar[str]
    _kind_declared: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:
            outside = not cls.__module__.startswith(_PACKAGE + ".")
            # no class above declared one, or a built-in's kind (whose cache entries hold the built-in's documents):
            # the class's own name
            if not cls._kind_declared or (outside and getattr(cls, "kind", None) in _BUILTIN_KINDS):
                cls.kind = f"{cls.__module__}.{cls.__qualname__}"
            return
        kind = cls.__dict__["kind"]
        if not isinstance(kind, str) or not kind.strip():
            raise InputTypeError(f"{cls.__qualname__}.kind must be a non-empty str naming the kind of source in the "
                                 f"cache key, got {kind!r}", parameter="kind")
        if cls.__module__.startswith(_PACKAGE + "."):
            _BUILTIN_KINDS.setdefault(kind, cls.__qualname__)
        elif kind in _BUILTIN_KINDS:
            raise InputValueError(f"{cls.__qualname__}.kind = {kind!r} is the kind of the built-in source "
                                  f"{_BUILTIN_KINDS[kind]}; choose another name (e.g. {cls.__qualname__.lower()!r}), "
                                  "or leave kind out to use the class's name", parameter="kind")
        cls._kind_declared = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            needs = {"read_records": "read_records(self) yielding one record per document (a str, a PromptCompletion, "
                                     "a 1-D int numpy array or a TokenIds)",
                     "identity": "identity(self) returning str or bytes parts that identify the documents (the cache "
                                 "key hashes them)"}
            raise InputTypeError(f"{cls.__qualname__} cannot be created: a CorpusSource subclass must define "
                                 + " and ".join(needs.get(name, f"{name}()") for name in missing)
                                 + "; see the CorpusSource docstring or docs/extending.md")
        return super().__new__(cls)

    # -- what a subclass defines ------------------------------------------------------------------------------

    @abc.abstractmethod
    def read_records(self) -> Iterable[Any]:
        """Yield the documents in corpus order, one record per document.

        A record is a ``str`` (a text), a :class:`PromptCompletion`, a 1-D integer ``numpy.ndarray`` (token ids,
        every token a target) or a :class:`TokenIds` (token ids with optional labels). Empty documents count (the
        cache drops and counts those empty after tokenization). The iterator may read lazily: the cache holds one
        chunk of documents at a time (:meth:`iter_chunks`).

        Returns:
            An iterable of records.
        """

    @abc.abstractmethod
    def identity(self) -> Iterable[str | bytes] | str | bytes:
        """Return what identifies the documents: the cache key hashes :attr:`kind` with these parts.

        Equal parts must mean equal documents; anything that changes the documents (the content of a file, a
        setting that picks documents from it) must change them. Called when the cache key is computed (before
        and after the corpus is tokenized, so content that changed meanwhile is not cached under the old key).

        Returns:
            One ``str`` or ``bytes``, or an iterable of them.
        """

    # -- what the cache and the DataModule read ---------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """sha256 hex digest of :attr:`kind` and the parts of :meth:`identity` (computed on each access).

        Raises:
            TypeError: :meth:`identity` returned a part that is neither ``str`` nor ``bytes``.
        """
        parts = self.identity()
        if parts is None or not isinstance(parts, (str, bytes, Iterable)):
            raise InputTypeError(f"{type(self).__qualname__}.identity() must return a str, bytes or an iterable of "
                                 f"them, got {parts!r:.60} of type {type(parts).__name__}")
        parts = [parts] if isinstance(parts, (str, bytes)) else list(parts)
        for index, part in enumerate(parts):
            if not isinstance(part, (str, bytes)):
                raise InputTypeError(f"{type(self).__qualname__}.identity() must return str or bytes parts, got "
                                     f"{type(part).__name__} {part!r:.60} at position {index}; convert it, e.g. "
                                     "with str()")
        return sha256_of(self.kind, *parts)

    @property
    def description(self) -> str:
        """Human-readable summary of the corpus, e.g. ``"2 files: a.txt, b.jsonl"`` (default: the class name)."""
        return type(self).__qualname__

    @property
    def holds_token_ids(self) -> bool:
        """Whether the documents are pre-tokenized ids (used as given, never re-encoded); a subclass whose records
        are token ids sets ``holds_token_ids = True``."""
        return False

    @property
    def streamed(self) -> bool:
        """Whether the corpus is a stream of unknown length, planned window by window while training
        (:class:`~lit_balance.stream.StreamCorpus`), rather than tokenized into the cache and planned whole (False, the
        default)."""
        return False

    @property
    def split_sizes(self) -> tuple[int, int] | None:
        """``(training documents, validation documents)`` when the corpus brings its own validation split
        (the training documents come first), else None."""
        return None

    @property
    def key_after_reading(self) -> bool:
        """Whether the corpus' identity is only known once it has been read: :meth:`content_fingerprint` then
        raises and the cache builds the entry first."""
        return False

    @property
    def num_documents(self) -> int | None:
        """Number of documents when known without reading the corpus, else None (a progress bar's total)."""
        return None

    @property
    def files(self) -> tuple[str, ...]:
        """The files the corpus reads, in order (the default: none, a corpus held in memory or read through a library):
        a mixture refuses a file read by two of its components (:func:`lit_balance.data.mixture.check_distinct_components`).
        """
        return ()

    @property
    def store_vocabulary(self) -> Any:
        """What the corpus' own files say about its vocabulary (a
        :class:`~lit_balance.data.vocabulary.StoreVocabulary`: a tokenized store read in place), or None (the
        default: the tokenizer, or the token ids, say it; :func:`~lit_balance.data.vocabulary.decide_vocabulary`)."""
        return None

    def open_in_place(self, tokenizer: Any) -> Any:
        """The tokenized corpus read where it lies (a :class:`~lit_balance.data.stores.TokenizedCorpus`), or None (the
        default): the corpus is tokenized into the cache, or loaded from it
        (:func:`lit_balance.data.cache.open_corpus`). A tokenized store (:class:`~lit_balance.data.stores.StoreSource`)
        returns its store's documents, planned from its index.

        Args:
            tokenizer: the :class:`~lit_balance.data.tokenizer.TokenizerAdapter` trained with (from
                :func:`~lit_balance.data.vocabulary.decide_vocabulary`).
        """
        return None

    def content_fingerprint(self) -> str:
        """Return a sha256 hex digest of what the documents are, the part of the cache key from the corpus.

        The base class returns :attr:`fingerprint`; a source whose resolve-time identity is cheaper than its
        content (files: paths, sizes and mtimes) hashes the content here.

        Example:
            >>> from lit_balance.data.sources import resolve_corpus
            >>> source = resolve_corpus(["a", "b"])
            >>> source.content_fingerprint() == source.fingerprint
            True
        """
        return self.fingerprint

    def fingerprint_of_read(self) -> str | None:
        """The content fingerprint of what the last complete :meth:`iter_chunks` read, or None when the source
        does not track it (the base class); the cache compares it with the key it computed before reading.

        Example:
            >>> from lit_balance.data.sources import resolve_corpus
            >>> resolve_corpus(["a"]).fingerprint_of_read() is None
            True
        """
        return None

    def iter_chunks(self, max_docs: int | None = None, max_chars: int | None = None) -> Iterator[CorpusChunk]:
        """Yield the documents in corpus order, in chunks of bounded size, reading the records as the chunks go.

        A consumer that keeps no chunk holds at most one chunk of documents at any time (plus what
        :meth:`read_records` buffers: files are read in blocks of about 1 MiB, datasets in batches of rows),
        whatever the size of the corpus. A chunk holds one form of document (:class:`CorpusChunk`); a source
        mixing texts and prompt–completion records starts a new chunk at each change. Chunks refer to the
        records' own strings and arrays (no copies).

        Args:
            max_docs: most documents per chunk (None: 4096).
            max_chars: most characters per chunk of texts (token ids per chunk of a pre-tokenized corpus); a
                single larger document forms a chunk of its own (None: 2**21).

        Returns:
            An iterator of :class:`CorpusChunk` whose ``start`` values count the documents before each chunk.

        Raises:
            ValueError: ``max_docs`` or ``max_chars`` is not an int >= 1 (at the call); while iterating: the
                source cannot be read or holds no document at all.
            TypeError: a record of another type than those above, or token ids from a source whose
                ``holds_token_ids`` is False (texts from one where it is True).

        Example:
            >>> from lit_balance.data.sources import resolve_corpus
            >>> [(chunk.start, list(chunk.texts)) for chunk in resolve_corpus(["a", "b", "c"]).iter_chunks(2)]
            [(0, ['a', 'b']), (2, ['c'])]
        """
        max_docs = _check_limit("max_docs", _CHUNK_DOCS if max_docs is None else max_docs)
        max_chars = _check_limit("max_chars", _CHUNK_CHARS if max_chars is None else max_chars)
        return self._chunks(max_docs, max_chars)

    def _chunks(self, max_docs: int, max_size: int) -> Iterator[CorpusChunk]:
        """:meth:`iter_chunks` with its limits checked: records grouped into chunks of at most ``max_docs`` documents
        and (past the first document) ``max_size`` characters or ids, with a new chunk at each change of form."""
        form, batch, labels, start, total = "", [], [], 0, 0
        for record in self.read_records():
            kind = type(record)
            label = None
            if kind is str:
                record_form, size = "texts", len(record)
            elif kind is np.ndarray and record.ndim == 1 and record.dtype.kind in "iu":
                record_form, size = "token_ids", len(record)
            elif kind is PromptCompletion and type(record[0]) is str and type(record[1]) is str:
                record_form, size = "pairs", len(record[0]) + len(record[1])
            else:
                record_form, record, label = self._checked_record(record, start + len(batch))
                size = len(record) if record_form != "pairs" else len(record[0]) + len(record[1])
            if record_form != form:
                if batch:
                    yield _make_chunk(start, form, batch, labels)
                    start, batch, labels, total = start + len(batch), [], [], 0
                self._check_form(record_form, start)
                form = record_form
            elif len(batch) == max_docs or total + size > max_size:
                yield _make_chunk(start, form, batch, labels)
                start, batch, labels, total = start + len(batch), [], [], 0
            batch.append(record)
            if form == "token_ids":
                labels.append(label)
            total += size
        if batch:
            yield _make_chunk(start, form, batch, labels)
        elif not start:
            raise InputValueError(f"corpus is empty: {type(self).__qualname__}.read_records() yielded no document "
                                  f"({self.description})")

    def _check_form(self, form: str, index: int) -> None:
        """Refuse token ids from a text source and texts (or prompt–completion records) from a token-id source."""
        holds = self.holds_token_ids
        if (form == "token_ids") == holds:
            return
        what = {"texts": "a text", "pairs": "a prompt–completion record", "token_ids": "token ids"}[form]
        fix = ("set holds_token_ids = True on the class when read_records() yields token ids" if not holds else
               "a token-id corpus yields only token ids (1-D int numpy arrays or TokenIds); set "
               "holds_token_ids = False to have texts tokenized")
        raise InputTypeError(f"{type(self).__qualname__} ({self.description}) yielded {what} at document {index}, "
                             f"but its holds_token_ids is {holds}: {fix} (a corpus holds token ids or texts, not both)")

    def _checked_record(self, record: Any, index: int) -> tuple[str, Any, Any]:
        """``(form, item, labels)`` of a record that is not a plain ``str``, int array or ``PromptCompletion``."""
        where = f"{type(self).__qualname__}.read_records(), document {index}"
        if isinstance(record, str):
            return "texts", record, None
        if isinstance(record, PromptCompletion):
            for name, value in zip(record._fields, record):
                if not isinstance(value, str):
                    raise InputTypeError(f"{where}: the PromptCompletion's {name} is {type(value).__name__} "
                                         f"{value!r:.60}, expected a str")
            return "pairs", record, None
        if isinstance(record, TokenIds):
            ids = _int_array(record.ids, f"{where}: TokenIds.ids")
            labels = None if record.labels is None else _int_array(record.labels, f"{where}: TokenIds.labels")
            if labels is not None and len(labels) != len(ids):
                raise InputValueError(f"{where}: {len(labels)} labels for {len(ids)} token ids; give one (unshifted) "
                                      "label per token, -100 where a token has no target")
            return "token_ids", ids, labels
        if isinstance(record, np.ndarray):
            return "token_ids", _int_array(record, f"{where}: the token-id array"), None
        raise InputTypeError(f"{where} is a {type(record).__name__} ({record!r:.60}); a record is a str (a text), a "
                             "PromptCompletion(prompt, completion), a 1-D int numpy array (token ids) or TokenIds(ids, "
                             "labels); wrap a (prompt, completion) tuple in PromptCompletion and a list of ids in "
                             "TokenIds")

    def load_texts(self) -> list[str]:
        """Read all documents as strings into one list (:meth:`iter_chunks` reads them chunk by chunk).

        Returns:
            The documents in corpus order (blank lines of text files are not documents).

        Raises:
            TypeError: the corpus is pre-tokenized (use :meth:`load_token_ids`) or holds prompt–completion
                records (use :meth:`iter_chunks`).
            ValueError: the corpus cannot be read (e.g. a file is not UTF-8, a JSONL line is bad) or is empty.

        Example:
            >>> from lit_balance.data.sources import resolve_corpus
            >>> resolve_corpus(["a", "b"]).load_texts()
            ['a', 'b']
        """
        if self.holds_token_ids:
            raise InputTypeError("this corpus holds token ids, not texts; call load_token_ids()")
        texts: list[str] = []
        for chunk in self.iter_chunks():
            if chunk.texts is None:
                raise InputTypeError(f"the corpus ({self.description}) holds prompt–completion records, not only "
                                     "texts; read it with iter_chunks() (the DataModule and the cache do)")
            texts.extend(chunk.texts)
        return texts

    def load_token_ids(self) -> list[np.ndarray]:
        """Return the pre-tokenized documents (their labels, if any, are left out: :meth:`iter_chunks` has them).

        Returns:
            One 1-D integer array per document.

        Raises:
            TypeError: the corpus holds texts (use :meth:`load_texts`).

        Example:
            >>> from lit_balance.data.sources import resolve_corpus
            >>> resolve_corpus([[5, 6], [7]]).load_token_ids()[0].tolist()
            [5, 6]
        """
        if not self.holds_token_ids:
            raise InputTypeError(f"this corpus holds texts ({self.kind}), not token ids; call load_texts()")
        return [ids for chunk in self.iter_chunks() for ids in chunk.token_ids]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CorpusSource):
            return NotImplemented
        return (type(self) is type(other) and self.kind == other.kind and self.fingerprint == other.fingerprint
                and self.description == other.description)

    def __hash__(self) -> int:
        return hash((type(self), self.kind, self.fingerprint, self.description))

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(kind={self.kind!r}, description={self.description!r})"


def _int_array(value: Any, what: str) -> np.ndarray:
    """A 1-D integer array of ``value`` (bools refused); raises naming ``what``."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as error:
        raise InputTypeError(f"{what} is not a sequence of ints: {error}") from None
    if array.ndim == 1 and array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InputTypeError(f"{what} must be a 1-D sequence of ints, got shape {array.shape} dtype {array.dtype}")
    return array


def _make_chunk(start: int, form: str, items: list, labels: list) -> CorpusChunk:
    if form != "token_ids":
        return CorpusChunk(start, **{form: items})
    return CorpusChunk(start, token_ids=items, labels=None if all(lab is None for lab in labels) else labels)
