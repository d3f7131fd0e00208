"""benchmarks/length_warmup.py run small: every stage's row, no micro-batch over budget, every token counted once.

Run:
    python -m pytest tests/benchmarks/test_length_warmup.py -q -m benchmark
"""

import json

import numpy as np
import pytest

from benchmarks import length_warmup as bench
from benchmarks._harness import load_lengths

pytestmark = pytest.mark.benchmark


def test_the_report_has_every_stage_and_counts_every_token_once(tmp_path):
    report = bench.main(["--distributions", "fortunes", "--tokens", "400000", "--ranks", "2", "--output-dir",
                         str(tmp_path)])
    rows = report["rows"]
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
    lengths = load_lengths("fortunes").astype(np.int64)
    total = int(np.tile(lengths, max(1, 400000 // int(lengths.sum()))).sum())
    for layout in ("padded", "packed"):
        for kind in ("stages", "linear"):
            mine = [r for r in rows if r["layout"] == layout and r["schedule"] == kind]
            assert len(mine) >= 2  # the warm-up's stages, then the rest
            assert sum(r["tokens"] for r in mine) == total
            assert all(r["over_budget"] == 0 and 0 < r["u"] <= 1 for r in mine)
    assert "| fortunes | padded | stages |" in (tmp_path / "results.md").read_text()


def test_the_schedules_rise_from_256_to_4096():
    for kind in ("stages", "linear"):
        f = bench.schedule(kind, 40)
        values = [f(g) for g in range(60)]
        assert values[0] == 256 and values[-1] == 4096 and values == sorted(values)
