"""benchmarks/long_documents.py: packed plans of whole files on 64 ranks reach U >= 0.995 (the target of
docs/benchmarks.md, packed plans of long documents), and the exchange stage never lowers U.

Run:
    python -m pytest tests/benchmarks/test_long_documents.py -q -m benchmark
"""

import json

import numpy as np
import pytest

from benchmarks import long_documents as bench
from benchmarks._harness import load_lengths

pytestmark = pytest.mark.benchmark


@pytest.mark.parametrize("name", bench.LONG_DISTRIBUTIONS)
def test_long_documents_on_64_ranks_reach_the_target(name):
    lengths = load_lengths(name)
    new = bench.u_of_plans(lengths, 4096, 64)
    old = bench.u_of_plans(lengths, 4096, 64, exchanges=False)
    assert min(new["u_tokens"]) >= 0.995, new
    assert all(a >= b for a, b in zip(new["u_tokens"], old["u_tokens"])), (new, old)
    assert new["micro_steps"] == old["micro_steps"] and len(new["micro_steps"]) == 1  # the same count every epoch


def test_a_plan_that_loses_a_document_is_refused():
    from lit_balance import BatchingSettings, plan_epoch

    lengths = np.array([300, 200, 100, 50])
    plan = plan_epoch(lengths, BatchingSettings(max_tokens=400, packing=True), num_replicas=2, epoch=0)
    bench._check(plan, lengths, 400)
    with pytest.raises(AssertionError, match="exactly once"):
        bench._check(plan, lengths[:3], 400)
    with pytest.raises(AssertionError, match="over 200 tokens"):
        bench._check(plan, lengths, 200)


def test_the_report_has_a_row_per_distribution_budget_and_ranks(tmp_path):
    report = bench.main(["--ranks", "2", "--max-tokens", "4096", "--output-dir", str(tmp_path)])
    rows = report["rows"]
    assert [(r["distribution"], r["max_tokens"], r["ranks"]) for r in rows] == [
        (name, 4096, 2) for name in bench.LONG_DISTRIBUTIONS]
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {name} | 4,096 | 2 |" in table for name in bench.LONG_DISTRIBUTIONS)
