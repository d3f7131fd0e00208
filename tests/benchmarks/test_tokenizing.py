"""benchmarks/tokenizing.py on tiny corpora: against encode_batch, the row's figures and the cache it built equals the
in-memory build; against datatrove, both paths tokenize the same documents; pairs alternate, the ratio is their
median; the corpus and the split are deterministic; the command line writes its report.

Run:
    python -m pytest tests/benchmarks/test_tokenizing.py -q
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import tokenizing
from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))  # tests/data/: the in-memory oracle
from _inmemory_cache import in_memory_arrays

pytestmark = pytest.mark.benchmark


def _files(directory: str) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime ns)}`` of every file below ``directory``."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(directory).rglob("*") if p.is_file()}


@pytest.mark.timeout(600)
def test_a_quick_run_against_encode_batch_reports_every_figure_and_builds_the_in_memory_entry(tmp_path):
    rows = tokenizing.run([0.2, 0.4], tmp_path, quick=True, keep=True)
    assert [row["corpus_mb"] for row in rows] == [0.2, 0.4]
    for row in rows:
        corpus = Path(row["corpus"])
        assert row["bytes"] == corpus.stat().st_size >= row["corpus_mb"] * (1 << 20)
        with open(corpus, encoding="utf-8") as lines:
            assert row["num_docs"] == sum(1 for _ in lines)
        [pair] = row["pairs"]
        assert 0 < pair["rss_after_import_mb"] <= pair["peak_rss_mb"]
        assert row["peak_above_import_mb"] == pytest.approx(pair["peak_rss_mb"] - pair["rss_after_import_mb"])
        assert row["cache_tokens_per_s"] == pytest.approx(row["num_tokens"] / pair["cache_s"])
        assert row["peer_tokens_per_s"] == pytest.approx(row["num_tokens"] / pair["peer_s"])
        assert row["ratio"] == pytest.approx(row["cache_tokens_per_s"] / row["peer_tokens_per_s"])
        assert pair["peer_s"] <= pair["peer_wall_s"] and pair["cache_docs"] == pair["peer_docs"] == row["num_docs"]
        reference = in_memory_arrays(resolve_corpus(corpus), resolve_tokenizer())
        built = _files(pair["cache_dir"])
        cached = load_or_build(resolve_corpus(corpus), resolve_tokenizer(), pair["cache_dir"])
        assert built and _files(pair["cache_dir"]) == built  # prepare_data built the entry; the look-up wrote nothing
        for name, expected in reference.items():
            np.testing.assert_array_equal(getattr(cached, name), expected, err_msg=name)
        assert row["num_tokens"] == len(reference["token_ids"])
        assert len(cached) + cached.num_empty == row["num_docs"]


@pytest.mark.timeout(600)
def test_a_quick_run_against_datatrove_tokenizes_the_same_documents_and_cleans_up(tmp_path):
    pytest.importorskip("datatrove")
    [row] = tokenizing.run([0.3], tmp_path, peer="datatrove", pairs=2, workers=2)
    assert row["bytes"] >= int(0.3 * (1 << 20)) and row["num_tokens"] > 0 and row["peer"] == "datatrove"
    assert [p["first"] for p in row["pairs"]] == ["cache", "datatrove"]  # alternating order
    for pair in row["pairs"]:
        assert pair["num_tokens"] == row["num_tokens"] and pair["cache_docs"] == row["num_docs"]
        assert pair["peer_docs"] <= row["num_docs"]  # datatrove writes no empty document
        assert pair["ratio"] == pytest.approx(pair["peer_s"] / pair["cache_s"])
        assert 0 < pair["peer_executor_s"] <= pair["peer_s"]
    assert row["ratio"] == pytest.approx(statistics.median(p["ratio"] for p in row["pairs"]))
    assert row["peer_tokens_per_s"] == pytest.approx(
        statistics.median(row["num_tokens"] / p["peer_s"] for p in row["pairs"]))
    assert list(tmp_path.iterdir()) == []  # the corpus, stores and caches are removed
    assert "| datatrove |" in tokenizing.table([row])


def test_the_corpus_is_sampled_deterministically(tmp_path):
    first = tokenizing.make_corpus(tmp_path / "a.jsonl", 0.05, seed=3)
    second = tokenizing.make_corpus(tmp_path / "b.jsonl", 0.05, seed=3)
    assert first == second and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert first["bytes"] >= 0.05 * (1 << 20)
    other = tokenizing.make_corpus(tmp_path / "c.jsonl", 0.05, seed=4)
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes() or other != first


def test_the_split_keeps_every_line_once_in_order(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(7)))
    parts = tokenizing.split_lines(corpus, tmp_path / "parts", 3)
    assert [p.name for p in parts] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert "".join(p.read_text() for p in parts) == corpus.read_text()
    assert [len(p.read_text().splitlines()) for p in parts] == [2, 2, 3]


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"sizes_mb must be positive numbers of MiB, got \[0, -1\]"):
        tokenizing.run([5, 0, -1], tmp_path)
    for pairs in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"pairs must be a positive int, got"):
            tokenizing.run([5], tmp_path, pairs=pairs)
    with pytest.raises(ValueError, match=r"peer must be one of \('encode_batch', 'datatrove'\), got 'spacy'"):
        tokenizing.run([5], tmp_path, peer="spacy")


@pytest.mark.timeout(600)
def test_pairs_alternate_which_runs_first_and_report_the_median_ratio(tmp_path, monkeypatch):
    calls = []
    seconds = iter([2.0, 1.0, 1.0, 4.0, 3.0, 1.0])  # per call, in call order: ratios 0.5, 0.25 and 1/3

    def fake_child(kind, *args):
        calls.append(kind)
        out = {"num_docs": 7, "num_tokens": 100, "seconds": next(seconds), "lengths_digest": "same"}
        if kind == "cache":
            return {**out, "rss_after_import_kib": 1024, "peak_rss_kib": 2048 * (len(calls) + 1)}
        return {**out, "wall_s": out["seconds"]}

    monkeypatch.setattr(tokenizing, "_run_child", fake_child)

    def fake_corpus(path, size, seed):
        path.write_text("{}\n", encoding="utf-8")
        return {"bytes": 10, "num_docs": 7}

    monkeypatch.setattr(tokenizing, "make_corpus", fake_corpus)
    [row] = tokenizing.run([0.1], tmp_path, pairs=3)
    assert calls == ["cache", "encode_batch", "encode_batch", "cache", "cache", "encode_batch"]
    assert [p["ratio"] for p in row["pairs"]] == pytest.approx([0.5, 0.25, 1 / 3])
    assert row["ratio"] == pytest.approx(1 / 3) and len(row["pairs"]) == 3
    assert row["cache_tokens_per_s"] == pytest.approx(100 / 3) and row["peer_tokens_per_s"] == pytest.approx(100)
    assert row["peak_above_import_mb"] == pytest.approx(2 * 6 - 1)  # the largest over pairs (fifth call)
    assert "0.33 (0.50, 0.25, 0.33)" in tokenizing.table([row])


def test_two_paths_that_saw_different_documents_are_refused(tmp_path, monkeypatch):
    def fake_child(kind, *args):
        return {"num_docs": 7, "num_tokens": 100, "seconds": 1.0, "lengths_digest": kind,
                "rss_after_import_kib": 1, "peak_rss_kib": 2}

    monkeypatch.setattr(tokenizing, "_run_child", fake_child)
    with pytest.raises(RuntimeError, match="different documents"):
        tokenizing.run([0.01], tmp_path)


def test_the_command_line_writes_results(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizing, "run", lambda sizes, work_dir, quick, **kwargs: [])
    results = tokenizing.main(["--quick", "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results["rows"] == []
    assert results["command"] == f"python -m benchmarks.tokenizing --quick --output-dir {tmp_path}"
