"""Plans in windows (lit_balance.plan.windows): the guarantees of a whole-epoch plan, per window and for the epoch.

Ranks are simulated in one process (one sampler per rank). The resume contract over windowed samplers (fixed cuts,
world-size changes) is in test_resume_contract.py; here random cuts and world sizes.
"""

import collections
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel
from lit_balance.plan import plan_epoch
from lit_balance.plan.settings import DEFAULT_PLAN_WINDOW
from lit_balance.plan.windows import PlanWindows

MAX_TOKENS = 512
_FORTUNES = np.load(Path(__file__).parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")
lengths_st = st.lists(st.integers(1, 300), min_size=2, max_size=200)


def _samplers(lengths, num_replicas, **kwargs):
    return [BalancedBatchSampler(lengths, MAX_TOKENS, num_replicas=num_replicas, rank=r, **kwargs)
            for r in range(num_replicas)]


def _epoch(samplers, epoch):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


def _real(batches):
    return [i for b in batches for i, fill in zip(b, b.is_fill) if not fill]


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)



def _window_totals(sampler, accumulate):
    """Global real tokens and rows of each micro-step's optimizer step, from the sampler's per-micro-step totals."""
    tokens, rows = sampler.micro_step_totals()
    window = np.arange(tokens.size) // accumulate
    return (np.bincount(window, tokens)[window].astype(np.int64), np.bincount(window, rows)[window].astype(np.int64))

@settings(deadline=None, max_examples=100)
@given(num_samples=st.integers(1, 5000), plan_window=st.integers(1, 6000), seed=st.integers(0, 2**32))
def test_windows_partition_the_samples(num_samples, plan_window, seed):
    w = PlanWindows(num_samples, plan_window, seed)
    assert w.num_windows == -(-num_samples // plan_window)
    members = [w.members(j) for j in range(w.num_windows)]
    sizes = [m.size for m in members]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= plan_window
    assert np.array_equal(np.sort(np.concatenate(members)), np.arange(num_samples))
    for j in {0, w.num_windows - 1}:
        for i in members[j][:3]:
            assert w.window_of(int(i)) == j
    assert np.array_equal(PlanWindows(num_samples, plan_window, seed).members(0), members[0])  # no global state


def test_windows_depend_on_the_seed():
    a, b = PlanWindows(1000, 100, 0).members(0), PlanWindows(1000, 100, 1).members(0)
    assert not np.array_equal(np.sort(a), np.sort(b))


@settings(deadline=None, max_examples=60)
@given(lengths=lengths_st, num_replicas=st.integers(1, 5), plan_window=st.integers(1, 80), epoch=st.integers(0, 3),
       accumulate=st.integers(1, 3), shuffle=st.booleans(), drop_last=st.booleans(), largest_first=st.booleans(),
       max_batch_size=st.one_of(st.none(), st.integers(1, 8)))
def test_windowed_epoch_keeps_every_guarantee(lengths, num_replicas, plan_window, epoch, accumulate, shuffle,
                                              drop_last, largest_first, max_batch_size):
    kwargs = {"plan_window": plan_window, "seed": 5, "accumulate_grad_batches": accumulate, "shuffle": shuffle,
              "drop_last": drop_last, "largest_first": largest_first, "max_batch_size": max_batch_size}
    try:
        samplers = _samplers(lengths, num_replicas, **kwargs)
    except ValueError as exc:  # drop_last with fewer samples than ranks: nothing to plan
        assert drop_last and "leaves no micro-batch" in str(exc)
        return
    windowed = len(lengths) > plan_window
    assert (samplers[0].windows is not None) == windowed
    length_before = len(samplers[0])  # what Lightning reads before set_epoch
    out = _epoch(samplers, epoch)
    # equal counts, and the length read before set_epoch is the epoch's (equal speeds)
    assert {len(o) for o in out} == {len(samplers[0])} == {length_before}
    # budget
    lengths_arr = np.asarray(lengths)
    assert all(len(b) * int(lengths_arr[list(b)].max()) <= MAX_TOKENS for o in out for b in o)
    if max_batch_size is not None:
        assert all(len(b) <= max_batch_size for o in out for b in o)
    # coverage: every sample once (fill rows aside), or dropped and counted
    counts = collections.Counter(_real(b for o in out for b in o))
    assert set(counts.values()) <= {1}
    assert len(counts) + samplers[0].num_dropped == len(lengths)
    if not drop_last:
        assert samplers[0].num_dropped == 0
    # determinism: fresh samplers give the same epoch; the iterated epoch is the materialised plan's columns
    assert _epoch(_samplers(lengths, num_replicas, **kwargs), epoch) == out
    plan = samplers[0].plan()
    for r, o in enumerate(out):
        assert [list(plan.batch(int(b))[0]) for b in plan.assignment[:, r]] == [list(b) for b in o]
    # the step totals carried by each micro-batch are those of its optimizer step, over all ranks
    tokens, rows = _window_totals(samplers[0], accumulate)
    assert [b.step_real_tokens for b in out[0]] == tokens.tolist()
    assert [b.step_rows for b in out[0]] == rows.tolist()
    step = np.arange(len(out[0])) // accumulate
    expected = collections.Counter()
    for o in out:
        for t, b in enumerate(o):
            expected[int(step[t])] += sum(int(lengths_arr[i]) for i, f in zip(b, b.is_fill) if not f)
    assert [expected[int(g)] for g in step] == tokens.tolist()
    # the next epoch has the same length
    _epoch(samplers, epoch + 1)
    assert len(samplers[0]) == length_before
    if largest_first and any(o for o in out):  # the longest sample planned (drop_last may drop the longest)
        longest = max(int(lengths_arr[i]) for i in counts)
        assert longest in {int(lengths_arr[i]) for o in out for b in o[:accumulate] for i in b}


@settings(deadline=None, max_examples=40)
@given(lengths=lengths_st, old=st.integers(1, 4), new=st.integers(1, 4), plan_window=st.integers(3, 60),
       epoch=st.integers(0, 2), accumulate=st.integers(1, 3), shuffle=st.booleans(), cut=st.floats(0, 1))
def test_windowed_resume_at_random_cuts(lengths, old, new, plan_window, epoch, accumulate, shuffle, cut):
    kwargs = {"plan_window": plan_window, "seed": 9, "accumulate_grad_batches": accumulate, "shuffle": shuffle}
    full = _epoch(_samplers(lengths, old, **kwargs), epoch)
    k = int(cut * len(full[0]))
    before = _samplers(lengths, old, **kwargs)
    heads = []
    for s in before:
        s.set_epoch(epoch)
        iterator = iter(s)
        heads.append([next(iterator) for _ in range(k)])
    state = _roundtrip(before[0].state_dict())
    after = _samplers(lengths, new, **kwargs)
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])
    rests = [list(s) for s in after]
    if k == len(full[0]):  # a finished epoch is saved as the start of the next one
        assert state["epoch"] == epoch + 1
        return
    assert len({len(r) for r in rests}) == 1 and len(after[0]) == k + len(rests[0])
    if new == old:
        assert [h + r for h, r in zip(heads, rests)] == full
    else:
        lengths_arr = np.asarray(lengths)
        assert all(len(b) * int(lengths_arr[list(b)].max()) <= MAX_TOKENS for r in rests for b in r)
        trained = collections.Counter(_real(b for h in heads for b in h) + _real(b for r in rests for b in r))
        assert trained == collections.Counter(_real(b for f in full for b in f))
        # the resumed epoch is never shorter than a whole epoch on the new ranks, where the samples left allow
        if new == 1:
            left = len(lengths) - len(_real(b for h in heads for b in h))
            assert len(after[0]) >= min(len(_samplers(lengths, new, **kwargs)[0]), k + left)


def test_windowed_rank_speeds_plan_by_speed_and_keep_counts_equal():
    lengths = np.minimum(_FORTUNES[:600], MAX_TOKENS)
    speeds = [1.0, 0.5]
    samplers = _samplers(lengths, 2, plan_window=150, rank_speeds=speeds, seed=2)
    out = _epoch(samplers, 1)
    assert len(out[0]) == len(out[1]) == len(samplers[0])
    assert sorted(_real(b for o in out for b in o)) == list(range(len(lengths)))
    tokens = [sum(int(lengths[i]) for b in o for i in b) for o in out]
    assert tokens[0] > 1.5 * tokens[1]  # the fast rank gets about twice the tokens


def test_windowed_plan_ignores_the_cost_model_for_its_length():
    lengths = np.minimum(_FORTUNES[:800], MAX_TOKENS)
    plain = _samplers(lengths, 2, plan_window=200)
    costly = _samplers(lengths, 2, plan_window=200, cost_model=CostModel(quadratic=1e-3, per_batch=50.0))
    assert len(plain[0]) == len(costly[0])
    assert sorted(_real(b for o in _epoch(costly, 0) for b in o)) == list(range(len(lengths)))


def test_memory_map_lengths_are_not_copied(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.minimum(_FORTUNES[:3000], MAX_TOKENS).astype(np.int32))
    mapped = np.load(path, mmap_mode="r")
    sampler = BalancedBatchSampler(mapped, MAX_TOKENS, num_replicas=2, rank=1, plan_window=1000)
    assert np.shares_memory(sampler.lengths, mapped) and sampler.lengths.dtype == np.int32
    in_memory = BalancedBatchSampler(np.asarray(mapped, dtype=np.int64), MAX_TOKENS, num_replicas=2, rank=1,
                                     plan_window=1000)
    assert list(sampler) == list(in_memory)
    assert sampler.state_dict() == in_memory.state_dict()  # the lengths' fingerprint is the int64 one


@pytest.mark.parametrize("num_samples", [1_000_000, DEFAULT_PLAN_WINDOW])
def test_default_settings_plan_a_million_samples_whole_as_before(num_samples):
    """Up to plan_window (2**20) samples the default plan is plan_epoch's over the whole epoch, bit for bit."""
    lengths = np.random.default_rng(0).choice(_FORTUNES, num_samples).astype(np.int32)
    settings = BatchingSettings(max_tokens=4096)
    sampler = BalancedBatchSampler(lengths, settings=settings, num_replicas=4, rank=0)
    assert sampler.windows is None and sampler.lengths.dtype == np.int64
    got, whole = sampler.plan(1), plan_epoch(lengths.astype(np.int64), settings, num_replicas=4, epoch=1)
    for name in ("rows", "is_fill", "batch_offsets", "assignment", "dropped"):
        assert np.array_equal(getattr(got, name), getattr(whole, name)), name


def test_one_more_sample_than_plan_window_plans_in_two_windows():
    lengths = np.minimum(_FORTUNES[:101], MAX_TOKENS)
    assert _samplers(lengths[:100], 1, plan_window=100)[0].windows is None
    sampler = _samplers(lengths, 1, plan_window=100)[0]
    assert sampler.windows.num_windows == 2
    assert sorted(_real(list(sampler))) == list(range(101))


def test_a_state_saved_before_plan_window_loads_where_the_epoch_is_planned_whole():
    lengths = np.minimum(_FORTUNES[:300], MAX_TOKENS)
    run = _samplers(lengths, 2, seed=1)
    for s in run:
        s.set_epoch(1)
    iterator = iter(run[0])
    head = [next(iterator) for _ in range(3)]
    state = run[0].state_dict()
    del state["settings"]["plan_window"]  # as written before the setting existed
    fresh = _samplers(lengths, 2, seed=1)[0]
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    assert head + list(fresh) == _epoch(_samplers(lengths, 2, seed=1), 1)[0]
    windowed = _samplers(lengths, 2, seed=1, plan_window=100)[0]
    with pytest.raises(ValueError, match="settings must have keys"):
        windowed.load_state_dict(state)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_counting_a_window_by_planning_it_agrees_with_the_padded_count(monkeypatch, accumulate):
    """The path another planner (packed rows) takes: each window's count from planning it at epoch 0."""
    from functools import partial

    from lit_balance.plan.assign import steps_by_planning
    from lit_balance.plan.padded import PaddedPlanner, plan_padded

    lengths = np.minimum(_FORTUNES[:900], MAX_TOKENS)
    kwargs = {"plan_window": 200, "accumulate_grad_batches": accumulate, "seed": 4}
    counted = _samplers(lengths, 3, **kwargs)
    monkeypatch.setattr(PaddedPlanner, "count_steps", staticmethod(partial(steps_by_planning, plan_padded)))
    planned = _samplers(lengths, 3, **kwargs)
    assert len(planned[0]) == len(counted[0])
    assert _epoch(planned, 2) == _epoch(counted, 2)


@settings(deadline=None, max_examples=40)
@given(lengths=lengths_st, num_replicas=st.integers(1, 5), epoch=st.integers(0, 3), shuffle=st.booleans(),
       drop_last=st.booleans(), accumulate=st.integers(1, 3))
def test_plan_epoch_with_the_count_passed_in_is_the_same_plan(lengths, num_replicas, epoch, shuffle, drop_last,
                                                               accumulate):
    from lit_balance.plan import padded_lengths
    from lit_balance.plan.padded import _num_batches

    settings_ = BatchingSettings(max_tokens=MAX_TOKENS, shuffle=shuffle, drop_last=drop_last,
                                 accumulate_grad_batches=accumulate)
    arr = np.asarray(lengths, dtype=np.int64)
    count = _num_batches(padded_lengths(arr, 1), np.arange(arr.size), settings_, num_replicas, MAX_TOKENS)
    a = plan_epoch(arr, settings_, num_replicas=num_replicas, epoch=epoch)
    b = plan_epoch(arr, settings_, num_replicas=num_replicas, epoch=epoch, num_batches=count)
    for name in ("rows", "is_fill", "batch_offsets", "assignment", "dropped"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match="num_batches must be >= 0, got -1"):
        plan_epoch(arr, settings_, num_replicas=num_replicas, epoch=epoch, num_batches=-1)


@pytest.mark.parametrize("num_samples, plan_window, seed, digest, windows_of", [
    (10, 4, 0, "99d1c22fa287405b5558a629324d8c8aec1b130c9d6fc07dd17146883ba5012b", [0, 1, 2]),
    (12345, 1000, 7, "87cf34453195da6df3e12af7bafbd8153934b6c89d5e6be4bff43264346ab8b3", [8, 0, 0]),
    (3_000_000, 1_048_576, 3, "263eb0d2943c7c115530c6405b4fbeada2bbdfd40a48158e2c85692a38401c71", [1, 0, 1]),
])
def test_window_membership_is_the_recorded_permutation(num_samples, plan_window, seed, digest, windows_of):
    """The windows' members (sha256 of every window's int64 members in order, recorded from the first version of
    the permutation) never change: a saved resume state and every windowed plan depend on them."""
    import hashlib

    w = PlanWindows(num_samples, plan_window, seed)
    h = hashlib.sha256()
    for j in range(w.num_windows):
        h.update(w.members(j).astype("<i8").tobytes())
    assert h.hexdigest() == digest
    assert [w.window_of(i) for i in (0, num_samples // 3, num_samples - 1)] == windows_of


@settings(deadline=None, max_examples=40)
@given(lengths=st.lists(st.integers(1, 700), min_size=20, max_size=300), num_replicas=st.integers(1, 4),
       plan_window=st.integers(5, 60), epoch=st.integers(0, 2), accumulate=st.integers(1, 3), packing=st.booleans(),
       drop_last=st.booleans(), shuffle=st.booleans())
def test_the_first_micro_batch_counts_the_windows_it_needs_only(lengths, num_replicas, plan_window, epoch, accumulate,
                                                               packing, drop_last, shuffle):
    """Windows are counted when first needed: building the sampler and its first micro-batch draw the members of the
    first windows of the epoch's order only (the first with a micro-step, and those the optimizer step holding its
    last micro-step reaches, for the step sums), len() read afterwards counts the rest, and the epoch is the one a
    sampler whose len() was read first yields (equal counts on every rank)."""
    assume(len(lengths) > plan_window)
    kwargs = {"plan_window": plan_window, "seed": 3, "accumulate_grad_batches": accumulate, "packing": packing,
              "drop_last": drop_last, "shuffle": shuffle, "too_long": "skip"}  # lengths above 512 are skipped
    drawn = []
    members = PlanWindows.members
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PlanWindows, "members", lambda self, j: drawn.append(int(j)) or members(self, j))
        try:
            lazy = _samplers(lengths, num_replicas, **kwargs)
        except ValueError as exc:  # every sample skipped, or drop_last leaves nothing
            assert "leaves no micro-batch" in str(exc) or "too_long='skip' leaves none" in str(exc)
            return
        built = set(drawn)
        drawn.clear()
        for s in lazy:
            s.set_epoch(epoch)
        iterators = [iter(s) for s in lazy]
        firsts = [next(it, None) for it in iterators[:1]]

    reference = _samplers(lengths, num_replicas, **kwargs)[0]

    def prefix(e, whole_steps):  # the windows of epoch e's order up to its first with a micro-step, and with
        # whole_steps, up to the end of the optimizer step holding that window's last micro-step (its step sums)
        starts = np.cumsum([0] + [part.num_micro_steps for part in reference.plan_parts(e)])
        order = reference.windows.order(e, reference.settings).tolist()
        end = int(starts[np.searchsorted(starts, 0, side="right")]) if starts[-1] else 0
        upto = -(-end // accumulate) * accumulate - 1 if whole_steps else 0
        return order, set(order[:max(int(np.searchsorted(starts, upto, side="right")), 1)])

    order, needed = prefix(epoch, True)
    assert set(drawn) <= needed
    assert built <= prefix(0, False)[1]  # building counts windows until one has a micro-step
    if len(needed) < len(order):
        assert len(set(drawn)) < len(order)
    out = [[b for b in firsts if b is not None] + list(iterators[0])] + [list(it) for it in iterators[1:]]
    assert {len(o) for o in out} == {len(lazy[0])} == {len(s) for s in lazy}
    counted = _samplers(lengths, num_replicas, **kwargs)
    assert {len(s) for s in counted} == {len(lazy[0])}  # len() before iterating, as Lightning reads it
    assert _epoch(counted, epoch) == out


def test_drop_last_with_every_window_empty_is_refused_at_construction():
    with pytest.raises(ValueError, match="leaves no micro-batch for any rank; set drop_last=False"):
        BalancedBatchSampler([10] * 9, MAX_TOKENS, num_replicas=4, rank=0, plan_window=3, drop_last=True)
