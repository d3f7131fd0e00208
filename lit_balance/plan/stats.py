"""Figures of merit of an epoch plan: padding, per-step rank imbalance, useful compute fraction, persistence.

Padded plans (rows padded to the longest row of their micro-batch) and packed plans (each micro-batch one row of
whole documents, ``packing=True``) are measured alike, each under its own micro-batch cost
(:meth:`CostModel.batch_cost` or :meth:`CostModel.packed_cost`). :func:`useful_fraction_bound` gives the best
useful compute fraction any plan with the same optimizer steps could reach, so a plan's U can be judged
against what its costliest documents allow.

Every figure is computed by one code path from the same arrays, whether the micro-batches come from an
:class:`~lit_balance.EpochPlan` or from any sampler as per-rank lists of micro-batches
(``rank_batches[rank][micro_step]`` -> sample indices), so lit_balance and its peers are measured alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lit_balance._checks import check_int, check_speeds
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModel, CostModelProtocol, check_cost_model  # noqa: F401 (CostModel: examples)
from lit_balance.plan.epoch import PLANNERS, Planner
from lit_balance.plan.types import EpochPlan

__all__ = ["PlanStats", "RankBatches", "batch_persistence", "plan_stats", "useful_fraction_bound"]

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
    sum_per_batch = EpochPlan.sum_per_batch
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
        raise InputTypeError(f"plan must be a lit_balance EpochPlan or per-rank lists of micro-batches "
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
        raise InputValueError(f"micro-batches must hold sample indices >= 0, got {int(rows.min())}")
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
        real_cost: cost of the real tokens of real rows (:meth:`CostModel.row_cost` of each), summed.
        max_batch_tokens: the largest padded token slots of any micro-batch.
        batch_padded_tokens: int64 ``[num_batches]``: padded token slots (rows x longest row) of each micro-batch.
        dropped_samples: samples of ``lengths`` that no micro-batch holds.
        duplicated_rows: rows beyond the first of each sample (fill rows and repeats).
        useful_fraction_bound: the upper bound on :attr:`useful_fraction` of :func:`useful_fraction_bound` for
            this plan's optimizer steps, or None when ``max_tokens`` was not given to :func:`plan_stats`.
        rank_speeds: float64 ``[num_replicas]`` relative rank speeds :attr:`useful_fraction` weighs ranks by, or None
            for equal ranks.
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
    useful_fraction_bound: float | None = None
    rank_speeds: np.ndarray | None = None

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
        and per-step imbalance alike. With :attr:`rank_speeds` ``s``, a rank's time is its cost over its speed and
        U = real-token cost / sum over optimizer steps of (``sum(s)`` x the slowest rank's time): the share of the
        ranks' capacity spent on real tokens.
        """
        if self.rank_speeds is not None:
            denom = float((self.rank_cost / self.rank_speeds).max(axis=1).sum()) * float(self.rank_speeds.sum())
            return self.real_cost / denom if denom > 0 else 1.0
        denom = float(self.rank_cost.max(axis=1).sum()) * self.rank_cost.shape[1]
        return self.real_cost / denom if denom > 0 else 1.0

    def over_budget_ratio(self, max_tokens: int) -> float:
        """Share of the non-empty micro-batches whose padded slots (rows x longest row) exceed ``max_tokens``."""
        slots = self.batch_padded_tokens[self.batch_padded_tokens > 0]
        return float(np.mean(slots > max_tokens)) if slots.size else 0.0

    def budget_fill_ratio(self, max_tokens: int) -> float:
        """Mean padded slots per micro-batch over ``max_tokens`` (all ranks)."""
        return float(self.rank_padded_tokens.sum()) / max(int(self.rank_micro_batches.sum()) * max_tokens, 1)


def plan_stats(
    plan: EpochPlan | RankBatches,
    lengths: np.ndarray,
    cost_model: CostModelProtocol | None = None,
    *,
    pad_to_multiple_of: int = 1,
    accumulate_grad_batches: int = 1,
    planner: Planner | None = None,
    max_tokens: int | None = None,
    rank_speeds: np.ndarray | None = None,
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
        planner: the planner whose layout the micro-batches have (:func:`~lit_balance.plan.planner_for` of the
            settings), which says a micro-batch's cost and slots; None: the padded one. Packed micro-batches
            (``BatchingSettings(packing=True)``) each cost :meth:`CostModel.packed_cost` of their documents (fill rows
            included: they run), and their padded slots are their real tokens rounded up to ``pad_to_multiple_of``
            (the padded tail of the row), so the padding ratio is 0 without rounding.
        max_tokens: the budget per micro-batch (tokens); when given, :attr:`PlanStats.useful_fraction_bound` is
            computed for this plan's optimizer steps (per-rank budgets: pass the largest).
        rank_speeds: float ``[num_replicas]`` relative rank speeds that :attr:`PlanStats.useful_fraction` weighs the
            ranks by (ranks of different speed), or None for equal ranks.

    Raises:
        ValueError: ``accumulate_grad_batches`` or ``pad_to_multiple_of`` < 1; ``lengths`` not 1-D or too short;
            a negative index in per-rank lists; ``rank_speeds`` of another length than the ranks, or not positive.
        TypeError: a non-int ``accumulate_grad_batches`` / ``pad_to_multiple_of``; ``cost_model`` not a CostModel;
            ``plan`` neither an EpochPlan nor per-rank lists.

    Example:
        >>> s = plan_stats([[[0, 1]], [[2]]], np.array([4, 2, 3]))  # 2 ranks: slots 2 x 4 and 1 x 3
        >>> s.rank_padded_tokens.tolist(), round(s.padding_ratio, 3), s.step_imbalance.tolist()
        ([8, 3], 0.182, [1.4545454545454546])
    """
    accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                                        "micro-batches per rank per optimizer step")
    pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, 1, "use the sampler's value (1: none)")
    cost_model = check_cost_model(cost_model)
    p = _batches(plan)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (p.rows.size and int(p.rows.max()) >= lengths.shape[0]):
        raise InputValueError(
            f"lengths must be 1-D with an entry for every planned sample (the plan uses index "
            f"{int(p.rows.max()) if p.rows.size else -1}), got shape {lengths.shape}; pass sampler.lengths"
        )
    offsets = p.batch_offsets
    num_batches = p.num_batches
    planner = PLANNERS["padded"] if planner is None else planner
    batch_cost, slots = planner.batch_costs(lengths, p.rows, offsets, pad_to_multiple_of, cost_model)
    real_rows = ~p.is_fill
    batch_real = p.real_tokens_per_batch(lengths)

    a = p.assignment  # [num_micro_steps, R]; -1 (no micro-batch) picks the appended zero
    cost = np.append(np.asarray(batch_cost, dtype=np.float64), 0.0)[a]
    groups = np.arange(a.shape[0]) // accumulate_grad_batches
    num_groups = int(groups[-1]) + 1 if a.shape[0] else 0
    rank_cost = np.zeros((num_groups, a.shape[1]))
    np.add.at(rank_cost, groups, cost)
    speeds = check_speeds(rank_speeds, a.shape[1])
    counts = np.bincount(p.rows, minlength=lengths.shape[0])
    real_lengths = lengths[p.rows[real_rows]]
    bound = None
    if max_tokens is not None:
        bound = useful_fraction_bound(real_lengths, cost_model, num_replicas=a.shape[1], num_micro_steps=a.shape[0],
                                      accumulate_grad_batches=accumulate_grad_batches, max_tokens=max_tokens)
    return PlanStats(
        rank_cost=rank_cost,
        rank_real_tokens=np.append(batch_real, 0.0)[a].sum(axis=0).astype(np.int64),
        rank_padded_tokens=np.append(slots, 0)[a].sum(axis=0).astype(np.int64),
        rank_micro_batches=(a >= 0).sum(axis=0).astype(np.int64),
        real_cost=float(cost_model.row_cost(real_lengths).sum()),
        max_batch_tokens=int(slots.max()) if num_batches else 0,
        batch_padded_tokens=slots.astype(np.int64),
        dropped_samples=int((counts == 0).sum()),
        duplicated_rows=int(np.maximum(counts - 1, 0).sum()),
        useful_fraction_bound=bound,
        rank_speeds=speeds,
    )


def useful_fraction_bound(lengths: np.ndarray, cost_model: CostModelProtocol | None = None, *, num_replicas: int,
                          num_micro_steps: int, accumulate_grad_batches: int = 1, max_tokens: int) -> float:
    """Upper bound on the useful compute fraction U of any plan of these documents with these optimizer steps.

    U (:attr:`PlanStats.useful_fraction`) divides the real-token cost ``W`` by ``R x`` the sum over optimizer steps
    of the slowest rank's cost. Each rank runs ``n_s`` micro-batches in step ``s`` (``accumulate_grad_batches``, the
    last step maybe fewer), so the slowest rank costs ``n_s * per_batch + X_s``, where ``X_s`` is the most document
    cost any rank carries in the step. Three facts bound ``sum_s X_s`` from below, for any plan:

    1. the ranks share the work: ``sum_s X_s >= W / R``;
    2. documents longer than ``max_tokens / 2`` cannot share a micro-batch, and a step has ``R * A`` micro-batches
       (``A = accumulate_grad_batches``), so the ``j``-th largest ``X_s`` is at least ``beta_j``, the cost of the
       ``((j - 1) * R * A + 1)``-th costliest such document (0 past the last): outliers can at best run ``R * A``
       to a step, side by side (the "outlier delay" of WLB-LLM, OSDI 2025);
    3. a step holds at most ``R * A * max_tokens`` tokens, so the steps other than the ``k`` with the largest
       ``X_s`` hold at least ``N - k * R * A * max_tokens`` of the ``N`` tokens, costing at least ``Cheap(.)``,
       the cost of that many of the cheapest tokens (those of the shortest documents, the last one in part);
       the ranks share it: those steps' ``X_s`` sum to at least ``Cheap(.) / R``.

    Hence ``sum_s X_s >= LB = max(W / R, max over k of [sum_{j<=k} beta_j + max(sum_{j>k} beta_j, Cheap(N - k R A
    max_tokens) / R)])`` and ``U <= W / (R * (num_micro_steps * per_batch + LB))``. It is a bound, not always
    reachable (documents are whole, ranks' micro-batches hold at most ``max_tokens`` each); with short documents
    and no per-batch cost it is 1.

    Args:
        lengths: int ``[num_documents]``: tokens of each document planned (fill rows excluded).
        cost_model: the cost model U is measured in (default: tokens).
        num_replicas: ranks ``R``.
        num_micro_steps: micro-batches per rank in the epoch.
        accumulate_grad_batches: micro-batches per rank per optimizer step ``A``.
        max_tokens: the budget of one micro-batch (tokens).

    Returns:
        The bound, in ``(0, 1]`` (1.0 for no documents).

    Raises:
        ValueError: a count below 1 (``num_micro_steps`` below 0).

    Example:
        >>> cm = CostModel(quadratic=1e-3)  # three 4096-token documents and 64 of 100 tokens, 2 ranks, 3 steps
        >>> round(useful_fraction_bound([4096] * 3 + [100] * 64, cm, num_replicas=2, num_micro_steps=3,
        ...                             max_tokens=4096), 4)
        0.8097

        Two outliers run side by side in one step, the third with 40 short documents beside it in the next, and
        the last 24 short ones share the third step: U = 69,659 / (2 x 43,066) = 0.8088, near the bound.
    """
    num_replicas = check_int("num_replicas", num_replicas, 1, "the world size")
    num_micro_steps = check_int("num_micro_steps", num_micro_steps, 0, "micro-batches per rank")
    accumulate = check_int("accumulate_grad_batches", accumulate_grad_batches, 1, "micro-batches per optimizer step")
    max_tokens = check_int("max_tokens", max_tokens, 1, "tokens per micro-batch")
    cost_model = check_cost_model(cost_model)
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))  # shortest (cheapest per token) first
    if not lengths.size:
        return 1.0
    cost = cost_model.row_cost(lengths)
    total_cost, total_tokens = float(cost.sum()), int(lengths.sum())
    steps = -(-num_micro_steps // accumulate)
    per_step = num_replicas * accumulate
    long_cost = cost[2 * lengths > max_tokens][::-1]  # costliest first
    beta = np.zeros(steps + 1)
    heads = long_cost[::per_step][:steps]
    beta[1:heads.shape[0] + 1] = heads
    beta_prefix = np.cumsum(beta)  # beta_prefix[k] = sum_{j<=k} beta_j
    rest_beta = beta_prefix[-1] - beta_prefix
    ks = np.arange(steps + 1)
    need = np.maximum(total_tokens - ks * per_step * max_tokens, 0)  # tokens the other steps must hold
    need[-1] = 0  # k = all steps: no other steps
    cum_tokens = np.concatenate([[0], np.cumsum(lengths)])
    cum_cost = np.concatenate([[0.0], np.cumsum(cost)])
    i = np.clip(np.searchsorted(cum_tokens, need, side="right") - 1, 0, lengths.shape[0] - 1)
    cheap = cum_cost[i] + (need - cum_tokens[i]) * (cost[i] / lengths[i])
    lower = max(total_cost / num_replicas, float(np.max(beta_prefix + np.maximum(rest_beta, cheap / num_replicas))))
    denominator = num_replicas * (num_micro_steps * cost_model.per_batch + lower)
    return min(1.0, total_cost / denominator) if denominator > 0 else 1.0


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
