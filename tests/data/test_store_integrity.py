"""Stores that lie are refused, naming the file and what is wrong: an index whose pointers disagree with its lengths,
a file named twice, nulls inside the token lists, labels beyond the vocabulary, and a store changed on disk after
the DataModule was set up (detected when a process or DataLoader worker opens it and before every read, so a
truncated file under a running epoch stops it with an error, not SIGBUS).

Fixtures come from the producers: megatron-core's ``IndexedDatasetBuilder``, ``datasets`` and pyarrow.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from lit_balance.data.stores import ArrowSource, MegatronSource
from lit_balance.data.stores._files import StoreChangedError
from tests.data._stores import (
    VOCAB,
    documents,
    write_arrow_ipc_file,
    write_megatron,
    write_save_to_disk,
    write_to_parquet,
)
from tests.data.test_stores import epoch_batches, modules

HEADER = 34  # bytes of the .idx header: magic 9, version 8, dtype code 1, sequence count 8, document count 8


@pytest.fixture(autouse=True)
def _parquet_copies(tmp_path, monkeypatch):
    """Parquet files' Arrow copies go to the default cache root: this test's own."""
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "default_cache"))



def _idx_arrays(prefix: Path) -> tuple[np.memmap, np.memmap, int]:
    """The writable ``(sequence lengths, sequence pointers, S)`` of ``prefix.idx``."""
    path = f"{prefix}.idx"
    count = int(np.fromfile(path, dtype="<u8", count=1, offset=18)[0])
    lengths = np.memmap(path, dtype="<i4", mode="r+", offset=HEADER, shape=(count,))
    pointers = np.memmap(path, dtype="<i8", mode="r+", offset=HEADER + 4 * count, shape=(count,))
    return lengths, pointers, count


def test_megatron_pointers_that_disagree_with_the_lengths_are_refused(tmp_path):
    docs = documents(40, seed=3, empty_every=0)
    prefix = write_megatron(tmp_path / "a" / "corpus", docs)
    _, pointers, _ = _idx_arrays(prefix)
    pointers[3] = pointers[5]  # document 3 points at document 5's bytes
    pointers.flush()
    with pytest.raises(ValueError, match=rf"{prefix}\.idx: sequence 3 \(document 3\) points at byte "
                                         rf"{int(pointers[5])} of .*corpus\.bin, but the lengths before it add up to "
                                         rf"byte {int(pointers[4]) - 2 * len(docs[3])}: the index's pointers disagree"):
        MegatronSource(prefix).store

    prefix = write_megatron(tmp_path / "b" / "corpus", docs)
    lengths, _, _ = _idx_arrays(prefix)
    lengths[10] += 2  # the lengths of documents 10 and 11 shifted by 2 (same total: the .bin size still agrees)
    lengths[11] -= 2
    lengths.flush()
    with pytest.raises(ValueError, match=rf"{prefix}\.idx: sequence 11 \(document 11\) points at byte .* the index's "
                                         "pointers disagree with its lengths"):
        MegatronSource(prefix).store


def test_a_file_named_twice_is_refused(tmp_path):
    docs = documents(30, seed=1)
    prefix = write_megatron(tmp_path / "corpus", docs)
    with pytest.raises(ValueError, match=rf"Megatron store: '{prefix}\.bin' is named twice; every document would "
                                         "train twice per epoch"):
        MegatronSource([prefix, f"{prefix}.bin"]).store
    parquet = write_to_parquet(tmp_path / "corpus.parquet", docs)
    with pytest.raises(ValueError, match=rf"Arrow / Parquet store: '{parquet}' is named twice"):
        ArrowSource([parquet, parquet]).store
    saved = write_save_to_disk(tmp_path / "saved", docs)
    shard = next(saved.glob("*.arrow"))
    with pytest.raises(ValueError, match=rf"'{shard}' is named twice"):
        ArrowSource([saved, shard]).store
    os.link(parquet, tmp_path / "again.parquet")  # the same file under another name (a hard link)
    with pytest.raises(ValueError, match=rf"'{tmp_path / 'again.parquet'}' is named twice \(as '{parquet}'\)"):
        ArrowSource([parquet, tmp_path / "again.parquet"]).store


def _with_nulls(path: Path, ids: list, labels: list | None = None, row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"input_ids": pa.array(ids, pa.list_(pa.int32()))}
    if labels is not None:
        columns["labels"] = pa.array(labels, pa.list_(pa.int32()))
    table = pa.table(columns)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=row_group_size)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=4)
    return path


def test_nulls_in_the_token_lists_are_refused_naming_the_file_and_row(tmp_path):
    docs = [d for d in documents(40, seed=2) if d]
    ids = [list(d) for d in docs]
    ids[7][1] = None
    path = _with_nulls(tmp_path / "ids.arrow", ids)
    with pytest.raises(ValueError, match=rf"{path}: row 7 of 'input_ids' holds a null among its values"):
        ArrowSource(path).store
    path = _with_nulls(tmp_path / "ids.parquet", ids, row_group_size=5)
    with pytest.raises(ValueError, match=rf"{path}: row 7 of 'input_ids' holds a null among its values"):
        ArrowSource(path).store
    labels = [list(d) for d in docs]
    labels[31][0] = None  # in the seventh row group
    path = _with_nulls(tmp_path / "labels.parquet", docs, labels, row_group_size=5)
    with pytest.raises(ValueError, match=rf"{path}: row 31 of 'labels' holds a null among its values"):
        ArrowSource(path).store
    rows = [list(d) for d in docs]
    rows[12] = None
    path = _with_nulls(tmp_path / "rows.arrow", rows)
    with pytest.raises(ValueError, match=rf"{path}: row 12 of 'input_ids' is null"):
        ArrowSource(path).store


def test_labels_beyond_the_vocabulary_are_named_when_read(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    labels = [list(d) for d in docs]
    labels[1][3] = 777
    for path in (_with_nulls(tmp_path / "c.parquet", docs, labels), _with_nulls(tmp_path / "c.arrow", docs, labels)):
        (dm,) = modules(ArrowSource(path), tmp_path / path.suffix, val_fraction=0)
        with pytest.raises(ValueError, match=rf"row 1 of {path} holds the label 777 at position 3, outside the "
                                             rf"vocabulary \[0, {VOCAB}\)"):
            epoch_batches(dm, 0)


# -- a store changed on disk after setup() ---------------------------------------------------------------------------

def _store(fmt: str, root: Path, docs: list[list[int]]) -> tuple[object, Path]:
    """A store source and the file of it that the test rewrites."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "megatron":
        prefix = write_megatron(root / "corpus", docs)
        return MegatronSource(prefix), Path(f"{prefix}.bin")
    if fmt == "arrow_ipc_file":
        path = write_arrow_ipc_file(root / "corpus.arrow", docs)
        return ArrowSource(path), path
    if fmt == "save_to_disk":
        saved = write_save_to_disk(root / "saved", docs)
        return ArrowSource(saved), sorted(saved.glob("*.arrow"))[-1]
    raise AssertionError(fmt)


def _rewrite(path: Path, how: str) -> None:
    data = path.read_bytes()
    before = path.stat().st_mtime_ns
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "same size":  # other bytes, the same size (a store written again in place)
        path.write_bytes(data[::-1])
    if path.stat().st_mtime_ns == before:  # a coarse file-system clock: the write happened in the same tick
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


@pytest.mark.parametrize(("fmt", "how", "workers"), [
    ("megatron", "truncated", 1), ("megatron", "same size", 0), ("arrow_ipc_file", "truncated", 0),
    ("arrow_ipc_file", "same size", 0), ("save_to_disk", "truncated", 0), ("save_to_disk", "same size", 1)])
def test_a_store_changed_after_setup_is_refused_naming_the_file(tmp_path, fmt, how, workers):
    source, changed = _store(fmt, tmp_path / "store", documents(60, seed=5))
    (dm,) = modules(source, tmp_path / "run", val_fraction=0, num_workers=workers)
    _rewrite(changed, how)
    with pytest.raises(StoreChangedError, match=rf"{changed} changed on disk after the store was opened"):
        epoch_batches(dm, 0)


@pytest.mark.parametrize("fmt", ["megatron", "arrow_ipc_file"])
def test_a_store_truncated_under_a_running_epoch_stops_it_with_an_error_not_a_signal(tmp_path, fmt):
    source, changed = _store(fmt, tmp_path / "store", documents(300, seed=6))
    (dm,) = modules(source, tmp_path / "run", val_fraction=0, num_workers=1)
    dm.train_sampler.set_epoch(0)
    loader = iter(dm.train_dataloader())
    assert len(dm.train_dataloader()) > 10
    for _ in range(2):
        next(loader)  # the worker has opened (and, for Arrow, mapped) the file and read from it
    os.truncate(changed, changed.stat().st_size // 3)  # the writer truncates it in place, under the running epoch
    with pytest.raises(StoreChangedError, match=rf"{changed} changed on disk after the store was opened \(\d+ bytes "
                                                r"then, \d+ now"):
        for _ in loader:
            pass
