"""benchmarks/per_rank_budgets.py: per-rank budgets ``[B, B/2]`` (half the ranks each) against ``B/2`` on every rank,
on the three shipped length distributions at 8 ranks, padded and packed (the target of docs/per_rank_budgets.md).

Run:
    python -m pytest tests/benchmarks/test_bench_per_rank_budgets.py -q
"""

import json

import numpy as np
import pytest

from benchmarks import per_rank_budgets as bench
from benchmarks._harness import DISTRIBUTIONS, load_lengths
from lit_balance import BatchingSettings, EpochPlan

pytestmark = pytest.mark.benchmark

B = 1024


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_mixed_budgets_keep_u_and_scale_steps_with_capacity(name, packing):
    """Speeds proportional to the budgets: U of [B, B/2] >= 0.95 x U of B/2 everywhere, and the steps the
    reference needs divided by the capacity ratio kappa = 1.5 (within 5 %); equal speeds: U kept as well."""
    lengths = load_lengths(name, max_length=B // 2)
    r = bench.compare(lengths, B, 8, packing=packing, speeds="budget")
    assert r["kappa"] == pytest.approx(1.5)
    assert r["U_ratio"] >= bench.U_RATIO_TARGET, r
    assert 0.95 <= r["steps_ratio"] <= 1.05, r
    assert not r["steps_vary"] and r["fill_rows_mixed"] <= 8
    equal = bench.compare(lengths, B, 8, packing=packing, speeds="equal")
    assert equal["U_ratio"] >= bench.U_RATIO_TARGET, equal


def test_check_plan_catches_a_micro_batch_over_its_ranks_budget():
    lengths = np.array([100, 100, 30, 30, 30, 30])
    settings = BatchingSettings(max_tokens=[200, 120])

    def plan(assignment):  # micro-batch 0: [0, 1], 200 slots; micro-batch 1: [2 3 4 5], 120 slots
        return EpochPlan(rows=np.arange(6), is_fill=np.zeros(6, bool), batch_offsets=np.array([0, 2, 6]),
                         assignment=np.array([assignment]), dropped=np.zeros(0, np.int64))

    bench.check_plan(plan([0, 1]), lengths, settings, 2)
    with pytest.raises(AssertionError, match="1 micro-batch.es. over their rank's budget"):
        bench.check_plan(plan([1, 0]), lengths, settings, 2)  # 200 slots on the rank of 120


def test_command_prints_the_table_and_writes_json(tmp_path, capsys):
    report = bench.main(["--distributions", "fortunes", "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| fortunes | padded | budget |" in printed and "| fortunes | packed | equal |" in printed
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows == report["rows"] and report["command"].startswith("python -m benchmarks.per_rank_budgets")
    assert len(rows) == 4 and all(row["met"] for row in rows)
