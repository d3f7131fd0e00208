"""The on-disk cache of tokenized corpora: flat arrays, written atomically, checked on load.

An entry ``<cache_dir>/<key>/`` holds ``token_ids.npy``, ``offsets.npy``, ``source_index.npy`` (plain
arrays, no pickle), ``labels.npy`` only for a corpus with masked tokens (prompt–completion records or
pre-tokenized labels; entries of plain corpora are unchanged), and ``meta.json`` (key, format, counts and the
sha256 of each array file); it loads as a :class:`~lit_balance.data.stores.TokenizedCorpus` over a
:class:`~lit_balance.data.stores.FlatStore` of the memory-mapped arrays, a store like any other. The key
hashes the corpus content (for files, their bytes: :meth:`CorpusSource.content_fingerprint`) with the
tokenizer's fingerprint, so an edit that keeps a file's size and mtime still rebuilds.

Building streams: the corpus is read in chunks (:meth:`CorpusSource.iter_chunks`, files in blocks of lines),
each chunk is tokenized with one call in an encoding thread (:meth:`TokenizerAdapter.encode_batch_deferred`),
turned into one int32 array of all its ids while the next chunk is tokenized, and appended to the array files;
the ``.npy`` headers are completed at the end, so memory stays bounded by a chunk whatever the size of the
corpus. The files are the ones ``np.save`` writes for the whole
arrays. Corpus files are hashed once for the key; the bytes read for tokenizing are hashed as they are read
(:meth:`CorpusSource.fingerprint_of_read`), and a build whose files changed in between is not cached.

An entry is written into a temporary directory ``.tmp-<key>-<pid>-<random>`` inside ``cache_dir`` and
renamed into place, so concurrent processes never read a half-written entry; a stale or corrupt entry is
detected, set aside (``.trash-*``) and rebuilt. Directories and files are created with mode ``0o777`` /
``0o666`` less the umask, so under ``umask 002`` a group can share one cache.

Leftovers of killed builds are removed at the start of the next build in the same ``cache_dir``:

* each temporary directory has a lock file beside it (``<name>.lock``) that its build holds with
  ``flock`` until it ends; the operating system releases the lock when the process dies, so a
  temporary directory whose lock can be taken belongs to a dead build and is removed, and one whose lock
  is held (a live build, on this or, over NFS, another machine) is left alone;
* a temporary directory without a lock file (written by an older version, or where ``flock`` is not
  available) is removed once it is older than a day;
* a ``.trash-*`` directory (an entry set aside whose removal was interrupted) is removed once it is older
  than a minute (younger ones may still be moved back by the process that set them aside).
"""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from lit_balance._fingerprint import sha256_of as _sha256
from lit_balance._fingerprint import sha256_of_stream
from lit_balance.data.cache_space import FULL, cache_dir_error
from lit_balance.data.records import IGNORE_INDEX, encode_chunk_deferred
from lit_balance.data.sources import CorpusChunk, CorpusSource
from lit_balance.data.stores.corpus import TokenizedCorpus
from lit_balance.data.tokenizer import TokenizerAdapter
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["TokenizedCorpus", "build_cache", "cache_key", "default_cache_dir", "load_cache", "load_or_build",
           "open_corpus"]

_CACHE_FORMAT = 1  # bump when the layout of a cache entry changes
_HASH_BLOCK = 1 << 22  # bytes read per update when hashing an entry's files
_IN_FLIGHT = 2  # chunks handed to the encoding thread ahead of the one converted and written
_ARRAYS = {"token_ids": np.int32, "offsets": np.int64, "source_index": np.int64}
_LABELS = "labels"  # the optional array: int32 [num_tokens], -100 where a token has no target
_TMP, _TRASH, _LOCK = ".tmp-", ".trash-", ".lock"
_UNLOCKED_TMP_MAX_AGE_S = 24 * 3600  # a temporary directory without a lock file is a leftover after this
_TRASH_MAX_AGE_S = 60  # a .trash-* directory is a leftover after this


def cache_key(source: CorpusSource, tokenizer: TokenizerAdapter) -> str:
    """Return the sha256 hex key of the cache entry for a corpus and tokenizer.

    For file corpora this reads (hashes) every file: see :meth:`CorpusSource.content_fingerprint`.

    Raises:
        RuntimeError: an ``IterableDataset`` corpus not read yet in this process (its key is the hash of its
            content; :func:`load_or_build` reads it first).
        TypeError: ``source`` or ``tokenizer`` is not a resolved object.
        ValueError: a corpus file cannot be read, or ``tokenizer.add_special_tokens`` is set for a
            token-id corpus (its ids are used as given).

    Example:
        >>> from lit_balance.data.sources import resolve_corpus
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> len(cache_key(resolve_corpus(["a"]), resolve_tokenizer()))
        64
    """
    _check_types(source, tokenizer)
    return _key(source, tokenizer, source.content_fingerprint())


def _key(source: CorpusSource, tokenizer: TokenizerAdapter, content: str) -> str:
    parts = ["cache", str(_CACHE_FORMAT), source.kind, content, tokenizer.fingerprint]
    if tokenizer.add_special_tokens:  # the default adds nothing, so existing cache keys stay valid
        parts.append("add_special_tokens")
    return _sha256(*parts)


def _key_of_read(source: CorpusSource, tokenizer: TokenizerAdapter) -> str:
    """The key of what the last complete read of the corpus saw: for files, their bytes as they were read (hashed
    while reading, no second pass); else as :func:`cache_key`."""
    read = source.fingerprint_of_read()
    return cache_key(source, tokenizer) if read is None else _key(source, tokenizer, read)


def default_cache_dir() -> Path:
    """Return ``$LIT_BALANCE_CACHE``, else ``$XDG_CACHE_HOME/lit_balance``, else ``~/.cache/lit_balance``.

    Example:
        >>> isinstance(default_cache_dir(), Path)
        True
    """
    if os.environ.get("LIT_BALANCE_CACHE"):
        return Path(os.environ["LIT_BALANCE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lit_balance"
    return Path.home() / ".cache" / "lit_balance"


def _check_types(source: Any, tokenizer: Any) -> None:
    if not isinstance(source, CorpusSource):
        raise InputTypeError(f"source must be a CorpusSource (from resolve_corpus), got {type(source).__name__}")
    if not isinstance(tokenizer, TokenizerAdapter):
        raise InputTypeError(f"tokenizer must be a TokenizerAdapter (from resolve_tokenizer), "
                             f"got {type(tokenizer).__name__}")
    if tokenizer.add_special_tokens and source.holds_token_ids:
        raise InputValueError("add_special_tokens=True applies to text corpora only: a token-id corpus is used as "
                              "given, "
                              "so add the special ids to each document yourself, or leave add_special_tokens=False")


def _array_sha256(path: Path) -> str:
    """sha256 hex digest of an array file of an entry, read in blocks of ``_HASH_BLOCK`` bytes."""
    with open(path, "rb") as handle:
        return sha256_of_stream(handle, _HASH_BLOCK)[1]


def _check_ids(flat: np.ndarray, sizes: np.ndarray, start: int, vocab_size: int, what: str,
               ignore: bool = False) -> None:
    """Raise naming the first document with a value outside ``[0, vocab_size)`` (or -100 when ``ignore``)."""
    if not flat.size or (flat.min() >= 0 and flat.max() < vocab_size):
        return
    bad_mask = (flat < 0) | (flat >= vocab_size)
    if ignore:
        bad_mask &= flat != IGNORE_INDEX
    if bad_mask.any():
        first = int(np.flatnonzero(bad_mask)[0])
        doc = start + int(np.searchsorted(np.cumsum(sizes), first, side="right"))
        allowed = f"[0, vocab_size={vocab_size})" + (" or -100" if ignore else "")
        raise InputValueError(f"document {doc} holds the {what} {int(flat[first])}, outside {allowed}; pass a "
                              "tokenizer or "
                              "vocab_size that covers it")


class _NpyAppender:
    """A 1-D ``.npy`` file written by appending values; the length in its header is filled in by :meth:`close`.

    numpy leaves room in the header of a 1-D array for a length of up to 21 digits (so that the header can be
    rewritten in place), so the header written first for length 0 is as long as the final one, and the closed
    file is byte for byte what ``np.save`` writes for the whole array.
    """

    def __init__(self, path: Path, dtype: Any) -> None:
        self._dtype = np.dtype(dtype)
        self._count = 0
        self._file = open(path, "wb")  # mode 0o666 less the umask, like np.save
        self._header_len = self._file.write(self._header(0))

    def _header(self, length: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(self._dtype),
                                                       "fortran_order": False, "shape": (length,)})
        return buffer.getvalue()

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self._dtype).data)
        self._count += len(values)

    def flush(self) -> None:
        """Write what was appended so far through to the file (it can then be read back)."""
        self._file.flush()

    def close(self) -> int:
        """Write the final header, close the file and return the array's length."""
        try:
            header = self._header(self._count)
            if len(header) != self._header_len:
                raise RuntimeError(f"the .npy header for {self._count} values is {len(header)} bytes, not the "
                                   f"{self._header_len} reserved; this numpy version cannot append in place")
            self._file.seek(0)
            self._file.write(header)
        finally:
            self._file.close()
        return self._count


def _tokenized_chunks(source: CorpusSource, tokenizer: TokenizerAdapter
                      ) -> Iterator[tuple[CorpusChunk, np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield each chunk with its tokens per document, token ids and labels (or None) as flat arrays
    (:func:`lit_balance.data.records.encode_chunk_flat`), the tokenizer running up to ``_IN_FLIGHT`` chunks ahead in
    one thread.

    ``encode_batch`` of a ``tokenizers`` tokenizer releases the GIL and runs on its own thread pool; turning its
    output into Python ids holds the GIL. So the encoding thread only runs the tokenizer
    (:func:`encode_chunk_deferred`) and this thread converts each chunk's output into one int32 array (no list
    or array per document), reads the corpus and writes the arrays, while the tokenizer works on the next
    chunks. At most ``_IN_FLIGHT + 2`` chunks are alive (the one converted, ``_IN_FLIGHT`` encoded or waiting
    for the thread, the one just read).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit_balance-encode") as pool:
        pending: deque[tuple[CorpusChunk, Future]] = deque()
        try:
            for chunk in source.iter_chunks():
                # submitted before the oldest is waited for: the thread takes it as soon as it is free
                pending.append((chunk, pool.submit(encode_chunk_deferred, chunk, tokenizer)))
                if len(pending) > _IN_FLIGHT:
                    done, future = pending.popleft()
                    yield done, *_encoded(done, future)
            while pending:
                done, future = pending.popleft()
                yield done, *_encoded(done, future)
        finally:
            for _, future in pending:
                future.cancel()


def _encoded(chunk: CorpusChunk, future: Future) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The flat arrays of a chunk the encoding thread tokenized; a text that is not valid Unicode (a lone surrogate,
    which no tokenizer takes) raises naming its document."""
    try:
        return future.result()()
    except TypeError as error:
        texts = chunk.texts if chunk.texts is not None else [p + c for p, c in chunk.pairs or ()]
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as bad:
                raise InputValueError(
                    f"document {chunk.start + i} of the corpus is not valid Unicode text: it holds "
                    f"{text[bad.start:bad.end]!r} at character {bad.start} (a lone surrogate, e.g. from a JSON "
                    "\\ud800 escape), which cannot be tokenized; fix or drop that document") from error
        raise


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (restored after it, if it was on).

    Tokenizing allocates a few container objects per document (parsed records, the tokenizer's encodings, lists
    of ids) that live for one chunk and form no cycles, so reference counting frees them all. Each automatic
    collection they trigger still traverses the objects of the younger generations, and the main thread's share
    of a build that keeps every core encoding was measured about a quarter lower without them.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _backfill_labels(entry: Path, count: int) -> _NpyAppender:
    """Start ``labels.npy`` with the first ``count`` token ids already written (documents whose every token is a
    target), copied in blocks from ``token_ids.npy``."""
    writer = _NpyAppender(entry / f"{_LABELS}.npy", np.int32)
    with open(entry / "token_ids.npy", "rb") as handle:
        np.lib.format.read_magic(handle)
        np.lib.format.read_array_header_1_0(handle)
        left = count
        while left:
            block = np.frombuffer(handle.read(min(left, _HASH_BLOCK) * 4), dtype="<i4")
            writer.append(block)
            left -= len(block)
    return writer


def _tokenize_into(entry: Path, source: CorpusSource, tokenizer: TokenizerAdapter,
                   progress: bool) -> tuple[int, int, int, bool]:
    """Tokenize ``source`` chunk by chunk, appending to the array files in ``entry``.

    ``labels.npy`` is written only once a chunk has masked labels; the tokens before it are its labels then.

    Returns:
        ``(documents read, documents kept, tokens, whether labels.npy was written)``.
    """
    writers = {name: _NpyAppender(entry / f"{name}.npy", dtype) for name, dtype in _ARRAYS.items()}
    writers["offsets"].append(np.zeros(1, dtype=np.int64))
    num_docs = num_kept = num_tokens = 0
    bar, started = None, time.perf_counter()
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=source.num_documents, unit="doc", desc=f"Tokenizing {source.description}")
    try:
        with _collector_paused(), closing(_tokenized_chunks(source, tokenizer)) as chunks:
            for chunk, sizes, flat, labels in chunks:
                if chunk.start != num_docs:
                    raise RuntimeError(f"the corpus ({source.description}) yielded a chunk starting at document "
                                       f"{chunk.start} after {num_docs} documents; chunks must be consecutive")
                _check_ids(flat, sizes, num_docs, tokenizer.vocab_size, "token id")
                if labels is not None:
                    _check_ids(labels, sizes, num_docs, tokenizer.vocab_size, "label", ignore=True)
                    if _LABELS not in writers:
                        writers["token_ids"].flush()
                        writers[_LABELS] = _backfill_labels(entry, num_tokens)
                kept = np.flatnonzero(sizes)
                writers["token_ids"].append(flat)
                if _LABELS in writers:
                    writers[_LABELS].append(flat if labels is None else labels)
                writers["offsets"].append(np.cumsum(sizes[kept]) + num_tokens)
                writers["source_index"].append(kept + num_docs)
                num_docs, num_kept, num_tokens = num_docs + len(chunk), num_kept + len(kept), num_tokens + len(flat)
                if bar is not None:
                    rate = num_tokens / max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(f"{num_tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)
                    bar.update(len(chunk))
    finally:
        failed = None
        for writer in writers.values():  # every file closed, also when one fails (a full cache_dir)
            try:
                writer.close()
            except OSError as error:
                failed = failed or error
        if bar is not None:
            bar.close()
        if failed is not None and sys.exc_info()[0] is None:  # else the error in flight goes on
            raise failed
    return num_docs, num_kept, num_tokens, _LABELS in writers


def build_cache(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike,
                *, progress: bool = False) -> Path:
    """Tokenize a corpus and write it atomically as the cache entry ``<cache_dir>/<key>/``.

    The entry (``token_ids.npy``, ``offsets.npy``, ``source_index.npy``, ``meta.json``) is written to
    a temporary directory inside ``cache_dir`` and renamed into place; if another process placed a
    valid entry first, this one is discarded. The temporary directory is created before tokenizing, so
    a ``cache_dir`` that cannot be written fails at once; leftovers of killed builds are removed first
    (see the module docstring). Documents empty after tokenization are dropped and counted. An
    ``IterableDataset`` corpus not read before in this process is read once here; its key (the hash of its
    content) is known at the end, and an entry already placed under it is kept.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer` (for token-id corpora it only
            supplies ``vocab_size`` and ``pad_token_id``).
        cache_dir: directory holding cache entries (created if missing).
        progress: show a progress bar: documents, documents per second, tokens and tokens per second.

    Returns:
        The entry directory.

    Raises:
        ValueError: ``cache_dir`` cannot be created or written (before tokenizing; the message names
            ``cache_dir`` and ``LIT_BALANCE_CACHE``), every document is empty after tokenization, a token
            id is outside the vocabulary, or the corpus cannot be read.
        TypeError: ``source`` or ``tokenizer`` is not a resolved object.
        RuntimeError: the corpus files changed while they were tokenized.

    Example:
        >>> from lit_balance.data.sources import resolve_corpus
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> entry = build_cache(resolve_corpus(["hello world"]), resolve_tokenizer(), getfixture("tmp_path"))
        >>> sorted(p.name for p in entry.iterdir())
        ['meta.json', 'offsets.npy', 'source_index.npy', 'token_ids.npy']
    """
    _check_types(source, tokenizer)
    after_reading = source.key_after_reading  # an IterableDataset: its key is the hash of what it yields
    return _build(source, tokenizer, Path(cache_dir), None if after_reading else cache_key(source, tokenizer),
                  progress)


def _build(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: Path, key: str | None,
           progress: bool) -> Path:
    """:func:`build_cache` with the key already known (None: learnt by reading an ``IterableDataset``)."""
    # before tokenizing: a cache_dir that is not writable fails now
    tmp, lock_fd = _start_entry(cache_dir, key or "iterable" + os.urandom(8).hex())
    try:
        return _build_into(tmp, source, tokenizer, cache_dir, key, progress)
    except OSError as error:
        if error.errno in FULL:  # a full cache_dir (a read-only one fails above): named, with the bytes it took
            raise _not_writable(cache_dir, error, written=_bytes_in(tmp)) from error
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _release(tmp, lock_fd)


def _build_into(tmp: Path, source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: Path, key: str | None,
                progress: bool) -> Path:
    """Tokenize into ``tmp`` and move it into place as the entry ``key`` (learnt by reading when None)."""
    after_reading = key is None
    _remove_leftovers(cache_dir)
    num_docs, num_kept, num_tokens, has_labels = _tokenize_into(tmp, source, tokenizer, progress)
    if after_reading:
        key = cache_key(source, tokenizer)
        if _read_entry(cache_dir / key, key, tokenizer) is not None:
            return cache_dir / key  # built before from the same content
    elif _key_of_read(source, tokenizer) != key:
        raise RuntimeError(f"the corpus ({source.description}) changed while it was tokenized; run again once it "
                           "no "
                           f"longer changes (its identity, {type(source).__qualname__}.identity() and for files "
                           "their "
                           "content, differs before and after reading it)")
    if not num_kept:
        raise InputValueError(f"all {num_docs} documents of the corpus ({source.description}) are empty after "
                              "tokenization")
    target = cache_dir / key
    names = [*_ARRAYS, *([_LABELS] if has_labels else [])]
    digests = {f"{name}.npy": _array_sha256(tmp / f"{name}.npy") for name in names}
    meta = {"key": key, "format": _CACHE_FORMAT, "num_docs": num_kept, "num_tokens": num_tokens,
            "num_empty": num_docs - num_kept, "vocab_size": tokenizer.vocab_size,
            "pad_token_id": tokenizer.pad_token_id, "description": source.description, "sha256": digests}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    for _ in range(3):
        try:
            os.replace(tmp, target)
            return target
        except OSError:
            try:
                inode = target.stat().st_ino
            except OSError:
                continue  # removed meanwhile: try again
            if _read_entry(target, key, tokenizer) is not None:
                return target  # another process won the race with a valid entry
            _discard(target, inode)
    raise RuntimeError(f"could not place the cache entry {str(target)!r}; check permissions of {str(cache_dir)!r}")


def _not_writable(cache_dir: Path, error: OSError, written: int | None = None) -> InputValueError:
    return cache_dir_error(cache_dir, error, what="the tokenized corpus", written=written,
                           rule="takes 4 bytes per token (8 with labels) and 16 per document (known once tokenized)")


def _bytes_in(folder: Path) -> int:
    """Bytes of the files directly in ``folder`` (0 when it is gone)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
    except OSError:
        return 0


def _start_entry(cache_dir: Path, key: str) -> tuple[Path, int | None]:
    """Create ``cache_dir`` if needed, a locked ``.tmp-*.lock`` file and the temporary directory beside it.

    The lock is held until :func:`_release`; see the module docstring for how leftovers are told apart.
    """
    for _ in range(3):
        tmp = cache_dir / f"{_TMP}{key[:16]}-{os.getpid()}-{os.urandom(4).hex()}"
        lock_path = tmp.with_name(tmp.name + _LOCK)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as error:
            raise _not_writable(cache_dir, error) from error
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # a cleaner may have taken and removed the new lock file before flock: then start again
                if os.fstat(fd).st_ino != os.stat(lock_path).st_ino:
                    raise FileNotFoundError(lock_path)
            os.mkdir(tmp, 0o777)  # the umask applies, as for the files written into it
            return tmp, fd
        except FileNotFoundError:
            os.close(fd)
            continue
        except OSError as error:
            _release(tmp, fd)
            raise _not_writable(cache_dir, error) from error
    raise RuntimeError(f"could not create a temporary directory in cache_dir {str(cache_dir)!r}: its lock files "
                       "keep disappearing; is another program cleaning that directory?")


def _release(tmp: Path, fd: int | None) -> None:
    try:
        os.unlink(tmp.with_name(tmp.name + _LOCK))
    except OSError:
        pass
    if fd is not None:
        os.close(fd)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def _abandoned(lock_path: Path, tmp: Path) -> tuple[bool, int | None]:
    """Whether the build of ``tmp`` is dead; if so, also the descriptor holding its lock (or None)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return _age_s(tmp) > _UNLOCKED_TMP_MAX_AGE_S, None
    except OSError:
        return False, None
    if fcntl is None:
        os.close(fd)
        return _age_s(tmp) > _UNLOCKED_TMP_MAX_AGE_S, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False, None  # held: a live build
    return True, fd


def _remove_leftovers(cache_dir: Path) -> None:
    """Remove temporary and trash directories of killed builds (never those of a live build)."""
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return
    present = set(names)
    for name in names:
        path = cache_dir / name
        if name.startswith(_TRASH):
            if _age_s(path) > _TRASH_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(_TMP) and name.endswith(_LOCK):
            if name[: -len(_LOCK)] not in present:  # a lock file whose directory is gone
                dead, fd = _abandoned(path, path)
                if dead and fd is not None:
                    _release(path.with_name(name[: -len(_LOCK)]), fd)
        elif name.startswith(_TMP):
            dead, fd = _abandoned(path.with_name(name + _LOCK), path)
            if dead:
                shutil.rmtree(path, ignore_errors=True)
                if fd is not None:
                    _release(path, fd)


def _discard(entry: Path, inode: int) -> None:
    # Move the entry aside first so that a valid entry placed meanwhile by another process survives.
    trash = entry.with_name(f".trash-{entry.name[:16]}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    try:
        moved = trash.stat().st_ino
    except OSError:
        return
    if moved != inode:
        try:
            os.rename(trash, entry)  # not the entry found broken: put it back
            return
        except OSError:
            pass
    shutil.rmtree(trash, ignore_errors=True)


def _read_entry(entry: Path, key: str, tokenizer: TokenizerAdapter) -> TokenizedCorpus | None:
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta["key"] != key or meta["format"] != _CACHE_FORMAT:
            return None
        if (meta["vocab_size"], meta["pad_token_id"]) != (tokenizer.vocab_size, tokenizer.pad_token_id):
            return None
        arrays = {}
        for name in (*_ARRAYS, *([_LABELS] if f"{_LABELS}.npy" in meta["sha256"] else [])):
            path = entry / f"{name}.npy"
            if _array_sha256(path) != meta["sha256"][f"{name}.npy"]:
                return None
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        corpus = TokenizedCorpus(num_empty=int(meta["num_empty"]), vocab_size=tokenizer.vocab_size,
                                 pad_token_id=tokenizer.pad_token_id, **arrays)
        if (len(corpus), corpus.num_tokens) != (meta["num_docs"], meta["num_tokens"]):
            return None
        return corpus
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_cache(source: CorpusSource, tokenizer: TokenizerAdapter,
               cache_dir: str | os.PathLike | None) -> TokenizedCorpus | None:
    """Load the cache entry of a corpus and tokenizer, or None if it is missing or broken.

    Broken entries (unreadable or mismatching ``meta.json``, checksum mismatch, arrays of the wrong
    dtype or shape, inconsistent offsets) are removed.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer`.
        cache_dir: directory holding cache entries (None: :func:`default_cache_dir`).

    Returns:
        The tokenized corpus (read-only memory-mapped arrays), or None.

    Raises:
        TypeError: ``source`` or ``tokenizer`` is not a resolved object.

    Example:
        >>> from lit_balance.data.sources import resolve_corpus
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> load_cache(resolve_corpus(["never built"]), resolve_tokenizer(), getfixture("tmp_path")) is None
        True
    """
    key = cache_key(source, tokenizer)
    return _load(Path(cache_dir if cache_dir is not None else default_cache_dir()), key, tokenizer)


def _load(cache_dir: Path, key: str, tokenizer: TokenizerAdapter) -> TokenizedCorpus | None:
    """:func:`load_cache` with the key already known."""
    entry = cache_dir / key
    try:
        inode = entry.stat().st_ino
    except OSError:
        return None
    corpus = _read_entry(entry, key, tokenizer)
    if corpus is None:
        _discard(entry, inode)
    return corpus


def load_or_build(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike | None = None,
                  *, progress: bool = False) -> TokenizedCorpus:
    """Load the cached tokenized corpus, building the entry first if needed.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer`.
        cache_dir: directory holding cache entries (None: :func:`default_cache_dir`).
        progress: show a progress bar while tokenizing.

    Returns:
        The tokenized corpus.

    Raises:
        ValueError: see :func:`build_cache`.
        RuntimeError: the entry cannot be read back after building it.

    Example:
        >>> from lit_balance.data.sources import resolve_corpus
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> corpus = load_or_build(resolve_corpus(["hello world", ""]), resolve_tokenizer(), getfixture("tmp_path"))
        >>> corpus.document(0).tolist(), corpus.num_empty
        ([7592, 2088], 1)
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _check_types(source, tokenizer)
    if source.key_after_reading:  # an IterableDataset: read it once, into the cache, to learn its key
        build_cache(source, tokenizer, cache_dir, progress=progress)
    key = cache_key(source, tokenizer)  # files are hashed once here; a build checks what it read against it
    corpus = _load(cache_dir, key, tokenizer)
    for _ in range(2):
        if corpus is not None:
            return corpus
        _build(source, tokenizer, cache_dir, key, progress)
        corpus = _load(cache_dir, key, tokenizer)
    if corpus is None:
        raise RuntimeError(f"the cache entry for {source.description} in {str(cache_dir)!r} "
                           "cannot be read back after building it; check the disk and permissions")
    return corpus


def open_corpus(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike | None = None, *,
                progress: bool = False) -> TokenizedCorpus:
    """The tokenized corpus of ``source``: read in place when the source is a store
    (:meth:`~lit_balance.data.sources.CorpusSource.open_in_place`: nothing tokenized, written or copied), else the
    cache's entry (:func:`load_or_build`).

    Args:
        source: a :class:`~lit_balance.data.sources.CorpusSource`.
        tokenizer: the tokenizer (its ``vocab_size`` bounds the ids, its ``pad_token_id`` pads).
        cache_dir: the cache directory (unused for a store).
        progress: show a progress bar while tokenizing.
    """
    corpus = source.open_in_place(tokenizer)
    return corpus if corpus is not None else load_or_build(source, tokenizer, cache_dir, progress=progress)
