"""Mixture plans: every optimizer step within one document of its shares, the budget, equal counts, every chosen
document once, the epoch's shares, the selection, and the errors of bad mixtures."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BatchingSettings
from lit_balance.plan import plan_stats, planner_for
from lit_balance.plan.cost import CostModel
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings, plan_mixture, select_epoch
from lit_balance.plan.types import padded_lengths


def _plan(lengths, sizes, weights, batching, *, num_replicas, epoch=0, **mixture):
    layout = MixtureLayout(np.asarray(sizes, dtype=np.int64), mixture.get("max_repetition", 1))
    mix = MixtureSettings(tuple(f"c{i}" for i in range(len(sizes))), tuple(weights), **mixture)
    tiled = layout.tile(np.asarray(lengths, dtype=np.int64))
    return layout, mix, tiled, plan_mixture(tiled, layout, mix, batching, num_replicas=num_replicas, epoch=epoch,
                                            cost_model=CostModel())


def _check_plan(layout, mix, lengths, mp, batching, num_replicas):
    """The invariants every mixture plan keeps; returns the per-step units per component."""
    plan, acc = mp.plan, batching.accumulate_grad_batches
    # equal counts: a full assignment, and every optimizer step but the last has acc micro-steps of every rank
    assert plan.assignment.shape[1] == num_replicas and (plan.assignment >= 0).all()
    assert sorted(plan.assignment.reshape(-1).tolist()) == list(range(plan.num_batches))
    # budget: rows x longest padded row (packed: the row's tokens, padded) within max_tokens
    padded = padded_lengths(lengths, batching.pad_to_multiple_of)
    for b in range(plan.num_batches):
        rows, _ = plan.batch(b)
        if batching.packing:
            assert padded_lengths(np.array([lengths[rows].sum()]), batching.pad_to_multiple_of)[0] <= \
                batching.max_tokens
        else:
            assert rows.size * padded[rows].max() <= batching.max_tokens
    # every chosen sample exactly once as a real row (drop_last=False: nothing dropped)
    real = plan.rows[~plan.is_fill]
    assert np.unique(real).size == real.size
    assert set(real.tolist()) == set(np.flatnonzero(mp.chosen).tolist())
    # per-step units per component, from the plan itself
    comp = layout.component_of(plan.rows)
    batch_of_row = np.repeat(np.arange(plan.num_batches), np.diff(plan.batch_offsets))
    step_of_batch = np.empty(plan.num_batches, dtype=np.int64)
    step_of_batch[plan.assignment.reshape(-1)] = np.repeat(np.arange(plan.num_micro_steps) // acc, num_replicas)
    steps = -(-plan.num_micro_steps // acc)
    units = np.zeros((steps, len(mix.names)), dtype=np.int64)
    np.add.at(units, (step_of_batch[batch_of_row][~plan.is_fill], comp[~plan.is_fill]), lengths[real])
    if mix.unit == "tokens":
        np.testing.assert_array_equal(units, mp.step_units)
    # fill rows only in a step of fewer documents than micro-batches (no rank left without a row)
    row_step = step_of_batch[batch_of_row]
    real_rows = np.bincount(row_step[~plan.is_fill], minlength=steps)
    assert (real_rows[np.unique(row_step[plan.is_fill])] < num_replicas * acc).all()
    return units


@st.composite
def _mixtures(draw):
    k = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 60)) for _ in range(k)]
    lengths = []
    for n in sizes:
        low = draw(st.integers(1, 200))
        high = draw(st.integers(low, 600))
        lengths += draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    weights = [draw(st.floats(0.05, 10.0)) for _ in range(k)]
    if k > 1 and draw(st.booleans()):
        weights[draw(st.integers(0, k - 1))] = 0.0
    return sizes, lengths, weights


def _steps_of_rows(plan, acc, num_replicas):
    """int64 ``[num_rows]``: the optimizer step of each row of the plan."""
    step_of_batch = np.empty(plan.num_batches, dtype=np.int64)
    step_of_batch[plan.assignment.reshape(-1)] = np.repeat(np.arange(plan.num_micro_steps) // acc, num_replicas)
    return step_of_batch[np.repeat(np.arange(plan.num_batches), np.diff(plan.batch_offsets))]


def _boundary_documents(layout, mp, lengths, batching, num_replicas):
    """Unshuffled plans: each step's boundary document, the longest document next to a component's cut at the
    step's start or end; the steps run in the order they are formed and each component's stream is its chosen
    samples longest first by padded length (packed: by index). Also checks that every step takes a contiguous run of
    each stream."""
    plan, acc = mp.plan, batching.accumulate_grad_batches
    real = ~plan.is_fill
    step_of = dict(zip(plan.rows[real].tolist(), _steps_of_rows(plan, acc, num_replicas)[real].tolist()))
    num_steps = mp.step_units.shape[0]
    bound = np.zeros(num_steps)
    padded = padded_lengths(lengths, batching.pad_to_multiple_of)
    for c in range(len(layout.sizes)):
        mine = np.flatnonzero(mp.chosen & (layout.component_of(np.arange(lengths.size)) == c))
        if not batching.packing:
            mine = mine[np.argsort(-padded[mine], kind="stable")]
        steps = np.array([step_of[i] for i in mine.tolist()], dtype=np.int64)
        assert (np.diff(steps) >= 0).all()  # contiguous runs of the stream, in step order
        ahead = np.concatenate([[0], lengths[mine]])  # the document before each cut
        after = np.concatenate([lengths[mine], [0]])  # the document after it
        edge = np.maximum(ahead, after)
        cut_before = np.searchsorted(steps, np.arange(num_steps), side="left")  # the step's start cut
        cut_after = np.searchsorted(steps, np.arange(num_steps), side="right")  # its end cut
        bound = np.maximum(bound, np.maximum(edge[cut_before], edge[cut_after]))
    return bound


@settings(max_examples=100, deadline=None)
@given(_mixtures(), st.integers(1, 8), st.integers(1, 4), st.booleans(), st.booleans(), st.integers(0, 3),
       st.integers(600, 4000))
def test_every_step_keeps_its_shares_within_one_boundary_document(mixture, num_replicas, acc, packing, shuffle,
                                                                  epoch, max_tokens):
    sizes, lengths, weights = mixture
    batching = BatchingSettings(max_tokens=max_tokens, accumulate_grad_batches=acc, packing=packing, shuffle=shuffle,
                                seed=5)
    layout, mix, tiled, mp = _plan(lengths, sizes, weights, batching, num_replicas=num_replicas, epoch=epoch)
    units = _check_plan(layout, mix, tiled, mp, batching, num_replicas)  # (units are mp.step_units)
    longest = int(tiled.max())
    # the epoch: each component within one document of its share of the weights
    total = units.sum(axis=0)
    assert np.all(np.abs(total - mix.shares * total.sum()) <= longest + 1e-6)
    # every step: each component within one document of the epoch's realized share; unshuffled (the order of the
    # steps and streams known), within the step's boundary document
    realized = total / max(total.sum(), 1)
    deviation = np.abs(units - realized * units.sum(axis=1, keepdims=True)).max(axis=1)
    assert (deviation <= longest + 1e-6).all()
    if not shuffle:
        bound = _boundary_documents(layout, mp, tiled, batching, num_replicas)
        assert (deviation <= bound + 1e-6).all(), (deviation, bound)
    # selection: the limiting component is read whole, none beyond once, zero weights not at all
    offsets = layout.offsets
    read = [mp.chosen[offsets[c]:offsets[c + 1]] for c in range(len(sizes))]
    assert any(r.all() for r, w in zip(read, weights) if w > 0) or mp.chosen.sum() == 0
    for r, w in zip(read, weights):
        if w == 0:
            assert not r.any()


@settings(max_examples=15)
@given(_mixtures(), st.integers(1, 8), st.integers(1, 4), st.booleans(), st.integers(2, 3))
def test_repetition_reads_a_document_at_most_max_repetition_times(mixture, num_replicas, acc, packing, reps):
    sizes, lengths, weights = mixture
    batching = BatchingSettings(max_tokens=4000, accumulate_grad_batches=acc, packing=packing, seed=1)
    layout, mix, tiled, mp = _plan(lengths, sizes, weights, batching, num_replicas=num_replicas, epoch=1,
                                   max_repetition=reps)
    units = _check_plan(layout, mix, tiled, mp, batching, num_replicas)
    docs = np.flatnonzero(mp.chosen) % layout.num_documents
    assert np.bincount(docs).max() <= reps
    longest = int(tiled.max())
    total = units.sum(axis=0)
    assert np.all(np.abs(total - mix.shares * total.sum()) <= longest + 1e-6)


@settings(max_examples=10, deadline=None)
@given(_mixtures(), st.integers(2, 4), st.integers(1, 3), st.booleans(), st.booleans())
def test_per_rank_budgets_and_rank_speeds_plan_step_by_step(mixture, num_replicas, acc, packing, per_rank):
    sizes, lengths, weights = mixture
    budgets = tuple(4000 - 1000 * (r % 2) for r in range(num_replicas)) if per_rank else 4000
    batching = BatchingSettings(max_tokens=budgets, accumulate_grad_batches=acc, packing=packing, seed=2)
    speeds = None if per_rank else np.linspace(1.0, 0.6, num_replicas)
    layout = MixtureLayout(np.asarray(sizes, dtype=np.int64))
    mix = MixtureSettings(tuple(f"c{i}" for i in range(len(sizes))), tuple(weights))
    tiled = np.asarray(lengths, dtype=np.int64)
    mp = plan_mixture(tiled, layout, mix, batching, num_replicas=num_replicas, epoch=1, cost_model=CostModel(),
                      speeds=speeds)
    plan = mp.plan
    real = plan.rows[~plan.is_fill]
    assert np.unique(real).size == real.size and set(real.tolist()) == set(np.flatnonzero(mp.chosen).tolist())
    padded = padded_lengths(tiled, batching.pad_to_multiple_of)
    for step in plan.assignment:  # each rank's micro-batch within that rank's budget
        for r, b in enumerate(step):
            rows, _ = plan.batch(b)
            cost = (padded_lengths(np.array([tiled[rows].sum()]), 1)[0] if packing
                    else rows.size * padded[rows].max())
            assert cost <= batching.rank_max_tokens(num_replicas)[r]
    total = mp.step_units.sum(axis=0)
    deviation = np.abs(mp.step_units - total / total.sum() * mp.step_units.sum(axis=1, keepdims=True))
    assert (deviation <= tiled.max() + 1e-6).all()


def test_a_new_subsample_every_epoch_and_the_same_on_every_call():
    lengths = np.arange(1, 401) % 97 + 5
    layout = MixtureLayout(np.array([100, 300]))
    mix = MixtureSettings(("a", "b"), (1.0, 1.0))
    units = lengths.astype(np.int64)
    e0, e0_again, e1 = (select_epoch(units, layout, mix, seed=3, epoch=e) for e in (0, 0, 1))
    np.testing.assert_array_equal(e0, e0_again)
    assert e0[:100].all() and e1[:100].all()  # the limiting component is read once, whole
    assert not np.array_equal(e0[100:], e1[100:])  # the other is subsampled anew
    assert abs(int(units[e0][units[e0] > 0][: e0[:100].sum()].sum()) - int(units[100:][e0[100:]].sum())) <= 101


def test_units_per_epoch_and_the_error_for_a_share_that_cannot_be_met():
    lengths = np.full(300, 10, dtype=np.int64)
    layout = MixtureLayout(np.array([100, 200]))
    mix = MixtureSettings(("web", "books"), (0.5, 0.5), units_per_epoch=1000)
    chosen = select_epoch(lengths, layout, mix, seed=0, epoch=0)
    assert int(lengths[chosen][:].sum()) == 1000 and chosen[:100].sum() == 50
    too_many = MixtureSettings(("web", "books"), (0.5, 0.5), units_per_epoch=3000)
    with pytest.raises(ValueError, match=r"component 'web' holds 1000 tokens .* needs 1500") as info:
        select_epoch(lengths, layout, too_many, seed=0, epoch=0)
    assert info.value.parameter == "units_per_epoch"
    # with two reads allowed it is met: every web document twice
    twice = MixtureSettings(("web", "books"), (0.5, 0.5), units_per_epoch=4000, max_repetition=2)
    layout2 = MixtureLayout(np.array([100, 200]), 2)
    chosen = select_epoch(layout2.tile(lengths), layout2, twice, seed=0, epoch=0)
    assert chosen[:100].all() and chosen[300:400].all() and chosen[100:300].all() and not chosen[400:].any()


def test_documents_and_supervised_units():
    lengths = np.concatenate([np.full(100, 10), np.full(100, 100)]).astype(np.int64)
    layout = MixtureLayout(np.array([100, 100]))
    batching = BatchingSettings(max_tokens=1000, shuffle=False)
    docs = MixtureSettings(("short", "long"), (1, 1), unit="documents")
    mp = plan_mixture(lengths, layout, docs, batching, num_replicas=2, epoch=0, cost_model=CostModel())
    assert mp.chosen.sum() == 200 and mp.step_units.sum(axis=0).tolist() == [100, 100]
    supervised = np.where(np.arange(200) < 100, 9, 50)  # the long ones mask half their tokens
    sup = MixtureSettings(("short", "long"), (1, 1), unit="supervised_tokens")
    mp = plan_mixture(lengths, layout, sup, batching, num_replicas=2, epoch=0, cost_model=CostModel(),
                      supervised_lengths=supervised)
    assert mp.step_units.sum(axis=0).tolist() == [900, 900]  # all 100 short (900), 18 long (900)


def _benchmark_lengths(n, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [int(n * 0.6), int(n * 0.1), int(n * 0.3)]
    lengths = np.concatenate([np.clip(rng.lognormal(math.log(m), 0.7, s), 8, 8192).astype(np.int64)
                              for m, s in zip((300, 900, 3000), sizes)])
    return sizes, lengths


@pytest.mark.parametrize("packing, bound", [(False, 0.97), (True, 0.99)])
def test_benchmark_distributions_keep_two_points_per_step_and_the_useful_fraction(packing, bound):
    sizes, lengths = _benchmark_lengths(40_000)
    batching = BatchingSettings(max_tokens=16384, accumulate_grad_batches=4, packing=packing)
    layout, mix, tiled, mp = _plan(lengths, sizes, (0.6, 0.1, 0.3), batching, num_replicas=8)
    units = _check_plan(layout, mix, tiled, mp, batching, 8)
    big = units.sum(axis=1) >= 256 * 1024
    assert big.sum() >= units.shape[0] - 1
    shares = units[big] / units[big].sum(axis=1, keepdims=True)
    assert np.abs(shares - mix.shares).max() <= 0.02
    stats = plan_stats(mp.plan, tiled, planner=planner_for(batching), accumulate_grad_batches=4)
    assert stats.useful_fraction >= bound


@pytest.mark.parametrize("weights, match", [
    ((1.0, -0.5), r"weight of component 'c1' must be finite and >= 0, got -0.5"),
    ((0.0, 0.0), r"weights of the mixture sum to 0.0"),
    ((float("nan"), 1.0), r"weight of component 'c0' must be finite"),
    ((float("inf"), 1.0), r"weight of component 'c0' must be finite"),
])
def test_bad_weights_name_the_setting(weights, match):
    with pytest.raises(ValueError, match=match):
        MixtureSettings(("c0", "c1"), weights)


def test_bad_mixtures():
    with pytest.raises(ValueError, match=r"component name 'web' is used twice"):
        MixtureSettings(("web", "web"), (1, 1))
    with pytest.raises(TypeError, match=r"weight of component 'web' must be a number, got 'x'"):
        MixtureSettings(("web",), ("x",))
    with pytest.raises(ValueError, match=r"one weight per component: 2 names"):
        MixtureSettings(("a", "b"), (1,))
    with pytest.raises(ValueError, match=r"unit must be one of"):
        MixtureSettings(("a",), (1,), unit="bytes")
    with pytest.raises(ValueError, match=r"max_repetition must be >= 1"):
        MixtureSettings(("a",), (1,), max_repetition=0)
    layout = MixtureLayout(np.array([3, 0]))
    with pytest.raises(ValueError, match=r"component 'b' has weight 1.0 but no tokens to read \(0 documents"):
        select_epoch(np.array([5, 5, 5]), layout, MixtureSettings(("a", "b"), (1, 1)), seed=0, epoch=0)


@st.composite
def _short_medium_long(draw):
    """Three components whose document lengths differ tenfold or more (tokens 1-30, 30-300, 300-3,000)."""
    sizes, lengths = [], []
    for low, high in ((1, 30), (30, 300), (300, 3000)):
        n = draw(st.integers(1, 80))
        sizes.append(n)
        lengths += draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    weights = [draw(st.floats(0.05, 10.0)) for _ in range(3)]
    return sizes, lengths, weights


@settings(max_examples=100, deadline=None)
@given(_short_medium_long(), st.integers(1, 8), st.integers(1, 2), st.booleans(), st.booleans(), st.integers(0, 2),
       st.integers(3000, 8192), st.sampled_from([1, 8]))
def test_short_medium_and_long_components_keep_the_budget_and_the_share_bound(mixture, num_replicas, acc, packing,
                                                                              shuffle, epoch, max_tokens, multiple):
    # one micro-batch per rank and step sizes each step to its longest document's micro-batch and passes over a
    # document too large for the room left: the same invariants, and each stream still taken in order
    sizes, lengths, weights = mixture
    batching = BatchingSettings(max_tokens=max_tokens, accumulate_grad_batches=acc, packing=packing, shuffle=shuffle,
                                seed=3, pad_to_multiple_of=multiple)
    layout, mix, tiled, mp = _plan(lengths, sizes, weights, batching, num_replicas=num_replicas, epoch=epoch)
    units = _check_plan(layout, mix, tiled, mp, batching, num_replicas)
    total = units.sum(axis=0)
    assert np.all(np.abs(total - mix.shares * total.sum()) <= int(tiled.max()) + 1e-6)
    if not shuffle:
        realized = total / max(total.sum(), 1)
        deviation = np.abs(units - realized * units.sum(axis=1, keepdims=True)).max(axis=1)
        bound = _boundary_documents(layout, mp, tiled, batching, num_replicas)
        assert (deviation <= bound + 1e-6).all(), (deviation, bound)
    # equal counts (the assignment is full, _check_plan), and every optimizer step but the last has acc micro-steps
    steps = mp.step_units.shape[0]
    assert steps == 0 or (steps - 1) * acc < mp.plan.num_micro_steps <= steps * acc


def _three_scales(n, seed=0):
    """The documents of docs/mixtures.md's comparison with one corpus: medians 30 / 300 / 3,000 tokens (log-normal,
    sigma 0.7, 8 to 8,192 tokens), in proportion to the targets 0.5 / 0.2 / 0.3."""
    rng = np.random.default_rng(seed)
    sizes = [int(n * t) for t in (0.5, 0.2, 0.3)]
    lengths = np.concatenate([np.clip(rng.lognormal(math.log(m), 0.7, s), 8, 8192).astype(np.int64)
                              for m, s in zip((30, 300, 3000), sizes)])
    return sizes, lengths


def _against_one_corpus(num_replicas, acc, packing, n=1_000_000, weights=(0.5, 0.2, 0.3)):
    """``(mixture stats, one-corpus stats)``: the mixture's plan and the same chosen documents planned as one
    corpus, at ``max_tokens=8192``."""
    from lit_balance.plan import plan_epoch

    sizes, lengths = _three_scales(n)
    batching = BatchingSettings(max_tokens=8192, accumulate_grad_batches=acc, packing=packing)
    layout, mix, tiled, mp = _plan(lengths, sizes, weights, batching, num_replicas=num_replicas)
    one = plan_epoch(tiled, batching, num_replicas=num_replicas, epoch=0, eligible=mp.chosen)
    planner = planner_for(batching)
    return (plan_stats(mp.plan, tiled, planner=planner, accumulate_grad_batches=acc),
            plan_stats(one, tiled, planner=planner, accumulate_grad_batches=acc))


def _epoch_imbalance(stats):
    per_rank = stats.rank_cost.sum(axis=0)
    return per_rank.max() / per_rank.mean()


@pytest.mark.parametrize("num_replicas, acc", [(8, 1), (8, 4), (64, 1), (64, 4)])
@pytest.mark.parametrize("packing", [False, True])
def test_three_scales_spread_the_epoch_over_the_ranks_as_one_corpus_does(num_replicas, acc, packing):
    # each step's shares of cost go to the ranks that have cost least so far: the epoch's cost per rank is as even
    # as the one-corpus plan's of the same documents (a step-local rank choice gave rank 0 every costliest share)
    mixture, one = _against_one_corpus(num_replicas, acc, packing)
    assert _epoch_imbalance(mixture) <= _epoch_imbalance(one) + 0.01


@pytest.mark.parametrize("num_replicas, acc", [(64, 1), (64, 4)])
def test_three_scales_padded_reach_one_corpus_u_at_many_micro_batches_per_step(num_replicas, acc):
    mixture, one = _against_one_corpus(num_replicas, acc, False)
    assert mixture.useful_fraction >= one.useful_fraction - 0.03


@pytest.mark.parametrize("weights", [(0.5, 0.2, 0.3), (0.05, 0.05, 0.9)])
def test_three_scales_padded_reach_097_at_8_ranks_with_accumulation(weights):
    # 32 micro-batches per step: each component's documents in a step are rounded to whole micro-batches within the
    # share bound, and the step's room is what micro-batches of its longest document hold (0.966 and 0.951 before)
    mixture, one = _against_one_corpus(8, 4, False, weights=weights)
    assert mixture.useful_fraction >= 0.97
    assert mixture.useful_fraction >= one.useful_fraction - 0.03
    assert _epoch_imbalance(mixture) <= _epoch_imbalance(one) + 0.01


@pytest.mark.parametrize("weights", [(0.5, 0.2, 0.3), (0.05, 0.05, 0.9)])
@pytest.mark.xfail(strict=True, reason="open: with one micro-batch per rank, a component whose share of a step is 2.4 "
                   "micro-batches of several of its documents each cannot be rounded to whole micro-batches within one "
                   "document of its share (U 0.923 and 0.929; one corpus 0.999); see docs/mixtures.md")
def test_three_scales_padded_reach_097_at_8_ranks_without_accumulation(weights):
    mixture, one = _against_one_corpus(8, 1, False, weights=weights)
    assert mixture.useful_fraction >= 0.97


@pytest.mark.parametrize("weights", [(0.5, 0.2, 0.3), (0.05, 0.05, 0.9)])
def test_three_scales_padded_without_accumulation_round_to_whole_micro_batches(weights):
    # a regression guard of the rounding to whole micro-batches at one micro-batch per rank and step: before it U
    # was 0.894 and 0.820
    mixture, one = _against_one_corpus(8, 1, False, weights=weights)
    assert mixture.useful_fraction >= 0.91
    assert _epoch_imbalance(mixture) <= _epoch_imbalance(one) + 0.01


@pytest.mark.parametrize("num_replicas, acc", [(8, 1), (64, 1)])
def test_three_scales_padded_without_accumulation_gain_over_steps_cut_at_the_budget(num_replicas, acc):
    # a regression guard of the rules for one micro-batch per rank and step (steps sized to their longest document,
    # a document too large passed over, steps grown): before them U was 0.81 at 8 ranks and 0.89 at 64
    mixture, one = _against_one_corpus(num_replicas, acc, False)
    assert mixture.useful_fraction >= one.useful_fraction - (0.11 if num_replicas == 8 else 0.03)


@pytest.mark.parametrize("num_replicas, acc", [(8, 1), (8, 4), (64, 1), (64, 4)])
def test_three_scales_packed_stay_within_a_point_of_one_corpus(num_replicas, acc):
    mixture, one = _against_one_corpus(num_replicas, acc, True)
    assert mixture.useful_fraction >= one.useful_fraction - 0.01
