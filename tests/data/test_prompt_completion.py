"""Prompt–completion records and masked labels: tokenization, the cache's labels array, and an exact plan divisor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BalancedTextDataModule, PadCollator, TokenDataset
from lit_balance.data.cache import load_or_build
from lit_balance.data.records import encode_chunk, supervised_counts
from lit_balance.data.sources import CorpusChunk, resolve_corpus
from lit_balance.data.tokenizer import resolve_tokenizer
from lit_balance.lightning.loss import token_loss_sum


@pytest.fixture(scope="module")
def tok():
    return resolve_tokenizer()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_prompt_completion_records_mask_the_prompt_tokens(tmp_path, tok):
    records = [{"prompt": "what is the cat", "completion": " a small animal"},
               {"prompt": "say hi", "completion": " hello there friend"}]
    corpus = load_or_build(resolve_corpus(_jsonl(tmp_path / "pc.jsonl", records)), tok, tmp_path / "cache")
    assert corpus.labels is not None and corpus.labels.dtype == np.int32
    for i, r in enumerate(records):
        full = tok.encode_batch([r["prompt"] + r["completion"]])[0]
        prompt = tok.encode_batch([r["prompt"]])[0]
        ids = corpus.document(i).tolist()
        labels = corpus.labels[corpus.offsets[i]:corpus.offsets[i + 1]].tolist()
        assert ids == full
        assert labels == [-100] * len(prompt) + full[len(prompt):]


def test_text_and_prompt_completion_records_mix_in_one_file(tmp_path, tok):
    records = [{"text": "plain text here"}, {"prompt": "q", "completion": " answer"}, {"text": "more text"}]
    corpus = load_or_build(resolve_corpus(_jsonl(tmp_path / "mix.jsonl", records)), tok, tmp_path / "cache")
    label = [corpus.labels[corpus.offsets[i]:corpus.offsets[i + 1]].tolist() for i in range(3)]
    assert label[0] == corpus.document(0).tolist() and label[2] == corpus.document(2).tolist()
    assert label[1][0] == -100 and label[1][1:] == corpus.document(1).tolist()[1:]


def test_a_plain_jsonl_corpus_keeps_its_cache_entry_layout(tmp_path, tok):
    corpus = load_or_build(resolve_corpus(_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])), tok, tmp_path / "c")
    assert corpus.labels is None
    (entry,) = [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    assert sorted(json.loads((entry / "meta.json").read_text())["sha256"]) == [
        "offsets.npy", "source_index.npy", "token_ids.npy"]


@pytest.mark.parametrize(("record", "match"), [
    ({"prompt": "only a prompt"}, r"line 1: no key 'text' and no 'prompt'/'completion' pair"),
    ({"prompt": "p", "completion": 5}, r"line 1: 'completion' is int, expected a string"),
])
def test_bad_prompt_completion_records_are_named(tmp_path, tok, record, match):
    with pytest.raises(ValueError, match=match):
        load_or_build(resolve_corpus(_jsonl(tmp_path / "bad.jsonl", [record])), tok, tmp_path / "cache")


def test_load_texts_of_prompt_completion_records_points_to_iter_chunks(tmp_path):
    source = resolve_corpus(_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}]))
    with pytest.raises(TypeError, match="prompt–completion.*iter_chunks"):
        source.load_texts()


class _MergingTokenizer:
    """Ids of characters; "ab" is one token, so a prompt ending in "a" merges with a completion starting "b"."""

    def encode_batch(self, texts):
        out = []
        for text in texts:
            ids, i = [], 0
            while i < len(text):
                if text[i:i + 2] == "ab":
                    ids.append(1000)
                    i += 2
                else:
                    ids.append(ord(text[i]))
                    i += 1
            out.append(ids)
        return out


def test_a_token_merged_across_the_prompt_boundary_carries_loss():
    (ids,), (labels,) = encode_chunk(CorpusChunk(0, pairs=[("xa", "bc")]), _MergingTokenizer())
    assert ids.tolist() == [ord("x"), 1000, ord("c")]
    assert labels.tolist() == [-100, 1000, ord("c")]  # the prompt's own tokens are [x, a]: only x is a prefix


def test_special_tokens_around_a_prompt_completion_record(tmp_path):
    tok = resolve_tokenizer(add_special_tokens=True)  # BERT: [CLS] ... [SEP]
    (ids,), (labels,) = encode_chunk(CorpusChunk(0, pairs=[("hello", " world")]), tok)
    assert ids.tolist() == [101, 7592, 2088, 102]
    assert labels.tolist() == [-100, -100, 2088, 102]


def test_the_data_module_batches_carry_the_labels_and_the_exact_divisor(tmp_path):
    records = [{"prompt": f"question number {i} reads", "completion": " answer" * (1 + i % 4)} for i in range(12)]
    dm = BalancedTextDataModule(_jsonl(tmp_path / "pc.jsonl", records), max_tokens=64, val_fraction=0,
                                cache_dir=tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    total = 0
    for batch in dm.train_dataloader():
        _, n = token_loss_sum(torch.zeros(*batch["labels"].shape, dm.vocab_size), batch["labels"])
        assert batch["step_supervised_tokens"] < batch["step_real_tokens"] - batch["step_rows"]
        total += n
        assert n == batch["step_supervised_tokens"]  # accumulate_grad_batches=1 on one rank: one micro-batch a step
    assert total == sum(1 + i % 4 for i in range(12))


def test_supervised_counts_follow_the_shift():
    labels = np.array([-100, 5, -100, 7, 8, -100, 9])
    offsets = np.array([0, 4, 7])
    # doc 0: labels 1..3 -> 5, -100, 7 -> 2 ; doc 1 cut to 2 tokens: label 1 -> -100 -> 0 ; doc 0 cut to 1 -> 0
    assert supervised_counts(labels, offsets, np.array([0, 1, 0]), np.array([4, 2, 1])).tolist() == [2, 0, 0]
    assert supervised_counts(None, offsets, np.array([0, 1]), np.array([4, 3])).tolist() == [3, 2]


def test_the_sampler_checks_supervised_lengths():
    with pytest.raises(ValueError, match=r"supervised_lengths\[1\] = 3 is outside \[0, 2\]"):
        BalancedBatchSampler([4, 3], 16, num_replicas=1, rank=0, supervised_lengths=[1, 3])
    with pytest.raises(ValueError, match="has 1 entries but lengths has 2"):
        BalancedBatchSampler([4, 3], 16, num_replicas=1, rank=0, supervised_lengths=[1])
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        BalancedBatchSampler([4, 3], 16, num_replicas=1, rank=0, supervised_lengths=[1.5, 1.0])


@st.composite
def _masked_corpora(draw):
    n = draw(st.integers(1, 30))
    lengths = draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    total = sum(lengths)
    mask = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    return np.array(lengths), np.array(mask)


@settings(max_examples=60, deadline=None)
@given(corpus=_masked_corpora(), max_tokens=st.integers(24, 80), world=st.integers(1, 3),
       accumulate=st.integers(1, 3), max_length=st.sampled_from([None, 5, 11]),
       too_long=st.sampled_from(["error", "truncate"]), drop_last=st.booleans(), seed=st.integers(0, 3))
def test_every_step_divisor_equals_the_targets_the_loss_counts_over_all_ranks(corpus, max_tokens, world, accumulate,
                                                                              max_length, too_long, drop_last, seed):
    lengths, mask = corpus
    token_ids = np.arange(lengths.sum()) % 50 + 1
    labels = np.where(mask, token_ids, -100)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ds = TokenDataset(token_ids, offsets, np.arange(len(lengths)), max_length, labels=labels)
    if too_long == "truncate":
        max_tokens = min(max_tokens, int(ds.lengths.max()))  # some rows are cut by the sampler and the collator
    elif ds.lengths.max() > max_tokens:
        max_tokens = int(ds.lengths.max())
    kwargs = dict(max_tokens=max_tokens, accumulate_grad_batches=accumulate, too_long=too_long, drop_last=drop_last,
                  seed=seed)
    try:
        probe = BalancedBatchSampler(ds.lengths, num_replicas=world, rank=0, **kwargs)
    except ValueError as error:  # drop_last=True with too few samples for every rank: refused, nothing to plan
        assume("leaves no micro-batch" not in str(error))
        raise
    cut = probe.truncate_to if too_long == "truncate" else None
    supervised = ds.supervised_lengths(cut)
    collate = PadCollator(0, max_length=cut)
    counted, planned = {}, {}
    for rank in range(world):
        sampler = BalancedBatchSampler(ds.lengths, num_replicas=world, rank=rank, supervised_lengths=supervised,
                                       **kwargs)
        for t, micro_batch in enumerate(sampler):
            batch = collate(ds[micro_batch])
            _, n = token_loss_sum(torch.zeros(*batch["labels"].shape, 51), batch["labels"])
            window = t // accumulate
            counted[window] = counted.get(window, 0) + n
            planned.setdefault(window, set()).add(batch["step_supervised_tokens"])
    assert all(len(v) == 1 for v in planned.values())
    assert {w: v.pop() for w, v in planned.items()} == counted


def test_labels_start_late_in_a_streamed_build_and_cover_every_token(tmp_path, tok, monkeypatch):
    from lit_balance.data import cache as cache_module
    from lit_balance.data.sources import base as base_module

    monkeypatch.setattr(base_module, "_CHUNK_DOCS", 2)  # several chunks of text before the first labelled one
    monkeypatch.setattr(cache_module, "_HASH_BLOCK", 3)  # the tokens before it are copied in several blocks
    records = [{"text": f"plain document number {i}"} for i in range(5)]
    records += [{"prompt": "ask", "completion": " reply one"}, {"text": "after"}, {"prompt": "q", "completion": " a"}]
    corpus = load_or_build(resolve_corpus(_jsonl(tmp_path / "late.jsonl", records)), tok, tmp_path / "cache")
    expected = []
    for r in records:
        if "text" in r:
            expected += tok.encode_batch([r["text"]])[0]
        else:
            full, prompt = tok.encode_batch([r["prompt"] + r["completion"], r["prompt"]])
            expected += [-100] * len(prompt) + full[len(prompt):]
    assert corpus.labels.tolist() == expected


@settings(max_examples=40, deadline=None)
@given(corpus=_masked_corpora(), old=st.integers(1, 4), new=st.integers(1, 4), accumulate=st.integers(1, 3),
       cut=st.floats(0, 1))
def test_a_resume_on_another_number_of_ranks_keeps_each_windows_exact_divisor(corpus, old, new, accumulate, cut):
    lengths, mask = corpus
    supervised = np.array([int(m[1:n].sum()) for m, n in zip(np.split(mask, np.cumsum(lengths)[:-1]), lengths)])
    kwargs = dict(max_tokens=max(32, int(lengths.max())), accumulate_grad_batches=accumulate, seed=1,
                  supervised_lengths=supervised)
    before = [BalancedBatchSampler(lengths, num_replicas=old, rank=r, **kwargs) for r in range(old)]
    k = int(cut * len(before[0]))
    iterators = [iter(s) for s in before]
    steps = [[next(it) for it in iterators] for _ in range(k)]  # epoch micro-step t -> every rank's micro-batch
    if k == len(before[0]):
        return
    state = before[0].state_dict()
    after = [BalancedBatchSampler(lengths, num_replicas=new, rank=r, **kwargs) for r in range(new)]
    for s in after:
        s.load_state_dict(state)
    steps += [list(column) for column in zip(*[list(s) for s in after])]
    for lo in range(0, len(steps), accumulate):
        hi = min(lo + accumulate, len(steps))
        targets = sum(int(supervised[i]) for step in steps[lo:hi] for b in step for i, f in zip(b, b.is_fill)
                      if not f)
        # micro-batches yielded before the cut were planned without knowing of it: checked for windows ending before
        for t in range(max(lo, k) if hi > k else lo, hi):
            assert {b.step_supervised_tokens for b in steps[t]} == {targets}
