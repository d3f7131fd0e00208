"""UTF-8 text and JSONL files as a corpus, read in blocks of lines and hashed by their bytes.

A ``.jsonl`` file holds one JSON object per non-blank line: the document is ``obj[text_key]``, or, for an object
without ``text_key`` that has ``prompt`` and ``completion`` strings, a prompt–completion record. Any other file is
UTF-8 text, one document per non-blank line (``txt_documents="line"``) or one per paragraph
(``txt_documents="paragraph"``). Corpus files must be regular files: pipes, FIFOs, sockets and devices are refused,
since the cache reads the files twice (to hash them and to tokenize them) and a pipe could block forever.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from lit_balance._fingerprint import sha256_of, sha256_of_stream
from lit_balance.data.sources.base import CorpusSource, PromptCompletion
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["TXT_DOCUMENTS", "FilesSource"]

TXT_DOCUMENTS = ("line", "paragraph")  # how plain-text files split into documents
_UTF8_BOM = b"\xef\xbb\xbf"
_HASH_BLOCK = 1 << 22  # bytes read per update when hashing corpus files
_READ_BLOCK = 1 << 20  # bytes read per step when a corpus file is read for its documents
_FILE_TYPES = ((stat.S_ISFIFO, "a pipe or FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path: Path, mode: int) -> InputValueError:
    what = next((name for test, name in _FILE_TYPES if test(mode)), "not a regular file")
    return InputValueError(f"corpus file {str(path)!r} cannot be read: it is {what}, not a regular file; write the "
                           "documents to a regular file first (the cache reads corpus files twice: to hash them and "
                           "to tokenize them)")


def _open_regular(path: Path) -> BinaryIO:
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


def _file_digest(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 hex digest of a corpus file, read in blocks of ``_HASH_BLOCK`` bytes."""
    with _open_regular(path) as handle:
        try:
            return sha256_of_stream(handle, _HASH_BLOCK)
        except OSError as error:
            raise InputValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error


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
                        raise InputValueError(f"corpus file {str(path)!r} is not valid UTF-8 at byte "
                                              f"{offset + bad}; re-encode it as UTF-8") from None
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


def check_txt_documents(txt_documents: Any) -> str:
    """Return ``txt_documents`` if it is ``"line"`` or ``"paragraph"``; raise a ValueError naming both otherwise."""
    if not isinstance(txt_documents, str) or txt_documents not in TXT_DOCUMENTS:
        raise InputValueError(f"txt_documents must be one of {TXT_DOCUMENTS} ('line': one document per non-blank "
                              "line of a text file; 'paragraph': documents separated by blank lines), "
                              f"got {txt_documents!r}", parameter="txt_documents")
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


def _jsonl_object_record(obj: Any, where: str, text_key: str) -> str | PromptCompletion:
    """One parsed JSONL value as a record: the text, or a :class:`PromptCompletion`."""
    if not isinstance(obj, dict):
        raise InputValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_key in obj:
        if not isinstance(obj[text_key], str):
            raise InputValueError(f"{where}: {text_key!r} is {type(obj[text_key]).__name__}, expected a string")
        return obj[text_key]
    if "prompt" in obj and "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj[key], str):
                raise InputValueError(f"{where}: {key!r} is {type(obj[key]).__name__}, expected a string")
        return PromptCompletion(obj["prompt"], obj["completion"])
    raise InputValueError(f"{where}: no key {text_key!r} and no 'prompt'/'completion' pair (keys: "
                          f"{sorted(obj)[:10]}); set text_key= to the key holding the text, or give each record "
                          "'prompt' and 'completion'")


def _jsonl_record(line: str, where: str, text_key: str) -> str | PromptCompletion:
    """One JSONL line as a record: the text, or a :class:`PromptCompletion`."""
    return _jsonl_object_record(_jsonl_value(line, where), where, text_key)


_scan_json = json.JSONDecoder().scan_once  # json.loads without its checks: (value, end) of the value at an index


def _jsonl_records(path: Path, lines: list[str], first: int, text_key: str) -> list[str | PromptCompletion]:
    """The records of a block of JSONL lines (line ``first`` first), blank lines skipped, as :func:`_jsonl_record`.

    A line that holds exactly one JSON value, with no whitespace around it, is parsed by the decoder's scanner
    (what ``json.loads`` calls after skipping whitespace); any other line, or one the scanner refuses, goes
    through ``json.loads``, so values and error messages are those of :func:`_jsonl_record`.
    """
    records: list[str | PromptCompletion] = []
    append = records.append
    for number, line in enumerate(lines, first):
        try:
            obj, end = _scan_json(line, 0)
        except (StopIteration, ValueError, RecursionError):
            end = -1
        if end == len(line) and type(obj) is dict and type(text := obj.get(text_key)) is str:
            append(text)
        elif line.strip():
            where = f"corpus file {str(path)!r}, line {number}"
            append(_jsonl_object_record(obj if end == len(line) else _jsonl_value(line, where), where, text_key))
    return records


def _file_records(path: Path, text_key: str, txt_documents: str = "line",
                  digest: _ContentDigest | None = None) -> Iterator[list[str | PromptCompletion]]:
    """Yield the documents of one corpus file in order as lists of records (texts, or :class:`PromptCompletion`
    for JSONL objects; see :func:`_jsonl_record`), one list per block of lines read (:func:`_file_line_blocks`;
    a list may be empty). Every byte read is passed to ``digest`` (if given)."""
    blocks = _file_line_blocks(path, digest)
    if _file_format(path) == "jsonl":
        for first, lines in blocks:
            yield _jsonl_records(path, lines, first, text_key)
    elif txt_documents == "paragraph":
        docs = _paragraphs(line for _, lines in blocks for line in lines)
        while batch := list(itertools.islice(docs, 1024)):  # a list per 1,024 paragraphs, not the whole file
            yield batch
    else:
        for _, lines in blocks:
            yield [line for line in lines if line.strip()]


class FilesSource(CorpusSource):
    """UTF-8 text and JSONL files, read in order (see the module docstring for what a document is).

    Creating the source checks each file (it exists, is a regular file, not a directory nor ``.json``) and
    records its resolved path, size and mtime: :attr:`fingerprint`. The cache key is the content of the files
    (:meth:`content_fingerprint`: their bytes, hashed when the cache is consulted), and the bytes read for the
    documents are hashed as they are read (:meth:`fingerprint_of_read`), so a file that changed in between is
    noticed.

    Args:
        paths: the files (``str`` or ``os.PathLike``), in corpus order.
        text_key: key of the document text in JSONL objects.
        txt_documents: ``"line"`` or ``"paragraph"``, how plain-text files split into documents.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a directory, a ``.json`` file, a file that is not regular (a FIFO, socket or device) or cannot
            be opened, every file empty, or ``txt_documents`` not ``"line"`` or ``"paragraph"``.
        TypeError: ``text_key`` is not a ``str``.

    Example:
        >>> path = getfixture("tmp_path") / "a.txt"
        >>> _ = path.write_text("first\\n\\nsecond\\n")
        >>> source = FilesSource([path])
        >>> source.kind, source.description, source.load_texts()
        ('files', '1 file: a.txt', ['first', 'second'])
    """

    kind = "files"

    def __init__(self, paths: Sequence[str | os.PathLike], text_key: str = "text",
                 txt_documents: str = "line") -> None:
        if not isinstance(text_key, str):
            raise InputTypeError(f"text_key must be a str, got {type(text_key).__name__} {text_key!r}",
                                 parameter="text_key")
        txt_documents = check_txt_documents(txt_documents)
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
        if txt_documents != "line":  # the default adds nothing to the identity
            parts.append(f"txt_documents={txt_documents}")
        self._paths = tuple(resolved)
        self._text_key, self._txt_documents = text_key, txt_documents
        self._identity = (text_key, *parts)
        self._read: dict[str, str] = {}  # the content fingerprint of the last complete read

    @property
    def paths(self) -> tuple[Path, ...]:
        """The resolved paths of the files, in corpus order."""
        return self._paths

    @property
    def files(self) -> tuple[str, ...]:
        """The files' resolved paths, in corpus order (:attr:`paths` as str)."""
        return tuple(str(p) for p in self._paths)

    @property
    def text_key(self) -> str:
        """Key of the document text in JSONL objects."""
        return self._text_key

    @property
    def txt_documents(self) -> str:
        """``"line"`` or ``"paragraph"``: how plain-text files split into documents."""
        return self._txt_documents

    def identity(self) -> tuple[str, ...]:
        """``text_key``, then each file's resolved path, size in bytes and mtime in ns (then ``txt_documents``
        unless ``"line"``), as they were when the source was created."""
        return self._identity

    @property
    def description(self) -> str:
        """E.g. ``"2 files: a.txt, b.jsonl"`` (five names at most)."""
        names = [path.name for path in self._paths]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"{len(names)} file{'s' if len(names) != 1 else ''}: {shown}"

    def content_fingerprint(self) -> str:
        """Return a sha256 hex digest of the files' content, the part of the cache key from the corpus.

        The files are hashed now (streamed in blocks; each file's format, size and digest in order; paths and
        mtimes do not count), so an edit that keeps a file's size and mtime (``cp -p``, ``rsync -t``,
        ``os.utime``) gives another fingerprint, and a copy of the same files elsewhere the same one.

        Raises:
            ValueError: a file cannot be read, or is no longer a regular file.
        """
        return self._files_fingerprint([_file_digest(path) for path in self._paths])

    def _files_fingerprint(self, contents: list[tuple[int, str]]) -> str:
        """The content fingerprint of the files from each file's ``(size in bytes, sha256 hex digest)``."""
        parts = ["files-content", self._text_key]
        if self._txt_documents != "line":  # the default adds nothing
            parts.append(f"txt_documents={self._txt_documents}")
        for path, (size, digest) in zip(self._paths, contents):
            parts += [_file_format(path), str(size), digest]
        return sha256_of(*parts)

    def fingerprint_of_read(self) -> str | None:
        """The content fingerprint of the bytes the last complete :meth:`iter_chunks` read.

        Each file's bytes are hashed as they are read for their documents, so this is what was tokenized, with no
        second pass over the files; it equals :meth:`content_fingerprint` when the files did not change between
        the two. The cache compares them to refuse an entry whose files changed while they were read.

        Returns:
            The sha256 hex digest (as :meth:`content_fingerprint`), or None before an iteration has reached its end.
        """
        return self._read.get("files")

    def read_records(self) -> Iterator[str | PromptCompletion]:
        """The documents of the files in order, read in blocks of about 1 MiB cut at line ends (each decoded at
        once, JSONL lines parsed one at a time); reading them to the end records the content fingerprint of the
        bytes read (:meth:`fingerprint_of_read`).

        Raises:
            ValueError: a file cannot be read, is not UTF-8 (naming the byte), has a bad JSONL line (naming the
                line), or no file holds a document.
        """
        self._read.pop("files", None)
        empty, contents = True, []
        for path in self._paths:
            digest = _ContentDigest()
            for records in _file_records(path, self._text_key, self._txt_documents, digest):
                empty = empty and not records
                yield from records
            contents.append((digest.size, digest.hexdigest()))
        if empty:
            raise InputValueError(f"corpus is empty: no non-blank lines in {', '.join(map(str, self._paths))}")
        self._read["files"] = self._files_fingerprint(contents)
