"""A stream (:class:`~lit_balance.stream.StreamCorpus`) as the corpus of BalancedTextDataModule, in one process: every
layout trains every document but the held-out ones once within the budget, validation holds out the first documents or
reads a finite corpus, a stop and resume through the DataModule's state (as JSON) trains each document once, and every
setting that cannot apply to a stream is refused at construction, naming both settings, before any token is read.
Real ranks: ``tests/ddp/test_stream_dm_ddp.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, BatchingSettings, Mixture
from lit_balance.data.training_sampler import training_sampler_of, use_training_stream
from lit_balance.lightning.callbacks._common import needed_sampler
from lit_balance.stream import StreamCorpus

VOCAB, N = 64, 90


def documents(n=N, seed=0):
    def read():
        rng = np.random.default_rng(seed)
        for _ in range(n):
            yield rng.integers(1, VOCAB, int(rng.integers(2, 40)))
    return read


def unread():
    raise AssertionError("the stream was read")


def datamodule(tmp_path, source=None, **kwargs):
    kwargs = {"max_tokens": 96, "vocab_size": VOCAB, "pad_token_id": 0, "window_documents": 24, "max_length": None,
              "cache_dir": tmp_path / "cache", **kwargs}
    return BalancedTextDataModule(StreamCorpus(documents() if source is None else source), **kwargs)


def trained(batches):
    return [i for b in batches for i, f in zip(b["indices"].tolist(), b["is_fill"].tolist()) if not f]


LAYOUTS = {
    "padded": {},
    "packed": {"packing": True},
    "static_packed": {"packing": True, "static_packing": True},
    "padded_shapes": {"padded_shapes": 2},
}


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_trains_each_document_once_within_the_budget(tmp_path, layout, accumulate):
    settings = BatchingSettings(max_tokens=96, accumulate_grad_batches=accumulate, **LAYOUTS[layout])
    dm = datamodule(tmp_path, settings=settings, val_documents=7)
    dm.prepare_data()
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sorted(trained(batches)) == list(range(7, N))  # the held-out 7 validate and never train
    if layout.startswith("padded"):
        assert all(b["input_ids"].numel() <= 96 for b in batches)
    else:
        assert all(b["input_ids"].shape[0] == 1 and b["input_ids"].shape[1] <= 96 for b in batches)
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    if layout == "static_packed":
        assert shapes == {(1, 96)}
    if layout == "padded_shapes":
        assert len(shapes) <= 2
    assert all(b["step_real_tokens"] >= int(b["num_real_tokens"]) > 0 for b in batches)  # the step's sums
    assert dm.val_names == ["train"] and len(dm.val_dataloader()) == 1
    assert sorted(trained(dm.val_dataloader()[0])) == list(range(7))  # the validation split's own positions


def test_a_separate_finite_corpus_validates_and_the_stream_trains_whole(tmp_path):
    val = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    dm = datamodule(tmp_path, val_corpus=val)
    dm.prepare_data()
    dm.setup("fit")
    assert sorted(trained(dm.train_dataloader())) == list(range(N))
    (loader,) = dm.val_dataloader()
    assert sorted(ids for b in loader for ids in b["input_ids"].tolist() for ids in [tuple(t for t in ids if t)]) \
        == sorted(tuple(v) for v in val)


def test_no_validation_without_val_documents_or_val_corpus(tmp_path):
    dm = datamodule(tmp_path)
    dm.setup("fit")
    assert dm.val_dataloader() == [] and dm.val_names == []


@pytest.mark.parametrize("stop_after", [1, 5, 13])
def test_a_stop_and_resume_through_the_datamodule_state_trains_each_document_once(tmp_path, stop_after):
    first = datamodule(tmp_path, val_documents=4, settings=BatchingSettings(max_tokens=96, accumulate_grad_batches=2))
    first.setup("fit")
    loader = iter(first.train_dataloader())
    head = [next(loader) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # plain types
    second = datamodule(tmp_path, val_documents=4, settings=BatchingSettings(max_tokens=96, accumulate_grad_batches=2))
    second.setup("fit")
    second.load_state_dict(state)
    rest = list(second.train_dataloader())
    assert sorted(trained(head) + trained(rest)) == list(range(4, N))


def test_a_resume_with_other_held_out_documents_is_refused_naming_them(tmp_path):
    first = datamodule(tmp_path, val_documents=4)
    first.setup("fit")
    next(iter(first.train_dataloader()))
    second = datamodule(tmp_path, val_documents=5)
    with pytest.raises(ValueError, match=r"held_out: saved 4, now 5"):
        second.load_state_dict(first.state_dict())


def test_the_datamodule_leaves_the_users_stream_as_it_was(tmp_path):
    corpus = StreamCorpus(documents(), max_length=30)
    dm = BalancedTextDataModule(corpus, max_tokens=96, vocab_size=VOCAB, pad_token_id=0, window_documents=24,
                                max_length=20, cache_dir=tmp_path)
    dm.setup("fit")
    assert max(int(b["num_real_tokens"]) for b in dm.train_dataloader()) > 0
    assert corpus.max_length == 30 and dm.stream.corpus(dm).max_length == 20  # the smaller cut, on a copy


def test_text_jsonl_files_are_tokenized_by_the_datamodules_tokenizer(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 9 + 1)}) + "\n" for i in range(40)))
    dm = BalancedTextDataModule(StreamCorpus(path), max_tokens=256, window_documents=16, cache_dir=tmp_path / "c")
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sorted(trained(batches)) == list(range(40)) and dm.vocab_size == 30522
    assert all(int(b["input_ids"].max()) < dm.vocab_size for b in batches)


REFUSED = [  # (keywords, the settings the message names)
    ({"max_tokens": [96, 96]}, ["max_tokens", "stream"]),
    ({"max_tokens": "auto", "memory_limit": 2**31}, ["max_tokens='auto'", "stream"]),
    ({"num_workers": 2}, ["num_workers=2", "stream"]),
    ({"val_fraction": 0.1}, ["val_fraction=0.1", "stream", "val_documents"]),
    ({"drop_last": True}, ["drop_last=True", "stream"]),
    ({"too_long": "skip"}, ["too_long='skip'", "stream", "max_length"]),
    ({"skip_steps": [(1, 2)]}, ["skip_steps", "stream"]),
    ({"val_documents": 3, "val_corpus": [[1, 2]]}, ["val_documents=3", "val_corpus"]),
    ({"max_documents": 10}, ["max_documents=10", "StreamCorpus", "max_steps"]),
]


@pytest.mark.parametrize("kwargs,named", REFUSED, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(REFUSED)])
def test_settings_that_cannot_apply_to_a_stream_are_refused_before_any_token_is_read(tmp_path, kwargs, named):
    with pytest.raises(ValueError) as error:
        datamodule(tmp_path, source=unread, **kwargs)
    for name in named:
        assert name in str(error.value)


@pytest.mark.parametrize("setting", ["window_documents", "val_documents", "val_corpus"])
def test_a_stream_setting_beside_a_finite_corpus_is_refused_naming_both(tmp_path, setting):
    value = [[1, 2]] if setting == "val_corpus" else 8
    with pytest.raises(ValueError, match=rf"{setting}=.*finite.*leave {setting}=None"):
        BalancedTextDataModule(["a b", "c d"], **{setting: value}, cache_dir=tmp_path)


def test_a_mixture_holding_a_stream_is_refused_naming_the_stream_and_the_finite_component(tmp_path):
    mixture = Mixture({"web": (StreamCorpus(unread), 1), "code": ([[1, 2], [3]], 1)})
    with pytest.raises(ValueError, match=r"component 'web' is a stream .*'code' is finite.*Mixture"):
        BalancedTextDataModule(mixture, vocab_size=VOCAB, pad_token_id=0, cache_dir=tmp_path)


def test_a_window_smaller_than_an_optimizer_step_is_refused_naming_both(tmp_path):
    dm = datamodule(tmp_path, window_documents=2, settings=BatchingSettings(max_tokens=96, accumulate_grad_batches=3))
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"window_documents=2 .*accumulate_grad_batches=3"):
        dm.train_dataloader()


def test_what_needs_a_plan_of_the_epoch_names_the_stream(tmp_path):
    dm = datamodule(tmp_path)
    dm.setup("fit")
    trainer = SimpleNamespace(train_dataloader=None)
    use_training_stream(trainer, dm.stream.description)  # what dm.train_dataloader() does under a Trainer
    assert training_sampler_of(trainer) is None
    with pytest.raises(RuntimeError, match=r"StragglerMonitor .*stream \(stream of function.*remove StragglerMonitor"):
        needed_sampler(trainer, "StragglerMonitor")
    with pytest.raises(RuntimeError, match="has no training sampler"):
        dm.training_sampler(dm.settings, 2)
    with pytest.raises(RuntimeError, match="has no plan before training"):
        dm.plan_summary(2)


def test_adaptive_accumulation_is_refused_with_a_stream_naming_both(tmp_path):
    from lit_balance.callbacks import AdaptiveGradAccumulation

    trainer = SimpleNamespace(train_dataloader=None, accumulate_grad_batches=1, callbacks=[],
                              strategy=SimpleNamespace(handles_gradient_accumulation=False))
    use_training_stream(trainer, "stream of 1 file(s): a.jsonl")
    callback = AdaptiveGradAccumulation(target_tokens_per_step=1000)
    with pytest.raises(ValueError, match=r"AdaptiveGradAccumulation .*stream \(stream of 1 file.*accumulate_grad_batches"):
        callback.on_train_start(trainer, SimpleNamespace(automatic_optimization=True))


def test_a_hugging_face_iterable_dataset_resumes_through_the_datamodule(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(3)
    rows = [{"input_ids": rng.integers(1, VOCAB, int(rng.integers(2, 40))).tolist()} for _ in range(N)]
    shards = [rows[:40], rows[40:44], rows[44:]]  # one shard 10x shorter

    def stream():
        return datasets.IterableDataset.from_generator(
            lambda shards: (row for shard in shards for row in shard), gen_kwargs={"shards": shards})

    first = datamodule(tmp_path, source=stream(), val_documents=5)
    first.setup("fit")
    loader = iter(first.train_dataloader())
    head = [next(loader) for _ in range(7)]
    state = first.state_dict()
    second = datamodule(tmp_path, source=stream(), val_documents=5)
    second.setup("fit")
    second.load_state_dict(state)
    assert state["stream"]["position"] is not None  # the dataset's own state_dict at the window: a resume seeks there
    rest = list(second.train_dataloader())
    assert sorted(trained(head) + trained(rest)) == list(range(5, N))


def test_an_empty_state_saved_before_training_starts_the_stream_from_its_start(tmp_path):
    first = datamodule(tmp_path, val_documents=3)
    first.setup("fit")
    state = first.state_dict()
    assert state == {}
    second = datamodule(tmp_path, val_documents=3)
    second.setup("fit")
    second.load_state_dict(state)
    assert sorted(trained(second.train_dataloader())) == list(range(3, N))
    with pytest.raises(ValueError, match=r"keys \['data', 'stream'\]"):
        second.load_state_dict({"train_sampler": {}})


def test_the_streams_own_tokenizer_tokenizes_and_a_second_one_is_refused(tmp_path):
    from lit_balance.data.tokenizer import resolve_tokenizer

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(8)))
    own = resolve_tokenizer(None)
    dm = BalancedTextDataModule(StreamCorpus(path, tokenizer=own), max_tokens=64, window_documents=8,
                                cache_dir=tmp_path)
    assert dm.tokenizer is own
    with pytest.raises(ValueError, match="tokenizer is given to both the StreamCorpus and BalancedTextDataModule"):
        BalancedTextDataModule(StreamCorpus(path, tokenizer=own), tokenizer=resolve_tokenizer(None), max_tokens=64,
                               cache_dir=tmp_path)


def test_the_plan_command_refuses_a_stream_naming_it(tmp_path, capsys):
    from lit_balance.cli.app import main

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(8)))
    corpus = json.dumps({"_target_": "lit_balance.stream.StreamCorpus", "source": str(path)})
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--corpus", corpus, "--cache-dir", str(tmp_path / "c"), "--output-dir", str(tmp_path / "o")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "lit-balance plan previews the plan of a finite corpus" in err and "stream of 1 file(s): a.jsonl" in err
    assert not (tmp_path / "c").exists()  # refused before any token is read
