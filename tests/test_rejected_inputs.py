"""Inputs across the parts that must be refused clearly (an InputError naming what to change), never let through."""

from __future__ import annotations

import pytest

from lit_balance import BalancedBatchSampler, BalancedTextDataModule, BatchingSettings
from lit_balance.data import CorpusSource, load_or_build, resolve_corpus, resolve_tokenizer
from lit_balance.data.sources import TextsSource
from lit_balance.errors import InputError, InputTypeError, InputValueError
from lit_balance.plan import planner_for
from lit_balance.world import DataParallelWorld


def test_a_subclass_of_a_builtin_source_gets_a_kind_and_a_cache_entry_of_its_own(tmp_path):
    class Reversed(TextsSource):
        def read_records(self):
            for text in super().read_records():
                yield " ".join(reversed(text.split()))

    tokenizer = resolve_tokenizer()
    plain = load_or_build(resolve_corpus(["hello big world"]), tokenizer, tmp_path)
    mine = Reversed(("hello big world",))
    assert mine.kind.endswith("Reversed") and mine.fingerprint != resolve_corpus(["hello big world"]).fingerprint
    assert load_or_build(mine, tokenizer, tmp_path).document(0).tolist() == plain.document(0).tolist()[::-1]


def test_an_identity_that_is_not_strings_is_refused():
    class NoIdentity(CorpusSource):
        def read_records(self):
            yield "a"

        def identity(self):
            return None

    with pytest.raises(InputTypeError, match=r"identity\(\) must return a str, bytes or an iterable of them"):
        NoIdentity().fingerprint


def test_a_text_that_is_not_valid_unicode_is_named(tmp_path):
    with pytest.raises(InputValueError, match="document 1 of the corpus is not valid Unicode text.*'\\\\ud800'"):
        load_or_build(resolve_corpus(["ok", "bad \ud800 text"]), resolve_tokenizer(), tmp_path)


@pytest.mark.parametrize("sizes", [(3, 3), (7.5, 2.5), (20, 3), (10, 0), "7,3"])
def test_a_sources_split_sizes_must_add_up_to_its_documents(tmp_path, sizes):
    class Split(CorpusSource):
        def read_records(self):
            yield from (f"document {i}" for i in range(10))

        def identity(self):
            return ["split"]

        @property
        def split_sizes(self):
            return sizes

    dm = BalancedTextDataModule(Split(), max_tokens=128, cache_dir=tmp_path)
    with pytest.raises(InputValueError, match="split_sizes must be .* add up to the 10 documents it yielded"):
        dm.setup("fit")


def test_a_sampler_state_of_another_version_type_is_refused():
    sampler = BalancedBatchSampler([5, 6, 7, 8], 16, num_replicas=1, rank=0)
    for version in (True, 1.0):
        with pytest.raises(InputValueError, match="version"):
            sampler.load_state_dict({**sampler.state_dict(), "version": version})
    with pytest.raises(InputValueError, match="num_samples must be an int"):
        sampler.load_state_dict({**sampler.state_dict(), "num_samples": "4"})


def test_planner_for_and_the_world_check_their_arguments():
    with pytest.raises(InputTypeError, match="settings must be a lit_balance.BatchingSettings, got dict"):
        planner_for({"max_tokens": 64})
    assert planner_for(BatchingSettings(max_tokens=64)).name == "padded"
    for rank, num_replicas in ((5, 2), (0, 0), (-1, 2), ("0", 2)):
        with pytest.raises(InputError):
            DataParallelWorld(rank=rank, num_replicas=num_replicas)
