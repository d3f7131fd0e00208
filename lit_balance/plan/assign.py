"""Micro-batches to ranks and optimizer steps: what every planner shares once its micro-batches are formed.

A planner (:mod:`lit_balance.plan.padded`, :mod:`lit_balance.plan.packed`) forms micro-batches and groups them,
``num_replicas * accumulate_grad_batches`` at a time, into optimizer steps; these functions place each step's
micro-batches on the ranks (Graham's Longest Processing Time rule with ``accumulate_grad_batches`` micro-batches per
rank: Graham, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17, 1969), order the steps, move the
step with the longest row first, even out too few samples with fill rows or drops, and measure how long a plan holds
the ranks. Every random choice draws from the generator passed in, in a fixed order, so a plan is a pure function of
its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["fastest_rank_first", "hold_time", "longest_first", "lpt", "lpt_steps", "one_row_each", "shuffle_steps",
           "steps_by_planning"]


def lpt(costs: np.ndarray, speeds: np.ndarray, per_rank: int) -> np.ndarray:
    """Assign ``costs`` (descending) to ranks, ``per_rank`` each: each goes where it would finish first.

    Graham's LPT rule with a cardinality limit; with unequal ``speeds`` (relative throughput), a rank's finishing
    time is ``load / speed``.

    Args:
        costs: float ``[per_rank * num_ranks]``: the cost of each micro-batch of one optimizer step.
        speeds: float ``[num_ranks]``: relative speed of each rank.
        per_rank: micro-batches per rank in the step.

    Returns:
        int64 ``[per_rank, num_ranks]`` of indices into ``costs``.

    Example:
        >>> lpt(np.array([5.0, 4.0, 3.0, 3.0]), np.ones(2), 2).tolist()
        [[0, 1], [3, 2]]
    """
    num_ranks = speeds.shape[0]
    if per_rank == 1:  # one each: the most costly on the fastest rank
        out = np.empty(num_ranks, dtype=np.int64)
        out[np.argsort(-speeds, kind="stable")] = np.argsort(-costs, kind="stable")
        return out[None, :]
    load = np.zeros(num_ranks)
    count = np.zeros(num_ranks, dtype=np.int64)
    slots = np.empty((per_rank, num_ranks), dtype=np.int64)
    for k in np.argsort(-costs, kind="stable"):
        finish = np.where(count < per_rank, (load + costs[k]) / speeds, np.inf)
        r = int(np.argmin(finish))
        slots[count[r], r] = k
        load[r] += costs[k]
        count[r] += 1
    return slots


def fastest_rank_first(steps: np.ndarray, speeds: np.ndarray, rng: np.random.Generator | None,
                       uniform: bool) -> np.ndarray:
    """One micro-batch per rank and micro-step: LPT for ``accumulate_grad_batches == 1``, vectorised.

    Args:
        steps: int64 ``[num_micro_steps, num_replicas]``: each micro-step's micro-batches, costliest first.
        speeds: float ``[num_replicas]``: relative rank speeds.
        rng: with equal speeds (``uniform``), ranks are permuted within each step at random; None keeps them.
        uniform: all speeds are equal.

    Returns:
        int64 ``[num_micro_steps, num_replicas]``: the costliest micro-batch of each step on the fastest rank.
    """
    out = np.empty_like(steps)
    out[:, np.argsort(-speeds, kind="stable")] = steps
    if rng is not None and uniform:
        out = rng.permuted(out, axis=1)
    return out


def lpt_steps(members_of_steps: Iterable[np.ndarray], cost: np.ndarray, speeds: np.ndarray, num_replicas: int,
              rng: np.random.Generator | None, uniform: bool) -> list[np.ndarray]:
    """Place the micro-batches of each optimizer step on the ranks by :func:`lpt`.

    Args:
        members_of_steps: per optimizer step, int64 micro-batch ids (a multiple of ``num_replicas`` of them).
        cost: float ``[num_batches]``: each micro-batch's cost.
        speeds: float ``[num_replicas]``: relative rank speeds.
        num_replicas: ranks.
        rng: with equal speeds (``uniform``), ranks are permuted within each step at random; None keeps them.
        uniform: all speeds are equal.

    Returns:
        Per optimizer step, int64 ``[micro-steps of the step, num_replicas]`` of micro-batch ids.
    """
    groups = []
    for members in members_of_steps:
        slots = members[lpt(cost[members], speeds, members.shape[0] // num_replicas)]
        if rng is not None and uniform:
            slots = slots[:, rng.permutation(num_replicas)]
        groups.append(slots)
    return groups


def shuffle_steps(assignment: np.ndarray, accumulate_grad_batches: int, rng: np.random.Generator) -> np.ndarray:
    """Optimizer steps (runs of ``accumulate_grad_batches`` micro-steps) in random order; a shorter last one stays
    last, so accumulation windows stay aligned with Lightning's.

    Args:
        assignment: int64 ``[num_micro_steps, num_replicas]``.
        accumulate_grad_batches: micro-steps per optimizer step.
        rng: the generator (one ``permutation`` of the whole steps).

    Returns:
        The assignment with its optimizer steps reordered.
    """
    num_steps = assignment.shape[0]
    if not num_steps:
        return assignment
    full = num_steps // accumulate_grad_batches
    order = (rng.permutation(full)[:, None] * accumulate_grad_batches + np.arange(accumulate_grad_batches)).reshape(-1)
    return assignment[np.concatenate([order, np.arange(full * accumulate_grad_batches, num_steps)])]


def longest_first(assignment: np.ndarray, offsets: np.ndarray, row_lengths: np.ndarray,
                  accumulate_grad_batches: int) -> np.ndarray:
    """Move the optimizer step holding the longest row to the front, its micro-batch first on its rank.

    Args:
        assignment: int64 ``[num_micro_steps, num_replicas]``.
        offsets: int64 ``[num_batches + 1]``: micro-batch ``b`` holds rows ``offsets[b]:offsets[b + 1]``.
        row_lengths: int64 ``[num_rows]``: each row's (padded) length in tokens.
        accumulate_grad_batches: micro-steps per optimizer step.
    """
    widths = np.maximum.reduceat(row_lengths, offsets[:-1])
    longest = int(np.argmax(widths))
    step, rank = (int(x[0]) for x in np.nonzero(assignment == longest))
    g0 = (step // accumulate_grad_batches) * accumulate_grad_batches
    g1 = min(g0 + accumulate_grad_batches, assignment.shape[0])
    if g1 - g0 < accumulate_grad_batches:  # the shorter last group must stay last: swap it into step 0 instead
        out = assignment.copy()
        out[[0, step], rank] = out[[step, 0], rank]
        return out
    group = assignment[g0:g1].copy()
    within = step - g0
    group[[0, within], rank] = group[[within, 0], rank]  # its micro-batch first on its rank
    rest = np.concatenate([assignment[:g0], assignment[g1:]], axis=0)
    return np.concatenate([group, rest], axis=0)


def one_row_each(order: np.ndarray, target: int, num_replicas: int, drop_last: bool,
                 rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Rows when there are fewer samples than ``target`` micro-batches, one row each.

    ``order`` holds the samples longest first. With ``drop_last`` a multiple of ``num_replicas`` is kept, the rest
    dropped at random (``rng``) or, without shuffle, the costliest; otherwise the cheapest samples are repeated as
    fill rows up to ``target`` (at most ``num_replicas - 1`` of them).

    Returns:
        ``(rows, dropped, num_fill)``: the rows in order (fill rows last), the dropped sample indices (sorted) and
        the number of fill rows.
    """
    n = order.shape[0]
    if drop_last:
        keep = (n // num_replicas) * num_replicas
        perm = rng.permutation(n) if rng is not None else np.arange(n)[::-1]
        keep_mask = np.ones(n, dtype=bool)
        keep_mask[perm[keep:]] = False
        return order[keep_mask], np.sort(order[~keep_mask]), 0
    num_fill = target - n
    return np.concatenate([order, order[::-1][np.arange(num_fill) % n]]), np.empty(0, dtype=np.int64), num_fill


def hold_time(batch_cost: np.ndarray, assignment: np.ndarray, accumulate_grad_batches: int,
              speeds: np.ndarray) -> float:
    """Sum over optimizer steps of the slowest rank's time, times the total speed: the time a plan holds the ranks.

    Candidate plans of the same samples compare by it: the smallest wastes least (padding, overhead and waiting).

    Args:
        batch_cost: float ``[num_batches]``: each micro-batch's cost.
        assignment: int64 ``[num_micro_steps, num_replicas]``.
        accumulate_grad_batches: micro-steps per optimizer step (ranks wait once per step).
        speeds: float ``[num_replicas]``: relative rank speeds.
    """
    if not batch_cost.shape[0]:
        return 0.0
    group = np.arange(assignment.shape[0]) // accumulate_grad_batches
    per_rank = np.zeros((int(group[-1]) + 1, assignment.shape[1]))
    np.add.at(per_rank, group, batch_cost[assignment] / speeds)
    return float(per_rank.max(axis=1).sum() * speeds.sum())


def steps_by_planning(plan: Callable[..., Any], lengths: np.ndarray, mask: np.ndarray | None, settings: Any,
                      num_replicas: int, min_steps: int, cost_model: Any) -> tuple[int, int, None]:
    """A window's micro-steps learnt by planning it at epoch 0 with equal rank speeds (for a planner whose count is
    fixed by the lengths and settings alone), rounded up to a multiple of ``accumulate_grad_batches`` where the
    samples allow, so that optimizer steps of consecutive windows stay aligned with the epoch's.

    Args:
        plan: the planner's plan function (``plan(lengths, candidates, settings, *, num_replicas, epoch, cost_model,
            speeds, min_steps)``).
        lengths: int ``[n]``: the window's lengths (tokens).
        mask: bool ``[n]`` of its eligible samples, or None for all.
        settings: the batching settings.
        num_replicas: ranks.
        min_steps: at least this many micro-steps where the samples allow.
        cost_model: the cost model.

    Returns:
        ``(micro-steps, min_steps to plan with, None)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    candidates = np.arange(lengths.shape[0], dtype=np.int64) if mask is None else np.flatnonzero(mask)
    speeds = np.ones(num_replicas)

    def steps_with(least: int) -> int:
        return plan(lengths, candidates, settings, num_replicas=num_replicas, epoch=0, cost_model=cost_model,
                    speeds=speeds, min_steps=least).num_micro_steps

    steps = steps_with(min_steps)
    accumulate = settings.accumulate_grad_batches
    aligned = -(-steps // accumulate) * accumulate
    if aligned == steps:
        return steps, min_steps, None
    return steps_with(aligned), aligned, None
