"""benchmarks/scale.py: the fields and invariants of its rows (never its speed), on --quick sizes.

Run:
    python -m pytest tests/benchmarks/test_scale.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import scale

pytestmark = pytest.mark.benchmark


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    results = scale.main(["--quick", "--work-dir", str(out / "work"), "--output-dir", str(out)])
    return results, json.loads((out / "results.json").read_text())


def test_lengths_rows_have_every_figure_and_hold_the_invariants(quick):
    results, written = quick
    assert written["lengths"] == results["lengths"]
    assert written["commit"] and written["machine"]["cpu_count"] >= 1 and written["command"].startswith("python -m")
    rows = results["lengths"]
    assert [r["num_samples"] for r in rows] == list(scale.QUICK_SIZES)
    for r in rows:
        expected_windows = -(-r["num_samples"] // scale.QUICK_PLAN_WINDOW)
        assert r["windows"] == expected_windows
        assert r["micro_batches_per_rank"] > 0
        assert 0 < r["first_batch_s"] <= r["epoch_s"] and 0 < r["argsort_s"]
        assert r["ratio_to_argsort"] == pytest.approx(r["epoch_s"] / r["argsort_s"])
        assert r["epoch_s_per_million"] == pytest.approx(r["epoch_s"] / (r["num_samples"] / 1e6))
        assert r["lengths_mb"] == pytest.approx(r["num_samples"] * 4 / 2**20)
        assert r["peak_rss_mb"] >= r["rss_after_import_mb"] > 0
        assert 0.5 < r["useful_fraction"] <= 1.0 and 0.5 < r["whole_useful_fraction"] <= 1.0
        assert abs(r["whole_useful_fraction"] - r["useful_fraction"]) < 0.02  # windows of 50k samples
    assert rows[0]["windows"] == 1 and rows[0]["useful_fraction"] == rows[0]["whole_useful_fraction"]  # one window
    assert rows[1]["windows"] > 1
    peer = rows[0]
    assert peer["lhotse_epoch_s"] > 0 and peer["lhotse_peak_rss_mb"] > 0, peer.get("lhotse_error")
    assert "lhotse_epoch_s" not in rows[1]  # the peer runs on the smallest size only


def test_u_by_distribution_covers_every_shipped_distribution(quick):
    results, _ = quick
    rows = results["u_by_distribution"]
    assert [r["distribution"] for r in rows] == list(scale.DISTRIBUTIONS)
    for r in rows:
        assert r["windowed_windows"] > 1 and r["whole_windows"] == 1
        assert r["u_difference"] == pytest.approx(r["whole_useful_fraction"] - r["windowed_useful_fraction"])
        assert abs(r["u_difference"]) < 0.02


@pytest.mark.parametrize("packing", [False, True])
def test_u_summed_part_by_part_matches_plan_stats(packing):
    from lit_balance import BalancedBatchSampler, plan_stats
    from lit_balance.plan import planner_for

    lengths = np.random.default_rng(1).integers(1, 400, 3000)
    sampler = BalancedBatchSampler(lengths, 1024, num_replicas=3, rank=0, plan_window=700, packing=packing)
    expected = plan_stats(sampler.plan(), lengths, planner=planner_for(sampler.settings)).useful_fraction
    assert scale._useful_fraction(sampler, lengths, 3) == pytest.approx(expected)


def test_written_lengths_are_int32_draws_from_the_pool(tmp_path):
    pool = scale.pooled_lengths(512)
    path = tmp_path / "l.npy"
    scale.write_lengths(path, pool, 10_001, seed=3, chunk=1000)
    got = np.load(path)
    assert got.dtype == np.int32 and got.shape == (10_001,)
    assert np.isin(got, pool).all() and got.max() <= 512


def test_packed_plans_are_measured_on_the_packed_planners_token_slots(tmp_path):
    [row] = scale.run_lengths([5000], tmp_path, num_replicas=2, lhotse=False, packing=True, whole_up_to=0)
    assert row["layout"] == "packed" and row["micro_batches_per_rank"] > 0 and "whole_epoch_s" not in row
    assert 0.97 < row["useful_fraction"] <= 1.0  # packed rows hold tokens, not rows x longest
    [u] = [r for r in scale.u_by_distribution(4000, num_replicas=2, packing=True) if r["distribution"] == "fortunes"]
    assert 0.97 < u["windowed_useful_fraction"] <= 1.0 and u["windowed_useful_fraction"] == u["whole_useful_fraction"]
