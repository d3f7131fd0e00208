"""The callbacks on packed micro-batches: zero padding, per-document costs, fitted per-document coefficients."""

import numpy as np
import pytest
import torch
from conftest import MODULE, make_trainer

from lit_balance.callbacks import CostModelFeedback, PaddingRatioMonitor, StragglerMonitor
from lit_balance.lightning.callbacks.feedback import fit_cost_and_speeds
from lit_balance.lightning.callbacks.straggler import TimingWindow, packed_rows_and_length
from lit_balance.data.collate import PackedCollator
from lit_balance.plan.cost import CostModel


def packed(lengths, multiple=1):
    return PackedCollator(0, pad_to_multiple_of=multiple)(
        [{"input_ids": np.arange(1, n + 1), "index": i} for i, n in enumerate(lengths)])


def test_packed_rows_and_length_give_the_per_document_cost_under_any_cost_model():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 300, size=rng.integers(1, 20))
        rows, length = packed_rows_and_length(np.concatenate([[0], np.cumsum(lengths)]))
        cost = CostModel(linear=float(rng.random()), quadratic=float(rng.random()), per_batch=float(rng.random()))
        expected = cost.per_batch + float(cost.row_cost(lengths).sum())
        assert cost.batch_cost(rows, length) == pytest.approx(expected, rel=1e-12)
    assert packed_rows_and_length(torch.tensor([0, 7], dtype=torch.int32)) == (1.0, 7.0)


def test_straggler_monitor_records_packed_micro_batches_by_their_documents(clock):
    trainer, logger = make_trainer()
    cb = StragglerMonitor(log_every_n_micro_batches=2, clock=clock, cost_model=CostModel(linear=1.0, quadratic=0.5))
    cb.on_train_epoch_start(trainer, MODULE)
    for i, lengths in enumerate([[2, 4], [3]]):
        b = packed(lengths)
        cb.on_train_batch_start(trainer, MODULE, b, i)
        clock.tick(1.0)
        cb.on_train_batch_end(trainer, MODULE, None, b, i)
    window = cb.epoch_windows[0]
    np.testing.assert_allclose(window.rows[0], [36 / 20, 1.0])
    np.testing.assert_allclose(window.padded_length[0], [20 / 6, 3.0])
    # cost = linear * sum(l) + quadratic * sum(l^2): (6 + 10) and (3 + 4.5), not rows x width of one row
    np.testing.assert_allclose(window.cost[0], [16.0, 7.5])
    assert logger.calls[0][1]["balance/cost_rank0"] == pytest.approx(23.5)
    assert logger.calls[0][1]["balance/real_tokens_rank0"] == 9.0


def test_feedback_fits_per_document_coefficients_from_packed_timings():
    """Seconds of packed micro-batches = per_batch + linear * sum(l) + quadratic * sum(l^2), rank 1 half as fast."""
    true = CostModel(linear=2e-4, quadratic=3e-6, per_batch=0.01)
    rng = np.random.default_rng(1)
    speeds = [1.0, 0.5]
    window = np.zeros((2, 60, 7))
    for r, speed in enumerate(speeds):
        for i in range(60):
            lengths = rng.integers(1, 400, size=rng.integers(1, 12))
            rows, length = packed_rows_and_length(np.concatenate([[0], np.cumsum(lengths)]))
            seconds = (true.per_batch + float(true.row_cost(lengths).sum())) / speed
            window[r, i] = [seconds, 0.0, rows, length, lengths.sum(), 0.0, np.nan]
    cost, fitted = fit_cost_and_speeds(TimingWindow(forward_s=window[:, :, 0], rows=window[:, :, 2],
                                                    padded_length=window[:, :, 3], real_tokens=window[:, :, 4]))
    assert cost.linear == pytest.approx(true.linear, rel=1e-6)
    assert cost.quadratic == pytest.approx(true.quadratic, rel=1e-6)
    assert cost.per_batch == pytest.approx(true.per_batch, rel=1e-6)
    assert fitted == pytest.approx(speeds, rel=1e-6)
    assert isinstance(CostModelFeedback(), CostModelFeedback)


@pytest.mark.parametrize(("multiple", "ratio"), [(1, 0.0), (8, 1 - 15 / 16)])
def test_padding_monitor_reports_zero_padding_for_packed_rows(clock, multiple, ratio):
    trainer, logger = make_trainer(world_size=2)
    cb = PaddingRatioMonitor(log_every_n_micro_batches=1, clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    b = packed([5, 3, 7], multiple)  # 15 real tokens; with multiple 8 the row is 16 slots
    clock.tick(1.0)
    cb.on_train_batch_end(trainer, MODULE, None, b, 0)
    logged = logger.calls[0][1]
    assert logged["balance/padding_ratio"] == pytest.approx(ratio, abs=0)
    assert logged["balance/padding_ratio_rank0"] == logged["balance/padding_ratio_rank1"] == pytest.approx(ratio, abs=0)
    assert logged["balance/real_tokens_per_s"] == 30.0
