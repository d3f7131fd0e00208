"""Checks of a store's index that formats share, each one vectorised pass in blocks (bounded memory), each error
naming the file and the setting to change.

* :func:`check_sequence_table`: an index of sequence lengths and byte pointers grouped by a document index (the
  layout of fairseq's and Megatron's memory-mapped indexed datasets);
* :func:`check_data_size`: a token file as long as its index says;
* :func:`read_ends`, :func:`check_non_decreasing`: cumulative document ends (datatrove's ``.ds.index``);
* :func:`check_list_type`, :func:`check_list_values`: an Arrow list column of integer ids without nulls;
* :func:`check_options`: a store's optional int and bool settings; :func:`import_pyarrow`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["check_data_size", "check_list_type", "check_list_values", "check_non_decreasing", "check_options",
           "check_sequence_table", "check_label_lengths", "import_pyarrow", "read_block", "read_ends"]

BLOCK = 1 << 22  # index entries checked per step (no temporary as large as a 100M-entry index)


def read_block(path: str, dtype: Any, base: int, start: int, count: int) -> np.ndarray:
    """``count`` entries from entry ``start`` of the array at byte ``base`` of ``path``, read with a plain file read
    (pages of a read are not kept mapped, so a pass over a large index does not grow the resident memory)."""
    dtype = np.dtype(dtype)
    return np.fromfile(path, dtype=dtype, count=count, offset=base + start * dtype.itemsize)


def check_sequence_table(path: str, *, sequences: int, entries: int, lengths_at: int, pointers_at: int,
                         documents_at: int, dtype: np.dtype, data_path: str) -> tuple[int, np.ndarray | None]:
    """One pass over a sequence table in blocks: the document index runs from 0 to the sequence count without
    decreasing, no length is negative, each pointer is the bytes of the sequences before it, the pointers end where
    the lengths say.

    Args:
        path: the index file; ``sequences`` lengths (int32) at byte ``lengths_at``, as many pointers (int64) at
            ``pointers_at``, ``entries`` document index entries (int64) at ``documents_at``.
        dtype: the token dtype; data_path: the token file (for messages).

    Returns:
        ``(tokens, document lengths)``: the document lengths (int64) when every document is one sequence, else None.

    Raises:
        ValueError: naming the file, the sequence and the document.
    """
    s, d = sequences, entries
    first = read_block(path, np.int64, documents_at, 0, 1)[0]
    last = read_block(path, np.int64, documents_at, d - 1, 1)[0]
    if int(first) != 0 or int(last) != s:
        raise InputValueError(f"{path}: the document index runs from {int(first)} to {int(last)}, expected 0 to the "
                              f"sequence count {s}", parameter="corpus")
    one_each = d == s + 1
    doc_lengths = np.empty(s if one_each else 0, dtype=np.int64)
    total, previous, itemsize = 0, 0, dtype.itemsize
    for start in range(0, max(s, d - 1), BLOCK):
        entries_ = read_block(path, np.int64, documents_at, start + 1, min(BLOCK, d - 1 - start)) if start < d - 1 \
            else np.zeros(0, np.int64)
        if entries_.size:
            steps = np.diff(entries_, prepend=previous)
            if steps.min() < 0:
                raise InputValueError(f"{path}: the document index decreases", parameter="corpus")
            one_each = one_each and bool(steps.min() == 1)
            previous = int(entries_[-1])
        seq = read_block(path, np.int32, lengths_at, start, min(BLOCK, s - start)) if start < s \
            else np.zeros(0, np.int32)
        if seq.size and seq.min() < 0:
            raise InputValueError(f"{path}: sequence {start + int(np.argmax(seq < 0))} has the negative length "
                                  f"{int(seq.min())}", parameter="corpus")
        if seq.size:  # written back to back: pointer i = bytes of the sequences before i
            pointers = read_block(path, np.int64, pointers_at, start, seq.size)
            expected = (total + np.cumsum(seq, dtype=np.int64) - seq) * itemsize
            if not np.array_equal(pointers, expected):
                bad = start + int(np.argmax(pointers != expected))
                _pointer_error(path, bad, pointers, expected, start, documents_at, d, dtype, data_path)
        total += int(seq.sum(dtype=np.int64))
        if one_each:
            doc_lengths[start:start + seq.size] = seq
    end = 0
    if s:
        end = int(read_block(path, np.int64, pointers_at, s - 1, 1)[0]) + \
            int(read_block(path, np.int32, lengths_at, s - 1, 1)[0]) * itemsize
    if end != total * itemsize:
        raise InputValueError(f"{path}: the sequence pointers end at byte {end} but the lengths add up to {total} "
                              f"tokens of {dtype} ({total * itemsize} bytes): the index is inconsistent, or its dtype "
                              "is not the one the .bin was written with", parameter="corpus")
    return total, doc_lengths if one_each else None


def _pointer_error(path: str, sequence: int, pointers: np.ndarray, expected: np.ndarray, start: int,
                   documents_at: int, entries: int, dtype: np.dtype, data_path: str) -> None:
    documents = np.fromfile(path, dtype=np.int64, count=entries, offset=documents_at)
    doc = int(np.searchsorted(documents, sequence, side="right")) - 1
    got, want = int(pointers[sequence - start]), int(expected[sequence - start])
    tokens = expected // dtype.itemsize
    other = [k for k in (1, 2, 4, 8) if k != dtype.itemsize and np.array_equal(pointers, tokens * k)]
    if other:
        raise InputValueError(f"{path}: the sequence pointers are those of {other[0]}-byte tokens but the header says "
                              f"{dtype} ({dtype.itemsize} bytes): its dtype is not the one the .bin was written with; "
                              "rewrite the store", parameter="corpus")
    raise InputValueError(f"{path}: sequence {sequence} (document {doc}) points at byte {got} of {data_path}, but the "
                          f"lengths before it add up to byte {want}: the index's pointers disagree with its lengths (a "
                          "hand-edited or corrupted .idx), so documents would read other documents' tokens; rewrite "
                          "the store", parameter="corpus")


def check_data_size(path: str, size: int, tokens: int, dtype: np.dtype, index: str) -> None:
    """Raise when the token file ``path`` (``size`` bytes) is not the ``tokens`` x itemsize bytes its ``index`` says."""
    expected = tokens * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its index says"
        raise InputValueError(f"{path} is {size} bytes but its index {index} says {tokens} tokens of {dtype} "
                              f"({expected} bytes): the token file is {what}, or the pair was written with another "
                              "dtype; rewrite the store", parameter="corpus")


def read_ends(path: str, parameter: str, missing: str) -> np.ndarray:
    """uint64 ``[documents]``: an index of cumulative document ends (little-endian ``uint64``, datatrove's
    ``.ds.index``), checked: present (else a FileNotFoundError, ``missing``), whole entries, never decreasing."""
    if not os.path.isfile(path):
        raise InputFileNotFoundError(missing, parameter=parameter)
    size = os.path.getsize(path)
    if size % 8:
        raise InputValueError(f"{path}: expected a multiple of 8 bytes (one uint64 document end each), got {size} "
                              "bytes", parameter=parameter)
    ends = np.fromfile(path, dtype="<u8")
    check_non_decreasing(ends, path, parameter)
    return ends


def check_non_decreasing(ends: np.ndarray, path: str, parameter: str) -> None:
    """Raise naming the first document whose cumulative end is below the one before it."""
    steps = np.diff(ends.astype(np.int64), prepend=0)
    if len(ends) and np.any(steps < 0):
        bad = int(np.argmax(steps < 0))
        raise InputValueError(f"{path}: document ends must not decrease, got {int(ends[bad])} after "
                              f"{int(ends[bad - 1]) if bad else 0} at document {bad}", parameter=parameter)


def check_list_type(pa: Any, field: Any, path: str, column: str) -> Any:
    """The Arrow type of ``field``, or a ValueError unless it is a list of integers."""
    kind = field.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise InputValueError(f"{path}: column {column!r} is {kind}, expected a list of integers (token ids)",
                              parameter="corpus")
    return kind


def check_list_values(pa: Any, lists: Any, path: str, column: str, first_row: int = 0) -> None:
    """Raise naming the file and row when a list of ``lists`` (an Arrow list array or chunked array) is null or
    holds a null value (free when there is none: Arrow keeps the null counts)."""
    for chunk in (lists.chunks if hasattr(lists, "chunks") else [lists]):
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


def check_options(ints: dict[str, Any], flags: dict[str, Any] | None = None) -> None:
    """Raise a TypeError naming the setting when a value of ``ints`` is not an int or None (bools too), or a value of
    ``flags`` not True, False or None."""
    for name, value in ints.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise InputTypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}", parameter=name)
    for name, value in (flags or {}).items():
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise InputTypeError(f"{name} must be True, False or None, got {type(value).__name__} {value!r}",
                                 parameter=name)


def import_pyarrow() -> Any:
    """pyarrow with its ``compute`` and ``parquet`` modules, or an ImportError that names the extra to install."""
    try:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401  (list_value_length)
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:  # pragma: no cover - pyarrow comes with the test extra
        raise ImportError('reading Arrow / Parquet stores needs pyarrow: pip install -e ".[stores]" '
                          '(in a clone of lit_balance)') from error
    return pa


def check_label_lengths(lengths: np.ndarray, label_lengths: np.ndarray, path: str, first_row: int = 0) -> None:
    """Raise naming the file and first row whose labels are not one per token id."""
    if not np.array_equal(label_lengths, lengths):
        row = int(np.flatnonzero(label_lengths != lengths)[0])
        raise InputValueError(f"{path}: row {first_row + row} has {int(label_lengths[row])} labels for "
                              f"{int(lengths[row])} token ids; give one label per token", parameter="labels")
