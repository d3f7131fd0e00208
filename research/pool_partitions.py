"""Persistence against padding: lit_balance's default plans beside the best partitions of the lengths into pools.

Run: ``python -m research.pool_partitions`` (8 and 64 ranks, the shipped distributions capped at 512 tokens, 4,096
padded slots per micro-batch); the table of a run is in ``docs/benchmarks/reports/2026-11-29-samplers.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks._harness import DISTRIBUTIONS, load_lengths
from lit_balance import BalancedBatchSampler, CostModel
from lit_balance.plan import batch_persistence, plan_stats

__all__ = ["persistence_bound_rows", "pool_partition_frontier"]


def pool_partition_frontier(lengths: np.ndarray, tokens_per_batch: float, num_lambdas: int = 60,
                            ) -> list[tuple[float, float]]:
    """Padding against persistence of the best *pool partitions* of ``lengths`` (an estimate, for comparison).

    A pool partition splits the distinct lengths into contiguous ranges (pools); every epoch it shuffles each
    pool and cuts it into micro-batches of ``tokens_per_batch / longest length in the pool`` rows, all padded to
    that longest length. Its expected padding slots are ``sum(pool max - length)``; a sample's expected
    persistence is ``(rows - 1) / (pool size - 1)`` (at most 1). An exact dynamic program over the distinct
    lengths minimises ``padding slots + lambda x summed persistence`` for ``num_lambdas`` values of lambda
    (log-spaced), giving points of the lower convex frontier. Noisy-sort orders (``shuffle_window``) are not
    pool partitions, but if this frontier needs more padding than a target allows, mixing lengths cannot
    reach that persistence cheaply either.

    Args:
        lengths: int ``[num_samples]``, tokens per sample (capped).
        tokens_per_batch: padded token slots per micro-batch (e.g. a plan's mean), > 0.

    Returns:
        ``(padding_ratio, persistence)`` points, global (all samples), one per lambda.
    """
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    cum_n = np.concatenate([[0], np.cumsum(counts)])
    cum_t = np.concatenate([[0], np.cumsum(counts * values)])
    total, num = float(cum_t[-1]), float(cum_n[-1])
    points = []
    for lam in np.geomspace(1e-2, 1e4, num_lambdas):
        best, pad, pers = np.zeros(values.size + 1), np.zeros(values.size + 1), np.zeros(values.size + 1)
        for j in range(1, values.size + 1):  # pools end at distinct length j - 1; i: first length of the pool
            i = np.arange(j)
            n = cum_n[j] - cum_n[i]
            pool_pad = n * values[j - 1] - (cum_t[j] - cum_t[i])
            rows = max(tokens_per_batch / values[j - 1], 1.0)
            pool_pers = n * np.minimum(1.0, (rows - 1.0) / np.maximum(n - 1, 1))
            k = int(np.argmin(best[i] + pool_pad + lam * pool_pers))
            best[j] = best[k] + pool_pad[k] + lam * pool_pers[k]
            pad[j], pers[j] = pad[k] + pool_pad[k], pers[k] + pool_pers[k]
        points.append((float(pad[-1] / (total + pad[-1])), float(pers[-1] / num)))
    return points


def persistence_bound_rows(lengths: np.ndarray, ranks: Sequence[int], max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """lit_balance at defaults beside the best pool partitions (:func:`pool_partition_frontier`) per rank count.

    Pools are cut into micro-batches of the default plan's mean padded slots, so both use the same number of
    micro-batches. Rows: the default plan's padding ratio and persistence, the least persistence of any pool
    partition at no more padding, and the least padding of any pool partition with persistence <= 0.2.
    """
    rows = []
    for num_replicas in ranks:
        sampler = BalancedBatchSampler(lengths, max_tokens, num_replicas=num_replicas, rank=0, seed=seed)
        p0, p1 = sampler.plan(0), sampler.plan(1)
        stats = plan_stats(p0, sampler.lengths, CostModel())
        per_batch = float(stats.rank_padded_tokens.sum()) / max(p0.num_batches, 1)
        points = pool_partition_frontier(sampler.lengths, per_batch)
        pads = [pad for pad, pers in points if pers <= 0.2]
        rows.append({"ranks": num_replicas, "tokens_per_batch": per_batch, "padding_ratio": stats.padding_ratio,
                     "persistence": batch_persistence(p0, p1),
                     "pool_persistence_at_padding": min((pers for pad, pers in points
                                                         if pad <= stats.padding_ratio), default=1.0),
                     "pool_padding_for_0.2": min(pads) if pads else None})
    return rows


if __name__ == "__main__":
    print("| distribution | ranks | slots per micro-batch | lit_balance padding | lit_balance persistence | best pool "
          "persistence at that padding | least pool padding for persistence <= 0.2 |\n|---|---|---|---|---|---|---|")
    for name in DISTRIBUTIONS:
        for row in persistence_bound_rows(load_lengths(name, 512), [8, 64], max_tokens=4096, seed=0):
            need = row["pool_padding_for_0.2"]
            print(f"| {name} | {row['ranks']} | {row['tokens_per_batch']:.0f} | {row['padding_ratio']:.3f} | "
                  f"{row['persistence']:.3f} | {row['pool_persistence_at_padding']:.3f} | "
                  f"{'none' if need is None else f'{need:.3f}'} |")
