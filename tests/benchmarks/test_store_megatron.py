"""benchmarks/store_megatron.py: its rows and its NumPy-written index (never its speed), on --quick sizes.

Run:
    python -m pytest tests/benchmarks/test_store_megatron.py -q
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from benchmarks import store_megatron
from benchmarks.scale import pooled_lengths

pytestmark = pytest.mark.benchmark


def test_numpy_written_index_reads_back_through_megatron_core(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    pool = pooled_lengths(256)
    tokens = store_megatron.write_store(tmp_path / "s", 3000, pool, seed=2)
    reference = IndexedDataset(str(tmp_path / "s"))
    assert int(reference.sequence_lengths.sum()) == tokens and len(reference) == 3000
    assert np.array_equal(reference.document_indices, np.arange(3001))
    assert reference[2999].shape == (int(reference.sequence_lengths[-1]),)
    assert (tmp_path / "s.bin").stat().st_size == tokens * 2


def test_quick_rows(tmp_path):
    results = store_megatron.main(["--quick", "--num-replicas", "2", "--max-tokens", "2048", "--max-length", "1024",
                                   "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results["rows"]
    rows = results["rows"]
    assert [(r["path"], r["num_documents"]) for r in rows] == [("store", 2000), ("cache", 2000), ("store", 20000)]
    store, cache = rows[0], rows[1]
    for r in rows:
        assert 0 < r["setup_s"] <= r["first_batch_s"] and r["peak_rss_mb"] >= r["rss_after_import_mb"] > 0
        assert r["micro_batches_per_rank"] > 0 and r["first_batch_rows"] > 0
    assert store["cache_written"] is False and cache["prepare_data_s"] > 0
    assert store["micro_batches_per_rank"] == cache["micro_batches_per_rank"]  # the same lengths, the same plan
    assert store["num_documents"] == cache["num_documents"] == 2000
