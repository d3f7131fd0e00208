"""benchmarks/static_shapes.py at its smallest: the plans' real-token fractions against an exact bound, and a
compiled 2-rank fit's graph count, in its dated report."""

from __future__ import annotations

import json
from itertools import combinations_with_replacement

import numpy as np
import pytest

from benchmarks import static_shapes

pytestmark = pytest.mark.benchmark


def test_the_bound_is_the_best_k_lengths_by_brute_force():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 60)
    values = np.unique(lengths)
    for k in (1, 2, 3):
        best = max(lengths.sum() / np.array(chosen)[np.searchsorted(chosen, lengths)].sum()
                   for chosen in (sorted(set(c) | {values[-1]}) for c in combinations_with_replacement(values, k))
                   if len(chosen) <= k)
        assert static_shapes.best_lengths_fraction(lengths, k) == pytest.approx(best)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smallest_run_writes_plans_and_graphs(tmp_path):
    argv = ["--distributions", "fortunes", "--ranks", "2", "--ks", "8", "--layouts", "static", "--output-dir",
            str(tmp_path)]
    results = static_shapes.main(argv)
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["command"] == "python -m benchmarks.static_shapes " + " ".join(argv)
    (plan,) = report["plans"]
    assert plan == results["plans"][0] and plan["k"] == 8 and plan["ranks"] == 2
    assert 0 < plan["real_token_fraction"] <= plan["shapes_length_bound"] <= plan["bound"] + 1e-12
    assert plan["distinct_shapes"] <= 8
    for rank in report["graphs"]["static"]:
        assert rank["train_graphs_epoch0"] == 1 and rank["graphs"] == 2 and rank["graph_breaks"] == 0
    assert "| static | 0 | 1 | 2 |" in (tmp_path / "results.md").read_text()


def test_a_bad_layout_is_refused(capsys):
    with pytest.raises(SystemExit):
        static_shapes.main(["--layouts", "shapes"])
    assert "expected static, free or shapesK" in capsys.readouterr().err
