"""Exact resume of BalancedBatchSampler: state_dict / load_state_dict, in one process (ranks simulated)."""

import collections
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, CostModel

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=150)


def _samplers(lengths, num_replicas, **kwargs):
    return [BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=r, **kwargs) for r in range(num_replicas)]


def _roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a Lightning checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@settings(deadline=None, max_examples=60)
@given(
    lengths=lengths_st,
    num_replicas=st.integers(1, 16),
    epoch=st.integers(0, 3),
    accumulate=st.integers(1, 3),
    shuffle=st.booleans(),
    cut=st.floats(0, 1),
)
def test_resume_yields_exactly_the_rest_then_full_epochs(lengths, num_replicas, epoch, accumulate, shuffle, cut):
    kwargs = {"shuffle": shuffle, "seed": 7, "accumulate_grad_batches": accumulate, "largest_first": True}
    for rank in range(num_replicas):
        reference = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=rank, **kwargs)
        reference.set_epoch(epoch)
        full = list(reference)
        k = int(cut * len(full))
        run = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=rank, **kwargs)
        run.set_epoch(epoch)
        iterator = iter(run)
        head = [next(iterator) for _ in range(k)]
        state = _roundtrip(run.state_dict())
        fresh = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=rank, **kwargs)
        fresh.load_state_dict(state)
        if k == len(full):  # a finished epoch is saved as the start of the next one
            assert fresh.epoch == epoch + 1
            continue
        assert fresh.epoch == epoch and len(fresh) == len(full)
        fresh.set_epoch(epoch)  # what Lightning does at the epoch start: changes nothing
        rest = list(fresh)
        assert head + rest == full
        assert [b.is_fill for b in rest] == [b.is_fill for b in full[k:]]
        fresh.set_epoch(epoch + 1)
        reference.set_epoch(epoch + 1)
        assert list(fresh) == list(reference)


@settings(deadline=None, max_examples=60)
@given(lengths=lengths_st, old=st.integers(1, 8), new=st.integers(1, 8), cut=st.floats(0, 1), epoch=st.integers(0, 2))
def test_world_size_change_replans_the_rest_with_nothing_lost(lengths, old, new, cut, epoch):
    before = _samplers(lengths, old, seed=3)
    for s in before:
        s.set_epoch(epoch)
    k = int(cut * len(before[0]))
    seen = collections.Counter()
    for s in before:
        iterator = iter(s)
        for _ in range(k):
            batch = next(iterator)
            seen.update(i for i, f in zip(batch, batch.is_fill) if not f)
    state = _roundtrip(before[0].state_dict())
    if k == len(before[0]):
        return  # the next epoch starts fresh on the new ranks
    after = _samplers(lengths, new, seed=3)
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(epoch)
    assert len({len(s) for s in after}) == 1  # equal counts on the new ranks
    if new != old:  # the rest is re-planned; Lightning counts from the epoch start
        assert len(after[0]) == k + after[0].plan().num_micro_steps
        full_epoch = BalancedBatchSampler(lengths, 512, num_replicas=new, rank=0, seed=3)
        full_epoch.set_epoch(epoch + 1)
        remaining = len(lengths) - len(seen)
        # as long as a whole epoch on the new ranks, where the samples left allow (no fill rows for that)
        assert len(after[0]) >= len(full_epoch) or remaining < new * (len(full_epoch) - k)
    else:
        assert len(after[0]) == len(before[0])
    for s in after:
        for batch in s:
            assert len(batch) * max(lengths[i] for i in batch) <= 512
            seen.update(i for i, f in zip(batch, batch.is_fill) if not f)
    assert sorted(seen) == list(range(len(lengths)))  # every sample ...
    assert set(seen.values()) == {1}  # ... exactly once (fill rows aside)
    # a state saved again mid-way through the re-planned rest continues it exactly
    mid = BalancedBatchSampler(lengths, 512, num_replicas=new, rank=0, seed=3)
    mid.load_state_dict(state)
    rest = list(mid)
    if len(rest) > 1:  # (after the last one the state is the next epoch's start)
        mid.load_state_dict(state)  # (a restored position applies to one pass)
        iterator = iter(mid)
        next(iterator)
        again = BalancedBatchSampler(lengths, 512, num_replicas=new, rank=0, seed=3)
        again.load_state_dict(_roundtrip(mid.state_dict()))
        assert list(again) == rest[1:]


def test_full_scan_then_restart_does_not_shift_resume():
    lengths = np.random.default_rng(0).integers(1, 200, 400)
    probe = BalancedBatchSampler(lengths, 512, num_replicas=2, rank=1)
    full = list(probe)  # an out-of-memory probe scans the epoch ...
    iterator = iter(probe)  # ... then the epoch restarts
    head = [next(iterator) for _ in range(3)]
    state = probe.state_dict()
    assert state["segments"] == [[2, 3]]
    fresh = BalancedBatchSampler(lengths, 512, num_replicas=2, rank=1)
    fresh.load_state_dict(state)
    assert head + list(fresh) == full  # the pass after loading starts after the 3 consumed ...
    assert list(fresh) == full  # ... and a restored position applies to that one pass


def test_batches_consumed_overrides_the_prefetching_cursor():
    lengths = np.random.default_rng(1).integers(1, 200, 400)
    sampler = BalancedBatchSampler(lengths, 512, num_replicas=2, rank=0)
    iterator = iter(sampler)
    for _ in range(6):  # a DataLoader worker ran ahead to 6; training consumed 4
        next(iterator)
    assert sampler.state_dict()["segments"] == [[2, 6]]
    assert sampler.state_dict(batches_consumed=4)["segments"] == [[2, 4]]
    with pytest.raises(ValueError, match=r"batches_consumed must be in \[0, "):
        sampler.state_dict(batches_consumed=len(sampler) + 1)


def test_cost_model_handover_applies_next_epoch_and_survives_resume():
    lengths = np.random.default_rng(2).integers(1, 300, 500)
    a = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0)
    epoch0 = list(a)
    fitted = CostModel(linear=2e-6, quadratic=1e-8, per_batch=1e-3)
    a.set_cost_model(fitted, rank_speeds=[1.0, 0.5])
    assert list(a) == epoch0  # the current epoch's plan never changes
    state = _roundtrip(a.state_dict())
    b = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0)
    b.load_state_dict(state)
    for s in (a, b):
        s.set_epoch(1)
        assert s.cost_model == fitted and s.rank_speeds.tolist() == [1.0, 0.5]
    assert list(a) == list(b)


def test_rank_speeds_give_the_slower_rank_less_cost():
    lengths = np.random.default_rng(3).integers(20, 300, 3000)
    from lit_balance.plan.stats import plan_stats

    even = BalancedBatchSampler(lengths, 4096, num_replicas=2, rank=0).plan()
    skewed = BalancedBatchSampler(lengths, 4096, num_replicas=2, rank=0, rank_speeds=[1.0, 1 / 1.5]).plan()
    cost_even = plan_stats(even, lengths).rank_cost.sum(axis=0)
    cost_skewed = plan_stats(skewed, lengths).rank_cost.sum(axis=0)
    assert abs(cost_even[0] / cost_even[1] - 1) < 0.02
    assert abs(cost_skewed[0] / cost_skewed[1] - 1.5) < 0.1  # time per rank about equal


@pytest.mark.parametrize("slow", [1e-3, 3e-4, 1e-6])
def test_a_rank_far_slower_than_any_share_of_whole_rows_still_gets_the_least(slow):
    # Below some speed no count of micro-batches gives the slow rank a share of whole rows; its share is raised
    # until one does, instead of falling back to equal shares.
    from lit_balance.plan.stats import plan_stats

    lengths = np.load(Path(__file__).parents[2] / "lit_balance" / "data" / "lengths" / "lengths_fortunes.npy")[:3000]
    plan = BalancedBatchSampler(lengths, 4096, num_replicas=8, rank=0, rank_speeds=[1.0] * 7 + [slow]).plan()
    cost = plan_stats(plan, lengths).rank_cost.sum(axis=0)
    assert cost[7] < 0.05 * cost[:7].mean()
    rows = np.concatenate([plan.batch(int(b))[0][~plan.batch(int(b))[1]] for b in plan.assignment.reshape(-1)])
    assert np.array_equal(np.sort(rows), np.arange(lengths.size))  # nothing lost or repeated


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda s: s.pop("epoch"), r"missing \['epoch'\]"),
        (lambda s: s.update(extra=1), r"unknown \['extra'\]"),
        (lambda s: s.update(version=99), "version 99 is not supported"),
        (lambda s: s["settings"].update(max_tokens=1000), "max_tokens: saved 1000, now 512"),
        (lambda s: s["settings"].update(seed=5), "seed: saved 5, now 0"),
        (lambda s: s.update(lengths_sha256="0" * 64), "other lengths"),
        (lambda s: s.update(segments=[[2, 10**6]]), "consumed 1000000 micro-steps"),
        (lambda s: s.update(segments=[[2, 1.7]]), r"segments must be a list of \[num_replicas, consumed\] int pairs"),
        (lambda s: s.update(segments=[[2, True]]), r"int pairs, got \[\[2, True\]\]"),
        (lambda s: s.update(segments=[[2]]), "int pairs"),
        (lambda s: s.update(pending={"foo": 1}), r"pending must be None or a dict with keys cost_model, rank_speeds"),
        (lambda s: s.update(pending={"cost_model": CostModel().to_dict(), "rank_speeds": [1.0]}),
         "rank_speeds must hold 2 finite numbers"),
    ],
)
def test_load_state_dict_rejects_mismatches(change, pattern):
    lengths = np.arange(1, 101)
    state = BalancedBatchSampler(lengths, 512, num_replicas=2, rank=0).state_dict()
    change(state)
    with pytest.raises(ValueError, match=pattern):
        BalancedBatchSampler(lengths, 512, num_replicas=2, rank=0).load_state_dict(state)


def test_load_state_dict_on_other_ranks_rejects_more_consumed_than_the_saved_plan_had():
    lengths = np.arange(1, 60)
    saved = BalancedBatchSampler(lengths, 100, num_replicas=1, rank=0)
    state = saved.state_dict()
    steps = saved.plan().num_micro_steps
    state["segments"] = [[1, steps + 5]]
    resumed = BalancedBatchSampler(lengths, 100, num_replicas=2, rank=0)
    before = resumed.state_dict()
    with pytest.raises(ValueError, match=f"consumed {steps + 5} micro-steps of epoch 0 on 1 rank.*only {steps}"):
        resumed.load_state_dict(state)
    assert resumed.state_dict() == before  # all or nothing
    state["segments"] = [[1, steps]]  # the whole epoch consumed on the old rank: the new ranks have nothing left
    resumed.load_state_dict(state)
    assert list(resumed) == []


def test_a_fresh_iterator_after_a_full_pass_saves_the_start_of_its_epoch():
    s = BalancedBatchSampler(np.arange(1, 60), 100, num_replicas=2, rank=0)
    first = list(s)
    assert s.state_dict()["epoch"] == 1  # a finished epoch resumes at the next one
    again = iter(s)  # the same epoch again, not yet advanced
    state = s.state_dict()
    assert (state["epoch"], state["segments"]) == (0, [[2, 0]])
    assert list(again) == first
    it = iter(s)  # Lightning makes the epoch's iterator before it calls set_epoch
    s.set_epoch(1)
    expected = BalancedBatchSampler(np.arange(1, 60), 100, num_replicas=2, rank=0)
    expected.set_epoch(1)
    assert list(it) == list(expected) != first


def test_state_is_the_same_on_every_rank():
    lengths = np.random.default_rng(4).integers(1, 300, 300)
    samplers = _samplers(lengths, 4)
    states = []
    for s in samplers:
        iterator = iter(s)
        next(iterator)
        states.append(s.state_dict())
    assert all(state == states[0] for state in states)


@settings(deadline=None, max_examples=60)
@given(lengths=lengths_st, num_replicas=st.integers(1, 16), window=st.sampled_from([0.0, 0.25, 1.0, 4.0]),
       accumulate=st.integers(1, 3))
def test_epoch_length_is_the_same_every_epoch_and_after_a_new_cost_model(lengths, num_replicas, window, accumulate):
    # Lightning fixes the number of training batches at the first epoch (unless it reloads the dataloaders): with
    # equal ranks it must never change. Unequal rank speeds may need a longer epoch (documented).
    sampler = BalancedBatchSampler(lengths, 512, num_replicas=num_replicas, rank=0, shuffle_window=window,
                                   accumulate_grad_batches=accumulate)
    first = len(sampler)
    for epoch in range(1, 4):
        if epoch == 2:
            sampler.set_cost_model(CostModel(1e-6, 1e-8, 1e-3))
        sampler.set_epoch(epoch)
        assert len(sampler) == first


@settings(deadline=None, max_examples=80)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=120),
       worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4), cuts=st.lists(st.floats(0, 1), min_size=4, max_size=4),
       speeds=st.booleans())
def test_several_world_size_changes_in_one_epoch_lose_and_repeat_nothing(lengths, worlds, cuts, speeds):
    seen = collections.Counter()
    state = None
    for stage, world in enumerate(worlds):
        extra = {"rank_speeds": [1.0 / (1 + r) for r in range(world)]} if speeds and stage == 0 else {}
        samplers = _samplers(lengths, world, seed=5, **extra)
        if state is not None:
            for s in samplers:
                s.load_state_dict(_roundtrip(state))
        earlier = samplers[0].first_micro_step
        # consumed of this world size's plan: the saved count when the world size is the saved one, else 0
        start = state["segments"][-1][1] if state is not None and state["segments"][-1][0] == world else 0
        available = len(samplers[0]) - earlier - start
        take = available if stage == len(worlds) - 1 else int(cuts[stage] * available)
        for s in samplers:
            iterator = iter(s)
            for _ in range(take):
                batch = next(iterator)
                seen.update(i for i, f in zip(batch, batch.is_fill) if not f)
        if stage < len(worlds) - 1:
            state = samplers[0].state_dict(batches_consumed=earlier + start + take)
            if state["epoch"] == 1:  # the epoch ended early in the chain
                break
    assert sorted(seen) == list(range(len(lengths)))  # every sample once over all stages
    assert set(seen.values()) == {1}


def _totals(batches, lengths):
    """Real tokens and rows (fill rows excluded) of a list of micro-batches."""
    real = [i for b in batches for i, f in zip(b, b.is_fill) if not f]
    return int(np.asarray(lengths, dtype=np.int64)[real].sum()) if real else 0, len(real)


@settings(deadline=None, max_examples=80)
@given(lengths=lengths_st, old=st.integers(1, 8), new=st.integers(1, 8), accumulate=st.integers(1, 4),
       cut=st.floats(0, 1), epoch=st.integers(0, 2), shuffle=st.booleans())
def test_world_size_change_keeps_every_lightning_window_and_its_step_totals(lengths, old, new, accumulate, cut,
                                                                            epoch, shuffle):
    kwargs = {"seed": 3, "accumulate_grad_batches": accumulate, "shuffle": shuffle}
    before = _samplers(lengths, old, **kwargs)
    for s in before:
        s.set_epoch(epoch)
    k = int(cut * len(before[0]))
    iterators = [iter(s) for s in before]
    steps = [[next(it) for it in iterators] for _ in range(k)]  # epoch micro-step t -> every rank's micro-batch
    state = _roundtrip(before[0].state_dict())
    if k == len(before[0]):
        return
    after = _samplers(lengths, new, **kwargs)
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(epoch)
    assert len({len(s) for s in after}) == 1
    rest = [list(s) for s in after]
    assert {len(r) for r in rest} == {len(after[0]) - k}
    steps += [list(column) for column in zip(*rest)]
    num_steps = len(after[0])
    assert len(steps) == num_steps
    # every remaining sample trained exactly once, none of those trained before again
    planned = after[0].lengths
    seen = collections.Counter(i for step in steps for b in step for i, f in zip(b, b.is_fill) if not f)
    assert seen == collections.Counter(range(len(planned)))
    # Lightning's windows, counted from the epoch start (the last one may be short): every micro-batch of a window
    # carries the window's true totals over all ranks and micro-batches, before and after the cut. Micro-batches
    # yielded before the cut were planned without knowing of it: they are checked for windows that end before it.
    for lo in range(0, num_steps, accumulate):
        hi = min(lo + accumulate, num_steps)
        tokens, rows = _totals([b for step in steps[lo:hi] for b in step], planned)
        for t in range(max(lo, k) if hi > k else lo, hi):
            for b in steps[t]:
                assert (b.step_real_tokens, b.step_rows) == (tokens, rows), (lo, hi, k, t)


@settings(deadline=None, max_examples=60)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=120),
       worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
       cuts=st.lists(st.floats(0, 1), min_size=4, max_size=4), accumulate=st.integers(1, 4))
def test_several_world_size_changes_keep_the_step_totals_of_every_lightning_window(lengths, worlds, cuts, accumulate):
    steps, ends, state = [], [], None  # steps[t]: every rank's micro-batch at epoch micro-step t; ends: per stage
    for stage, world in enumerate(worlds):
        samplers = _samplers(lengths, world, seed=5, accumulate_grad_batches=accumulate)
        if state is not None:
            for s in samplers:
                s.load_state_dict(_roundtrip(state))
        done = len(steps)
        available = len(samplers[0]) - done
        take = available if stage == len(worlds) - 1 else int(cuts[stage] * available)
        iterators = [iter(s) for s in samplers]
        steps += [[next(it) for it in iterators] for _ in range(take)]
        ends.append(len(steps))
        if stage < len(worlds) - 1:
            state = samplers[0].state_dict(batches_consumed=len(steps))
            if state["epoch"] == 1:  # the epoch ended early in the chain
                ends[-1] = len(steps) + 1  # nothing after it: every window it yielded is whole
                break
    planned = samplers[0].lengths
    stage_of = [next(i for i, end in enumerate(ends) if t < end) for t in range(len(steps))]
    for lo in range(0, len(steps), accumulate):
        hi = min(lo + accumulate, len(steps))
        tokens, rows = _totals([b for step in steps[lo:hi] for b in step], planned)
        for t in range(lo, hi):
            if hi <= ends[stage_of[t]] or stage_of[t] == len(ends) - 1:  # the stage knew the whole window
                assert {(b.step_real_tokens, b.step_rows) for b in steps[t]} == {(tokens, rows)}, (lo, hi, t, ends)
