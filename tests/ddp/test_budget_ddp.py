"""max_tokens="auto" on real 2-process CPU DDP (gloo): a rank that runs out of memory never leaves another waiting."""

from pathlib import Path

import pytest

from launch import run_ranks, run_script  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses

SCRIPT = Path(__file__).with_name("fit_budget.py")


def test_one_rank_out_of_memory_ends_with_its_smaller_budget_on_every_rank(tmp_path):
    records = run_ranks(SCRIPT, {"oom": (tmp_path, ["300"])}, timeout_s=600)["oom"]
    budgets = [r["token_budget"] for r in records]
    assert budgets[0] == budgets[1]  # the same result on every rank
    measured = budgets[0]["measured"]
    assert measured[1] <= 300 < measured[0], measured  # rank 1 runs out of memory above 300 slots
    # the same device type and capacity (memory_limit): one budget, the smallest, for every rank
    assert budgets[0]["per_rank"] == [measured[1]] * 2 and budgets[0]["max_tokens"] == measured[1]
    for record in records:
        assert record["max_tokens"] == record["sampler_max_tokens"] == measured[1]
        assert record["trained"] == record["micro_batches"] > 0  # a whole epoch, the same count on both ranks
        assert record["largest_trained"] <= measured[1]


def test_one_rank_out_of_memory_at_every_size_stops_every_rank_with_the_cause(tmp_path):
    code, log = run_script(SCRIPT, [tmp_path, "0"], 240)  # never a hang
    assert code != 0, log[-4000:]
    for rank in (0, 1):
        error = (tmp_path / f"rank{rank}.json").read_text()
        assert "RuntimeError" in error and "rank(s) [1] cannot fit even one micro-batch" in error, (rank, error)
        assert "lower max_length" in error and "memory_limit" in error


def test_a_probe_that_fails_on_one_rank_shows_its_cause_on_every_rank(tmp_path):
    code, log = run_script(SCRIPT, [tmp_path, "-1"], 240)  # rank 1's training_step returns None: never a hang
    assert code != 0, log[-4000:]
    for rank in (0, 1):
        error = (tmp_path / f"rank{rank}.json").read_text()
        assert "needs its loss" in error and "got NoneType" in error, (rank, error)  # the cause, not "see their log"
    assert "failed on rank(s) [1]" in (tmp_path / "rank0.json").read_text()
    assert "measured with the model at fit start" not in log, log[-4000:]
