"""The vectorised planner against plain reference implementations, and bad-input regressions."""

import heapq
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.plan import BatchingSettings, CostModel, padded_lengths, plan_epoch
from lit_balance.plan.assign import hold_time, lpt
from lit_balance.plan.padded import (
    _batch_costs,
    _count_batches,
    _cumulative_by_speed,
    _cut_points,
    _Cuts,
    _Layout,
    _order,
    _split_to,
)
from lit_balance.plan.stats import batch_persistence, plan_stats
from lit_balance.sampler.sampler import MAX_TOKENS_LIMIT, BalancedBatchSampler

LENGTHS = Path(__file__).resolve().parents[2] / "lit_balance" / "data" / "lengths"


def _greedy_reference(take):
    """One micro-batch at a time: a micro-batch starting at row i takes take[i] rows."""
    ends, i = [], 0
    while i < len(take):
        i = min(i + int(take[i]), len(take))
        ends.append(i)
    return ends


def _split_reference(starts, ends, target):
    """Split the largest micro-batch (ties: earliest) in half until there are target, over all of them."""
    heap = [(-(e - s), s, e) for s, e in zip(starts, ends)]
    heapq.heapify(heap)
    while len(heap) < target and -heap[0][0] >= 2:
        size, lo, hi = heapq.heappop(heap)
        mid = lo + (-size + 1) // 2
        heapq.heappush(heap, (lo - mid, lo, mid))
        heapq.heappush(heap, (mid - hi, mid, hi))
    return sorted((s, e) for _, s, e in heap)


def _lpt_reference(costs, speeds, per_rank):
    """Plain LPT with a cardinality limit: most costly first, to the rank that would finish first."""
    load, count = [0.0] * len(speeds), [0] * len(speeds)
    slots = [[None] * len(speeds) for _ in range(per_rank)]
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        best = min((r for r in range(len(speeds)) if count[r] < per_rank),
                   key=lambda r: ((load[r] + costs[k]) / speeds[r], r))
        slots[count[best]][best] = k
        load[best] += costs[k]
        count[best] += 1
    return slots


@settings(deadline=None, max_examples=300)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300),
    max_tokens=st.integers(64, 512),
    max_batch_size=st.integers(1, 40),
    num_replicas=st.integers(1, 40),
)
def test_vectorised_planner_matches_references(lengths, max_tokens, max_batch_size, num_replicas):
    pl = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    run_ends = np.append(np.flatnonzero(pl[1:] != pl[:-1]) + 1, len(pl))
    run_take = np.minimum(max_tokens // pl[run_ends - 1], max_batch_size)
    take = np.repeat(run_take, np.diff(np.concatenate([[0], run_ends])))  # per row
    ends = _cut_points(run_take, run_ends)
    assert ends.tolist() == _greedy_reference(take)
    assert _count_batches(run_take.tolist(), run_ends.tolist(), len(pl)) == len(ends)
    starts = np.concatenate([[0], ends[:-1]])
    target = -(-len(starts) // num_replicas) * num_replicas
    got_s, got_e = _split_to(starts, ends, target)
    assert list(zip(got_s.tolist(), got_e.tolist())) == _split_reference(starts.tolist(), ends.tolist(), target)


@settings(deadline=None, max_examples=200)
@given(
    num_ranks=st.integers(1, 6),
    per_rank=st.integers(1, 5),
    data=st.data(),
)
def test_lpt_matches_reference_and_fills_every_rank(num_ranks, per_rank, data):
    costs = np.asarray(data.draw(st.lists(st.integers(1, 1000), min_size=num_ranks * per_rank,
                                          max_size=num_ranks * per_rank)), dtype=np.float64)
    speeds = np.asarray(data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=num_ranks,
                                           max_size=num_ranks)))
    slots = lpt(costs, speeds, per_rank)
    assert sorted(slots.reshape(-1).tolist()) == list(range(len(costs)))
    if per_rank > 1:
        assert slots.tolist() == _lpt_reference(costs.tolist(), speeds.tolist(), per_rank)
    else:  # one each: the k-th most costly on the k-th fastest rank
        by_speed = np.argsort(-speeds, kind="stable")
        assert (costs[slots[0, by_speed]] == np.sort(costs)[::-1]).all()


def test_equal_lengths_make_equal_cost_steps():
    # 1000 rows of 10 tokens, budget 128 -> 12 rows each would need 84 micro-batches; 4 ranks -> 84 is a
    # multiple; equal cost: every micro-batch has 11 or 12 rows, and the plan balances each step
    plan = plan_epoch(np.full(1000, 10), BatchingSettings(max_tokens=128, seed=0, shuffle=True, drop_last=False),
                      num_replicas=4, epoch=0)
    sizes = np.diff(plan.batch_offsets)
    assert plan.num_batches == 84 and sizes.max() * 10 <= 128 and sizes.max() - sizes.min() <= 1
    stats = plan_stats(plan, np.full(1000, 10))
    assert stats.step_imbalance.max() <= 12 / 11


@pytest.mark.parametrize(
    ("lengths", "pattern"),
    [
        ([3, float("nan")], r"index 1 holds nan"),
        ([3, float("inf")], r"index 1 holds inf"),
        ([True, 2, 3], r"index 0 holds the bool True"),
        ([np.bool_(True), 2], r"index 0 holds the bool"),
        ([2**63 - 1, 5], r"index 0: 9223372036854775807"),
        (np.array([5, 2**64 - 1], dtype=np.uint64), r"index 1: 18446744073709551615"),
        ([5, 2**70], r"index 1 holds 1180591620717411303424"),
        (torch.tensor([3.0, 4.5], dtype=torch.bfloat16), r"index 1 holds 4.5"),
    ],
)
def test_odd_lengths_raise_naming_the_value(lengths, pattern):
    with pytest.raises(ValueError, match=pattern):
        BalancedBatchSampler(lengths, 10, num_replicas=1, rank=0, pad_to_multiple_of=2, too_long="skip")


def test_object_array_of_ints_is_accepted():
    sampler = BalancedBatchSampler(np.array([3, 4], dtype=object), 10, num_replicas=1, rank=0)
    assert sampler.lengths.tolist() == [3, 4] and sampler.lengths.dtype == np.int64


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"shuffle": "false"}, TypeError, "shuffle must be True or False, got 'false'"),
        ({"drop_last": "false"}, TypeError, "drop_last must be True or False"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"seed": 1.0}, TypeError, "seed must be an int >= 0, got 1.0"),
    ],
)
def test_flag_and_seed_types(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        BalancedBatchSampler([3, 4], 10, num_replicas=1, rank=0, **kwargs)


def test_limits_on_max_tokens_and_epoch():
    with pytest.raises(ValueError, match=rf"max_tokens must be in \[1, {MAX_TOKENS_LIMIT}\], got {2**63}"):
        BalancedBatchSampler([3], 2**63, num_replicas=1, rank=0)
    sampler = BalancedBatchSampler([3], 10, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -5"):
        sampler.plan(-5)


def _compositions(sampler, epoch):
    sampler.set_epoch(epoch)
    return {frozenset(b) for b in sampler}


def test_shuffle_window_changes_composition_of_distinct_lengths():
    lengths = np.arange(100, 400)  # no two lengths equal
    moving = BalancedBatchSampler(lengths, 2048, num_replicas=1, rank=0, seed=3, shuffle_window=1.0)
    frozen = BalancedBatchSampler(lengths, 2048, num_replicas=1, rank=0, seed=3, shuffle_window=0.0)
    assert _compositions(moving, 0) != _compositions(moving, 1)
    assert _compositions(frozen, 0) == _compositions(frozen, 1)  # only the order of steps changes
    for sampler in (moving, frozen):
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert all(len(b) * int(lengths[b].max()) <= 2048 for b in sampler)
            assert sorted(i for b in sampler for i in b) == list(range(300))


def test_larger_shuffle_window_lowers_persistence():
    lengths = np.minimum(np.load(LENGTHS / "lengths_fortunes.npy"), 512)
    persistence = []
    for window in (0.0, 1.0, 4.0):
        sampler = BalancedBatchSampler(lengths, 4096, num_replicas=8, rank=0, shuffle_window=window)
        persistence.append(batch_persistence(sampler.plan(0), sampler.plan(1)))
    assert persistence[0] > persistence[1] > persistence[2]


@pytest.mark.parametrize(("value", "error"), [(-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                              (10**400, ValueError), (True, TypeError), ("0.1", TypeError)])
def test_shuffle_window_rejects_bad_values(value, error):
    with pytest.raises(error, match="shuffle_window must be a finite number >= 0"):
        BalancedBatchSampler([3, 4], 10, num_replicas=1, rank=0, shuffle_window=value)


# --------------------------------------------------------------------------------------------------
# extreme rank speeds: bounded work, no overflow
# --------------------------------------------------------------------------------------------------
def _planning_work(monkeypatch, lengths, settings, speeds):
    """(plan, number of cumulative cuts tried): the work of planning, counted instead of timed."""
    import lit_balance.plan.padded as planning

    calls = []
    original = planning._cut_equal
    monkeypatch.setattr(planning, "_cut_equal", lambda *args: calls.append(1) or original(*args))
    plan = plan_epoch(lengths, settings, num_replicas=len(speeds), epoch=0, rank_speeds=np.asarray(speeds))
    return plan, len(calls)


@pytest.mark.parametrize("speeds", [[1.0, 1e-3], [1.0, 1e-9], [1e-9, 1.0, 1.0, 1e-9]])
def test_a_far_slower_rank_costs_no_more_planning_than_a_moderately_slower_one(monkeypatch, speeds):
    lengths = np.minimum(np.load(LENGTHS / "lengths_pydocs_paragraphs.npy")[:3000].astype(np.int64), 256)
    settings = BatchingSettings(max_tokens=256)
    _, moderate = _planning_work(monkeypatch, lengths, settings, [1.0 if s == 1.0 else 0.1 for s in speeds])
    plan, work = _planning_work(monkeypatch, lengths, settings, speeds)
    assert work <= 2 * moderate, (work, moderate)
    slow = [r for r, s in enumerate(speeds) if s < 1.0]
    rows = np.diff(plan.batch_offsets)[plan.assignment[:, slow]]
    # the least share a rank can get: one row per micro-batch (the cut's last micro-batch takes what is left)
    assert (rows > 1).sum() <= 1, np.bincount(rows.reshape(-1))
    covered = np.sort(plan.rows[~plan.is_fill])
    assert covered.tolist() == list(range(lengths.size))


@pytest.mark.parametrize("speeds", [[1e308, 1e-20], [1.0, 1e-320], [1e-320, 1.0], [1.0, 5e-324]])
def test_speeds_spanning_beyond_the_float_range_plan_the_slow_rank_at_the_floor(speeds):
    from lit_balance.sampler.sampler import MIN_RANK_SPEED_RATIO

    lengths = np.random.default_rng(0).integers(1, 300, 500)
    slow = int(np.argmin(speeds))
    sampler = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0, rank_speeds=speeds)
    assert sampler.rank_speeds[slow] == MIN_RANK_SPEED_RATIO and sampler.rank_speeds.max() == 1.0
    floor = [1.0, 1.0]
    floor[slow] = MIN_RANK_SPEED_RATIO
    at_floor = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0, rank_speeds=floor)
    plan = sampler.plan()
    assert plan.assignment.tolist() == at_floor.plan().assignment.tolist()
    rows = np.diff(plan.batch_offsets)
    assert (rows[plan.assignment[:, slow]] > 1).sum() <= 1  # one row per micro-batch on the slow rank
    assert (rows[plan.assignment[:, 1 - slow]] > 1).sum() > plan.num_micro_steps // 2
    direct = plan_epoch(sampler.lengths, sampler.settings, num_replicas=2, epoch=0, rank_speeds=np.asarray(speeds))
    assert direct.assignment.tolist() == plan.assignment.tolist()  # the planner clamps alike
    sampler.set_cost_model(CostModel(), speeds)  # and so does the hand-over
    sampler.set_epoch(1)
    assert sampler.rank_speeds[slow] == MIN_RANK_SPEED_RATIO


@pytest.mark.parametrize(("lengths", "kwargs", "error", "pattern"), [
    ([100, 2], {}, ValueError, r"1 eligible sample\(s\) exceed max_tokens=64 .*index 0, 100 tokens"),
    ([-5, 2], {}, ValueError, "every length must be in"),
    ([1.5, 2.5], {}, ValueError, "lengths must be integers"),
    ([], {}, ValueError, "lengths is empty"),
    ([[1, 2]], {}, ValueError, "lengths must be 1-D"),
    ([5, 6, 7], {"num_replicas": 0}, ValueError, "num_replicas must be >= 1, got 0"),
    ([5, 6, 7], {"num_replicas": True}, TypeError, "num_replicas must be an int"),
    ([5, 6, 7], {"epoch": -1}, ValueError, "epoch must be >= 0, got -1"),
    ([5, 6, 7], {"epoch": 1.7}, TypeError, "epoch must be an int"),
    ([5, 6, 7], {"min_steps": -1}, ValueError, "min_steps must be >= 0"),
    ([5, 6, 7], {"eligible": np.ones(4, bool)}, ValueError, r"eligible must be a bool mask of shape \(3,\)"),
    ([5, 6, 7], {"eligible": np.array([0, 1, 1])}, ValueError, "eligible must be a bool mask .* dtype int64"),
])
def test_plan_epoch_checks_its_inputs(lengths, kwargs, error, pattern):
    args = {"num_replicas": 2, "epoch": 0, **kwargs}
    with pytest.raises(error, match=pattern):
        plan_epoch(lengths, BatchingSettings(max_tokens=64), **args)


def _hold_time(plan, padded, cost, speeds):
    return hold_time(_batch_costs(padded, plan.rows, plan.batch_offsets, cost)[0], plan.assignment,
                     plan.accumulate_grad_batches, speeds)


@pytest.mark.parametrize("accumulate", [1, 4])
def test_nearly_equal_rank_speeds_keep_the_epoch_length_when_micro_batches_have_an_overhead(accumulate):
    # Shares cut to speeds 1 : 0.997 would need more, smaller micro-batches; with a per-micro-batch overhead
    # (what CostModelFeedback fits in seconds) that holds the ranks longer than the equal-cost cut.
    lengths = np.random.default_rng(4).integers(5, 257, 2000)
    cost = CostModel(linear=1.0, quadratic=1e-3, per_batch=200.0)
    settings = BatchingSettings(max_tokens=1024, seed=0, shuffle=True, drop_last=False, shuffle_window=0.25,
                                accumulate_grad_batches=accumulate)
    args = dict(num_replicas=2, epoch=1, cost_model=cost)
    even = plan_epoch(lengths, settings, **args)
    speeds = np.array([0.997, 1.0])
    near = plan_epoch(lengths, settings, rank_speeds=speeds, **args)
    assert near.num_batches == even.num_batches
    # the cumulative cut for these speeds alone is longer and holds the ranks longer
    padded = padded_lengths(lengths, 1)
    rng = np.random.default_rng(np.random.SeedSequence([0, 1]))
    order = _order(padded, np.arange(lengths.size), 1024, 0.25, rng)
    cuts = _cumulative_by_speed(_Cuts(padded[order], 1024, 1024, cost), speeds, even.num_batches, 2)
    assert cuts and all(count > even.num_batches for count, _ in cuts)
    for count, ends in cuts:
        layout = _Layout(padded=padded, cost_model=cost, num_replicas=2, accumulate_grad_batches=accumulate,
                         speeds=speeds, uniform=False, drop_last=False, largest_first=False, rng=None)
        split = layout.finish(order, ends, count, by_lpt=False)
        assert _hold_time(split, padded, cost, speeds) > _hold_time(near, padded, cost, speeds)


@settings(deadline=None, max_examples=300)
@given(values=st.lists(st.integers(0, 40000), max_size=300), small=st.booleans())
def test_longest_first_order_and_sorted_descending_are_the_stable_sort(values, small):
    """The linear-time orders (int16 radix keys, counting) equal NumPy's stable comparison sort, ties included."""
    from lit_balance.plan.types import longest_first_order, sorted_descending

    v = np.array(values, dtype=np.int64) % (50 if small else 40001)
    reference = np.argsort(-v, kind="stable")
    assert np.array_equal(longest_first_order(v), reference)
    assert sorted_descending(v).dtype == np.int64
    assert np.array_equal(sorted_descending(v), v[reference])


@settings(deadline=None, max_examples=300)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300), max_tokens=st.sampled_from([64, 100, 512]),
       row_cap=st.sampled_from([1, 3, 10_000]), window=st.sampled_from([0.0, 0.1234567, 0.25, 1.0, 2.5]))
def test_shifted_fill_count_equals_cutting_the_shifted_order(lengths, max_tokens, row_cap, window):
    """The run-wise count of the shifted longest-first order equals cutting that order row by row."""
    from lit_balance.plan.padded import _Cuts, _shifted_fill_count

    longest = np.sort(np.array(lengths, dtype=np.int64))[::-1]
    shift = window * max_tokens
    pl = longest
    if shift > 0:
        position = np.cumsum(longest) - longest
        pl = longest[np.searchsorted(position, position - shift, side="left")]
    assert _shifted_fill_count(longest, shift, max_tokens, row_cap) == _Cuts(pl, max_tokens, row_cap,
                                                                              CostModel()).fill_count()
