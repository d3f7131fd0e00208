"""The edges of a mixture, in one process: component order never decides the tokenizer, the same documents in two
components are refused, component names cannot make logged keys collide, weights resume as shares, errors name the
component, a max_repetition too large to plan is refused before planning, and too-long advice follows the settings
given."""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.data.stores import ArrowSource
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.data.vocabulary import components_vocabulary
from lit_balance.lightning.callbacks.mixture import component_keys
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.sampler.mixture import MixtureBatchSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from _stores import documents, write_arrow_ipc_file  # noqa: E402


def _jsonl(path: Path, num: int = 40) -> Path:
    path.write_text("".join(json.dumps({"text": f"document number {i} has some words"}) + "\n" for i in range(num)))
    return path


# ---- component order ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", [("store", "text"), ("text", "store")])
def test_a_store_and_a_jsonl_train_with_the_tokenizer_whatever_their_order(tmp_path, order):
    store = write_arrow_ipc_file(tmp_path / "ids.arrow", documents(60))
    text = _jsonl(tmp_path / "t.jsonl")
    components = {"store": (ArrowSource([str(store)]), 1), "text": (text, 1)}
    dm = BalancedTextDataModule(Mixture({name: components[name] for name in order}), vocab_size=30522,
                                pad_token_id=0, max_tokens=512, val_fraction=0, cache_dir=tmp_path / "cache")
    dm.setup("fit")
    builtin = resolve_tokenizer()
    assert dm.tokenizer.fingerprint == builtin.fingerprint  # the tokenizer encodes the text, either order
    corpus = dm.corpora[order.index("text")]
    assert np.asarray(corpus.lengths).tolist() == [len(ids) for ids in builtin.encode_batch(
        [json.loads(line)["text"] for line in text.read_text().splitlines()])]
    assert len(dm.corpora[order.index("store")]) == sum(1 for d in documents(60) if d)


@pytest.mark.parametrize("text_first", [True, False])
def test_components_vocabulary_returns_the_one_that_encodes_text_in_any_order(text_first):
    ids, text = TokenizerAdapter.for_token_ids(vocab_size=30522, pad_token_id=0), resolve_tokenizer()
    adapters, names = ([text, ids], ["t", "i"]) if text_first else ([ids, text], ["i", "t"])
    assert components_vocabulary(names, adapters) is text
    other = TokenizerAdapter.for_token_ids(vocab_size=100, pad_token_id=0)
    with pytest.raises(ValueError, match=r"components 't' and 'o' differ in vocabulary"):
        components_vocabulary([*names, "o"], [*adapters, other])


# ---- the same documents in two components -------------------------------------------------------------------------
def test_the_same_store_file_in_two_components_is_refused_naming_both_and_the_file(tmp_path):
    store = write_arrow_ipc_file(tmp_path / "ids.arrow", documents(30))
    os.link(store, tmp_path / "link.arrow")  # one file under another name
    for second in (store, tmp_path / "link.arrow"):
        mixture = Mixture({"web": (ArrowSource([str(store)]), 1), "again": (ArrowSource([str(second)]), 1)})
        with pytest.raises(ValueError, match=r"components 'web' and 'again' both read the file .*link\.arrow|"
                                             r"components 'web' and 'again' both read the file .*ids\.arrow") as err:
            BalancedTextDataModule(mixture, vocab_size=500, pad_token_id=0, cache_dir=tmp_path / "c")
        assert "twice per epoch" in str(err.value) and err.value.parameter == "components.again"
    other = write_arrow_ipc_file(tmp_path / "other.arrow", documents(30, seed=1))
    BalancedTextDataModule(Mixture({"web": (ArrowSource([str(store)]), 1), "b": (ArrowSource([str(other)]), 1)}),
                           vocab_size=500, pad_token_id=0, cache_dir=tmp_path / "c")


def test_the_same_text_file_or_list_in_two_components_is_refused(tmp_path):
    text = _jsonl(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match=re.escape(f"components 'a' and 'b' both read the file {str(text)!r}")):
        BalancedTextDataModule(Mixture({"a": (text, 1), "b": ([text, _jsonl(tmp_path / "u.jsonl")], 1)}),
                               cache_dir=tmp_path / "c")
    docs = ["one two", "three four"]
    with pytest.raises(ValueError, match=r"components 'a' and 'b' are the same corpus \(one list object"):
        BalancedTextDataModule(Mixture({"a": (docs, 1), "b": (docs, 2)}), cache_dir=tmp_path / "c")
    BalancedTextDataModule(Mixture({"a": (docs, 1), "b": (list(docs), 2)}), cache_dir=tmp_path / "c")  # a copy


# ---- names and logged keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, match", [
    ("web_rank0", r"'web_rank0' ends in '_rank<digits>'.*component 'web' on rank 0; rename it \(e.g. 'web_r0'\)"),
    ("x_rank12", r"'x_rank12' ends in '_rank<digits>'"),
    ("", r"component name '' must be a non-empty string"),
    ("a/b", r"component name 'a/b' must be a non-empty string without '/'"),
    (" web", r"component name ' web' must be .* without '/' or leading and trailing spaces"),
])
def test_names_that_make_keys_ambiguous_are_refused_at_construction(name, match):
    with pytest.raises(ValueError, match=match):
        Mixture({"web": (["a b"], 1), name: (["c"], 1)})


def test_a_name_used_twice_is_refused():
    with pytest.raises(ValueError, match=r"component name 'web' is used twice"):
        MixtureSettings(("web", "web"), (1, 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="ab_rnk01", min_size=1, max_size=6),
                          st.one_of(st.just(""), st.integers(0, 12).map("_rank{}".format))),
                min_size=1, max_size=5, unique=True),
       st.integers(1, 12))
def test_the_keys_of_any_accepted_names_never_collide(parts, num_replicas):
    names = list(dict.fromkeys(base + suffix for base, suffix in parts))
    try:
        MixtureSettings(tuple(names), (1.0,) * len(names))
    except ValueError:
        assert any(re.search(r"_rank\d+$", n) or n != n.strip() for n in names)
        return
    keys = component_keys(names, num_replicas)
    assert len(keys) == len(set(keys))


# ---- weights resume as shares --------------------------------------------------------------------------------------
def _sampler(weights, world=2, rank=0, **kwargs):
    rng = np.random.default_rng(0)
    sizes = [40, 30, 20]
    lengths = np.concatenate([rng.integers(4, 40, size=n) for n in sizes])
    mixture = MixtureSettings(("web", "code", "books"), tuple(weights))
    return MixtureBatchSampler(lengths, sizes, mixture, max_tokens=128, num_replicas=world, rank=rank, seed=5,
                               **kwargs)


@pytest.mark.parametrize("before, after", [((0.5, 0.2, 0.3), (5, 2, 3)), ((51, 38, 31), (0.51, 0.38, 0.31))])
def test_weights_at_another_scale_resume_exactly(before, after):
    mine, theirs = (MixtureSettings(("web", "code", "books"), w).shares for w in (before, after))
    assert np.allclose(mine, theirs, rtol=1e-12)  # the second pair's shares differ in their last bits
    uninterrupted = _sampler(before)
    whole = list(uninterrupted)
    stopped = _sampler(before)
    it = iter(stopped)
    head = [next(it) for _ in range(3)]
    state = stopped.state_dict(batches_consumed=3)
    resumed = _sampler(after)
    resumed.load_state_dict(state)
    assert head + list(resumed) == whole
    resumed.set_epoch(1)
    uninterrupted.set_epoch(1)
    assert list(resumed) == list(uninterrupted)


def _real(batch):
    return [int(i) for i, fill in zip(batch, batch.is_fill) if not fill]


@pytest.mark.parametrize("packing", [False, True])
def test_weights_at_another_scale_resume_on_another_number_of_ranks(packing):
    def ranks(weights, world):
        return [_sampler(weights, world=world, rank=r, packing=packing) for r in range(world)]

    names = ("web", "code", "books")
    assert not np.array_equal(MixtureSettings(names, (0.51, 0.38, 0.31)).shares,
                              MixtureSettings(names, (51, 38, 31)).shares)  # a few bits apart: planned as saved
    whole = [i for s in ranks((0.51, 0.38, 0.31), 2) for b in s for i in _real(b)]
    stopped = ranks((0.51, 0.38, 0.31), 2)
    head = [i for s in stopped for _, b in zip(range(2), s) for i in _real(b)]
    state = stopped[0].state_dict(batches_consumed=2)
    resumed = ranks((51, 38, 31), 3)
    for s in resumed:
        s.load_state_dict(state)
    assert all(s.mixture.weights == (0.51, 0.38, 0.31) for s in resumed)  # the saved epoch's own shares
    rest = [i for s in resumed for b in s for i in _real(b)]
    assert sorted(head + rest) == sorted(whole)  # nothing replayed, nothing skipped


def test_other_shares_are_refused_naming_both():
    state = _sampler((0.5, 0.2, 0.3)).state_dict(batches_consumed=0)
    with pytest.raises(ValueError, match=r"shares saved \[0\.5, 0\.2, 0\.3\], now \[0\.6, 0\.2, 0\.2\]"):
        _sampler((6, 2, 2)).load_state_dict(state)


# ---- errors name the component ------------------------------------------------------------------------------------
def test_a_component_left_without_training_documents_is_named(tmp_path):
    mixture = Mixture({"big": ([f"w{i} x y" for i in range(50)], 1), "small": (["one two"], 1)})
    dm = BalancedTextDataModule(mixture, max_tokens=512, val_fraction=0.5, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"mixture component 'small' has 1 document\(s\); val_fraction=0\.5 .*lower "
                                         r"val_fraction, or give 'small' more documents") as err:
        dm.setup("fit")
    assert err.value.parameter == "val_fraction"


# ---- max_repetition -----------------------------------------------------------------------------------------------
def test_a_max_repetition_beyond_plan_window_is_refused_before_anything_is_tiled():
    lengths, sizes = np.arange(1, 231) % 30 + 1, [115, 115]
    huge = MixtureSettings(("a", "b"), (1, 1), max_repetition=10**12)  # tiled, 230e12 samples would not fit memory
    with pytest.raises(ValueError, match=r"max_repetition=1000000000000 over the mixture's 230 documents .* sample "
                                         r"space of 230,000,000,000,000 samples, more than plan_window=1,048,576.*"
                                         r"epoch of about [\d,]+ documents and [\d,]+ tokens .*Lower max_repetition to "
                                         r"at most 4,559, or raise plan_window") as err:
        MixtureBatchSampler(lengths, sizes, huge, max_tokens=64, num_replicas=1, rank=0)
    assert err.value.parameter == "max_repetition"
    five = MixtureSettings(("a", "b"), (1, 1), max_repetition=5)  # 1,150 samples
    with pytest.raises(ValueError, match=r"more than plan_window=1,000"):
        MixtureBatchSampler(lengths, sizes, five, max_tokens=64, num_replicas=1, rank=0, plan_window=1000)
    assert len(MixtureBatchSampler(lengths, sizes, five, max_tokens=64, num_replicas=1, rank=0, plan_window=1150)) > 0


def test_the_epoch_named_is_the_one_selected():
    lengths, sizes = np.array([20] * 6 + [10] * 4), [6, 4]
    mixture = MixtureSettings(("a", "b"), (1, 1), max_repetition=3)  # b limits: 3 reads of its 40 tokens, a gives 120
    with pytest.raises(ValueError, match=r"about 18 documents and 240 tokens"):  # a once (6), b three times (12)
        MixtureBatchSampler(lengths, sizes, mixture, max_tokens=64, num_replicas=1, rank=0, plan_window=29)
    sampler = MixtureBatchSampler(lengths, sizes, mixture, max_tokens=64, num_replicas=1, rank=0, plan_window=30)
    chosen = [i for batch in sampler for i in batch]
    assert len(chosen) == 18 and int(sampler.lengths[chosen].sum()) == 240


def test_a_datamodule_names_max_repetition(tmp_path):
    mixture = Mixture({"a": ([f"w{i} x y z" for i in range(115)], 1), "b": ([f"v{i} q" for i in range(115)], 1)},
                      max_repetition=100000)
    dm = BalancedTextDataModule(mixture, max_tokens=512, val_fraction=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"max_repetition=100000 over the mixture's 230 documents") as err:
        dm.setup("fit")
    assert err.value.parameter == "max_repetition"


# ---- advice matches the settings given ----------------------------------------------------------------------------
@pytest.mark.parametrize("too_long", ["truncate", "error"])
def test_padded_shapes_advice_follows_too_long(too_long):
    from lit_balance.sampler.sampler import BalancedBatchSampler

    lengths = [10, 20, 50, 60]
    with pytest.raises(ValueError, match=r"cannot hold the longest sample") as err:
        BalancedBatchSampler(lengths, max_tokens=128, padded_shapes=[[4, 32]], too_long=too_long, num_replicas=1,
                             rank=0)
    message = str(err.value)
    assert "truncate them to at most 32 tokens" in message or "truncate the samples to at most 32 tokens" in message
    if too_long == "truncate":
        assert "too_long='truncate' cuts samples at 128 tokens" in message
        assert "or truncate the samples" not in message
    else:
        assert "too_long" not in message


@pytest.mark.parametrize("max_length, too_long, advice, absent", [
    (None, "truncate", "raise max_tokens (too_long='truncate' cuts at 8 tokens)", "max_length"),
    (8, "skip", "raise max_length=8 so that", "too_long"),
])
def test_lost_targets_advice_names_only_what_cuts(tmp_path, max_length, too_long, advice, absent):
    records = [{"prompt": "explain in detail " * 6, "completion": " yes"} for _ in range(6)]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = BalancedTextDataModule(path, max_tokens=8 if too_long == "truncate" else 64, max_length=max_length,
                                too_long=too_long, val_fraction=0, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"no training record has a next-token target") as err:
        dm.setup("fit")
    message = str(err.value)
    assert advice in message and absent not in message
    assert err.value.parameter == ("max_tokens" if max_length is None else "max_length")


def test_a_datamodule_resumes_with_weights_at_another_scale(tmp_path):
    rng = np.random.default_rng(1)
    parts = {name: [rng.integers(1, 90, size=int(n)).tolist() for n in rng.integers(3, 30, size=size)]
             for name, size in (("web", 40), ("code", 30), ("books", 20))}

    def dm(weights):
        mixture = Mixture({name: (docs, w) for (name, docs), w in zip(parts.items(), weights)})
        module = BalancedTextDataModule(mixture, vocab_size=100, pad_token_id=0, max_tokens=128, max_length=None,
                                        val_fraction=0, cache_dir=tmp_path, seed=2)
        module.setup("fit")
        return module

    whole = [b["indices"].tolist() for b in dm((0.51, 0.38, 0.31)).train_dataloader()]
    first = dm((0.51, 0.38, 0.31))
    loader = iter(first.train_dataloader())
    head = [next(loader)["indices"].tolist() for _ in range(3)]
    state = first.state_dict()
    resumed = dm((51, 38, 31))
    resumed.load_state_dict(state)
    assert head + [b["indices"].tolist() for b in resumed.train_dataloader()] == whole
