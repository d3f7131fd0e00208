"""MixtureBatchSampler.set_weights_from: weights set during training hold from the next epoch's first step, as a
sampler built with the edited schedule plans them; the state saves the edit."""

import numpy as np
import pytest

from lit_balance import MixtureBatchSampler, MixtureSettings, Schedule

NAMES = ("a", "b", "c")
OLD = [[0, {"a": 0.6, "b": 0.3, "c": 0.1}]]
NEW = {"a": 0.1, "b": 0.3, "c": 0.6}


def _sampler(schedule, num_replicas=2, rank=0, packing=False):
    rng = np.random.default_rng(7)
    lengths = rng.integers(5, 300, size=200)
    return MixtureBatchSampler(lengths, sizes=(120, 60, 20), mixture=MixtureSettings(NAMES, (1, 1, 1)),
                               max_tokens=600, num_replicas=num_replicas, rank=rank, weights_schedule=schedule,
                               seed=3, packing=packing)


def _plans(sampler, epochs):
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        p = sampler.plan()
        out.append((p.rows.tolist(), p.assignment.tolist()))
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_weights_set_during_epoch_0_hold_from_epoch_1_as_an_edited_schedule(packing):
    online = _sampler(OLD, packing=packing)
    first = _plans(online, [0])
    step = online.schedule_start(1)[0]
    with pytest.raises(ValueError, match=f"apply from the next epoch's first optimizer step \\({step}\\)"):
        online.set_weights_from(step - 1, NEW)
    edited = online.set_weights_from(step, NEW)
    assert edited.points_as_given() == [(0, dict(OLD[0][1])), (step, NEW)]
    rest = _plans(online, [1, 2])
    reference = _sampler(edited, packing=packing)
    assert _plans(reference, [0, 1, 2]) == first + rest
    reference.set_epoch(1)
    targets = online.step_targets(1)
    assert np.allclose(targets, np.array([NEW[n] for n in NAMES]))
    # the state holds the edited schedule: a resume with the edit continues, the original schedule is a past edit
    state = online.state_dict()
    assert Schedule.from_dict(state["weights_schedule"]).points_as_given() == edited.points_as_given()
    with pytest.raises(ValueError, match="cannot resume with another weights_schedule"):
        _sampler(OLD, packing=packing).load_state_dict(state)
    again = _sampler(OLD, packing=packing)
    again.set_weights_from(step, NEW, check_step=False)  # what MixtureWeightsHook restores from its own state
    again.load_state_dict(state)
    assert _plans(again, [2]) == rest[1:]


def test_fixed_weights_are_refused():
    s = MixtureBatchSampler(np.arange(1, 41), sizes=(20, 20), mixture=MixtureSettings(("a", "b"), (1, 1)),
                            max_tokens=100, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="fixed weights; pass weights_schedule"):
        s.set_weights_from(5, {"a": 1, "b": 1})


@pytest.mark.parametrize("at", [0, 1, 5, 9, 10, 15])
def test_set_from_keeps_every_value_before_its_step(at):
    ramp = Schedule([(0, 1.0), (10, 3.0)], interpolation="linear")
    edited = ramp.set_from(at, 7.0)
    assert [edited.value_at(x) for x in range(at)] == pytest.approx([ramp.value_at(x) for x in range(at)], rel=1e-12)
    assert [edited.value_at(x) for x in range(at, at + 5)] == [7.0] * 5
