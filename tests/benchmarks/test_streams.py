"""benchmarks/streams.py at its smallest: the stream planned in windows covers every document once, never over the
budget, and its report holds U of both plans and the moved tokens for each layout and number of ranks."""

import json

import pytest

from benchmarks import streams

pytestmark = pytest.mark.benchmark


def test_the_streams_benchmark_reports_both_plans_of_every_layout_and_world(tmp_path):
    argv = ["--documents", "3000", "--ranks", "2", "4", "--window", "600", "--output-dir", str(tmp_path)]
    results = streams.main(argv)
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["command"] == "python -m benchmarks.streams " + " ".join(argv)
    assert {(r["layout"], r["ranks"]) for r in report["rows"]} == {(l, n) for l in ("padded", "packed") for n in (2, 4)}
    for r in results["rows"]:
        assert r["every_document_once"] and r["over_budget_windows"] == 0 and r["windows"] == 5
        assert 0 < r["u_windows"] <= 1 and 0 < r["u_whole"] <= 1
        assert 0 < r["moved_token_share"] < 1
