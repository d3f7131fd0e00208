"""The pool-partition frontier against every pool partition, by enumeration; the table's rows."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks._harness import load_lengths
from lit_balance import BalancedBatchSampler
from lit_balance.plan import batch_persistence, plan_stats
from research import pool_partitions


def _pool_partitions(lengths: np.ndarray, tokens_per_batch: float) -> list[tuple[float, float]]:
    """(padding ratio, persistence) of every contiguous partition of the distinct lengths, by enumeration."""
    values = np.unique(lengths)
    out = []
    for cut_mask in itertools.product((False, True), repeat=values.size - 1):
        bounds = [0, *[i + 1 for i, cut in enumerate(cut_mask) if cut], values.size]
        pad = pers = 0.0
        for lo, hi in itertools.pairwise(bounds):
            pool = lengths[(lengths >= values[lo]) & (lengths <= values[hi - 1])]
            rows = max(tokens_per_batch / pool.max(), 1.0)
            pad += float((pool.max() - pool).sum())
            pers += pool.size * min(1.0, (rows - 1.0) / max(pool.size - 1, 1))
        out.append((pad / (lengths.sum() + pad), pers / lengths.size))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=2, max_size=40), st.integers(4, 64))
def test_pool_partition_frontier_is_pareto_optimal_among_all_pool_partitions(lengths, tokens_per_batch):
    lengths = np.array(lengths)
    every = _pool_partitions(lengths, float(tokens_per_batch))
    points = pool_partitions.pool_partition_frontier(lengths, float(tokens_per_batch))
    for pad, pers in points:
        assert any(math.isclose(pad, p, abs_tol=1e-12) and math.isclose(pers, q, abs_tol=1e-12) for p, q in every)
        assert not any(p < pad - 1e-12 and q < pers - 1e-12 for p, q in every)  # nothing better on both
    # the extremes are reached: one pool per length (least padding) is on the frontier
    assert min(p for p, _ in points) == pytest.approx(min(p for p, _ in every), abs=1e-12)


def test_persistence_bound_rows_match_the_default_plans():
    lengths = load_lengths("fortunes", 64, 400)
    rows = {r["ranks"]: r for r in pool_partitions.persistence_bound_rows(lengths, [2, 3], max_tokens=256, seed=0)}
    for ranks, row in rows.items():
        sampler = BalancedBatchSampler(lengths, 256, num_replicas=ranks, rank=0, seed=0)
        p0, p1 = sampler.plan(0), sampler.plan(1)
        assert row["persistence"] == pytest.approx(batch_persistence(p0, p1))
        assert row["padding_ratio"] == pytest.approx(plan_stats(p0, sampler.lengths).padding_ratio)
        assert 0.0 <= row["pool_persistence_at_padding"] <= 1.0 and 0 < row["tokens_per_batch"] <= 256
