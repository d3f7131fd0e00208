"""Per-rank budgets: ``max_tokens`` with one value per data-parallel rank, for ranks of different memory.

With ``BatchingSettings(max_tokens=[...])`` rank ``r``'s micro-batches hold at most ``max_tokens[r]`` padded token
slots (packed: tokens of the row). :class:`PerRankPlanner` wraps a planner (padded or packed) and keeps its every
guarantee: equal micro-batch counts on every rank, every micro-batch within its own rank's budget, every sample
once, determinism, and exact resume. When every rank has the same budget it is the wrapped planner, with the same
plans as one int gives. Otherwise the ranks are split into classes of equal budget, the samples into the classes by
proportional shares (each sample to the eligible class furthest below its share, as in a largest-deficit
apportionment), and each class is planned by the wrapped planner on its own ranks:

1. **Classes.** Ranks with the same budget form a class; classes are ordered by budget, largest first.
2. **Membership.** Each sample goes to one class whose budget holds it (padded length within the budget), so a
   sample longer than a small rank's budget but within a larger one's is planned on a larger rank. The samples,
   longest first (ties by index), go one by one to the eligible class that holds the least padded tokens relative
   to its share, the sum of its ranks' speeds over all ranks' (equal ranks: its number of ranks): the faster
   classes take more, the short samples fill the small budgets, and each class gets a mix of lengths. The split
   is fixed by the lengths, budgets and speeds (never by the epoch or the cost model, so the epoch's length
   stays the same), and it is counted in padded tokens; a class that must take more tokens than its share (long
   samples only it holds) runs longer optimizer steps.
3. **Plans.** Each class is planned by the wrapped planner on its own ranks, budget and speeds, with every
   guarantee there. The class with the most micro-steps fixes the epoch's count; the others are planned again
   with that many (``min_steps``: smaller micro-batches). A class that still has fewer (too few samples fit its
   budget) runs fill micro-batches of one marked fill row each (its shortest sample, else the shortest sample of
   all): then there can be more fill rows than ``num_replicas - 1``, also with ``drop_last``.
4. **Steps.** Each class's optimizer steps are ordered by their time (the slowest rank's cost over its speed),
   longest first, a shorter last step staying last; the ``j``-th of every class run together, so long steps of
   one class meet long steps of the others. With ``shuffle`` the optimizer steps then run in random order
   (seeded by ``(seed, epoch)``) and ``largest_first`` moves the step holding the epoch's longest sample first.

Worked example (``max_tokens=[100, 50]``, 2 ranks, ``shuffle=False``, padded slots as the cost)::

    lengths = [80, 40, 40, 30, 20, 20, 10, 10]   # shares 1/2 each (equal speeds)
    # longest first, each to the eligible class holding the fewest tokens per share (ties: the larger budget):
    #   80 -> rank 0 (only it holds 80), 40 -> rank 1, 40 -> rank 1, 30 -> rank 0 (both hold 80: a tie),
    #   20 -> rank 1, 20 -> rank 1, 10 -> rank 0, 10 -> rank 0: rank 0 plans 80 30 10 10, rank 1 40 40 20 20
    # rank 1 needs 3 micro-batches ([40] [40] [20 20]), so rank 0 is planned with 3 too: [80] [30] [10 10]
    # steps, longest first on each rank: [80] + [40], [30] + [40], [10 10] + [20 20]

>>> from lit_balance import BatchingSettings, plan_epoch
>>> lengths = [80, 40, 40, 30, 20, 20, 10, 10]
>>> plan = plan_epoch(lengths, BatchingSettings(max_tokens=[100, 50], shuffle=False), num_replicas=2, epoch=0)
>>> [[[lengths[i] for i in plan.batch(b)[0]] for b in step] for step in plan.assignment.tolist()]
[[[80], [40]], [[30], [40]], [[10, 10], [20, 20]]]

Raises an :class:`~lit_balance.errors.InputValueError` naming ``max_tokens`` when its length is not
``num_replicas``, or when a rank's budget holds none of the samples (it could run no micro-batch).
"""

from __future__ import annotations

import functools

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.plan.assign import longest_first, shuffle_steps, steps_by_planning
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, empty_plan, padded_lengths

__all__ = ["PerRankPlanner", "budget_classes", "class_members", "plan_per_rank"]


def budget_classes(budgets: tuple[int, ...]) -> list[tuple[int, np.ndarray]]:
    """Ranks grouped by budget, largest budget first: ``[(budget, int64 ranks ascending), ...]``.

    Example:
        >>> [(b, r.tolist()) for b, r in budget_classes((50, 100, 50, 100))]
        [(100, [1, 3]), (50, [0, 2])]
    """
    values = np.asarray(budgets, dtype=np.int64)
    return [(int(b), np.flatnonzero(values == b)) for b in sorted(set(budgets), reverse=True)]


def class_members(padded: np.ndarray, candidates: np.ndarray, class_budgets: np.ndarray,
                  shares: np.ndarray) -> list[np.ndarray]:
    """Split ``candidates`` among the budget classes (stage 2 of the module docstring).

    Args:
        padded: int64 ``[num_samples]`` padded lengths (tokens).
        candidates: int64 indices of the samples to plan, each within the largest budget.
        class_budgets: int64 ``[num_classes]`` budgets, descending.
        shares: float64 ``[num_classes]`` each class's share of the tokens (positive).

    Returns:
        Per class, the int64 indices of its samples (ascending).
    """
    m = class_budgets.shape[0]
    order = candidates[np.lexsort((candidates, -padded[candidates]))]
    tokens = padded[order]
    # eligible classes of each sample: 0 .. last[i] (budgets descending)
    last = np.searchsorted(-class_budgets, -tokens, side="right") - 1
    owner = np.zeros(order.shape[0], dtype=np.int64)
    held = [0.0] * m
    share = shares.tolist()
    for i, (t, g) in enumerate(zip(tokens.tolist(), last.tolist())):
        best, best_ratio = 0, held[0] / share[0]
        for c in range(1, g + 1):
            ratio = held[c] / share[c]
            if ratio < best_ratio:
                best, best_ratio = c, ratio
        held[best] += t
        owner[i] = best
    return [np.sort(order[owner == c]) for c in range(m)]


def plan_per_rank(base, lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *,
                  num_replicas: int, epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray,
                  min_steps: int = 0) -> EpochPlan:
    """Plan one epoch with a budget per rank (stages 1 to 4 of the module docstring).

    Args:
        base: the wrapped planner (:class:`~lit_balance.plan.padded.PaddedPlanner` or the packed one).
        lengths: int64 ``[num_samples]``: tokens per sample (already truncated where that applies).
        candidates: int64 indices of the samples to plan, each within the largest budget once padded.
        settings: the batching settings; ``settings.max_tokens`` holds ``num_replicas`` budgets, not all equal.
        num_replicas: number of ranks.
        epoch: the epoch; with ``settings.shuffle`` the generators are seeded by ``(settings.seed, epoch)``.
        cost_model: the cost of a micro-batch.
        speeds: float64 ``[num_replicas]`` relative rank speeds.
        min_steps: at least this many micro-steps where the samples allow.

    Returns:
        The :class:`~lit_balance.plan.types.EpochPlan`; ``assignment[:, r]`` holds only micro-batches within
        ``max_tokens[r]``.

    Raises:
        ValueError: a rank whose budget holds none of the samples.
    """
    budgets = settings.rank_max_tokens(num_replicas)
    accumulate = settings.accumulate_grad_batches
    if not candidates.shape[0]:
        return empty_plan(num_replicas, accumulate)
    multiple = settings.pad_to_multiple_of
    padded = padded_lengths(lengths, multiple)
    classes = budget_classes(budgets)
    class_budgets = np.array([b for b, _ in classes], dtype=np.int64)
    shortest = int(np.argmin(padded))  # the first of the shortest samples: any class's last resort fill row
    if int(padded[shortest]) > int(class_budgets[-1]):
        small = [r for r, b in enumerate(budgets) if b < padded[shortest]]
        raise InputValueError(
            f"max_tokens={list(budgets)}: rank(s) {small} have a budget below every sample (the shortest, "
            f"index {shortest}, is {int(lengths[shortest])} tokens, {int(padded[shortest])} padded to a multiple "
            f"of {multiple}; an epoch planned in windows of plan_window samples looks at one window), so they could "
            f"run no micro-batch; raise those ranks' max_tokens to at least {int(padded[shortest])}",
            parameter="max_tokens")
    shares = np.array([float(speeds[ranks].sum()) for _, ranks in classes])
    members = class_members(padded, candidates, class_budgets, shares / shares.sum())

    def plan_class(c: int, least: int) -> EpochPlan | None:
        budget, ranks = classes[c]
        if not members[c].shape[0]:
            return None
        return base.plan(lengths, members[c], settings.replace(max_tokens=budget), num_replicas=ranks.shape[0],
                         epoch=epoch, cost_model=cost_model, speeds=speeds[ranks], min_steps=least)

    plans = [plan_class(c, min_steps) for c in range(len(classes))]
    steps = max(p.num_micro_steps for p in plans if p is not None)
    plans = [p if p is None or p.num_micro_steps >= steps else plan_class(c, steps) for c, p in enumerate(plans)]
    steps = max(p.num_micro_steps for p in plans if p is not None)  # a class planned again may reach further
    plans = [p if p is None or p.num_micro_steps >= steps else plan_class(c, steps) for c, p in enumerate(plans)]
    steps = max(p.num_micro_steps for p in plans if p is not None)

    rows, fills, offsets, dropped = [], [], [np.zeros(1, dtype=np.int64)], []
    num_rows = num_batches = 0
    out = np.empty((steps, num_replicas), dtype=np.int64)
    for c, ((budget, ranks), plan) in enumerate(zip(classes, plans)):
        plan = _with_fill_batches(plan, steps, ranks.shape[0], members[c], padded, candidates, budget, shortest,
                                  accumulate)
        cost = base.batch_costs(lengths, plan.rows, plan.batch_offsets, multiple, cost_model)[0]
        order = _steps_by_time(cost[plan.assignment] / speeds[ranks], accumulate)
        out[:, ranks] = plan.assignment[order] + num_batches
        rows.append(plan.rows)
        fills.append(plan.is_fill)
        offsets.append(plan.batch_offsets[1:] + num_rows)
        dropped.append(plan.dropped)
        num_rows += plan.rows.shape[0]
        num_batches += plan.num_batches
    rows_all = np.concatenate(rows).astype(np.int64)
    offsets_all = np.concatenate(offsets).astype(np.int64)
    if settings.shuffle:
        out = shuffle_steps(out, accumulate, np.random.default_rng(np.random.SeedSequence(
            [int(settings.seed), int(epoch), 2])))
    if settings.largest_first and steps:
        out = longest_first(out, offsets_all, padded[rows_all], accumulate)
    return EpochPlan(rows=rows_all, is_fill=np.concatenate(fills), batch_offsets=offsets_all,
                     assignment=np.ascontiguousarray(out, dtype=np.int64),
                     dropped=np.sort(np.concatenate(dropped)).astype(np.int64), accumulate_grad_batches=int(accumulate))


def _with_fill_batches(plan: EpochPlan | None, steps: int, num_ranks: int, members: np.ndarray, padded: np.ndarray,
                       candidates: np.ndarray, budget: int, shortest: int, accumulate: int) -> EpochPlan:
    """``plan`` (None: no samples) extended to ``steps`` micro-steps by micro-batches of one fill row each: the
    shortest of the class's samples, else of all candidates when it is within ``budget``, else ``shortest``, the
    shortest sample of all (the rest of a resumed epoch may hold no sample within a small budget)."""
    if plan is not None and plan.num_micro_steps == steps:
        return plan
    if plan is None:
        plan = empty_plan(num_ranks, accumulate)
    pool = members if members.shape[0] else candidates
    fill = int(pool[np.lexsort((pool, padded[pool]))][0])
    if padded[fill] > budget:
        fill = shortest
    extra = (steps - plan.num_micro_steps) * num_ranks
    first = plan.num_batches
    return EpochPlan(
        rows=np.concatenate([plan.rows, np.full(extra, fill, dtype=np.int64)]),
        is_fill=np.concatenate([plan.is_fill, np.ones(extra, dtype=bool)]),
        batch_offsets=np.concatenate([plan.batch_offsets, plan.batch_offsets[-1] + 1 + np.arange(extra)]),
        assignment=np.concatenate([plan.assignment,
                                   (first + np.arange(extra, dtype=np.int64)).reshape(-1, num_ranks)], axis=0),
        dropped=plan.dropped, accumulate_grad_batches=plan.accumulate_grad_batches)


def _steps_by_time(times: np.ndarray, accumulate: int) -> np.ndarray:
    """Micro-step order with the optimizer steps longest first (a shorter last step stays last).

    ``times`` is float64 ``[num_micro_steps, ranks]``: each micro-batch's cost over its rank's speed.
    """
    num_steps = times.shape[0]
    full = num_steps // accumulate
    if full == 0:
        return np.arange(num_steps)
    per_rank = times[:full * accumulate].reshape(full, accumulate, -1).sum(axis=1)
    by_time = np.argsort(-per_rank.max(axis=1), kind="stable")
    order = (by_time[:, None] * accumulate + np.arange(accumulate)).reshape(-1)
    return np.concatenate([order, np.arange(full * accumulate, num_steps)])


class PerRankPlanner:
    """A planner (padded or packed) with a budget per data-parallel rank: :func:`plan_per_rank` when the budgets
    differ, the wrapped planner itself (the same plans as one int) when they are all equal.

    Args:
        base: the wrapped planner.
    """

    def __init__(self, base) -> None:
        self.base = base
        self.name = base.name
        self.cost_unit = base.cost_unit
        self.row_buckets = base.row_buckets
        self.worst_case_batch = base.worst_case_batch
        self.packed_rows = base.packed_rows
        self.collator_options = base.collator_options
        self.micro_batch_shapes = base.micro_batch_shapes
        self.real_token_fraction_bound = base.real_token_fraction_bound

    @staticmethod
    def steps_together(settings: BatchingSettings) -> bool:
        """False: a mixture's steps are planned one by one, each by this planner (the budget of each rank)."""
        return False

    def plan(self, lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
             epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
             num_batches: int | None = None) -> EpochPlan:
        """The plan (see :class:`~lit_balance.plan.epoch.Planner`); ``num_batches`` is used only with equal budgets."""
        budgets = settings.rank_max_tokens(num_replicas)
        if len(set(budgets)) == 1:
            return self.base.plan(lengths, candidates, settings.replace(max_tokens=budgets[0]),
                                  num_replicas=num_replicas, epoch=epoch, cost_model=cost_model, speeds=speeds,
                                  min_steps=min_steps, num_batches=num_batches)
        return plan_per_rank(self.base, lengths, candidates, settings, num_replicas=num_replicas, epoch=epoch,
                             cost_model=cost_model, speeds=speeds, min_steps=min_steps)

    def count_steps(self, lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings,
                    num_replicas: int, min_steps: int, cost_model: CostModelProtocol) -> tuple[int, int, int | None]:
        """A window's micro-steps with equal rank speeds: the wrapped planner's with equal budgets, else learnt by
        planning (the count is fixed by the lengths, budgets and settings)."""
        budgets = settings.rank_max_tokens(num_replicas)
        if len(set(budgets)) == 1:
            return self.base.count_steps(lengths, mask, settings.replace(max_tokens=budgets[0]), num_replicas,
                                         min_steps, cost_model)
        return steps_by_planning(functools.partial(plan_per_rank, self.base), lengths, mask, settings, num_replicas,
                                 min_steps, cost_model)

    def batch_costs(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                    cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
        """The wrapped planner's: each micro-batch's cost and token slots."""
        return self.base.batch_costs(lengths, rows, offsets, pad_to_multiple_of, cost_model)
