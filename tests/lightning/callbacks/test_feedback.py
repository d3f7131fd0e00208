"""CostModelFeedback: fitting seconds and rank speeds from gathered timings, and handing them to the sampler."""

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODULE, Clock, batch, make_trainer

from lit_balance import BalancedBatchSampler
from lit_balance.callbacks import CostModelFeedback, StragglerMonitor
from lit_balance.lightning.callbacks.feedback import fit_cost_and_speeds
from lit_balance.lightning.callbacks.straggler import TimingWindow
from lit_balance.plan.cost import CostModel

COST = CostModel(linear=2e-5, quadratic=1e-7, per_batch=3e-3)
LENGTHS = Path(__file__).resolve().parents[3] / "lit_balance/data/lengths/lengths_fortunes.npy"


def as_window(columns):
    """A TimingWindow from ``[R, n, 6 or 7]`` columns: forward s, (unused), rows, padded length, real tokens, cost,
    and local backward s (NaN where absent)."""
    c = np.asarray(columns, dtype=np.float64)
    return TimingWindow(forward_s=c[:, :, 0], rows=c[:, :, 2], padded_length=c[:, :, 3], real_tokens=c[:, :, 4],
                        cost=c[:, :, 5], backward_s=c[:, :, 6] if c.shape[2] > 6 else None)


def synthetic_window(speeds, cost=COST, n=40, seed=0):
    """Timings of micro-batches that take cost(rows, L) / speed[r] seconds exactly."""
    rng = np.random.default_rng(seed)
    out = np.zeros((len(speeds), n, 6))
    for r, s in enumerate(speeds):
        length = rng.integers(8, 512, n).astype(float)
        rows = np.maximum(np.floor(1024 / length), 1)
        out[r, :, 0] = cost.batch_cost(rows, length) / s
        out[r, :, 2], out[r, :, 3] = rows, length
    return as_window(out)


def test_recovers_cost_model_and_rank_speeds():
    cost, speeds = fit_cost_and_speeds(synthetic_window([1.0, 2 / 3, 1.0]))
    assert speeds == pytest.approx([1.0, 2 / 3, 1.0], rel=1e-6)
    assert (cost.linear, cost.quadratic, cost.per_batch) == pytest.approx((2e-5, 1e-7, 3e-3), rel=1e-5)


def test_slow_rank_given_smaller_micro_batches_is_still_measured_slow():
    # After feedback, the slow rank runs smaller micro-batches than the fast one. Rank time alone cannot tell a
    # slow rank from a per-micro-batch cost then; the fit must not trade one for the other (linear truth, 5 % noise).
    rng = np.random.default_rng(1)
    n = 60
    window = np.zeros((2, n, 6))
    for r, (share, speed) in enumerate([(1.0, 1.0), (0.68, 0.68)]):
        length = rng.integers(16, 257, n).astype(float)
        rows = np.maximum(np.floor(share * 1024 / length), 1)
        window[r, :, 0] = 5e-4 * rows * length / speed * rng.lognormal(0.0, 0.05, n)
        window[r, :, 2], window[r, :, 3] = rows, length
    cost, speeds = fit_cost_and_speeds(as_window(window))
    assert speeds[1] == pytest.approx(0.68, abs=0.02)
    assert cost.per_batch < 0.1 * cost.batch_cost(1, 512)  # not a large invented per-micro-batch cost


def window_with_backward(forward_speeds, backward_speeds, local_every=(2, 2), n=40, seed=3):
    """[R, n, 7] columns (see as_window): forward takes cost/forward_speed, backward 2 x cost/backward_speed;
    every ``local_every[r]``-th micro-batch of rank r syncs (its backward: NaN, its forward 10x too long, as if it had waited)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((len(forward_speeds), n, 7))
    for r, (fs, bs) in enumerate(zip(forward_speeds, backward_speeds)):
        length = rng.integers(8, 512, n).astype(float)
        rows = np.maximum(np.floor(1024 / length), 1)
        cost = COST.batch_cost(rows, length)
        out[r, :, 0], out[r, :, 6] = cost / fs, 2 * cost / bs
        synced = np.arange(n) % local_every[r] == local_every[r] - 1
        out[r, synced, 0] *= 10
        out[r, synced, 6] = np.nan
        out[r, :, 2], out[r, :, 3] = rows, length
    return out


def test_speeds_come_from_forward_and_backward_of_the_micro_batches_whose_backward_was_local():
    # rank 1 is 0.8x as fast in forward and 0.5x in backward: forward + backward take 1/0.8 + 2/0.5 = 5.25 cost
    # units on it against 3 on rank 0, a speed of 3 / 5.25 (forward alone would say 0.8)
    cost, speeds = fit_cost_and_speeds(as_window(window_with_backward([1.0, 0.8], [1.0, 0.5])), min_samples=8)
    assert speeds == pytest.approx([1.0, 3 / 5.25], rel=1e-6)
    # the cost model is in forward + backward seconds of the fast rank: 3x the forward cost
    assert (cost.linear, cost.quadratic, cost.per_batch) == pytest.approx((6e-5, 3e-7, 9e-3), rel=1e-3)


def test_forward_seconds_of_every_micro_batch_when_a_rank_has_too_few_local_backwards():
    # rank 1 syncs every micro-batch (accumulate_grad_batches=1): 0 local backwards, so forward only, all of them
    window = window_with_backward([1.0, 0.8], [1.0, 0.5], local_every=(2, 1))
    window[:, :, 0] = window[:, :, 0] / np.where(np.isnan(window[:, :, 6]), 10, 1)  # undo the waits
    _, speeds = fit_cost_and_speeds(as_window(window), min_samples=8)
    assert speeds == pytest.approx([1.0, 0.8], rel=1e-6)
    # a window without backward timings (all NaN) is fitted the same way
    _, six = fit_cost_and_speeds(as_window(window[:, :, :6]), min_samples=8)
    assert six == pytest.approx(speeds, rel=1e-12)


def test_a_window_that_is_not_a_timing_window_is_refused():
    with pytest.raises(TypeError, match=r"window must be a TimingWindow .*got ndarray"):
        fit_cost_and_speeds(np.zeros((2, 10, 7)))
    with pytest.raises(ValueError, match=r"must all be \[num_replicas, n\], got rows of shape \(2, 3\)"):
        TimingWindow(forward_s=np.zeros((2, 4)), rows=np.zeros((2, 3)), padded_length=np.zeros((2, 4)))


def test_too_few_timings_raise():
    with pytest.raises(ValueError, match="at least 8 timed micro-batches"):
        fit_cost_and_speeds(synthetic_window([1.0, 1.0], n=5), min_samples=8)


class RecordingSampler(BalancedBatchSampler):
    """A training sampler that records what it is handed instead of planning with it."""

    def __init__(self, cost_model=None):
        super().__init__(np.full(40, 16), 64, num_replicas=2, rank=0, cost_model=cost_model)
        self.calls = []

    def set_cost_model(self, cost_model, rank_speeds=None):
        self.calls.append((cost_model, rank_speeds))


def test_hands_the_fit_to_the_sampler_and_logs_it():
    sampler = RecordingSampler()
    monitor = StragglerMonitor()
    feedback = CostModelFeedback()
    trainer, logger = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    monitor.epoch_windows = [synthetic_window([1.0, 0.5], n=20, seed=1), synthetic_window([1.0, 0.5], n=20, seed=2)]
    feedback.on_train_epoch_end(trainer, MODULE)
    (cost, speeds), = sampler.calls
    assert speeds == pytest.approx([1.0, 0.5], rel=1e-6)
    assert cost.linear == pytest.approx(2e-5, rel=1e-5)
    logged = logger.calls[-1][1]
    assert logged["balance/rank_speed_rank1"] == pytest.approx(0.5, rel=1e-6)
    assert logged["balance/cost_linear"] == cost.linear and logged["balance/cost_per_batch"] == cost.per_batch
    # only the cost model when speeds are not wanted
    only_cost = CostModelFeedback(fit_speeds=False)
    only_cost.on_train_start(trainer, MODULE)
    only_cost.on_train_epoch_end(trainer, MODULE)
    assert sampler.calls[-1][1] is None


def test_needs_a_monitor_and_a_training_sampler_handed_to_the_trainer():
    feedback = CostModelFeedback()
    trainer, _ = make_trainer(callbacks=[feedback])
    with pytest.raises(RuntimeError, match="needs a StragglerMonitor"):
        feedback.on_train_start(trainer, MODULE)
    monitor = StragglerMonitor()
    # a loader over a BalancedBatchSampler that nobody handed to the Trainer: refused at fit start, naming the ways
    trainer, _ = make_trainer(world_size=2, callbacks=[monitor, feedback])
    trainer.train_dataloader.sampler = RecordingSampler()
    with pytest.raises(RuntimeError, match=r"CostModelFeedback reads the training sampler's plan, and no "
                                           r"lit_balance.BalancedBatchSampler was handed to the Trainer: .*"
                                           r"use_training_sampler\(self.trainer, sampler\)"):
        feedback.on_train_start(trainer, MODULE)
    assert feedback.last_fit is None and trainer.train_dataloader.sampler.calls == []


def test_no_fit_from_too_few_timings_leaves_the_sampler_alone():
    sampler = RecordingSampler()
    monitor = StragglerMonitor()
    feedback = CostModelFeedback(min_samples=8)
    trainer, _ = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    monitor.epoch_windows = [synthetic_window([1.0, 1.0], n=4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feedback.on_train_epoch_end(trainer, MODULE)
    assert sampler.calls == [] and any("no fit this epoch" in str(w.message) for w in caught)


def test_later_fits_are_smoothed_with_the_previous_ones():
    sampler = RecordingSampler()
    monitor = StragglerMonitor()
    feedback = CostModelFeedback(smoothing=0.5)
    trainer, _ = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    for speeds in ([1.0, 0.5], [1.0, 0.7]):
        monitor.epoch_windows = [synthetic_window(speeds)]
        feedback.on_train_epoch_end(trainer, MODULE)
    assert sampler.calls[0][1] == pytest.approx([1.0, 0.5])  # the first fit is taken as it is
    assert sampler.calls[1][1] == pytest.approx([1.0, 0.6])
    assert sampler.calls[1][0].linear == pytest.approx(2e-5, rel=1e-5)
    with pytest.raises(ValueError, match="smoothing"):
        CostModelFeedback(smoothing=1.0)


def test_speeds_need_the_trainer_to_reload_the_train_dataloader():
    monitor = StragglerMonitor()
    feedback = CostModelFeedback()
    trainer, _ = make_trainer(world_size=2, sampler=RecordingSampler(), callbacks=[monitor, feedback],
                              reload_dataloaders_every_n_epochs=0)
    with pytest.raises(RuntimeError, match=r"reload_dataloaders_every_n_epochs is 0: pass Trainer\(reload_"):
        feedback.on_train_start(trainer, MODULE)
    CostModelFeedback(fit_speeds=False).on_train_start(trainer, MODULE)  # the cost model alone keeps the length


@pytest.mark.parametrize("tolerance, handed", [(0.05, [1.0, 1.0, 1.0]), (0.0, [1.0, 0.97, 0.99])])
def test_speeds_within_the_tolerance_are_planned_as_equal(tolerance, handed):
    sampler = RecordingSampler()
    monitor = StragglerMonitor()
    feedback = CostModelFeedback(speed_tolerance=tolerance)
    trainer, logger = make_trainer(world_size=3, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    monitor.epoch_windows = [synthetic_window([1.0, 0.97, 0.99])]
    feedback.on_train_epoch_end(trainer, MODULE)
    assert sampler.calls[-1][1] == pytest.approx(handed, rel=1e-6)
    assert logger.calls[-1][1]["balance/rank_speed_rank1"] == pytest.approx(0.97, rel=1e-6)  # the fitted value
    # a gap beyond the tolerance is planned as measured
    monitor.epoch_windows = [synthetic_window([1.0, 0.9, 1.0])]
    fresh = CostModelFeedback(speed_tolerance=tolerance, smoothing=0.0)
    fresh.on_train_start(trainer, MODULE)
    fresh.on_train_epoch_end(trainer, MODULE)
    assert sampler.calls[-1][1] == pytest.approx([1.0, 0.9, 1.0], rel=1e-6)


@pytest.mark.parametrize(("bad", "error", "match"), [
    (-0.1, ValueError, r"speed_tolerance must be a finite number in \[0, 1\), got -0.1"),
    (1.0, ValueError, r"speed_tolerance must be a finite number in \[0, 1\), got 1.0"),
    (True, TypeError, r"speed_tolerance must be a real number in \[0, 1\), got True of type bool"),
    ("0.05", TypeError, r"speed_tolerance must be a real number in \[0, 1\), got '0.05' of type str"),
])
def test_speed_tolerance_is_checked(bad, error, match):
    with pytest.raises(error, match=match):
        CostModelFeedback(speed_tolerance=bad)


class ThreadedStrategy:
    """all_gather and broadcast between ranks that run in threads of this process, through a barrier."""

    def __init__(self, rank, exchange):
        self.rank, self.exchange = rank, exchange
        self.distributed_sampler_kwargs = {"num_replicas": len(exchange[0]), "rank": rank}

    def _swap(self, value):
        slots, barrier = self.exchange
        slots[self.rank] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()  # nobody writes the next value before everyone has read this one
        return out

    def all_gather(self, tensor):
        return torch.stack(self._swap(tensor.clone()))

    def broadcast(self, obj, src=0):
        return self._swap(obj)[src]


def test_feedback_at_least_halves_the_straggler_gap():
    # The loop of recipes/straggler_feedback.py on two simulated ranks (threads) with fixed clocks: a micro-batch of
    # rows x L takes exactly true_cost.batch_cost(rows, L) * slowdown[r] seconds. Epoch 0 is planned on padded slots
    # with equal ranks; CostModelFeedback fits seconds and speeds and the sampler plans epoch 1 with them. The costs are
    # powers of two and the slowdown 1.5, so every clock reading, difference and sum is exact in float64.
    true_cost = CostModel(linear=2.0**-20, quadratic=2.0**-30, per_batch=2.0**-14)
    slowdown, max_tokens = (1.0, 1.5), 1024
    lengths = np.minimum(np.load(LENGTHS)[:600].astype(np.int64), max_tokens)
    exchange = ([None, None], threading.Barrier(2, timeout=60))
    results, errors = [None, None], []

    def run_rank(rank):
        clock = Clock()
        sampler = BalancedBatchSampler(lengths, max_tokens, num_replicas=2, rank=rank, seed=0)
        monitor = StragglerMonitor(log_every_n_micro_batches=10_000, clock=clock)  # one window per epoch
        feedback = CostModelFeedback()
        trainer, logger = make_trainer(rank=rank, world_size=2, sampler=sampler, callbacks=[monitor, feedback])
        trainer.strategy = ThreadedStrategy(rank, exchange)
        monitor.setup(trainer, MODULE, "fit")
        feedback.on_train_start(trainer, MODULE)
        seconds, logged = [], []
        for epoch in (0, 1):
            trainer.current_epoch = epoch
            sampler.set_epoch(epoch)
            monitor.on_train_epoch_start(trainer, MODULE)
            total = 0.0
            for i, micro_batch in enumerate(sampler):
                rows, width = len(micro_batch), int(lengths[list(micro_batch)].max())
                b = batch(rows, width, int(lengths[list(micro_batch)].sum()))
                monitor.on_train_batch_start(trainer, MODULE, b, i)
                trainer.profiler.start("run_training_batch")  # Lightning's profiler action of the micro-batch
                took = float(true_cost.batch_cost(rows, width)) * slowdown[rank]
                clock.tick(took)  # forward and loss: the monitor's forward interval, and compute
                total += took
                monitor.on_before_backward(trainer, MODULE, torch.tensor(1.0))
                monitor.on_after_backward(trainer, MODULE)
                trainer.profiler.stop("run_training_batch")
                monitor.on_train_batch_end(trainer, MODULE, None, b, i)
            monitor.on_train_epoch_end(trainer, MODULE)
            feedback.on_train_epoch_end(trainer, MODULE)
            seconds.append(total)
            logged.append(dict(monitor.last_metrics))
            if epoch == 0:
                window, fit = TimingWindow.concatenate(monitor.epoch_windows), feedback.last_fit
        results[rank] = (seconds, logged, window, fit, logger.calls)

    def guarded(rank):
        try:
            run_rank(rank)
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)
            exchange[1].abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    (seconds0, logged, window, fit, calls), (seconds1, logged1, window1, fit1, _) = results
    # every rank gathered the same window, logged the same values and handed its sampler the same fit
    for name in ("forward_s", "backward_s", "rows", "padded_length", "real_tokens", "cost", "compute_s", "other_s"):
        np.testing.assert_array_equal(getattr(window, name), getattr(window1, name))
    assert logged == logged1 and fit == fit1
    # the sampler got the fit of epoch 0's window (the first fit: no smoothing), as logged
    cost, planned = fit
    expected_cost, expected_speeds = fit_cost_and_speeds(window, min_samples=8)
    assert (cost.linear, cost.quadratic, cost.per_batch) == (expected_cost.linear, expected_cost.quadratic,
                                                             expected_cost.per_batch)
    assert planned == pytest.approx(expected_speeds, rel=1e-12, abs=0)
    assert [m["balance/rank_speed_rank1"] for _, m in calls if "balance/rank_speed_rank1" in m][0] == planned[1]
    assert planned[0] == 1.0 and planned[1] == pytest.approx(1 / 1.5, rel=1e-6)  # rank 1 measured 1.5x slower
    gaps = []
    for epoch in (0, 1):
        compute = (seconds0[epoch], seconds1[epoch])
        median = (compute[0] + compute[1]) / 2
        m = logged[epoch]
        assert (m["balance/compute_s_rank0"], m["balance/compute_s_rank1"]) == compute  # the clock's seconds
        assert m["balance/straggler_gap_s"] == max(compute) - median
        assert m["balance/straggler_ratio"] == max(compute) / median
        gaps.append(max(compute) - median)
    before, after = gaps
    # epoch 0: equal shares of padded slots, so rank 1 runs 1.5x its cost; the gap is a fifth of rank 1's time
    assert logged[0]["balance/slowest_rank"] == 1.0 and before > 0.15 * seconds1[0]
    assert after <= 0.5 * before, (before, after)


def test_a_rank_measured_far_slower_is_handed_over_at_the_speed_floor_with_a_warning():
    from lit_balance.sampler.sampler import MIN_RANK_SPEED_RATIO

    sampler = RecordingSampler()
    monitor = StragglerMonitor()
    feedback = CostModelFeedback()
    trainer, logger = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    monitor.epoch_windows = [synthetic_window([1.0, 1e-9])]
    with pytest.warns(RuntimeWarning, match=r"rank 1 .*1e-09.* planned at MIN_RANK_SPEED_RATIO=1e-06"):
        feedback.on_train_epoch_end(trainer, MODULE)
    (cost, speeds), = sampler.calls
    assert speeds == pytest.approx([1.0, MIN_RANK_SPEED_RATIO])
    assert logger.calls[-1][1]["balance/rank_speed_rank1"] == pytest.approx(1e-9, rel=1e-6)  # the fitted value


def test_a_fit_that_is_not_finite_is_not_handed_over(monkeypatch):
    import lit_balance.lightning.callbacks.feedback as feedback_module

    lengths = np.load(LENGTHS)[:200]
    sampler = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0)
    monitor = StragglerMonitor()
    feedback = CostModelFeedback()
    trainer, _ = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    monitor.epoch_windows = [synthetic_window([1.0, 0.5])]
    monkeypatch.setattr(feedback_module, "fit_cost_and_speeds", lambda window, **kw: (COST, [1.0, float("nan")]))
    with pytest.warns(RuntimeWarning, match=r"not finite .*nan.*the sampler keeps its cost model and speeds"):
        feedback.on_train_epoch_end(trainer, MODULE)
    assert feedback.last_fit is None
    sampler.set_epoch(1)  # nothing was handed over for the next epoch: it plans as before
    assert sampler.cost_model == CostModel() and sampler.rank_speeds is None


def test_a_custom_cost_model_stays_of_its_class_across_epochs_and_resume():
    from conftest import RowCost

    true = RowCost(per_token=2e-5, per_row=4e-4, per_batch=3e-3)
    lengths = np.load(LENGTHS)[:200]
    sampler = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0, cost_model=RowCost())
    monitor, feedback = StragglerMonitor(), CostModelFeedback(smoothing=0.0)
    trainer, logger = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    feedback.on_train_start(trainer, MODULE)
    for epoch in (0, 1):
        monitor.epoch_windows = [synthetic_window(cost=true, speeds=[1.0, 0.5], seed=epoch)]
        feedback.on_train_epoch_end(trainer, MODULE)
        sampler.set_epoch(epoch + 1)
        cost, speeds = feedback.last_fit
        assert type(cost) is RowCost and type(sampler.cost_model) is RowCost and sampler.cost_model == cost
        assert (cost.per_token, cost.per_row, cost.per_batch) == pytest.approx(
            (true.per_token, true.per_row, true.per_batch), rel=1e-6)
        assert speeds == pytest.approx([1.0, 0.5], rel=1e-6)
    logged = logger.calls[-1][1]
    assert {k for k in logged if k.startswith("balance/cost_")} == {
        "balance/cost_per_token", "balance/cost_per_row", "balance/cost_per_batch"}
    assert logged["balance/cost_per_row"] == cost.per_row
    # resume: a sampler built with the custom class restores the fitted model, and the feedback refits that class
    resumed = BalancedBatchSampler(lengths, 1024, num_replicas=2, rank=0, cost_model=RowCost())
    resumed.load_state_dict(sampler.state_dict())
    assert type(resumed.cost_model) is RowCost and resumed.cost_model == cost
    again = CostModelFeedback()
    trainer, _ = make_trainer(world_size=2, sampler=resumed, callbacks=[monitor, again])
    again.on_train_start(trainer, MODULE)
    again.on_train_epoch_end(trainer, MODULE)
    assert type(again.last_fit[0]) is RowCost


def test_fit_cost_and_speeds_fits_the_given_class():
    from conftest import RowCost

    true = RowCost(per_token=1e-5, per_row=2e-4, per_batch=1e-3)
    cost, speeds = fit_cost_and_speeds(synthetic_window(cost=true, speeds=[1.0, 0.8]), cost_class=RowCost)
    assert type(cost) is RowCost and cost.per_row == pytest.approx(true.per_row, rel=1e-6)
    assert speeds == pytest.approx([1.0, 0.8], rel=1e-6)
    default, _ = fit_cost_and_speeds(synthetic_window([1.0, 0.8]))
    assert type(default) is CostModel


def test_a_cost_model_class_without_fit_is_refused_at_fit_start_naming_it():
    from conftest import RowCostWithoutFit

    sampler = BalancedBatchSampler(np.load(LENGTHS)[:50], 1024, num_replicas=2, rank=0,
                                   cost_model=RowCostWithoutFit())
    monitor, feedback = StragglerMonitor(), CostModelFeedback()
    trainer, _ = make_trainer(world_size=2, sampler=sampler, callbacks=[monitor, feedback])
    with pytest.raises(TypeError, match=r"RowCostWithoutFit has no fit: add a classmethod fit\(cls, rows, "
                                        r"padded_length, seconds, \*, min_samples\) -> RowCostWithoutFit") as err:
        feedback.on_train_start(trainer, MODULE)
    assert err.value.parameter == "cost_model"
    with pytest.raises(TypeError, match="RowCostWithoutFit has no fit"):
        fit_cost_and_speeds(synthetic_window([1.0, 1.0]), cost_class=RowCostWithoutFit)


def test_a_fit_of_another_shape_fails_on_every_rank_alike():
    from dataclasses import dataclass

    from conftest import RowCost

    @dataclass(frozen=True)
    class Changing(RowCost):
        @classmethod
        def fit(cls, rows, padded_length, seconds, *, min_samples=3):
            return CostModel()  # not a Changing: other to_dict() keys

    sent = []  # what rank 0 broadcasts, handed to rank 1

    def broadcast(obj, src=0):
        if not sent:  # rank 0 sends
            sent.append(obj)
        return sent[0]

    for rank in (0, 1):
        sampler = RecordingSampler(cost_model=Changing())
        monitor, feedback = StragglerMonitor(), CostModelFeedback()
        trainer, _ = make_trainer(rank=rank, world_size=2, sampler=sampler, callbacks=[monitor, feedback])
        trainer.strategy.broadcast = broadcast
        feedback.on_train_start(trainer, MODULE)
        monitor.epoch_windows = [synthetic_window([1.0, 1.0])]
        with pytest.raises(TypeError, match=r"Changing.fit returned a cost model whose to_dict\(\) is not .*'per_row'"):
            feedback.on_train_epoch_end(trainer, MODULE)
        assert sampler.calls == [] and len(sent) == 1
