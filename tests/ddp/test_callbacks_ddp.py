"""Real 2-process CPU DDP runs (gloo) with the measuring and adapting callbacks and the token-weighted loss."""

from pathlib import Path

import numpy as np
import pytest
import torch

from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_callbacks.py")
MODES = ("adaptive", "fixed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both modes, run side by side (each is 2 ranks); returns {mode: (out_dir, [rank0, rank1])}."""
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    records = run_ranks(SCRIPT, {mode: (outs[mode], [mode]) for mode in MODES}, 240)
    return {mode: (outs[mode], records[mode]) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_per_optimizer_step_equal_accumulate_grad_batches_on_every_rank(runs, mode):
    _, ranks = runs[mode]
    assert ranks[0]["handed_over"] and ranks[1]["handed_over"]  # the callbacks read the plain loader's sampler
    assert ranks[0]["steps"] == ranks[1]["steps"]  # same windows, same values, on both ranks
    assert ranks[0]["zero_grads"] == ranks[1]["zero_grads"]
    num_batches = ranks[0]["num_batches"]
    for epoch in (0, 1):
        steps = [s for s in ranks[0]["steps"] if s[0] == epoch]
        expected_first = 0
        for _, first, micro_batches, acc in steps:
            assert first == expected_first
            # a full window, or the epoch-end flush of a shorter one
            assert micro_batches == acc or (micro_batches < acc and first + micro_batches == num_batches)
            expected_first += micro_batches
        assert expected_first == num_batches
        # gradients were zeroed exactly at each window's first micro-batch
        assert [z[1] for z in ranks[0]["zero_grads"] if z[0] == epoch] == [s[1] for s in steps]
    if mode == "adaptive":
        values = {s[3] for s in ranks[0]["steps"]}
        assert len(values) > 1  # the callback did change the value mid-run
        assert ranks[0]["history"] == ranks[1]["history"]
        assert [h[2] for h in ranks[0]["history"]] == [s[2] for s in ranks[0]["steps"]]
        assert ranks[0]["final_accumulate_grad_batches"] == 1  # restored after fit
        m = ranks[0]["metrics"]
        for key in ("balance/padding_ratio", "balance/padding_ratio_rank0", "balance/padding_ratio_rank1",
                    "balance/real_tokens_per_s", "balance/straggler_ratio", "balance/straggler_gap_s",
                    "balance/accumulate_grad_batches", "balance/tokens_per_optimizer_step"):
            assert key in m
        assert m == ranks[1]["metrics"] or all(m[k] == ranks[1]["metrics"][k] for k in m if k.startswith("balance/"))
    else:
        assert {s[3] for s in ranks[0]["steps"]} == {2}


@pytest.mark.parametrize("mode", MODES)
def test_backward_is_timed_on_every_rank_exactly_where_ddp_skipped_the_all_reduce(runs, mode):
    _, ranks = runs[mode]
    backward = np.array(ranks[0]["backward_s"])  # [2, micro-batches of the last epoch], the same on both ranks
    np.testing.assert_array_equal(backward, np.array(ranks[1]["backward_s"]))
    synced = np.zeros(backward.shape[1], dtype=bool)
    for epoch, first, micro_batches, _ in ranks[0]["steps"]:
        if epoch == 1:
            synced[first + micro_batches - 1] = True  # the optimizer step's last backward all-reduces
    assert synced.any() and not synced.all()
    assert np.isnan(backward[:, synced]).all()
    local = backward[:, ~synced]
    assert np.isfinite(local).all() and (local > 0).all()


@pytest.mark.parametrize(("mode", "divisor"), [("adaptive", "all_reduce"), ("fixed", "plan")])
def test_step_loss_and_gradient_equal_one_process_over_the_same_tokens(runs, mode, divisor):
    out, ranks = runs[mode]
    assert set(ranks[0]["modes"]) == {divisor}
    model = DemoTransformerLM(vocab_size=100, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    model.load_state_dict(torch.load(out / "init.pt", weights_only=True))
    steps = [torch.load(out / f"step0_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert len(steps[0]["batches"]) == ranks[0]["steps"][0][2] == len(steps[1]["batches"])
    total, count = torch.zeros((), dtype=torch.float64), 0
    for step in steps:
        for b in step["batches"]:
            s, n = token_loss_sum(model(b["input_ids"], b["attention_mask"]), b["labels"])
            total, count = total + s.double(), count + n
    loss = total / count
    loss.backward()
    assert steps[0]["tokens"] == steps[1]["tokens"] == count
    for step in steps:
        assert step["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(step["grads"][name], p.grad, rtol=1e-4, atol=1e-6)
