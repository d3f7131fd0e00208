"""AdaptiveGradAccumulation: aligned changes only, the same decision from the plan on every rank, hysteresis,
the straggler input, refusals."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import MODULE, batch, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.callbacks import AdaptiveGradAccumulation, StragglerMonitor, TimingWindow
from lit_balance.lightning.callbacks.accumulation import plan_step_tokens
from lit_balance import BalancedBatchSampler


class ScriptedPlan(BalancedBatchSampler):
    """A training sampler whose plan totals are scripted: rank r runs tokens_per_rank[s][r] real tokens at micro-step
    s (what :meth:`BalancedBatchSampler.micro_step_totals` answers, the one thing the callback asks of the plan)."""

    def __init__(self, tokens_per_rank):
        t = np.asarray(tokens_per_rank, dtype=np.int64)
        super().__init__(t.reshape(-1), int(t.max()), num_replicas=t.shape[1], rank=0)
        self._totals = t.sum(axis=1)

    def micro_step_totals(self):
        return self._totals.copy(), np.full(self._totals.shape, self.num_replicas, dtype=np.int64)


def fake_sampler(tokens_per_rank):
    """A sampler whose plan gives rank r, at micro-step s, one row of tokens_per_rank[s][r] tokens."""
    return ScriptedPlan(tokens_per_rank)


def run_epoch(cb, trainer, n, real=10):
    """Lightning 2.6's rule, step by step: zero_grad when batch_idx % acc == 0, step when
    (batch_idx + 1) % acc == 0 or at the last batch. Returns [(zeroed, stepped, acc)] per batch."""
    out = []
    trainer.num_training_batches = n
    for b in range(n):
        cb.on_train_batch_start(trainer, MODULE, batch(1, real, real), b)
        acc = trainer.accumulate_grad_batches
        out.append((b % acc == 0, (b + 1) % acc == 0 or b + 1 == n, acc))
        cb.on_train_batch_end(trainer, MODULE, None, batch(1, real, real), b)
    return out


def check_aligned(events):
    """Every window opens with zero_grad right after a step, closes with a step, and has acc micro-batches."""
    start = 0
    for b, (zeroed, stepped, acc) in enumerate(events):
        assert zeroed == (b == start), f"batch {b}: zero_grad {zeroed}, window opened at {start}"
        assert events[start][2] == acc, "accumulate_grad_batches changed inside a window"
        if stepped:
            assert b + 1 - start == acc or b + 1 == len(events)
            start = b + 1
    assert start == len(events)


def test_sets_the_value_from_the_plan_and_logs_every_step():
    sampler = fake_sampler([[50, 50]] * 12)  # 100 global real tokens per micro-step
    cb = AdaptiveGradAccumulation(target_tokens_per_step=400)
    trainer, logger = make_trainer(world_size=2, sampler=sampler, callbacks=[cb])
    cb.on_train_start(trainer, MODULE)
    events = run_epoch(cb, trainer, 12)
    check_aligned(events)
    assert cb.history == [(0, 0, 4, 400), (0, 4, 4, 400), (0, 8, 4, 400)]
    assert [m for _, m in logger.calls] == [
        {"balance/accumulate_grad_batches": 4.0, "balance/tokens_per_optimizer_step": 400.0}] * 3
    cb.on_train_end(trainer, MODULE)
    assert trainer.accumulate_grad_batches == 1  # the Trainer's value is restored


def test_a_change_waits_for_an_aligned_window_start_and_the_epoch_end_flush_is_short():
    # 100 tokens per micro-step for 10 steps, then 25: wants 4, then 16 (only at a multiple of 16)
    tokens = [[50, 50]] * 10 + [[10, 15]] * 27
    cb = AdaptiveGradAccumulation(target_tokens_per_step=400, lookahead=1)
    trainer, _ = make_trainer(world_size=2, sampler=fake_sampler(tokens), callbacks=[cb])
    cb.on_train_start(trainer, MODULE)
    events = run_epoch(cb, trainer, len(tokens))
    check_aligned(events)
    starts = [(s, acc) for _, s, acc, _ in cb.history]
    # 12 and 16 are window starts of 4; 16 is the first that is a multiple of 16; the last window is cut short
    assert starts == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 16), (32, 5)]
    assert cb.history[-1][3] == 5 * 25


def test_hysteresis_keeps_the_value_when_tokens_wobble():
    rng = np.random.default_rng(0)
    tokens = [[int(x), int(y)] for x, y in rng.integers(30, 71, size=(64, 2))]  # ~100 per micro-step
    values = {}
    for tolerance in (0.0, 0.6):
        cb = AdaptiveGradAccumulation(target_tokens_per_step=200, lookahead=1, tolerance=tolerance)
        trainer, _ = make_trainer(world_size=2, sampler=fake_sampler(tokens), callbacks=[cb])
        cb.on_train_start(trainer, MODULE)
        check_aligned(run_epoch(cb, trainer, 64))
        values[tolerance] = [acc for _, _, acc, _ in cb.history[:-1]]
    assert len(set(values[0.0])) > 1  # without hysteresis it follows every wobble it can align with
    assert len(set(values[0.6])) == 1 and values[0.6][0] == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=80), st.integers(1, 2000), st.integers(1, 8),
       st.floats(0, 0.9))
def test_windows_stay_aligned_for_any_plan(tokens, target, lookahead, tolerance):
    cb = AdaptiveGradAccumulation(target_tokens_per_step=target, lookahead=lookahead, tolerance=tolerance,
                                  max_accumulate_grad_batches=16)
    trainer, _ = make_trainer(sampler=fake_sampler([[t] for t in tokens]), callbacks=[cb])
    cb.on_train_start(trainer, MODULE)
    check_aligned(run_epoch(cb, trainer, len(tokens)))
    assert sum(t for *_, t in cb.history) == sum(tokens)
    assert sum(acc for _, _, acc, _ in cb.history) == len(tokens)


def test_two_ranks_decide_alike_without_communication():
    tokens = np.random.default_rng(1).integers(5, 80, size=(50, 2)).tolist()
    histories = []
    for rank in (0, 1):
        cb = AdaptiveGradAccumulation(target_tokens_per_step=300, lookahead=3, tolerance=0.0)
        trainer, _ = make_trainer(rank=rank, world_size=2, sampler=fake_sampler(tokens), callbacks=[cb])
        cb.on_train_start(trainer, MODULE)
        run_epoch(cb, trainer, 50, real=10 + 50 * rank)  # what each rank saw locally does not matter
        histories.append(cb.history)
    assert histories[0] == histories[1] and len({h[2] for h in histories[0]}) > 1


def test_straggler_timings_raise_accumulation_until_imbalance_averages_out():
    # per micro-batch, one rank is 3x slower, alternating: steps of 1 are 1.5x imbalanced, steps of 2 balanced
    compute = np.array([[3.0, 1.0] * 8, [1.0, 3.0] * 8])
    cb = AdaptiveGradAccumulation(target_tokens_per_step=100, target_straggler_ratio=1.05)
    assert cb.wanted(100.0) == 1
    assert cb.wanted(100.0, compute) == 2
    assert cb.wanted(50.0, compute) == 2  # k_tok = 2 already balanced
    capped = AdaptiveGradAccumulation(target_tokens_per_step=100, target_straggler_ratio=1.05, max_overshoot=1.0)
    assert capped.wanted(100.0, compute) == 1
    # through the hooks: the monitor's last window is the input, and the change is logged
    monitor = StragglerMonitor(log_every_n_micro_batches=16)
    monitor.last_window = TimingWindow(forward_s=compute, rows=compute, padded_length=compute)
    cb = AdaptiveGradAccumulation(target_tokens_per_step=100, target_straggler_ratio=1.05)
    trainer, logger = make_trainer(world_size=2, sampler=fake_sampler([[50, 50]] * 8), callbacks=[monitor, cb])
    cb.on_train_start(trainer, MODULE)
    check_aligned(run_epoch(cb, trainer, 8))
    assert [acc for _, _, acc, _ in cb.history] == [2, 2, 2, 2]
    assert logger.calls[0][1]["balance/tokens_per_optimizer_step"] == 200.0
    # by default straggler timings are ignored (Lightning's per-micro-batch broadcast keeps them from averaging out)
    default = AdaptiveGradAccumulation(target_tokens_per_step=100)
    assert default.target_straggler_ratio is None and default.wanted(100.0, compute) == 1
    trainer, _ = make_trainer(world_size=2, sampler=fake_sampler([[50, 50]] * 8), callbacks=[monitor, default])
    default.on_train_start(trainer, MODULE)
    check_aligned(run_epoch(default, trainer, 8))
    assert [acc for _, _, acc, _ in default.history] == [1] * 8


def test_without_a_training_sampler_handed_over_it_all_reduces_the_tokens_seen():
    cb = AdaptiveGradAccumulation(target_tokens_per_step=60)
    trainer, _ = make_trainer(world_size=2, sampler=None, callbacks=[cb])  # e.g. a DataLoader of another sampler
    cb.on_train_start(trainer, MODULE)
    check_aligned(run_epoch(cb, trainer, 6))  # 10 tokens per rank per micro-batch: 20 global (fake reduce x2)
    assert cb.history[0] == (0, 0, 1, 20)  # nothing known before the first step
    # 60 / 20 = 3, taken at the first window start that is a multiple of 3
    assert cb.history == [(0, 0, 1, 20), (0, 1, 1, 20), (0, 2, 1, 20), (0, 3, 3, 60)]


def test_refuses_what_it_cannot_drive():
    cb = AdaptiveGradAccumulation(target_tokens_per_step=100)
    trainer, _ = make_trainer(callbacks=[cb])
    with pytest.raises(RuntimeError, match="manual optimization"):
        cb.on_train_start(trainer, SimpleNamespace(automatic_optimization=False))
    trainer.strategy.handles_gradient_accumulation = True
    with pytest.raises(RuntimeError, match="manages gradient accumulation itself"):
        cb.on_train_start(trainer, MODULE)
    trainer, _ = make_trainer(callbacks=[cb])
    trainer.accumulate_grad_batches = 4
    with pytest.raises(ValueError, match=r"Trainer\(accumulate_grad_batches=4\)"):
        cb.on_train_start(trainer, MODULE)
    trainer, _ = make_trainer(callbacks=[cb, AdaptiveGradAccumulation(target_tokens_per_step=5)])
    with pytest.raises(RuntimeError, match="keep only one"):
        cb.on_train_start(trainer, MODULE)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"target_tokens_per_step": 0}, ValueError, "target_tokens_per_step"),
    ({"target_tokens_per_step": 1.5}, TypeError, "target_tokens"),
    ({"target_tokens_per_step": 8, "tolerance": 1.0}, ValueError, "tolerance"),
    ({"target_tokens_per_step": 8, "max_overshoot": 0.5}, ValueError, "max_overshoot"),
    ({"target_tokens_per_step": 8, "target_straggler_ratio": 0.9}, ValueError, "target_straggler_ratio"),
])
def test_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdaptiveGradAccumulation(**kwargs)


def test_plan_step_tokens_sum_every_ranks_real_tokens_per_micro_step_without_fill_rows():
    lengths = [200, 190, 180, 170]  # one document per micro-batch: 4 micro-batches on 3 ranks, two of them fill rows
    samplers = [BalancedBatchSampler(lengths, 256, num_replicas=3, rank=r, seed=2) for r in range(3)]
    plan = samplers[0].plan()
    assert plan.is_fill.any()  # the plan fills some rows: they carry no real tokens
    want = np.zeros(len(samplers[0]), dtype=np.int64)
    for sampler in samplers:
        for t, micro_batch in enumerate(sampler):
            want[t] += sum(lengths[i] for i, fill in zip(micro_batch, micro_batch.is_fill) if not fill)
    assert all(plan_step_tokens(s).tolist() == want.tolist() for s in samplers)  # the same on every rank
    assert plan_step_tokens(None) is None  # no sampler, no plan


def test_state_dict_restores_the_value_in_use():
    cb = AdaptiveGradAccumulation(target_tokens_per_step=400)
    trainer, _ = make_trainer(world_size=2, sampler=fake_sampler([[50, 50]] * 8), callbacks=[cb])
    cb.on_train_start(trainer, MODULE)
    run_epoch(cb, trainer, 4)
    state = cb.state_dict()
    assert state == {"version": 1, "accumulate_grad_batches": 4}
    fresh = AdaptiveGradAccumulation(target_tokens_per_step=400)
    fresh.load_state_dict(state)
    trainer, _ = make_trainer(world_size=2, sampler=fake_sampler([[50, 50]] * 8), callbacks=[fresh])
    fresh.on_train_start(trainer, MODULE)
    assert trainer.accumulate_grad_batches == 4
    with pytest.raises(ValueError, match="expected keys"):
        fresh.load_state_dict({"accumulate_grad_batches": 4})


def _resumed_on_one_rank(lengths, cut, accumulate=1):
    """Samplers of 2 ranks stopped after ``cut`` micro-batches, and the rest re-planned on 1 rank."""
    from lit_balance import BalancedBatchSampler

    before = [BalancedBatchSampler(lengths, 256, num_replicas=2, rank=r, seed=1,
                                   accumulate_grad_batches=accumulate) for r in (0, 1)]
    head = [[b for b, _ in zip(s, range(cut))] for s in before]
    after = BalancedBatchSampler(lengths, 256, num_replicas=1, rank=0, seed=1, accumulate_grad_batches=accumulate)
    after.load_state_dict(before[0].state_dict(batches_consumed=cut))
    steps = [list(step) for step in zip(*head)] + [[b] for b in after]
    tokens = [int(sum(after.lengths[i] for b in step for i, f in zip(b, b.is_fill) if not f)) for step in steps]
    return after, steps, tokens


LENGTHS = [5 + (i * 37) % 120 for i in range(60)]


def test_plan_step_tokens_after_a_resume_on_other_ranks_counts_from_the_epoch_start():
    sampler, _, tokens = _resumed_on_one_rank(LENGTHS, cut=3)
    assert plan_step_tokens(sampler).tolist() == tokens  # micro-steps 0..2 ran on the 2 old ranks


def test_a_resume_inside_a_window_closes_that_window_where_lightning_does():
    sampler, steps, tokens = _resumed_on_one_rank(LENGTHS, cut=3)
    cb = AdaptiveGradAccumulation(target_tokens_per_step=10**9, max_accumulate_grad_batches=2)
    cb.load_state_dict({"version": 1, "accumulate_grad_batches": 2})
    trainer, _ = make_trainer(sampler=sampler, callbacks=[cb], num_training_batches=len(sampler))
    cb.on_train_start(trainer, MODULE)
    for b in range(3, len(sampler)):  # Lightning resumes at batch_idx 3, inside the window [2, 4)
        mb = steps[b][0]
        real = int(sum(sampler.lengths[mb]))
        cb.on_train_batch_start(trainer, MODULE, batch(len(mb), real, real), b)
        cb.on_train_batch_end(trainer, MODULE, None, batch(len(mb), real, real), b)
    n = len(sampler)
    expected = [(0, 2, 2, tokens[2] + tokens[3])] + [
        (0, lo, min(2, n - lo), sum(tokens[lo:lo + 2])) for lo in range(4, n, 2)]
    assert cb.history == expected
