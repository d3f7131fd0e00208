"""benchmarks/bench_packing.py: the figures of a row on hand-made micro-batches,
and a small run of the whole command (every strategy, both workloads, the tables and results.json).

Run:
    python -m pytest tests/benchmarks/test_bench_packing.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_packing as bp
from benchmarks.packing_peers import PACKING_PEERS
from lit_balance import BatchingSettings, plan_epoch

pytestmark = pytest.mark.benchmark

LENGTHS = np.array([4, 2, 2, 1, 3, 5])
EPOCH0 = [[[0, 1], [3]], [[2, 4], [4, 5]]]  # rank 1 repeats 4 (unmarked); every document present
EPOCH1 = [[[1, 0], [3]], [[2, 5], [4]]]  # 0 and 1 stay together; 2 and 4 part


def test_row_figures_of_packed_rank_lists():
    r = bp.row_figures((EPOCH0, EPOCH1), LENGTHS, max_tokens=6, packed=True)
    assert (r["steps_min"], r["steps_max"], r["equal_counts"]) == (2, 2, True)
    # packed rows: 6, 1 | 5, 8 tokens: one of four over the budget of 6, the largest 8 / 6
    assert r["over_budget_ratio"] == pytest.approx(0.25) and r["max_batch_ratio"] == pytest.approx(8 / 6)
    assert r["budget_fill_ratio"] == pytest.approx(20 / 24) and r["padding_ratio"] == pytest.approx(3 / 20)
    assert (r["dropped"], r["duplicated_marked"], r["duplicated_unmarked"]) == (0, 0, 1)
    assert r["U_tokens"] == pytest.approx(17 / (2 * (6 + 8)))  # real tokens / ranks x slowest per step
    real = sum(n + 1e-3 * n * n for n in LENGTHS)
    cost = [[4 + 2 + 1e-3 * 20, 2 + 3 + 1e-3 * 13], [1 + 1e-3, 3 + 5 + 1e-3 * 34]]
    assert r["U_attn_1e-3"] == pytest.approx(real / (2 * sum(max(step) for step in cost)))
    # of 0, 1, 2, 4 (3 and 5 have no real batch-mate), 0 and 1 keep theirs
    assert r["persistence"] == pytest.approx(0.5)


def test_row_figures_of_a_padded_plan_count_marked_fills():
    lengths = np.array([30, 20, 20, 10, 10])
    settings = BatchingSettings(max_tokens=40, shuffle=False)
    plans = [plan_epoch(lengths, settings, num_replicas=2, epoch=e) for e in (0, 1)]
    r = bp.row_figures(plans, lengths, 40, packed=False)
    assert r["duplicated_marked"] == int(plans[0].is_fill.sum()) and r["duplicated_unmarked"] == 0
    assert r["over_budget_ratio"] == 0 and r["equal_counts"] and r["dropped"] == 0


def _row(workload, strategy, **figures):
    base = {"workload": workload, "ranks": 8, "strategy": strategy, "status": "ok", "persistence": 0.01,
            "long_documents": workload == "long", "over_budget_ratio": 0.0, "dropped": 0, "duplicated_unmarked": 0,
            "equal_counts": True, "U_tokens": 0.999, "U_attn_1e-3": 0.995, "U_bound_attn_1e-3": 1.0}
    return {**base, **figures}


def test_command_runs_every_strategy_and_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    results = bp.main(["--num-samples", "200", "--ranks", "2", "--distributions", "fortunes", "--long-distributions",
                       "stdlib_docstrings", "--million", "2000", "--output-dir", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(results["rows"]))
    assert [(r["workload"], r["strategy"]) for r in saved["rows"]] == [
        (w, s) for w in ("fortunes cap 512", "stdlib_docstrings cap 4096 (long documents)") for s in bp.STRATEGIES]
    for row in saved["rows"]:
        assert row["status"] == "ok", row
        assert 0 < row["U_tokens"] <= 1 and 0 < row["U_attn_1e-3"] <= row["U_bound_attn_1e-3"] + 1e-12
        assert row["packed"] == (row["strategy"] in PACKING_PEERS or row["strategy"].startswith("lit_packed"))
        if row["strategy"].startswith("lit_"):  # our plans: every document once, fills marked, equal counts
            assert row["dropped"] == row["duplicated_unmarked"] == row["over_budget_ratio"] == 0 and row["equal_counts"]
    million = saved["plan_seconds_per_million"]
    assert [(m["status"], m["packing"], m["cost"]) for m in million] == [
        ("ok", True, "tokens"), ("ok", True, "attn_1e-3"), ("ok", False, "tokens")]
    assert all(m["documents"] == 2000 and m["plan_s_per_million"] == pytest.approx(m["plan_s"] * 500)
               and m["plan_cpu_s_per_million"] == pytest.approx(m["plan_cpu_s"] * 500) for m in million)
    hf = [r for r in saved["rows"] if r["strategy"] == "hf_flattening"]
    assert all(r["collator_mismatches"] == 0 and r["collator_longest_row"] == r["max_batch_tokens"] for r in hf)
    assert {w["max_length"] for w in saved["workloads"]} == {512, 4096}
    report = (out / "results.md").read_text()
    assert report.count("| strategy | planned for |") == 2 and report.startswith("Command: `python -m benchmarks.")
    assert all(f"| {s} |" in report for s in bp.STRATEGIES)
    assert saved["commit"] is None or len(saved["commit"]) == 40


def test_a_peer_refusing_its_inputs_gives_a_refused_row():
    workload = bp.Workload("tiny", "fortunes", 512, 4096, False)
    row = bp.run_row(workload, np.array([5, 7, 9]), "kk_balanced", 4, seed=0)  # 3 documents cannot fill 4 ranks
    assert row["status"] == "refused" and "each of 4 ranks a document" in row["reason"]
    assert "| kk_balanced | verl workload | 4 | refused: " in "| " + " | ".join(bp._fmt_row(row)) + " |"
    assert bp.run_row(workload, np.array([5, 7, 9]), "lit_packed", 4, seed=0)["status"] == "ok"


def test_command_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bp.main(["--max-length", "8192"])
    assert "--max-length (8192) must be <= --max-tokens (4096)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bp.main(["--seed", "-1"])
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err
