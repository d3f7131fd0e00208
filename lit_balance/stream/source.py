"""A stream of documents of unknown length, read from a position, with the position it can seek back to.

:class:`StreamCorpus` wraps what a user has: any Python iterable (or a zero-argument callable returning one) of texts,
records (mappings with a ``text_key`` or an ``input_ids`` field) or token-id lists; a Hugging Face ``IterableDataset``
(``load_dataset(..., streaming=True)``); or text / JSONL files read lazily, line by line. Nothing is read before
training and no length is asked for.

The stream's order is the source's own iteration order (files: in the order given, lines in file order; an
``IterableDataset``: its iteration order, all shards). A document's *position* is its index in that order, counted
from 0; it is the document's index in the batches (``indices``) and in the resume state.

Seeking (resume without re-reading): files seek to a byte offset, an ``IterableDataset`` reloads its own
``state_dict()`` (``datasets`` >= 2.18); any other iterable is read again from its start and the documents before
the position are skipped, said once on stderr with their count.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.data.sources.base import CorpusSource
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["StreamCorpus", "StreamReader"]

_SUFFIXES = (".jsonl", ".txt")


def _is_hf_iterable(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "datasets" and type(obj).__name__ == "IterableDataset"


def _file_list(source: Any) -> list[Path] | None:
    """The files a source names (a ``Path``, a str path or glob pattern, or a list of ``Path``), or None when it names
    none."""
    if isinstance(source, str) and glob.has_magic(source):
        items = sorted(p for p in glob.glob(os.path.expanduser(source)) if os.path.isfile(p))
        if not items:
            raise InputValueError(f"stream glob pattern {source!r} matches no file", parameter="source")
    elif isinstance(source, (str, os.PathLike)):
        items = [source]
    elif isinstance(source, (list, tuple)) and source and all(isinstance(s, os.PathLike) for s in source):
        items = list(source)
    else:
        return None
    files = [Path(s) for s in items]
    for f in files:
        if f.suffix not in _SUFFIXES:
            raise InputValueError(f"stream file {str(f)!r} has suffix {f.suffix!r}; expected one of {_SUFFIXES} "
                                  "(one document per line, JSONL with a text field)", parameter="source")
        if not f.is_file():
            raise InputValueError(f"stream file {str(f)!r} does not exist", parameter="source")
    return files


class StreamCorpus(CorpusSource):
    """A stream of documents with no known length: what :class:`~lit_balance.stream.StreamBatches` trains from, and a
    corpus of :class:`~lit_balance.BalancedTextDataModule` (it declares itself :attr:`streamed`, so the DataModule
    plans it window by window during training: no cache, no pass before training, no ``len()``).

    Args:
        source: one of
            * an iterable of documents, or a zero-argument callable that returns a fresh one (a generator function);
              an iterable is iterated again (``iter(source)``) for every pass and every resume, so a one-shot
              generator object serves one pass only;
            * a Hugging Face ``datasets.IterableDataset`` (``streaming=True``), rows with ``input_ids`` or
              ``text_key``;
            * a path (str or ``os.PathLike``), a glob pattern (a str holding ``*``, ``?`` or ``[``, expanded in
              sorted order) or a list of ``os.PathLike`` of ``.txt`` (one document per non-blank line) and ``.jsonl``
              (one record per line) files, read lazily in the order given (a list of str is documents; one whose
              items all name existing files is refused).
            A document is a str (tokenized by the tokenizer), a mapping with ``input_ids`` (token ids, used as they
            are) or with ``text_key`` (a str, tokenized), or a sequence / 1-D array of ints (token ids).
        text_key: the field holding a record's text.
        tokenizer: what tokenizes texts (anything :func:`lit_balance.resolve_tokenizer` takes; None: the built-in
            tokenizer, loaded at the first text).
        max_length: documents longer than this many tokens are cut to it (their first tokens); None keeps them whole.

    Raises:
        TypeError: ``source`` is none of the above.
        ValueError: a named file is missing or has another suffix; ``max_length`` < 1.

    Example:
        >>> corpus = StreamCorpus(lambda: ([1, 2, 3][:n] for n in (1, 2, 3)))
        >>> [ids.tolist() for _, ids in corpus.reader().read(3)]
        [[1], [1, 2], [1, 2, 3]]
    """

    def __init__(self, source: Any, *, text_key: str = "text", tokenizer: Any = None,
                 max_length: int | None = None) -> None:
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):
            raise InputValueError(f"max_length must be an int >= 1 or None, got {max_length!r}",
                                  parameter="max_length")
        self.file_paths = _file_list(source)
        self.hf = _is_hf_iterable(source)
        if self.file_paths is None and not self.hf and not callable(source) and not isinstance(source, Iterable):
            raise InputTypeError(f"a stream source must be an iterable of documents, a callable returning one, a "
                                 f"datasets.IterableDataset or text/JSONL file paths; got {type(source).__name__}",
                                 parameter="source")
        if isinstance(source, (bytes, Mapping)):
            raise InputTypeError(f"a stream source must be an iterable of documents, got a {type(source).__name__}",
                                 parameter="source")
        if isinstance(source, (list, tuple)) and source and all(isinstance(s, str) for s in source):
            from lit_balance.data.sources import _refuse_paths_as_texts

            _refuse_paths_as_texts(tuple(source))
        self.source, self.text_key, self.max_length = source, text_key, max_length
        self._tokenizer_arg, self._tokenizer = tokenizer, None
        self.pad_token_id: int | None = None if tokenizer is None else self.tokenizer.pad_token_id

    kind = "stream"

    @property
    def given_tokenizer(self) -> Any:
        """The ``tokenizer`` this stream was built with (None: none given)."""
        return self._tokenizer_arg

    @property
    def streamed(self) -> bool:
        """True: a stream, read window by window while training (:class:`~lit_balance.stream.StreamBatches`)."""
        return True

    @property
    def files(self) -> tuple[str, ...]:
        """The files the stream reads, in order (none for an iterable or a dataset)."""
        return tuple(str(p) for p in self.file_paths or ())

    @property
    def description(self) -> str:
        """What the stream is, in a line."""
        if self.file_paths is not None:
            names = ", ".join(p.name for p in self.file_paths[:3]) + (", ..." if len(self.file_paths) > 3 else "")
            return f"stream of {len(self.file_paths)} file(s): {names}"
        return f"stream of {'a datasets.IterableDataset' if self.hf else type(self.source).__name__}"

    def identity(self) -> list[str]:
        """The files' paths, or the source's type: a stream's content is not known before it is read."""
        return [*self.files] or [type(self.source).__qualname__]

    def read_records(self) -> Any:
        """Refused: a stream has no pass before training, so it is not tokenized into the cache.

        Raises:
            ValueError: always, naming what needs a finite corpus.
        """
        raise InputValueError(
            f"{self.description} is read window by window while training (lit_balance.stream); the tokenization "
            "cache, `lit-balance tokenize` and plan previews need a finite corpus: pass the files or dataset itself "
            "(not wrapped in StreamCorpus), or train from the stream", parameter="corpus")

    def with_tokenizer(self, tokenizer: Any, max_length: int | None) -> StreamCorpus:
        """A copy of this stream (the same source) that tokenizes with ``tokenizer`` (a
        :class:`~lit_balance.TokenizerAdapter`, whose ``pad_token_id`` it takes) and cuts documents to ``max_length``
        tokens (None: not cut); this one is left as it is."""
        other = copy.copy(self)
        other.max_length, other._tokenizer, other.pad_token_id = max_length, tokenizer, tokenizer.pad_token_id
        return other

    @property
    def can_seek(self) -> bool:
        """Whether a resume seeks (files, an ``IterableDataset``) rather than re-reading the skipped documents."""
        return self.file_paths is not None or self.hf

    @property
    def tokenizer(self) -> Any:
        """The :class:`~lit_balance.TokenizerAdapter` texts are tokenized with (built at first use)."""
        if self._tokenizer is None:
            from lit_balance.data.tokenizer import resolve_tokenizer
            self._tokenizer = resolve_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    def reader(self, position: Any = None, start: int = 0) -> StreamReader:
        """A :class:`StreamReader` at document ``start``, seeking to ``position`` (from :meth:`StreamReader.position`
        at that document) where the source can, else skipping ``start`` documents."""
        return StreamReader(self, position, start)

    def head(self, num_documents: int) -> list[np.ndarray]:
        """The token ids (int64 ``[length]`` each) of the first ``num_documents`` documents: a held-out validation
        set taken from the stream's start (train with ``StreamBatches(held_out=num_documents)``)."""
        return [ids for _, ids in self.reader().read(num_documents, tokenize=None)]

    def to_ids(self, items: list[tuple[int, Any]]) -> list[np.ndarray]:
        """Token ids (int64 ``[length]``) of documents ``(position, item)``; texts are tokenized in one call.

        Raises:
            ValueError: a record without ``input_ids`` or ``text_key``; a document with no tokens.
            TypeError: a document of another type.
        """
        out: list[Any] = [None] * len(items)
        texts, at = [], []
        for k, (position, item) in enumerate(items):
            value = item
            if isinstance(item, Mapping):
                if "input_ids" in item:
                    value = item["input_ids"]
                elif self.text_key in item:
                    value = item[self.text_key]
                else:
                    raise InputValueError(f"stream document {position} is a record with keys {sorted(item)[:8]}; "
                                          f"expected a {self.text_key!r} field (set text_key=) or 'input_ids'",
                                          parameter="text_key")
            if isinstance(value, str):
                texts.append(value)
                at.append(k)
                continue
            array = np.asarray(value)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise InputTypeError(f"stream document {position} is a {type(value).__name__} (dtype {array.dtype}, "
                                     f"shape {array.shape}); expected a str, a record or a sequence of token ids")
            out[k] = array.astype(np.int64)
        if texts:
            for k, ids in zip(at, self.tokenizer.encode_batch(texts)):
                out[k] = np.asarray(ids, dtype=np.int64)
        for k, (position, _) in enumerate(items):
            if self.max_length is not None:
                out[k] = out[k][: self.max_length]
            if out[k].size == 0:
                raise InputValueError(f"stream document {position} has no tokens; remove empty documents from the "
                                      "stream", parameter="source")
            if out[k].size and (int(out[k].min()) < 0 or int(out[k].max()) >= 2**31):
                raise InputValueError(f"stream document {position} has token ids outside [0, 2**31)",
                                      parameter="source")
        return out


class StreamReader:
    """Reads a :class:`StreamCorpus` in order from a document position; knows the position to seek back to.

    Args:
        corpus: the stream.
        position: a seek position from :meth:`position` (None: the start, or skip to ``start``).
        start: the document index the reader starts at.
    """

    def __init__(self, corpus: StreamCorpus, position: Any, start: int) -> None:
        self.corpus, self.next_document, self.skipped = corpus, int(start), 0
        self._opened_at, self._pulled = position, False  # a dataset's state is its last iteration's until a row is read
        self._file, self._offset, self._handle = 0, 0, None
        self._iterator: Iterator[Any] | None = None
        if corpus.file_paths is not None:
            if position is not None:
                self._file, self._offset = int(position["file"]), int(position["offset"])
            elif start:
                self._skip(start)
        elif corpus.hf:
            if position is not None:
                corpus.source.load_state_dict(position)
            else:  # a fresh pass from the start, whatever state an earlier resume loaded into the dataset
                corpus.source._starting_state_dict = None
            self._iterator = iter(corpus.source)
            if position is None and start:
                self._skip(start)
        else:
            source = corpus.source() if callable(corpus.source) else corpus.source
            self._iterator = iter(source)
            if start:
                self._skip(start)

    def _skip(self, count: int) -> None:
        if not self.corpus.can_seek:  # a source that seeks skips without a position only past held-out documents
            print(f"lit_balance: reading and skipping the stream's first {count} documents (this source cannot seek)",
                  file=sys.stderr, flush=True)
        self.next_document = 0
        for _ in self._raw(count):
            pass
        if self.next_document < count:
            raise InputValueError(f"the stream ended after {self.next_document} documents, but the resume state says "
                                  f"{count} were consumed: the stream is not the one the state was saved from",
                                  parameter="source")
        self.skipped = count

    def position(self) -> Any:
        """The seek position of :attr:`next_document` (plain types; the same on every rank), or None."""
        if self.corpus.file_paths is not None:
            return {"file": self._file, "offset": self._offset}
        if self.corpus.hf:
            return self.corpus.source.state_dict() if self._pulled else self._opened_at
        return None

    def _raw(self, count: int, wanted: Callable[[int], bool] | None = None) -> Iterator[Any]:
        """Up to ``count`` raw documents from :attr:`next_document` on (fewer at the stream's end). A JSONL line whose
        position ``wanted`` says False of is counted but not parsed (None): each rank parses only its own lines."""
        if self._iterator is not None:
            for _ in range(count):
                try:
                    item = next(self._iterator)
                except StopIteration:
                    return
                self._pulled = True
                self.next_document += 1
                yield item
            return
        files, read = self.corpus.file_paths, 0
        while read < count and self._file < len(files):
            if self._handle is None:
                self._handle = open(files[self._file], "rb")  # noqa: SIM115 (kept open across windows)
                self._handle.seek(self._offset)
            line = self._handle.readline()
            if not line:
                self._handle.close()
                self._handle, self._file, self._offset = None, self._file + 1, 0
                continue
            self._offset = self._handle.tell()
            text = line.decode("utf-8").rstrip("\r\n")
            if not text.strip():
                continue
            if wanted is not None and not wanted(self.next_document):
                text = None  # another rank's line: counted (a non-blank line is a document), not parsed
            elif files[self._file].suffix == ".jsonl":
                try:
                    text = json.loads(text)
                except json.JSONDecodeError as error:
                    raise InputValueError(f"{files[self._file]}: a line before byte {self._offset} is not JSON "
                                          f"({error})", parameter="source") from error
            read += 1
            self.next_document += 1
            yield text

    def read(self, count: int, tokenize: Callable[[int], bool] | None = None) -> list[tuple[int, np.ndarray | None]]:
        """The next ``count`` documents (fewer at the end) as ``(position, token ids)``; those ``tokenize(position)``
        says False of are read but not tokenized (ids None). None: tokenize all."""
        first = self.next_document
        items = list(enumerate(self._raw(count, tokenize), start=first))
        mine = [(p, x) for p, x in items if tokenize is None or tokenize(p)]
        ids = dict(zip((p for p, _ in mine), self.corpus.to_ids(mine)))
        return [(p, ids.get(p)) for p, _ in items]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
