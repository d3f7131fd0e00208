"""The benchmark scripts without a test module of their own run at their smallest and write their dated report
through the one results writer: the command, the commit, the date and the machine, then their figures.

Run:
    python -m pytest tests/benchmarks/test_reports.py -q
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_callbacks, store_parquet

pytestmark = pytest.mark.benchmark


def _report(out) -> dict:
    report = json.loads((out / "results.json").read_text())
    assert report["commit"] is None or len(report["commit"]) == 40
    assert report["date_utc"] and report["machine"]["cpu_count"] >= 1
    return report


def test_store_parquet_times_both_stores_on_the_same_micro_batches(tmp_path):
    pytest.importorskip("pyarrow")
    argv = ["--documents", "3000", "--row-groups", "3", "--micro-batches", "4", "--output-dir", str(tmp_path)]
    results = store_parquet.main(argv)
    report = _report(tmp_path)
    assert report["command"] == "python -m benchmarks.store_parquet " + " ".join(argv)
    assert report["rows"] == results["rows"] and set(report["rows"]) == {"arrow", "parquet"}
    arrow, parquet = report["rows"]["arrow"], report["rows"]["parquet"]
    assert arrow["mean_rows"] == parquet["mean_rows"] > 0  # the same plan over the same documents
    assert report["parquet_over_arrow_median"] == pytest.approx(parquet["median_s"] / arrow["median_s"])
    assert 0 < arrow["median_s"] <= arrow["p90_s"] and 0 < parquet["median_s"] <= parquet["p90_s"]


@pytest.mark.timeout(600)
def test_bench_callbacks_fits_with_and_without_the_callbacks(tmp_path):
    argv = ["--reps", "1", "--num-docs", "120", "--max-tokens", "256", "--d-model", "16", "--output-dir", str(tmp_path)]
    bench_callbacks.main(argv)
    report = _report(tmp_path)
    assert report["command"] == "python -m benchmarks.bench_callbacks " + " ".join(argv)
    assert len(report["fit_s_without"]) == len(report["fit_s_with"]) == len(report["fit_wall_ratio"]) == 1
    assert report["micro_batches_per_fit"] > 0 and 0 < report["hook_cpu_share"][0] < 1
    assert report["fit_wall_ratio"][0] == pytest.approx(report["fit_s_with"][0] / report["fit_s_without"][0])
