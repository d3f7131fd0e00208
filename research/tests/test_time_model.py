"""research/time_model.py: the fit recovers known coefficients from synthetic traces, per-run predictions match,
measured step times add up, projected plans are the runner's plans, and the projection's figures keep their
invariants. No training and no timing: every trace here is generated from known coefficients.

Run:
    python -m pytest -m benchmark research/tests/test_time_model.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler

from research import time_model as tm
from research._training import TRACE_FIELDS
from benchmarks.peers import fixed_batch_size, sort_fill_batches
from research.strategies import deal_even, sorted_bucket_batches
from lit_balance import CostModel, plan_stats

pytestmark = pytest.mark.benchmark

COL = {name: i for i, name in enumerate(TRACE_FIELDS)}
NUM_FIELDS = len(TRACE_FIELDS)
#: Coefficients of the synthetic runs: seconds per micro-batch, per token, per attention pair, per step. The
#: attention term is a few times the demo model's, so that 5 % noise does not hide it.
TRUE = np.array([0.05, 1.4e-3, 1e-6, 0.06])


def _draw_micro_batches(rng: np.random.Generator, kind: str, world: int) -> tuple[np.ndarray, ...]:
    """``(slots, pairs, real, rows)`` ``[world]`` of one micro-step of a strategy-like batching rule."""
    if kind == "random":  # 4 rows of a random longest length: heavy padding, unequal ranks
        width = rng.integers(20, 257, world)
        rows = np.full(world, 4)
        slots, pairs, real = rows * width, rows * width ** 2, rows * width * rng.uniform(0.3, 0.7, world)
    elif kind == "dynamic":  # sorted fill: near the budget, some above it
        width = rng.integers(8, 257, world)
        rows = np.maximum(1, rng.integers(900, 1250, world) // width)
        slots, pairs, real = rows * width, rows * width ** 2, rows * width * 0.99
    elif kind == "packed":  # one row of whole documents, sum of squared document lengths
        docs = [rng.integers(5, 200, rng.integers(5, 25)) for _ in range(world)]
        slots = np.array([d.sum() for d in docs])
        pairs = np.array([(d.astype(np.int64) ** 2).sum() for d in docs])
        real, rows = slots.astype(float), np.array([d.size for d in docs])
    else:  # balanced padded: equal slots on every rank
        width = np.full(world, rng.integers(16, 257))
        rows = np.maximum(1, 1000 // width)
        slots, pairs, real = rows * width, rows * width ** 2, rows * width * 0.98
    return slots.astype(float), pairs.astype(float), np.asarray(real, float), rows.astype(float)


def synthetic_run(rng: np.random.Generator, kind: str, *, coef: np.ndarray = TRUE, world: int = 2,
                  micro_batches: int = 48, accumulate: int = 1, factors: tuple[float, ...] | None = None,
                  noise: float = 0.0, barrier: str = "micro_batch", epochs: int = 2, name: str | None = None,
                  jitter_s: float = 0.0) -> tm.RunTrace:
    """A run's trace as a DDP run under the model would record it: ranks start each micro-step together after the
    barrier (``"micro_batch"``) or run their step's micro-batches back to back and meet at its end (``"step"``);
    each micro-batch lasts ``f_r * (coef . features) * (1 + noise * N(0, 1))``; a step's last micro-batch then waits
    for every rank and adds the sync ``coef[3] * (1 + noise * N(0, 1))`` (the all-reduce of its backward and the
    update run before ``on_train_batch_end``), so it ends at the same time on every rank; ``jitter_s`` delays each
    rank's start a little (uniform)."""
    factors = factors or (1.0,) * world
    f = np.asarray(factors)
    trace = np.zeros((world, micro_batches * epochs, len(TRACE_FIELDS)))
    clock = np.full(world, 10.0)
    k = step = 0
    for epoch in range(epochs):
        done = 0
        while done < micro_batches:
            count = min(accumulate, micro_batches - done)
            for j in range(count):
                slots, pairs, real, rows = _draw_micro_batches(rng, kind, world)
                seconds = f * (coef[0] + coef[1] * slots + coef[2] * pairs) * (1 + noise * rng.standard_normal(world))
                start = (clock.max() if barrier == "micro_batch" else clock) + jitter_s * rng.random(world)
                start = np.broadcast_to(start, (world,)).astype(float)
                end = start + seconds
                if j == count - 1:  # the step's all-reduce waits for every rank, then the update: inside the batch
                    end = np.full(world, end.max() + coef[3] * (1 + noise * rng.standard_normal()))
                trace[:, k] = np.stack([np.full(world, epoch), np.full(world, step), start, end, 0.4 * seconds,
                                        real, slots, rows, pairs], axis=1)
                clock = end
                k += 1
            done += count
            step += 1
    run = tm.RunTrace(name or kind, kind, trace, (1,), tuple(float(x) for x in f), 1.0)
    s = tm._steps(run)
    return tm.RunTrace(run.run, kind, trace, (1,), run.rank_factors, s.real_tokens / float(s.epoch_s.sum()))


def _runs(rng: np.random.Generator, noise: float, barrier: str = "micro_batch") -> list[tm.RunTrace]:
    return [
        synthetic_run(rng, "random", noise=noise, barrier=barrier, micro_batches=80),
        synthetic_run(rng, "dynamic", noise=noise, barrier=barrier),
        synthetic_run(rng, "dynamic", noise=noise, barrier=barrier, accumulate=4, name="dynamic_accum"),
        synthetic_run(rng, "balanced", noise=noise, barrier=barrier, accumulate=4, name="lit_balance"),
        synthetic_run(rng, "packed", noise=noise, barrier=barrier, accumulate=3, name="lit_balance_packed"),
        synthetic_run(rng, "balanced", noise=noise, barrier=barrier, accumulate=4, factors=(1.0, 1.5),
                      name="lit_balance_slowed"),
    ]


# ------------------------------------------------------------------------------------------------------------------
# Fit and prediction.


@pytest.mark.parametrize("barrier", tm.BARRIERS)
def test_noise_free_traces_give_back_the_coefficients_and_the_measured_tokens_per_s(barrier):
    runs = _runs(np.random.default_rng(0), noise=0.0, barrier=barrier)
    model = tm.fit_time_model(runs, barrier=barrier)
    np.testing.assert_allclose(model.coef, TRUE, rtol=1e-6)
    assert model.noise_ratio == pytest.approx(0.0, abs=1e-6)
    assert model.barrier == barrier and model.world_size == 2
    for run in runs:
        p = tm.predict_run(model, run)
        assert abs(p["calibration_error"]) < 1e-6
        assert p["measured_real_tokens_per_s"] == run.measured_real_tokens_per_s
        assert p["step_sum_over_interval"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_traces_with_a_slowed_rank_and_accumulation_recover_the_coefficients(seed):
    runs = _runs(np.random.default_rng(seed), noise=0.05)
    model = tm.fit_time_model(runs)
    assert model.per_token_s == pytest.approx(TRUE[1], rel=0.02)
    assert model.per_micro_batch_s == pytest.approx(TRUE[0], rel=0.35)
    assert model.per_step_sync_s == pytest.approx(TRUE[3], rel=0.25)
    assert model.per_attention_pair_s == pytest.approx(TRUE[2], rel=0.3)
    assert model.noise_ratio == pytest.approx(0.05, abs=0.01)
    errors = [tm.predict_run(model, r)["calibration_error"] for r in runs]
    assert max(abs(e) for e in errors) < 0.02, errors


def test_without_the_noise_term_the_slowest_of_noisy_ranks_biases_the_fit():
    # the expected maximum of two noisy ranks exceeds the larger mean; a noiseless model puts that into intercepts
    errors = {}
    for noise in ("trace", "fit", "none"):
        worst = []
        for seed in (1, 2, 3):
            runs = _runs(np.random.default_rng(seed), noise=0.05)
            model = tm.fit_time_model(runs, noise=noise)
            assert (model.noise_ratio == 0) == (noise == "none")
            worst.append(max(abs(tm.predict_run(model, r)["calibration_error"]) for r in runs))
        errors[noise] = float(np.mean(worst))
    assert errors["trace"] < errors["none"] and errors["fit"] < errors["none"]


def test_a_load_shared_by_every_rank_is_not_read_as_noise():
    runs = _runs(np.random.default_rng(9), noise=0.0)
    for run in runs:  # every rank of a micro-step slowed alike, by up to 30 %
        t = run.trace
        t[:, :, COL["end_s"]] = t[:, :, COL["start_s"]] + (t[:, :, COL["end_s"]] - t[:, :, COL["start_s"]]) * (
            1 + 0.3 * np.random.default_rng(0).random(t.shape[1]))
    assert tm.fit_time_model(runs).noise_ratio == pytest.approx(0.0, abs=1e-9)


def test_the_slowed_rank_factor_is_what_makes_its_run_slower():
    rng = np.random.default_rng(4)
    runs = _runs(rng, noise=0.0)
    model = tm.fit_time_model(runs)
    slowed = runs[-1]
    as_if_equal = tm.RunTrace(slowed.run, slowed.strategy, slowed.trace, slowed.headline_epochs, (1.0, 1.0),
                              slowed.measured_real_tokens_per_s)
    assert tm.predict_run(model, slowed)["calibration_error"] == pytest.approx(0.0, abs=1e-6)
    assert tm.predict_run(model, as_if_equal)["calibration_error"] > 0.2  # without the factor: far too fast


def test_the_wrong_barrier_fits_a_per_micro_batch_barrier_run_worse():
    runs = _runs(np.random.default_rng(5), noise=0.0, barrier="micro_batch")
    right = tm.fit_time_model(runs, barrier="micro_batch")
    wrong = tm.fit_time_model(runs, barrier="step")
    worst = {m.barrier: max(abs(tm.predict_run(m, r)["calibration_error"]) for r in runs) for m in (right, wrong)}
    assert worst["micro_batch"] < 1e-6 < worst["step"]


# ------------------------------------------------------------------------------------------------------------------
# Measured step times.


def test_step_times_of_a_hand_made_trace():
    # 2 ranks, epoch 1 only: step 0 = micro-batches 0, 1; step 1 = micro-batch 2. Rank 1 starts 0.1 s late.
    starts = np.array([[0.0, 1.0, 3.0], [0.1, 1.0, 3.2]])
    ends = np.array([[0.9, 2.5, 4.0], [0.8, 2.9, 4.5]])
    trace = np.zeros((2, 3, len(TRACE_FIELDS)))
    trace[:, :, COL["epoch"]] = 1
    trace[:, :, COL["step"]] = [0, 0, 1]
    trace[:, :, COL["start_s"]], trace[:, :, COL["end_s"]] = starts, ends
    trace[:, :, COL["real_tokens"]] = trace[:, :, COL["padded_slots"]] = 10
    run = tm.RunTrace("r", "random", trace, (1,), (1.0, 1.0), 1.0)
    # rank 0: steps 3.0 and 1.0 s (sum 4.0); rank 1: 3.1 and 1.3 s (sum 4.4, the epoch's 4.4 s)
    np.testing.assert_allclose(tm.measured_step_times(run, scaled=False), [3.1, 1.3])
    np.testing.assert_allclose(tm.measured_step_times(run), [3.1, 1.3])
    assert tm.predict_run(tm.TimeModel(0.0, 0.01, 0.0, 0.0), run)["trace_real_tokens_per_s"] == pytest.approx(60 / 4.4)


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), accumulate=st.integers(1, 5), world=st.integers(1, 4),
       barrier=st.sampled_from(tm.BARRIERS))
def test_measured_step_times_sum_to_the_epoch_interval(seed, accumulate, world, barrier):
    run = synthetic_run(np.random.default_rng(seed), "dynamic", world=world, micro_batches=13, accumulate=accumulate,
                        noise=0.1, barrier=barrier)
    raw, scaled = tm.measured_step_times(run, scaled=False), tm.measured_step_times(run)
    epoch = run.trace[:, run.trace[0, :, COL["epoch"]] == 1]
    interval = float((epoch[:, -1, COL["end_s"]] - epoch[:, 0, COL["start_s"]]).max())
    assert raw.shape == scaled.shape == (-(-13 // accumulate),)
    assert float(scaled.sum()) == pytest.approx(interval, rel=1e-12)
    # ranks leave every step together here (the all-reduce), so even the unscaled maxima add up to the interval
    assert float(raw.sum()) == pytest.approx(interval, rel=1e-12)


def test_jittered_ranks_make_the_raw_steps_sum_a_little_above_the_interval():
    run = synthetic_run(np.random.default_rng(6), "random", jitter_s=0.05, barrier="step", micro_batches=20)
    p = tm.predict_run(tm.fit_time_model([run], barrier="step"), run)
    assert 1.0 < p["step_sum_over_interval"] < 1.1


# ------------------------------------------------------------------------------------------------------------------
# Bad inputs.


def _trace(shape=(2, 4, NUM_FIELDS)):
    trace = np.zeros(shape)
    if len(shape) == 3 and shape[2] == len(TRACE_FIELDS):
        trace[:, :, COL["epoch"]] = 1
        trace[:, :, COL["start_s"]] = np.arange(shape[1])
        trace[:, :, COL["end_s"]] = np.arange(shape[1]) + 0.5
    return trace


@pytest.mark.parametrize("shape", [(2, 4), (2, 4, 5), (2, 4, len(TRACE_FIELDS) + 1), (0, 4, len(TRACE_FIELDS))])
def test_a_trace_of_the_wrong_shape_names_the_expected_columns(shape):
    with pytest.raises(ValueError, match=r"columns \['epoch', 'step', 'start_s'.*got shape"):
        tm.RunTrace("r", "random", np.zeros(shape), (1,), (1.0, 1.0), 1.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"headline_epochs": (3,)}, r"subset of the trace's epochs \[1\], got \[3\]"),
    ({"headline_epochs": ()}, "non-empty subset"),
    ({"rank_factors": (1.0,)}, r"2 positive numbers \(one per rank\), got \[1.0\]"),
    ({"rank_factors": (1.0, 0.0)}, "positive numbers"),
    ({"measured_real_tokens_per_s": 0.0}, "must be > 0, got 0.0"),
])
def test_bad_run_fields_say_what_was_expected(kwargs, match):
    fields = {"headline_epochs": (1,), "rank_factors": (1.0, 1.0), "measured_real_tokens_per_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        tm.RunTrace("r", "random", _trace(), **fields)


def test_ranks_with_different_steps_or_a_nan_are_refused():
    trace = _trace()
    trace[1, 2, COL["step"]] = 1
    with pytest.raises(ValueError, match="step column differs between ranks"):
        tm.RunTrace("r", "random", trace, (1,), (1.0, 1.0), 1.0)
    trace = _trace()
    trace[0, 0, COL["padded_slots"]] = np.nan
    with pytest.raises(ValueError, match="1 non-finite"):
        tm.RunTrace("r", "random", trace, (1,), (1.0, 1.0), 1.0)


def test_fit_refuses_no_runs_mixed_worlds_too_few_steps_and_other_objects():
    with pytest.raises(ValueError, match="at least one RunTrace.*got 0 runs"):
        tm.fit_time_model([])
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match=r"one world size.*\[2, 3\]"):
        tm.fit_time_model([synthetic_run(rng, "dynamic"), synthetic_run(rng, "dynamic", world=3)])
    with pytest.raises(ValueError, match="at least 4 optimizer steps.*got 3"):
        tm.fit_time_model([synthetic_run(rng, "dynamic", micro_batches=3)])
    with pytest.raises(TypeError, match=r"RunTrace objects, got \['dict'\]"):
        tm.fit_time_model([{"trace": None}])
    with pytest.raises(ValueError, match="barrier must be one of"):
        tm.fit_time_model([synthetic_run(rng, "dynamic")], barrier="never")
    with pytest.raises(ValueError, match=r"noise must be one of \('trace', 'fit', 'none'\), got 'x'"):
        tm.fit_time_model([synthetic_run(rng, "dynamic")], noise="x")


def test_a_negative_coefficient_is_refused():
    with pytest.raises(ValueError, match=r"TimeModel.per_token_s must be a finite number >= 0 \(seconds\), got -1"):
        tm.TimeModel(0.0, -1.0, 0.0, 0.0)


# ------------------------------------------------------------------------------------------------------------------
# The projected plans are the runner's plans.


@pytest.mark.parametrize("n, size, batch_size", [(2, 37, 4), (3, 40, 5), (8, 100, 3)])
def test_the_random_plan_is_distributed_sampler_with_drop_last_and_a_batch_sampler(n, size, batch_size):
    lengths = np.arange(1, size + 1, dtype=np.int64)
    plan = tm._distributed_fixed(lengths, n, batch_size, seed=5, epoch=1, accumulate=1, packed=False)
    for rank in range(n):
        sampler = DistributedSampler(range(size), num_replicas=n, rank=rank, shuffle=True, seed=5, drop_last=True)
        sampler.set_epoch(1)
        expected = [list(b) for b in BatchSampler(sampler, batch_size, drop_last=False)]
        assert [int(plan.slots[b]) for b in plan.assignment[:, rank]] == [len(b) * max(lengths[b]) for b in expected]
        assert [int(plan.real[b]) for b in plan.assignment[:, rank]] == [int(lengths[b].sum()) for b in expected]


def test_sorted_buckets_and_dynamic_are_dealt_as_the_runner_deals_them():
    lengths = np.random.default_rng(0).integers(1, 64, 203)
    for batches in (sorted_bucket_batches(lengths, 4, 0, 1), sort_fill_batches(lengths, 128, 0, 1)):
        plan = tm._dealt(lengths, batches, 3, accumulate=2)
        per_rank, _ = deal_even(batches, 3)
        for rank in range(3):
            expected = [len(b) * int(lengths[b].max()) for b in per_rank[rank]]
            assert plan.slots[plan.assignment[:, rank]].astype(int).tolist() == expected
        assert plan.step.tolist() == [s // 2 for s in range(len(per_rank[0]))]


def test_accumulated_useful_fraction_is_lit_balance_stats_under_the_same_cost_with_a_step_barrier():
    lengths = np.random.default_rng(1).integers(1, 129, 500)
    model = tm.TimeModel(0.01, 1e-3, 2e-6, 0.05, barrier="step")
    (row,) = tm.project(model, strategies=["dynamic_accum"], lengths={"d": lengths}, num_replicas=(4,),
                        max_tokens=256, max_length=128, accumulate=3, micro_batches_per_rank=1)
    per_rank, _ = deal_even(sort_fill_batches(lengths, 256, 0, tm.PROJECTION_EPOCH), 4)
    stats = plan_stats(per_rank, lengths, CostModel(linear=1e-3, quadratic=2e-6, per_batch=0.01),
                       accumulate_grad_batches=3)
    assert row["useful_compute_fraction"] == pytest.approx(stats.useful_fraction, rel=1e-9)
    assert row["padding_ratio"] == pytest.approx(stats.padding_ratio, rel=1e-9)
    assert row["max_micro_batch_slots"] == stats.max_batch_tokens


def test_lit_balance_steps_follow_adaptive_accumulation_to_the_target():
    lengths = np.random.default_rng(2).integers(1, 129, 3000)
    model = tm.TimeModel(0.01, 1e-3, 0.0, 0.05)
    rows = tm.project(model, strategies=["lit_balance", "lit_balance_packed"], lengths={"d": lengths},
                      num_replicas=(4,), max_tokens=512, max_length=128, accumulate=4)
    for row in rows:
        # target 4 x 4 x 512 real tokens per step; each micro-step holds about 4 x 512 x (1 - slack)
        assert 3 <= row["micro_batches_per_step_median"] <= 5
        assert row["optimizer_steps"] == pytest.approx(row["micro_batches_per_rank"] / 4, rel=0.3)
    from lit_balance import BalancedBatchSampler

    sampler = BalancedBatchSampler(np.minimum(lengths, 128), 512, num_replicas=4, rank=0, seed=0)
    sampler.set_epoch(1)
    step = tm._adaptive_steps(sampler, 4 * 4 * 512)
    assert step.shape == (len(sampler),) and step[0] == 0 and set(np.diff(step)) <= {0, 1}
    firsts = np.flatnonzero(np.diff(step, prepend=-1))
    counts = np.diff(np.append(firsts, step.size))
    # Lightning's alignment, kept by the callback: a window of k micro-batches starts at a multiple of k (the
    # epoch's last window may be cut short)
    assert all(first % count == 0 for first, count in zip(firsts[:-1], counts[:-1]))


# ------------------------------------------------------------------------------------------------------------------
# Projection invariants.

ALL = ("random", "sorted_buckets", "dynamic", "dynamic_accum", "lit_balance", "lit_balance_packed", "hf_flatten")


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(dists=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=300), min_size=1, max_size=2),
       ranks=st.lists(st.sampled_from([1, 2, 3, 8]), min_size=1, max_size=2, unique=True),
       coef=st.tuples(st.floats(0, 0.1), st.floats(1e-5, 1e-2), st.floats(0, 1e-5), st.floats(0, 0.1)),
       barrier=st.sampled_from(tm.BARRIERS), accumulate=st.integers(1, 4))
def test_projection_rows_keep_their_invariants(dists, ranks, coef, barrier, accumulate):
    model = tm.TimeModel(*coef, barrier=barrier)
    lengths = {f"d{i}": np.array(d, dtype=np.int64) for i, d in enumerate(dists)}
    max_tokens, max_length = 256, 64
    rows = tm.project(model, strategies=ALL, lengths=lengths, num_replicas=ranks, max_tokens=max_tokens,
                      max_length=max_length, accumulate=accumulate, micro_batches_per_rank=2)
    keys = {(r["distribution"], r["num_replicas"], r["strategy"]) for r in rows}
    assert keys == {(d, n, s) for d in lengths for n in ranks for s in ALL} and len(rows) == len(keys)
    for r in rows:
        assert r["label"] == tm.PROJECTION_LABEL
        assert 0 <= r["padding_ratio"] < 1
        assert np.isfinite(r["predicted_real_tokens_per_s"]) and np.isfinite(r["predicted_optimizer_steps_per_s"])
        if r["real_tokens"] > 0:
            assert 0 < r["useful_compute_fraction"] <= 1 + 1e-12
            assert r["predicted_real_tokens_per_s"] > 0
        else:  # too few micro-batches for every rank to get one (dealt with the remainder dropped)
            assert r["predicted_real_tokens_per_s"] == 0 and r["micro_batches_per_rank"] == 0
        assert r["predicted_epoch_s"] >= r["max_rank_compute_s"] * (1 - 1e-12)
        if r["strategy"].startswith("lit_balance"):
            assert r["over_budget_micro_batches"] == 0 and r["max_micro_batch_slots"] <= max_tokens
        if r["strategy"] in ("random", "sorted_buckets"):
            assert r["max_micro_batch_slots"] <= fixed_batch_size(max_tokens, max_length) * max_length
        n, d = r["num_replicas"], lengths[r["distribution"]]
        size = tm.projection_size(d.size, float(np.minimum(d, max_length).mean()), n, max_tokens, 2)
        assert r["num_documents"] == size and r["resampled"] == (size != d.size)


def test_projection_is_deterministic_and_resamples_only_small_distributions():
    lengths = {"small": np.random.default_rng(3).integers(1, 257, 400), "big": np.full(40000, 30)}
    model = tm.TimeModel(0.05, 1.4e-3, 1.7e-7, 0.06)
    kwargs = {"strategies": ["random", "lit_balance"], "lengths": lengths, "num_replicas": (2, 8),
              "max_tokens": 1024, "max_length": 256, "accumulate": 4}
    a, b = tm.project(model, **kwargs), tm.project(model, **kwargs)
    assert a == b
    sizes = {(r["distribution"], r["num_replicas"]): (r["num_documents"], r["resampled"]) for r in a}
    assert sizes[("big", 2)] == (40000, False) and sizes[("big", 8)] == (40000, False)
    assert sizes[("small", 8)][1] and sizes[("small", 8)][0] >= 16 * 8 * 1024 / 256


def test_ring_sync_scaling_slows_every_step_by_the_ring_factor():
    lengths = {"d": np.random.default_rng(4).integers(1, 257, 3000)}
    model = tm.TimeModel(0.0, 1e-3, 0.0, 0.5)
    common = {"strategies": ["dynamic"], "lengths": lengths, "num_replicas": (8,), "max_tokens": 1024,
              "max_length": 256, "accumulate": 1}
    (ring,), (flat,) = tm.project(model, **common), tm.project(model, sync_scaling="none", **common)
    extra = ring["predicted_epoch_s"] - flat["predicted_epoch_s"]
    assert extra == pytest.approx(ring["optimizer_steps"] * 0.5 * (tm.ring_factor(8) / tm.ring_factor(2) - 1))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"strategies": ["nope"]}, ValueError, r"strategies must be a non-empty list from .*got \['nope'\]"),
    ({"strategies": []}, ValueError, "non-empty list"),
    ({"lengths": {}}, ValueError, "at least one distribution"),
    ({"lengths": {"d": np.array([0, 3])}}, ValueError, r"lengths\['d'\] must be .* >= 1"),
    ({"lengths": {"d": np.array([1.5])}}, ValueError, "dtype float64"),
    ({"num_replicas": (0,)}, ValueError, "num_replicas must be an int >= 1, got 0"),
    ({"max_length": 2048}, ValueError, "max_length=2048 exceeds max_tokens=1024"),
    ({"sync_scaling": "tree"}, ValueError, "sync_scaling must be one of"),
    ({"model": "m"}, TypeError, "TimeModel, got str"),
])
def test_bad_projection_inputs_say_what_was_expected(kwargs, error, match):
    args = {"model": tm.TimeModel(0.0, 1e-3, 0.0, 0.0), "strategies": ["random"], "lengths": {"d": np.array([5, 6])},
            "num_replicas": (2,), "max_tokens": 1024, "max_length": 256, "accumulate": 1, **kwargs}
    model = args.pop("model")
    with pytest.raises(error, match=match):
        tm.project(model, **args)


# ------------------------------------------------------------------------------------------------------------------
# Plots.


def test_plots_are_written_and_refuse_rows_without_their_keys(tmp_path):
    runs = _runs(np.random.default_rng(8), noise=0.02)
    model = tm.fit_time_model(runs)
    predictions = [tm.predict_run(model, r) for r in runs]
    assert tm.plot_calibration(predictions, tmp_path / "cal.png").stat().st_size > 1000
    rows = tm.project(model, strategies=["random", "lit_balance"], lengths={"a": np.arange(1, 300)},
                      num_replicas=(2, 4), max_tokens=256, max_length=64, accumulate=2)
    assert tm.plot_projection(rows, tmp_path / "proj.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="lacks"):
        tm.plot_calibration([{"strategy": "x"}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="at least one row"):
        tm.plot_projection([], tmp_path / "bad.png")


def test_the_docstring_examples_hold():
    import doctest

    result = doctest.testmod(tm)
    assert result.failed == 0 and result.attempted >= 2  # ring_factor, projection_size
