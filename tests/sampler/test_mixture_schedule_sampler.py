"""MixtureBatchSampler with a weight schedule: simulated ranks agree and keep each step's scheduled shares across
epochs; the schedule and where the epoch starts are saved; an exact resume; edits of the past refused naming the
first differing point, edits of the future accepted from the next epoch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import MixtureBatchSampler, MixtureSettings, Schedule

NAMES = ("web", "code", "rare")


def _lengths(seed=0, sizes=(120, 60, 20)):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(8, 160, n) for n in sizes]), list(sizes)


def _sampler(schedule, num_replicas, rank, *, acc=1, packing=False, seed=0, sizes=(120, 60, 20), **kwargs):
    lengths, sizes = _lengths(seed, sizes)
    return MixtureBatchSampler(lengths, sizes=sizes, mixture=MixtureSettings(NAMES, (1, 1, 1)), max_tokens=600,
                               num_replicas=num_replicas, rank=rank, accumulate_grad_batches=acc, packing=packing,
                               weights_schedule=schedule, **kwargs), lengths


SCHEDULE = Schedule([(0, {"web": 0.6, "code": 0.4 - 1e-4, "rare": 1e-4}),
                     (6, {"web": 0.2, "code": 0.5, "rare": 0.3})], name="weights_schedule")


def _epoch(samplers, epoch):
    for s in samplers:
        s.set_epoch(epoch)
        len(s)  # the epoch's length, read after set_epoch as the DataModule does
    return [list(s) for s in samplers]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.booleans(), st.integers(0, 5))
def test_ranks_agree_and_every_step_keeps_its_scheduled_shares(num_replicas, acc, packing, seed):
    samplers = [_sampler(SCHEDULE, num_replicas, r, acc=acc, packing=packing, seed=seed)[0]
                for r in range(num_replicas)]
    lengths = _lengths(seed)[0]
    comp = samplers[0].component_of(np.arange(lengths.size))
    longest = float(lengths.max())
    first = 0
    for epoch in range(3):
        batches = _epoch(samplers, epoch)
        assert len({len(b) for b in batches}) == 1  # equal counts
        assert samplers[0].schedule_start(epoch)[0] == first
        targets = samplers[0].step_targets(epoch)
        num_micro = len(batches[0])
        steps = -(-num_micro // acc)
        assert targets.shape[0] == steps
        units = np.zeros((steps, len(NAMES)))
        seen = []
        for rank_batches in batches:
            for t, mb in enumerate(rank_batches):
                rows = np.asarray(list(mb))[~np.asarray(mb.is_fill, dtype=bool)] if hasattr(mb, "is_fill") \
                    else np.asarray(list(mb))
                seen += rows.tolist()
                np.add.at(units, (t // acc, comp[rows]), lengths[rows])
        assert len(seen) == len(set(seen))  # every document once per epoch
        for g in range(steps):
            w = np.asarray(SCHEDULE.vector_at(first + g, NAMES))
            np.testing.assert_allclose(targets[g], w / w.sum())
            assert np.abs(units[g] - targets[g] * units[g].sum()).max() <= longest + 1e-6
        first += steps


def _state_after(sampler, consumed):
    it = iter(sampler)
    out = [next(it) for _ in range(consumed)]
    return sampler.state_dict(batches_consumed=consumed), out


def test_a_resume_continues_exactly_and_the_state_holds_the_schedule():
    ref, _ = _sampler(SCHEDULE, 2, 1)
    ref.set_epoch(1)
    whole = [list(b) for b in ref]
    run, _ = _sampler(SCHEDULE, 2, 1)
    run.set_epoch(1)
    state, head = _state_after(run, 3)
    assert state["weights_schedule"] == SCHEDULE.to_dict()
    assert state["schedule_start"][0] == ref.schedule_start(1)[0] > 0
    fresh, _ = _sampler(SCHEDULE, 2, 1)
    fresh.load_state_dict(state)
    assert [list(b) for b in head] + [list(b) for b in fresh] == whole
    fresh.set_epoch(2)
    ref.set_epoch(2)
    assert [list(b) for b in fresh] == [list(b) for b in ref]


def test_an_edit_of_the_past_is_refused_naming_the_first_differing_point():
    run, _ = _sampler(SCHEDULE, 2, 0)
    run.set_epoch(1)
    state, _ = _state_after(run, 3)
    resume_step = state["schedule_start"][0] + 3
    past = Schedule([(0, {"web": 0.6, "code": 0.4 - 1e-4, "rare": 1e-4}),
                     (2, {"web": 0.5, "code": 0.5, "rare": 0.0})], name="weights_schedule")
    fresh, _ = _sampler(past, 2, 0)
    with pytest.raises(ValueError) as err:
        fresh.load_state_dict(state)
    text = str(err.value)
    assert "weights_schedule" in text and f"trained up to {resume_step} steps" in text
    assert "is at 2 steps" in text and "point (2, {'web': 0.5, 'code': 0.5, 'rare': 0})" in text


def test_an_edit_of_the_future_holds_from_the_next_epoch_and_one_inside_the_epoch_names_where_it_may_start():
    run, _ = _sampler(SCHEDULE, 2, 0)
    run.set_epoch(1)
    state, _ = _state_after(run, 2)
    end = run.schedule_start(2)[0]  # the next epoch's first step
    future = Schedule(list(SCHEDULE.points_as_given()) + [(end, {"web": 0.1, "code": 0.1, "rare": 0.8})],
                      name="weights_schedule")
    fresh, _ = _sampler(future, 2, 0)
    fresh.load_state_dict(state)
    rest = [list(b) for b in fresh]
    ref, _ = _sampler(SCHEDULE, 2, 0)
    ref.set_epoch(1)
    assert rest == [list(b) for b in ref][2:]  # the resumed epoch runs as planned
    fresh.set_epoch(2)
    assert fresh.schedule_start(2)[0] == end
    targets = fresh.step_targets(2)
    np.testing.assert_allclose(targets[0], [0.1, 0.1, 0.8])
    inside = Schedule(list(SCHEDULE.points_as_given()) + [(end - 1, {"web": 0.1, "code": 0.1, "rare": 0.8})],
                      name="weights_schedule")
    if end - 1 >= state["schedule_start"][0] + 2:
        with pytest.raises(ValueError, match=f"A change may start at {end} steps"):
            _sampler(inside, 2, 0)[0].load_state_dict(state)


def test_a_resume_mid_epoch_on_other_ranks_is_refused_and_one_at_an_epoch_start_is_planned_on_the_new_ranks():
    run, _ = _sampler(SCHEDULE, 2, 0)
    run.set_epoch(1)
    state, _ = _state_after(run, 2)
    with pytest.raises(ValueError, match="on 3 rank\\(s\\) with a weights_schedule"):
        _sampler(SCHEDULE, 3, 0)[0].load_state_dict(state)
    at_start = run.state_dict(batches_consumed=len(run))  # the epoch done: the next one's start
    fresh, _ = _sampler(SCHEDULE, 3, 0)
    fresh.load_state_dict(at_start)
    assert fresh.epoch == 2 and fresh.schedule_start(2)[0] == run.schedule_start(2)[0]


def test_a_state_with_and_without_a_schedule_do_not_mix():
    run, _ = _sampler(SCHEDULE, 1, 0)
    state = run.state_dict(batches_consumed=0)
    plain, _ = _sampler(None, 1, 0)
    with pytest.raises(ValueError, match="saved with a weights_schedule and this sampler has none"):
        plain.load_state_dict(state)


def test_bad_schedules_are_refused_when_the_sampler_is_built():
    with pytest.raises(ValueError, match="names the component\\(s\\) \\['books'\\]"):
        _sampler(Schedule([(0, {"web": 1, "code": 1, "rare": 1, "books": 1})]), 1, 0)
    with pytest.raises(ValueError, match="largest_first=True"):
        _sampler(SCHEDULE, 1, 0, largest_first=True)
