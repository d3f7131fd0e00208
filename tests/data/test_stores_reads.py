"""What a store-backed DataModule reads: no token byte before the first micro-batch, no file written, and each rank
reads exactly the tokens of its own micro-batches (bytes read = its tokens x the dtype's size, the index aside)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from lit_balance.data.stores import ArrowSource, MegatronSource
from lit_balance.data.stores.arrow import ArrowFile
from lit_balance.data.stores.megatron import MegatronFile
from tests.data._stores import documents, write_megatron, write_save_to_disk
from tests.data.test_stores import files_under, modules


@pytest.fixture(autouse=True)
def _parquet_copies(tmp_path, monkeypatch):
    """Parquet files' Arrow copies go to the default cache root: this test's own."""
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "default_cache"))



class CountingTokens:
    """A memory-mapped ``.bin`` whose every read (a slice) is recorded: (start, count, bytes)."""

    def __init__(self, array: np.ndarray, log: list) -> None:
        self.array, self.log = array, log

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise AssertionError(f"the .bin is read only by slices, got {key!r}")
        out = self.array[key]
        self.log.append((key.start, len(out), out.nbytes))
        return out

    def __len__(self) -> int:
        return len(self.array)


def planned_reads(dm) -> tuple[list[int], int]:
    """The store documents of this rank's micro-batches this epoch and their kept tokens (every item, fill rows too)."""
    dataset = dm.train_dataset
    docs, tokens = [], 0
    for micro_batch in dm.train_sampler:
        for i in micro_batch:
            docs.append(dataset.store_document(int(i)))
            tokens += int(dataset.lengths[int(i)])
    return docs, tokens


@pytest.mark.parametrize("extra", [{}, {"max_length": 9}, {"packing": True, "max_length": 12}])
def test_each_rank_reads_only_its_micro_batches_tokens(tmp_path, monkeypatch, extra):
    docs = documents(150, seed=5)
    prefix = write_megatron(tmp_path / "store" / "corpus", docs, dtype=np.int32)
    log_of: dict[int, list] = {}
    current = {"rank": None}

    def counting_open_tokens(self):
        return CountingTokens(np.memmap(self.name, dtype=self.dtype, mode="r"), log_of.setdefault(current["rank"], []))

    monkeypatch.setattr(MegatronFile, "open_tokens", counting_open_tokens)
    before = files_under(tmp_path)
    ranks = modules(lambda: MegatronSource(prefix), tmp_path / "run", 2, val_fraction=0, **extra)
    assert log_of == {}  # setup planned from the .idx alone: the .bin was not even mapped
    assert files_under(tmp_path) == before  # no cache entry, no file written anywhere
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine and Apex are missing
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(str(prefix))  # megatron-core's reader
    # the first token of each non-empty document (its first sequence's pointer, in tokens) -> the document
    doc_at = {int(index.index.sequence_pointers[int(index.document_indices[d])]) // 4: d
              for d, doc in enumerate(docs) if doc}
    read_by_rank = []
    for rank, dm in enumerate(ranks):
        current["rank"] = rank
        dm.train_sampler.set_epoch(0)
        want_docs, want_tokens = planned_reads(dm)
        dm.train_sampler.set_epoch(0)
        batches = list(dm.train_dataloader())
        assert batches
        log = log_of[rank]
        assert sum(nbytes for _, _, nbytes in log) == want_tokens * 4  # bytes read = its tokens x itemsize
        assert sum(count for _, count, _ in log) == want_tokens
        assert sorted(doc_at[int(start)] for start, count, _ in log if count) == \
            sorted(d for d in want_docs if int(ranks[0].corpus.store.lengths[d]))
        read_by_rank.append({doc_at[int(start)] for start, count, _ in log if count})
    assert files_under(tmp_path) == before
    if "packing" not in extra:  # no fill rows here: the ranks' documents are disjoint and cover the corpus
        assert not read_by_rank[0] & read_by_rank[1]
        assert read_by_rank[0] | read_by_rank[1] == {d for d, doc in enumerate(docs) if doc}


def test_arrow_store_reads_values_only_for_micro_batches(tmp_path, monkeypatch):
    docs = documents(120, seed=6)
    path = write_save_to_disk(tmp_path / "store" / "saved", docs)
    log: list[int] = []
    real_slice = ArrowFile._slice

    def counting_slice(chunk, row, length):
        out = real_slice(chunk, row, length)
        log.append(out.nbytes)
        return out

    monkeypatch.setattr(ArrowFile, "_slice", staticmethod(counting_slice))
    before = files_under(tmp_path)
    (dm,) = modules(ArrowSource(path), tmp_path / "run", 1, val_fraction=0, max_length=7)
    assert log == [] and files_under(tmp_path) == before
    dm.train_sampler.set_epoch(0)
    _, tokens = planned_reads(dm)
    dm.train_sampler.set_epoch(0)
    list(dm.train_dataloader())
    assert sum(log) == tokens * 4 and files_under(tmp_path) == before


def test_dataloader_workers_read_through_their_own_maps(tmp_path):
    docs = documents(80, seed=7)
    prefix = write_megatron(tmp_path / "corpus", docs)
    (dm,) = modules(MegatronSource(prefix), tmp_path / "run", 1, val_fraction=0, num_workers=2)
    (ref,) = modules(docs, tmp_path / "ref", 1, val_fraction=0)
    dm.train_sampler.set_epoch(0)
    ref.train_sampler.set_epoch(0)
    got, want = list(dm.train_dataloader()), list(ref.train_dataloader())
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert Path(f"{prefix}.bin").stat().st_size == sum(len(d) for d in docs) * 2
