"""Tokenized stores read in place (Megatron .bin/.idx, Arrow / Parquet): the same plans and micro-batches as the
same token ids given as a list, nothing written, errors that name the file.

Every fixture is written by the format's own producer: megatron-core's ``IndexedDatasetBuilder``,
``datasets.Dataset.save_to_disk`` / ``to_parquet`` and pyarrow's IPC writer.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule, BatchingSettings
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.stores import (
    ArrowSource,
    MegatronSource,
    StoreChangedError,
    StoreSource,
    TokenStore,
)
from tests.data._stores import (
    VOCAB,
    documents,
    masked_labels,
    write_arrow_ipc_file,
    write_megatron,
    write_save_to_disk,
    write_to_parquet,
)

FORMATS = ["megatron", "megatron_two_prefixes", "save_to_disk", "to_parquet", "arrow_ipc_file"]


@pytest.fixture(autouse=True)
def _parquet_copies(tmp_path, monkeypatch):
    """Parquet files' Arrow copies go to the default cache root: this test's own."""
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "default_cache"))



def make_source(fmt: str, root: Path, docs: list[list[int]]) -> StoreSource:
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "megatron":
        return MegatronSource(write_megatron(root / "corpus", docs))
    if fmt == "megatron_two_prefixes":
        half = len(docs) // 3
        return MegatronSource([write_megatron(root / "a", docs[:half]), write_megatron(root / "b", docs[half:])])
    if fmt == "save_to_disk":
        return ArrowSource(write_save_to_disk(root / "saved", docs))
    if fmt == "to_parquet":
        return ArrowSource(write_to_parquet(root / "corpus.parquet", docs))
    if fmt == "arrow_ipc_file":
        return ArrowSource(write_arrow_ipc_file(root / "corpus.arrow", docs))
    raise AssertionError(fmt)


def files_under(path: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in path.rglob("*")}


def modules(corpus, tmp_path: Path, world_size: int = 1, **kwargs) -> list[BalancedTextDataModule]:
    settings = dict(vocab_size=VOCAB, pad_token_id=0, max_tokens=96, val_fraction=0.1, seed=3,
                    cache_dir=tmp_path / "cache")
    settings.update(kwargs)
    if "settings" in kwargs:
        del settings["max_tokens"]
    out = []
    for rank in range(world_size):
        dm = BalancedTextDataModule(corpus() if callable(corpus) else corpus, **settings)  # callable: one per rank
        if world_size > 1:  # a Trainer of world_size ranks as data_parallel_world reads it
            dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=0,
                                         strategy=SimpleNamespace(distributed_sampler_kwargs={
                                             "num_replicas": world_size, "rank": rank}),
                                         accumulate_grad_batches=1)
        dm.prepare_data()
        dm.setup("fit")
        out.append(dm)
    return out


def epoch_batches(dm: BalancedTextDataModule, epoch: int) -> list[dict]:
    dm.train_sampler.set_epoch(epoch)
    return list(dm.train_dataloader())


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b)
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("world_size", "extra"), [
    (1, {}), (2, {"max_length": 24}), (2, {"packing": True}), (2, {"max_tokens": [64, 160]}),  # per-rank budgets
    (2, {"settings": BatchingSettings(max_tokens=96, plan_window=40, seed=3)}),  # plans in windows
], ids=["one_rank", "max_length", "packed", "per_rank_budgets", "windows"])
def test_plans_and_micro_batches_equal_the_token_id_list(tmp_path, fmt, world_size, extra):
    docs = documents()
    source = make_source(fmt, tmp_path / "store", docs)
    before = files_under(tmp_path / "store")
    stores = modules(source, tmp_path / "s", world_size, **extra)
    lists = modules(docs, tmp_path / "l", world_size, **extra)
    assert files_under(tmp_path / "store") == before  # nothing written beside the store
    assert not (tmp_path / "s" / "cache").exists() or not any((tmp_path / "s" / "cache").iterdir())
    for store_dm, list_dm in zip(stores, lists):
        assert isinstance(store_dm.train_dataset, TokenDataset) and store_dm.train_dataset.store is source.store
        assert store_dm.corpus.num_empty == list_dm.corpus.num_empty == sum(not d for d in docs)
        assert np.array_equal(store_dm.corpus.lengths, list_dm.corpus.lengths)
        assert np.array_equal(store_dm.train_dataset.doc_ids, list_dm.train_dataset.doc_ids)
        assert np.array_equal(store_dm.train_dataset.lengths, list_dm.train_dataset.lengths)
        assert np.array_equal(store_dm.val_dataset.lengths, list_dm.val_dataset.lengths)
        assert store_dm.tokenizer.fingerprint == list_dm.tokenizer.fingerprint
        for epoch in (0, 1):
            assert_same_batches(epoch_batches(store_dm, epoch), epoch_batches(list_dm, epoch))
        assert_same_batches(list(store_dm.val_dataloader()[0]), list(list_dm.val_dataloader()[0]))
        if world_size == 1:  # the resume state and its fingerprint: from the lengths, not the files
            assert store_dm.state_dict() == list_dm.state_dict()
    assert files_under(tmp_path / "store") == before


def test_every_document_once_per_epoch_over_ranks(tmp_path):
    docs = documents(200, seed=1)
    source = make_source("megatron", tmp_path / "store", docs)
    ranks = modules(source, tmp_path, 2, val_fraction=0)
    for epoch in (0, 1):
        per_rank = [epoch_batches(dm, epoch) for dm in ranks]
        assert len(per_rank[0]) == len(per_rank[1])
        seen = []
        for batches in per_rank:
            for batch in batches:
                assert batch["input_ids"].numel() <= 96  # the budget: padded token slots per micro-batch
                seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(sum(bool(d) for d in docs)))


@pytest.mark.filterwarnings("ignore:.*have no next-token target:UserWarning")
def test_labels_of_an_arrow_store_equal_a_labelled_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = [d for d in documents(90, seed=2) if d]
    labels = masked_labels(docs)
    for source in (ArrowSource(write_save_to_disk(tmp_path / "saved", docs, labels)),
                   ArrowSource(write_to_parquet(tmp_path / "corpus.parquet", docs, labels))):
        assert source.store.has_labels
        reference = datasets.Dataset.from_dict({"input_ids": docs, "labels": labels})
        (store_dm,) = modules(source, tmp_path / "s", max_length=30)
        (ref_dm,) = modules(reference, tmp_path / "r", max_length=30)
        assert np.array_equal(store_dm.train_sampler.supervised_lengths, ref_dm.train_sampler.supervised_lengths)
        for epoch in (0, 1):
            assert_same_batches(epoch_batches(store_dm, epoch), epoch_batches(ref_dm, epoch))


def test_store_pickles_without_its_maps_and_reads_after(tmp_path):
    docs = documents()
    for fmt in ("megatron", "save_to_disk", "to_parquet"):
        source = make_source(fmt, tmp_path / fmt, docs)
        store = source.store
        store.read(0, 3)  # maps opened in this process
        blob = pickle.dumps(store)
        assert len(blob) < 20_000  # the lengths and names, not the files
        again = pickle.loads(blob)
        for doc in (0, 7, len(docs) - 1):
            assert again.read(doc, len(docs[doc]))[0].tolist() == docs[doc]
        assert pickle.loads(pickle.dumps(source)).store.identity() == store.identity()


def test_generic_path_reads_records_from_the_store(tmp_path):
    docs = documents()
    source = make_source("megatron", tmp_path, docs)
    assert [r.ids.tolist() for r in source.read_records()] == docs
    assert source.num_documents == len(docs) and source.holds_token_ids


def test_identity_comes_from_the_index_not_the_tokens(tmp_path):
    docs = documents()
    source = make_source("megatron", tmp_path / "a", docs)
    same_lengths = [[(t % (VOCAB - 1)) + 1 for t in np.add(d, 1).tolist()] for d in docs]
    other = make_source("megatron", tmp_path / "b", same_lengths)
    assert source.identity() == other.identity()  # same names, sizes and lengths: the tokens are never hashed
    longer = make_source("megatron", tmp_path / "c", [*docs, [1, 2]])
    assert source.identity() != longer.identity()


def test_megatron_reader_agrees_with_megatron_core(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = [d for d in documents() if d]
    prefix = write_megatron(tmp_path / "c", docs, dtype=np.int32)
    store = MegatronSource(prefix).store
    reference = IndexedDataset(str(prefix))
    assert store.dtype == np.int32
    assert np.array_equal(store.lengths, reference.sequence_lengths)
    for doc in range(len(docs)):
        assert np.array_equal(store.read(doc, len(docs[doc]))[0], reference[doc])


# --------------------------------------------------------------------------------------------------
# Vocabulary and pad


def test_vocab_and_pad_are_required_when_the_store_does_not_say_them(tmp_path):
    source = make_source("megatron", tmp_path, documents())
    with pytest.raises(ValueError, match="does not say its vocabulary size: pass vocab_size="):
        BalancedTextDataModule(source, pad_token_id=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not say its padding id: pass pad_token_id="):
        BalancedTextDataModule(source, vocab_size=VOCAB, cache_dir=tmp_path)


def test_ids_beyond_the_vocabulary_name_the_file_and_document(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    docs[1][2] = 600
    for fmt in ("megatron", "to_parquet"):
        source = make_source(fmt, tmp_path / fmt, docs)
        (dm,) = modules(source, tmp_path / fmt, val_fraction=0)
        with pytest.raises(ValueError) as error:
            epoch_batches(dm, 0)
        message = str(error.value)
        assert "token id 600 at position 2" in message and "vocabulary [0, 500)" in message
        assert ("document 1 of" in message and "corpus.bin" in message) or "row 1 of" in message and ".parquet" in message


def test_a_store_vocabulary_larger_than_the_model_is_refused(tmp_path):
    class Said(MegatronSource):
        def open_store(self):
            store = super().open_store()
            store.vocab_size = 1000
            return store

    source = Said(write_megatron(tmp_path / "c", documents()))
    with pytest.raises(ValueError, match="vocabulary of 1000 token ids, more than the 500"):
        BalancedTextDataModule(source, vocab_size=VOCAB, pad_token_id=0, cache_dir=tmp_path)
    dm = BalancedTextDataModule(source, pad_token_id=0, cache_dir=tmp_path)
    assert dm.vocab_size == 1000


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture
def megatron_prefix(tmp_path) -> Path:
    return write_megatron(tmp_path / "corpus", documents())


def test_truncated_bin_names_the_file(megatron_prefix):
    path = Path(f"{megatron_prefix}.bin")
    size = path.stat().st_size
    with open(path, "r+b") as stream:
        stream.truncate(size - 6)
    with pytest.raises(ValueError) as error:
        MegatronSource(megatron_prefix).store
    assert str(path) in str(error.value) and "truncated" in str(error.value) and str(size) in str(error.value)


def test_idx_of_another_version_names_the_file(megatron_prefix):
    path = Path(f"{megatron_prefix}.idx")
    with open(path, "r+b") as stream:
        stream.seek(9)
        stream.write(struct.pack("<Q", 2))
    with pytest.raises(ValueError, match=f"{path}.*version 2; only version 1"):
        MegatronSource(megatron_prefix).store


def test_idx_of_another_dtype_names_the_file(megatron_prefix):
    path = Path(f"{megatron_prefix}.idx")
    with pytest.raises(ValueError, match=f"{path} holds uint16 token ids, but dtype=int32 was asked for"):
        MegatronSource(megatron_prefix, dtype="int32").store
    with open(path, "r+b") as stream:  # the header now says int32, but the .bin holds uint16 ids
        stream.seek(17)
        stream.write(struct.pack("<B", 4))
    with pytest.raises(ValueError, match=f"{path}: the sequence pointers are those of 2-byte tokens .* its dtype is "
                                         "not the one"):
        MegatronSource(megatron_prefix).store
    with open(path, "r+b") as stream:
        stream.seek(17)
        stream.write(struct.pack("<B", 42))
    with pytest.raises(ValueError, match=f"{path} has the dtype code 42"):
        MegatronSource(megatron_prefix).store
    with open(path, "r+b") as stream:
        stream.seek(17)
        stream.write(struct.pack("<B", 6))
    with pytest.raises(ValueError, match="float64 values, not token ids"):
        MegatronSource(megatron_prefix).store


def test_truncated_or_foreign_idx_names_the_file(megatron_prefix, tmp_path):
    path = Path(f"{megatron_prefix}.idx")
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match=f"{path} is {len(data) - 8} bytes, but its header"):
        MegatronSource(megatron_prefix).store
    path.write_bytes(b"PK" + data[2:])
    with pytest.raises(ValueError, match=f"{path} is not a Megatron index"):
        MegatronSource(megatron_prefix).store
    with pytest.raises(FileNotFoundError, match="missing.idx does not exist"):
        MegatronSource(tmp_path / "missing").store


def test_prefixes_of_different_dtypes_are_refused(tmp_path):
    a = write_megatron(tmp_path / "a", documents(), dtype=np.uint16)
    b = write_megatron(tmp_path / "b", documents(), dtype=np.int32)
    with pytest.raises(ValueError, match="b.idx holds int32 token ids but .*a.idx holds uint16"):
        MegatronSource([a, b]).store


def test_parquet_without_input_ids_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "ids": [[1], [2]]}), path)
    with pytest.raises(ValueError, match=f"{path} has no 'input_ids' column \\(its columns: \\['text', 'ids'\\]\\)"):
        ArrowSource(path).store
    assert ArrowSource(path, column="ids").store.lengths.tolist() == [1, 1]
    bad = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"input_ids": [["a"], ["b"]]}), bad)
    with pytest.raises(ValueError, match=f"{bad}: column 'input_ids' is list<element: string>, expected a list of int"):
        ArrowSource(bad).store


def test_arrow_directory_and_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.arrow does not exist"):
        ArrowSource(tmp_path / "nothing.arrow").store
    with pytest.raises(ValueError, match="without a state.json"):
        ArrowSource(tmp_path).store
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="expected a .arrow, .feather, .ipc or .parquet file"):
        ArrowSource(tmp_path / "x.csv").store


def test_a_custom_store_source_trains_through_the_interface(tmp_path):
    docs = [d for d in documents(60, seed=4) if d]

    class ListStore(TokenStore):
        vocab_size, pad_token_id = VOCAB, 0

        def __init__(self):
            self._lengths = np.array([len(d) for d in docs], dtype=np.int64)

        @property
        def lengths(self):
            return self._lengths

        @property
        def dtype(self):
            return np.dtype(np.int64)

        def read(self, doc, length):
            doc, length = self._check_read(doc, length)
            return np.array(docs[doc][:length]), None

        def identity(self):
            return ["list", str(len(docs))]

    class ListSource(StoreSource):
        def open_store(self):
            return ListStore()

    (dm,) = modules(ListSource(), tmp_path / "s", vocab_size=None, pad_token_id=None)
    (ref,) = modules(docs, tmp_path / "r")
    assert dm.vocab_size == VOCAB
    assert_same_batches(epoch_batches(dm, 0), epoch_batches(ref, 0))
    assert not (tmp_path / "s" / "cache").exists()  # nothing written to the tokenization cache


def test_map_style_path_reads_a_store_dataset_by_micro_batch(tmp_path):
    from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader
    from lit_balance.data.stores import TokenizedCorpus
    from lit_balance.data.tokenizer import TokenizerAdapter

    docs = documents(90, seed=8)
    source = make_source("to_parquet", tmp_path, docs)
    corpus = TokenizedCorpus.from_store(source.store, vocab_size=VOCAB, pad_token_id=0)
    store_items = MicroBatchDataset(TokenDataset.of(corpus, max_length=20), "input_ids")
    list_items = MicroBatchDataset([{"input_ids": np.array(d[:20], np.int32)} for d in docs if d], "input_ids")
    assert np.array_equal(store_items.lengths, list_items.lengths)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, drop_fields=["index", "is_fill"])
    loaders = [balanced_dataloader(items, BalancedBatchSampler(items.lengths, 64, num_replicas=2, rank=1, seed=2),
                                   collate) for items in (store_items, list_items)]
    got, want = (list(loader) for loader in loaders)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert TokenizerAdapter.for_token_ids(VOCAB).vocab_size == corpus.vocab_size


def test_a_parquet_file_is_copied_once_to_arrow_and_read_from_the_copy(tmp_path, capfd):
    docs = documents(160, seed=8)
    parquet = write_to_parquet(tmp_path / "store" / "corpus.parquet", docs, batch_size=20)  # 8 row groups
    pq = pytest.importorskip("pyarrow.parquet")
    assert pq.ParquetFile(parquet).num_row_groups == 8
    copies = tmp_path / "copies"
    (dm,) = modules(ArrowSource(parquet, cache_dir=copies), tmp_path / "run", val_fraction=0)
    said = capfd.readouterr().err
    (copy,) = (copies / "parquet").glob("*.arrow")
    assert f"converting the ['input_ids'] columns of {parquet} (8 row groups, 160 rows) once into the " \
           f"memory-mapped Arrow file {copy}" in said
    (ref,) = modules(ArrowSource(write_arrow_ipc_file(tmp_path / "ref.arrow", docs)), tmp_path / "ref",
                     val_fraction=0)
    for epoch in (0, 1):  # shuffled micro-batches across every row group: the same as the same ids in Arrow IPC
        assert_same_batches(epoch_batches(dm, epoch), epoch_batches(ref, epoch))
    written = copy.stat().st_mtime_ns
    again = ArrowSource(parquet, cache_dir=copies).store  # another rank, or the next run: the copy is reused
    assert "converting" not in capfd.readouterr().err and copy.stat().st_mtime_ns == written
    assert np.array_equal(again.lengths, [len(d) for d in docs])
    write_to_parquet(parquet, docs[::-1], batch_size=20)  # the file changed: a new copy, of the new ids
    changed = ArrowSource(parquet, cache_dir=copies).store
    assert "converting" in capfd.readouterr().err and len(list((copies / "parquet").glob("*.arrow"))) == 2
    assert np.array_equal(changed.lengths, [len(d) for d in docs[::-1]])
    with pytest.raises(StoreChangedError, match=f"{parquet} changed on disk after the store was opened"):
        epoch_batches(dm, 2)  # the run that planned the old file refuses the new one
