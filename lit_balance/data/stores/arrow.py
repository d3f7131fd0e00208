"""Arrow and Parquet files with an ``input_ids`` list column, read in place: :class:`ArrowSource`, :class:`ArrowStore`.

Accepted inputs (several make one corpus, in the order given, :class:`~lit_balance.data.stores.MultiFileStore`): a
``datasets.Dataset.save_to_disk`` directory (its ``state.json`` lists the ``.arrow`` files); ``.arrow`` / ``.feather``
/ ``.ipc`` files in Arrow IPC (stream or file format, uncompressed); ``.parquet`` files, read through an Arrow IPC copy
written once (:func:`~lit_balance.data.stores.parquet.parquet_as_arrow`).

Arrow IPC files are memory-mapped with pyarrow: a document's length is the difference of two list offsets (the
lengths read the offsets buffer only), its tokens a slice of the values buffer, read when its micro-batch is built.
The ``labels`` column, when present (or named by ``labels=``), gives unshifted labels, ``-100`` for no target.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.data.stores._checks import check_label_lengths, check_list_type, check_list_values, import_pyarrow
from lit_balance.data.stores._files import FileStamp, expand_dataset_files
from lit_balance.data.stores.corpus import check_labels
from lit_balance.data.stores.multifile import MultiFileStore, StoreFile
from lit_balance.data.stores.parquet import parquet_as_arrow
from lit_balance.data.stores.source import StoreSource, path_list
from lit_balance.data.tokenizer_identity import schema_tokenizer
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["ArrowSource", "ArrowStore"]

_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


class _Mapped:
    """An Arrow IPC file memory-mapped in this process: its columns' chunks, checked against its stamp."""

    def __init__(self, path: str, column: str, labels: str | None, stamp: FileStamp) -> None:
        pa = import_pyarrow()
        self.stamp, self.fd = stamp, os.open(path, os.O_RDONLY)
        stamp.check(os.fstat(self.fd))
        try:
            with open(path, "rb") as stream:
                is_file_format = stream.read(6) == b"ARROW1"
            source = pa.memory_map(path, "r")
            self.table = (pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)).read_all()
        except (pa.ArrowInvalid, OSError) as error:
            raise InputValueError(f"{path} cannot be read as an Arrow IPC file: {error}", parameter="corpus") from None
        names = self.table.column_names
        self.ids = self.table.column(column).chunks if column in names else None
        self.labels = self.table.column(labels).chunks if labels is not None and labels in names else None
        self.chunk_starts = np.cumsum([0, *(len(c) for c in self.ids or [])]).astype(np.int64)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (AttributeError, OSError):
            pass


class ArrowFile(StoreFile):
    """One Arrow IPC file (or a Parquet file, through its Arrow copy): lengths from the list offsets."""

    def __init__(self, path: str, column: str, labels: str | None, cache_dir: Path | None) -> None:
        pa = import_pyarrow()
        self.name, self.stamp, self.column, self.labels_column = path, FileStamp(path), column, labels
        self.mapped = parquet_as_arrow(pa, path, self.stamp, column, labels, cache_dir) if path.endswith(".parquet") \
            else path
        self.mapped_stamp = self.stamp if self.mapped == path else FileStamp(self.mapped)
        arrow = _Mapped(self.mapped, column, labels, self.mapped_stamp)
        if arrow.ids is None:
            raise InputValueError(f"{path} has no {column!r} column (its columns: {arrow.table.column_names}); a "
                                  "tokenized Arrow / Parquet store holds the token ids of each document in a list "
                                  "column: name it with column=", parameter="column")
        kind = check_list_type(pa, arrow.table.schema.field(column), path, column)
        check_list_values(pa, arrow.table.column(column), path, column)
        parts = [np.diff(chunk.offsets.to_numpy()).astype(np.int64) for chunk in arrow.ids]
        self.lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if arrow.labels is not None:
            check_list_values(pa, arrow.table.column(labels), path, labels)
            check_list_type(pa, arrow.table.schema.field(labels), path, labels)
            label_lengths = [np.diff(c.offsets.to_numpy()) for c in arrow.labels]
            check_label_lengths(self.lengths, np.concatenate(label_lengths) if parts else self.lengths, path)
        self.dtype, self.has_labels = np.dtype(kind.value_type.to_pandas_dtype()), arrow.labels is not None
        self.tokenizer_identity = schema_tokenizer(arrow.table.schema.metadata)
        self._tokens = arrow  # kept for the first reads in this process

    def open_tokens(self) -> _Mapped:
        """Map the file in this process (the file given, a Parquet file too, checked against its stamp first)."""
        self.stamp.check()
        return _Mapped(self.mapped, self.column, self.labels_column if self.has_labels else None, self.mapped_stamp)

    @staticmethod
    def _slice(chunk: Any, row: int, length: int) -> np.ndarray:
        start = int(chunk.offsets[row].as_py())
        return np.array(chunk.values.slice(start, length).to_numpy(zero_copy_only=False))

    def read(self, local: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """A slice of the memory-mapped values; the files are checked against their stamps before every read (a
        mapped file that shrank would end the process with SIGBUS)."""
        arrow = self.tokens
        arrow.stamp.check(os.fstat(arrow.fd))
        if self.mapped != self.name:  # a Parquet file read through its copy: the file itself unchanged too
            self.stamp.check()
        chunk = int(np.searchsorted(arrow.chunk_starts, local, side="right")) - 1
        row = local - int(arrow.chunk_starts[chunk])
        ids = self._slice(arrow.ids[chunk], row, length)
        if not self.has_labels:
            return ids, None
        return ids, check_labels(self._slice(arrow.labels[chunk], row, length), f"row {local} of {self.name}")


class ArrowStore(MultiFileStore):
    """Arrow / Parquet files with an ``input_ids`` list column (optional ``labels``) as one corpus, read in place.

    Args:
        paths: files or ``save_to_disk`` directories (see the module docstring), in corpus order.
        column: the token-id list column.
        labels: the label list column: ``"labels"`` by default when the files have it; None for none.
        require_labels: refuse files without the ``labels`` column.
        cache_dir: where Parquet files' Arrow copies go (``<cache_dir>/parquet/``); None: the tokenization cache's
            root (``$LIT_BALANCE_CACHE``, else ``~/.cache/lit_balance``).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file without the ``column`` (naming the file and its columns), a column that is not a list of
            integers, a null row or a null value inside a list (naming the file and row), labels of another length
            than the ids, files that disagree on having labels, a file named twice.
        StoreChangedError: (on reading) a file whose size or modification time changed since the store was opened.
    """

    noun, title, shown = "row", "Arrow store", 2

    def __init__(self, paths: Sequence[str | os.PathLike], column: str = "input_ids",
                 labels: str | None = "labels", *, require_labels: bool = False,
                 cache_dir: str | os.PathLike | None = None) -> None:
        self.column, self.labels_column = column, labels
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        files = [ArrowFile(path, column, labels, self.cache_dir)
                 for path in expand_dataset_files(paths, (*_ARROW_SUFFIXES, ".parquet"))]
        have = [f.has_labels for f in files]
        if labels is not None and any(have) and not all(have):
            raise InputValueError(f"{files[have.index(False)].name} has no {labels!r} column but other files of the "
                                  "corpus do; give every file its labels, or pass labels=None", parameter="labels")
        if require_labels and not all(have):
            raise InputValueError(f"{files[have.index(False)].name} has no {labels!r} column (labels={labels!r} was "
                                  "asked for)", parameter="labels")
        for file in files:
            file.has_labels = all(have)
        super().__init__(files, np.result_type(*(f.dtype for f in files)))

    def identity(self) -> list[str]:
        """File names and sizes, the columns read, and the sha256 of the lengths (never the token values)."""
        return [*(f.identity() for f in self.files_opened), self.column,
                str(self.labels_column if self.has_labels else None), self.lengths_digest()]


class ArrowSource(StoreSource):
    """Arrow / Parquet files or a ``save_to_disk`` directory with an ``input_ids`` list column, read in place.

    The files say neither the vocabulary size nor the padding id: give ``vocab_size`` and ``pad_token_id`` (or a
    tokenizer) to the DataModule. Schema metadata may say the tokenizer (:mod:`lit_balance.data.tokenizer_identity`).

    Args:
        paths: one path or a list: ``.arrow`` / ``.feather`` / ``.ipc`` / ``.parquet`` files or ``save_to_disk``
            directories, in corpus order.
        column: the token-id list column (default ``"input_ids"``).
        labels: the label list column, read when the files have it (default ``"labels"``); None to ignore labels.
        cache_dir: where Parquet files are copied once as Arrow IPC (``<cache_dir>/parquet/``, memory-mapped and
            read at Arrow's speed); None: the tokenization cache's root (``$LIT_BALANCE_CACHE``, else
            ``~/.cache/lit_balance``).

    Raises:
        As :class:`ArrowStore`, when the store is first opened (at the DataModule's construction).

    Example:
        >>> dataset.save_to_disk("tokenized")  # doctest: +SKIP
        >>> BalancedTextDataModule(corpus=ArrowSource("tokenized"), vocab_size=32000, pad_token_id=0)  # doctest: +SKIP
    """

    kind = "arrow"

    def __init__(self, paths: Sequence[str | os.PathLike] | str | os.PathLike, column: str = "input_ids",
                 labels: str | None = "labels", cache_dir: str | os.PathLike | None = None) -> None:
        paths = path_list(paths)
        for name, value in (("column", column), ("labels", labels)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InputTypeError(f"{name} must be a column name (str), got {value!r}", parameter=name)
        if column is None:
            raise InputTypeError("column must name the token-id list column, got None", parameter="column")
        self.paths = [os.fspath(p) if isinstance(p, (str, os.PathLike)) else p for p in paths]
        self.column, self.labels = column, labels
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)

    def open_store(self) -> ArrowStore:
        """Map the files and read their lengths from the list offsets (a Parquet file: of its Arrow copy, written on
        the first opening)."""
        return ArrowStore(self.paths, self.column, self.labels, cache_dir=self.cache_dir)
