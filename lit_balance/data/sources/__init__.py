"""Input sources: one class per kind of input behind one protocol, :class:`CorpusSource`.

:func:`resolve_corpus` turns a corpus argument into a source: the built-in corpus
(:class:`StdlibDocstringsSource`), in-memory texts (:class:`TextsSource`), text and JSONL files
(:class:`FilesSource`), pre-tokenized ids (:class:`TokenIdsSource`) or a Hugging Face ``datasets`` object
(:class:`HuggingFaceSource`); an instance of any :class:`CorpusSource` subclass is used as it is. A source's
:meth:`CorpusSource.content_fingerprint` (for files: a sha256 of their bytes, read when the cache is consulted) with
a tokenizer's fingerprint keys the tokenization cache (:mod:`lit_balance.data.cache`), which reads the documents
chunk by chunk (:meth:`CorpusSource.iter_chunks`, :class:`CorpusChunk`: texts, prompt–completion records, or token
ids with optional labels).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from lit_balance.data.sources.base import CorpusChunk, CorpusSource, PromptCompletion, TokenIds
from lit_balance.data.sources.builtin import BUILTIN_CORPUS, StdlibDocstringsSource, stdlib_docstrings
from lit_balance.data.sources.files import TXT_DOCUMENTS, FilesSource, check_txt_documents
from lit_balance.data.sources.hf import HuggingFaceSource, is_datasets_object
from lit_balance.data.sources.texts import TextsSource
from lit_balance.data.sources.token_ids import TokenIdsSource
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["BUILTIN_CORPUS", "TXT_DOCUMENTS", "CorpusChunk", "CorpusSource", "FilesSource", "HuggingFaceSource",
           "PromptCompletion", "StdlibDocstringsSource", "TextsSource", "TokenIds", "TokenIdsSource",
           "resolve_corpus", "stdlib_docstrings"]


def _item_kind(item: Any, index: int) -> str:
    if isinstance(item, str):
        return "texts"
    if isinstance(item, os.PathLike):
        return "files"
    if isinstance(item, (list, tuple, np.ndarray)) or (hasattr(item, "detach") and hasattr(item, "numpy")):
        return "token_ids"
    raise InputTypeError(f"corpus item {index} is a {type(item).__name__}; expected str (a document), "
                         "os.PathLike (a file) or a sequence of ints (token ids)")


def _names_files(text: str) -> bool:
    """Whether a str looks like a path rather than a document: an existing file, or a glob matching files."""
    if "\n" in text or "\0" in text or len(text) >= 4096:
        return False
    if os.path.isfile(text):
        return True
    if not glob.has_magic(text):
        return False
    try:  # not recursive: a document holding "**" must not walk a directory tree
        return any(os.path.isfile(p) for p in glob.iglob(os.path.expanduser(text)))
    except (OSError, ValueError):
        return False


def _refuse_paths_as_texts(texts: tuple[str, ...]) -> None:
    """Refuse a list of str that all name existing files or are glob patterns matching files."""
    if not all(_names_files(t) for t in texts):
        return
    shown = ", ".join(repr(t) for t in texts[:3]) + (", ..." if len(texts) > 3 else "")
    patterns = [t for t in texts if glob.has_magic(t)]
    what = "name existing files or are glob patterns matching files" if patterns else "name existing files"
    single = f" (a single str, not a list: corpus={patterns[0]!r})" if len(patterns) == 1 else ""
    raise InputValueError(
        f"corpus is a list of {len(texts)} str that all {what} ({shown}); a list of str is "
        "read as the documents themselves. To read the files, pass pathlib.Path objects or a glob "
        f"pattern such as 'data/*.txt'{single}", parameter="corpus"
    )


def resolve_corpus(corpus: Any = None, *, text_key: str = "text", txt_documents: str = "line",
                   max_documents: int | None = None) -> CorpusSource:
    """Turn a corpus argument into a :class:`CorpusSource`.

    Rules, in order:

    * A :class:`CorpusSource` (a built-in one or an instance of one's own subclass): used as it is.
    * A Hugging Face ``datasets.Dataset``, ``DatasetDict`` (its ``train`` split, and its ``validation``
      split when present: :attr:`CorpusSource.split_sizes`), ``IterableDataset`` or ``Column``:
      :class:`HuggingFaceSource` (see :mod:`lit_balance.data.sources.hf` for the columns read: ``input_ids`` and
      ``labels``, the ``text_key`` column, or ``prompt`` and ``completion``, and the identity of each).
    * ``None`` or ``"stdlib_docstrings"``: the built-in corpus (:func:`stdlib_docstrings`).
    * A single ``str`` or ``os.PathLike``: one file, which must exist; a ``str`` holding ``*``, ``?``
      or ``[`` is a glob pattern (e.g. ``"data/*.jsonl"``), expanded in sorted order.
    * A list/tuple of ``str``: in-memory documents. A list whose items all name existing files, or
      are glob patterns matching files, is refused (pass ``pathlib.Path`` objects or a single glob
      pattern for files), so that paths are never trained on as text.
    * A list/tuple of ``os.PathLike`` (e.g. ``pathlib.Path``): files.
    * A list/tuple of int sequences (lists, tuples, 1-D integer numpy arrays or torch tensors):
      pre-tokenized documents, every id ``>= 0``.

    Files ending in ``.jsonl`` hold one JSON object per non-blank line, the document being
    ``obj[text_key]``, or, for an object without ``text_key`` that has ``prompt`` and ``completion``
    strings, a prompt–completion record (tokenized as ``prompt + completion``, only the completion's
    tokens carrying loss: :func:`lit_balance.data.records.encode_chunk`); ``.json`` is rejected; any other file is
    UTF-8 text, one document per non-blank line (``txt_documents="line"``) or one per paragraph
    (``txt_documents="paragraph"``: runs of non-blank lines, separated by blank or whitespace-only lines, joined
    with ``"\\n"``). File contents are read (and checked) when the documents are read.

    Args:
        corpus: the corpus, as above.
        text_key: key of the document text in JSONL objects (the text column of a dataset).
        txt_documents: ``"line"`` or ``"paragraph"``, how plain-text files split into documents (part of
            the cache key; ignored for other corpora).
        max_documents: rows read at most from a Hugging Face ``IterableDataset``, which needs this bound (a
            stream may never end); None for every other corpus.

    Returns:
        The source.

    Raises:
        FileNotFoundError: a path does not exist, or a glob pattern matches no file.
        ValueError: ``txt_documents`` is not ``"line"`` or ``"paragraph"``; an ``IterableDataset`` without
            ``max_documents``, or ``max_documents`` with any other corpus; a directory or ``.json``
            file, an unreadable file, a negative token id, an
            empty corpus or path, or a list of ``str`` that all name existing files or are glob
            patterns matching files.
        TypeError: an unsupported type, or a list mixing item kinds.
        ImportError: a Hugging Face ``datasets`` object while ``datasets`` cannot be imported (the message
            says ``pip install -e ".[datasets]"``).

    Example:
        >>> resolve_corpus().kind, resolve_corpus([[1, 2], [3]]).kind
        ('builtin', 'token_ids')
    """
    if not isinstance(text_key, str):
        raise InputTypeError(f"text_key must be a str, got {type(text_key).__name__} {text_key!r}",
                             parameter="text_key")
    txt_documents = check_txt_documents(txt_documents)
    if is_datasets_object(corpus):
        return HuggingFaceSource(corpus, text_key, max_documents=max_documents)
    if max_documents is not None and isinstance(corpus, CorpusSource) and corpus.streamed:
        raise InputValueError(f"max_documents={max_documents!r} bounds a Hugging Face IterableDataset read into the "
                              f"cache, but {corpus.description} is a StreamCorpus, read window by window while "
                              "training to its end: leave max_documents=None (end the run earlier with "
                              "Trainer(max_steps=...))", parameter="max_documents")
    if max_documents is not None:
        what = "a CorpusSource" if isinstance(corpus, CorpusSource) else "this corpus"
        raise InputValueError(f"max_documents={max_documents!r} bounds a Hugging Face IterableDataset (a stream), but "
                              f"{what} is read to its end: leave max_documents=None", parameter="max_documents")
    if isinstance(corpus, CorpusSource):
        return corpus
    if corpus is None or (isinstance(corpus, str) and corpus == BUILTIN_CORPUS):
        return StdlibDocstringsSource()
    if isinstance(corpus, str) and not corpus.strip():
        raise InputValueError("corpus is an empty string; pass a file path, a glob pattern, a list of documents, "
                              "or None for the built-in corpus", parameter="corpus")
    if isinstance(corpus, str) and any(c in corpus for c in "*?["):
        matches = sorted(p for p in glob.glob(os.path.expanduser(corpus), recursive=True) if os.path.isfile(p))
        if not matches:
            raise InputFileNotFoundError(f"corpus glob pattern {corpus!r} matches no file", parameter="corpus")
        return FilesSource(matches, text_key, txt_documents)
    if isinstance(corpus, (str, os.PathLike)):
        return FilesSource([corpus], text_key, txt_documents)
    if not isinstance(corpus, (list, tuple)):
        raise InputTypeError(f"corpus must be None, {BUILTIN_CORPUS!r}, a path, a list/tuple of documents, paths "
                             "or token-id sequences, a Hugging Face datasets.Dataset, DatasetDict or IterableDataset "
                             "(pip install -e \".[datasets]\" in a clone of lit_balance), or a CorpusSource; got "
                             f"{type(corpus).__name__}",
                             parameter="corpus")
    if not corpus:
        raise InputValueError("corpus is empty: the list holds no documents", parameter="corpus")
    kinds = [_item_kind(item, index) for index, item in enumerate(corpus)]
    if len(set(kinds)) > 1:
        first = kinds.index(next(k for k in kinds if k != kinds[0]))
        raise InputTypeError(f"corpus items must all be of one kind; item 0 is {kinds[0]} but item {first} is "
                             f"{kinds[first]} ({type(corpus[first]).__name__})", parameter="corpus")
    if kinds[0] == "files":
        return FilesSource(list(corpus), text_key, txt_documents)
    if kinds[0] == "texts":
        texts = tuple(corpus)
        _refuse_paths_as_texts(texts)
        return TextsSource(texts)
    return TokenIdsSource(corpus)
