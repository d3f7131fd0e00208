"""The files of a store as they were when it was opened, and reads that notice when one changed since.

A store is read for days from files other tools wrote, often on shared file systems. :class:`FileStamp` records a
file's size and modification time when the store is opened (the DataModule's construction, before ``setup()``);
:class:`TokenFile` reads token ids with ``os.pread`` through a descriptor opened once per process (a DataLoader
worker opens its own) and compares the file with its stamp when it opens it and before every read
(``os.fstat``, well under a microsecond). A file rewritten, truncated or grown after the store was opened raises
:class:`StoreChangedError` naming it, before any of its tokens train; a file that shrinks under a read gives a short
read, never the ``SIGBUS`` a memory map would raise. :func:`expand_files` turns the paths a user gives (files,
folders, glob patterns) into a store's files (:func:`expand_dataset_files`: Arrow / Parquet files and
``save_to_disk`` directories), and :func:`check_distinct` refuses a file named twice.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["FileStamp", "StoreChangedError", "TokenFile", "check_distinct", "expand_dataset_files", "expand_files"]


class StoreChangedError(RuntimeError):
    """A file of a store changed on disk after the store was opened (its size or modification time differ)."""


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="microseconds")


class FileStamp:
    """A file's path, size (bytes) and modification time (ns) when the store opened it.

    Args:
        path: the file.
        stat: its ``os.stat_result`` when already taken (None: taken now).
    """

    __slots__ = ("mtime_ns", "path", "size")

    def __init__(self, path: str | os.PathLike, stat: os.stat_result | None = None) -> None:
        self.path = os.fspath(path)
        stat = os.stat(self.path) if stat is None else stat
        self.size, self.mtime_ns = int(stat.st_size), int(stat.st_mtime_ns)

    def __getstate__(self) -> tuple[str, int, int]:
        return self.path, self.size, self.mtime_ns

    def __setstate__(self, state: tuple[str, int, int]) -> None:
        self.path, self.size, self.mtime_ns = state

    def check(self, stat: os.stat_result | None = None) -> None:
        """Raise :class:`StoreChangedError` when the file's size or modification time is not the stamp's.

        Args:
            stat: the file's ``os.stat_result`` now (None: ``os.stat`` of the path; a missing file raises too).
        """
        if stat is None:
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                raise StoreChangedError(f"{self.path} was removed after the store was opened ({self.size} bytes "
                                        "then); restore it, or restart the run to plan from the store as it is "
                                        "now") from None
        size, mtime = int(stat.st_size), int(stat.st_mtime_ns)
        if size != self.size or mtime != self.mtime_ns:
            what = []
            if size != self.size:
                what.append(f"{self.size} bytes then, {size} now")
            if mtime != self.mtime_ns:
                what.append(f"modified at {_when(self.mtime_ns)} then, {_when(mtime)} now")
            raise StoreChangedError(f"{self.path} changed on disk after the store was opened ({'; '.join(what)}): "
                                    "its index and tokens no longer match the plan; stop writing to a store that a "
                                    "run reads, and restart the run to plan from the store as it is now")


class TokenFile:
    """A flat file of fixed-size values (token ids, loss-mask bytes) read by slices with ``os.pread``.

    ``file[start:stop]`` returns a NumPy array of ``dtype`` (a copy). The descriptor is opened on first read in each
    process (after a fork or unpickling too) and the file checked against its stamp then and before every read.

    Args:
        stamp: the file's stamp when the store was opened.
        dtype: the values' NumPy dtype.

    Raises:
        StoreChangedError: (on reading) the file changed since the stamp.
        ValueError: (on reading) a read returned fewer bytes than the stamp's size promises.
    """

    def __init__(self, stamp: FileStamp, dtype: Any) -> None:
        self.stamp = stamp
        self.dtype = np.dtype(dtype)
        self._fd: int | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"stamp": self.stamp, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["stamp"], state["dtype"])

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass

    def __len__(self) -> int:
        return self.stamp.size // self.dtype.itemsize

    def _descriptor(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:  # first read in this process (a forked worker opens its own)
            self.stamp.check()
            self._fd, self._pid = os.open(self.stamp.path, os.O_RDONLY), pid
        self.stamp.check(os.fstat(self._fd))
        return self._fd

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a TokenFile is read by contiguous slices, got {key!r}")
        start, stop, _ = key.indices(len(self))
        return self.read_at(start * self.dtype.itemsize, max(stop - start, 0))

    def read_at(self, offset: int, count: int, dtype: Any = None) -> np.ndarray:
        """``count`` values of ``dtype`` (default: the file's) from byte ``offset`` (a copy)."""
        out = np.empty(count, dtype=self.dtype if dtype is None else dtype)
        if count == 0:
            return out
        fd = self._descriptor()
        view, done = memoryview(out).cast("B"), 0
        while done < out.nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self.stamp.path} ends at byte {offset + done}, before the {out.nbytes} bytes "
                                 f"from byte {offset} the store's index promises: the file was truncated after the "
                                 "store was opened")
            done += got
        return out


def check_distinct(paths: list[str], what: str, parameter: str) -> None:
    """Raise a ValueError when two of ``paths`` are the same file (same resolved path, or same device and inode).

    Args:
        paths: the store's files as given or expanded.
        what: the store, for the message (e.g. ``"Megatron store"``).
        parameter: the setting that names the files.
    """
    seen: dict[tuple[int, int] | str, str] = {}
    for path in paths:
        try:
            stat = os.stat(path)
            key: tuple[int, int] | str = (stat.st_dev, stat.st_ino)
        except OSError:
            key = os.path.realpath(path)
        if key in seen:
            same = "" if seen[key] == path else f" (as {seen[key]!r})"
            raise InputValueError(f"{what}: {path!r} is named twice{same}; every document would train twice per "
                                  "epoch. Name each file once", parameter=parameter)
        seen[key] = path


def _check_orphans(folder: Path, found: list[Path], suffix: str, sidecars: tuple[str, ...], what: str) -> None:
    """Raise when a sidecar (e.g. ``.ds.index``) in ``folder`` names a token file that is not there (a copy or a run
    interrupted halfway: its documents would silently not train)."""
    present = {p.name for p in found}
    for sidecar in sidecars:
        orphans = sorted(p for p in folder.glob(f"*{sidecar}") if p.name[: -len(sidecar)] + suffix not in present)
        if orphans and found:
            names = ", ".join(p.name for p in orphans[:3]) + (f" and {len(orphans) - 3} more" if len(orphans) > 3
                                                                else "")
            missing = orphans[0].name[: -len(sidecar)] + suffix
            verb = "names" if len(orphans) == 1 else "name"
            raise InputFileNotFoundError(f"{what} folder {str(folder)!r}: {names} {verb} a token file that is missing "
                                         f"({missing}); the store is incomplete (an interrupted copy or "
                                         "tokenization). Copy or tokenize it again, or remove the leftover files to "
                                         "train on the other files only", parameter="paths")


def expand_files(paths: Sequence[str | os.PathLike], *, suffix: str, what: str, sidecars: tuple[str, ...] = (),
                 hint: str = "") -> list[Path]:
    """The token files named by ``paths`` (files, folders, glob patterns), in the order given, each folder's and
    pattern's sorted by name; a folder's sidecars (``sidecars``, the first the index) must each have their file.

    Args:
        paths: what the user gave (the ``paths`` setting).
        suffix: the token files' suffix (e.g. ``".ds"``).
        what: the store, for messages (e.g. ``"datatrove store"``).
        sidecars: suffixes of files beside a token file (e.g. ``(".ds.index", ".ds.loss")``).
        hint: what to pass, said when a folder holds no token file and no index.

    Raises:
        FileNotFoundError: a path that does not exist, a folder or pattern without token files, an orphan sidecar.
        ValueError: a file without the suffix, a file named twice.
    """
    files: list[Path] = []
    for given in paths:
        text = os.path.expanduser(os.fspath(given))
        if glob.has_magic(text):
            found = sorted(Path(p) for p in glob.glob(text) if p.endswith(suffix) and os.path.isfile(p))
            if not found:
                raise InputFileNotFoundError(f"{what} pattern {text!r} matches no {suffix} file", parameter="paths")
        elif os.path.isdir(text):
            found = sorted(Path(text).glob(f"*{suffix}"))
            _check_orphans(Path(text), found, suffix, sidecars, what)
            if not found:
                index = sorted(Path(text).glob(f"*{sidecars[0]}")) if sidecars else []
                why = f": {index[0].name} has no {suffix} file beside it" if index else hint
                raise InputFileNotFoundError(f"{what} folder {text!r} holds no {suffix} file{why}", parameter="paths")
        elif os.path.isfile(text):
            if not text.endswith(suffix):
                raise InputValueError(f"{what} file {text!r} does not end in {suffix}; pass a {suffix} token file or "
                                      "the folder holding them", parameter="paths")
            found = [Path(text)]
        else:
            raise InputFileNotFoundError(f"{what} path {text!r} does not exist", parameter="paths")
        files.extend(found)
    names = [str(f.resolve()) for f in files]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InputValueError(f"{what} file {twice} is named twice by paths={list(map(str, paths))!r}; each file once",
                              parameter="paths")
    return files


def expand_dataset_files(paths: Sequence[str | os.PathLike], suffixes: tuple[str, ...]) -> list[str]:
    """The Arrow / Parquet files of ``paths`` in order: a ``datasets`` ``save_to_disk`` directory becomes the data files
    its ``state.json`` lists.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: a directory that is not a ``save_to_disk`` directory (or a saved ``DatasetDict``), a file
            without one of ``suffixes``, no file, a file named twice.
    """
    files: list[str] = []
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise InputTypeError(f"an Arrow / Parquet store is named by paths (str or os.PathLike), got "
                                 f"{type(path).__name__} {path!r:.80}", parameter="corpus")
        path = os.fspath(path)
        if os.path.isdir(path):
            state = os.path.join(path, "state.json")
            if os.path.isfile(os.path.join(path, "dataset_dict.json")):
                raise InputValueError(f"{path} is a saved DatasetDict; pass the directory of one split (e.g. "
                                      f"{os.path.join(path, 'train')!r})", parameter="corpus")
            if not os.path.isfile(state):
                raise InputValueError(f"{path} is a directory without a state.json: not a datasets.save_to_disk "
                                      "directory; pass it, or the .arrow / .parquet files themselves",
                                      parameter="corpus")
            with open(state, encoding="utf-8") as stream:
                names = [entry["filename"] for entry in json.load(stream).get("_data_files", [])]
            if not names:
                raise InputValueError(f"{state} lists no data file", parameter="corpus")
            files.extend(os.path.join(path, name) for name in names)
        elif not os.path.isfile(path):
            raise InputFileNotFoundError(f"Arrow / Parquet store: {path} does not exist", parameter="corpus")
        else:
            files.append(path)
    for file in files:
        if not os.path.isfile(file):
            raise InputFileNotFoundError(f"Arrow / Parquet store: {file} does not exist", parameter="corpus")
        if not file.endswith(suffixes):
            raise InputValueError(f"{file}: expected a {', '.join(suffixes[:-1])} or {suffixes[-1]} file (or a "
                                  "save_to_disk directory)", parameter="corpus")
    if not files:
        raise InputValueError("an Arrow / Parquet store needs at least one file", parameter="corpus")
    check_distinct(files, "Arrow / Parquet store", "corpus")
    return files
