"""Arrow and Parquet files with an ``input_ids`` list column, read in place: :class:`ArrowSource`, :class:`ArrowStore`.

Accepted inputs (several make one corpus, in the order given):

* a ``datasets.Dataset.save_to_disk`` directory: its ``state.json`` lists the ``.arrow`` files, in order;
* ``.arrow`` / ``.feather`` / ``.ipc`` files in Arrow IPC (stream format, as ``datasets`` writes, or file format,
  as ``pyarrow.ipc.new_file`` and Feather v2 write; uncompressed);
* ``.parquet`` files (``Dataset.to_parquet``, ``pyarrow.parquet.write_table``, Spark, Ray Data).

Arrow IPC files are memory-mapped with pyarrow: every document's length is the difference of two list offsets, so
the lengths read the offsets buffer only; a document's tokens are a slice of the values buffer, read when its
micro-batch is built. Parquet has no offsets buffer and decodes whole row groups, which shuffled micro-batches miss:
a Parquet file's ``input_ids`` (and ``labels``) columns are copied once, one row group at a time (bounded memory),
into an Arrow IPC file under ``<cache_dir>/parquet/`` (default: the tokenization cache's root), said on stderr, and
read from there exactly as an Arrow IPC file (the copy is reused while the Parquet file's path, size and
modification time stay the same). The ``labels`` column, when present (or named by ``labels=``), gives unshifted labels, ``-100`` where a
token has no target.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.data.stores._files import FileStamp, check_distinct
from lit_balance.data.stores.base import TokenStore
from lit_balance.data.stores.source import StoreSource
from lit_balance.data.stores.corpus import check_labels
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["ArrowSource", "ArrowStore"]

_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_PARQUET_COPY_FORMAT = 1  # bump when the layout of a Parquet file's Arrow copy changes


def _import_pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401  (list_value_length)
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:  # pragma: no cover - pyarrow comes with the test extra
        raise ImportError('reading Arrow / Parquet stores needs pyarrow: pip install "lit_balance[stores]"') from error
    return pa


def _expand(paths: Sequence[str | os.PathLike]) -> list[str]:
    """The Arrow / Parquet files of ``paths`` in order: a ``save_to_disk`` directory becomes its data files."""
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
        if not file.endswith((*_ARROW_SUFFIXES, ".parquet")):
            raise InputValueError(f"{file}: expected a .arrow, .feather, .ipc or .parquet file (or a save_to_disk "
                                  "directory)", parameter="corpus")
    if not files:
        raise InputValueError("an Arrow / Parquet store needs at least one file", parameter="corpus")
    check_distinct(files, "Arrow / Parquet store", "corpus")
    return files


def _check_values(pa: Any, lists: Any, path: str, column: str, first_row: int = 0) -> None:
    """Raise naming the file and row when a list of ``lists`` (an Arrow list array or chunked array) is null or
    holds a null value (free when there is none: Arrow keeps the null counts)."""
    chunks = lists.chunks if hasattr(lists, "chunks") else [lists]
    for chunk in chunks:
        if chunk.null_count:
            row = first_row + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputValueError(f"{path}: row {row} of {column!r} is null ({chunk.null_count} null rows in all); "
                                  "every document needs a list of ids (empty for an empty document)",
                                  parameter="corpus")
        flat = chunk.flatten()
        if flat.null_count:
            first = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
            row = first_row + int(pa.compute.list_parent_indices(chunk)[first].as_py())
            raise InputValueError(f"{path}: row {row} of {column!r} holds a null among its values ({flat.null_count} "
                                  "null values in all); a token id or label must be an integer (-100 for a label "
                                  "without target); fix the writer or drop the row", parameter="corpus")
        first_row += len(chunk)


def _list_type(pa: Any, field: Any, path: str, column: str) -> Any:
    kind = field.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise InputValueError(f"{path}: column {column!r} is {kind}, expected a list of integers (token ids)",
                              parameter="corpus")
    return kind


def _parquet_copy_dir(cache_dir: Path | None) -> Path:
    from lit_balance.data.cache import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "parquet"


def _parquet_as_arrow(pa: Any, path: str, stamp: FileStamp, column: str, labels: str | None,
                      cache_dir: Path | None) -> str:
    """The Arrow IPC copy of a Parquet file's ``column`` (and ``labels``) columns, written once and memory-mapped.

    Parquet has no offsets buffer and decodes by row group: a shuffled micro-batch touches many row groups, each
    decoded whole (measured: 300 times the time of the same ids in an Arrow IPC file, 200k documents in 8 row groups).
    The copy is written in one pass, a row group at a time (bounded memory), into ``<cache_dir>/parquet/`` (default:
    the tokenization cache's root, :func:`lit_balance.data.cache.default_cache_dir`) under a key of the file's path,
    size and modification time and the columns, so a changed file gets a new copy; concurrent processes (ranks)
    wait on a file lock and reuse the first one's copy. The columns are checked on the way (a null row or value).

    Returns:
        The copy's path.

    Raises:
        ValueError: the file is not Parquet, lacks ``column``, a column is not a list of integers, a null row or
            value, labels of another length than the ids (each naming the file and row).
    """
    import hashlib
    import sys
    import time
    import uuid

    from filelock import FileLock

    key = hashlib.sha256("\0".join([str(_PARQUET_COPY_FORMAT), os.path.realpath(path), str(stamp.size),
                                     str(stamp.mtime_ns), column, str(labels)]).encode()).hexdigest()[:32]
    folder = _parquet_copy_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{Path(path).stem}-{key}.arrow"
    if target.is_file():
        return str(target)
    with FileLock(str(target) + ".lock"):
        if target.is_file():  # another process (rank) wrote it while this one waited
            return str(target)
        try:
            parquet = pa.parquet.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as error:
            raise InputValueError(f"{path} cannot be read as a Parquet file: {error}", parameter="corpus") from None
        schema = parquet.schema_arrow
        if column not in schema.names:
            raise InputValueError(f"{path} has no {column!r} column (its columns: {schema.names}); a tokenized Arrow / "
                                  "Parquet store holds the token ids of each document in a list column: name it with "
                                  "column=", parameter="column")
        _list_type(pa, schema.field(column), path, column)
        columns = [column]
        if labels is not None and labels in schema.names:
            _list_type(pa, schema.field(labels), path, labels)
            columns.append(labels)
        out_schema = pa.schema([schema.field(c) for c in columns])
        started = time.perf_counter()
        print(f"lit_balance: converting the {columns} columns of {path} ({parquet.num_row_groups} row groups, "
              f"{parquet.metadata.num_rows:,} rows) once into the memory-mapped Arrow file {target}, for reads at "
              "Arrow's speed", file=sys.stderr, flush=True)
        partial = folder / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            first = 0
            with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, out_schema) as writer:
                for group in range(parquet.num_row_groups):  # one row group at a time: bounded memory
                    table = parquet.read_row_group(group, columns=columns)
                    for name in columns:
                        _check_values(pa, table.column(name), path, name, first)
                    if len(columns) == 2:
                        ids_lengths = pa.compute.list_value_length(table.column(column)).to_numpy()
                        label_lengths = pa.compute.list_value_length(table.column(labels)).to_numpy()
                        if not np.array_equal(ids_lengths, label_lengths):
                            row = first + int(np.flatnonzero(ids_lengths != label_lengths)[0])
                            raise InputValueError(f"{path}: row {row} has labels of another length than its token ids",
                                                  parameter="labels")
                    writer.write_table(table.cast(out_schema))
                    first += table.num_rows
            stamp.check()  # the Parquet file did not change while it was copied
            os.replace(partial, target)
        finally:
            if partial.exists():
                partial.unlink()
        print(f"lit_balance: wrote {target} ({target.stat().st_size:,} bytes) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
    return str(target)


class _ArrowFile:
    """One memory-mapped Arrow IPC file: its table (zero-copy over the map) and column chunks."""

    def __init__(self, path: str, column: str, labels: str | None, stamp: FileStamp | None = None) -> None:
        pa = _import_pyarrow()
        self.path = path
        self.stamp = FileStamp(path) if stamp is None else stamp
        self.fd = os.open(path, os.O_RDONLY)
        self.stamp.check(os.fstat(self.fd))
        source = pa.memory_map(path, "r")
        try:
            with open(path, "rb") as stream:
                is_file_format = stream.read(6) == b"ARROW1"
            reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
            table = reader.read_all()
        except (pa.ArrowInvalid, OSError) as error:
            raise InputValueError(f"{path} cannot be read as an Arrow IPC file: {error}", parameter="corpus") from None
        self.table = table
        self.ids = table.column(column).chunks if column in table.column_names else None
        self.labels = table.column(labels).chunks if labels is not None and labels in table.column_names else None
        sizes = [len(chunk) for chunk in self.ids] if self.ids is not None else []
        self.chunk_starts = np.cumsum([0, *sizes]).astype(np.int64)  # first row of each record batch

    def check(self) -> None:
        """Raise :class:`~lit_balance.data.stores._files.StoreChangedError` when the file changed since the store
        was opened (checked before every read: a mapped file that shrank would end the process with SIGBUS)."""
        self.stamp.check(os.fstat(self.fd))

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (AttributeError, OSError):
            pass


class ArrowStore(TokenStore):
    """Arrow / Parquet files with an ``input_ids`` list column (optional ``labels``) as one corpus, read in place.

    Args:
        paths: files or ``save_to_disk`` directories (see the module docstring), in corpus order.
        column: the token-id list column.
        labels: the label list column: ``"labels"`` by default when the files have it; None for none; a name that
            the files lack is a ValueError.
        require_labels: refuse files without the ``labels`` column.
        cache_dir: where Parquet files' Arrow copies go (``<cache_dir>/parquet/``); None: the tokenization cache's
            root (``$LIT_BALANCE_CACHE``, else ``~/.cache/lit_balance``).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file without the ``column`` (naming the file and its columns), a column that is not a list of
            integers, a null row or a null value inside a list (naming the file and row), labels of another length
            than the ids, files that disagree on having labels, a file named twice.
        StoreChangedError: (on reading) a file whose size or modification time changed since the store was opened
            (checked before every read, so a mapped file that shrank stops the run with this error, not SIGBUS).
    """

    process_local = ("_arrow",)

    def __init__(self, paths: Sequence[str | os.PathLike], column: str = "input_ids",
                 labels: str | None = "labels", *, require_labels: bool = False,
                 cache_dir: str | os.PathLike | None = None) -> None:
        pa = _import_pyarrow()
        self.files = _expand(paths)
        self.column, self.labels_column = column, labels
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        lengths, starts, dtypes, has_labels, sizes, stamps = [], [0], set(), [], [], []
        self._stamps = stamps
        self._mapped: list[str] = []  # the Arrow IPC file read for each file: itself, or a Parquet file's copy
        self._mapped_stamps: list[FileStamp] = []
        self._arrow: dict[int, _ArrowFile] | None = {}
        for k, path in enumerate(self.files):
            stamps.append(FileStamp(path))
            sizes.append(stamps[-1].size)
            mapped = _parquet_as_arrow(pa, path, stamps[-1], column, labels, self.cache_dir) \
                if path.endswith(".parquet") else path
            self._mapped.append(mapped)
            self._mapped_stamps.append(stamps[-1] if mapped == path else FileStamp(mapped))
            part, dtype, with_labels = self._arrow_lengths(pa, k, path)
            lengths.append(part)
            starts.append(starts[-1] + len(part))
            dtypes.add(dtype)
            has_labels.append(with_labels)
        if labels is not None and any(has_labels) and not all(has_labels):
            missing = [f for f, h in zip(self.files, has_labels) if not h]
            raise InputValueError(f"{missing[0]} has no {labels!r} column but other files of the corpus do; give every "
                                  "file its labels, or pass labels=None", parameter="labels")
        if require_labels and not all(has_labels):
            raise InputValueError(f"{self.files[has_labels.index(False)]} has no {labels!r} column (labels={labels!r} "
                                  "was asked for)", parameter="labels")
        self.has_labels = bool(has_labels) and all(has_labels)
        self._dtype = np.result_type(*dtypes)
        self._lengths = lengths[0] if len(lengths) == 1 else np.concatenate(lengths)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._sizes = sizes

    # -- opening ------------------------------------------------------------------------------------------------

    def _missing(self, path: str, names: list[str]) -> InputValueError:
        return InputValueError(f"{path} has no {self.column!r} column (its columns: {names}); a tokenized Arrow / "
                               f"Parquet store holds the token ids of each document in a list column: name it with "
                               "column=", parameter="column")

    def _arrow_lengths(self, pa: Any, k: int, path: str) -> tuple[np.ndarray, np.dtype, bool]:
        arrow = _ArrowFile(self._mapped[k], self.column, self.labels_column, self._mapped_stamps[k])
        if arrow.ids is None:
            raise self._missing(path, arrow.table.column_names)
        field = arrow.table.schema.field(self.column)
        kind = _list_type(pa, field, path, self.column)
        _check_values(pa, arrow.table.column(self.column), path, self.column)
        if arrow.labels is not None:
            _check_values(pa, arrow.table.column(self.labels_column), path, self.labels_column)
        parts = []
        for chunk in arrow.ids:
            offsets = chunk.offsets.to_numpy()
            parts.append(np.diff(offsets).astype(np.int64))
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if arrow.labels is not None:
            _list_type(pa, arrow.table.schema.field(self.labels_column), path, self.labels_column)
            label_lengths = np.concatenate([np.diff(c.offsets.to_numpy()) for c in arrow.labels]) if parts else lengths
            if not np.array_equal(label_lengths, lengths):
                row = int(np.flatnonzero(label_lengths != lengths)[0])
                raise InputValueError(f"{path}: row {row} has {int(label_lengths[row])} labels for "
                                      f"{int(lengths[row])} token ids; give one label per token", parameter="labels")
        self._arrow[k] = arrow
        return lengths, np.dtype(kind.value_type.to_pandas_dtype()), arrow.labels is not None

    # -- the interface ------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens per row (Arrow: from the list offsets; Parquet: computed once at opening)."""
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """The token-id dtype of the list values (the widest over the files)."""
        return self._dtype

    @property
    def description(self) -> str:
        """E.g. ``"Arrow store data-00000-of-00002.arrow, ... (1,000 documents)"``."""
        names = ", ".join(Path(f).name for f in self.files[:2]) + (", ..." if len(self.files) > 2 else "")
        return f"Arrow store {names} ({len(self._lengths):,} documents)"

    def _locate(self, doc: int) -> tuple[int, int]:
        k = int(np.searchsorted(self._starts, doc, side="right")) - 1
        return k, doc - int(self._starts[k])

    def where(self, doc: int) -> str:
        """E.g. ``"row 3 of /data/train.parquet"``."""
        k, row = self._locate(doc)
        return f"row {row} of {self.files[k]}"

    def _arrow_file(self, k: int) -> _ArrowFile:
        if self._arrow is None:
            self._arrow = {}
        if k not in self._arrow:  # first read in this process: the file given (a Parquet file too) is checked
            self._stamps[k].check()
            self._arrow[k] = _ArrowFile(self._mapped[k], self.column, self.labels_column if self.has_labels else None,
                                        self._mapped_stamps[k])
        return self._arrow[k]

    @staticmethod
    def _slice(chunk: Any, row: int, length: int) -> np.ndarray:
        start = int(chunk.offsets[row].as_py())
        return np.array(chunk.values.slice(start, length).to_numpy(zero_copy_only=False))

    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``length`` token ids (and labels) of row ``doc``: a slice of the memory-mapped values (of the
        Arrow IPC file, or of a Parquet file's Arrow copy)."""
        doc, length = self._check_read(doc, length)
        k, row = self._locate(doc)
        arrow = self._arrow_file(k)
        arrow.check()
        if self._mapped[k] != self.files[k]:  # a Parquet file read through its copy: the file itself unchanged too
            self._stamps[k].check()
        chunk_index = int(np.searchsorted(arrow.chunk_starts, row, side="right")) - 1
        local = row - int(arrow.chunk_starts[chunk_index])
        ids_chunk = arrow.ids[chunk_index]
        label_chunk = arrow.labels[chunk_index] if self.has_labels else None
        ids = self._slice(ids_chunk, local, length)
        labels = None
        if label_chunk is not None:
            labels = check_labels(self._slice(label_chunk, local, length), self.where(doc))
        return ids, labels

    def identity(self) -> list[str]:
        """File names and sizes, the columns read, and the sha256 of the lengths (never the token values)."""
        digest = hashlib.sha256(np.ascontiguousarray(self._lengths, dtype="<i8").tobytes()).hexdigest()
        files = [f"{Path(f).name}:{size}" for f, size in zip(self.files, self._sizes)]
        return [*files, self.column, str(self.labels_column if self.has_labels else None), digest]


class ArrowSource(StoreSource):
    """Arrow / Parquet files or a ``save_to_disk`` directory with an ``input_ids`` list column, read in place.

    The files say neither the vocabulary size nor the padding id: give ``vocab_size`` and ``pad_token_id`` (or a
    tokenizer) to the DataModule.

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
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not isinstance(paths, Sequence) or not paths:
            raise InputValueError(f"paths must be a path or a non-empty list of them, got {paths!r:.80}",
                                  parameter="corpus")
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
