"""The stream's sources: iterables, a Hugging Face IterableDataset of unequal shards and text / JSONL files, read
lazily in one order, resumed by seeking where the source can and by skipping (said on stderr) where it cannot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lit_balance import BatchingSettings
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.stream import StreamBatches, StreamCorpus

from threaded import run_ranks

datasets = pytest.importorskip("datasets")

SHARDS = [120, 12, 120]  # one shard 10x shorter than the others


def _rows(shards):
    for shard in shards:
        rng = np.random.default_rng(shard)
        for i in range(SHARDS[shard]):
            yield {"input_ids": [shard + 1] * int(rng.integers(1, 60)), "doc": f"{shard}/{i}"}


def hf_stream():
    return datasets.IterableDataset.from_generator(_rows, gen_kwargs={"shards": list(range(len(SHARDS)))})


def write_files(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for k, count in enumerate((70, 7, 50)):
        if k == 1:
            path = tmp_path / "b.txt"
            path.write_text("".join(" ".join(["word"] * int(rng.integers(1, 30))) + "\n\n" for _ in range(count)))
        else:
            path = tmp_path / f"{'ac'[k // 2]}.jsonl"
            path.write_text("".join(json.dumps({"text": " ".join(["hello"] * int(rng.integers(1, 30)))}) + "\n"
                                    for _ in range(count)))
        paths.append(path)
    return paths


def _trained(out):
    return sorted(i for run in out["batches"] for idx, fills, _, _ in run for i, f in zip(idx, fills) if not f)


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_an_hf_iterable_dataset_of_unequal_shards_trains_every_row_once_with_equal_counts(num_replicas):
    assert hf_stream().num_shards == 3
    make = lambda rank: StreamBatches(StreamCorpus(hf_stream()), BatchingSettings(max_tokens=128, packing=True),
                                      window_documents=24, num_replicas=num_replicas, rank=rank)
    out = run_ranks(make, num_replicas)
    assert out["errors"] == [None] * num_replicas
    assert len({len(r) for r in out["batches"]}) == 1
    assert _trained(out) == list(range(sum(SHARDS)))


def test_an_hf_stream_resumes_on_another_world_by_seeking_its_own_state(capfd):
    # each rank its own dataset object, as in its own process
    make = lambda n: lambda rank: StreamBatches(StreamCorpus(hf_stream()), BatchingSettings(max_tokens=128),
                                                window_documents=24, num_replicas=n, rank=rank)
    first = run_ranks(make(4), 4, stop_after=20)
    state = first["states"][0]
    assert state["start"] > 0 and state["position"] is not None  # the dataset's own state_dict at the window start
    second = run_ranks(make(3), 3, state=state, stop_after=9)
    third = run_ranks(make(4), 4, state=second["states"][0])  # a second resume seeks again (datasets #8308)
    assert second["states"][0]["start"] > state["start"]
    assert sorted(_trained(first) + _trained(second) + _trained(third)) == list(range(sum(SHARDS)))
    assert "skipping" not in capfd.readouterr().err


def test_files_are_read_lazily_in_order_and_resume_at_a_byte_offset(tmp_path, capfd):
    paths = write_files(tmp_path)
    corpus = StreamCorpus(paths)
    texts = [t for _, t in zip(range(200), corpus.reader()._raw(200))]
    assert len(texts) == 127 and isinstance(texts[0], dict) and isinstance(texts[70], str)
    make = lambda n: lambda rank: StreamBatches(StreamCorpus(paths), BatchingSettings(max_tokens=64),
                                                window_documents=12, num_replicas=n, rank=rank)
    whole = run_ranks(make(2), 2)
    assert _trained(whole) == list(range(127))
    first = run_ranks(make(2), 2, stop_after=9)
    assert set(first["states"][0]["position"]) == {"file", "offset"}
    second = run_ranks(make(4), 4, state=first["states"][0])
    assert sorted(_trained(first) + _trained(second)) == list(range(127))
    assert "skipping" not in capfd.readouterr().err


def test_a_reader_from_a_seek_position_reads_what_follows():
    source = hf_stream()
    corpus = StreamCorpus(source)
    reader = corpus.reader()
    reader.read(30)
    position = reader.position()
    after = [ids.tolist() for _, ids in reader.read(20)]
    again = corpus.reader(position, 30)
    assert [ids.tolist() for _, ids in again.read(20)] == after and again.next_document == 50


@pytest.mark.parametrize("source, error, match", [
    (42, InputTypeError, "iterable of documents"),
    ({"text": "a"}, InputTypeError, "dict"),
])
def test_a_source_that_is_not_a_stream_is_refused(source, error, match):
    with pytest.raises(error, match=match):
        StreamCorpus(source)


def test_a_missing_or_unknown_file_is_refused(tmp_path):
    with pytest.raises(InputValueError, match="does not exist"):
        StreamCorpus(tmp_path / "none.jsonl")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(InputValueError, match="suffix '.csv'"):
        StreamCorpus([tmp_path / "x.csv"])


def test_an_hf_stream_stopped_in_its_first_window_after_an_earlier_pass_resumes_from_its_start():
    source = hf_stream()
    corpus = StreamCorpus(source)
    assert len(corpus.head(200)) == 200  # an earlier pass over the same dataset object leaves its state behind
    make = lambda: StreamBatches(corpus, BatchingSettings(max_tokens=128), window_documents=64, num_replicas=1,
                                 rank=0)
    first = make()
    done = [i for _, b in zip(range(3), first) for i in b["indices"].tolist()]
    state = first.state_dict()
    assert state["window"] == 0
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for b in resumed for i in b["indices"].tolist()]
    assert sorted(done + rest) == list(range(sum(SHARDS)))


def test_a_stream_state_loads_with_weights_only_and_as_json(tmp_path):
    import io

    import torch

    batches = StreamBatches(StreamCorpus(hf_stream()), BatchingSettings(max_tokens=128), window_documents=24,
                            num_replicas=1, rank=0)
    for _, _batch in zip(range(30), batches):
        pass
    state = batches.state_dict()
    assert state["position"] is not None and state["trained"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state == json.loads(json.dumps(state))


def test_a_rank_parses_only_the_jsonl_lines_it_tokenizes(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"line {p}"}) if p % 2 == 0 else "{not json" for p in range(9)]
    path.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")  # a blank line is no document
    corpus = StreamCorpus(path)
    read = corpus.reader().read(9, tokenize=lambda p: p % 2 == 0)  # the even lines are this rank's
    assert [p for p, _ in read] == list(range(9))
    assert [ids is None for _, ids in read] == [p % 2 == 1 for p in range(9)]  # the others' lines are not parsed
    with pytest.raises(ValueError, match="is not JSON"):
        StreamCorpus(path).reader().read(9, tokenize=lambda p: p % 2 == 1)
