"""benchmarks/tokenize_datatrove.py on a tiny corpus: both paths run, tokenize the same documents, and the row's
figures follow from its times.

Run:
    python -m pytest tests/benchmarks/test_tokenize_datatrove.py -q
"""

from __future__ import annotations

import statistics

import pytest

from benchmarks import tokenize_datatrove

pytestmark = pytest.mark.benchmark
pytest.importorskip("datatrove")


@pytest.mark.timeout(600)
def test_a_quick_run_reports_both_paths_on_the_same_tokens(tmp_path):
    row = tokenize_datatrove.run(0.3, tmp_path, pairs=2, workers=2)
    assert row["bytes"] >= int(0.3 * (1 << 20)) and row["num_tokens"] > 0  # make_corpus: int(size_mb * MiB)
    assert [p["first"] for p in row["pairs"]] == ["datatrove", "cache"]  # alternating order
    for pair in row["pairs"]:
        assert pair["num_tokens"] == row["num_tokens"]
        assert pair["store_docs"] >= pair["cache_docs"] and pair["store_docs"] <= row["num_docs"]
        assert pair["ratio"] == pytest.approx(pair["cache_s"] / pair["datatrove_s"])
        assert 0 < pair["datatrove_executor_s"] <= pair["datatrove_s"]
    assert row["ratio"] == pytest.approx(statistics.median(p["ratio"] for p in row["pairs"]))
    assert row["datatrove_tokens_per_s"] == pytest.approx(
        statistics.median(row["num_tokens"] / p["datatrove_s"] for p in row["pairs"]))
    assert list(tmp_path.iterdir()) == []  # the corpus, stores and caches are removed
    assert "| median |" in tokenize_datatrove.table(row)


def test_the_split_keeps_every_line_once_in_order(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(7)))
    parts = tokenize_datatrove.split_lines(corpus, tmp_path / "parts", 3)
    assert [p.name for p in parts] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert "".join(p.read_text() for p in parts) == corpus.read_text()
    assert [len(p.read_text().splitlines()) for p in parts] == [2, 2, 3]
