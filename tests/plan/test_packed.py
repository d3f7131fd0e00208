"""Packed plans (``packing=True``): the sampler's guarantees as properties, the cost, the figures and the bound."""

import collections
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_balance.plan import PLANNERS, planner_for
from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel, plan_epoch, plan_report, plan_stats
from lit_balance.plan import padded_lengths
from lit_balance.plan.stats import batch_persistence, useful_fraction_bound

LENGTHS = Path(__file__).resolve().parents[2] / "lit_balance" / "data" / "lengths"


def _ranks(lengths, num_replicas, epoch=0, **kwargs):
    """Every rank's micro-batches of ``epoch`` (one sampler per rank, as on real ranks)."""
    samplers = [BalancedBatchSampler(lengths, num_replicas=num_replicas, rank=r, packing=True, **kwargs)
                for r in range(num_replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@settings(deadline=None, max_examples=150)
@given(
    data=st.data(),
    max_tokens=st.integers(8, 300),
    num_replicas=st.integers(1, 6),
    pad=st.sampled_from([1, 1, 4, 8]),
    accumulate=st.integers(1, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    max_batch_size=st.one_of(st.none(), st.integers(1, 6)),
    too_long=st.sampled_from(["skip", "truncate"]),
    epoch=st.integers(0, 3),
    speeds=st.booleans(),
    quadratic=st.sampled_from([0.0, 1e-3, 0.05]),
)
def test_packed_plan_invariants(data, max_tokens, num_replicas, pad, accumulate, drop_last, shuffle, max_batch_size,
                                too_long, epoch, speeds, quadratic):
    assume(pad <= max_tokens)
    lengths = np.array(data.draw(st.lists(st.integers(1, max_tokens + 40), min_size=1, max_size=160)))
    rank_speeds = (data.draw(st.lists(st.floats(0.3, 1.0), min_size=num_replicas, max_size=num_replicas))
                   if speeds else None)
    kwargs = {"max_tokens": max_tokens, "pad_to_multiple_of": pad, "accumulate_grad_batches": accumulate,
              "drop_last": drop_last, "shuffle": shuffle, "max_batch_size": max_batch_size, "too_long": too_long,
              "seed": 3, "cost_model": CostModel(quadratic=quadratic), "rank_speeds": rank_speeds}
    capacity = (max_tokens // pad) * pad
    eligible = lengths <= capacity if too_long == "skip" else np.ones(lengths.shape, dtype=bool)
    assume(eligible.any())
    if drop_last and eligible.sum() < num_replicas:
        with pytest.raises(ValueError, match="drop_last=True"):
            _ranks(lengths, num_replicas, epoch, **kwargs)
        return
    samplers, batches = _ranks(lengths, num_replicas, epoch, **kwargs)
    planned = samplers[0].lengths

    # equal counts on every rank, as len() says
    assert len({len(b) for b in batches}) == 1 and all(len(s) == len(batches[0]) for s in samplers)
    # budget: the packed row, padded at its tail to the multiple, within max_tokens; the row cap on documents
    for rank in batches:
        for b in rank:
            assert len(b) >= 1
            assert padded_lengths([planned[list(b)].sum()], pad)[0] <= max_tokens
            assert max_batch_size is None or len(b) <= max_batch_size
    # nothing lost; fills marked, few, and only real documents repeated
    real = collections.Counter(i for rank in batches for b in rank for i, f in zip(b, b.is_fill) if not f)
    fills = [i for rank in batches for b in rank for i, f in zip(b, b.is_fill) if f]
    assert set(real.values()) <= {1}
    expected = set(np.flatnonzero(eligible).tolist())
    plan = samplers[0].plan()
    assert set(real) | set(plan.dropped.tolist()) == expected and not set(real) & set(plan.dropped.tolist())
    if drop_last:
        assert not fills and plan.dropped.size < num_replicas
    else:
        assert plan.dropped.size == 0 and len(fills) < num_replicas and set(fills) <= expected
    # each micro-batch carries its optimizer step's global real tokens and documents
    steps = len(batches[0])
    for s in range(steps):
        window = range((s // accumulate) * accumulate, min((s // accumulate + 1) * accumulate, steps))
        tokens = sum(int(planned[i]) for t in window for rank in batches for i, f in zip(rank[t], rank[t].is_fill)
                     if not f)
        rows = sum(1 for t in window for rank in batches for f in rank[t].is_fill if not f)
        assert all(rank[s].step_real_tokens == tokens and rank[s].step_rows == rows for rank in batches)
    # deterministic from (seed, epoch)
    assert _ranks(lengths, num_replicas, epoch, **kwargs)[1] == batches
    # the epoch's length is fixed by the lengths and settings: every epoch and, with equal speeds, any cost model
    other = samplers[0]
    for e in (epoch + 1, epoch + 2):
        other.set_epoch(e)
        assert len(other) == steps
    if rank_speeds is None:
        assert len(BalancedBatchSampler(lengths, num_replicas=num_replicas, rank=0, packing=True,
                                        **{**kwargs, "cost_model": CostModel(linear=0.0, quadratic=1.0)})) == steps


def test_unequal_rank_speeds_keep_the_epoch_length_of_epoch_0():
    """With unequal speeds two counts are planned and the less wasteful kept: epoch 0 decides for every epoch."""
    lengths = np.array([1] * 10 + [7] + [8] * 6)
    sampler = BalancedBatchSampler(lengths, num_replicas=3, rank=0, packing=True, max_tokens=8, seed=3,
                                   accumulate_grad_batches=3, cost_model=CostModel(quadratic=1e-3),
                                   rank_speeds=[0.5, 0.375, 0.375])
    counts = []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        counts.append((len(sampler), len(list(sampler))))
    assert counts == [(4, 4)] * 6  # len() and the micro-batches yielded: epoch 0's 4 in every epoch


def test_packing_changes_composition_and_balances_on_a_shipped_distribution():
    lengths = np.minimum(np.load(LENGTHS / "lengths_fortunes.npy").astype(np.int64), 512)
    for cost_model in (CostModel(), CostModel(quadratic=1e-3)):
        s = BatchingSettings(max_tokens=4096, packing=True)
        p0, p1 = (plan_epoch(lengths, s, num_replicas=8, epoch=e, cost_model=cost_model) for e in (0, 1))
        stats = plan_stats(p0, lengths, cost_model, planner=PLANNERS["packed"], max_tokens=4096)
        assert stats.useful_fraction >= 0.99
        assert stats.padding_ratio == 0.0 and stats.max_batch_tokens <= 4096
        assert batch_persistence(p0, p1) <= 0.05
        assert p0.num_micro_steps == p1.num_micro_steps


def test_long_documents_under_attention_cost_reach_the_bound():
    lengths = np.minimum(np.load(LENGTHS / "lengths_stdlib_docstrings.npy").astype(np.int64), 4096)
    cost_model = CostModel(quadratic=1e-3)
    for num_replicas in (8, 64):
        plan = plan_epoch(lengths, BatchingSettings(max_tokens=4096, packing=True), num_replicas=num_replicas,
                          epoch=0, cost_model=cost_model)
        stats = plan_stats(plan, lengths, cost_model, planner=PLANNERS["packed"], max_tokens=4096)
        assert stats.useful_fraction_bound < 1.0  # the outliers cost U, whatever the plan
        assert stats.useful_fraction >= 0.95 * stats.useful_fraction_bound


def test_outliers_run_side_by_side():
    # four 1000-token documents among 200 short ones, 4 ranks, attention cost: one step holds all four outliers
    lengths = np.array([1000] * 4 + [20] * 200)
    cost_model = CostModel(quadratic=1e-2)
    plan = plan_epoch(lengths, BatchingSettings(max_tokens=1024, packing=True, seed=1), num_replicas=4, epoch=0,
                      cost_model=cost_model)
    steps_with_outlier = {s for s in range(plan.num_micro_steps) for r in range(4)
                          if (plan.batch(plan.assignment[s, r])[0] < 4).any()}
    assert len(steps_with_outlier) == 1


@settings(deadline=None, max_examples=120)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=80),
    max_tokens=st.integers(200, 400),
    num_replicas=st.integers(1, 4),
    accumulate=st.integers(1, 2),
    quadratic=st.sampled_from([0.0, 1e-2, 0.1]),
    per_batch=st.sampled_from([0.0, 5.0]),
    packing=st.booleans(),
    seed=st.integers(0, 3),
)
def test_no_plan_beats_the_useful_fraction_bound(lengths, max_tokens, num_replicas, accumulate, quadratic, per_batch,
                                                 packing, seed):
    cost_model = CostModel(quadratic=quadratic, per_batch=per_batch)
    lengths = np.array(lengths)
    s = BatchingSettings(max_tokens=max_tokens, packing=packing, accumulate_grad_batches=accumulate, seed=seed)
    plan = plan_epoch(lengths, s, num_replicas=num_replicas, epoch=0, cost_model=cost_model)
    planner = planner_for(s)
    stats = plan_stats(plan, lengths, cost_model, planner=planner, accumulate_grad_batches=accumulate,
                       max_tokens=max_tokens)
    assert stats.useful_fraction <= stats.useful_fraction_bound + 1e-9
    # any other grouping of the same micro-batches into the same steps is bounded too
    rng = np.random.default_rng(seed)
    shuffled = plan.assignment.reshape(-1)[rng.permutation(plan.assignment.size)].reshape(plan.assignment.shape)
    other = plan_stats(type(plan)(plan.rows, plan.is_fill, plan.batch_offsets, shuffled, plan.dropped, accumulate),
                       lengths, cost_model, planner=planner, accumulate_grad_batches=accumulate, max_tokens=max_tokens)
    assert other.useful_fraction <= stats.useful_fraction_bound + 1e-9


def test_bound_of_two_outlier_steps_is_reached_by_the_obvious_plan():
    cost_model = CostModel(quadratic=1e-3)
    lengths = np.array([4096] * 3 + [100] * 64)
    bound = useful_fraction_bound(lengths, cost_model, num_replicas=2, num_micro_steps=3, max_tokens=4096)
    # step 0: two outliers; step 1: the third and 40 short documents; step 2: 12 short ones per rank
    rank_batches = [[[0], [2], list(range(43, 55))], [[1], list(range(3, 43)), list(range(55, 67))]]
    u = plan_stats(rank_batches, lengths, cost_model, planner=PLANNERS["packed"]).useful_fraction
    assert u <= bound and u >= 0.995 * bound
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        useful_fraction_bound(lengths, cost_model, num_replicas=0, num_micro_steps=3, max_tokens=4096)


def test_packed_cost_and_padding_in_the_figures():
    lengths = np.array([5, 3, 7, 2])
    cost_model = CostModel(linear=1.0, quadratic=0.5, per_batch=2.0)
    rank_batches = [[[0, 1]], [[2, 3, 0]]]  # the second 0 is a fill row: it runs, but is not real
    stats = plan_stats(rank_batches, lengths, cost_model, planner=PLANNERS["packed"], pad_to_multiple_of=4)
    assert stats.rank_cost.tolist() == [[2 + 5 + 12.5 + 3 + 4.5, 2 + 7 + 24.5 + 2 + 2 + 5 + 12.5]]
    assert stats.rank_real_tokens.tolist() == [8, 9]
    assert stats.rank_padded_tokens.tolist() == [8, 16]  # 8 fits the multiple; 14 rounds up to 16
    assert stats.max_batch_tokens == 16 and stats.duplicated_rows == 1
    packed = plan_stats(rank_batches, lengths, cost_model, planner=PLANNERS["packed"])
    assert packed.padding_ratio == pytest.approx(1 - 17 / 22)
    assert CostModel().packed_cost([3, 4]) == 7.0


def test_plan_report_of_a_packed_plan_has_no_padding():
    lengths = np.minimum(np.load(LENGTHS / "lengths_stdlib_docstrings.npy")[:3000].astype(np.int64), 512)
    report = plan_report(lengths, 2048, num_replicas=2, packing=True, cost_model=CostModel(quadratic=1e-3))
    summary = report.summary()
    assert summary["balanced"]["padding_ratio"] == 0.0 and summary["distributed_sampler"]["padding_ratio"] > 0.2
    assert summary["balanced"]["useful_fraction"] > summary["distributed_sampler"]["useful_fraction"]
    assert 0 < summary["balanced"]["useful_fraction"] <= summary["balanced"]["useful_fraction_bound"] <= 1
    assert summary["settings"]["packing"] is True and summary["balanced"]["max_batch_tokens"] <= 2048


def test_too_long_documents_follow_the_policy_when_packed():
    with pytest.raises(ValueError, match=r"1 sample\(s\) exceed max_tokens=100 .*index 1: 101 tokens"):
        BalancedBatchSampler([50, 101, 20], 100, num_replicas=1, rank=0, packing=True)
    truncated = BalancedBatchSampler([50, 101, 20], 100, num_replicas=1, rank=0, packing=True, too_long="truncate")
    assert truncated.lengths.tolist() == [50, 100, 20]
    assert sorted(i for b in truncated for i in b) == [0, 1, 2]
    skipped = BalancedBatchSampler([50, 101, 20], 100, num_replicas=1, rank=0, packing=True, too_long="skip")
    assert sorted(i for b in skipped for i in b) == [0, 2] and skipped.num_skipped == 1


def test_largest_first_puts_the_longest_document_first():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500)
    for accumulate in (1, 2):
        _, batches = _ranks(lengths, 3, epoch=1, max_tokens=512, largest_first=True,
                            accumulate_grad_batches=accumulate)
        first = [i for rank in batches for b in rank[:accumulate] for i in b]
        assert int(np.argmax(lengths)) in first


@pytest.mark.parametrize("min_steps", [0, 30])
def test_an_epoch_whose_shuffled_packing_fails_falls_back_to_the_count_packing(monkeypatch, min_steps):
    from lit_balance.plan import packed as packing

    real_pack = packing._pack
    monkeypatch.setattr(packing, "_pack", lambda *a: None if a[-1] is not None else real_pack(*a))
    lengths = np.random.default_rng(0).integers(1, 120, 300)
    s = BatchingSettings(max_tokens=512, packing=True, accumulate_grad_batches=2)
    plans = [plan_epoch(lengths, s, num_replicas=3, epoch=e, min_steps=min_steps) for e in (0, 1)]
    for plan in plans:
        sums = np.add.reduceat(lengths[plan.rows], plan.batch_offsets[:-1])
        assert sums.max() <= 512 and np.diff(plan.batch_offsets).min() >= 1
        assert sorted(plan.rows.tolist()) == list(range(300)) and not plan.is_fill.any()
        assert plan.num_micro_steps >= min_steps
    assert plans[0].num_micro_steps == plans[1].num_micro_steps
    # the same micro-batches (the unshuffled packing), in another order
    assert (sorted(map(tuple, np.split(plans[0].rows, plans[0].batch_offsets[1:-1])))
            == sorted(map(tuple, np.split(plans[1].rows, plans[1].batch_offsets[1:-1]))))


def _first_fit(lengths, k, capacity, doc_cap):
    """A valid packing of ``lengths`` into ``k`` non-empty bins (one document each, then first fit), or None."""
    bin_of = np.full(lengths.shape[0], -1, dtype=np.int64)
    tokens, count = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        fits = np.flatnonzero((tokens + length <= capacity) & (count < doc_cap))
        if i < k:
            fits = np.array([i])
        if not fits.size:
            return None
        bin_of[i] = fits[0]
        tokens[fits[0]] += length
        count[fits[0]] += 1
    return bin_of


@settings(deadline=None, max_examples=200)
@given(data=st.data(), capacity=st.integers(8, 400), num_replicas=st.integers(1, 8), num_steps=st.integers(1, 5),
       doc_cap=st.integers(1, 12), quadratic=st.sampled_from([0.0, 1e-3, 0.05]))
def test_exchanges_keep_every_document_once_within_budget_and_slow_no_step(data, capacity, num_replicas, num_steps,
                                                                         doc_cap, quadratic):
    from lit_balance.plan.packed import _polish

    k = num_replicas * num_steps
    lengths = np.array(data.draw(st.lists(st.integers(1, capacity), min_size=k, max_size=6 * k)), dtype=np.int64)
    bin_of = _first_fit(lengths, k, capacity, doc_cap)
    assume(bin_of is not None)
    group_of_bin = np.random.default_rng(data.draw(st.integers(0, 99))).permutation(np.arange(k) // num_replicas)
    cost = CostModel(quadratic=quadratic).row_cost(lengths)
    given_bins = bin_of.copy()
    out = _polish(lengths, cost, bin_of, group_of_bin, capacity, doc_cap)
    assert np.array_equal(bin_of, given_bins)  # the input is not changed
    assert out.shape == lengths.shape and out.min() >= 0 and out.max() < k  # every document in exactly one bin
    count = np.bincount(out, minlength=k)
    assert (np.bincount(out, weights=lengths, minlength=k) <= capacity).all()
    assert (count >= 1).all() and (count <= doc_cap).all()

    def levels(b):
        level = np.zeros(num_steps)
        np.maximum.at(level, group_of_bin, np.bincount(b, weights=cost, minlength=k))
        return level

    assert (levels(out) <= levels(given_bins) * (1 + 1e-9) + 1e-12).all()  # no step waits longer


def test_exchanges_lower_the_step_that_waits_for_one_micro_batch():
    from lit_balance.plan.packed import _polish

    lengths = np.array([4, 2, 2])  # one step of two ranks: [4 2] and [2] cost 6 and 2; [4] and [2 2] cost 4 and 4
    out = _polish(lengths, lengths.astype(np.float64), np.array([0, 0, 1]), np.array([0, 0]), 10, 4)
    assert sorted(np.bincount(out, weights=lengths).tolist()) == [4.0, 4.0]


def test_packed_plans_of_long_documents_on_many_ranks_wait_no_longer_with_exchanges(monkeypatch):
    import lit_balance.plan.packed as packed

    lengths = np.minimum(np.load(LENGTHS / "lengths_linux_docs.npy").astype(np.int64), 4096)
    settings_ = BatchingSettings(max_tokens=4096, packing=True, seed=0)

    def useful(plan):
        return plan_stats(plan, lengths, CostModel(), planner=planner_for(settings_), max_tokens=4096).useful_fraction

    with_exchanges = plan_epoch(lengths, settings_, num_replicas=64, epoch=0)
    monkeypatch.setattr(packed, "_polish", lambda length, cost, bin_of, *args: bin_of)
    without = plan_epoch(lengths, settings_, num_replicas=64, epoch=0)
    assert with_exchanges.num_batches == without.num_batches
    assert useful(with_exchanges) >= useful(without)


@settings(deadline=None, max_examples=150)
@given(data=st.data(), max_tokens=st.integers(8, 300), num_replicas=st.integers(1, 6), accumulate=st.integers(1, 3),
       drop_last=st.booleans(), max_batch_size=st.one_of(st.none(), st.integers(1, 6)), min_steps=st.integers(0, 40),
       masked=st.booleans(), pad=st.sampled_from([1, 8]))
def test_the_counted_micro_steps_are_those_of_the_plan(data, max_tokens, num_replicas, accumulate, drop_last,
                                                       max_batch_size, min_steps, masked, pad):
    from lit_balance.plan.assign import steps_by_planning
    from lit_balance.plan.packed import count_steps, plan_packed

    assume(pad <= max_tokens)
    capacity = (max_tokens // pad) * pad
    lengths = np.array(data.draw(st.lists(st.integers(1, capacity), min_size=1, max_size=120)), dtype=np.int64)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=lengths.size, max_size=lengths.size))) if masked \
        else None
    s = BatchingSettings(max_tokens=max_tokens, packing=True, pad_to_multiple_of=pad,
                         accumulate_grad_batches=accumulate, drop_last=drop_last, max_batch_size=max_batch_size, seed=7)
    assert count_steps(lengths, mask, s, num_replicas, min_steps, CostModel()) == steps_by_planning(
        plan_packed, lengths, mask, s, num_replicas, min_steps, CostModel())
