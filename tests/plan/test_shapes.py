"""Static shapes: static_packing rows and padded_shapes plans keep their declared shapes, the budget, equal counts,
every document once and exact resume; the shape choice is optimal; bad settings name themselves."""

from __future__ import annotations

import functools
import io
import itertools
from importlib.resources import files

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BatchingSettings, plan_epoch
from lit_balance.data.collate import collator_for
from lit_balance.errors import InputValueError
from lit_balance.plan import planner_for
from lit_balance.plan.shapes import (
    ShapedPaddedPlanner,
    StaticPackedPlanner,
    choose_document_cap,
    choose_padded_shapes,
    epoch_shapes,
    length_histogram,
    resolve_static_shapes,
    shape_index,
)


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _collate_all(sampler, lengths, epoch):
    """Every micro-batch of ``sampler``'s epoch, collated with the collator its settings choose."""
    collate = collator_for(sampler.settings, pad_token_id=0)
    sampler.set_epoch(epoch)
    out = []
    for micro in sampler:
        out.append((micro, collate([{"input_ids": np.arange(1, lengths[i] + 1), "index": i,
                                     "is_fill": bool(f)} for i, f in zip(micro, micro.is_fill)])))
    return out


STATIC = {
    "static_packing": lambda lengths, budget: {"packing": True, "static_packing": True},
    "static_packing_cap": lambda lengths, budget: {"packing": True, "static_packing": True, "max_batch_size": 3},
    "padded_shapes_k": lambda lengths, budget: {"padded_shapes": 3},
    "padded_shapes_list": lambda lengths, budget: {"padded_shapes": [(budget // max(lengths), max(lengths)),
                                                                     (max(1, budget // 8), 8)]
                                                   if max(lengths) > 8 else [(budget // 8, 8)]},
}


@settings(deadline=None, max_examples=40)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80), budget=st.integers(60, 200),
       num_replicas=st.integers(1, 4), kind=st.sampled_from(sorted(STATIC)), shuffle=st.booleans(),
       accumulate=st.integers(1, 2), cut=st.floats(0, 1), window=st.sampled_from([1 << 20, 30]))
def test_static_shapes_hold_their_shape_budget_counts_documents_and_resume(lengths, budget, num_replicas, kind,
                                                                           shuffle, accumulate, cut, window):
    kwargs = {"seed": 3, "shuffle": shuffle, "accumulate_grad_batches": accumulate, "plan_window": window,
              **STATIC[kind](lengths, budget)}
    samplers = [BalancedBatchSampler(lengths, budget, num_replicas=num_replicas, rank=r, **kwargs)
                for r in range(num_replicas)]
    resolved = samplers[0].settings
    for epoch in (0, 1):
        per_rank = [_collate_all(s, lengths, epoch) for s in samplers]
        assert len({len(r) for r in per_rank}) == 1  # equal counts on every rank
        seen = []
        for micro, batch in itertools.chain.from_iterable(per_rank):
            seen += [i for i, f in zip(micro, micro.is_fill) if not f]
            assert batch["num_padded_tokens"] <= budget  # 0 over budget
            if resolved.packing:
                assert batch["input_ids"].shape == (1, budget)
                assert batch["cu_seq_lens_q"].shape == (resolved.max_batch_size + 1,)
                assert batch["max_length_q"] == batch["max_length_k"] == budget
                assert int(batch["cu_seq_lens_q"][-1]) == budget
            else:
                assert tuple(batch["input_ids"].shape) in resolved.padded_shapes
        assert sorted(seen) == list(range(len(lengths)))  # every document once (no drop_last, nothing too long)
    # resume exact: stop rank 0 mid-epoch, restore into a fresh sampler, the rest is the uninterrupted epoch's
    reference = BalancedBatchSampler(lengths, budget, num_replicas=num_replicas, rank=0, **kwargs)
    reference.set_epoch(1)
    full = list(reference)
    run = BalancedBatchSampler(lengths, budget, num_replicas=num_replicas, rank=0, **kwargs)
    run.set_epoch(1)
    iterator = iter(run)
    head = [next(iterator) for _ in range(int(cut * len(full)))]
    fresh = BalancedBatchSampler(lengths, budget, num_replicas=num_replicas, rank=0, **kwargs)
    fresh.load_state_dict(_roundtrip(run.state_dict()))
    if len(head) < len(full):
        fresh.set_epoch(1)
        assert head + list(fresh) == full


def test_static_packed_plan_fills_rows_within_the_cap():
    lengths = np.random.default_rng(0).integers(1, 200, 2000)
    static = BatchingSettings(max_tokens=1024, packing=True, static_packing=True, max_batch_size=16)
    free = static.replace(static_packing=False)
    for epoch in (0, 1):
        a = plan_epoch(lengths, static, num_replicas=2, epoch=epoch)
        b = plan_epoch(lengths, free, num_replicas=2, epoch=epoch)
        sizes = np.diff(a.batch_offsets)
        tokens = np.add.reduceat(lengths[a.rows], a.batch_offsets[:-1])
        assert sizes.max() <= 16 and tokens.max() <= 1024
        # no headroom is left in the count: at most as many rows as the free packed plan's, each fuller
        assert a.num_batches <= b.num_batches
        assert lengths.sum() / (a.num_batches * 1024) > 0.985
    assert isinstance(planner_for(static), StaticPackedPlanner) and planner_for(static).name == "packed"


def test_chosen_cap_keeps_the_free_plan_and_bounds_cu_seq_lens():
    lengths = np.random.default_rng(1).integers(1, 100, 3000)
    settings = BatchingSettings(max_tokens=2048, packing=True, static_packing=True)
    resolved = resolve_static_shapes(lengths, settings)
    cap = resolved.max_batch_size
    assert cap == choose_document_cap(length_histogram(lengths), settings) and cap % 8 == 0
    free = plan_epoch(lengths, settings.replace(static_packing=False), num_replicas=4, epoch=0)
    most = int(np.diff(free.batch_offsets).max())
    assert most <= cap < 4 * most  # the cap does not bind the free plan, and is not far above what it needs
    stats = epoch_shapes(plan_epoch(lengths, resolved, num_replicas=4, epoch=0), lengths, resolved)
    assert stats["shapes"] == {f"1x2048 cu{cap + 1}": free.num_batches} and stats["real_token_fraction"] > 0.95


def _brute_force_padding(values, counts, k):
    """Least padding of any choice of at most k lengths among the distinct ones that includes the longest."""
    best = None
    for r in range(1, min(k, len(values)) + 1):
        for chosen in itertools.combinations(values[:-1], r - 1):
            edges = np.array(sorted(chosen) + [values[-1]])
            pad = int(sum(c * (edges[np.searchsorted(edges, v)] - v) for v, c in zip(values, counts)))
            best = pad if best is None else min(best, pad)
    return best


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 5), st.integers(1, 4))
def test_chosen_shapes_pad_the_fewest_slots(lengths, k, multiple):
    budget = 160
    settings = BatchingSettings(max_tokens=budget, pad_to_multiple_of=multiple)
    shapes = choose_padded_shapes(length_histogram(np.array(lengths)), settings, k)
    padded = -(-np.array(lengths) // multiple) * multiple
    values, counts = np.unique(padded, return_counts=True)
    edges = np.array([t for _, t in shapes])
    assert len(shapes) <= k and edges[-1] == values[-1] and all(t % multiple == 0 for t in edges)
    assert all(1 <= r <= budget // t for r, t in shapes)
    planner = ShapedPaddedPlanner(shapes, budget)
    # each sample is planned at its shape's length (the shortest that holds it)
    assert planner.planned_lengths(padded).tolist() == edges[np.searchsorted(edges, padded)].tolist()
    pad = int((edges[np.searchsorted(edges, padded)] - padded).sum())
    assert pad == _brute_force_padding(values, counts, k)


def test_shape_index_picks_the_fewest_slots_that_hold_the_batch():
    shapes = ((8, 16), (4, 32), (2, 64))
    assert shape_index(shapes, np.array([8, 3, 5, 1, 3]), np.array([16, 16, 20, 64, 65])).tolist() == [0, 0, -1, 2, -1]


def test_padded_shapes_with_fewer_rows_than_the_budget_holds():
    lengths = np.random.default_rng(2).integers(1, 64, 400)
    settings = BatchingSettings(max_tokens=512, padded_shapes=[(3, 64), (5, 32), (16, 16)], seed=1)
    planner = planner_for(settings)
    assert isinstance(planner, ShapedPaddedPlanner) and planner.name == "padded"
    plan = plan_epoch(lengths, settings, num_replicas=2, epoch=1)
    index = planner.batch_shapes(lengths, plan.rows, plan.batch_offsets)
    assert (index >= 0).all()
    _, slots = planner.batch_costs(lengths, plan.rows, plan.batch_offsets, 1, __import__("lit_balance").CostModel())
    assert (slots <= 512).all()


def test_defaults_and_to_dict_are_unchanged_while_off():
    s = BatchingSettings(max_tokens=64)
    assert "static_packing" not in s.to_dict() and "padded_shapes" not in s.to_dict()
    on = BatchingSettings(max_tokens=64, padded_shapes=[[2, 32], [8, 8]])
    assert on.to_dict()["padded_shapes"] == [[8, 8], [2, 32]]
    assert BatchingSettings.from_dict(on.to_dict()) == on
    assert resolve_static_shapes(np.array([5, 6]), s) is s


@pytest.mark.parametrize("kwargs, setting", [
    ({"padded_shapes": 0}, "padded_shapes"),
    ({"padded_shapes": -3}, "padded_shapes"),
    ({"padded_shapes": [(3, 32)]}, "padded_shapes"),  # 96 slots over max_tokens=64
    ({"padded_shapes": [(1, 30)], "pad_to_multiple_of": 8}, "padded_shapes"),
    ({"padded_shapes": [(2, 16), (1, 16)]}, "padded_shapes"),
    ({"padded_shapes": 4, "packing": True}, "padded_shapes"),
    ({"static_packing": True}, "static_packing"),  # without packing
    ({"static_packing": True, "packing": True, "max_batch_size": 0}, "max_batch_size"),  # a cap below one document
])
def test_bad_static_settings_name_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=setting) as info:
        BatchingSettings(max_tokens=64, **kwargs)
    assert info.value.parameter == setting


@pytest.mark.parametrize("kwargs", [{"padded_shapes": 2}, {"static_packing": True, "packing": True}])
def test_static_shapes_refuse_per_rank_budgets(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BatchingSettings(max_tokens=[64, 128], **kwargs)


def test_a_shape_list_that_cannot_hold_the_longest_document_is_refused():
    with pytest.raises(InputValueError, match=r"cannot hold the longest sample: index 2 has 40 tokens") as info:
        BalancedBatchSampler([5, 9, 40, 3], 64, num_replicas=1, rank=0, padded_shapes=[(4, 16), (2, 32)])
    assert info.value.parameter == "padded_shapes"
    with pytest.raises(InputValueError, match="padded_shapes"):
        plan_epoch([5, 9, 40, 3], BatchingSettings(max_tokens=64, padded_shapes=[(4, 16)]), num_replicas=1, epoch=0)


def test_the_budget_probe_measures_the_static_shapes():
    from lit_balance.plan.shapes import probe_planner

    lengths = np.random.default_rng(3).integers(1, 300, 2000)
    free = BatchingSettings(max_tokens=1 << 40, packing=True)  # max_tokens: a placeholder, as the probe has
    assert probe_planner(free, lengths) is None  # the probe then uses planner_for(settings)
    packed = probe_planner(free.replace(static_packing=True), lengths)
    for budget in (600, 4096, 20000):
        case = packed.worst_case_batch(free.replace(static_packing=True), budget, 7)
        cap = choose_document_cap(length_histogram(lengths), free.replace(max_tokens=budget))
        assert sum(case.rows) == case.slots == budget and len(case.rows) <= cap
    capped = packed.worst_case_batch(free.replace(static_packing=True, max_batch_size=4), 4096, 7)
    assert len(capped.rows) == 4 and sum(capped.rows) == 4096
    padded = BatchingSettings(max_tokens=1 << 40, padded_shapes=4)
    probe = probe_planner(padded, lengths)
    widths = [t for _, t in choose_padded_shapes(length_histogram(lengths), padded, 4)]
    for budget in (1024, 4096):
        for length in (1, 120, 299):
            case = probe.worst_case_batch(padded, budget, length)
            width = min(t for t in widths if t >= length)
            assert case.rows == (width,) * (budget // width) and case.slots <= budget
    assert probe.worst_case_batch(padded, 100, 299) is None or widths[-1] <= 100


def _best_lengths_fraction(lengths, k):
    """The real-token fraction of the best ``k`` lengths (every sample padded to the next chosen length, rows not
    counted): an exact dynamic program over every distinct length."""
    values, counts = np.unique(lengths, return_counts=True)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    n = values.shape[0]
    slots = values[None, :].astype(np.float64) * (cum[None, 1:] - cum[:n, None])  # samples i..j padded to values[j]
    slots[np.tril_indices(n, -1)] = np.inf
    best = slots[0].copy()
    for _ in range(k - 1):
        best = np.minimum(best, (np.concatenate([[np.inf], best[:-1]])[:, None] + slots).min(axis=0))
    return float(lengths.sum() / best[-1])


_DISTRIBUTIONS = sorted(p.name[len("lengths_"):-len(".npy")]
                        for p in files("lit_balance.data.lengths").iterdir() if p.name.endswith(".npy"))


@functools.lru_cache(maxsize=None)
def _real_lengths_and_bound(name):
    """A shipped distribution capped at 4,096 tokens, and the best 32 lengths' real-token fraction of it (exact)."""
    lengths = np.minimum(np.load(files("lit_balance.data.lengths") / f"lengths_{name}.npy").astype(np.int64), 4096)
    return lengths, _best_lengths_fraction(lengths, 32)


@pytest.mark.parametrize("name", _DISTRIBUTIONS)
@pytest.mark.parametrize("num_replicas, accumulate", [(1, 1), (2, 1), (8, 1), (64, 1), (8, 4)])
def test_32_chosen_shapes_come_within_two_points_of_the_best_32_lengths(name, num_replicas, accumulate):
    # every rank runs the same number of micro-batches (whole optimizer steps): the shapes' rows fill that many, so
    # the micro-batches many ranks add are not padded to whole shapes
    lengths, bound = _real_lengths_and_bound(name)
    sampler = BalancedBatchSampler(lengths, max_tokens=8192, padded_shapes=32, num_replicas=num_replicas, rank=0,
                                   accumulate_grad_batches=accumulate)
    plan = sampler.plan(0)
    assert plan.num_batches % (num_replicas * accumulate) == 0 and not plan.is_fill.any()
    shapes = epoch_shapes(plan, lengths, sampler.settings)
    if len(np.unique(lengths)) <= 1024:  # the shape choice is exact up to 1,024 distinct lengths (quantiles beyond)
        assert shapes["real_token_fraction_bound"] == pytest.approx(bound, abs=1e-9)
    assert bound - 0.02 <= shapes["real_token_fraction"] <= shapes["real_token_fraction_bound"] <= bound + 1e-9


@pytest.mark.parametrize("worlds", [(2, 3, 2), (8, 7)])
def test_chosen_shapes_change_with_the_ranks_and_a_resume_on_other_ranks_keeps_every_document_once(worlds):
    lengths = _real_lengths_and_bound("fortunes")[0][:4000]
    kwargs = {"max_tokens": 2048, "padded_shapes": 8, "seed": 5}
    seen, state, chosen = [], None, []
    for i, world in enumerate(worlds):
        samplers = [BalancedBatchSampler(lengths, num_replicas=world, rank=r, **kwargs) for r in range(world)]
        chosen.append(samplers[0].settings.padded_shapes)
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
        collate = collator_for(samplers[0].settings, pad_token_id=0)
        per_rank = []
        for sampler in samplers:
            iterator = iter(sampler)
            per_rank.append(list(iterator) if i == len(worlds) - 1 else [next(iterator) for _ in range(3)])
        assert len({len(r) for r in per_rank}) == 1  # equal counts
        for micro in itertools.chain.from_iterable(per_rank):
            batch = collate([{"input_ids": np.arange(1, lengths[j] + 1), "index": j, "is_fill": bool(f)}
                             for j, f in zip(micro, micro.is_fill)])
            assert tuple(batch["input_ids"].shape) in chosen[-1] and batch["num_padded_tokens"] <= 2048
            seen += [j for j, f in zip(micro, micro.is_fill) if not f]
        state = _roundtrip(samplers[0].state_dict())
        assert all(_roundtrip(s.state_dict()) == state for s in samplers)  # the same on every rank
    assert len(set(chosen)) > 1  # the rows follow the ranks: the resumes planned with other shapes
    assert sorted(seen) == list(range(len(lengths)))  # every document once


def test_a_resume_on_the_same_ranks_with_other_shapes_is_refused_naming_them():
    lengths = _real_lengths_and_bound("fortunes")[0][:2000]
    saved = BalancedBatchSampler(lengths, 2048, num_replicas=2, rank=0, padded_shapes=8).state_dict()
    other = BalancedBatchSampler(lengths, 2048, num_replicas=2, rank=0, padded_shapes=6)
    with pytest.raises(InputValueError, match="padded_shapes: saved"):
        other.load_state_dict(saved)
    bad = {**saved, "segments": [[3, 1], [2, 0]], "segment_padded_shapes": [[[9999, 9999]], saved["settings"]
                                                                            ["padded_shapes"]]}
    same = BalancedBatchSampler(lengths, 2048, num_replicas=2, rank=0, padded_shapes=8)
    with pytest.raises(InputValueError, match="padded_shapes must be"):  # a segment's shapes over the budget
        same.load_state_dict(bad)
