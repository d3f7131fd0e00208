"""benchmarks/mixtures.py at a small size: the mixture plan keeps every large step within 2 percentage points of its
shares at U >= 0.97 padded and >= 0.99 packed on the benchmark's distributions, where sample weighting misses by
far more; the script writes its dated report.

Run:
    python -m pytest tests/benchmarks/test_mixtures.py -q
"""

import json

import pytest

from benchmarks import mixtures as bench

pytestmark = pytest.mark.benchmark


def test_the_mixture_plan_keeps_each_steps_shares_and_u_where_sample_weighting_does_not(tmp_path):
    report = bench.main(["--documents", "40000", "--timing-documents", "20000", "--repeats", "1",
                         "--scales-documents", "100000", "--output-dir", str(tmp_path)])
    rows = report["rows"]
    for name, least_u in (("lit_balance padded", 0.97), ("lit_balance packed", 0.99)):
        assert rows[name]["steps"] >= 20, rows[name]
        assert max(rows[name]["max"]) <= 0.02, (name, rows[name]["max"])
        assert rows[name]["U"] >= least_u, (name, rows[name]["U"])
    for name in ("interleave_datasets padded", "Megatron blend padded"):
        assert max(rows[name]["max"]) > 0.10, (name, rows[name]["max"])
    assert {(t["documents"], t["packing"]) for t in report["planning_time"]} == {(20000, False), (20000, True)}
    # three scales: every ranks x accumulation x layout measured beside one corpus of the same documents; at 8 ranks
    # (enough steps at this size) the epoch's cost per rank as even as one corpus's
    scales = report["three_scales"]
    assert sorted((tuple(r["weights"]), r["ranks"], r["accumulate_grad_batches"], r["packing"]) for r in scales) == \
        sorted((weights, ranks, acc, packing) for weights in bench.SCALE_WEIGHTS for ranks in (8, 64)
               for acc in (1, 4) for packing in (False, True))
    for r in scales:
        if r["ranks"] == 8:
            assert r["mixture"]["rank_imbalance"] <= r["one_corpus"]["rank_imbalance"] + 0.01, r
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["command"].startswith("python -m benchmarks.mixtures --documents 40000")
    assert "| lit_balance packed |" in (tmp_path / "results.md").read_text()
