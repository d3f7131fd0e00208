"""The record of what every rank received, for a later check against a ledger (``lit-balance ledger check``).

:class:`lit_balance.callbacks.LedgerCheck` with ``record=DIR`` keeps, per micro-batch it trains, a 64-bit hash of the
sampler indices and fill flags it received (:func:`micro_batch_hash`) and the indices themselves, and each rank writes
them as one Parquet file per pass over an epoch (:func:`record_file_name`), with the run's ledger header
(:func:`lit_balance.ledger.ledger_header` of its training sampler) in the schema metadata (key
``lit_balance.ledger_record``). :func:`check_record` compares such files with a ledger written before or after training
(``lit-balance plan --ledger``): a ledger of other settings is refused naming each setting; every micro-batch whose hash
differs is reported with its optimizer step, rank and first differing document.

Columns of a record (one row per micro-batch a rank trained):

=================  =============  ================================================================================
``micro_step``     int64          the epoch's micro-step (Lightning's ``batch_idx``), as the ledger's ``micro_step``
``optimizer_step`` int64          the run's optimizer step as the ledger numbers it
``rank``           int32          the data-parallel rank
``hash``           int64          :func:`micro_batch_hash` of ``sample`` and ``fill``
``sample``         list<int64>    the sampler indices received (the batch key ``indices``), in row order
``fill``           list<bool>     the batch key ``is_fill``
=================  =============  ================================================================================
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lit_balance.errors import InputFileNotFoundError, InputValueError
from lit_balance.lightning.ledger import _import_pyarrow, check_ledger_header, read_ledger

__all__ = ["RECORD_KEY", "RecordCheck", "RecordMismatch", "check_record", "micro_batch_hash", "read_record",
           "record_file_name", "write_record"]

#: Schema metadata key of a record's JSON header.
RECORD_KEY = b"lit_balance.ledger_record"


def micro_batch_hash(samples: np.ndarray, fill: np.ndarray) -> int:
    """A 64-bit hash (signed) of one micro-batch: BLAKE2b (8-byte digest) of its sampler indices as little-endian int64
    followed by its fill flags as bytes; the same on every machine."""
    digest = hashlib.blake2b(np.ascontiguousarray(samples, dtype="<i8").tobytes(), digest_size=8)
    digest.update(np.ascontiguousarray(fill, dtype=np.bool_).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def record_file_name(epoch: int, rank: int, first_micro_step: int) -> str:
    """``epoch{E:04d}-from{M:08d}-rank{R:05d}.parquet``: the file a rank writes for a pass over epoch ``E`` that began
    at micro-step ``M`` (a resumed pass begins later)."""
    return f"epoch{int(epoch):04d}-from{int(first_micro_step):08d}-rank{int(rank):05d}.parquet"


def write_record(path: str | os.PathLike, header: dict[str, Any], micro_step: Sequence[int],
                 optimizer_step: Sequence[int], rank: int, samples: Sequence[np.ndarray],
                 fill: Sequence[np.ndarray]) -> None:
    """Write one rank's record of a pass (Parquet, replaced atomically); ``header`` is the run's ledger header, kept
    with ``"complete"`` (whether the pass ran to the epoch's end) as the caller sets it."""
    pa = _import_pyarrow()
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(samples).astype(np.int64) if samples else np.zeros(0, np.int64)
    flat_fill = np.concatenate(fill).astype(bool) if fill else np.zeros(0, bool)
    hashes = [micro_batch_hash(s, f) for s, f in zip(samples, fill)]
    table = pa.Table.from_arrays(
        [pa.array(np.asarray(micro_step, dtype=np.int64)), pa.array(np.asarray(optimizer_step, dtype=np.int64)),
         pa.array(np.full(len(samples), int(rank), dtype=np.int32)), pa.array(np.asarray(hashes, dtype=np.int64)),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_fill))],
        names=["micro_step", "optimizer_step", "rank", "hash", "sample", "fill"],
    ).replace_schema_metadata({RECORD_KEY: json.dumps(header).encode()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pa.parquet.write_table(table, str(partial), compression="zstd")
    os.replace(partial, path)


def read_record(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(table, header)`` of a record file.

    Raises:
        ValueError: the file is not a record (no header), naming it.
    """
    pa = _import_pyarrow()
    metadata = pa.parquet.read_schema(str(path)).metadata or {}
    if RECORD_KEY not in metadata:
        raise InputValueError(f"{path} is not a record of LedgerCheck(record=...): its Parquet schema has no "
                              f"{RECORD_KEY.decode()!r} header", parameter="record")
    return pa.parquet.read_table(str(path)), json.loads(metadata[RECORD_KEY])


def _record_files(records: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in records:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("epoch*-rank*.parquet"))
            if not found:
                raise InputFileNotFoundError(f"expected record files (epochE-fromM-rankR.parquet, written by "
                                             f"LedgerCheck(record=...)) in the directory {path}, found none",
                                             parameter="record")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise InputFileNotFoundError(f"record {path} does not exist: give the directory LedgerCheck(record=...) "
                                         "wrote, or files in it", parameter="record")
    return files


@dataclass(frozen=True)
class RecordMismatch:
    """One micro-batch a rank received that differs from the ledger.

    Attributes:
        optimizer_step: the run's optimizer step (the ledger's numbering).
        micro_step: the epoch's micro-step (Lightning's ``batch_idx``).
        rank: the data-parallel rank.
        row: the first differing row of the micro-batch.
        expected: the ledger's sampler index at that row (-1: the ledger has no row there).
        received: the rank's (-1: it received no row there, or never ran the micro-step).
        document: ``(component, document)`` of the ledger's row, or None.
        message: one line saying all of it.
    """

    optimizer_step: int
    micro_step: int
    rank: int
    row: int
    expected: int
    received: int
    document: tuple[str, int] | None
    message: str


@dataclass(frozen=True)
class RecordCheck:
    """What :func:`check_record` compared: ``micro_batches`` compared, the ``ranks`` seen, and the ``mismatches`` in
    running order (micro-step, then rank); ``ok`` when there are none."""

    micro_batches: int
    ranks: tuple[int, ...]
    mismatches: tuple[RecordMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _ledger_batches(table: Any) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """``{(micro_step, rank): (samples, fill, row positions in the table, optimizer_step)}`` of a ledger table."""
    micro = table.column("micro_step").to_numpy()
    rank = table.column("rank").to_numpy()
    if not micro.size:
        return {}
    sample = table.column("sample").to_numpy()
    fill = table.column("fill").to_numpy(zero_copy_only=False)
    step = table.column("optimizer_step").to_numpy()
    key = micro * (int(rank.max()) + 1) + rank
    cuts = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    ends = np.concatenate([cuts, [micro.size]]).astype(np.int64)
    return {(int(micro[a]), int(rank[a])): (sample[a:b], fill[a:b], np.arange(a, b), int(step[a]))
            for a, b in zip(starts.tolist(), ends.tolist())}


def check_record(records: Sequence[str | os.PathLike], ledger: str | os.PathLike) -> RecordCheck:
    """Compare what the ranks of a run received (record files of :class:`lit_balance.callbacks.LedgerCheck` with
    ``record=``) with a ledger, micro-batch by micro-batch.

    Every record file of the ledger's epoch is compared (files of other epochs in a directory are passed over; a
    directory without any of the ledger's epoch is an error). Each file's header must describe the ledger's run
    (:func:`lit_balance.ledger.check_ledger_header`): after a resume on another number of ranks, give the ledger of the
    resumed plan and the files of the resumed pass. A micro-batch differs when its hash differs from the ledger's rows'
    (and then the first differing row is named); a pass that ran to the epoch's end also differs where it never ran
    a micro-step of the ledger after its first.

    Args:
        records: record files, or directories of them.
        ledger: the ledger's Parquet file.

    Returns:
        A :class:`RecordCheck`.

    Raises:
        ValueError: a record written for other settings than the ledger (naming each setting and both values, the
            first one as the setting), a file that is not a record, no record of the ledger's epoch.
        FileNotFoundError: a record path that does not exist, a directory without record files.
    """
    table, header = read_ledger(ledger, columns=["optimizer_step", "micro_step", "rank", "sample", "fill",
                                                 "component", "document"])
    epoch = int(header["epoch"])
    files = []
    for path in _record_files(records):
        record, record_header = read_record(path)
        if int(record_header.get("epoch", -1)) != epoch and any(Path(r).is_dir() for r in records):
            continue  # another epoch's pass in a directory
        check_ledger_header(header, record_header, source=f"the ledger {ledger} (checking the record {path})")
        files.append((path, record, record_header))
    if not files:
        raise InputValueError(f"no record of epoch {epoch} (the epoch of the ledger {ledger}) in "
                              f"{list(map(str, records))}; give the ledger of the recorded epoch (lit-balance "
                              "plan --ledger ... --epoch E)", parameter="record")
    expected = _ledger_batches(table)
    components = table.column("component").to_pylist()
    documents = table.column("document").to_numpy()
    acc = int(header["accumulate_grad_batches"])
    mismatches: list[RecordMismatch] = []
    compared, ranks = 0, set()

    def mismatch(micro: int, rank: int, row: int, want: int, got: int, step: int, position: int | None,
                 what: str) -> None:
        doc = None if position is None else (str(components[position]), int(documents[position]))
        where = "" if doc is None else f" (component {doc[0]!r}, document {doc[1]})"
        mismatches.append(RecordMismatch(step, micro, rank, row, want, got, doc, (
            f"optimizer step {step} (epoch {epoch}, micro-step {micro}, micro-batch {micro % acc} of the step), rank "
            f"{rank}, row {row}: {what}{where}")))

    for path, record, record_header in files:
        micro_col = record.column("micro_step").to_numpy()
        rank_col = record.column("rank").to_numpy()
        hashes = record.column("hash").to_numpy()
        steps = record.column("optimizer_step").to_numpy().tolist()
        samples = record.column("sample").to_pylist()
        fills = record.column("fill").to_pylist()
        seen: dict[int, set[int]] = {}
        for micro, rank, digest, got, got_fill, got_step in zip(micro_col.tolist(), rank_col.tolist(),
                                                                hashes.tolist(), samples, fills, steps):
            ranks.add(rank)
            seen.setdefault(rank, set()).add(micro)
            compared += 1
            got, got_fill = np.asarray(got, dtype=np.int64), np.asarray(got_fill, dtype=bool)
            if micro_batch_hash(got, got_fill) != digest:
                raise InputValueError(f"the record {path} is damaged: micro-step {micro} of rank {rank} does not "
                                      "hash to its recorded hash", parameter="record")
            if (micro, rank) not in expected:
                first = int(got[0]) if got.size else -1
                mismatch(micro, rank, 0, -1, first, int(got_step), None,
                         f"received sample {first} where the ledger has no micro-batch")
                continue
            want, want_fill, positions, step = expected[(micro, rank)]
            if micro_batch_hash(want, want_fill) == digest:
                continue
            n = min(want.size, got.size)
            differ = np.flatnonzero((want[:n] != got[:n]) | (want_fill[:n] != got_fill[:n]))
            row = int(differ[0]) if differ.size else n
            w = int(want[row]) if row < want.size else -1
            g = int(got[row]) if row < got.size else -1
            what = (f"received sample {g}{' (a fill row)' if row < got.size and got_fill[row] else ''} where the "
                    f"ledger has sample {w}{' (a fill row)' if row < want.size and want_fill[row] else ''}"
                    if w >= 0 and g >= 0 else f"received no row where the ledger has sample {w}" if g < 0 else
                    f"received sample {g} beyond the ledger's rows of this micro-batch")
            mismatch(micro, rank, row, w, g, step, int(positions[row]) if row < want.size else None, what)
        if record_header.get("complete"):  # a pass to the epoch's end: every later micro-step of the ledger ran
            for rank, micro_steps in seen.items():
                start = min(micro_steps)
                for (micro, r), (want, _, positions, step) in expected.items():
                    if r == rank and micro >= start and micro not in micro_steps:
                        mismatch(micro, rank, 0, int(want[0]), -1, step, int(positions[0]),
                                 f"never ran this micro-step, whose first row in the ledger is sample {int(want[0])}")
    mismatches.sort(key=lambda m: (m.micro_step, m.rank))
    return RecordCheck(compared, tuple(sorted(ranks)), tuple(mismatches))
