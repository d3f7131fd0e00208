"""benchmarks/scale_text.py on a tiny corpus: the row's fields, and the cache it built equals the in-memory build.

Run:
    python -m pytest tests/benchmarks/test_scale_text.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import scale_text
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))  # tests/data/: the in-memory oracle
from _inmemory_cache import in_memory_arrays

pytestmark = pytest.mark.benchmark


def _files(directory: str) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime ns)}`` of every file below ``directory``."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(directory).rglob("*") if p.is_file()}


@pytest.mark.timeout(600)
def test_a_quick_run_reports_every_figure_and_builds_the_in_memory_entry(tmp_path):
    rows = scale_text.run([0.2, 0.4], tmp_path, quick=True, keep=True)
    assert [row["corpus_mb"] for row in rows] == [0.2, 0.4]
    for row in rows:
        corpus = Path(row["corpus"])
        assert row["bytes"] == corpus.stat().st_size >= row["corpus_mb"] * (1 << 20)
        with open(corpus, encoding="utf-8") as lines:
            assert row["num_docs"] == sum(1 for _ in lines)
        assert 0 < row["rss_after_import_mb"] <= row["peak_rss_mb"]
        assert row["peak_above_import_mb"] == pytest.approx(row["peak_rss_mb"] - row["rss_after_import_mb"])
        assert row["tokens_per_s"] == pytest.approx(row["num_tokens"] / row["tokenize_s"])
        assert row["encode_batch_tokens_per_s"] == pytest.approx(row["num_tokens"] / row["encode_batch_s"])
        assert row["ratio_to_encode_batch"] == pytest.approx(row["tokens_per_s"] / row["encode_batch_tokens_per_s"])
        assert row["encode_batch_s"] <= row["encode_batch_wall_s"]
        reference = in_memory_arrays(resolve_corpus(corpus), resolve_tokenizer())
        built = _files(row["cache_dir"])
        cached = load_or_build(resolve_corpus(corpus), resolve_tokenizer(), row["cache_dir"])
        assert built and _files(row["cache_dir"]) == built  # prepare_data built the entry; the look-up wrote nothing
        for name, expected in reference.items():
            np.testing.assert_array_equal(getattr(cached, name), expected, err_msg=name)
        assert row["num_tokens"] == len(reference["token_ids"])
        assert len(cached) + cached.num_empty == row["num_docs"]


def test_the_corpus_is_sampled_deterministically(tmp_path):
    first = scale_text.make_corpus(tmp_path / "a.jsonl", 0.05, seed=3)
    second = scale_text.make_corpus(tmp_path / "b.jsonl", 0.05, seed=3)
    assert first == second and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert first["bytes"] >= 0.05 * (1 << 20)
    other = scale_text.make_corpus(tmp_path / "c.jsonl", 0.05, seed=4)
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes() or other != first


def test_sizes_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"sizes_mb must be positive numbers of MiB, got \[0, -1\]"):
        scale_text.run([5, 0, -1], tmp_path)
    for pairs in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"pairs must be a positive int, got"):
            scale_text.run([5], tmp_path, pairs=pairs)


@pytest.mark.timeout(600)
def test_pairs_alternate_which_runs_first_and_report_the_median_ratio(tmp_path, monkeypatch):
    calls = []
    seconds = iter([2.0, 1.0, 1.0, 4.0, 3.0, 1.0])  # per call, in call order: ratios 0.5, 0.25 and 1/3

    def fake_child(kind, *args):
        calls.append(kind)
        out = {"num_docs": 7, "num_tokens": 100, "seconds": next(seconds)}
        if kind == "prepare":
            return {**out, "rss_after_import_kib": 1024, "peak_rss_kib": 2048 * (len(calls) + 1)}
        return {**out, "wall_s": out["seconds"]}

    monkeypatch.setattr(scale_text, "_run_child", fake_child)

    def fake_corpus(path, size, seed):
        path.write_text("{}\n", encoding="utf-8")
        return {"bytes": 10, "num_docs": 7}

    monkeypatch.setattr(scale_text, "make_corpus", fake_corpus)
    [row] = scale_text.run([0.1], tmp_path, pairs=3)
    assert calls == ["prepare", "encode", "encode", "prepare", "prepare", "encode"]
    assert row["ratio_per_pair"] == pytest.approx([0.5, 0.25, 1 / 3])
    assert row["ratio_to_encode_batch"] == pytest.approx(1 / 3) and row["pairs"] == 3
    assert (row["tokenize_s"], row["encode_batch_s"]) == (3.0, 1.0)  # the median pair's figures
    assert row["peak_above_import_mb"] == pytest.approx(2 * 6 - 1)  # the largest over pairs (fifth call)
    assert "0.33 (0.50, 0.25, 0.33)" in scale_text.table([row])


def test_the_command_line_writes_results(tmp_path, monkeypatch):
    monkeypatch.setattr(scale_text, "run", lambda sizes, work_dir, quick, seed, pairs: [])
    results = scale_text.main(["--quick", "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results["rows"] == []
    assert results["command"] == f"python -m benchmarks.scale_text --quick --output-dir {tmp_path}"
