"""benchmarks/schedules.py at a small size: it writes its dated report with every part the benchmark promises (the
scheduled plan's per-step deviation and U per stage, the restarted Megatron blend's lost and repeated samples, the
per-block sample counts, the tiny weights, the length warm-up's discards, the planning time). Structure, not figures.

Run:
    python -m pytest tests/benchmarks/test_bench_schedules.py -q -m benchmark
"""

import json

import numpy as np
import pytest

from benchmarks import schedules as bench

pytestmark = pytest.mark.benchmark


def test_the_schedules_benchmark_writes_every_part_of_its_report(tmp_path):
    report = bench.main(["--documents", "60000", "--timing-documents", "20000", "--warmup-tokens", "1500000",
                         "--tiny-weight", "1e-4", "--output-dir", str(tmp_path)])
    assert [r["layout"] for r in report["lit_balance"]] == ["padded", "packed"]
    for r in report["lit_balance"]:
        assert 0 < r["transition"] < r["steps"] and r["over_budget"] == 0
        assert len(r["max_pp"]) == len(r["p95_pp"]) == 3
        assert all(0 <= q <= m for q, m in zip(r["p95_pp"], r["max_pp"]))
        assert 0 < r["u_before"] <= 1 and 0 < r["u_after"] <= 1
    meg = report["megatron_restart"]
    assert set(meg["components"]) == set(bench.NAMES)
    consumed = [c["consumed_before"] for c in meg["components"].values()]
    resumed = [c["resumed_at"] for c in meg["components"].values()]
    assert sum(consumed) == sum(resumed) == meg["consumed_samples"]  # both blends at the same sample count
    # what one component gains another loses: lost and repeated samples balance
    assert (sum(c["lost_samples"] for c in meg["components"].values())
            == sum(c["repeated_samples"] for c in meg["components"].values()))
    assert [lev["corrected"] for lev in report["levanter_blocks"]] == [False, True]
    (tiny,) = report["tiny_weight"]
    assert tiny["weight"] == 1e-4 and tiny["planned_tokens"] >= 0 and tiny["levanter_documents"] >= 0
    warm = report["length_warmup"]
    assert {w["layout"] for w in warm} == {"padded", "packed"}
    assert all(w["over_budget"] == 0 and w["truncation_discards"] >= 0 for w in warm)
    assert [t["layout"] for t in report["timing"]] == ["padded", "packed"]
    assert all(t["documents"] > 0 and t["cpu_s_per_million"] >= 0 for t in report["timing"])
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["command"].startswith("python -m benchmarks.schedules --documents 60000")
    assert written["schedule"]["points"] == report["schedule"]["points"]
    markdown = (tmp_path / "results.md").read_text()
    for part in ("lit_balance padded", "Megatron blend restarted", "levanter blocks", "truncation discards",
                 "planning CPU seconds"):
        assert part in markdown


def test_the_megatron_blend_model_follows_the_greedy_rule():
    blend = bench.megatron_blend((0.6, 0.1, 0.3), 1000)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[blend], axis=0)  # [samples, components]
    expected = np.arange(1, 1001)[:, None] * np.array([0.6, 0.1, 0.3])
    assert np.abs(counts - expected).max() < 1  # every prefix within one sample of its weights
