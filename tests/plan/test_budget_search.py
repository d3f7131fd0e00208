"""The token budget search on scripted memory curves: no model, no device, each case well under a second.

Every curve gives the peak memory (bytes) of a worst-case micro-batch from its slots and squares, as the planner builds
it (:meth:`Planner.worst_case_batch`); the optimum is found by brute force over every budget.
"""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BatchingSettings
from lit_balance.plan import planner_for
from lit_balance.plan.budget_search import (
    MAX_ROUNDS,
    OK,
    OUT_OF_MEMORY,
    OVER,
    BudgetSpace,
    MemoryMeasurement,
    MemoryModel,
    chosen_budget,
    next_budget,
)

MIB = 2**20
TARGET = 900 * MIB


def _search(curve, s, shapes, max_budget, target=TARGET):
    """Drive next_budget as the probe does: every shape's worst-case micro-batch at each proposed budget."""
    planner = planner_for(s)
    longest = max(shapes)
    min_budget = planner.worst_case_batch(s, longest, longest).slots
    space = BudgetSpace(min_budget=min_budget, max_budget=max_budget, multiple=s.pad_to_multiple_of,
                        longest=longest, target=target)
    tried = []
    while (budget := next_budget(tried, space)) is not None:
        assert budget % s.pad_to_multiple_of == 0 and min_budget <= budget <= max_budget
        assert budget not in {m.budget for m in tried}
        for length in shapes:
            batch = planner.worst_case_batch(s, budget, length)
            if batch is None:
                continue
            peak = curve(batch)
            status = OUT_OF_MEMORY if peak is None else OK if peak <= target else OVER
            tried.append(MemoryMeasurement(budget, batch.slots, batch.squares, peak or 0, status))
    return chosen_budget(tried), tried, space


def _optimum(fits, s, shapes, max_budget):
    """The largest budget at which every shape's worst-case micro-batch fits (bisection: a worst-case micro-batch
    only grows with the budget)."""
    planner = planner_for(s)
    m = s.pad_to_multiple_of

    def ok(budget):
        return all(fits(b) for b in (planner.worst_case_batch(s, budget, n) for n in shapes) if b is not None)

    lo, hi = planner.worst_case_batch(s, max(shapes), max(shapes)).slots // m, max_budget // m
    if not ok(lo * m):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid * m) else (lo, mid - 1)
    return lo * m


def _linear(a, b):
    return lambda batch: a + b * batch.slots


def _quadratic(a, b, c):
    return lambda batch: a + b * batch.slots + c * batch.squares


CASES = {
    "linear": _linear(600 * MIB, 40_000),
    "quadratic in row length": _quadratic(600 * MIB, 20_000, 60),
    "steep": _quadratic(850 * MIB, 30_000, 10),  # little room: a few rows of the longest documents
}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_search_lands_within_5_percent_of_the_optimum_and_never_over_the_target(name, packing):
    s = BatchingSettings(max_tokens=64, packing=packing, pad_to_multiple_of=8)
    shapes, curve = (400, 60), CASES[name]
    start = time.perf_counter()
    chosen, tried, _ = _search(curve, s, shapes, max_budget=200_000)
    seconds = time.perf_counter() - start
    optimum = _optimum(lambda b: curve(b) <= TARGET, s, shapes, 200_000)
    assert 0.95 * optimum <= chosen <= optimum, (chosen, optimum, [(m.budget, m.status) for m in tried])
    assert all(curve(planner_for(s).worst_case_batch(s, chosen, n)) <= TARGET for n in shapes)
    assert len({m.budget for m in tried}) <= MAX_ROUNDS and seconds < 1.0


@given(a=st.integers(100, 800), b=st.integers(1_000, 100_000), c=st.integers(0, 200), seed=st.integers(0, 1000),
       packing=st.booleans())
@settings(max_examples=60, deadline=None)
def test_noisy_curves_within_5_percent_pick_a_budget_that_measured_under_the_target(a, b, c, seed, packing):
    # the micro-batch's own memory varies by +-5 % from pass to pass (allocator, threads)
    s = BatchingSettings(max_tokens=64, packing=packing)
    rng = np.random.default_rng(seed)
    base = _quadratic(a * MIB, b, c)

    def noisy(batch):
        return int(a * MIB + (base(batch) - a * MIB) * rng.uniform(0.95, 1.05))

    start = time.perf_counter()
    chosen, tried, space = _search(noisy, s, (300, 40), max_budget=300_000)
    seconds = time.perf_counter() - start
    # the optimum that noise cannot move: every pass fits even when it reads 5 % high
    safe = _optimum(lambda x: a * MIB + (base(x) - a * MIB) * 1.05 <= TARGET, s, (300, 40), 300_000)
    if safe == 0:  # not one row of the longest documents fits even at its best reading
        return
    at_chosen = [m for m in tried if m.budget == chosen]
    assert at_chosen and all(m.peak_bytes <= TARGET for m in at_chosen)  # never a pick over the target
    assert chosen >= 0.95 * safe, (chosen, safe, [(m.budget, m.status) for m in tried])
    assert seconds < 1.0


@pytest.mark.parametrize("oom_above", [700, 3_000, 40_000])
def test_out_of_memory_above_a_size_is_bisected_to_within_5_percent(oom_above):
    # a device that fails above a micro-batch size with no peak to fit (the curve itself is far under the target)
    s = BatchingSettings(max_tokens=64)
    curve = _linear(100 * MIB, 1_000)

    def failing(batch):
        return None if batch.slots > oom_above else curve(batch)

    start = time.perf_counter()
    chosen, tried, _ = _search(failing, s, (200, 30), max_budget=500_000)
    seconds = time.perf_counter() - start
    optimum = _optimum(lambda x: failing(x) is not None, s, (200, 30), 500_000)
    assert 0.95 * optimum <= chosen <= optimum, (chosen, optimum, [(m.budget, m.status) for m in tried])
    assert all(failing(planner_for(s).worst_case_batch(s, chosen, n)) is not None for n in (200, 30))
    assert seconds < 1.0


def test_every_size_out_of_memory_chooses_nothing_after_one_pass():
    s = BatchingSettings(max_tokens=64)
    chosen, tried, space = _search(lambda batch: None, s, (200, 30), max_budget=10_000)
    assert chosen == 0 and {m.budget for m in tried} == {space.min_budget}


def test_a_budget_over_the_target_at_the_smallest_size_chooses_nothing():
    s = BatchingSettings(max_tokens=64)
    chosen, tried, space = _search(_linear(TARGET, 10), s, (200, 30), max_budget=10_000)
    assert chosen == 0 and {m.budget for m in tried} == {space.min_budget}


@given(a=st.floats(1e6, 1e9), b=st.floats(0, 1e5), c=st.floats(0, 100),
       lengths=st.lists(st.integers(1, 512), min_size=2, max_size=6, unique=True))
@settings(max_examples=50, deadline=None)
def test_the_memory_model_recovers_exact_coefficients(a, b, c, lengths):
    points = [(n * k, n * n * k) for n in lengths for k in (1, 3)]
    model = MemoryModel.fit([MemoryMeasurement(0, s, q, int(a + b * s + c * q), OK) for s, q in points])
    for s, q in points:
        assert model.predict(s, q) == pytest.approx(a + b * s + c * q, rel=1e-6, abs=2.0)
    assert model.per_slot >= 0 and model.per_square >= 0


def test_the_memory_model_never_has_a_negative_slope():
    m = [MemoryMeasurement(0, s, q, p, OK) for s, q, p in [(100, 1e4, 1000), (200, 4e4, 1100), (400, 1.6e5, 1150),
                                                            (100, 2e3, 1001)]]
    model = MemoryModel.fit(m)
    assert model.per_slot >= 0 and model.per_square >= 0
    with pytest.raises(ValueError, match="at least one measured peak"):
        MemoryModel.fit([MemoryMeasurement(100, 100, 0, 0, OUT_OF_MEMORY)])


@given(budget=st.integers(1, 5000), length=st.integers(1, 600), packing=st.booleans(),
       multiple=st.sampled_from([1, 8]), cap=st.one_of(st.none(), st.integers(1, 50)))
@settings(max_examples=200, deadline=None)
def test_worst_case_batches_are_within_the_budget_and_as_large_as_it_allows(budget, length, packing, multiple, cap):
    s = BatchingSettings(max_tokens=4096, packing=packing, pad_to_multiple_of=multiple,  # max_tokens unused here
                         max_batch_size=None if packing else cap)
    batch = planner_for(s).worst_case_batch(s, budget, length)
    width = -(-length // multiple) * multiple
    if batch is None:
        assert (budget // multiple) * multiple < length if packing else budget < width
        return
    assert batch.slots <= budget and max(batch.rows) == length
    if packing:
        assert sum(batch.rows) == (budget // multiple) * multiple
        assert batch.squares == sum(r * r for r in batch.rows)
    else:
        assert len(batch.rows) == min(budget // width, cap or budget) and batch.squares == batch.slots * width
    per_rank = s.replace(max_tokens=[4096, 2048])  # per-rank budgets: the same layout
    assert planner_for(per_rank).worst_case_batch(per_rank, budget, length) == batch


@given(a=st.floats(1e8, 5e8), b=st.floats(1e3, 1e5), excess=st.floats(0, 3e8), budget=st.integers(200, 20_000),
       multiple=st.sampled_from([1, 8, 64]))
@settings(max_examples=60, deadline=None)
def test_settling_takes_the_excess_of_passes_in_a_row_off_the_target(a, b, excess, budget, multiple):
    from lit_balance.plan.budget_search import settled_budget

    budget = max(2 * multiple, budget // multiple * multiple)
    tried = [MemoryMeasurement(s, s, 0, int(a + b * s), OK) for s in (multiple, budget // 2, budget)]
    model = MemoryModel.fit(tried)
    space = BudgetSpace(min_budget=multiple, max_budget=40_000, multiple=multiple, longest=multiple,
                        target=model.bound(budget, multiple))
    assert settled_budget(model.bound(budget, multiple), budget, tried, space) is None  # at the target: settled
    peak = model.bound(budget, multiple) + excess + 1
    smaller = settled_budget(peak, budget, tried, space)
    assert smaller is not None and multiple <= smaller < budget and smaller % multiple == 0
    if smaller > multiple:  # the largest under the target less the excess
        assert model.bound(smaller, multiple) <= space.target - (peak - model.bound(budget, multiple)) + 1e-6 * peak
        assert model.bound(smaller + multiple, multiple) > space.target - (peak - model.bound(budget, multiple))


def test_a_rank_outcome_is_gathered_as_numbers_and_read_back():
    from lit_balance.plan.budget_search import RankOutcome

    outcome = RankOutcome(budget=2348, capacity_bytes=2**30, seconds=1.5, device_kind=0, intercept=1e8,
                          per_slot=1e4, per_square=0.5)
    assert RankOutcome.from_row(outcome.to_row()) == outcome and outcome.coefficients == (1e8, 1e4, 0.5)
