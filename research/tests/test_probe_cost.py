"""research/probe_cost.py: one short run of the main job with max_tokens=auto, and what it records (never its speed).

Run:
    python -m pytest research/tests/test_probe_cost.py -q
"""

from __future__ import annotations

import json

import pytest

from research import probe_cost

pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(1800)]  # two CPU ranks, the probe and 4 steps: ~1 min here


def test_one_run_records_the_probe_and_the_epoch_side_by_side(tmp_path):
    result = probe_cost.main(["--memory-limits-mib", "1100", "--runs", "1", "--max-steps", "4", "--timeout-s", "900",
                              "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    (row,) = result["rows"]
    assert row["memory_limit"] == 1100 << 20 and row["per_rank"] == [row["max_tokens"]] * 2
    searched = sum(p[2] for p in row["passes"])  # the recorded passes are a part of every pass run
    assert row["probe_slots"] > searched > 0
    assert row["probe_s"] > 0 and row["iterations_timed"] == 4 - 2  # the first two iterations are warm-up
    assert row["epoch_slots_rank0"] <= row["micro_batches_per_epoch"] * row["max_tokens"]
    assert row["slot_ratio"] == pytest.approx(row["probe_slots"] / row["epoch_slots_rank0"])
    assert row["wall_ratio"] == pytest.approx(row["probe_s"] / (row["iteration_s"] * row["micro_batches_per_epoch"]))
