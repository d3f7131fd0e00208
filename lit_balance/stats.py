"""Figures of merit of an epoch plan: padding, per-step rank imbalance, useful compute fraction, persistence.

Every figure is computed by one code path from the same arrays, whether the micro-batches come from an
:class:`~lit_balance.planning.EpochPlan` or from any sampler as per-rank lists of micro-batches
(``rank_batches[rank][micro_step]`` -> sample indices), so lit_balance and its peers are measured alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lit_balance._validate import check_int
from lit_balance.cost import CostModel
from lit_balance.planning import EpochPlan, padded_lengths

__all__ = ["PlanStats", "RankBatches", "batch_persistence", "plan_stats"]

#: Micro-batches of any sampler: ``rank_batches[rank][micro_step]`` -> the sample indices of that micro-batch.
#: Ranks may hold different numbers of micro-batches (a rank without one at a step waits there).
RankBatches = Sequence[Sequence[Sequence[int]]]


@dataclass(frozen=True)
class _Batches:
    """The arrays every figure is computed from (the layout of :class:`EpochPlan`).

    ``assignment[s, r]`` is -1 where rank ``r`` has no micro-batch at micro-step ``s``.
    """

    rows: np.ndarray
    is_fill: np.ndarray
    batch_offsets: np.ndarray
    assignment: np.ndarray

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets.shape[0] - 1)

    # One implementation of per-batch sums: the plan's own (it reads only rows, is_fill and batch_offsets).
    _sum_per_batch = EpochPlan._sum_per_batch
    real_tokens_per_batch = EpochPlan.real_tokens_per_batch

    def row_batch(self) -> np.ndarray:
        """int64 ``[num_rows]``: the micro-batch of each row."""
        return np.repeat(np.arange(self.num_batches), np.diff(self.batch_offsets))


def _batches(plan: EpochPlan | RankBatches) -> _Batches:
    """The arrays of ``plan``; per-rank lists are flattened step-major (step 0 of every rank, then step 1, ...).

    In per-rank lists only the first occurrence of an index in the epoch counts as real; later ones are
    fill rows (a sampler repeating samples to even out counts, as ``DistributedSampler`` does).

    Raises:
        TypeError: ``plan`` is neither an EpochPlan nor a sequence of per-rank sequences of micro-batches.
        ValueError: a negative index.
    """
    if isinstance(plan, EpochPlan):
        return _Batches(plan.rows, plan.is_fill, plan.batch_offsets, plan.assignment)
    if isinstance(plan, (str, bytes, np.ndarray)) or not isinstance(plan, Sequence):
        raise TypeError(f"plan must be a lit_balance EpochPlan or per-rank lists of micro-batches "
                        f"(rank_batches[rank][step] -> indices), got {type(plan).__name__}")
    num_replicas = len(plan)
    num_steps = max((len(b) for b in plan), default=0)
    assignment = np.full((num_steps, num_replicas), -1, dtype=np.int64)
    batches: list[Sequence[int]] = []
    for s in range(num_steps):
        for r, rank in enumerate(plan):
            if s < len(rank):
                assignment[s, r] = len(batches)
                batches.append(rank[s])
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    rows = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=int(sizes.sum()))
    if rows.size and rows.min() < 0:
        raise ValueError(f"micro-batches must hold sample indices >= 0, got {int(rows.min())}")
    is_fill = np.ones(rows.shape[0], dtype=bool)
    is_fill[np.unique(rows, return_index=True)[1]] = False
    return _Batches(rows, is_fill, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), assignment)


@dataclass(frozen=True)
class PlanStats:
    """Figures of one epoch plan, all global (every rank) unless a name says per rank.

    Attributes:
        rank_cost: float64 ``[num_optimizer_steps, num_replicas]``: each rank's cost in each optimizer step
            (the sum over its micro-batches of that step), in the cost model's unit; 0 where a rank has none.
        rank_real_tokens: int64 ``[num_replicas]``: real tokens per rank over the epoch (fill rows excluded).
        rank_padded_tokens: int64 ``[num_replicas]``: padded token slots per rank over the epoch.
        rank_micro_batches: int64 ``[num_replicas]``: micro-batches per rank.
        real_cost: cost of the real tokens of real rows (:meth:`CostModel.real_cost`), summed.
        max_batch_tokens: the largest padded token slots of any micro-batch.
        batch_padded_tokens: int64 ``[num_batches]``: padded token slots (rows x longest row) of each micro-batch;
            with ``plan_stats(..., packing=True)`` the tokens of its packed row (the sum of its rows' lengths).
        dropped_samples: samples of ``lengths`` that no micro-batch holds.
        duplicated_rows: rows beyond the first of each sample (fill rows and repeats).
    """

    rank_cost: np.ndarray
    rank_real_tokens: np.ndarray
    rank_padded_tokens: np.ndarray
    rank_micro_batches: np.ndarray
    real_cost: float
    max_batch_tokens: int
    batch_padded_tokens: np.ndarray
    dropped_samples: int
    duplicated_rows: int

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

    def over_budget_ratio(self, max_tokens: int) -> float:
        """Share of the non-empty micro-batches whose token slots (:attr:`batch_padded_tokens`) exceed ``max_tokens``."""
        slots = self.batch_padded_tokens[self.batch_padded_tokens > 0]
        return float(np.mean(slots > max_tokens)) if slots.size else 0.0

    def budget_fill_ratio(self, max_tokens: int) -> float:
        """Mean padded slots per micro-batch over ``max_tokens`` (all ranks)."""
        return float(self.rank_padded_tokens.sum()) / max(int(self.rank_micro_batches.sum()) * max_tokens, 1)


def plan_stats(
    plan: EpochPlan | RankBatches,
    lengths: np.ndarray,
    cost_model: CostModel | None = None,
    *,
    pad_to_multiple_of: int = 1,
    accumulate_grad_batches: int = 1,
    packing: bool = False,
) -> PlanStats:
    """Compute :class:`PlanStats` of ``plan`` (vectorised; no communication).

    Args:
        plan: the epoch plan (all ranks), e.g. ``sampler.plan(epoch)``, or any sampler's micro-batches as
            per-rank lists (:data:`RankBatches`); in those, repeats of an index count as fill rows (padding).
        lengths: int ``[num_samples]``: tokens per sample as planned (``sampler.lengths``).
        cost_model: cost of a micro-batch; default :class:`CostModel()` (padded token slots).
        pad_to_multiple_of: rows are padded to a multiple of this (tokens), as in the sampler.
        accumulate_grad_batches: micro-batches per rank per optimizer step; ranks wait for each other once
            per optimizer step, so a rank's cost per step is the sum over this many micro-batches (the last
            step may be shorter).
        packing: each micro-batch is one packed row of whole documents (padding-free) instead of rows padded to
            the longest: its token slots (``batch_padded_tokens``, ``max_batch_tokens``, the budget figures) are
            its documents' lengths summed, fill rows included, rounded up to ``pad_to_multiple_of`` (the row's
            tail is padded), and it costs ``per_batch + sum over its documents of (linear * l + quadratic * l**2)``
            (the padded tail is not counted). Padding then counts fill rows and the tail only.

    Raises:
        ValueError: ``accumulate_grad_batches`` or ``pad_to_multiple_of`` < 1; ``lengths`` not 1-D or too short;
            a negative index in per-rank lists.
        TypeError: a non-int ``accumulate_grad_batches`` / ``pad_to_multiple_of``; ``cost_model`` not a CostModel;
            ``plan`` neither an EpochPlan nor per-rank lists; ``packing`` not a bool.

    Example:
        >>> s = plan_stats([[[0, 1]], [[2]]], np.array([4, 2, 3]))  # 2 ranks: slots 2 x 4 and 1 x 3
        >>> s.rank_padded_tokens.tolist(), round(s.padding_ratio, 3), s.step_imbalance.tolist()
        ([8, 3], 0.182, [1.4545454545454546])
        >>> s = plan_stats([[[0, 1]], [[2]]], np.array([4, 2, 3]), packing=True)  # packed rows of 4 + 2 and 3 tokens
        >>> s.rank_padded_tokens.tolist(), s.padding_ratio, s.step_imbalance.tolist()
        ([6, 3], 0.0, [1.3333333333333333])
    """
    accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                                        "micro-batches per rank per optimizer step")
    pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, 1, "use the sampler's value (1: none)")
    if not isinstance(packing, (bool, np.bool_)):
        raise TypeError(f"packing must be a bool (True: packed rows of whole documents), got {packing!r}")
    cost_model = cost_model or CostModel()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a lit_balance.CostModel or None, got {type(cost_model).__name__}")
    p = _batches(plan)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (p.rows.size and int(p.rows.max()) >= lengths.shape[0]):
        raise ValueError(
            f"lengths must be 1-D with an entry for every planned sample (the plan uses index "
            f"{int(p.rows.max()) if p.rows.size else -1}), got shape {lengths.shape}; pass sampler.lengths"
        )
    padded = padded_lengths(lengths, pad_to_multiple_of)
    offsets = p.batch_offsets
    num_batches = p.num_batches
    sizes = np.diff(offsets)
    filled = sizes > 0
    if packing:  # one row of whole documents, its tail padded to the multiple: sums over its documents
        tokens = p._sum_per_batch(lengths[p.rows])
        slots = padded_lengths(tokens, pad_to_multiple_of)
        doc_cost = np.concatenate([[0.0], np.cumsum(cost_model.row_cost(lengths[p.rows]))])
        batch_cost = np.where(filled, cost_model.per_batch + doc_cost[offsets[1:]] - doc_cost[offsets[:-1]], 0.0)
    else:
        width = np.zeros(num_batches, dtype=np.int64)
        if filled.any():  # segments of the non-empty batches are contiguous: empty ones hold no rows
            width[filled] = np.maximum.reduceat(padded[p.rows], offsets[:-1][filled])
        slots = sizes * width
        batch_cost = np.where(filled, cost_model.batch_cost(sizes, width), 0.0) if num_batches else np.zeros(0)
    real_rows = ~p.is_fill
    batch_real = p.real_tokens_per_batch(lengths)

    a = p.assignment  # [num_micro_steps, R]; -1 (no micro-batch) picks the appended zero
    cost = np.append(np.asarray(batch_cost, dtype=np.float64), 0.0)[a]
    groups = np.arange(a.shape[0]) // accumulate_grad_batches
    num_groups = int(groups[-1]) + 1 if a.shape[0] else 0
    rank_cost = np.zeros((num_groups, a.shape[1]))
    np.add.at(rank_cost, groups, cost)
    counts = np.bincount(p.rows, minlength=lengths.shape[0])
    return PlanStats(
        rank_cost=rank_cost,
        rank_real_tokens=np.append(batch_real, 0.0)[a].sum(axis=0).astype(np.int64),
        rank_padded_tokens=np.append(slots, 0)[a].sum(axis=0).astype(np.int64),
        rank_micro_batches=(a >= 0).sum(axis=0).astype(np.int64),
        real_cost=float(cost_model.real_cost(lengths[p.rows[real_rows]]).sum()),
        max_batch_tokens=int(slots.max()) if num_batches else 0,
        batch_padded_tokens=slots.astype(np.int64),
        dropped_samples=int((counts == 0).sum()),
        duplicated_rows=int(np.maximum(counts - 1, 0).sum()),
    )


def batch_persistence(plan_a: EpochPlan | RankBatches, plan_b: EpochPlan | RankBatches) -> float:
    """Mean over samples of the share of their batch-mates in ``plan_a`` that are batch-mates again in ``plan_b``.

    0 means every sample meets new batch-mates; 1 means batch composition is frozen. Samples alone in their
    micro-batch in ``plan_a`` (no batch-mates) and samples missing from either plan are left out of the mean;
    fill rows are ignored (in per-rank lists, :data:`RankBatches`, every occurrence of an index after its first).
    Typically ``plan_a`` and ``plan_b`` are two consecutive epochs of one sampler.

    Returns:
        The mean share in [0, 1], or 0.0 when no sample has a batch-mate in ``plan_a``.

    Raises:
        TypeError: a plan neither an EpochPlan nor per-rank lists.
        ValueError: a negative index in per-rank lists.

    Example:
        >>> batch_persistence([[[0, 1, 2]], [[3]]], [[[0, 1]], [[2, 3]]])  # 0, 1 keep half their mates; 2 none
        0.3333333333333333
    """
    pa, pb = _batches(plan_a), _batches(plan_b)

    def batch_of(p: _Batches, num_samples: int) -> np.ndarray:
        out = np.full(num_samples, -1, dtype=np.int64)
        real = ~p.is_fill
        out[p.rows[real]] = p.row_batch()[real]
        return out

    n = int(max(pa.rows.max(initial=-1), pb.rows.max(initial=-1))) + 1
    a, b = batch_of(pa, n), batch_of(pb, n)
    present = (a >= 0) & (b >= 0)
    size_a = np.bincount(a[a >= 0], minlength=pa.num_batches)
    a, b = a[present], b[present]
    keys = a * (pb.num_batches + 1) + b
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    mates_a = size_a[a] - 1
    has_mates = mates_a > 0
    if not has_mates.any():
        return 0.0
    return float(np.mean((counts[inverse] - 1)[has_mates] / mates_a[has_mates]))
