"""benchmarks/ledger.py at a small size: it writes ledgers of every size asked (one row per planned document), times
LedgerCheck against the fit's steps, and writes its dated report.

Run:
    python -m pytest tests/benchmarks/test_bench_ledger.py -q -m benchmark
"""

import json

import pytest

from benchmarks import ledger as bench

pytestmark = pytest.mark.benchmark


def test_the_ledger_benchmark_reports_writing_and_checking_costs(tmp_path):
    report = bench.main(["--documents", "3000", "20000", "--fit-docs", "200", "--reps", "1", "--output-dir",
                         str(tmp_path)])
    assert [r["documents"] for r in report["writing"]] == [3000, 20000]
    for r in report["writing"]:
        assert r["rows"] == r["documents"]  # one corpus, no fill row at these sizes: one row per document
        assert r["bytes"] > 0 and r["ledger_docs_per_s"] > 0
    assert report["fit_optimizer_steps"] > 0
    assert len(report["check_step_ratio"]) == 1 and report["check_step_ratio"][0] > 0
    assert len(report["record_step_ratio"]) == 1 and report["record_step_ratio"][0] > 0
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["command"].startswith("python -m benchmarks.ledger --documents 3000 20000")
    markdown = (tmp_path / "results.md").read_text()
    assert "LedgerCheck:" in markdown and "recording" in markdown
