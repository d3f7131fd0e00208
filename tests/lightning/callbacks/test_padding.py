"""PaddingRatioMonitor and the PaddingRatio metric: exact logged values with a patched clock and fake ranks."""

import pytest
import torch
from conftest import MODULE, batch, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.callbacks import PaddingRatioMonitor
from lit_balance.lightning.metrics import PaddingRatio


def test_logs_global_and_per_rank_ratios_and_tokens_per_second(clock):
    # rank 1 reports [real, padded, real since last log, elapsed] = [30, 40, 30, 4.0] at the first log
    other = torch.tensor([30.0, 40.0, 30.0, 4.0], dtype=torch.float64)
    trainer, logger = make_trainer(rank=0, world_size=2, others=lambda local: [other])
    cb = PaddingRatioMonitor(log_every_n_micro_batches=2, clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    clock.tick(1.0)
    cb.on_train_batch_end(trainer, MODULE, None, batch(2, 10, 15), 0)
    assert logger.calls == []
    clock.tick(2.0)
    cb.on_train_batch_end(trainer, MODULE, None, batch(1, 10, 5), 1)
    # rank 0: 20 real of 30 padded; rank 1: 30 of 40; all: 50 of 70; 50 real tokens in max(3 s, 4 s)
    assert logger.calls == [(0, {
        "balance/padding_ratio": 1 - 50 / 70,
        "balance/padding_ratio_rank0": 1 - 20 / 30,
        "balance/padding_ratio_rank1": 1 - 30 / 40,
        "balance/real_tokens_per_s": 50 / 4.0,
    })]
    assert float(trainer.callback_metrics["balance/padding_ratio"]) == pytest.approx(1 - 50 / 70)
    # epoch end logs what is left; a new epoch starts from zero
    clock.tick(1.0)
    cb.on_train_batch_end(trainer, MODULE, None, batch(1, 8, 8), 2)
    cb.on_train_epoch_end(trainer, MODULE)
    assert logger.calls[-1][1]["balance/padding_ratio_rank0"] == 1 - 28 / 38
    assert logger.calls[-1][1]["balance/real_tokens_per_s"] == (8 + 30) / 4.0
    cb.on_train_epoch_start(trainer, MODULE)
    assert float(cb.metric.padded_tokens) == 0


def test_only_rank_zero_writes_but_every_rank_gathers(clock):
    trainer, logger = make_trainer(rank=1, world_size=2)
    cb = PaddingRatioMonitor(log_every_n_micro_batches=1, clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    cb.on_train_batch_end(trainer, MODULE, None, batch(1, 4, 4), 0)
    assert logger.calls == [] and trainer.strategy.gathers == 1
    assert cb.last_metrics["balance/padding_ratio"] == 0.0


def test_uses_the_trainer_interval_by_default(clock):
    trainer, logger = make_trainer(log_every_n_steps=3)
    cb = PaddingRatioMonitor(clock=clock)
    cb.on_train_epoch_start(trainer, MODULE)
    for i in range(7):
        cb.on_train_batch_end(trainer, MODULE, None, batch(1, 4, 3), i)
    assert len(logger.calls) == 2


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_rejects_bad_interval(bad, error):
    with pytest.raises(error, match="log_every_n_micro_batches"):
        PaddingRatioMonitor(log_every_n_micro_batches=bad)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=20), st.integers(1, 4))
def test_metric_is_the_ratio_of_sums_whatever_the_split(pairs, ranks):
    pairs = [(min(a, b), max(a, b)) for a, b in pairs]
    metrics = [PaddingRatio() for _ in range(ranks)]
    for i, (real, padded) in enumerate(pairs):
        metrics[i % ranks].update(real, padded)
    # what dist_reduce_fx="sum" does across ranks: add the states
    merged = PaddingRatio()
    merged.real_tokens = sum(m.real_tokens for m in metrics)
    merged.padded_tokens = sum(m.padded_tokens for m in metrics)
    total_real, total_padded = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    expected = 1 - total_real / total_padded if total_padded else 0.0
    assert float(merged.compute()) == pytest.approx(expected, abs=1e-12)
    assert 0.0 <= float(merged.compute()) <= 1.0


def test_metric_states_reduce_by_sum_and_reject_bad_counts():
    m = PaddingRatio()
    assert m._reductions["real_tokens"].__name__ == "dim_zero_sum"
    assert float(m.compute()) == 0.0
    with pytest.raises(ValueError, match="num_real_tokens=5, num_padded_tokens=4"):
        m.update(5, 4)
    m.update(torch.tensor([3, 1]), torch.tensor([4, 4]))
    assert float(m.compute()) == 0.5
