"""Per-rank budgets (``max_tokens`` a list, one per data-parallel rank): the sampler's guarantees as properties,
padded and packed, resume (also onto another world size with a new list), and the errors."""

import collections
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel, plan_epoch, plan_stats
from lit_balance.plan import padded_lengths, planner_for


def _ranks(lengths, max_tokens, num_replicas, epoch=0, **kwargs):
    """Every rank's sampler and micro-batches of ``epoch`` (one sampler per rank, as on real ranks)."""
    samplers = [BalancedBatchSampler(lengths, max_tokens, num_replicas=num_replicas, rank=r, **kwargs)
                for r in range(num_replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


def _slots(planned, batch, pad, packing):
    """Token slots of one micro-batch: the packed row padded at its tail, or rows x longest padded row."""
    if packing:
        return int(padded_lengths([planned[list(batch)].sum()], pad)[0])
    return len(batch) * int(padded_lengths(planned[list(batch)], pad).max())


def _real(batches):
    return [i for b in batches for i, fill in zip(b, b.is_fill) if not fill]


def _check_budgets(batches, budgets, planned, pad, packing):
    for rank, rank_batches in enumerate(batches):
        for b in rank_batches:
            assert len(b) >= 1
            assert _slots(planned, b, pad, packing) <= budgets[rank], (rank, list(b), budgets[rank])


@settings(deadline=None, max_examples=120)
@given(
    data=st.data(),
    packing=st.booleans(),
    num_replicas=st.integers(1, 6),
    pad=st.sampled_from([1, 1, 4]),
    accumulate=st.integers(1, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    max_batch_size=st.one_of(st.none(), st.integers(1, 5)),
    too_long=st.sampled_from(["skip", "truncate"]),
    largest_first=st.booleans(),
    epoch=st.integers(0, 3),
    speeds=st.booleans(),
    quadratic=st.sampled_from([0.0, 1e-3]),
)
def test_per_rank_plan_invariants(data, packing, num_replicas, pad, accumulate, drop_last, shuffle, max_batch_size,
                                  too_long, largest_first, epoch, speeds, quadratic):
    budgets = data.draw(st.lists(st.sampled_from([16, 24, 40, 64, 100]), min_size=num_replicas,
                                 max_size=num_replicas))
    largest = max(budgets)
    lengths = np.array(data.draw(st.lists(st.integers(1, largest + 20), min_size=1, max_size=120)))
    rank_speeds = (data.draw(st.lists(st.floats(0.3, 1.0), min_size=num_replicas, max_size=num_replicas))
                   if speeds else None)
    kwargs = {"packing": packing, "pad_to_multiple_of": pad, "accumulate_grad_batches": accumulate,
              "drop_last": drop_last, "shuffle": shuffle, "max_batch_size": max_batch_size, "too_long": too_long,
              "largest_first": largest_first, "seed": 5, "cost_model": CostModel(quadratic=quadratic),
              "rank_speeds": rank_speeds}
    capacity = (largest // pad) * pad
    eligible = lengths <= capacity if too_long == "skip" else np.ones(lengths.shape, dtype=bool)
    planned = np.minimum(lengths, capacity) if too_long == "truncate" else lengths
    if not eligible.any():
        with pytest.raises(ValueError, match="max_tokens"):
            _ranks(lengths, budgets, num_replicas, epoch, **kwargs)
        return
    shortest = int(padded_lengths(planned, pad).min())
    if shortest > min(budgets):  # a rank whose budget holds no sample could run no micro-batch
        with pytest.raises(ValueError, match=r"max_tokens=\[.*budget below every sample"):
            _ranks(lengths, budgets, num_replicas, epoch, **kwargs)
        return
    try:
        samplers, batches = _ranks(lengths, budgets, num_replicas, epoch, **kwargs)
    except ValueError as error:  # drop_last with too few samples for any micro-batch
        assert drop_last and "drop_last=True" in str(error)
        return
    assert np.array_equal(samplers[0].lengths, planned)

    # equal counts on every rank, as len() says
    assert len({len(b) for b in batches}) == 1 and all(len(s) == len(batches[0]) for s in samplers)
    # each micro-batch within its own rank's budget (and the row cap)
    _check_budgets(batches, budgets, planned, pad, packing)
    assert all(max_batch_size is None or len(b) <= max_batch_size for rank in batches for b in rank)
    # every eligible sample exactly once (or dropped, with drop_last); fills marked and only real samples
    real = collections.Counter(_real(b for rank in batches for b in rank))
    assert set(real.values()) <= {1}
    plan = samplers[0].plan()
    expected = set(np.flatnonzero(eligible).tolist())
    assert set(real) | set(plan.dropped.tolist()) == expected and not set(real) & set(plan.dropped.tolist())
    if not drop_last:
        assert plan.dropped.size == 0
    fills = [i for rank in batches for b in rank for i, f in zip(b, b.is_fill) if f]
    assert set(fills) <= set(range(lengths.shape[0]))
    # the same plan on every rank, and again from a fresh sampler (determinism)
    assert all(np.array_equal(s.plan().assignment, plan.assignment) for s in samplers)
    assert _ranks(lengths, budgets, num_replicas, epoch, **kwargs)[1] == batches


@settings(deadline=None, max_examples=80)
@given(
    data=st.data(),
    packing=st.booleans(),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    accumulate=st.integers(1, 2),
    shuffle=st.booleans(),
    windowed=st.booleans(),
)
def test_per_rank_resume_continues_the_epoch_also_on_another_world(data, packing, old, new, accumulate, shuffle,
                                                                    windowed):
    """Stop after k micro-batches, save (through torch.save / weights_only load), resume on ``new`` ranks with a
    list of ``new`` budgets (the same largest budget): on the same ranks exactly the uninterrupted run's
    micro-batches; on others every sample once, equal counts, each micro-batch within its own rank's budget."""
    # in windows, every sample fits every rank (a window with no sample within a rank's budget is refused)
    sizes = [40, 64] if windowed else [24, 40, 64]
    old_budgets = data.draw(st.lists(st.sampled_from(sizes), min_size=old - 1, max_size=old - 1)) + [64]
    new_budgets = (old_budgets if new == old else
                   data.draw(st.lists(st.sampled_from(sizes), min_size=new - 1, max_size=new - 1)) + [64])
    lengths = np.array(data.draw(st.lists(st.integers(1, 40 if windowed else 64), min_size=1, max_size=90)))
    kwargs = {"packing": packing, "accumulate_grad_batches": accumulate, "shuffle": shuffle, "seed": 2}
    if windowed:
        kwargs["plan_window"] = max(1, lengths.shape[0] // 2)
    shortest = int(lengths.min())
    if shortest > min(old_budgets) or shortest > min(new_budgets):
        return  # refused (test_per_rank_plan_invariants)
    _, full = _ranks(lengths, old_budgets, old, epoch=1, **kwargs)
    n = len(full[0])
    k = data.draw(st.integers(0, n - 1))  # the whole epoch consumed is the next epoch's start
    before, heads = [], []
    for r in range(old):
        s = BalancedBatchSampler(lengths, old_budgets, num_replicas=old, rank=r, **kwargs)
        s.set_epoch(1)
        iterator = iter(s)
        heads.append([next(iterator) for _ in range(k)])
        before.append(s)
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)
    buffer = io.BytesIO()
    torch.save(states[0], buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    after = [BalancedBatchSampler(lengths, new_budgets, num_replicas=new, rank=r, **kwargs) for r in range(new)]
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(1)
    rests = [list(s) for s in after]
    assert len({len(r) for r in rests}) == 1 and len({len(s) for s in after}) == 1
    if new == old:
        assert [h + r for h, r in zip(heads, rests)] == full
    else:
        _check_budgets(rests, new_budgets, after[0].lengths, 1, packing)
        trained = collections.Counter(_real(h for head in heads for h in head) + _real(b for r in rests for b in r))
        assert trained == collections.Counter(_real(b for f in full for b in f))
        assert set(trained.values()) == {1} and set(trained) == set(range(lengths.shape[0]))
    # the resumed sampler's own state (before it runs) names each segment's budgets and resumes the same rest
    again = BalancedBatchSampler(lengths, new_budgets, num_replicas=new, rank=0, **kwargs)
    again.load_state_dict(state)
    resaved = again.state_dict()
    if new != old and old_budgets != new_budgets:
        assert resaved["segment_max_tokens"] == [old_budgets, new_budgets]
    else:
        assert "segment_max_tokens" not in resaved
    for r in range(new):
        s = BalancedBatchSampler(lengths, new_budgets, num_replicas=new, rank=r, **kwargs)
        s.load_state_dict(resaved)
        assert list(s) == rests[r]


@pytest.mark.filterwarnings("ignore:BalancedBatchSampler. epoch:RuntimeWarning")  # unequal speeds lengthen epoch 1
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("windowed", [False, True])
def test_equal_budgets_plan_as_one_int(packing, windowed):
    """A list of equal budgets gives exactly the plans of one int (any settings, epochs, speeds)."""
    lengths = np.random.default_rng(4).integers(1, 300, 700)
    extra = {"plan_window": 200} if windowed else {}
    for num_replicas, speeds in ((1, None), (3, None), (4, [1.0, 0.5, 0.8, 1.0])):
        for kwargs in ({}, {"accumulate_grad_batches": 2, "largest_first": True, "pad_to_multiple_of": 8}):
            one = [BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=r, packing=packing,
                                        rank_speeds=speeds, **kwargs, **extra) for r in range(num_replicas)]
            many = [BalancedBatchSampler(lengths, [512] * num_replicas, num_replicas=num_replicas, rank=r,
                                         packing=packing, rank_speeds=speeds, **kwargs, **extra)
                    for r in range(num_replicas)]
            for epoch in (0, 1):
                for a, b in zip(one, many):
                    a.set_epoch(epoch)
                    b.set_epoch(epoch)
                    assert list(a) == list(b)
                    assert [x.is_fill for x in a] == [x.is_fill for x in b]


@pytest.mark.parametrize("packing", [False, True])
def test_samples_only_a_large_budget_holds_go_to_large_ranks(packing):
    """A sample longer than the small ranks' budget but within the large ranks' is planned on a large rank."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1, 60, 400), rng.integers(101, 200, 40)])
    budgets = [64, 200, 100, 64]
    settings_ = BatchingSettings(max_tokens=budgets, packing=packing, accumulate_grad_batches=2)
    plan = plan_epoch(lengths, settings_, num_replicas=4, epoch=0)
    for rank, budget in enumerate(budgets):
        for b in plan.assignment[:, rank]:
            rows = plan.batch(int(b))[0]
            slots = int(lengths[rows].sum()) if packing else len(rows) * int(lengths[rows].max())
            assert slots <= budget
            if budget < 101:
                assert int(lengths[rows].max()) < 101  # the long ones are all on rank 1
    real = plan.rows[~plan.is_fill]
    assert sorted(real.tolist()) == list(range(lengths.shape[0]))


def test_membership_follows_speeds_and_budgets():
    from lit_balance.plan.budgets import budget_classes, class_members

    padded = np.array([90, 80, 50, 40, 30, 30, 20, 20, 10, 10])
    members = class_members(padded, np.arange(10), np.array([100, 50]), np.array([0.5, 0.5]))
    assert members[0].tolist()[:2] == [0, 1]  # only the large class holds 90 and 80
    assert set(members[0].tolist()) | set(members[1].tolist()) == set(range(10))
    assert all(padded[i] <= 50 for i in members[1])
    assert [(b, r.tolist()) for b, r in budget_classes((50, 100, 50))] == [(100, [1]), (50, [0, 2])]


def test_useful_fraction_weighs_ranks_by_speed():
    """With rank speeds, U counts each rank's time as cost / speed and the ranks' capacity as their speeds' sum."""
    lengths = np.array([10, 10, 10])
    stats = plan_stats([[[0, 1]], [[2]]], lengths, rank_speeds=[1.0, 0.5])
    # rank 0: 20 slots at speed 1, rank 1: 10 slots at speed 0.5: both take 20; capacity 1.5 x 20
    assert stats.useful_fraction == pytest.approx(30 / (1.5 * 20))
    assert plan_stats([[[0, 1]], [[2]]], lengths).useful_fraction == pytest.approx(30 / 40)


def test_settings_hold_a_tuple_and_round_trip():
    s = BatchingSettings(max_tokens=[512, np.int64(256)], pad_to_multiple_of=8)
    assert s.max_tokens == (512, 256) and s.per_rank and s.largest_max_tokens == 512 and s.truncate_to == 512
    assert s.rank_max_tokens(2) == (512, 256) and BatchingSettings(max_tokens=64).rank_max_tokens(3) == (64,) * 3
    assert s.to_dict()["max_tokens"] == [512, 256] and BatchingSettings.from_dict(s.to_dict()) == s
    assert BatchingSettings(max_tokens=np.array([8, 4])).max_tokens == (8, 4)
    assert planner_for(s).name == "padded" and planner_for(s.replace(packing=True)).name == "packed"


@pytest.mark.parametrize(("max_tokens", "error", "pattern"), [
    ([], ValueError, r"max_tokens must be an int or a non-empty list of ints .*got \[\]"),
    ([512, 0], ValueError, r"max_tokens\[1\] must be in \[1, 1099511627776\], got 0"),
    ([512, 1.5], TypeError, r"max_tokens\[1\] must be an int >= 1, got 1.5 of type float"),
    ([512, True], TypeError, r"max_tokens\[1\] must be an int >= 1, got True of type bool"),
    ("512", TypeError, r"max_tokens must be an int >= 1, got '512' of type str"),
])
def test_bad_per_rank_budgets_raise_naming_max_tokens(max_tokens, error, pattern):
    with pytest.raises(error, match=pattern):
        BatchingSettings(max_tokens=max_tokens)


def test_pad_to_multiple_of_above_the_smallest_budget_is_refused():
    with pytest.raises(ValueError, match=r"pad_to_multiple_of \(64\) exceeds max_tokens \(32 on some rank\)"):
        BatchingSettings(max_tokens=[128, 32], pad_to_multiple_of=64)


def test_a_list_of_another_length_than_the_world_is_refused():
    pattern = (r"max_tokens holds 2 per-rank budgets \[512, 256\], but the data-parallel world has num_replicas=3 "
               r"ranks; pass one budget per rank \(a list of 3 ints\)")
    with pytest.raises(ValueError, match=pattern):
        BalancedBatchSampler([5, 6, 7], [512, 256], num_replicas=3, rank=0)
    with pytest.raises(ValueError, match=pattern):
        plan_epoch([5, 6, 7], BatchingSettings(max_tokens=[512, 256]), num_replicas=3, epoch=0)


def test_a_budget_below_every_sample_is_refused():
    with pytest.raises(ValueError, match=r"max_tokens=\[512, 20\]: rank\(s\) \[1\] have a budget below every sample "
                                         r"\(the shortest, index 0, is 50 tokens"):
        BalancedBatchSampler([50, 60], [512, 20], num_replicas=2, rank=0)


def test_too_long_applies_to_the_largest_budget():
    lengths = [10, 300, 600]
    s = BalancedBatchSampler(lengths, [512, 128], num_replicas=2, rank=0, too_long="truncate")
    assert s.lengths.tolist() == [10, 300, 512] and s.truncate_to == 512
    assert BalancedBatchSampler(lengths, [512, 128], num_replicas=2, rank=0, too_long="skip").num_skipped == 1
    with pytest.raises(ValueError, match=r"1 sample\(s\) exceed max_tokens=512 padded token slots"):
        BalancedBatchSampler(lengths, [512, 128], num_replicas=2, rank=0)


def _state_after(lengths, max_tokens, num_replicas, k, **kwargs):
    s = BalancedBatchSampler(lengths, max_tokens, num_replicas=num_replicas, rank=0, **kwargs)
    iterator = iter(s)
    for _ in range(k):
        next(iterator)
    return s.state_dict()


def test_resume_rules_for_max_tokens():
    lengths = np.random.default_rng(1).integers(1, 400, 300)
    state = _state_after(lengths, [512, 256], 2, 3)
    # the same world size: the same budgets
    with pytest.raises(ValueError, match=r"max_tokens: saved \[512, 256\], now \[512, 128\].*max_tokens may change "
                                         r"only with the number of ranks"):
        BalancedBatchSampler(lengths, [512, 128], num_replicas=2, rank=0).load_state_dict(state)
    # another world size: a list of the new length (a wrong length is refused when the sampler is built)
    s = BalancedBatchSampler(lengths, [256, 512, 300], num_replicas=3, rank=0)
    s.load_state_dict(state)
    assert s.state_dict()["segment_max_tokens"] == [[512, 256], [256, 512, 300]]
    # the largest budget may not change which samples too_long cuts or leaves out
    skip = _state_after(lengths, [512, 256], 2, 3, too_long="skip")
    with pytest.raises(ValueError, match=r"largest budget was max_tokens=512, this one's is 300, and "
                                         r"too_long='skip' treats \d+ sample\(s\) between them differently"):
        BalancedBatchSampler(lengths, [300, 256, 300], num_replicas=3, rank=0, too_long="skip").load_state_dict(skip)
