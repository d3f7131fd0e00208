"""BatchingSettings: checks, round trip, and that every consumer builds the same plan from it or from keywords."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_balance import (BalancedBatchSampler, BalancedTextDataModule, BatchingSettings, CostModel, plan_epoch,
                         plan_report)
from lit_balance._checks import MAX_TOKENS_LIMIT
from lit_balance.cli import plan_parser
from lit_balance.cli.plan import PLAN_FLAGS

LENGTHS = np.random.default_rng(0).integers(1, 300, 400)


def plans(sampler: BalancedBatchSampler, epochs=(0, 1, 2)) -> list[tuple]:
    out = []
    for epoch in epochs:
        p = sampler.plan(epoch)
        out.append(tuple(a.tolist() for a in (p.rows, p.is_fill, p.batch_offsets, p.assignment, p.dropped)))
    return out


@pytest.mark.parametrize(
    ("changes", "error", "pattern"),
    [
        ({"max_tokens": 0}, ValueError, rf"max_tokens must be in \[1, {MAX_TOKENS_LIMIT}\], got 0"),
        ({"max_tokens": 2**41}, ValueError, rf"max_tokens must be in \[1, {MAX_TOKENS_LIMIT}\], got {2**41}"),
        ({"max_tokens": 1.5}, TypeError, "max_tokens must be an int >= 1, got 1.5 of type float"),
        ({"max_tokens": None}, TypeError, "max_tokens must be an int >= 1, got None"),
        ({"shuffle": "false"}, TypeError, "shuffle must be True or False, got 'false'"),
        ({"drop_last": 1}, TypeError, "drop_last must be True or False, got 1 of type int"),
        ({"largest_first": None}, TypeError, "largest_first must be True or False, got None"),
        ({"packing": "true"}, TypeError, "packing must be True or False, got 'true'"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"plan_window": 0}, ValueError, r"plan_window must be in \[1, 1099511627776\], got 0"),
        ({"plan_window": 2.0}, TypeError, "plan_window must be an int >= 1, got 2.0"),
        ({"seed": True}, TypeError, "seed must be an int >= 0, got True"),
        ({"too_long": "drop"}, ValueError, r"too_long must be one of \('error', 'skip', 'truncate'\), got 'drop'"),
        ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be >= 1, got 0"),
        ({"pad_to_multiple_of": 128}, ValueError, r"pad_to_multiple_of \(128\) exceeds max_tokens \(100\)"),
        ({"max_batch_size": 0}, ValueError, r"max_batch_size must be in \[1, 1099511627776\], got 0"),
        ({"shuffle_window": -0.5}, ValueError, "shuffle_window must be a finite number >= 0 .*got -0.5"),
        ({"shuffle_window": float("nan")}, ValueError, "shuffle_window must be a finite number >= 0 .*got nan"),
        ({"accumulate_grad_batches": 0}, ValueError, r"accumulate_grad_batches must be in \[1, 1099511627776\], got 0"),
        ({"accumulate_grad_batches": 2.0}, TypeError, "accumulate_grad_batches must be an int >= 1, got 2.0"),
    ],
)
def test_bad_values_raise_naming_the_setting_and_value(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        BatchingSettings(**{"max_tokens": 100, **changes})
    with pytest.raises(error, match=pattern):  # the same check on a copy and through the sampler's keywords
        BatchingSettings(max_tokens=100).replace(**changes)
    with pytest.raises(error, match=pattern):
        BalancedBatchSampler([3, 4], **{"max_tokens": 100, **changes}, num_replicas=1, rank=0)


def test_defaults_and_normalised_types():
    s = BatchingSettings(max_tokens=np.int64(512), shuffle=np.bool_(False), shuffle_window=1, seed=np.int32(3))
    assert s.to_dict() == {"max_tokens": 512, "shuffle": False, "seed": 3, "drop_last": False, "too_long": "error",
                           "pad_to_multiple_of": 1, "max_batch_size": None, "shuffle_window": 1.0,
                           "accumulate_grad_batches": 1, "largest_first": False, "plan_window": 1 << 20,
                           "packing": False}
    assert [type(v) for v in s.to_dict().values()] == [int, bool, int, bool, str, int, type(None), float, int, bool,
                                                       int, bool]
    assert BatchingSettings(max_tokens=64, pad_to_multiple_of=24).truncate_to == 48
    with pytest.raises(TypeError):
        BatchingSettings()  # max_tokens has no default


def test_frozen():
    s = BatchingSettings(max_tokens=100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_tokens = 200
    assert s.replace(max_tokens=200).max_tokens == 200 and s.max_tokens == 100


def test_to_dict_from_dict_round_trip_through_json():
    s = BatchingSettings(max_tokens=2048, shuffle=False, seed=7, drop_last=True, too_long="truncate",
                         pad_to_multiple_of=8, max_batch_size=32, shuffle_window=0.5, accumulate_grad_batches=4,
                         largest_first=True, packing=True)
    assert BatchingSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert BatchingSettings.from_dict({"max_tokens": 10}) == BatchingSettings(max_tokens=10)
    with pytest.raises(ValueError, match=r"unknown batching settings \['shufle'\]"):
        BatchingSettings.from_dict({"max_tokens": 10, "shufle": True})
    with pytest.raises(ValueError, match="needs max_tokens"):
        BatchingSettings.from_dict({"seed": 1})
    with pytest.raises(TypeError, match="expects a mapping"):
        BatchingSettings.from_dict([("max_tokens", 10)])


KEYWORD_VARIANTS = [
    {"max_tokens": 1024},
    {"max_tokens": 1024, "shuffle": False},
    {"max_tokens": 512, "accumulate_grad_batches": 2, "largest_first": True, "seed": 5},
    {"max_tokens": 256, "too_long": "skip", "pad_to_multiple_of": 8, "max_batch_size": 4, "shuffle_window": 1.0},
    {"max_tokens": 256, "too_long": "truncate", "drop_last": True},
]


@pytest.mark.parametrize("keywords", KEYWORD_VARIANTS)
def test_sampler_from_settings_equals_sampler_from_keywords(keywords):
    world = {"num_replicas": 3, "rank": 1, "rank_speeds": [1.0, 0.7, 0.9], "cost_model": CostModel(per_batch=10.0)}
    by_keywords = BalancedBatchSampler(LENGTHS, **keywords, **world)
    settings = BatchingSettings(**keywords)
    by_settings = BalancedBatchSampler(LENGTHS, settings=settings, **world)
    positional = BalancedBatchSampler(LENGTHS, keywords["max_tokens"], settings=settings, **world)
    assert by_keywords.settings == by_settings.settings == positional.settings == settings
    assert plans(by_keywords) == plans(by_settings)
    assert [list(b) for b in by_keywords] == [list(b) for b in by_settings]
    for name, value in settings.to_dict().items():  # the old attribute names still read
        assert getattr(by_settings, name) == value
    assert by_settings.state_dict()["settings"] == settings.to_dict()
    by_settings.load_state_dict(by_keywords.state_dict())  # one's checkpoint loads into the other


def test_plan_epoch_takes_the_settings_object():
    settings = BatchingSettings(max_tokens=512, accumulate_grad_batches=2)
    sampler = BalancedBatchSampler(LENGTHS, settings=settings, num_replicas=2, rank=0)
    direct = plan_epoch(sampler.lengths, settings, num_replicas=2, epoch=0)
    assert np.array_equal(direct.assignment, sampler.plan(0).assignment)
    assert np.array_equal(direct.rows, sampler.plan(0).rows)
    with pytest.raises(TypeError, match="settings must be a lit_balance.BatchingSettings, got dict"):
        plan_epoch(sampler.lengths, settings.to_dict(), num_replicas=2, epoch=0)


def test_conflicting_keyword_and_settings_raise_naming_both():
    settings = BatchingSettings(max_tokens=1024, seed=3)
    with pytest.raises(ValueError, match=r"seed=4 but settings.seed=3"):
        BalancedBatchSampler(LENGTHS, settings=settings, seed=4, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"max_tokens=512 but settings.max_tokens=1024"):
        BalancedBatchSampler(LENGTHS, 512, settings=settings, num_replicas=1, rank=0)
    # saying the same thing twice is fine
    assert BalancedBatchSampler(LENGTHS, 1024, settings=settings, seed=3, num_replicas=1, rank=0).settings == settings
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['shufle'\]"):
        BalancedBatchSampler(LENGTHS, 1024, shufle=False, num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="settings must be a lit_balance.BatchingSettings or None, got"):
        BalancedBatchSampler(LENGTHS, settings={"max_tokens": 1024}, num_replicas=1, rank=0)


def test_sampler_settings_attributes_are_read_only():
    sampler = BalancedBatchSampler(LENGTHS, 1024, num_replicas=1, rank=0)
    with pytest.raises(AttributeError):
        sampler.max_tokens = 2048


def test_real_tokens_and_rows_per_batch_exclude_fill_rows():
    lengths = np.array([40, 50, 60, 35, 45, 55, 62])
    sampler = BalancedBatchSampler(lengths, 64, num_replicas=3, rank=0)  # 7 single-row batches + 2 fill rows
    plan = sampler.plan()
    assert plan.is_fill.sum() == 2
    tokens, rows = plan.real_tokens_per_batch(lengths), plan.real_rows_per_batch()
    assert tokens.dtype == rows.dtype == np.int64
    for b in range(plan.num_batches):
        idx, fill = plan.batch(b)
        assert tokens[b] == lengths[idx[~fill]].sum() and rows[b] == (~fill).sum()
    assert tokens.sum() == lengths.sum() and rows.sum() == lengths.size


def test_plan_report_from_settings_equals_keywords():
    settings = BatchingSettings(max_tokens=512, accumulate_grad_batches=2, max_batch_size=16)
    a = plan_report(LENGTHS, settings=settings, num_replicas=4).summary()
    b = plan_report(LENGTHS, 512, num_replicas=4, accumulate_grad_batches=2, max_batch_size=16).summary()
    assert a == b
    assert {k: a["settings"][k] for k in settings.to_dict()} == settings.to_dict()
    assert (a["settings"]["num_replicas"], a["settings"]["epoch"]) == (4, 0)


def test_plan_cli_has_one_flag_per_setting_with_its_default():
    cfg = plan_parser().parse_args([])
    for f in dataclasses.fields(BatchingSettings):
        assert f.name in PLAN_FLAGS
        assert cfg[f.name] == (4096 if f.name == "max_tokens" else f.default)


@pytest.fixture()
def texts():
    return [" ".join(["word"] * (1 + i % 37)) for i in range(60)]


def test_datamodule_with_settings_equals_keywords(tmp_path, texts):
    keywords = {"max_tokens": 256, "seed": 2, "shuffle_window": 1.0, "pad_to_multiple_of": 8, "largest_first": True}
    settings = BatchingSettings(**keywords, accumulate_grad_batches=3)
    dms = [BalancedTextDataModule(texts, settings=settings, cache_dir=tmp_path),
           BalancedTextDataModule(texts, **keywords, cache_dir=tmp_path)]
    assert dms[0].settings == settings and dms[1].settings == settings.replace(accumulate_grad_batches=1)
    assert (dms[0].max_tokens, dms[0].seed, dms[0].shuffle_window) == (256, 2, 1.0)
    out = []
    for dm in dms:
        dm.trainer = SimpleNamespace(world_size=2, global_rank=1, current_epoch=0, accumulate_grad_batches=2,
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}))
        dm.prepare_data()
        dm.setup("fit")
        # the training sampler takes the Trainer's accumulate_grad_batches; validation is plain
        assert dm.train_sampler.settings == settings.replace(accumulate_grad_batches=2)
        assert dm.val_sampler.settings == settings.replace(shuffle=False, drop_last=False, largest_first=False,
                                                           accumulate_grad_batches=1)
        out.append((plans(dm.train_sampler), plans(dm.val_sampler, (0,))))
    assert out[0] == out[1]


def test_datamodule_settings_conflicts_and_checks(tmp_path, texts):
    settings = BatchingSettings(max_tokens=256)
    with pytest.raises(ValueError, match=r"shuffle=False but settings.shuffle=True"):
        BalancedTextDataModule(texts, settings=settings, shuffle=False, cache_dir=tmp_path)
    # a keyword given beside settings says the same thing or fails, even at the BatchingSettings default
    with pytest.raises(ValueError, match=r"max_tokens=4096 but settings.max_tokens=256"):
        BalancedTextDataModule(texts, settings=settings, max_tokens=4096, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"shuffle=True but settings.shuffle=False"):
        BalancedTextDataModule(texts, settings=settings.replace(shuffle=False), shuffle=True, cache_dir=tmp_path)
    same = BalancedTextDataModule(texts, settings=settings, max_tokens=256, seed=0, cache_dir=tmp_path)
    assert same.max_tokens == 256
    assert BalancedTextDataModule(texts, settings=settings.replace(shuffle=False), cache_dir=tmp_path).shuffle is False
    with pytest.raises(TypeError, match="settings must be a lit_balance.BatchingSettings"):
        BalancedTextDataModule(texts, settings=256, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="cost_model must be a lit_balance.CostModel or None"):
        BalancedTextDataModule(texts, cost_model="padded", cache_dir=tmp_path)
    dm = BalancedTextDataModule(texts, max_tokens=256, cache_dir=tmp_path)
    with pytest.raises(AttributeError):
        dm.max_tokens = 512


def test_settings_survive_a_weights_only_checkpoint(tmp_path):
    sampler = BalancedBatchSampler(LENGTHS, 512, num_replicas=2, rank=0, accumulate_grad_batches=2)
    next(iter(sampler))
    torch.save(sampler.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert BatchingSettings.from_dict(state["settings"]) == sampler.settings


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"max_batch_size": 2**63}, r"max_batch_size must be in \[1, 1099511627776\], got 9223372036854775808"),
    ({"accumulate_grad_batches": 10**30}, r"accumulate_grad_batches must be in \[1, 1099511627776\]"),
    ({"shuffle_window": 10**400}, r"shuffle_window must be a finite number >= 0 \(micro-batches\), got 1000"),
])
def test_values_beyond_int64_or_float_range_are_named(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        BatchingSettings(max_tokens=64, **changes)


def test_from_dict_names_unknown_keys_of_any_type():
    with pytest.raises(ValueError, match=r"unknown batching settings \[1, None\]"):
        BatchingSettings.from_dict({1: 2, None: 3, "max_tokens": 64})


def test_rank_speeds_beyond_the_float_range_are_named():
    with pytest.raises(ValueError, match="rank_speeds must hold 2 finite numbers > 0"):
        BalancedBatchSampler([5, 6], 64, num_replicas=2, rank=0, rank_speeds=[1, 10**400])


def test_a_trainer_accumulate_grad_batches_below_one_is_named_at_setup(tmp_path):
    dm = BalancedTextDataModule([[1, 2, 3], [4, 5]], max_tokens=64, val_fraction=0, cache_dir=tmp_path)
    dm.trainer = SimpleNamespace(accumulate_grad_batches=0, world_size=1, global_rank=0, current_epoch=0,
                                 strategy=None)
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"the Trainer's accumulate_grad_batches=0 cannot be planned.*Trainer\("
                                         r"accumulate_grad_batches=\.\.\.\) to an int >= 1"):
        dm.setup("fit")
