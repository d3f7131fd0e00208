"""datatrove token stores read in place: fixtures written by datatrove's own ``DocumentTokenizer`` (with the package's
tokenizer file), read back as the library's own tokenization of the same documents, planned and batched exactly as
the same ids given as a list, the ``.ds.loss`` masks exact, and every malformed store refused naming its file."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule
from lit_balance.data import load_or_build, resolve_corpus
from lit_balance.data.records import IGNORE_INDEX, encode_chunk_flat
from lit_balance.data.sources import CorpusChunk, TokenIds, TokenIdsSource, stdlib_docstrings
from lit_balance.data.stores.datatrove import DatatroveFile, DatatroveSource, DatatroveStore, read_metadata
from lit_balance.data.tokenizer import resolve_tokenizer

datatrove = pytest.importorskip("datatrove")  # the "datatrove" extra; part of the test extra

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_TOKENIZER = ROOT / "lit_balance" / "data" / "tokenizer" / "tokenizer.json"
VOCAB = 30522


def _plain_tokenizer(path: Path) -> Path:
    """The package's tokenizer file with truncation, padding and the [CLS]/[SEP] post-processor cleared, written
    with the ``tokenizers`` library (datatrove keeps a file's own settings)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(PACKAGE_TOKENIZER))
    tok.no_truncation()
    tok.no_padding()
    tok.post_processor = None
    tok.save(str(path))
    return path


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _datatrove(input_folder: Path, output: Path, tokenizer: Path, *, tasks: int, **options) -> Path:
    """Run datatrove's JsonlReader -> DocumentTokenizer (in process, one task after the other)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    options = {"shuffle_documents": False, **options}
    steps = [JsonlReader(str(input_folder), glob_pattern="*.jsonl"),
             DocumentTokenizer(output_folder=str(output), tokenizer_name_or_path=str(tokenizer), **options)]
    logs = output.parent / f"{output.name}_logs"
    LocalPipelineExecutor(pipeline=steps, tasks=tasks, workers=1, logging_dir=str(logs)).run()
    return output


@pytest.fixture(scope="module")
def texts() -> list[list[str]]:
    """Two files' documents: real text (docstrings of the standard library), long ones included."""
    docs = sorted(stdlib_docstrings(), key=len)
    rng = np.random.default_rng(0)
    picked = [docs[i] for i in rng.choice(len(docs), size=240, replace=False)] + docs[-3:]
    return [picked[:130], picked[130:]]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, texts) -> Path:
    root = tmp_path_factory.mktemp("datatrove")
    for part, docs in enumerate(texts):
        _write_jsonl(root / "input" / f"part-{part:05d}.jsonl", [{"text": t} for t in docs])
    tokenizer = _plain_tokenizer(root / "tokenizer.json")
    return _datatrove(root / "input", root / "store", tokenizer, tasks=2)


@pytest.fixture(scope="module")
def tok():
    return resolve_tokenizer()


def _documents(store: DatatroveStore) -> list[list[int]]:
    return [store.read(doc, int(n))[0].tolist() for doc, n in enumerate(store.lengths)]


def test_the_store_holds_the_library_s_own_tokenization_of_each_file_in_task_order(store_dir, texts, tok):
    store = DatatroveStore(store_dir)
    assert [Path(f).name for f in store.files] == ["00000_unshuffled.ds", "00001_unshuffled.ds"]
    assert store.dtype == np.dtype("<u2") and store.vocab_size == VOCAB and store.pad_token_id == 0
    assert not store.has_labels
    expected = tok.encode_batch(texts[0] + texts[1])
    assert _documents(store) == expected
    assert store.lengths.dtype == np.int64 and store.lengths.tolist() == [len(e) for e in expected]
    assert max(store.lengths) > 128  # no truncation to the file's 128 tokens
    # and the tokenization cache's entry for the same two files holds the same documents in the same order
    files = sorted((store_dir.parent / "input").glob("*.jsonl"))
    cached = load_or_build(resolve_corpus(files), tok, store_dir.parent / "cache")
    assert [cached.document(i).tolist() for i in range(len(cached))] == expected


def test_lengths_and_identity_come_from_the_index_alone(store_dir, tmp_path):
    copy = shutil.copytree(store_dir, tmp_path / "copy")
    store = DatatroveStore(copy)
    lengths, identity = store.lengths.copy(), store.identity()
    assert not any({"_tokens", "_mask"} & set(f.__dict__) for f in store.files_opened)  # no token file opened yet
    for ds in copy.glob("*.ds"):  # other token bytes of the same size: the index, and so the plan, are unchanged
        ds.write_bytes(np.full(ds.stat().st_size // 2, 7, dtype="<u2").tobytes())
    again = DatatroveStore(copy)
    np.testing.assert_array_equal(again.lengths, lengths)
    assert again.identity() == identity
    assert set(again.read(0, 3)[0].tolist()) == {7}
    (copy / "00001_unshuffled.ds.index").write_bytes(np.fromfile(copy / "00001_unshuffled.ds.index", "<u8")[:-1]
                                                      .tobytes())
    (copy / "00001_unshuffled.ds.metadata").unlink()
    (copy / "00001_unshuffled.ds").write_bytes(b"\0" * 2 * int(np.fromfile(copy / "00001_unshuffled.ds.index",
                                                                         "<u8")[-1]))
    assert DatatroveStore(copy, token_size=2).identity() != identity


def test_reads_only_the_asked_tokens_and_pickles_without_its_maps(store_dir, tok, texts):
    store = DatatroveStore(store_dir)
    longest = int(np.argmax(store.lengths))
    full = store.read(longest, int(store.lengths[longest]))[0]
    ids, labels = store.read(longest, 5)
    assert ids.tolist() == full[:5].tolist() and labels is None and ids.dtype == np.int64
    assert store.read(longest, 0)[0].shape == (0,)
    clone = pickle.loads(pickle.dumps(store))
    assert not any("_tokens" in f.__dict__ for f in clone.files_opened)  # the descriptors stay in their process
    assert clone.read(longest, 7)[0].tolist() == full[:7].tolist()
    with pytest.raises(IndexError, match="holds"):
        store.read(longest, int(store.lengths[longest]) + 1)
    with pytest.raises(IndexError, match="out of range"):
        store.read(len(store), 1)
    assert store.where(len(texts[0]) + 2) == f"document 2 of {store.files[1]}"


@pytest.mark.parametrize("packing", [False, True])
def test_plans_and_micro_batches_equal_those_of_the_same_ids_as_a_list(store_dir, tmp_path, packing):
    store = DatatroveStore(store_dir)
    ids = _documents(store)
    common = {"max_tokens": 1024, "max_length": 256, "val_fraction": 0.1, "seed": 3, "packing": packing}
    stored = BalancedTextDataModule(DatatroveSource(store_dir), **common)
    listed = BalancedTextDataModule(TokenIdsSource(ids), vocab_size=VOCAB, pad_token_id=0,
                                    cache_dir=tmp_path / "cache", **common)
    for dm in (stored, listed):
        dm.prepare_data()
        dm.setup("fit")
    assert stored.vocab_size == listed.vocab_size == VOCAB
    np.testing.assert_array_equal(stored.train_dataset.lengths, listed.train_dataset.lengths)
    for num_replicas in (1, 3):
        assert stored.plan_summary(num_replicas) == listed.plan_summary(num_replicas)
    for got, want in zip(stored.train_dataloader(), listed.train_dataloader(), strict=True):
        assert got.keys() == want.keys()
        for key in got:
            if isinstance(got[key], torch.Tensor):
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
            else:
                assert got[key] == want[key], key


def test_a_loss_file_gives_the_labels_of_the_library_s_prompt_completion_records(tmp_path, tok):
    pairs = [("Question: what is two plus two? ", "Answer: four."),
             ("Translate to French: the cat. ", "Le chat."),
             ("", "A document without a prompt is every token a target."),
             ("Summarize: a long text about sampling documents by length for balanced batches. ", "Balance.")]
    rows = [{"text": p + c, **({"no_loss_ranges": [[0, len(p)]]} if p else {})} for p, c in pairs]
    _write_jsonl(tmp_path / "input" / "part-00000.jsonl", rows)
    store_dir = _datatrove(tmp_path / "input", tmp_path / "store", _plain_tokenizer(tmp_path / "tokenizer.json"),
                           tasks=1, save_loss_metadata=True)
    store = DatatroveStore(store_dir)
    assert store.has_labels
    sizes, ids, labels = encode_chunk_flat(CorpusChunk(0, pairs=pairs), tok)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for doc, (start, size) in enumerate(zip(starts.tolist(), sizes.tolist())):
        got_ids, got_labels = store.read(doc, int(store.lengths[doc]))
        assert got_ids.tolist() == ids[start:start + size].tolist()
        assert got_labels.dtype == np.int32
        assert got_labels.tolist() == labels[start:start + size].tolist()
        prompt = len(tok.encode_batch([pairs[doc][0]])[0]) if pairs[doc][0] else 0
        assert got_labels.tolist() == [IGNORE_INDEX] * prompt + got_ids[prompt:].tolist()
    # supervised targets (after the shift) from the masks, as the base class counts them from read()
    lengths = store.lengths
    expected = [int(np.count_nonzero(store.read(d, int(n))[1][1:] != IGNORE_INDEX)) for d, n in enumerate(lengths)]
    assert store.supervised_lengths(lengths).tolist() == expected
    # truncation reads the first tokens' masks only
    assert store.read(0, 3)[1].tolist() == [IGNORE_INDEX] * 3
    # the DataModule trains on the same labels as the same TokenIds given as a list
    as_list = [TokenIds(*store.read(d, int(n))) for d, n in enumerate(lengths)]
    stored = BalancedTextDataModule(DatatroveSource(store_dir), max_tokens=256, val_fraction=0)
    stored.setup("fit")
    batches = list(stored.train_dataloader())
    assert len(batches) == 1  # one micro-batch holds the four documents
    for row, index in enumerate(batches[0]["indices"].tolist()):
        want = as_list[index].labels.tolist()
        got = batches[0]["labels"][row].tolist()
        assert got[:len(want)] == want and set(got[len(want):]) <= {IGNORE_INDEX}
    assert batches[0]["step_supervised_tokens"] == sum(expected)


def test_metadata_is_datatrove_s_three_lines(store_dir):
    name, size, count = read_metadata(store_dir / "00000_unshuffled.ds.metadata")
    assert Path(name).name == "tokenizer.json" and size == 2
    assert count == int(np.fromfile(store_dir / "00000_unshuffled.ds.index", "<u8")[-1])


# -- bad input: each refused naming the file and what is wrong -----------------------------------------------------

@pytest.fixture
def broken(store_dir, tmp_path) -> Path:
    return Path(shutil.copytree(store_dir, tmp_path / "broken"))


def test_a_ds_without_its_index_is_named(broken):
    (broken / "00001_unshuffled.ds.index").unlink()
    with pytest.raises(FileNotFoundError, match=r"00001_unshuffled\.ds has no index: expected "
                                                r"00001_unshuffled\.ds\.index"):
        DatatroveStore(broken)


def test_a_folder_whose_index_names_a_missing_ds_is_refused(broken):
    # an interrupted copy: task 1's .ds is missing, its .ds.index and .ds.metadata are there
    (broken / "00001_unshuffled.ds").unlink()
    with pytest.raises(FileNotFoundError, match=r"broken': 00001_unshuffled\.ds\.index names a token file that is "
                                                r"missing \(00001_unshuffled\.ds\); the store is incomplete"):
        DatatroveStore(broken)
    assert len(DatatroveStore(broken / "00000_unshuffled.ds")) > 0  # naming the files that are there still reads


def test_a_file_named_twice_is_refused(store_dir):
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds is named twice"):
        DatatroveStore([store_dir, store_dir / "00000_unshuffled.ds"])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_ds_changed_after_setup_is_refused_naming_it(broken, tmp_path, workers):
    import os

    dm = BalancedTextDataModule(DatatroveSource(broken), max_tokens=512, max_length=64, val_fraction=0,
                                num_workers=workers, cache_dir=tmp_path / "cache")
    dm.setup("fit")
    ds = broken / "00001_unshuffled.ds"
    before = ds.stat().st_mtime_ns
    ds.write_bytes(ds.read_bytes()[::-1])  # written again in place: the same size, other tokens
    if ds.stat().st_mtime_ns == before:  # a coarse file-system clock: the write happened in the same tick
        os.utime(ds, ns=(before + 1_000_000, before + 1_000_000))
    from lit_balance.data.stores import StoreChangedError

    dm.train_sampler.set_epoch(0)
    with pytest.raises(StoreChangedError, match=rf"{ds} changed on disk after the store was opened \(modified at "):
        list(dm.train_dataloader())


def test_a_truncated_ds_is_named_with_both_sizes(broken):
    ds = broken / "00000_unshuffled.ds"
    full = ds.stat().st_size
    ds.write_bytes(ds.read_bytes()[:-6])
    tokens = full // 2
    with pytest.raises(ValueError, match=rf"00000_unshuffled\.ds: expected {tokens} tokens x 2 bytes = {full} bytes "
                                         rf".*got {full - 6} bytes"):
        DatatroveStore(broken)


def test_an_index_of_odd_size_or_decreasing_ends_is_named(broken):
    index = broken / "00000_unshuffled.ds.index"
    ends = np.fromfile(index, "<u8")
    index.write_bytes(ends.tobytes() + b"\0\0\0")
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds\.index: expected a multiple of 8 bytes"):
        DatatroveStore(broken)
    swapped = ends.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    index.write_bytes(swapped.tobytes())
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds\.index: document ends must not decrease"):
        DatatroveStore(broken)


def test_metadata_that_disagrees_is_named(broken):
    metadata = broken / "00000_unshuffled.ds.metadata"
    name, _, count = read_metadata(metadata)
    metadata.write_text(f"{name}|2\n{count + 1}\n")
    with pytest.raises(ValueError, match=rf"counts {count + 1} tokens but 00000_unshuffled\.ds\.index ends at {count}"):
        DatatroveStore(broken)
    metadata.write_text(f"{name}|4\n{count}\n")
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds: expected .* x 4 bytes"):
        DatatroveStore(broken)
    metadata.write_text("not datatrove's")
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds\.metadata: expected datatrove's \.ds\.metadata"):
        DatatroveStore(broken)
    metadata.unlink()
    with pytest.raises(ValueError, match=r"has no 00000_unshuffled\.ds\.metadata saying its token size; pass "
                                         r"token_size="):
        DatatroveStore(broken)
    assert len(DatatroveStore(broken, token_size=2)) == len(DatatroveStore(broken, token_size=2).lengths)


def test_ids_beyond_the_vocabulary_are_named_when_read(store_dir, tmp_path):
    store = DatatroveStore(store_dir, vocab_size=1000)  # the store's ids reach far beyond 1000
    plain = DatatroveStore(store_dir)
    doc = next(d for d, n in enumerate(store.lengths) if n and plain.read(d, int(n))[0].max() >= 1000)
    with pytest.raises(ValueError, match=rf"document {doc} of .*00000_unshuffled\.ds holds the id \d+, beyond the "
                                         r"vocabulary of 1000 ids"):
        store.read(doc, int(store.lengths[doc]))
    with pytest.raises(ValueError, match=r"vocab_size=70000 does not fit the store's 2-byte tokens"):
        DatatroveStore(store_dir, vocab_size=70000)
    # through the DataModule: a model vocabulary below the store's tokenizer is refused before training
    with pytest.raises(ValueError, match=r"written with a vocabulary of 30522 token ids, more than the 1000"):
        BalancedTextDataModule(DatatroveSource(store_dir), vocab_size=1000).setup("fit")


def test_loss_files_on_some_tasks_only_and_a_loss_file_of_another_length_are_named(broken):
    first = broken / "00000_unshuffled.ds"
    loss = broken / "00000_unshuffled.ds.loss"
    tokens = first.stat().st_size // 2
    loss.write_bytes(b"\1" * tokens)
    with pytest.raises(ValueError, match=r"00000_unshuffled\.ds has a \.ds\.loss label mask but .*00001_unshuffled\.ds "
                                         r"has none; pass labels=False"):
        DatatroveStore(broken)
    assert not DatatroveStore(broken, labels=False).has_labels
    with pytest.raises(FileNotFoundError, match=r"labels=True but .*00001_unshuffled\.ds has no \.ds\.loss"):
        DatatroveStore(broken, labels=True)
    loss.write_bytes(b"\1" * (tokens - 1))
    with pytest.raises(ValueError, match=rf"00000_unshuffled\.ds\.loss: expected {tokens} bytes .*got {tokens - 1}"):
        DatatroveStore(broken, labels=False)


def test_paths_that_name_no_store_are_refused(tmp_path, store_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DatatroveStore(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no \.ds file"):
        DatatroveStore(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"does not end in \.ds"):
        DatatroveStore(store_dir / "00000_unshuffled.ds.index")
    with pytest.raises(ValueError, match="is named twice"):
        DatatroveStore([store_dir, store_dir / "00000_unshuffled.ds"])
    with pytest.raises(FileNotFoundError, match=r"matches no \.ds file"):
        DatatroveStore(str(tmp_path / "*.ds"))
    one = DatatroveStore(str(store_dir / "00001_*.ds"))
    assert len(one) == len(DatatroveStore(store_dir)) - len(DatatroveStore(store_dir / "00000_unshuffled.ds"))


# -- what is read: no token byte before the first micro-batch, each rank its own micro-batches' tokens only ----------

class _Counting:
    """A memory-mapped ``.ds`` whose every slice read is recorded as ``(first token, tokens, bytes)``."""

    def __init__(self, array: np.ndarray, log: list) -> None:
        self.array, self.log = array, log

    def __getitem__(self, key):
        assert isinstance(key, slice), f"the .ds is read only by slices, got {key!r}"
        out = self.array[key]
        self.log.append((key.start, len(out), out.nbytes))
        return out


def _rank_modules(source, world_size: int, **kwargs) -> list[BalancedTextDataModule]:
    from types import SimpleNamespace

    out = []
    for rank in range(world_size):
        dm = BalancedTextDataModule(source(), max_tokens=512, val_fraction=0, seed=3, **kwargs)
        dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=0,
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={
                                         "num_replicas": world_size, "rank": rank}), accumulate_grad_batches=1)
        dm.prepare_data()
        dm.setup("fit")
        out.append(dm)
    return out


@pytest.mark.parametrize("extra", [{"max_length": 64}, {"packing": True, "max_length": 100}])
def test_each_rank_reads_only_the_tokens_of_its_micro_batches(store_dir, tmp_path, monkeypatch, extra):
    copy = Path(shutil.copytree(store_dir, tmp_path / "store"))
    log_of: dict[int, list] = {}
    current = {"rank": None}
    real_open = DatatroveFile.open_tokens

    def counting_open(self):
        return _Counting(real_open(self), log_of.setdefault(current["rank"], []))

    monkeypatch.setattr(DatatroveFile, "open_tokens", counting_open)
    before = {str(p): p.stat().st_size for p in tmp_path.rglob("*")}
    ranks = _rank_modules(lambda: DatatroveSource(copy), 2, **extra)
    assert log_of == {}  # setup planned from the .ds.index files alone
    read = []
    for rank, dm in enumerate(ranks):
        current["rank"] = rank
        dataset = dm.train_dataset
        dm.train_sampler.set_epoch(0)
        planned = [int(i) for micro_batch in dm.train_sampler for i in micro_batch]
        dm.train_sampler.set_epoch(0)
        assert list(dm.train_dataloader())
        log = log_of[rank]
        tokens = sum(int(dataset.lengths[i]) for i in planned)
        assert sum(nbytes for *_, nbytes in log) == tokens * 2  # uint16: 2 bytes a token
        assert sorted(count for _, count, _ in log) == sorted(int(dataset.lengths[i]) for i in planned)
        read.append({dataset.store_document(i) for i in planned})
    assert {str(p): p.stat().st_size for p in tmp_path.rglob("*")} == before  # nothing written
    if "packing" not in extra:  # no fill rows here: the ranks' documents are disjoint and cover the corpus
        assert not read[0] & read[1] and len(read[0] | read[1]) == len(DatatroveStore(copy))
