"""TokensPerStepAccumulation's per-micro-batch accumulate_grad_batches against Lightning 2.6's rules."""

import pytest
from hypothesis import given, strategies as st

from lit_balance.lightning.callbacks.step_tokens import TokensPerStepAccumulation, window_accumulation


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12))
def test_lightning_zeroes_at_each_step_start_and_steps_at_each_end(steps):
    start = 0
    for k in steps:
        for b in range(start, start + k):
            value, zero_here = window_accumulation(b, start, start + k)
            assert value >= 1
            lightning_zeroes = b % value == 0  # optimization/automatic.py: is_first_batch_to_accumulate
            lightning_steps = (b + 1) % value == 0  # training_epoch_loop: current.ready % value == 0
            assert not (zero_here and lightning_zeroes)
            assert (lightning_zeroes or zero_here) == (b == start)
            assert lightning_steps == (b == start + k - 1)
        start += k


def test_refuses_another_sampler():
    with pytest.raises(ValueError, match="TokensPerStepSampler"):
        TokensPerStepAccumulation(sampler=[1, 2])
