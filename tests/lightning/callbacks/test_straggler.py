"""StragglerMonitor: the timed intervals, the gathered window and the exact logged values."""

import warnings

import numpy as np
import pytest
import torch
from conftest import MODULE, batch, make_trainer

from lit_balance.callbacks import StragglerMonitor
from lit_balance.lightning.callbacks.straggler import step_imbalance
from lit_balance.plan.cost import CostModel


def drive(cb, trainer, clock, steps, after=0.0):
    """steps: (data wait s, forward s, backward s, rows, width, real) per micro-batch; ``after``: s after backward."""
    cb.on_train_epoch_start(trainer, MODULE)
    for i, (wait, fwd, bwd, rows, width, real) in enumerate(steps):
        clock.tick(wait)
        b = batch(rows, width, real)
        cb.on_train_batch_start(trainer, MODULE, b, i)
        clock.tick(fwd)
        cb.on_before_backward(trainer, MODULE, torch.tensor(1.0))
        clock.tick(bwd)  # backward, where DDP's all-reduce waits: not counted in compute
        cb.on_after_backward(trainer, MODULE)
        clock.tick(after)  # e.g. the optimizer step: counted nowhere
        cb.on_train_batch_end(trainer, MODULE, None, b, i)


def fake_ddp(require_backward_grad_sync):
    """A DistributedDataParallel instance (not initialised: no process group) with the no_sync flag set."""
    model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    object.__setattr__(model, "require_backward_grad_sync", require_backward_grad_sync)
    return model


def test_window_gathers_forward_time_and_data_wait_and_logs_exact_values(clock):
    # rank 1's window: 2 micro-batches, compute 1.0 + 2.0 s, data wait 0.5 s, 10 + 20 real tokens, cost 40 + 40
    nan = float("nan")
    other = torch.tensor([[1.0, 0.25, 2, 20, 10, 40, nan], [2.0, 0.25, 4, 10, 20, 40, nan]], dtype=torch.float64)
    trainer, logger = make_trainer(world_size=2, others=lambda local: [other])
    cb = StragglerMonitor(log_every_n_micro_batches=2, clock=clock, cost_model=CostModel())
    drive(cb, trainer, clock, [(0.1, 0.5, 9.0, 2, 8, 12), (0.2, 0.25, 9.0, 3, 4, 10)])
    assert len(logger.calls) == 1
    # rank 0: 0.75 s compute, rank 1: 3.0 s; median of two = their mean 1.875
    assert logger.calls[0][1] == {
        "balance/straggler_ratio": 3.0 / 1.875,
        "balance/straggler_gap_s": 3.0 - 1.875,
        "balance/slowest_rank": 1.0,
        "balance/compute_s_rank0": 0.75, "balance/compute_s_rank1": 3.0,
        "balance/data_wait_s_rank0": pytest.approx(0.1 + 0.2), "balance/data_wait_s_rank1": 0.5,
        "balance/real_tokens_rank0": 22.0, "balance/real_tokens_rank1": 30.0,
        "balance/cost_rank0": 16.0 + 12.0, "balance/cost_rank1": 80.0,
    }
    window = cb.epoch_windows[0]
    assert window.shape == (2, 2, 7)
    np.testing.assert_allclose(window[0, :, 0], [0.5, 0.25])  # forward only, never the 9 s backward
    assert np.isnan(window[0, :, 6]).all()  # 2 ranks, no DDP model: the backward may communicate
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
    np.testing.assert_array_equal(window[0, :, 6], expected)  # from on_before_backward to on_after_backward only
    np.testing.assert_array_equal(window[0, :, 0], [1.0, 0.5])


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
    np.testing.assert_array_equal(cb.epoch_windows[0][0, :, 6], [3.0, np.nan, np.nan])


def test_three_ranks_median_and_epoch_end_flush(clock):
    rows = {1: 4.0, 2: 1.0}  # compute seconds of ranks 1 and 2 in the one-batch window

    def others(local):
        out = []
        for r in (1, 2):
            t = local.clone()
            t[:, 0] = rows[r]
            out.append(t)
        return out

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
    assert logger.calls[0][1]["balance/compute_s_rank0"] == 0.75


def test_warns_when_one_rank_stays_slowest(clock):
    trainer, _ = make_trainer(world_size=2, others=lambda local: [local * torch.tensor([3.0, 1, 1, 1, 1, 1, 1])])
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
    from lit_balance.lightning.callbacks.straggler import COST

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
    np.testing.assert_allclose(cb.epoch_windows[0][0, :, COST], expected, rtol=1e-12)
    # a fixed cost per row or document: 3 rows of 10 and 3 documents of 15 tokens cost alike, unlike CostModel's
    assert expected == [3.0 + 3 * (8.0 + 5.0), 3.0 + 3 * 8.0 + 0.5 * 15, 3.0 + 8.0 + 3.5]
    assert logger.calls[0][1]["balance/cost_rank0"] == pytest.approx(sum(expected), rel=1e-12)


def test_refuses_an_object_that_is_not_a_cost_model():
    with pytest.raises(TypeError, match=r"cost_model must be a lit_balance.CostModel or None.*lacks") as err:
        StragglerMonitor(cost_model=object())
    assert err.value.parameter == "cost_model"
