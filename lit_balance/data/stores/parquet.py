"""Parquet files as tokenized stores: each opened once as an Arrow IPC copy of its token columns
(:func:`parquet_as_arrow`), then read in place as :class:`~lit_balance.data.stores.ArrowStore` reads Arrow files.

Parquet has no offsets buffer and decodes whole row groups, which shuffled micro-batches miss (measured: 300 times the
time of the same ids in an Arrow IPC file, 200k documents in 8 row groups), so a Parquet file's ``input_ids`` (and
``labels``) columns are copied once, one row group at a time (bounded memory), into an Arrow IPC file under
``<cache_dir>/parquet/`` (default: the tokenization cache's root), said on stderr, and memory-mapped from there; the
copy is keyed on the file's content (a sha256 of its footer, which holds every column chunk's offsets, sizes and
statistics, and its size), so a file replaced by another of the same size with its modification time kept
(``cp -p``, ``rsync -t``) gets a new copy. A cache folder that is read-only or has no room for the copy is refused
naming ``cache_dir`` and the bytes the copy needs (:mod:`lit_balance.data.cache_space`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lit_balance.data.stores._checks import check_label_lengths, check_list_type, check_list_values
from lit_balance.data.stores._files import FileStamp
from lit_balance.errors import InputValueError

__all__ = ["parquet_as_arrow"]

_PARQUET_COPY_FORMAT = 2  # bump when the layout of a Parquet file's Arrow copy changes (2: schema metadata kept)
_MAGIC = b"PAR1"
_WIDTH = {"INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8, "BOOLEAN": 1}


def _footer_digest(path: str) -> str:
    """sha256 of a Parquet file's size and footer (its last ``8 + footer length`` bytes: the metadata of every row
    group and column chunk, offsets, sizes and statistics included), read without the data pages.

    Raises:
        ValueError: the file does not end as a Parquet file does (``PAR1``), naming it.
    """
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size >= 12:
            handle.seek(size - 8)
            tail = handle.read(8)
            length = int.from_bytes(tail[:4], "little")
        if size < 12 or tail[4:] != _MAGIC or length + 8 > size - 4:
            raise InputValueError(f"{path} cannot be read as a Parquet file: expected it to end with a footer and "
                                  f"{_MAGIC!r} ({size} bytes)", parameter="corpus")
        handle.seek(size - 8 - length)
        footer = handle.read(length + 8)
    return hashlib.sha256(size.to_bytes(8, "little") + footer).hexdigest()


def _copy_bytes(parquet: Any, columns: list[str]) -> int:
    """Bytes the Arrow IPC copy of ``columns`` takes, about: each list's values at their width, its offsets, and a
    page of slack per row group (from the footer, nothing decoded)."""
    metadata, names = parquet.metadata, parquet.schema_arrow.names
    total = 4096
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for i in range(row_group.num_columns):
            chunk = row_group.column(i)
            if chunk.path_in_schema.split(".")[0] in columns and chunk.path_in_schema.split(".")[0] in names:
                total += chunk.num_values * _WIDTH.get(chunk.physical_type, 8) + 4 * (row_group.num_rows + 1) + 512
    return total


def _probe_writable(folder: Path, needed: int | None) -> None:
    """Create ``folder`` and a file in it, or raise the error naming ``cache_dir`` (read-only, full)."""
    from lit_balance.data.cache_space import cache_dir_error

    probe = folder / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.unlink(probe)
    except OSError as error:
        raise cache_dir_error(folder.parent, error, what="the Arrow copy of a Parquet file", needed=needed) from error


def _parquet_copy_dir(cache_dir: Path | None) -> Path:
    from lit_balance.data.cache import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "parquet"


def parquet_as_arrow(pa: Any, path: str, stamp: FileStamp, column: str, labels: str | None,
                     cache_dir: Path | None) -> str:
    """The Arrow IPC copy of a Parquet file's ``column`` (and ``labels``) columns, written once and memory-mapped.

    Parquet has no offsets buffer and decodes by row group: a shuffled micro-batch touches many row groups, each
    decoded whole (measured: 300 times the time of the same ids in an Arrow IPC file, 200k documents in 8 row groups).
    The copy is written in one pass, a row group at a time (bounded memory), into ``<cache_dir>/parquet/`` (default:
    the tokenization cache's root, :func:`lit_balance.data.cache.default_cache_dir`) under a key of the file's content
    (sha256 of its footer and size: :func:`_footer_digest`) and the columns, so a changed file gets a new copy, even
    one of the same size and modification time; concurrent processes (ranks) wait on a file lock and reuse the first
    one's copy. The columns are checked on the way (a null row or value). The schema's metadata (e.g. the tokenizer,
    :mod:`lit_balance.data.tokenizer_identity`) is kept in the copy.

    Returns:
        The copy's path.

    Raises:
        ValueError: the file is not Parquet, lacks ``column``, a column is not a list of integers, a null row or
            value, labels of another length than the ids (each naming the file and row); the cache folder is
            read-only or has no room for the copy (naming ``cache_dir`` and the bytes needed).
    """
    from filelock import FileLock

    from lit_balance.data.cache_space import FULL, cache_dir_error, check_free_space

    key = hashlib.sha256("\0".join([str(_PARQUET_COPY_FORMAT), _footer_digest(path), column,
                                     str(labels)]).encode()).hexdigest()[:32]
    folder = _parquet_copy_dir(cache_dir)
    target = folder / f"{Path(path).stem}-{key}.arrow"
    if target.is_file():  # a read-only cache still serves the copies it holds
        return str(target)
    needed = None
    try:
        needed = _copy_bytes(pa.parquet.ParquetFile(path), [column, *([labels] if labels else [])])
    except (pa.ArrowInvalid, OSError):
        pass  # refused with its message below
    _probe_writable(folder, needed)
    if needed is not None:
        check_free_space(folder.parent, folder, needed, what="the Arrow copy of a Parquet file")
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
        check_list_type(pa, schema.field(column), path, column)
        columns = [column]
        if labels is not None and labels in schema.names:
            check_list_type(pa, schema.field(labels), path, labels)
            columns.append(labels)
        out_schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
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
                        check_list_values(pa, table.column(name), path, name, first)
                    if len(columns) == 2:
                        check_label_lengths(pa.compute.list_value_length(table.column(column)).to_numpy(),
                                            pa.compute.list_value_length(table.column(labels)).to_numpy(), path, first)
                    writer.write_table(table.cast(out_schema))
                    first += table.num_rows
            stamp.check()  # the Parquet file did not change while it was copied
            os.replace(partial, target)
        except OSError as error:
            if error.errno in FULL:
                raise cache_dir_error(folder.parent, error, what="the Arrow copy of a Parquet file",
                                      needed=needed) from error
            raise
        finally:
            if partial.exists():
                partial.unlink()
        print(f"lit_balance: wrote {target} ({target.stat().st_size:,} bytes) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
    return str(target)
