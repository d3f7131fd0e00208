"""Tokens per optimizer step as a schedule: plans and the sampler's resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from lit_balance import BatchingSettings, Schedule
from lit_balance.plan.step_tokens import plan_tokens_per_step
from lit_balance.plan.types import padded_lengths
from lit_balance.sampler.step_tokens import TokensPerStepSampler

BUDGET = 64


@st.composite
def cases(draw):
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    lengths = np.random.default_rng(seed).integers(1, BUDGET + 1, size=n)
    replicas = draw(st.integers(1, 8))
    floor = BUDGET * replicas
    k = draw(st.integers(1, 4))
    at = sorted(draw(st.sets(st.integers(1, 30), min_size=k - 1, max_size=k - 1)))
    values = [draw(st.integers(floor, 6 * floor)) for _ in range(k)]
    interpolation = draw(st.sampled_from(["constant", "linear"]))
    unit = draw(st.sampled_from(["steps", "tokens"]))
    if unit == "tokens":
        at = [a * floor for a in at]
    schedule = Schedule(list(zip([0] + at, values)), unit=unit, interpolation=interpolation)
    packing = draw(st.booleans())
    shuffle = draw(st.booleans())
    first = draw(st.integers(0, 5))
    return lengths, replicas, schedule, packing, shuffle, first


@hsettings(max_examples=60, deadline=None)
@given(cases())
def test_steps_follow_the_schedule(case):
    lengths, replicas, schedule, packing, shuffle, first = case
    s = BatchingSettings(max_tokens=BUDGET, packing=packing, shuffle=shuffle, seed=3)
    p = plan_tokens_per_step(lengths, s, num_replicas=replicas, epoch=1, schedule=schedule, first_step=first,
                             tokens_before=7)
    plan = p.plan
    # every document exactly once, no fill row holds a document that is not also real
    real = plan.rows[~plan.is_fill]
    assert sorted(real.tolist()) == list(range(len(lengths)))
    # equal counts and the budget: assignment is [micro-steps, ranks]; every micro-batch within max_tokens
    assert plan.assignment.shape == (int(p.step_micro_batches.sum()), replicas)
    assert sorted(plan.assignment.reshape(-1).tolist()) == list(range(plan.num_batches))
    padded = padded_lengths(lengths, 1)
    for b in range(plan.num_batches):
        rows, _ = plan.batch(b)
        cost = int(padded[rows].sum()) if packing else len(rows) * int(padded[rows].max())
        assert cost <= BUDGET
    # each step's tokens: what its micro-batches hold, within one document of the schedule (the last may be short)
    real_tok = plan.real_tokens_per_batch(lengths)
    starts = p.step_starts
    trained = 7
    longest = int(lengths.max())
    for g in range(p.num_steps):
        got = int(real_tok[plan.assignment[starts[g]:starts[g + 1]].reshape(-1)].sum())
        assert got == int(p.step_tokens[g])
        position = trained if schedule.unit == "tokens" else first + g
        want = int(schedule.value_at(position))
        assert int(p.step_target[g]) == want
        assert got <= want
        if g < p.num_steps - 1:
            assert want - got < longest
        trained += got
    assert trained - 7 == int(lengths.sum())


def test_refuses_tokens_below_one_micro_step_before_reading():
    s = BatchingSettings(max_tokens=BUDGET)
    with pytest.raises(ValueError, match=r"tokens_per_step_schedule: the point at 10 steps asks 100 tokens.*"
                                         r"128 = max_tokens 64 x 2 ranks"):
        TokensPerStepSampler([1, 2, 3], s, [[0, 500], [10, 100]], num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="drop_last"):
        TokensPerStepSampler([1, 2, 3], BatchingSettings(max_tokens=BUDGET, drop_last=True), 500,
                             num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="tokens_per_step_schedule"):
        TokensPerStepSampler([1, 2, 3], s, {"a": 500}, num_replicas=2, rank=0)


def _run(samplers, upto=None):
    """Indices of every rank's micro-batches (real rows) per micro-step, up to ``upto`` micro-steps."""
    out = []
    its = [iter(x) for x in samplers]
    for step, batches in enumerate(zip(*its)):
        if upto is not None and step >= upto:
            break
        out.append([sorted(i for i, f in zip(mb, mb.is_fill) if not f) for mb in batches])
    return out


def _docs_per_step(sampler, batches):
    """The documents of each optimizer step, from per-micro-step batches of a sampler's plan."""
    bounds = sampler.step_bounds() - sampler.first_micro_step
    return [sorted(d for s in range(bounds[g], bounds[g + 1]) for mb in batches[s] for d in mb)
            for g in range(len(bounds) - 1) if bounds[g + 1] <= len(batches)]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("worlds", [(8, 6, 8), (2, 3, 2)])
def test_resume_on_another_world_size_gives_the_same_documents(packing, worlds):
    lengths = np.random.default_rng(5).integers(1, 33, size=700)
    s = BatchingSettings(max_tokens=32, packing=packing, seed=1)
    schedule = {"points": [[0, 8 * 32 * 2], [6, 8 * 32 * 4]], "interpolation": "linear"}

    def make(world):
        return [TokensPerStepSampler(lengths, s, schedule, num_replicas=world, rank=r) for r in range(world)]

    full = make(worlds[0])
    whole = _docs_per_step(full[0], _run(full))
    full_steps = full[0].plan().step_tokens.tolist()
    # stop after 3 optimizer steps, resume on worlds[1], stop after 2 more, resume on worlds[2]
    a = make(worlds[0])
    cut = int(a[0].step_bounds()[3])
    seen = _docs_per_step(a[0], _run(a, cut))[:3]
    state = a[0].state_dict(cut)
    b = make(worlds[1])
    for x in b:
        x.load_state_dict(state)
    rest_b = _run(b, None)
    cut_b = int(b[0].step_bounds()[2])
    seen += _docs_per_step(b[0], rest_b)[:2]
    state = b[0].state_dict(cut_b)
    c = make(worlds[2])
    for x in c:
        x.load_state_dict(state)
    seen += _docs_per_step(c[0], _run(c))
    assert sorted(d for step in seen for d in step) == list(range(len(lengths)))
    assert [sum(int(lengths[d]) for d in step) for step in seen[:5]] == full_steps[:5]
    assert seen == whole  # step by step, the documents of the uninterrupted run
    # the schedule keeps holding after the resumes: every step but the last within one document of its value
    sched = Schedule.of(schedule, name="x")
    for g, step in enumerate(seen[:-1]):
        got = sum(int(lengths[d]) for d in step)
        assert 0 <= sched.value_at(g) - got < 32


def test_future_edit_holds_and_past_edit_is_refused():
    lengths = np.random.default_rng(2).integers(1, 17, size=400)
    s = BatchingSettings(max_tokens=16, seed=0)
    old = [[0, 64], [20, 128]]
    a = [TokensPerStepSampler(lengths, s, old, num_replicas=2, rank=r) for r in range(2)]
    cut = int(a[0].step_bounds()[5])
    seen = _docs_per_step(a[0], _run(a, cut))[:5]
    state = a[0].state_dict(cut)
    with pytest.raises(ValueError, match=r"cannot resume with another tokens_per_step_schedule: the run has trained "
                                         r"up to 5 steps, and the first point that differs before 5 steps is at 3"):
        TokensPerStepSampler(lengths, s, [[0, 64], [3, 96]], num_replicas=2, rank=0).load_state_dict(state)
    new = [[0, 64], [7, 160]]
    b = [TokensPerStepSampler(lengths, s, new, num_replicas=2, rank=r) for r in range(2)]
    for x in b:
        x.load_state_dict(state)
    seen += _docs_per_step(b[0], _run(b))
    assert sorted(d for step in seen for d in step) == list(range(len(lengths)))
    sched = Schedule(new)
    for g, step in enumerate(seen[:-1]):
        got = sum(int(lengths[d]) for d in step)
        assert 0 <= sched.value_at(g) - got < 16, g
    # the next epoch starts where the resumed one ended
    b[0].set_epoch(1)
    assert b[0].plan().first_step == len(seen)
