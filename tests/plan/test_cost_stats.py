"""CostModel, plan statistics and the planner's cost balance, with exact hand-computed cases."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_balance.plan import PLANNERS
from lit_balance import BalancedBatchSampler, CostModel, EpochPlan
from lit_balance.plan.stats import batch_persistence, plan_stats


def test_batch_cost_formula_and_broadcasting():
    model = CostModel(linear=2.0, quadratic=0.5, per_batch=3.0)
    assert model.batch_cost(4, 10) == 3 + 4 * (2 * 10 + 0.5 * 100)
    assert model.batch_cost(np.array([1, 2]), np.array([2, 4])).tolist() == [3 + 4 + 2, 3 + 2 * (8 + 8)]
    assert model.row_cost([3]).tolist() == [2 * 3 + 0.5 * 9]
    assert model.to_dict() == {"linear": 2.0, "quadratic": 0.5, "per_batch": 3.0}


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"linear": -1.0}, ValueError, "linear must be a finite number >= 0, got -1.0"),
        ({"quadratic": float("nan")}, ValueError, "quadratic must be a finite number"),
        ({"per_batch": "1"}, TypeError, "per_batch must be a number"),
        ({"linear": True}, TypeError, "linear must be a number"),
        ({"linear": 0.0}, ValueError, "needs linear > 0 or quadratic > 0"),
    ],
)
def test_cost_model_rejects_bad_coefficients(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        CostModel(**kwargs)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 64, 200)
    length = rng.integers(8, 512, 200)
    seconds = 2e-3 + rows * (3e-6 * length + 4e-9 * length**2)
    fitted = CostModel.fit(rows, length, seconds)
    assert fitted.linear == pytest.approx(3e-6, rel=1e-6)
    assert fitted.quadratic == pytest.approx(4e-9, rel=1e-5)
    assert fitted.per_batch == pytest.approx(2e-3, rel=1e-6)


def test_fit_keeps_coefficients_non_negative_and_checks_input():
    rows, length = np.full(10, 4), np.arange(10, 20)
    fitted = CostModel.fit(rows, length, rows * length * 1e-6 - 1e-9)  # a tiny negative intercept is clipped
    assert fitted.per_batch == 0 and fitted.linear > 0
    with pytest.raises(ValueError, match="at least 3 timed micro-batches, got 2"):
        CostModel.fit([1, 2], [3, 4], [0.1, 0.2])
    with pytest.raises(ValueError, match="same length, got 3, 3, 2"):
        CostModel.fit([1, 2, 3], [3, 4, 5], [0.1, 0.2])
    with pytest.raises(ValueError, match="do not grow with tokens"):
        CostModel.fit([1, 2, 3, 4], [30, 20, 10, 40], [5.0, 5.0, 5.0, 5.0])


def _plan(batches, assignment, fill=None):
    rows = np.concatenate([np.asarray(b) for b in batches])
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in batches])])
    is_fill = np.zeros(rows.size, dtype=bool) if fill is None else np.asarray(fill, dtype=bool)
    return EpochPlan(rows=rows, is_fill=is_fill, batch_offsets=offsets, assignment=np.asarray(assignment),
                     dropped=np.empty(0, dtype=np.int64))


def test_plan_stats_exact_values():
    lengths = np.array([4, 2, 3, 3, 1])
    # batch 0 = [0, 1] -> 2 x 4 = 8 slots; batch 1 = [2, 3] -> 6; batch 2 = [4] -> 1; batch 3 = [4] (fill) -> 1
    plan = _plan([[0, 1], [2, 3], [4], [4]], [[0, 1], [2, 3]], fill=[0, 0, 0, 0, 0, 1])
    stats = plan_stats(plan, lengths)
    assert stats.rank_cost.tolist() == [[8, 6], [1, 1]]
    assert stats.rank_real_tokens.tolist() == [4 + 2 + 1, 3 + 3]
    assert stats.rank_padded_tokens.tolist() == [9, 7]
    assert stats.padding_ratio == pytest.approx(1 - 13 / 16)
    assert stats.step_imbalance.tolist() == pytest.approx([8 / 7, 1.0])
    assert stats.useful_fraction == pytest.approx(13 / (2 * 8 + 2 * 1))
    assert stats.max_batch_tokens == 8
    # two micro-batches per optimizer step: ranks wait once, on their sums 9 and 7
    assert plan_stats(plan, lengths, accumulate_grad_batches=2).useful_fraction == pytest.approx(13 / (2 * 9))
    attention = plan_stats(plan, lengths, CostModel(linear=1.0, quadratic=1.0))
    assert attention.real_cost == sum(x + x * x for x in [4, 2, 3, 3, 1])


def test_batch_persistence_exact_values():
    a = _plan([[0, 1, 2], [3, 4]], [[0, 1]])
    same = _plan([[3, 4], [0, 1, 2]], [[0, 1]])
    # 0 keeps 1 of its 2 mates, 1 keeps 1 of 2, 2 keeps 0 of 2; 3 and 4 keep 0 of 1
    moved = _plan([[0, 1, 3], [2, 4]], [[0, 1]])
    assert batch_persistence(a, same) == 1.0
    assert batch_persistence(a, moved) == pytest.approx((0.5 + 0.5 + 0 + 0 + 0) / 5)
    assert batch_persistence(_plan([[0], [1]], [[0, 1]]), _plan([[0, 1]], [[0]])) == 0.0  # nobody had mates


@settings(deadline=None, max_examples=80)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=200),
    num_replicas=st.integers(1, 8),
    accumulate=st.integers(1, 3),
    epoch=st.integers(0, 3),
    quadratic=st.sampled_from([0.0, 1e-3]),
)
def test_largest_first_puts_the_longest_sample_in_step_zero(lengths, num_replicas, accumulate, epoch, quadratic):
    sampler = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=0, largest_first=True,
                                   accumulate_grad_batches=accumulate, cost_model=CostModel(1.0, quadratic))
    plan = sampler.plan(epoch)
    first = {int(i) for b in plan.assignment[0] for i in plan.batch(int(b))[0]}
    assert max(lengths[i] for i in first) == max(lengths)


@settings(deadline=None, max_examples=60)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=200), num_replicas=st.integers(1, 8),
       accumulate=st.integers(1, 4), window=st.sampled_from([0.0, 0.25, 2.0]))
def test_budget_counts_coverage_with_costs_and_accumulation(lengths, num_replicas, accumulate, window):
    per_rank = []
    for rank in range(num_replicas):
        sampler = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=rank, shuffle_window=window,
                                       accumulate_grad_batches=accumulate, cost_model=CostModel(1.0, 1e-3, 5.0))
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(len(b) * max(lengths[i] for i in b) <= 512 for b in batches)
        # every micro-batch of an optimizer step carries the same global totals
        for g in range(0, len(batches), accumulate):
            assert len({(b.step_real_tokens, b.step_rows) for b in batches[g:g + accumulate]}) == 1
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1
    real = sorted(i for batches in per_rank for b in batches for i, f in zip(b, b.is_fill) if not f)
    assert real == list(range(len(lengths)))
    # the step totals add up to the epoch's real tokens and rows
    groups = {}
    for rank_batches in per_rank:
        for s, b in enumerate(rank_batches):
            groups.setdefault(s // accumulate, []).append(b)
    assert sum(bs[0].step_real_tokens for bs in groups.values()) == sum(lengths)
    assert sum(bs[0].step_rows for bs in groups.values()) == len(lengths)
    for bs in groups.values():
        assert bs[0].step_real_tokens == sum(lengths[i] for b in bs for i, f in zip(b, b.is_fill) if not f)


@pytest.mark.parametrize(
    ("lengths", "pattern"),
    [
        (np.ma.array([3, 4], mask=[0, 1]), "masked array"),
        ((n for n in [3, 4]), "got generator"),
        ("34", "got str"),
    ],
)
def test_lengths_of_odd_containers_raise_clearly(lengths, pattern):
    with pytest.raises(ValueError, match=pattern):
        BalancedBatchSampler(lengths, 10, num_replicas=1, rank=0)


def test_plan_stats_checks_its_inputs():
    sampler = BalancedBatchSampler([3, 4, 5], 10, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 1, got 0"):
        plan_stats(sampler.plan(), sampler.lengths, pad_to_multiple_of=0)
    with pytest.raises(TypeError, match="accumulate_grad_batches must be an int >= 1, got 1.5"):
        plan_stats(sampler.plan(), sampler.lengths, accumulate_grad_batches=1.5)
    with pytest.raises(ValueError, match=r"the plan uses index 2\), got shape \(1,\)"):
        plan_stats(sampler.plan(), [1])
    with pytest.raises(TypeError, match="cost_model must be a lit_balance.CostModel"):
        plan_stats(sampler.plan(), sampler.lengths, cost_model="tokens")
    with pytest.raises(ValueError, match="min_samples must be an int >= 1, got 0"):
        CostModel.fit([], [], [], min_samples=0)


def test_rank_speeds_must_be_a_flat_list_of_numbers():
    with pytest.raises(TypeError, match="rank_speeds must be numbers"):
        BalancedBatchSampler([3, 4], 10, num_replicas=2, rank=0, rank_speeds=[True, True])
    with pytest.raises(ValueError, match="rank_speeds must be 1-D"):
        BalancedBatchSampler([3, 4], 10, num_replicas=2, rank=0, rank_speeds=[[1.0], [2.0]])
    with pytest.raises(ValueError, match=r"rank_speeds must hold 2 finite numbers > 0"):
        BalancedBatchSampler([3, 4], 10, num_replicas=2, rank=0, rank_speeds=[1.0, 0.0])


@pytest.mark.parametrize(("rows", "dtype"), [(["a", "b", "c"], "<U1"), ([True, False, True], "bool"),
                                             ([1, None, 2], "object")])
def test_fit_rejects_arrays_that_are_not_numbers(rows, dtype):
    with pytest.raises(TypeError, match=f"CostModel.fit: rows must be numbers .*got dtype {dtype}"):
        CostModel.fit(rows, [10, 20, 30], [1.0, 2.0, 3.0])


# Per-rank lists of micro-batches (any sampler's output): 6 samples, 2 ranks, rank 1 has one micro-batch more;
# samples 4 and 1 repeat, sample 5 never appears.
LENGTHS = np.array([4, 2, 2, 1, 3, 5])
RANK_BATCHES = [
    [[0, 1], [3]],  # rank 0: 2 x 4 = 8 slots (real 6); 1 slot (real 1)
    [[2], [4, 4], [1]],  # rank 1: 2 slots (real 2); 2 x 3 = 6 slots (real 3, one repeat); 2 slots (a repeat)
]


def test_plan_stats_of_rank_lists_token_cost():
    stats = plan_stats(RANK_BATCHES, LENGTHS, CostModel())
    np.testing.assert_array_equal(stats.rank_cost, [[8, 2], [1, 6], [0, 2]])  # rank 0 has nothing at step 2: 0
    assert stats.padding_ratio == pytest.approx(1 - 12 / 19)  # real tokens of samples 0..4 once: 12; slots: 19
    np.testing.assert_allclose(stats.step_imbalance, [8 / 5, 6 / 3.5, 2 / 1])
    assert stats.useful_fraction == pytest.approx(12 / (2 * (8 + 6 + 2)))
    assert stats.max_batch_tokens == 8
    np.testing.assert_array_equal(stats.rank_micro_batches, [2, 3])
    np.testing.assert_array_equal(stats.rank_real_tokens, [6 + 1, 2 + 3])  # repeats (rank 1's 4 and 1) excluded
    assert (stats.dropped_samples, stats.duplicated_rows) == (1, 2)  # sample 5 dropped; 4 and 1 repeated once
    assert stats.over_budget_ratio(6) == pytest.approx(1 / 5)  # only the 8-slot micro-batch of 5
    assert stats.over_budget_ratio(8) == 0.0
    assert stats.budget_fill_ratio(6) == pytest.approx(19 / (5 * 6))


def test_plan_stats_of_rank_lists_quadratic_cost():
    stats = plan_stats(RANK_BATCHES, LENGTHS, CostModel(linear=0, quadratic=1))
    np.testing.assert_allclose(stats.rank_cost, [[32, 4], [1, 18], [0, 4]])  # rows x L^2
    assert stats.real_cost == pytest.approx(16 + 4 + 4 + 1 + 9)
    assert stats.useful_fraction == pytest.approx(34 / (2 * (32 + 18 + 4)))


def test_plan_stats_of_rank_lists_checks_its_inputs():
    with pytest.raises(ValueError, match=r"the plan uses index 4\), got shape \(4,\)"):
        plan_stats(RANK_BATCHES, LENGTHS[:4])
    with pytest.raises(ValueError, match="sample indices >= 0, got -1"):
        plan_stats([[[0, -1]]], LENGTHS)
    with pytest.raises(TypeError, match="got ndarray"):
        plan_stats(np.zeros((2, 2, 2), dtype=int), LENGTHS)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([[0, 1, 2, 3]], [[0, 1], [2, 3]], 1 / 3),  # each keeps 1 of its 3 batch-mates
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]], 0.0),
        ([[0, 1], [2, 3]], [[3, 2], [1, 0]], 1.0),  # order within and between batches does not matter
        ([[0, 1, 2]], [[0, 1]], 0.5),  # 2 is missing from b: left out of the mean, still a batch-mate in a
        ([[0], [1]], [[0, 1]], 0.0),  # nobody has batch-mates in a
        ([[0, 1], [1, 2]], [[0, 1], [2]], 1.0),  # the repeat of 1 is ignored: 2 is alone in a
    ],
)
def test_batch_persistence_of_rank_lists(a, b, expected):
    assert batch_persistence([a], [b]) == pytest.approx(expected)  # one rank
    two_ranks = [a[0::2], a[1::2]]  # dealt to 2 ranks: step-major order is the same list of micro-batches
    assert batch_persistence(two_ranks, [b]) == pytest.approx(expected)


def _rank_lists(plan: EpochPlan) -> list[list[list[int]]]:
    """The plan as each rank yields it: ``[rank][micro_step]`` -> indices."""
    return [[plan.batch(int(b))[0].tolist() for b in plan.assignment[:, r]] for r in range(plan.assignment.shape[1])]


@settings(deadline=None, max_examples=60)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=150),
    num_replicas=st.integers(1, 6),
    accumulate=st.integers(1, 3),
    window=st.sampled_from([0.0, 0.25, 2.0]),
    drop_last=st.booleans(),
    pad=st.sampled_from([1, 8]),
    quadratic=st.sampled_from([0.0, 1e-3]),
)
def test_figures_of_a_plan_and_of_its_rank_lists_agree(lengths, num_replicas, accumulate, window, drop_last, pad,
                                                       quadratic):
    cost = CostModel(1.0, quadratic, 2.0)
    try:
        sampler = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=0, shuffle_window=window,
                                       drop_last=drop_last, pad_to_multiple_of=pad,
                                       accumulate_grad_batches=accumulate, cost_model=cost)
    except ValueError:  # drop_last=True leaving no micro-batch for any rank
        assume(False)
    plans = sampler.plan(0), sampler.plan(1)
    kwargs = {"pad_to_multiple_of": pad, "accumulate_grad_batches": accumulate}
    ours, lists = plan_stats(plans[0], sampler.lengths, cost, **kwargs), plan_stats(
        _rank_lists(plans[0]), sampler.lengths, cost, **kwargs)
    np.testing.assert_allclose(lists.rank_cost, ours.rank_cost, rtol=1e-12)
    for name in ("rank_padded_tokens", "rank_micro_batches", "batch_padded_tokens"):
        assert sorted(getattr(lists, name).tolist()) == sorted(getattr(ours, name).tolist()), name
    np.testing.assert_array_equal(lists.rank_padded_tokens, ours.rank_padded_tokens)
    assert lists.rank_real_tokens.sum() == ours.rank_real_tokens.sum()  # a repeat may be counted on another rank
    assert lists.real_cost == pytest.approx(ours.real_cost, rel=1e-12)
    assert lists.padding_ratio == pytest.approx(ours.padding_ratio, abs=1e-12)
    assert lists.useful_fraction == pytest.approx(ours.useful_fraction, rel=1e-12)
    np.testing.assert_allclose(lists.step_imbalance, ours.step_imbalance, rtol=1e-12)
    assert (lists.max_batch_tokens, lists.dropped_samples, lists.duplicated_rows) == (
        ours.max_batch_tokens, ours.dropped_samples, ours.duplicated_rows)
    assert ours.duplicated_rows == int(plans[0].is_fill.sum())
    assert ours.dropped_samples == plans[0].dropped.size
    assert lists.over_budget_ratio(512) == ours.over_budget_ratio(512) == 0.0
    if not (plans[0].is_fill.any() or plans[1].is_fill.any()):  # else a list may keep another copy as the real one
        assert batch_persistence(*map(_rank_lists, plans)) == pytest.approx(batch_persistence(*plans), abs=1e-12)


def test_plan_stats_packed_exact_values():
    cost = CostModel(linear=1, quadratic=0.5, per_batch=3)
    stats = plan_stats(RANK_BATCHES, LENGTHS, cost, planner=PLANNERS["packed"])
    # packed rows: rank 0: [4 + 2], [1]; rank 1: [2], [3 + 3] (a repeat of 4, computed all the same), [2]
    np.testing.assert_array_equal(stats.batch_padded_tokens, [6, 2, 1, 6, 2])  # step-major: (0, 0), (0, 1), ...
    np.testing.assert_array_equal(stats.rank_padded_tokens, [7, 10])
    per_doc = {n: n + 0.5 * n * n for n in range(6)}
    np.testing.assert_allclose(stats.rank_cost, [[3 + per_doc[4] + per_doc[2], 3 + per_doc[2]],
                                                 [3 + per_doc[1], 3 + 2 * per_doc[3]], [0, 3 + per_doc[2]]])
    assert stats.padding_ratio == pytest.approx(1 - 12 / 17)  # only the repeats (3 and 2 tokens) are waste
    assert stats.real_cost == pytest.approx(sum(per_doc[n] for n in (4, 2, 2, 1, 3)))
    assert stats.max_batch_tokens == 6 and stats.over_budget_ratio(5) == pytest.approx(2 / 5)
    assert (stats.dropped_samples, stats.duplicated_rows) == (1, 2)


@settings(deadline=None, max_examples=60)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    data=st.data(),
    accumulate=st.integers(1, 3),
    pad=st.sampled_from([1, 4]),
    coefficients=st.tuples(st.sampled_from([0.5, 1.0]), st.sampled_from([0.0, 1e-3, 0.2]),
                           st.sampled_from([0.0, 7.0])),
)
def test_plan_stats_packed_equal_a_direct_sum(lengths, data, accumulate, pad, coefficients):
    num_replicas = data.draw(st.integers(1, 4))
    indices = st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=6)
    rank_batches = [data.draw(st.lists(indices, max_size=5)) for _ in range(num_replicas)]
    cost = CostModel(*coefficients)
    stats = plan_stats(rank_batches, np.array(lengths), cost, planner=PLANNERS["packed"], pad_to_multiple_of=pad,
                       accumulate_grad_batches=accumulate)
    def row(batch):  # the packed row's tokens, its tail padded to the multiple
        return -(-sum(lengths[i] for i in batch) // pad) * pad

    steps = -(-max(map(len, rank_batches)) // accumulate) if any(rank_batches) else 0
    expected = np.zeros((steps, num_replicas))
    for r, batches in enumerate(rank_batches):
        for s, batch in enumerate(batches):
            expected[s // accumulate, r] += cost.per_batch + sum(  # the row's padded tail costs nothing
                cost.linear * lengths[i] + cost.quadratic * lengths[i] ** 2 for i in batch)
    np.testing.assert_allclose(stats.rank_cost, expected, rtol=1e-12)
    assert stats.rank_padded_tokens.tolist() == [sum(row(b) for b in bs) for bs in rank_batches]
    assert stats.max_batch_tokens == max((row(b) for bs in rank_batches for b in bs), default=0)
