"""The measuring and adapting recipes, run small as a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ddp
@pytest.mark.slow
def test_feedback_recipe_plans_the_next_epoch_with_fitted_rank_speeds(tmp_path):
    # How far the gap closes depends on this machine's speed and load; that the loop closes it is checked with
    # fixed clocks in test_feedback.py::test_feedback_at_least_halves_the_straggler_gap.
    out = tmp_path / "gaps.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes/straggler_feedback.py"), "--epochs", "2", "--num-docs", "300",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    epochs = json.loads(out.read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[0]["rank_speeds"] is None  # epoch 0: equal ranks
    speeds = epochs[1]["rank_speeds"]  # epoch 1: the fitted speeds, the fastest rank at 1.0
    assert len(speeds) == 2 and max(speeds) == 1.0 and min(speeds) > 0
    assert all(len(e["compute_s"]) == 2 and min(e["compute_s"]) > 0 for e in epochs)
    assert "straggler gap before feedback" in proc.stdout
