"""benchmarks/bench_packing.py: the figures of a row on hand-made micro-batches, the targets' met / not met rule,
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


def test_target_rows_mark_each_target_met_or_not():
    rows = [_row("short", "lit_packed", U_tokens=0.9949), _row("short", "lit_packed_attn_1.2e-4", persistence=0.2),
            _row("short", "lit_packed_attn_1e-3", **{"U_attn_1e-3": 0.99}),
            _row("long", "lit_packed", over_budget_ratio=0.01), _row("long", "lit_packed_attn_1.2e-4"),
            _row("long", "lit_packed_attn_1e-3", dropped=1, **{"U_attn_1e-3": 0.80, "U_bound_attn_1e-3": 0.84}),
            _row("long", "kk_balanced", **{"U_attn_1e-3": 0.81}),
            _row("long", "greedy_sequential", **{"U_attn_1e-3": 0.5})]
    million = [{"status": "ok", "packing": True, "plan_s_per_million": 0.7, "plan_cpu_s_per_million": 0.6},
               {"status": "ok", "packing": True, "plan_s_per_million": 1.2, "plan_cpu_s_per_million": 0.9},
               {"status": "ok", "packing": False, "plan_s_per_million": 5.0, "plan_cpu_s_per_million": 5.0}]
    met = {(t["workload"], t["target"].split(" (")[0]): (t["value"], t["met"]) for t in bp.target_rows(rows, million)}
    assert met[("short", "U tokens >= 0.995")] == (0.9949, False)
    assert met[("short", "U attn q=1e-3 >= 0.99")] == (0.99, True)
    assert met[("short", "persistence <= 0.05")] == (0.2, False)  # the worst packed row counts
    assert met[("short", "no micro-batch over budget")] == (0.0, True)
    assert met[("long", "no micro-batch over budget")] == (0.01, False)
    assert met[("long", "U attn q=1e-3 >= 0.95 x per-step bound")] == (pytest.approx(0.80 / 0.84), True)
    assert met[("long", "U attn q=1e-3 above every packing peer")] == (0.80, False)  # kk_balanced has 0.81
    assert met[("long", "nothing dropped, duplicates only as marked fills, equal counts")] == (1, False)
    timing = [(t["target"], t["value"], t["met"]) for t in bp.target_rows(rows, million) if t["ranks"] == "all"]
    assert timing == [("packed plan <= 1.0 s per million documents (CPU time)", 0.9, True),  # padded rows not judged
                      ("packed plan <= 1.0 s per million documents (wall time)", 1.2, False)]
    assert ("short", "U attn q=1e-3 >= 0.95 x per-step bound") not in met  # long-document targets only there


def test_side_by_side_puts_our_targets_beside_the_best_peer():
    rows = [_row("short", "lit_packed", U_tokens=0.9991), _row("short", "lit_packed_attn_1.2e-4", persistence=0.03),
            _row("short", "lit_packed_attn_1e-3", **{"U_attn_1e-3": 0.985}),
            _row("short", "kk_balanced", U_tokens=0.9996, persistence=0.007, **{"U_attn_1e-3": 0.99}),
            _row("short", "hf_flattening", U_tokens=0.8, over_budget_ratio=0.4, **{"U_attn_1e-3": 0.7}),
            _row("long", "lit_packed"), _row("long", "lit_packed_attn_1e-3", **{"U_attn_1e-3": 0.5,
                                                                              "U_bound_attn_1e-3": 0.51}),
            _row("long", "ffd_repacked", persistence=0.5, **{"U_attn_1e-3": 0.3})]
    short, long = bp.side_by_side(rows)
    assert short == ["short", "8", "0.9991 met", "0.9996 kk_balanced", "0.9850 **not met**", "1.0000",
                     "0.9900 kk_balanced", "0.030 met", "0.007", "0.000 met", "0.400 hf_flattening"]
    assert long[2:8] == ["0.9990", "0.9990 ffd_repacked", "0.5000 met", "0.5100", "0.3000 ffd_repacked", "0.010 met"]
    assert bp.side_by_side([r for r in rows if r["workload"] == "short" and r["strategy"] != "lit_packed"]) == []


def test_target_rows_stay_open_without_our_rows():
    rows = [_row("long", "kk_balanced"), {**_row("long", "lit_packed_attn_1e-3"), "status": "refused"}]
    targets = bp.target_rows(rows, [{"status": "refused"}])
    assert {t["met"] for t in targets} == {None} and all(t["value"] is None for t in targets)
    assert bp._met(None) == "n/a" and bp._met(False) == "**not met**" and bp._met(True) == "met"


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
    assert report.count("| strategy | planned for |") == 2 and "**Targets**" in report
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
