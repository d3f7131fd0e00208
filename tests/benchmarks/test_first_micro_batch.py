"""benchmarks/first_micro_batch.py: the fields and invariants of its rows (never its speed), on --quick sizes.

Run:
    python -m pytest tests/benchmarks/test_first_micro_batch.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import first_micro_batch as bench

pytestmark = pytest.mark.benchmark


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("first_micro_batch")
    results = bench.main(["--quick", "--layouts", "padded", "--baseline", "HEAD", "--work-dir", str(out / "work"),
                          "--output-dir", str(out)])
    return results, json.loads((out / "results.json").read_text()), out


def test_lengths_rows_hold_the_invariants(quick):
    results, written, out = quick
    assert written["lengths"] == results["lengths"] and (out / "results.md").exists()
    rows = results["lengths"]
    assert sorted((r["order"], r["code"]) for r in rows) == [("iterate", "HEAD"), ("iterate", "this"),
                                                             ("len first", "HEAD"), ("len first", "this")]
    assert len({r["micro_batches_per_rank"] for r in rows}) == 1  # the same epoch, whatever the order or the code
    for r in rows:
        assert r["num_samples"] == bench.QUICK_SIZES[0]
        assert r["windows"] == -(-r["num_samples"] // bench.QUICK_PLAN_WINDOW) > 1
        assert 0 <= r["construct_cpu_s"] <= r["first_batch_cpu_s"] <= r["epoch_cpu_s"]
        assert r["epoch_cpu_s_per_million"] == pytest.approx(r["epoch_cpu_s"] / (r["num_samples"] / 1e6))
        assert r["cpu_ratio_to_argsort"] == pytest.approx(r["epoch_cpu_s"] / r["argsort_cpu_s"])
        assert r["peak_rss_kib"] >= r["rss_after_import_kib"] > 0
        # the baseline's package is the revision's archive, this code's the checkout
        assert (Path(r["package"]).parent.name == "baseline") == (r["code"] == "HEAD")
    assert not (out / "work").exists() or not any((out / "work").iterdir())  # lengths and stores removed


def test_store_rows_come_from_setup_to_the_first_micro_batch(quick):
    results, _, _ = quick
    rows = results["store"]
    assert [r["code"] for r in rows] == ["this", "HEAD"]
    for r in rows:
        assert r["num_documents"] == bench.QUICK_SIZES[0] == r["num_documents"]
        assert r["micro_batches_per_rank"] > 0 and r["first_batch_rows"] > 0 and r["first_batch_cpu_s"] > 0
        assert not r["cache_written"]  # read in place
