"""The token budget probe on 2 real CPU processes (gloo): equal devices share one budget whatever each measured;
devices of different capacity get per-rank budgets."""

from pathlib import Path

import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # two processes each

SCRIPT = Path(__file__).with_name("probe_ranks.py")


def test_equal_ranks_share_one_budget_and_twice_the_capacity_gives_per_rank_budgets(tmp_path):
    records = run_ranks(SCRIPT, {"cpu": (tmp_path / "cpu", ["cpu"]), "scripted": (tmp_path / "s", ["scripted"])},
                        timeout_s=1200)
    cpu, scripted = records["cpu"], records["scripted"]
    for rank_records in (cpu, scripted):
        assert rank_records[0] == rank_records[1]  # the same result on every rank
    budget = cpu[0]["token_budget"]
    assert budget["capacity_bytes"][0] == budget["capacity_bytes"][1]
    # each rank measured its own peak; whatever they measured, equal devices plan with the smallest
    assert budget["per_rank"] == [min(budget["measured"])] * 2 and cpu[0]["planned"] == min(budget["measured"])
    assert "every rank" in cpu[0]["line"] and f"max_tokens={cpu[0]['planned']} " in cpu[0]["line"]
    budget = scripted[0]["token_budget"]
    assert budget["capacity_bytes"][1] == 2 * budget["capacity_bytes"][0]
    small, large = budget["per_rank"]
    assert scripted[0]["planned"] == [small, large] and 1.9 * small <= large <= 2.3 * small, budget
    # within 5 % of the scripted optimum: 100 MiB + 100 KiB per slot <= 90 % of the capacity
    for rank, chosen in enumerate((small, large)):
        optimum = (0.9 * 2**30 * (1 + rank) - 100 * 2**20) / (100 * 1024)
        assert 0.95 * optimum <= chosen <= optimum, (rank, chosen, optimum)
    assert "by rank (capacities differ)" in scripted[0]["line"]


def test_a_collective_inside_training_step_meets_the_same_pass_on_every_rank(tmp_path):
    """Ranks of different capacity search different budgets; their passes are still as many on every rank."""
    records = run_ranks(SCRIPT, {"collective": (tmp_path, ["collective"])}, timeout_s=600)["collective"]
    budget = records[0]["token_budget"]
    assert records[0]["token_budget"] == records[1]["token_budget"]
    small, large = budget["per_rank"][1], budget["per_rank"][0]
    assert large > 1.2 * small, budget  # the capacities differ: so do the searches
    assert records[0]["passes"] == records[1]["passes"] > 0, records
