"""Figures of merit of an epoch plan: padding, per-step rank imbalance, useful compute fraction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lit_balance._validate import check_int
from lit_balance.cost import CostModel
from lit_balance.planning import EpochPlan, padded_lengths

__all__ = ["PlanStats", "batch_persistence", "plan_stats"]


@dataclass(frozen=True)
class PlanStats:
    """Figures of one epoch plan, all global (every rank) unless a name says per rank.

    Attributes:
        rank_cost: float64 ``[num_optimizer_steps, num_replicas]``: each rank's cost in each optimizer step
            (the sum over its micro-batches of that step), in the cost model's unit.
        rank_real_tokens: int64 ``[num_replicas]``: real tokens per rank over the epoch (fill rows excluded).
        rank_padded_tokens: int64 ``[num_replicas]``: padded token slots per rank over the epoch.
        rank_micro_batches: int64 ``[num_replicas]``: micro-batches per rank.
        real_cost: cost of the real tokens of real rows (:meth:`CostModel.real_cost`), summed.
        max_batch_tokens: the largest padded token slots of any micro-batch.
    """

    rank_cost: np.ndarray
    rank_real_tokens: np.ndarray
    rank_padded_tokens: np.ndarray
    rank_micro_batches: np.ndarray
    real_cost: float
    max_batch_tokens: int

    @property
    def padding_ratio(self) -> float:
        """Padding slots over padded slots, all ranks (``1 - real / padded``)."""
        return 1.0 - float(self.rank_real_tokens.sum()) / max(float(self.rank_padded_tokens.sum()), 1.0)

    @property
    def step_imbalance(self) -> np.ndarray:
        """float64 ``[num_optimizer_steps]``: max over ranks / mean over ranks of each step's cost (>= 1)."""
        mean = self.rank_cost.mean(axis=1)
        return np.divide(self.rank_cost.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)

    @property
    def useful_fraction(self) -> float:
        """U = real-token cost / sum over optimizer steps of (num_replicas x the slowest rank's cost).

        1.0 means no padding, no overhead and no rank ever waits; it falls with padding, per-batch overhead
        and per-step imbalance alike.
        """
        denom = float(self.rank_cost.max(axis=1).sum()) * self.rank_cost.shape[1]
        return self.real_cost / denom if denom > 0 else 1.0


def plan_stats(
    plan: EpochPlan,
    lengths: np.ndarray,
    cost_model: CostModel | None = None,
    *,
    pad_to_multiple_of: int = 1,
    accumulate_grad_batches: int = 1,
) -> PlanStats:
    """Compute :class:`PlanStats` of ``plan`` (vectorised; no communication).

    Args:
        plan: the epoch plan (all ranks), e.g. ``sampler.plan(epoch)``.
        lengths: int ``[num_samples]``: tokens per sample as planned (``sampler.lengths``).
        cost_model: cost of a micro-batch; default :class:`CostModel()` (padded token slots).
        pad_to_multiple_of: rows are padded to a multiple of this (tokens), as in the sampler.
        accumulate_grad_batches: micro-batches per rank per optimizer step; ranks wait for each other once
            per optimizer step, so a rank's cost per step is the sum over this many micro-batches (the last
            step may be shorter).

    Raises:
        ValueError: ``accumulate_grad_batches`` or ``pad_to_multiple_of`` < 1; ``lengths`` not 1-D or too short.
        TypeError: a non-int ``accumulate_grad_batches`` / ``pad_to_multiple_of``; ``cost_model`` not a CostModel.
    """
    accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                                        "micro-batches per rank per optimizer step")
    pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, 1, "use the sampler's value (1: none)")
    cost_model = cost_model or CostModel()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a lit_balance.CostModel or None, got {type(cost_model).__name__}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (plan.rows.size and int(plan.rows.max()) >= lengths.shape[0]):
        raise ValueError(
            f"lengths must be 1-D with an entry for every planned sample (the plan uses index "
            f"{int(plan.rows.max()) if plan.rows.size else -1}), got shape {lengths.shape}; pass sampler.lengths"
        )
    padded = padded_lengths(lengths, pad_to_multiple_of)
    offsets = plan.batch_offsets
    num_batches = plan.num_batches
    sizes = np.diff(offsets)
    width = np.maximum.reduceat(padded[plan.rows], offsets[:-1]) if num_batches else np.zeros(0, np.int64)
    batch_cost = cost_model.batch_cost(sizes, width) if num_batches else np.zeros(0)
    real_rows = ~plan.is_fill
    batch_real = plan.real_tokens_per_batch(lengths)

    a = plan.assignment  # [num_micro_steps, R]
    cost = np.asarray(batch_cost, dtype=np.float64)[a] if a.size else np.zeros(a.shape)
    groups = np.arange(a.shape[0]) // accumulate_grad_batches
    num_groups = int(groups[-1]) + 1 if a.shape[0] else 0
    rank_cost = np.zeros((num_groups, a.shape[1]))
    np.add.at(rank_cost, groups, cost)
    return PlanStats(
        rank_cost=rank_cost,
        rank_real_tokens=batch_real[a].sum(axis=0).astype(np.int64) if a.size else np.zeros(a.shape[1], np.int64),
        rank_padded_tokens=(sizes * width)[a].sum(axis=0).astype(np.int64) if a.size else np.zeros(a.shape[1], np.int64),
        rank_micro_batches=np.full(a.shape[1], a.shape[0], dtype=np.int64),
        real_cost=float(cost_model.real_cost(lengths[plan.rows[real_rows]]).sum()),
        max_batch_tokens=int((sizes * width).max()) if num_batches else 0,
    )


def batch_persistence(plan_a: EpochPlan, plan_b: EpochPlan) -> float:
    """Mean over samples of the share of their batch-mates in ``plan_a`` that are batch-mates again in ``plan_b``.

    0 means every sample meets new batch-mates; 1 means batch composition is frozen. Samples alone in their
    micro-batch in ``plan_a`` (no batch-mates) are left out of the mean; fill rows are ignored. Typically
    ``plan_a`` and ``plan_b`` are two consecutive epochs of one sampler.

    Returns:
        The mean share in [0, 1], or 0.0 when no sample has a batch-mate in ``plan_a``.
    """

    def batch_of(plan: EpochPlan, num_samples: int) -> np.ndarray:
        out = np.full(num_samples, -1, dtype=np.int64)
        real = ~plan.is_fill
        row_batch = np.repeat(np.arange(plan.num_batches), np.diff(plan.batch_offsets))
        out[plan.rows[real]] = row_batch[real]
        return out

    n = int(max(plan_a.rows.max(initial=-1), plan_b.rows.max(initial=-1))) + 1
    a, b = batch_of(plan_a, n), batch_of(plan_b, n)
    present = (a >= 0) & (b >= 0)
    size_a = np.bincount(a[a >= 0], minlength=plan_a.num_batches)
    a, b = a[present], b[present]
    keys = a * (plan_b.num_batches + 1) + b
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    mates_a = size_a[a] - 1
    has_mates = mates_a > 0
    if not has_mates.any():
        return 0.0
    return float(np.mean((counts[inverse] - 1)[has_mates] / mates_a[has_mates]))
