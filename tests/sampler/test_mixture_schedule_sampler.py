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


def _units_per_step(samplers, lengths, acc=1):
    """Real units per component of every optimizer step the samplers (one per rank) yield now, and the documents."""
    comp = samplers[0].component_of(np.arange(lengths.size))
    for s in samplers:
        len(s)
    batches = [[np.asarray(list(mb))[~np.asarray(mb.is_fill, dtype=bool)] for mb in s] for s in samplers]
    steps = -(-len(batches[0]) // acc)
    units = np.zeros((steps, len(NAMES)))
    docs = []
    for rank_batches in batches:
        for t, rows in enumerate(rank_batches):
            np.add.at(units, (t // acc, comp[rows]), lengths[rows])
            docs += rows.tolist()
    return units, docs


def _take(sampler, count):
    """The real rows of the next ``count`` micro-batches of a new pass."""
    it = iter(sampler)
    out = []
    for _ in range(count):
        mb = next(it)
        out += [i for i, f in zip(list(mb), mb.is_fill) if not f]
    return out


def _stopped(world, consumed, schedule=SCHEDULE, epoch=1):
    runs = [_sampler(schedule, world, r)[0] for r in range(world)]
    head = []
    for s in runs:
        s.set_epoch(epoch)
        head += _take(s, consumed)
    return runs[0].state_dict(batches_consumed=consumed), head


def _resumed(world, state, schedule=SCHEDULE):
    out = []
    for r in range(world):
        s, _ = _sampler(schedule, world, r)
        s.load_state_dict(state)
        out.append(s)
    return out


def _check_rest(samplers, schedule, first_step):
    lengths = _lengths()[0]
    targets = samplers[0].step_targets()
    units, docs = _units_per_step(samplers, lengths)
    assert targets.shape[0] == units.shape[0]
    for g in range(units.shape[0]):
        w = np.asarray(schedule.vector_at(first_step + g, NAMES))
        np.testing.assert_allclose(targets[g], w / w.sum())
        assert np.abs(units[g] - targets[g] * units[g].sum()).max() <= lengths.max() + 1e-6
    return docs


def _whole(epoch=1):
    ref = [_sampler(SCHEDULE, 2, r)[0] for r in range(2)]
    for s in ref:
        s.set_epoch(epoch)
    return ref, _units_per_step(ref, _lengths()[0])[1]


def test_an_edit_of_the_future_holds_from_the_resume_step_with_the_same_documents():
    state, head = _stopped(2, 2)
    resume_step = state["schedule_start"][0] + 2
    ref, whole = _whole()
    future = Schedule([*SCHEDULE.points_as_given(), (resume_step, {"web": 0.1, "code": 0.1, "rare": 0.8})],
                      name="weights_schedule")
    rest = _check_rest(_resumed(2, state, future), future, resume_step)
    assert sorted(head + rest) == sorted(whole)  # nothing consumed lost or repeated
    # the schedule unchanged: the rest is the uninterrupted run's, micro-batch for micro-batch
    same = _resumed(2, state)
    ref[1].set_epoch(1)
    assert [list(b) for b in same[1]] == [list(b) for b in ref[1]][2:]


def test_a_resume_on_other_ranks_mid_epoch_and_back_trains_the_uninterrupted_epochs_documents():
    state, head = _stopped(2, 3)
    _, whole = _whole()
    resume_step = state["schedule_start"][0] + 3
    three = _resumed(3, state)
    middle = [i for s in three for i in _take(s, 2)]  # 2 more micro-steps on 3 ranks, then stopped again
    state3 = three[0].state_dict(batches_consumed=three[0].first_micro_step + 2)
    back = _resumed(2, state3)
    rest = _check_rest(back, SCHEDULE, resume_step + 2)
    assert sorted(head + middle + rest) == sorted(whole)
    # the next epoch starts where the resumed one ended, and its steps follow the schedule
    for s in back:
        s.set_epoch(2)
    _check_rest(back, SCHEDULE, back[0].schedule_start(2)[0])


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


def test_with_rank_speeds_and_a_preview_on_one_rank_the_step_count_continues_the_epochs_that_ran():
    """Rank speeds change the plan, hence the steps of an epoch: the next epoch's first step is where the epoch the
    samplers ran ended, also after rank 0 alone previewed a later epoch (planned with other inputs)."""
    lengths = _lengths()[0]
    samplers = [_sampler(SCHEDULE, 2, r, rank_speeds=[1.0, 2.0])[0] for r in range(2)]
    samplers[0].schedule_start(2)  # a preview on rank 0 only
    first = 0
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        assert [s.schedule_start(epoch)[0] for s in samplers] == [first, first]
        docs = _check_rest(samplers, SCHEDULE, first)
        assert len(docs) == len(set(docs))
        first += samplers[0].step_targets().shape[0]
