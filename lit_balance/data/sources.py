"""Corpus sources: the built-in corpus, in-memory texts, text/JSONL files, pre-tokenized ids, Hugging Face datasets.

A corpus is resolved into a :class:`CorpusSource`; its :meth:`CorpusSource.content_fingerprint` (for files:
a sha256 of their bytes, read when the cache is consulted) with a tokenizer's fingerprint keys the tokenization
cache (:mod:`lit_balance.data.cache`). Corpus files must be regular files: pipes, FIFOs, sockets and devices are
refused, since the cache reads the files twice (to hash and to tokenize) and a pipe could block forever.

:meth:`CorpusSource.iter_chunks` yields the documents in chunks of bounded size (:class:`CorpusChunk`: texts,
prompt–completion records, or token ids with optional labels), reading files in blocks of lines, so that tokenizing a
corpus never holds more than one chunk of it. A JSONL object without ``text_key`` that has ``prompt`` and
``completion`` strings, or a dataset row with those columns, is a prompt–completion record
(:func:`lit_balance.data.records.encode_chunk`).
"""

from __future__ import annotations

import ast
import gc
import glob
import hashlib
import inspect
import itertools
import json
import os
import platform
import stat
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance._fingerprint import sha256_of as _sha256
from lit_balance.data import hf_datasets
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["BUILTIN_CORPUS", "CorpusChunk", "CorpusSource", "resolve_corpus", "stdlib_docstrings"]

BUILTIN_CORPUS = "stdlib_docstrings"

_BUILTIN_VERSION = 1  # bump when the extraction rules of stdlib_docstrings change
_KINDS = ("builtin", "texts", "files", "token_ids", "datasets")
TXT_DOCUMENTS = ("line", "paragraph")  # how plain-text files split into documents
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOC_NODES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_UTF8_BOM = b"\xef\xbb\xbf"
_HASH_BLOCK = 1 << 22  # bytes read per update when hashing corpus files
_READ_BLOCK = 1 << 20  # bytes read per step when a corpus file is read for its documents
_CHUNK_DOCS = 4096  # most documents per chunk of CorpusSource.iter_chunks
_CHUNK_CHARS = 1 << 21  # most characters (or token ids) per chunk, unless one document is larger
_FILE_TYPES = ((stat.S_ISFIFO, "a pipe or FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).parts)


def _collect_docstrings(statements: list[ast.AST], out: list[str]) -> None:
    # Docstring owners are statements, so only statement lists are visited (expressions are skipped).
    for node in statements:
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=False)
            if doc and (doc := inspect.cleandoc(doc)):
                out.append(doc)
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            child = getattr(node, name, None)
            if child:
                _collect_docstrings(child, out)


def stdlib_docstrings() -> list[str]:
    """Extract the docstrings of the running interpreter's standard library (the built-in corpus).

    Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is parsed with :mod:`ast` (nothing is
    imported), in sorted path order, skipping ``site-packages``/``dist-packages``, test directories
    (``test``, ``tests``, ``idle_test``) and files that fail to read or parse. Module, class and
    (async) function docstrings are kept in source order, cleaned with :func:`inspect.cleandoc`;
    empty ones are dropped. The result is deterministic for a given interpreter (about 8.6k
    documents on CPython 3.11, ~2 s).

    Returns:
        The docstrings, all non-empty.

    Example:
        >>> docs = stdlib_docstrings()
        >>> len(docs) > 1000 and all(docs)
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    collecting = gc.isenabled()
    gc.disable()  # the parse trees are short-lived; collection passes over them only cost time
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences; must not depend on filters
            for path in _stdlib_files(root):
                try:
                    tree = ast.parse(path.read_bytes(), filename=str(path))
                except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
                    continue
                doc = ast.get_docstring(tree, clean=False)
                if doc and (doc := inspect.cleandoc(doc)):
                    docs.append(doc)
                _collect_docstrings(tree.body, docs)
    finally:
        if collecting:
            gc.enable()
    return docs


def _not_regular(path: Path, mode: int) -> ValueError:
    what = next((name for test, name in _FILE_TYPES if test(mode)), "not a regular file")
    return ValueError(f"corpus file {str(path)!r} cannot be read: it is {what}, not a regular file; write the "
                      "documents to a regular file first (the cache reads corpus files twice: to hash them and "
                      "to tokenize them)")


def _open_regular(path: Path) -> Any:
    """Open a corpus file for binary reading; a FIFO, socket or device raises instead of blocking."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise _not_regular(path, mode) from None
        raise InputValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _ContentDigest:
    """Size in bytes and sha256 of the bytes of a file, fed block by block as they are read."""

    def __init__(self) -> None:
        self.size, self._sha256 = 0, hashlib.sha256()

    def update(self, block: bytes) -> None:
        self._sha256.update(block)
        self.size += len(block)

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


def _file_sha256(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 hex digest of a corpus file, read in blocks of ``_HASH_BLOCK`` bytes."""
    digest = _ContentDigest()
    with _open_regular(path) as handle:
        try:
            for block in iter(lambda: handle.read(_HASH_BLOCK), b""):
                digest.update(block)
        except OSError as error:
            raise InputValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error
    return digest.size, digest.hexdigest()


def _split_lines(text: str) -> list[str]:
    """Whole lines of text (the last may lack its end) split at ``\r\n``, ``\r`` or ``\n``, without their ends."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.removesuffix("\n").split("\n")


def _file_line_blocks(path: Path, digest: _ContentDigest | None = None) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(number of the first line, lines)`` of a UTF-8 file, read in blocks of about ``_READ_BLOCK`` bytes.

    Lines are as :func:`_file_lines` yields them. Each block is cut after its last ``\n`` (which never occurs
    inside a UTF-8 sequence) and decoded at once; a block without one is joined to the next, so a line is never
    split. On a byte that is not UTF-8, the lines before the one holding it are yielded first, then the error
    names the byte's offset in the file. Every byte read is passed to ``digest`` (if given) as it is read.
    """
    number, offset = 1, 0  # offset: bytes of the file before ``data``
    parts: list[bytes] = []
    with _open_regular(path) as handle:
        try:
            while True:
                block = handle.read(_READ_BLOCK)
                if digest is not None:
                    digest.update(block)
                cut = block.rfind(b"\n") + 1
                if block and not cut:
                    parts.append(block)
                    continue
                parts.append(block[:cut] if block else b"")
                data = b"".join(parts)
                parts = [block[cut:]] if block and cut < len(block) else []
                if data:
                    skip = len(_UTF8_BOM) if offset == 0 and data.startswith(_UTF8_BOM) else 0
                    try:
                        lines = _split_lines(data[skip:].decode("utf-8") if skip else data.decode("utf-8"))
                    except UnicodeDecodeError as error:
                        bad = skip + error.start
                        good = max(data.rfind(b"\n", 0, bad) + 1, skip)  # the lines before the bad one
                        if good > skip:
                            yield number, _split_lines(data[skip:good].decode("utf-8"))
                        raise InputValueError(f"corpus file {str(path)!r} is not valid UTF-8 at byte {offset + bad}; "
                                         "re-encode it as UTF-8") from None
                    yield number, lines
                    number += len(lines)
                    offset += len(data)
                if not block:
                    return
        except OSError as error:
            raise InputValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error


def _file_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, line)`` of a UTF-8 file, read in blocks (never the whole file at once).

    A leading UTF-8 byte order mark is skipped. Lines end at ``\r\n``, ``\r`` or ``\n`` (universal
    newlines, as ``open(..., newline=None)``), and are yielded without their end; numbers count from 1.
    """
    for first, lines in _file_line_blocks(path):
        yield from enumerate(lines, first)


def _file_format(path: Path) -> str:
    return "jsonl" if path.suffix.lower() == ".jsonl" else "text"


def _check_txt_documents(txt_documents: Any) -> str:
    if not isinstance(txt_documents, str) or txt_documents not in TXT_DOCUMENTS:
        raise InputValueError(f"txt_documents must be one of {TXT_DOCUMENTS} ('line': one document per non-blank line "
                         "of a text file; 'paragraph': documents separated by blank lines), "
                         f"got {txt_documents!r}")
    return txt_documents


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Join runs of non-blank lines with ``\\n``; blank (whitespace-only) lines separate documents."""
    current: list[str] = []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            yield "\n".join(current)
            current = []
    if current:
        yield "\n".join(current)


def _jsonl_value(line: str, where: str) -> Any:
    """``json.loads(line)``; invalid JSON raises naming ``where``, the reason and the column."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise InputValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None


def _jsonl_object_record(obj: Any, where: str, text_key: str) -> tuple[str, Any]:
    """One parsed JSONL value as a record: ``("texts", text)`` or ``("pairs", (prompt, completion))``."""
    if not isinstance(obj, dict):
        raise InputValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_key in obj:
        if not isinstance(obj[text_key], str):
            raise InputValueError(f"{where}: {text_key!r} is {type(obj[text_key]).__name__}, expected a string")
        return "texts", obj[text_key]
    if "prompt" in obj and "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj[key], str):
                raise InputValueError(f"{where}: {key!r} is {type(obj[key]).__name__}, expected a string")
        return "pairs", (obj["prompt"], obj["completion"])
    raise InputValueError(f"{where}: no key {text_key!r} and no 'prompt'/'completion' pair (keys: {sorted(obj)[:10]}); "
                     "set text_key= to the key holding the text, or give each record 'prompt' and 'completion'")


def _jsonl_record(line: str, where: str, text_key: str) -> tuple[str, Any]:
    """One JSONL line as a record: ``("texts", text)`` or ``("pairs", (prompt, completion))``."""
    return _jsonl_object_record(_jsonl_value(line, where), where, text_key)


_scan_json = json.JSONDecoder().scan_once  # json.loads without its checks: (value, end) of the value at an index


def _jsonl_records(path: Path, lines: list[str], first: int, text_key: str) -> list[tuple[str, Any]]:
    """The records of a block of JSONL lines (line ``first`` first), blank lines skipped, as :func:`_jsonl_record`.

    A line that holds exactly one JSON value, with no whitespace around it, is parsed by the decoder's scanner
    (what ``json.loads`` calls after skipping whitespace); any other line, or one the scanner refuses, goes
    through ``json.loads``, so values and error messages are those of :func:`_jsonl_record`.
    """
    records = []
    append = records.append
    for number, line in enumerate(lines, first):
        try:
            obj, end = _scan_json(line, 0)
        except (StopIteration, ValueError, RecursionError):
            end = -1
        if end == len(line) and type(obj) is dict and type(obj.get(text_key)) is str:
            append(("texts", obj[text_key]))
        elif line.strip():
            where = f"corpus file {str(path)!r}, line {number}"
            append(_jsonl_object_record(obj if end == len(line) else _jsonl_value(line, where), where, text_key))
    return records


def _file_records(path: Path, text_key: str, txt_documents: str = "line",
                  digest: _ContentDigest | None = None) -> Iterator[list[tuple[str, Any]]]:
    """Yield the documents of one corpus file in order as lists of ``(kind, item)`` records, one list per block of
    lines read (:func:`_file_line_blocks`; a list may be empty).

    ``kind`` is ``"texts"`` (``item`` a str) or, for JSONL objects, ``"pairs"`` (``item`` a ``(prompt,
    completion)`` pair; see :func:`_jsonl_record`). Every byte read is passed to ``digest`` (if given).
    """
    blocks = _file_line_blocks(path, digest)
    if _file_format(path) == "jsonl":
        for first, lines in blocks:
            yield _jsonl_records(path, lines, first, text_key)
    elif txt_documents == "paragraph":
        docs = _paragraphs(line for _, lines in blocks for line in lines)
        while batch := list(itertools.islice(docs, 1024)):  # a list per 1,024 paragraphs, not the whole file
            yield [("texts", doc) for doc in batch]
    else:
        for _, lines in blocks:
            yield [("texts", line) for line in lines if line.strip()]


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
        raise InputValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _record_size(kind: str, item: Any) -> int:
    """Characters of a text or a prompt–completion pair, token ids of a pre-tokenized document."""
    if kind == "texts":
        return len(item)
    if kind == "pairs":
        return len(item[0]) + len(item[1])
    return len(item[0])


def _make_chunk(start: int, kind: str, items: list) -> CorpusChunk:
    if kind != "token_ids":
        return CorpusChunk(start, **{kind: items})
    labels = [lab for _, lab in items]
    return CorpusChunk(start, token_ids=[ids for ids, _ in items],
                       labels=None if all(lab is None for lab in labels) else labels)


def _chunked_records(blocks: Iterable[list[tuple[str, Any]]], max_docs: int,
                     max_size: int) -> Iterator[CorpusChunk]:
    """Group ``(kind, item)`` records, given in lists, as :func:`_chunked` groups documents, with a new chunk at each
    change of kind.

    ``kind`` is ``"texts"`` (a str), ``"pairs"`` (a prompt–completion pair) or ``"token_ids"`` (an ``(ids,
    labels or None)`` pair).
    """
    kind, batch, start, total = None, [], 0, 0
    for records in blocks:
        for record_kind, item in records:
            size = len(item) if record_kind == "texts" else _record_size(record_kind, item)
            if batch and (record_kind != kind or len(batch) == max_docs or total + size > max_size):
                yield _make_chunk(start, kind, batch)
                start, batch, total = start + len(batch), [], 0
            kind = record_kind
            batch.append(item)
            total += size
    if batch:
        yield _make_chunk(start, kind, batch)


def _chunked(docs: Iterable[Any], max_docs: int, max_size: int, size: Callable[[Any], int],
             make: Callable[[int, list], CorpusChunk]) -> Iterator[CorpusChunk]:
    """Group documents into chunks of at most ``max_docs`` documents and (past the first) ``max_size`` units."""
    batch: list[Any] = []
    start = total = 0
    for doc in docs:
        if batch and (len(batch) == max_docs or total + size(doc) > max_size):
            yield make(start, batch)
            start, batch, total = start + len(batch), [], 0
        batch.append(doc)
        total += size(doc)
    if batch:
        yield make(start, batch)


@dataclass(frozen=True)
class CorpusSource:
    """Where the documents of a corpus come from; build one with :func:`resolve_corpus`.

    Attributes:
        kind: ``"builtin"``, ``"texts"``, ``"files"``, ``"token_ids"`` or ``"datasets"`` (a Hugging Face
            ``datasets`` object, see :mod:`lit_balance.data.hf_datasets`).
        fingerprint: sha256 hex identifying the corpus when it was resolved (for files: resolved paths,
            sizes, mtimes; their content is only read by :meth:`content_fingerprint`; for an
            ``IterableDataset``: its mode and columns, its content being hashed while it is read).
        description: human-readable summary, e.g. ``"2 files: a.txt, b.jsonl"``.

    Example:
        >>> source = resolve_corpus(["first document", "second one"])
        >>> source.kind, source.description, source.load_texts()
        ('texts', '2 text documents', ['first document', 'second one'])
    """

    kind: str
    fingerprint: str
    description: str
    _payload: tuple = field(default=(), repr=False, compare=False)
    _text_key: str = field(default="text", repr=False, compare=False)
    _txt_documents: str = field(default="line", repr=False, compare=False)
    _read: dict = field(default_factory=dict, repr=False, compare=False)  # content digests of what was read

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InputValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")

    @property
    def holds_token_ids(self) -> bool:
        """Whether the documents are pre-tokenized ids (used as given, never re-encoded)."""
        return self.kind == "token_ids" or (self.kind == "datasets" and self._payload[0].mode == "token_ids")

    @property
    def split_sizes(self) -> tuple[int, int] | None:
        """``(training documents, validation documents)`` when the corpus brings its own validation split
        (a ``DatasetDict`` with a ``validation`` split; the training documents come first), else None."""
        return self._payload[0].split_sizes if self.kind == "datasets" else None

    @property
    def key_after_reading(self) -> bool:
        """Whether the corpus' identity is only known once it has been read (an ``IterableDataset`` not read yet
        in this process): :meth:`content_fingerprint` then raises and the cache builds the entry first."""
        return self.kind == "datasets" and self._payload[0].iterable and "digest" not in self._read

    def content_fingerprint(self) -> str:
        """Return a sha256 hex digest of what the documents are, the part of the cache key from the corpus.

        For files it hashes their bytes now (streamed in blocks, each file's format, size and digest in
        order; paths and mtimes do not count), so an edit that keeps a file's size and mtime (``cp -p``,
        ``rsync -t``, ``os.utime``) gives another fingerprint, and a copy of the same files elsewhere the
        same one. For a Hugging Face ``Dataset`` it is :attr:`fingerprint` (from the dataset's own
        ``_fingerprint``); for an ``IterableDataset`` it is the sha256 of what it yielded, known once
        :meth:`iter_chunks` has read it to the end. For the other kinds it is :attr:`fingerprint`.

        Raises:
            ValueError: a file cannot be read, or is no longer a regular file.
            RuntimeError: an ``IterableDataset`` not read yet (see :attr:`key_after_reading`).

        Example:
            >>> source = resolve_corpus(["a", "b"])
            >>> source.content_fingerprint() == source.fingerprint
            True
        """
        if self.kind == "datasets" and self._payload[0].iterable:
            if "digest" not in self._read:
                raise RuntimeError("the identity of an IterableDataset corpus is the hash of its content: read it "
                                   "with iter_chunks() first (load_or_build does)")
            return self._read["digest"]
        if self.kind != "files":
            return self.fingerprint
        return self._files_fingerprint([_file_sha256(path) for path in self._payload])

    def _files_fingerprint(self, contents: list[tuple[int, str]]) -> str:
        """The content fingerprint of the files from each file's ``(size in bytes, sha256 hex digest)``."""
        parts = ["files-content", self._text_key]
        if self._txt_documents != "line":  # the default adds nothing, so existing cache keys stay valid
            parts.append(f"txt_documents={self._txt_documents}")
        for path, (size, digest) in zip(self._payload, contents):
            parts += [_file_format(path), str(size), digest]
        return _sha256(*parts)

    def fingerprint_of_read(self) -> str | None:
        """The content fingerprint of the bytes the last complete :meth:`iter_chunks` of a file corpus read.

        Each file's bytes are hashed as they are read for their documents, so this is what was tokenized, with no
        second pass over the files; it equals :meth:`content_fingerprint` when the files did not change between
        the two. The cache compares them to refuse an entry whose files changed while they were read.

        Returns:
            The sha256 hex digest (as :meth:`content_fingerprint`), or None for other kinds of corpus, or before
            an iteration over a file corpus has reached its end.

        Example:
            >>> source = resolve_corpus(["a"])
            >>> source.fingerprint_of_read() is None
            True
        """
        return self._read.get("files")

    def iter_chunks(self, max_docs: int | None = None, max_chars: int | None = None) -> Iterator[CorpusChunk]:
        """Yield the documents in corpus order, in chunks of bounded size; files are read as the chunks go.

        Files are read in blocks of about 1 MiB cut at line ends (each decoded at once, JSONL lines parsed one at a
        time with :mod:`json`; the bytes read are hashed on the way: :meth:`fingerprint_of_read`), and Hugging Face
        datasets in batches of rows, so a consumer that keeps no chunk holds at most one chunk of documents
        (plus the line being read) at any time, whatever the size of the corpus. A chunk holds one form of
        document (:class:`CorpusChunk`); a file mixing text and prompt–completion records starts a new chunk
        at each change. Reading an ``IterableDataset`` to its end records the sha256 of its content, its
        identity (:meth:`content_fingerprint`). The built-in and in-memory corpora are already in memory; their
        chunks refer to the same strings and arrays (no copies).

        Args:
            max_docs: most documents per chunk (None: 4096).
            max_chars: most characters per chunk of texts (token ids per chunk of a pre-tokenized corpus); a
                single larger document forms a chunk of its own (None: 2**21).

        Returns:
            An iterator of :class:`CorpusChunk` whose ``start`` values count the documents before each chunk.

        Raises:
            ValueError: ``max_docs`` or ``max_chars`` is not an int >= 1 (at the call); while iterating: a file
                cannot be read, is not UTF-8, has a bad JSONL line, or holds no document at all.
            TypeError: a dataset value of the wrong type (naming split, row and column).

        Example:
            >>> [(chunk.start, list(chunk.texts)) for chunk in resolve_corpus(["a", "b", "c"]).iter_chunks(2)]
            [(0, ['a', 'b']), (2, ['c'])]
        """
        max_docs = _check_limit("max_docs", _CHUNK_DOCS if max_docs is None else max_docs)
        max_chars = _check_limit("max_chars", _CHUNK_CHARS if max_chars is None else max_chars)
        if self.kind == "token_ids":
            return _chunked(self._payload, max_docs, max_chars, len,
                            lambda start, docs: CorpusChunk(start, token_ids=docs))
        if self.kind == "datasets":
            return _chunked_records(self._iter_dataset_records(), max_docs, max_chars)
        if self.kind == "files":
            return _chunked_records(self._iter_file_records(), max_docs, max_chars)
        docs: Iterable[str] = stdlib_docstrings() if self.kind == "builtin" else self._payload
        return _chunked(docs, max_docs, max_chars, len, lambda start, texts: CorpusChunk(start, texts=texts))

    def _iter_file_records(self) -> Iterator[list[tuple[str, Any]]]:
        """Lists of records of the files in order; reading them to the end records the content fingerprint of the
        bytes read (:meth:`fingerprint_of_read`)."""
        self._read.pop("files", None)
        empty, contents = True, []
        for path in self._payload:
            digest = _ContentDigest()
            for records in _file_records(path, self._text_key, self._txt_documents, digest):
                empty = empty and not records
                yield records
            contents.append((digest.size, digest.hexdigest()))
        if empty:
            raise InputValueError(f"corpus is empty: no non-blank lines in {', '.join(map(str, self._payload))}")
        self._read["files"] = self._files_fingerprint(contents)

    def _iter_file_documents(self) -> Iterator[str]:
        for kind, item in (record for records in self._iter_file_records() for record in records):
            if kind != "texts":
                raise InputTypeError(f"the corpus ({self.description}) holds prompt–completion records, not only texts; "
                                "read it with iter_chunks() (the DataModule and the cache do)")
            yield item

    def _iter_dataset_records(self) -> Iterator[list[tuple[str, Any]]]:
        """Rows of a Hugging Face dataset as lists of records; reading an ``IterableDataset`` to its end records the
        sha256 of its content, its identity (:meth:`content_fingerprint`)."""
        hf = self._payload[0]
        digest = hf_datasets.new_digest(hf) if hf.iterable else None
        count = 0
        for kind, items in hf.iter_chunks(_CHUNK_DOCS, digest):
            count += len(items)
            yield [(kind, item) for item in items]
        if count == 0:
            raise InputValueError(f"corpus is empty: the {hf.description} yields no rows")
        if digest is not None:
            digest.update(count.to_bytes(8, "little"))
            self._read["digest"] = digest.hexdigest()

    @property
    def num_documents(self) -> int | None:
        """Number of documents when known without reading the corpus (in-memory corpora, a ``Dataset``), else None.

        Example:
            >>> resolve_corpus(["a", "b"]).num_documents, resolve_corpus().num_documents
            (2, None)
        """
        if self.kind in ("texts", "token_ids"):
            return len(self._payload)
        if self.kind == "datasets" and not self._payload[0].iterable:
            return sum(self._payload[0].split_sizes or (len(self._payload[0].train),))
        return None

    def load_texts(self) -> list[str]:
        """Read all documents as strings into one list (:meth:`iter_chunks` reads them chunk by chunk).

        Returns:
            The documents in corpus order (blank lines of text files are not documents).

        Raises:
            TypeError: the corpus is pre-tokenized (use :meth:`load_token_ids`) or holds prompt–completion
                records (use :meth:`iter_chunks`).
            ValueError: a file cannot be read, is not UTF-8, has a bad JSONL line, or the corpus is empty.

        Example:
            >>> resolve_corpus(["a", "b"]).load_texts()
            ['a', 'b']
        """
        if self.holds_token_ids:
            raise InputTypeError("this corpus holds token ids, not texts; call load_token_ids()")
        if self.kind == "datasets":
            if self._payload[0].mode != "texts":
                raise InputTypeError("this corpus holds prompt–completion records, not only texts; call iter_chunks()")
            return [text for chunk in self.iter_chunks() for text in chunk.texts]
        if self.kind == "builtin":
            return stdlib_docstrings()
        if self.kind == "texts":
            return list(self._payload)
        return list(self._iter_file_documents())

    def load_token_ids(self) -> list[np.ndarray]:
        """Return the pre-tokenized documents.

        Returns:
            One read-only int64 1-D array per document.

        Raises:
            TypeError: the corpus holds texts (use :meth:`load_texts`).

        Example:
            >>> resolve_corpus([[5, 6], [7]]).load_token_ids()[0].tolist()
            [5, 6]
        """
        if not self.holds_token_ids:
            raise InputTypeError(f"this corpus holds texts ({self.kind}), not token ids; call load_texts()")
        if self.kind == "datasets":
            return [ids for chunk in self.iter_chunks() for ids in chunk.token_ids]
        return list(self._payload)


def _as_ids(item: Any, index: int) -> np.ndarray:
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


def _files_source(paths: list[Any], text_key: str, txt_documents: str = "line") -> CorpusSource:
    resolved, parts, sizes = [], [], []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise InputFileNotFoundError(f"corpus file {str(path)!r} does not exist "
                                    "(a list of str is read as documents; a single str must be a file)")
        if path.is_dir():
            raise InputValueError(f"corpus path {str(path)!r} is a directory; pass the files inside it, "
                             f"e.g. sorted(Path({str(path)!r}).glob('*.txt'))")
        if path.suffix.lower() == ".json":
            raise InputValueError(f"corpus file {str(path)!r}: .json is not supported; use .jsonl "
                             "(one JSON object per line) or plain text (one document per line)")
        with _open_regular(path) as handle:  # refuses a FIFO, socket or device instead of blocking on it
            info = os.fstat(handle.fileno())
        path = path.resolve()
        resolved.append(path)
        parts += [str(path), str(info.st_size), str(info.st_mtime_ns)]
        sizes.append(info.st_size)
    if not any(sizes):
        raise InputValueError(f"corpus is empty: every file is empty ({', '.join(map(str, resolved))})")
    names = [path.name for path in resolved]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    description = f"{len(names)} file{'s' if len(names) != 1 else ''}: {shown}"
    if txt_documents != "line":
        parts.append(f"txt_documents={txt_documents}")
    return CorpusSource("files", _sha256("files", text_key, *parts), description, tuple(resolved), text_key,
                        txt_documents)


def resolve_corpus(corpus: Any = None, *, text_key: str = "text", txt_documents: str = "line") -> CorpusSource:
    """Turn a corpus argument into a :class:`CorpusSource`.

    Rules, in order:

    * ``None`` or ``"stdlib_docstrings"``: the built-in corpus (:func:`stdlib_docstrings`).
    * A single ``str`` or ``os.PathLike``: one file, which must exist; a ``str`` holding ``*``, ``?``
      or ``[`` is a glob pattern (e.g. ``"data/*.jsonl"``), expanded in sorted order.
    * A list/tuple of ``str``: in-memory documents. A list whose items all name existing files, or
      are glob patterns matching files, is refused (pass ``pathlib.Path`` objects or a single glob
      pattern for files), so that paths are never trained on as text.
    * A list/tuple of ``os.PathLike`` (e.g. ``pathlib.Path``): files.
    * A list/tuple of int sequences (lists, tuples, 1-D integer numpy arrays or torch tensors):
      pre-tokenized documents, every id ``>= 0``.
    * A Hugging Face ``datasets.Dataset``, ``DatasetDict`` (its ``train`` split, and its ``validation``
      split when present: :attr:`CorpusSource.split_sizes`), ``IterableDataset`` or ``Column``: see
      :mod:`lit_balance.data.hf_datasets` for the columns read (``input_ids`` and ``labels``, the ``text_key``
      column, or ``prompt`` and ``completion``) and the identity (cache key) of each.

    Files ending in ``.jsonl`` hold one JSON object per non-blank line, the document being
    ``obj[text_key]``, or, for an object without ``text_key`` that has ``prompt`` and ``completion``
    strings, a prompt–completion record (tokenized as ``prompt + completion``, only the completion's
    tokens carrying loss: :func:`lit_balance.data.records.encode_chunk`); ``.json`` is rejected; any other file is UTF-8 text, one document per
    non-blank line (``txt_documents="line"``) or one per paragraph (``txt_documents="paragraph"``: runs
    of non-blank lines, separated by blank or whitespace-only lines, joined with ``"\\n"``). File
    contents are read (and checked) by :meth:`CorpusSource.load_texts`.

    Args:
        corpus: the corpus, as above.
        text_key: key of the document text in JSONL objects.
        txt_documents: ``"line"`` or ``"paragraph"``, how plain-text files split into documents (part of
            the cache key; ignored for other corpora).

    Returns:
        The source.

    Raises:
        FileNotFoundError: a path does not exist, or a glob pattern matches no file.
        ValueError: ``txt_documents`` is not ``"line"`` or ``"paragraph"``; a directory or ``.json``
            file, an unreadable file, a negative token id, an
            empty corpus or path, or a list of ``str`` that all name existing files or are glob
            patterns matching files.
        TypeError: an unsupported type, or a list mixing item kinds.
        ImportError: a Hugging Face ``datasets`` object while ``datasets`` cannot be imported (the message
            says ``pip install "lit_balance[datasets]"``).

    Example:
        >>> resolve_corpus().kind, resolve_corpus([[1, 2], [3]]).kind
        ('builtin', 'token_ids')
    """
    if not isinstance(text_key, str):
        raise InputTypeError(f"text_key must be a str, got {type(text_key).__name__} {text_key!r}")
    txt_documents = _check_txt_documents(txt_documents)
    if isinstance(corpus, CorpusSource):
        return corpus
    if hf_datasets.is_datasets_object(corpus):
        hf = hf_datasets.describe(corpus, text_key)
        fingerprint = hf.fingerprint or _sha256("datasets-iterable", hf.mode, *hf.columns)
        return CorpusSource("datasets", fingerprint, hf.description, (hf,), text_key)
    if corpus is None or (isinstance(corpus, str) and corpus == BUILTIN_CORPUS):
        stdlib = sysconfig.get_paths()["stdlib"]
        parts = ("builtin", str(_BUILTIN_VERSION), sys.implementation.name, sys.version, stdlib)
        description = f"Python {platform.python_version()} standard library docstrings"
        return CorpusSource("builtin", _sha256(*parts), description)
    if isinstance(corpus, str) and not corpus.strip():
        raise InputValueError("corpus is an empty string; pass a file path, a glob pattern, a list of documents, "
                         "or None for the built-in corpus")
    if isinstance(corpus, str) and any(c in corpus for c in "*?["):
        matches = sorted(p for p in glob.glob(os.path.expanduser(corpus), recursive=True) if os.path.isfile(p))
        if not matches:
            raise InputFileNotFoundError(f"corpus glob pattern {corpus!r} matches no file")
        return _files_source(matches, text_key, txt_documents)
    if isinstance(corpus, (str, os.PathLike)):
        return _files_source([corpus], text_key, txt_documents)
    if not isinstance(corpus, (list, tuple)):
        raise InputTypeError(f"corpus must be None, {BUILTIN_CORPUS!r}, a path, a list/tuple of documents, paths or "
                        "token-id sequences, or a Hugging Face datasets.Dataset, DatasetDict or IterableDataset "
                        f"(pip install \"lit_balance[datasets]\"); got {type(corpus).__name__}")
    if not corpus:
        raise InputValueError("corpus is empty: the list holds no documents")
    kinds = [_item_kind(item, index) for index, item in enumerate(corpus)]
    if len(set(kinds)) > 1:
        first = kinds.index(next(k for k in kinds if k != kinds[0]))
        raise InputTypeError(f"corpus items must all be of one kind; item 0 is {kinds[0]} but item {first} is "
                        f"{kinds[first]} ({type(corpus[first]).__name__})")
    if kinds[0] == "files":
        return _files_source(list(corpus), text_key, txt_documents)
    if kinds[0] == "texts":
        texts = tuple(corpus)
        if all(_names_files(t) for t in texts):
            shown = ", ".join(repr(t) for t in texts[:3]) + (", ..." if len(texts) > 3 else "")
            patterns = [t for t in texts if glob.has_magic(t)]
            what = "name existing files or are glob patterns matching files" if patterns else "name existing files"
            single = f" (a single str, not a list: corpus={patterns[0]!r})" if len(patterns) == 1 else ""
            raise InputValueError(
                f"corpus is a list of {len(texts)} str that all {what} ({shown}); a list of str is "
                "read as the documents themselves. To read the files, pass pathlib.Path objects or a glob "
                f"pattern such as 'data/*.txt'{single}"
            )
        return CorpusSource("texts", _sha256("texts", *texts), f"{len(texts)} text documents", texts)
    arrays = tuple(_as_ids(item, index) for index, item in enumerate(corpus))
    digest = hashlib.sha256(b"token_ids")
    for array in arrays:
        digest.update(len(array).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
    total = sum(len(array) for array in arrays)
    return CorpusSource("token_ids", digest.hexdigest(), f"{len(arrays)} pre-tokenized documents ({total} tokens)",
                        arrays)
