"""A cost model is anything that implements CostModelProtocol: planners, statistics and resume all take it alike."""

from __future__ import annotations

import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.plan import PLANNERS
from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel, plan_epoch
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan import CostModelBase, CostModelProtocol, plan_stats

DOCS = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


@dataclass(frozen=True)
class Affine(CostModelBase):
    """CostModel's formula written as a CostModelBase subclass."""

    linear: float = 1.0
    quadratic: float = 0.0
    per_batch: float = 0.0

    def row_cost(self, length):
        length = np.asarray(length, dtype=np.float64)
        return self.linear * length + self.quadratic * length * length


def _section(title: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_the_documented_cost_model_example_runs(capsys, monkeypatch):
    module = types.ModuleType("extending_example")  # a module of its own: dataclasses look their module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_section("A cost model"), str(DOCS), "exec"), module.__dict__)
    out = capsys.readouterr().out
    assert "micro-batches per rank; useful compute fraction" in out and "with TransformerFlops" in out


def test_cost_model_is_a_protocol_member():
    assert isinstance(CostModel(), CostModelProtocol) and isinstance(Affine(), CostModelProtocol)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), num_replicas=st.integers(1, 5), packing=st.booleans(),
       accumulate=st.integers(1, 3), per_batch=st.sampled_from([0.0, 50.0]), uneven=st.booleans())
def test_a_subclass_with_costmodels_formula_plans_exactly_as_costmodel(seed, num_replicas, packing, accumulate,
                                                                      per_batch, uneven):
    lengths = np.random.default_rng(seed).integers(1, 200, 300)
    s = BatchingSettings(max_tokens=256, packing=packing, accumulate_grad_batches=accumulate, seed=seed)
    speeds = np.linspace(1.0, 0.5, num_replicas) if uneven else None
    ours = plan_epoch(lengths, s, num_replicas=num_replicas, epoch=1, rank_speeds=speeds,
                      cost_model=Affine(1.0, 1e-3, per_batch))
    theirs = plan_epoch(lengths, s, num_replicas=num_replicas, epoch=1, rank_speeds=speeds,
                        cost_model=CostModel(1.0, 1e-3, per_batch))
    for name in ("rows", "is_fill", "batch_offsets", "assignment", "dropped"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name
    planner = PLANNERS["packed" if packing else "padded"]
    a = plan_stats(ours, lengths, Affine(1.0, 1e-3, per_batch), planner=planner, accumulate_grad_batches=accumulate)
    b = plan_stats(theirs, lengths, CostModel(1.0, 1e-3, per_batch), planner=planner,
                   accumulate_grad_batches=accumulate)
    assert a.useful_fraction == b.useful_fraction and np.array_equal(a.rank_cost, b.rank_cost)


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_resume_rebuilds_a_custom_cost_model_and_its_pending_one():
    lengths = np.random.default_rng(3).integers(1, 200, 400)
    kwargs = dict(max_tokens=256, num_replicas=2, rank=1, seed=2)
    sampler = BalancedBatchSampler(lengths, cost_model=Affine(1.0, 1e-3), **kwargs)
    sampler.set_cost_model(Affine(2.0, 5e-3, 7.0), [1.0, 0.5])
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(4)]
    state = _roundtrip(sampler.state_dict())
    assert state["cost_model"] == {"linear": 1.0, "quadratic": 1e-3, "per_batch": 0.0}
    resumed = BalancedBatchSampler(lengths, cost_model=Affine(), **kwargs)
    resumed.load_state_dict(state)
    assert resumed.cost_model == Affine(1.0, 1e-3) and type(resumed.cost_model) is Affine
    assert head + list(resumed) == list(sampler)
    resumed.set_epoch(1)
    sampler.set_epoch(1)
    assert len(resumed) == len(sampler) > len(head)  # the next epoch, planned for the pending speeds
    assert resumed.cost_model == Affine(2.0, 5e-3, 7.0) and list(resumed) == list(sampler)


def test_a_state_of_another_cost_model_class_is_refused_naming_it():
    @dataclass(frozen=True)
    class Quadratic(CostModelBase):
        q: float = 1.0
        per_batch: float = 0.0

        def row_cost(self, length):
            return self.q * np.asarray(length, dtype=np.float64) ** 2

    lengths = np.random.default_rng(3).integers(1, 200, 100)
    state = BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0).state_dict()
    other = BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0, cost_model=Quadratic())
    with pytest.raises(InputValueError, match=r"cost model of class lit_balance.CostModel, this one has a .*Quadratic"):
        other.load_state_dict(state)
    with pytest.raises(InputValueError, match=r"cost_model must describe a Quadratic .*keys \['q', 'per_batch'\]"):
        other.load_state_dict({**state, "cost_model_class": other.state_dict()["cost_model_class"]})


@pytest.mark.parametrize(("value", "words"), [
    (object(), "which lacks ['per_batch', 'row_cost', 'batch_cost', 'packed_cost', 'to_dict', 'from_dict']"),
    (CostModel, "of type type"),
])
def test_something_that_is_not_a_cost_model_is_refused_naming_what_it_lacks(value, words):
    with pytest.raises(InputTypeError) as info:
        BalancedBatchSampler([5, 6, 7], max_tokens=16, num_replicas=1, rank=0, cost_model=value)
    assert words in str(info.value) and info.value.parameter == "cost_model"


def test_an_unhashable_cost_model_is_refused():
    @dataclass  # not frozen: unhashable
    class Mutable(CostModelBase):
        per_batch: float = 0.0

        def row_cost(self, length):
            return np.asarray(length, dtype=np.float64)

    with pytest.raises(InputTypeError, match="must be hashable"):
        plan_epoch([5, 6, 7], BatchingSettings(max_tokens=16), num_replicas=1, epoch=0, cost_model=Mutable())


@dataclass(frozen=True)
class Quadratic(CostModelBase):
    q: float = 1e-2
    per_batch: float = 10.0

    def row_cost(self, length):
        length = np.asarray(length, dtype=np.float64)
        return length + self.q * length * length


def test_a_state_names_the_class_of_its_cost_model_and_another_class_is_refused():
    lengths = np.random.default_rng(3).integers(1, 120, 200)
    saved = BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0, cost_model=Quadratic())
    state = _roundtrip(saved.state_dict(batches_consumed=5))
    assert state["cost_model_class"].endswith("test_cost_protocol.Quadratic")
    default = BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0)
    assert default.state_dict()["cost_model_class"] == "lit_balance.CostModel"
    before = default.state_dict()
    with pytest.raises(InputValueError, match=r"cost model of class .*Quadratic, this one has a lit_balance.CostModel"):
        default.load_state_dict(state)
    assert default.state_dict() == before  # left as it was
    legacy = {k: v for k, v in before.items() if k != "cost_model_class"}  # a state from before the key: CostModel
    default.load_state_dict(legacy)
    with pytest.raises(InputValueError, match="cost model of class lit_balance.CostModel"):
        BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0, cost_model=Quadratic()).load_state_dict(
            legacy)


def test_a_saved_cost_model_with_a_key_missing_or_extra_is_refused():
    lengths = np.random.default_rng(3).integers(1, 120, 200)
    sampler = BalancedBatchSampler(lengths, max_tokens=256, num_replicas=1, rank=0)
    for cost in ({"linear": 1.0}, {"linear": 1.0, "quadratic": 0.0, "per_batch": 0.0, "cubic": 1.0}):
        state = {**sampler.state_dict(), "cost_model": cost}
        with pytest.raises(InputValueError, match=r"described by the keys \['linear', 'quadratic', 'per_batch'\]"):
            sampler.load_state_dict(state)


def test_numpy_fields_are_saved_as_plain_values():
    model = Quadratic(q=np.float32(0.5), per_batch=np.int64(3))
    state = _roundtrip(BalancedBatchSampler([5, 6, 7], 64, num_replicas=1, rank=0, cost_model=model).state_dict())
    assert state["cost_model"] == {"q": 0.5, "per_batch": 3} and type(state["cost_model"]["per_batch"]) is int


@pytest.mark.parametrize(("row_cost", "per_batch", "words"), [
    (lambda length: np.full(np.shape(length), np.nan), 0.0, "must be finite and >= 0 for every length, got nan"),
    (lambda length: -np.asarray(length, dtype=np.float64), 0.0, "must be finite and >= 0 for every length, got -1.0"),
    (lambda length: np.zeros(np.shape(length)), 0.0, "is 0 for every length"),
    (lambda length: np.ones(3), 0.0, "must return one cost per length"),
    (lambda length: np.asarray(length, dtype=np.float64), -5.0, "per_batch must be a finite number >= 0"),
    (lambda length: np.asarray(length, dtype=np.float64), float("inf"), "per_batch must be a finite number >= 0"),
])
def test_a_cost_model_with_costs_no_plan_can_use_is_refused_when_given(row_cost, per_batch, words):
    @dataclass(frozen=True)
    class Broken(CostModelBase):
        per_batch: float = 0.0

        def row_cost(self, length):
            return row_cost(length)

    for packing in (False, True):
        with pytest.raises(InputValueError) as info:
            BalancedBatchSampler([10, 20, 30, 40], max_tokens=64, num_replicas=2, rank=0, packing=packing,
                                 cost_model=Broken(per_batch))
        assert words in str(info.value) and info.value.parameter == "cost_model"


def test_a_costmodelbase_that_is_not_a_dataclass_is_refused():
    class Loose(CostModelBase):
        per_batch = 0.0

        def row_cost(self, length):
            return np.asarray(length, dtype=np.float64)

    with pytest.raises(InputTypeError, match="must be a \\(frozen\\) dataclass"):
        plan_epoch([5, 6, 7], BatchingSettings(max_tokens=16), num_replicas=1, epoch=0, cost_model=Loose())


def test_a_from_dict_that_returns_something_else_is_refused():
    @dataclass(frozen=True)
    class Lost(Quadratic):
        @classmethod
        def from_dict(cls, values):
            return None

    lengths = np.random.default_rng(3).integers(1, 120, 200)
    state = BalancedBatchSampler(lengths, 256, num_replicas=1, rank=0, cost_model=Lost()).state_dict()
    with pytest.raises(InputTypeError, match="Lost.from_dict returned None of type NoneType, not a Lost"):
        BalancedBatchSampler(lengths, 256, num_replicas=1, rank=0, cost_model=Lost()).load_state_dict(state)
