"""Mixture plans under a weight schedule: every optimizer step within one boundary document of the shares its
schedule gives (transition steps included), tiny weights honoured over the run through the carried deficit, the
budget, equal counts and every chosen document once; the errors of bad weight schedules."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BatchingSettings, Schedule
from lit_balance.plan.cost import CostModel
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings, plan_mixture
from lit_balance.plan.mixture_schedule import StepShares, check_weights_schedule

from tests.plan.test_mixture import _boundary_documents, _check_plan

_WEIGHTS = st.one_of(st.sampled_from([0.0, 1e-6, 1e-4]), st.floats(0.05, 10.0))


@st.composite
def _scheduled(draw):
    k = draw(st.integers(2, 4))
    sizes = [draw(st.integers(5, 60)) for _ in range(k)]
    lengths = []
    for n in sizes:
        low = draw(st.integers(1, 200))
        high = draw(st.integers(low, 500))
        lengths += draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    names = tuple(f"c{i}" for i in range(k))
    at = sorted(draw(st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True)))
    points = []
    for p in at:
        w = [draw(_WEIGHTS) for _ in range(k)]
        if sum(w) < 0.05:
            w[draw(st.integers(0, k - 1))] = 1.0
        points.append((p, dict(zip(names, w))))
    schedule = Schedule(points, interpolation=draw(st.sampled_from(["constant", "linear"])), name="weights_schedule")
    return sizes, lengths, names, schedule


def _epochs(lengths, sizes, names, schedule, batching, *, num_replicas, epochs):
    """Plan ``epochs`` epochs in a row, each starting where the last ended (step, tokens, deficits)."""
    layout = MixtureLayout(np.asarray(sizes, dtype=np.int64), 1)
    mix = MixtureSettings(names, tuple(1.0 for _ in names))
    tiled = layout.tile(np.asarray(lengths, dtype=np.int64))
    first, tokens, carry, out = 0, 0, None, []
    for epoch in range(epochs):
        shares = StepShares(schedule, names, first_step=first, tokens_before=tokens, carry=carry)
        mp = plan_mixture(tiled, layout, mix, batching, num_replicas=num_replicas, epoch=epoch,
                          cost_model=CostModel(), step_shares=shares)
        out.append((shares, mp))
        first += mp.step_units.shape[0]
        tokens += int(mp.step_units.sum())
        carry = tuple(mp.carry.tolist())
    return layout, mix, tiled, out


@settings(max_examples=150, deadline=None)
@given(_scheduled(), st.integers(1, 8), st.integers(1, 4), st.booleans(), st.booleans(), st.integers(600, 3000))
def test_every_step_keeps_its_scheduled_shares_and_tiny_weights_add_up_over_the_run(case, num_replicas, acc, packing,
                                                                                   shuffle, max_tokens):
    sizes, lengths, names, schedule = case
    batching = BatchingSettings(max_tokens=max_tokens, accumulate_grad_batches=acc, packing=packing, shuffle=shuffle,
                                seed=3)
    layout, mix, tiled, epochs = _epochs(lengths, sizes, names, schedule, batching, num_replicas=num_replicas,
                                         epochs=3)
    comp_of_doc = layout.component_of(np.arange(tiled.size))
    longest = np.array([tiled[comp_of_doc == c].max() for c in range(len(names))], dtype=np.float64)
    got = np.zeros(len(names))
    asked = np.zeros(len(names))
    position = 0
    for shares, mp in epochs:
        units = _check_plan(layout, mix, tiled, mp, batching, num_replicas)  # budget, counts, each chosen once
        steps = units.shape[0]
        for g in range(steps):  # each step's target is the schedule's value at its step of the run
            w = np.asarray(schedule.vector_at(position + g, names))
            np.testing.assert_allclose(mp.step_targets[g], w / w.sum(), rtol=1e-12)
        total = units.sum(axis=1, keepdims=True)
        deviation = np.abs(units - mp.step_targets * total).max(axis=1)
        if not shuffle and steps:  # the step's boundary document: the longest next to a component's cut at its ends
            bound = _boundary_documents(layout, mp, tiled, batching, num_replicas)
            # the epoch's last step: the document after a stream's last cut went back to the pool (the epoch ended
            # before it), so it is not among the chosen ones the helper sees; any document bounds it
            bound[-1] = max(bound[-1], longest.max())
            # a weight of 1e-6 asks a millionth of a step's tokens: the bound holds to a thousandth of a token
            assert (deviation <= bound + 1e-3).all(), (deviation, bound)
        assert (deviation <= longest.max() + 1e-6).all()
        got += units.sum(axis=0)
        asked += (mp.step_targets * total).sum(axis=0)
        position += steps
        # what a component got and what its schedule asked differ by the deficit carried on, within one document
        np.testing.assert_allclose(asked - got, mp.carry, rtol=1e-9, atol=1e-6)
        assert (np.abs(mp.carry) <= longest.max() + 1e-6).all(), (mp.carry, longest)
    # a weight asked of at least one document over the run is never rounded away
    assert all(got[c] > 0 for c in range(len(names)) if asked[c] >= longest[c] + 1e-6)


def test_a_tiny_weight_gets_its_documents_over_the_run():
    """Weights 1e-4 and 1e-6 beside two large components: the tiny components' tokens over many epochs are within one
    document of what their schedule asks, never zero once it asks a whole document."""
    rng = np.random.default_rng(0)
    sizes = [400, 400, 50, 50]
    lengths = np.concatenate([rng.integers(20, 120, s) for s in sizes]).tolist()
    names = ("web", "code", "rare", "rarest")
    schedule = Schedule([(0, {"web": 0.7, "code": 0.3 - 1.01e-4, "rare": 1e-4, "rarest": 1e-6}),
                         (40, {"web": 0.5, "code": 0.5 - 1.01e-4, "rare": 1e-4, "rarest": 1e-6})])
    batching = BatchingSettings(max_tokens=512, accumulate_grad_batches=1, seed=1)
    layout, mix, tiled, epochs = _epochs(lengths, sizes, names, schedule, batching, num_replicas=2, epochs=30)
    got = sum(mp.step_units.sum(axis=0) for _, mp in epochs).astype(np.float64)
    asked = sum((mp.step_targets * mp.step_units.sum(axis=1, keepdims=True)).sum(axis=0) for _, mp in epochs)
    assert asked[2] > 120  # "rare" is asked more than its longest document over the run
    assert got[2] > 0 and abs(got[2] - asked[2]) <= 120
    assert abs(got[3] - asked[3]) <= 120
    steps = sum(mp.step_units.shape[0] for _, mp in epochs)
    assert steps > 40  # the transition was crossed
    # rounding each step's share of the tiny component to whole documents would give it nothing
    assert all((np.round(mp.step_targets[:, 2] * mp.step_units.sum(axis=1) / 120) == 0).all() for _, mp in epochs)


def test_the_rest_of_an_epoch_plans_every_given_sample():
    """``plan_exactly`` (the rest of an epoch resumed on other ranks): every given sample is planned once, also when
    a component runs out before the others."""
    rng = np.random.default_rng(2)
    sizes = [80, 30, 40]
    lengths = np.concatenate([rng.integers(5, 300, s) for s in sizes])
    names = ("a", "b", "c")
    layout = MixtureLayout(np.asarray(sizes), 1)
    mix = MixtureSettings(names, (1.0, 1.0, 1.0))
    schedule = Schedule([(0, {"a": 0.2, "b": 0.7, "c": 0.1}), (3, {"a": 0.5, "b": 0.1, "c": 0.4})])
    given_samples = rng.random(lengths.size) < 0.7
    for replicas, acc, packing in [(3, 1, False), (2, 2, True), (5, 3, False)]:
        batching = BatchingSettings(max_tokens=900, accumulate_grad_batches=acc, packing=packing, seed=0)
        mp = plan_mixture(lengths, layout, mix, batching, num_replicas=replicas, epoch=0, cost_model=CostModel(),
                          plan_exactly=given_samples, step_shares=StepShares(schedule, names, first_step=2))
        real = mp.plan.rows[~mp.plan.is_fill]
        assert sorted(real.tolist()) == np.flatnonzero(given_samples).tolist()


@pytest.mark.parametrize("schedule, words", [
    ([(0, {"a": 1, "b": 1, "z": 1})], "names the component\\(s\\) \\['z'\\], which the mixture does not have"),
    ([(0, {"a": 1})], "it gives none to \\['b'\\]"),
    ([(0, {"a": 1, "b": 1}), (5, {"a": 0, "b": 0})], "the weights at 5 steps sum to 0"),
    ([(5, {"a": 1, "b": 1}), (2, {"a": 1, "b": 0})], "point 1 is at 2 steps, not after point 0 at 5"),
    ([(0, {"a": -1, "b": 1})], "must be finite and >= 0, got -1.0"),
    ([(0, {"a": float("nan"), "b": 1})], "must be finite and >= 0, got nan"),
    ([(0, 0.5)], "must be the weights of the components \\['a', 'b'\\]"),
])
def test_bad_weight_schedules_are_refused_naming_the_setting(schedule, words):
    with pytest.raises((ValueError, TypeError), match=words) as err:
        check_weights_schedule(schedule, ("a", "b"))
    assert "weights_schedule" in str(err.value)


def test_largest_first_is_refused_beside_a_schedule():
    layout = MixtureLayout(np.asarray([3, 3]), 1)
    mix = MixtureSettings(("a", "b"), (1.0, 1.0))
    shares = StepShares(check_weights_schedule([(0, {"a": 1, "b": 1})], ("a", "b")), ("a", "b"))
    with pytest.raises(ValueError, match="largest_first=True .* weights_schedule"):
        plan_mixture(np.full(6, 10), layout, mix, BatchingSettings(max_tokens=100, largest_first=True),
                     num_replicas=1, epoch=0, cost_model=CostModel(), step_shares=shares)


def test_steps_stay_full_until_the_epoch_ends():
    """A component read whole ends the epoch before its share would leave steps to shrink around it: every step but
    the last fills most of its capacity, as with fixed weights, and the epoch is about as long."""
    rng = np.random.default_rng(0)
    real = np.load(Path(__file__).parents[2] / "lit_balance/data/lengths/lengths_pydocs_paragraphs.npy")
    n = 20_000
    sizes = np.array([n // 2, n // 4, n - n // 2 - n // 4])
    lengths = np.minimum(rng.choice(real, n), 4096).astype(np.int64)
    layout, names = MixtureLayout(sizes, 1), ("a", "b", "c")
    mix = MixtureSettings(names, (0.6, 0.1, 0.3))
    batching = BatchingSettings(max_tokens=8192, accumulate_grad_batches=2, seed=0)
    fixed = plan_mixture(lengths, layout, mix, batching, num_replicas=8, epoch=0, cost_model=CostModel())
    schedule = Schedule([(0, {"a": 0.6, "b": 0.1, "c": 0.3}), (4, {"a": 0.3, "b": 0.3, "c": 0.4})])
    for interpolation in ("constant", "linear"):
        s = Schedule(schedule.points_as_given(), interpolation=interpolation)
        mp = plan_mixture(lengths, layout, mix, batching, num_replicas=8, epoch=0, cost_model=CostModel(),
                          step_shares=StepShares(s, names))
        tokens = mp.step_units.sum(axis=1)
        assert (tokens[:-1] >= 0.8 * 8 * 2 * 8192).all(), tokens
        assert 0.5 * fixed.step_units.shape[0] <= tokens.size <= 1.5 * fixed.step_units.shape[0]
