"""StragglerMonitor: the timed intervals, the gathered window and the exact logged values."""

import warnings

import numpy as np
import pytest
import torch
from conftest import MODULE, batch, make_trainer

from lit_balance.callbacks import StragglerMonitor
from lit_balance.lightning.callbacks.straggler import step_imbalance
from lit_balance.plan.cost import CostModel


FETCH, BATCH = "[_TrainingEpochLoop].train_dataloader_next", "run_training_batch"


def drive(cb, trainer, clock, steps, after=0.0):
    """steps: (data wait s, forward s, backward s, rows, width, real) per micro-batch; ``after``: s after backward (the
    optimizer step). Lightning's profiler actions as the Trainer reports them: the fetch, then the micro-batch."""
    if trainer.profiler.__class__.__name__ != "PhaseClock":
        cb.setup(trainer, MODULE, "fit")
    cb.on_train_epoch_start(trainer, MODULE)
    for i, (wait, fwd, bwd, rows, width, real) in enumerate(steps):
        trainer.profiler.start(FETCH)
        clock.tick(wait)
        trainer.profiler.stop(FETCH)
        b = batch(rows, width, real)
        cb.on_train_batch_start(trainer, MODULE, b, i)
        trainer.profiler.start(BATCH)
        clock.tick(fwd)
        cb.on_before_backward(trainer, MODULE, torch.tensor(1.0))
        clock.tick(bwd)
        cb.on_after_backward(trainer, MODULE)
        clock.tick(after)  # e.g. the optimizer step
        trainer.profiler.stop(BATCH)
        cb.on_train_batch_end(trainer, MODULE, None, b, i)
        trainer.global_step += 1


def payload(records, phases):
    """What a rank contributes to the window's all_gather: its micro-batches (forward s, backward s, rows, padded
    length, real tokens, cost) and its phases (compute, data wait, rank wait, other s)."""
    return torch.tensor([x for r in records for x in r] + list(phases), dtype=torch.float64)


def fake_ddp(require_backward_grad_sync):
    """A DistributedDataParallel instance (not initialised: no process group) with the no_sync flag set."""
    model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    object.__setattr__(model, "require_backward_grad_sync", require_backward_grad_sync)
    return model


def test_window_gathers_micro_batches_and_phases_and_logs_exact_values(clock):
    # rank 1's window: 2 micro-batches, compute 3.0 s, data wait 0.5 s, 10 + 20 real tokens, cost 40 + 40
    nan = float("nan")
    other = payload([[1.0, nan, 2, 20, 10, 40], [2.0, nan, 4, 10, 20, 40]], [3.0, 0.5, 0.25, 0.125])
    trainer, logger = make_trainer(world_size=2, others=lambda local: [other])
    cb = StragglerMonitor(log_every_n_micro_batches=2, clock=clock, cost_model=CostModel())
    # rank 0: compute = forward + backward + optimizer step = (0.5 + 9 + 0.25) + (0.25 + 9 + 0.25)
    drive(cb, trainer, clock, [(0.1, 0.5, 9.0, 2, 8, 12), (0.2, 0.25, 9.0, 3, 4, 10)], after=0.25)
    assert len(logger.calls) == 1
    step, logged = logger.calls[0]
    assert step == 1  # global_step at the start of the window's last micro-batch, the step its loss is logged at
    compute0 = 0.5 + 9.0 + 0.25 + 0.25 + 9.0 + 0.25
    median = (compute0 + 3.0) / 2
    assert logged == {
        "balance/straggler_ratio": compute0 / median,
        "balance/straggler_gap_s": compute0 - median,
        "balance/slowest_rank": 0.0,
        "balance/compute_s_rank0": compute0, "balance/compute_s_rank1": 3.0,
        "balance/data_wait_s_rank0": pytest.approx(0.1 + 0.2), "balance/data_wait_s_rank1": 0.5,
        "balance/rank_wait_s_rank0": 0.0, "balance/rank_wait_s_rank1": 0.25,
        "balance/other_s_rank0": pytest.approx(0.0, abs=1e-12), "balance/other_s_rank1": 0.125,
        "balance/real_tokens_rank0": 22.0, "balance/real_tokens_rank1": 30.0,
        "balance/cost_rank0": 16.0 + 12.0, "balance/cost_rank1": 80.0,
    }
    window = cb.epoch_windows[0]
    assert (window.num_replicas, window.num_micro_batches, window.first_step, window.last_step) == (2, 2, 0, 1)
    np.testing.assert_allclose(window.forward_s[0], [0.5, 0.25])  # forward only, never the 9 s backward
    np.testing.assert_array_equal(window.rows, [[2, 3], [2, 4]])
    np.testing.assert_array_equal(window.real_tokens, [[12, 10], [10, 20]])
    assert np.isnan(window.backward_s[0]).all()  # 2 ranks, no DDP model: the backward may communicate
    assert cb.last_window is window


@pytest.mark.parametrize(("world_size", "model", "expected"), [
    (1, None, [2.0, 3.0]),  # one process: every backward is local
    (2, "no_sync", [2.0, 3.0]),  # DDP inside an accumulation window: no all-reduce in backward
    (2, "sync", [np.nan, np.nan]),  # DDP at the optimizer step: backward waits in the all-reduce
    (2, None, [np.nan, np.nan]),  # another strategy: assumed to communicate
])
def test_backward_is_timed_only_where_it_holds_no_collective(clock, world_size, model, expected):
    trainer, _ = make_trainer(world_size=world_size)
    if model is not None:
        trainer.strategy.model = fake_ddp(require_backward_grad_sync=model == "sync")
    cb = StragglerMonitor(log_every_n_micro_batches=10, clock=clock)
    drive(cb, trainer, clock, [(0.1, 1.0, 2.0, 1, 4, 4), (0.1, 0.5, 3.0, 1, 4, 4)], after=7.0)
    cb.flush(trainer, MODULE)
    window = cb.epoch_windows[0]
    np.testing.assert_array_equal(window.backward_s[0], expected)  # from on_before_backward to on_after_backward
    np.testing.assert_array_equal(window.forward_s[0], [1.0, 0.5])


def test_backwards_add_up_and_one_that_communicates_spoils_the_sum(clock):
    trainer, _ = make_trainer(world_size=2)
    trainer.strategy.model = fake_ddp(require_backward_grad_sync=False)
    cb = StragglerMonitor(log_every_n_micro_batches=10, clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    for i, flags in enumerate([(False, False), (False, True), (False, None)]):
        b = batch(1, 4, 4)
        cb.on_train_batch_start(trainer, MODULE, b, i)
        for sync in flags:  # two backwards per micro-batch (manual optimization); None: never finished
            trainer.strategy.model.require_backward_grad_sync = bool(sync)
            cb.on_before_backward(trainer, MODULE, torch.tensor(1.0))
            clock.tick(1.5)
            if sync is not None:
                cb.on_after_backward(trainer, MODULE)
        cb.on_train_batch_end(trainer, MODULE, None, b, i)
    cb.flush(trainer, MODULE)
    np.testing.assert_array_equal(cb.epoch_windows[0].backward_s[0], [3.0, np.nan, np.nan])


def test_three_ranks_median_and_epoch_end_flush(clock):
    compute = {1: 4.0, 2: 1.0}  # compute seconds of ranks 1 and 2 in the one-batch window

    def others(local):
        return [payload([[1.0, 0.0, 1, 4, 4, 16]], [compute[r], 0.0, 0.0, 0.0]) for r in (1, 2)]

    trainer, logger = make_trainer(world_size=3, others=others)
    cb = StragglerMonitor(log_every_n_micro_batches=10, clock=clock)
    drive(cb, trainer, clock, [(0.0, 2.0, 0.0, 1, 4, 4)])
    assert logger.calls == []
    cb.on_train_epoch_end(trainer, MODULE)  # partial window flushed at epoch end
    m = logger.calls[0][1]
    assert (m["balance/straggler_ratio"], m["balance/straggler_gap_s"], m["balance/slowest_rank"]) == (2.0, 2.0, 1.0)


def test_without_backward_the_interval_ends_at_batch_end(clock):
    trainer, logger = make_trainer()
    cb = StragglerMonitor(log_every_n_micro_batches=1, clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    b = batch(1, 4, 4)
    cb.on_train_batch_start(trainer, MODULE, b, 0)
    clock.tick(0.75)
    cb.on_train_batch_end(trainer, MODULE, None, b, 0)
    assert cb.epoch_windows[0].forward_s[0, 0] == 0.75 and np.isnan(cb.epoch_windows[0].backward_s[0, 0])


def test_warns_when_one_rank_stays_slowest(clock):
    trainer, _ = make_trainer(world_size=2, others=lambda local: [local * 3.0])  # rank 1: 3x rank 0's seconds
    cb = StragglerMonitor(log_every_n_micro_batches=1, warn_after=2, warn_ratio=1.2, clock=clock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drive(cb, trainer, clock, [(0.0, 1.0, 0.0, 1, 4, 4)] * 2)
        assert not [w for w in caught if "slowest" in str(w.message)]
        drive(cb, trainer, clock, [(0.0, 1.0, 0.0, 1, 4, 4)])
        msgs = [str(w.message) for w in caught if "slowest" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith("rank 1 has been the slowest for 3 windows")


def test_step_imbalance_averages_out_over_accumulation():
    # rank 0 is slow on even micro-batches, rank 1 on odd ones: each micro-batch is 2x imbalanced,
    # but steps of 2 micro-batches are perfectly balanced
    c = np.array([[2.0, 1.0] * 4, [1.0, 2.0] * 4])
    assert step_imbalance(c, 1) == pytest.approx(2.0 / 1.5)
    assert step_imbalance(c, 2) == 1.0
    assert step_imbalance(c, 3) == pytest.approx((5 + 5 + 3) / (4.5 + 4.5 + 3))


@pytest.mark.parametrize(("kwargs", "match"), [({"log_every_n_micro_batches": 0}, "log_every_n_micro_batches"),
                                               ({"warn_after": 0}, "warn_after"),
                                               ({"warn_ratio": 0.5}, "warn_ratio")])
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StragglerMonitor(**kwargs)


def _packed_batch(lengths):
    from lit_balance.data.collate import PackedCollator

    return PackedCollator(0)([{"input_ids": np.arange(1, n + 1), "index": i} for i, n in enumerate(lengths)])


@pytest.mark.parametrize("given_to", ["monitor", "sampler"])
def test_cost_column_is_the_custom_cost_models_own_for_padded_and_packed_micro_batches(clock, given_to):
    from conftest import RowCost

    from lit_balance import BalancedBatchSampler
    model = RowCost(per_token=0.5, per_row=8.0, per_batch=3.0)
    sampler = BalancedBatchSampler([4, 6, 9], 64, num_replicas=1, rank=0, cost_model=model)
    trainer, logger = make_trainer(sampler=sampler if given_to == "sampler" else None)
    cb = StragglerMonitor(log_every_n_micro_batches=3, clock=clock,
                          cost_model=model if given_to == "monitor" else None)
    micro_batches = [batch(3, 10, 25), _packed_batch([2, 4, 9]), _packed_batch([7])]
    cb.on_train_epoch_start(trainer, MODULE)
    for i, b in enumerate(micro_batches):
        cb.on_train_batch_start(trainer, MODULE, b, i)
        clock.tick(1.0)
        cb.on_train_batch_end(trainer, MODULE, None, b, i)
    expected = [model.batch_cost(3, 10), model.packed_cost([2, 4, 9]), model.packed_cost([7])]
    np.testing.assert_allclose(cb.epoch_windows[0].cost[0], expected, rtol=1e-12)
    # a fixed cost per row or document: 3 rows of 10 and 3 documents of 15 tokens cost alike, unlike CostModel's
    assert expected == [3.0 + 3 * (8.0 + 5.0), 3.0 + 3 * 8.0 + 0.5 * 15, 3.0 + 8.0 + 3.5]
    assert logger.calls[0][1]["balance/cost_rank0"] == pytest.approx(sum(expected), rel=1e-12)


def test_refuses_an_object_that_is_not_a_cost_model():
    with pytest.raises(TypeError, match=r"cost_model must be a lit_balance.CostModel or None.*lacks") as err:
        StragglerMonitor(cost_model=object())
    assert err.value.parameter == "cost_model"
