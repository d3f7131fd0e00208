"""The padded planner: lengths -> equal-cost micro-batches of rows padded to their longest -> steps x ranks.

Every micro-batch's rows are padded to its longest row, and ``max_tokens`` bounds its padded token slots (rows x
longest padded row). Everything here is a pure function of its arguments: every rank computes the same plan locally,
with no communication, and keeps its own column of it.

Worked example (``max_tokens=100``, ``num_replicas=2``, ``shuffle=False``, padded-token cost)::

    lengths = [95, 95, 95, 95, 95, 20, 20, 20, 20, 20]
    # sorted longest first. Filling each micro-batch to the budget gives [0] [1] [2] [3] [4] [5 6 7 8 9]:
    # 6 micro-batches, already a multiple of 2; the cost cap that still gives 6 is 100 padded slots.
    # costs: 95 95 95 95 95 100; most costly first, two per optimizer step (one per rank):
    #   step 0: [5 6 7 8 9] [0]   step 1: [1] [2]   step 2: [3] [4]

The plan is made in four stages:

1. **Order.** Samples are sorted by padded length, longest first. With ``shuffle``, ties are broken at
   random and every sample's sort position is moved later by a random amount of up to ``shuffle_window``
   micro-batches' worth of tokens, so batch-mates change between epochs; this is the one knob that trades
   padding for randomness (the "sortish" idea of fastai's ``SortishSampler`` and of Hugging Face's
   ``group_by_length`` megabatches, applied as a noisy sort key in token space).
2. **Micro-batches of equal cost.** The number of micro-batches is fixed first, from the lengths and settings
   only, so every epoch has the same length: the smallest multiple of ``num_replicas`` not below what filling
   every micro-batch to ``max_tokens`` needs for any shuffled order, plus one more step of them when that
   wastes less on the unshuffled order (few steps). The order is then cut into that many contiguous
   micro-batches of about equal cost, none over the budget, in two ways: greedily under one cost cap found
   by bisection (fairseq's ``batch_by_size`` cuts a sorted order the same way, with the budget as the only
   cap), and by cumulative equal shares of the cost still to place. The plan that holds the ranks for the
   least time is kept. A micro-batch's cost comes from :class:`~lit_balance.plan.cost.CostModel`. With unequal
   rank speeds, the cumulative shares cycle over the ranks in proportion to their speeds, on the fewest
   micro-batches found for which the fast ranks' shares fit the budget (the epoch can grow); the greedy cut
   keeps the epoch's count and its micro-batches go to ranks by speed, and again the plan that holds the ranks
   for the least time under the cost model (with its per-micro-batch overhead) is kept.
3. **Steps.** Micro-batches in descending cost order are taken ``num_replicas * accumulate_grad_batches``
   at a time (one optimizer step) and spread over the ranks with the Longest Processing Time rule
   restricted to ``accumulate_grad_batches`` micro-batches per rank (Graham, "Bounds on multiprocessing
   timing anomalies", SIAM J. Appl. Math. 17, 1969). Ranks only wait for each other once per optimizer
   step, so this balances each rank's summed cost per step (finishing times ``cost / speed`` with unequal
   speeds). When the cut for unequal speeds is kept, each rank runs the micro-batches cut for its share, most
   costly first.
4. **Order of steps.** With ``shuffle``, optimizer steps run in random order, and ranks are permuted within
   a step (equal speeds only); ``largest_first`` moves the step holding the epoch's longest sample to the
   front, so an out-of-memory error shows at the first step.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from lit_balance.plan.assign import fastest_rank_first, hold_time, longest_first, lpt_steps, one_row_each, shuffle_steps
from lit_balance.plan.cost import CostModel, CostModelProtocol
from lit_balance.plan.mixture_batches import batch_padded_steps, padded_fits
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, WorstCaseBatch, longest_first_order, padded_lengths, sorted_descending

__all__ = ["PaddedPlanner", "batch_costs", "count_steps", "plan_padded"]



def plan_padded(lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
                epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
                num_batches: int | None = None) -> EpochPlan:
    """Plan one padded epoch for all ranks (:func:`~lit_balance.plan.plan_epoch` calls it, arguments checked).

    Args:
        lengths: int64 ``[num_samples]``: tokens per sample (already truncated where that applies).
        candidates: int64 indices of the samples to plan, each within the budget once padded.
        settings: the batching settings.
        num_replicas: number of ranks.
        epoch: the epoch; with ``settings.shuffle`` the generators are seeded by ``(settings.seed, epoch)``.
        cost_model: the cost of a micro-batch (:meth:`~lit_balance.CostModel.batch_cost`).
        speeds: float64 ``[num_replicas]`` relative rank speeds.
        min_steps: at least this many micro-steps where the samples allow (the rest of an epoch on new ranks).
        num_batches: the epoch's micro-batch count before ``min_steps`` (:func:`count_steps` gives it), or None to
            count here.

    Returns:
        The :class:`~lit_balance.plan.types.EpochPlan`.
    """
    padded = padded_lengths(lengths, settings.pad_to_multiple_of)
    max_tokens = settings.max_tokens
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else max_tokens
    uniform = bool(np.all(speeds == speeds[0]))
    seed, shuffle = int(settings.seed), settings.shuffle
    rng = np.random.default_rng(np.random.SeedSequence([seed, int(epoch)])) if shuffle else None

    weight = speeds / speeds.max()  # cost caps cycle over ranks in proportion to their speeds
    k = _num_batches(padded, candidates, settings, num_replicas, row_cap) if num_batches is None else num_batches
    if min_steps * num_replicas > k:
        k = max(k, min(min_steps, candidates.shape[0] // num_replicas) * num_replicas)
    order = _order(padded, candidates, max_tokens, settings.shuffle_window, rng)
    cuts = _Cuts(padded[order], max_tokens, row_cap, cost_model)
    finish_rng = np.random.default_rng(np.random.SeedSequence([seed, int(epoch), 1])) if shuffle else None
    layout = _Layout(padded=padded, cost_model=cost_model, num_replicas=num_replicas,
                     accumulate_grad_batches=settings.accumulate_grad_batches, speeds=speeds, uniform=uniform,
                     drop_last=settings.drop_last, largest_first=settings.largest_first, rng=finish_rng)
    best: tuple[float, EpochPlan] | None = None
    # Candidate cuts of the order within the budget (greedy under a cost cap, which always fits; cumulative equal
    # shares); the plan that holds the ranks for the least time is kept. With unequal speeds, the cumulative cut
    # gives each rank micro-batches sized to its share, which can need more of them (a longer epoch); the greedy
    # cut keeps the epoch's count and spreads equal-cost micro-batches by speed (LPT), which wins when the speeds
    # are close and each extra micro-batch has an overhead.
    cut_candidates = [("greedy", k, cuts.greedy(k))]
    if uniform:
        cut_candidates.append(("cumulative", k, cuts.cumulative(k, np.resize(weight, k))))
    else:
        found, floor = _cumulative_by_speed(cuts, weight, k, num_replicas), float(weight.min())
        while not found and floor < 1.0:
            # No count of micro-batches gives the slowest ranks a share of whole rows (their speed is a tiny
            # fraction of the fastest): raise the smallest shares until one does, which still favours the fast ranks.
            floor = min(1.0, floor * 4)
            found = _cumulative_by_speed(cuts, np.maximum(weight, floor), k, num_replicas)
        cut_candidates += [("cumulative", count, ends) for count, ends in found]
    for method, target, ends in cut_candidates:
        if ends is None or ends.size > target:  # (the second: float precision lost to an extreme cost model)
            continue
        plan = layout.finish(order, ends, target, by_lpt=uniform or method == "greedy")
        waste = hold_time(_batch_costs(padded, plan.rows, plan.batch_offsets, cost_model)[0], plan.assignment,
                          plan.accumulate_grad_batches, speeds)
        if best is None or waste < best[0]:
            best = (waste, plan)
    if best is None:  # micro-batches filled to the budget, split to the epoch's count: always fits
        k = max(k, -(-cuts.fill_count() // num_replicas) * num_replicas)
        ends = _cut_points(cuts.run_take, cuts.run_ends) if cuts.n else np.empty(0, dtype=np.int64)
        best = (0.0, layout.finish(order, ends, k, by_lpt=True))
    return best[1]


def plan_filled(lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
                epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
                num_batches: int | None = None, takes: np.ndarray | None = None) -> EpochPlan:
    """A padded epoch of micro-batches filled to the budget: the plan of static shapes (``padded_shapes``).

    The samples go longest first (ties at random with ``shuffle``; ``shuffle_window`` does not apply) and each
    micro-batch takes as many rows as the budget holds at its first row's length, so every micro-batch but the last
    of the order is full: with a few distinct lengths (the shapes' lengths), the shape a micro-batch is padded to
    is filled. With ``takes`` (int ``[num_samples]``, equal for equal lengths), a micro-batch whose first row is
    sample ``i`` takes ``takes[i]`` rows instead (at most what the budget holds at ``lengths[i]``): the rows of the
    shape that sample is padded to. The count (:func:`filled_count`) is the same every epoch; micro-batches are then
    split to it and to equal counts, and assigned to ranks and steps as :func:`plan_padded` does (LPT on cost within
    each step).

    Args: as for :func:`plan_padded` (``lengths`` here the lengths the shapes round to), and ``takes``.
    """
    padded = padded_lengths(lengths, settings.pad_to_multiple_of)
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
    seed, shuffle = int(settings.seed), settings.shuffle
    rng = np.random.default_rng(np.random.SeedSequence([seed, int(epoch)])) if shuffle else None
    k = filled_count(padded, candidates, settings, num_replicas, takes) if num_batches is None else num_batches
    if min_steps * num_replicas > k:
        k = max(k, min(min_steps, candidates.shape[0] // num_replicas) * num_replicas)
    order = _order(padded, candidates, settings.max_tokens, 0.0, rng)
    cuts = _Cuts(padded[order], settings.max_tokens, row_cap, cost_model, None if takes is None else takes[order])
    ends = _cut_points(cuts.run_take, cuts.run_ends) if cuts.n else np.empty(0, dtype=np.int64)
    if num_batches is not None:  # a count asked for (a mixture's step) that the filled micro-batches exceed: theirs
        k = max(k, -(-ends.shape[0] // num_replicas) * num_replicas)
    finish_rng = np.random.default_rng(np.random.SeedSequence([seed, int(epoch), 1])) if shuffle else None
    layout = _Layout(padded=padded, cost_model=cost_model, num_replicas=num_replicas,
                     accumulate_grad_batches=settings.accumulate_grad_batches, speeds=speeds,
                     uniform=bool(np.all(speeds == speeds[0])), drop_last=settings.drop_last,
                     largest_first=settings.largest_first, rng=finish_rng)
    return layout.finish(order, ends, k, by_lpt=True)


def filled_count(padded: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, num_replicas: int,
                 takes: np.ndarray | None = None) -> int:
    """Micro-batches of every epoch of :func:`plan_filled`: those filled to the budget (or to ``takes``; ties do not
    change the count), rounded up to a multiple of ``num_replicas``."""
    if not candidates.shape[0]:
        return 0
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
    if takes is None:
        longest, taken = sorted_descending(padded[candidates]), None
    else:
        by_length = longest_first_order(padded[candidates])
        longest, taken = padded[candidates][by_length], takes[candidates][by_length]
    count = _Cuts(longest, settings.max_tokens, row_cap, CostModel(), taken).fill_count()
    return -(-count // num_replicas) * num_replicas


def count_filled_steps(lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings, num_replicas: int,
                       min_steps: int, cost_model: CostModelProtocol | None = None,
                       takes: np.ndarray | None = None) -> tuple[int, int, int | None]:
    """``(micro-steps, min_steps to plan with, micro-batches before min_steps)`` of a window's :func:`plan_filled`
    (with ``takes``), as :func:`count_steps` for :func:`plan_padded`."""
    padded = padded_lengths(lengths, settings.pad_to_multiple_of)
    candidates = np.arange(padded.shape[0], dtype=np.int64) if mask is None else np.flatnonzero(mask)
    n = candidates.shape[0]
    if not n:
        return 0, 0, None
    k = count = filled_count(padded, candidates, settings, num_replicas, takes)
    accumulate = settings.accumulate_grad_batches
    plan_min = max(int(min_steps), -(-(k // num_replicas) // accumulate) * accumulate)
    if plan_min * num_replicas > k:
        k = max(k, min(plan_min, n // num_replicas) * num_replicas)
    steps = n // num_replicas if settings.drop_last and n < k else k // num_replicas
    return steps, plan_min, count


def _cumulative_by_speed(cuts: _Cuts, weight: np.ndarray, k: int,
                         num_replicas: int) -> list[tuple[int, np.ndarray]]:
    """Cumulative cuts with shares cycling over the ranks by speed, on counts of micro-batches that fit.

    Starting from ``k``, the count grows by about 10 % (a multiple of ``num_replicas``) until the shares fit the
    budget, then bisects back towards the last count that did not fit. Returns ``(count, ends)`` for the first
    count that fitted and, when smaller, the smallest found by bisection (fewer, fuller micro-batches; the larger
    count balances more finely); empty when no count up to the number of samples fits.
    """
    def attempt(count: int) -> np.ndarray | None:
        return cuts.cumulative(count, np.resize(weight, count))

    ends, tried, failed = attempt(k), k, None
    while ends is None:
        failed = tried
        tried = max(tried + num_replicas, -(-int(tried * 1.1) // num_replicas) * num_replicas)
        if tried > cuts.n:  # never more micro-batches than samples
            return []
        ends = attempt(tried)
    found = [(tried, ends)]
    while failed is not None and tried - failed > num_replicas:
        mid = failed + (tried - failed) // (2 * num_replicas) * num_replicas
        cut = attempt(mid)
        if cut is None:
            failed = mid
        else:
            tried, ends = mid, cut
    if tried < found[0][0]:
        found.append((tried, ends))
    return found


class _Cuts:
    """Contiguous cuts of one order (padded lengths ``pl`` in plan order) into micro-batches within the budget."""

    def __init__(self, pl: np.ndarray, max_tokens: int, row_cap: int, cost_model: CostModel,
                 takes: np.ndarray | None = None) -> None:
        """``takes``: int ``[n]`` rows of a micro-batch starting at each row, in plan order (equal within a run of
        equal caps; None: as many as the budget holds)."""
        n = self.n = pl.shape[0]
        # Each row's cap: the longest padded length from it to the end of the order (non-increasing), which
        # bounds the longest row of any micro-batch that starts there.
        caps = np.maximum.accumulate(pl[::-1])[::-1] if n else np.zeros(0, dtype=np.int64)
        self.run_ends = np.append(np.flatnonzero(caps[1:] != caps[:-1]) + 1, n) if n else np.zeros(0, np.int64)
        run_caps = caps[self.run_ends - 1] if n else np.zeros(0, dtype=np.int64)
        self.run_cost = cost_model.row_cost(run_caps)
        self.run_take = np.minimum(max_tokens // np.maximum(run_caps, 1), row_cap)
        if takes is not None and n:
            self.run_take = np.clip(np.asarray(takes, dtype=np.int64)[self.run_ends - 1], 1, self.run_take)
        self.per_batch = cost_model.per_batch
        self.caps = caps
        self.cost_model = cost_model

    @property
    def budget_take(self) -> np.ndarray:
        """int64 ``[n]``: each row's run's take (rows of a micro-batch filled to the budget), row by row."""
        return np.repeat(self.run_take, np.diff(np.concatenate([[0], self.run_ends])))

    def fill_count(self) -> int:
        """Micro-batches when every one is filled to the budget."""
        return _count_batches(self.run_take.tolist(), self.run_ends.tolist(), self.n)

    def greedy(self, k: int) -> np.ndarray | None:
        if not self.n:
            return np.empty(0, dtype=np.int64)
        if self.fill_count() > k:
            return None
        return _cut_greedy(self.run_cost, self.per_batch, self.run_take, self.run_ends, k)

    def cumulative(self, k: int, weights: np.ndarray) -> np.ndarray | None:
        if not self.n:
            return np.empty(0, dtype=np.int64)
        take = self.budget_take
        row_weight = self.cost_model.row_cost(self.caps) + self.per_batch / np.maximum(take, 1)
        cum = np.concatenate([[0.0], np.cumsum(row_weight)]).tolist()
        ends = _cut_equal(cum, take.tolist(), weights)
        return ends if ends.size and ends[-1] == self.n and ends.size == min(k, self.n) else None


def _num_batches(padded: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, num_replicas: int,
                 row_cap: int) -> int:
    """Micro-batches of every epoch: the same for all epochs, so the epoch length never changes.

    The smallest multiple of ``num_replicas`` not below the budget-filling count of the noise-free longest-first
    order with each row's cap raised to the length ``shuffle_window`` micro-batches earlier: no shuffled order
    can need more (a sample only moves later, by at most that much). With several ranks, one more step of
    micro-batches is taken when that holds the ranks for less time on the noise-free order (few steps: whole
    rows make equal costs coarse), judged in padded tokens so that a new cost model or rank speeds never change
    the epoch length.
    """
    cost_model = CostModel()
    max_tokens = settings.max_tokens
    window = settings.shuffle_window if settings.shuffle else 0.0
    n = candidates.shape[0]
    if not n:
        return 0
    # Everything below reads the candidates' padded lengths only through the longest-first order's values
    # (ties are interchangeable), so the count is planned on those values: row i of the order is longest[i].
    whole = n == padded.shape[0]  # n distinct indices into padded: all of them
    longest = sorted_descending(padded if whole else padded[candidates])
    order = np.arange(n, dtype=np.int64)
    target = -(-_shifted_fill_count(longest, window * max_tokens, max_tokens, row_cap) // num_replicas) * num_replicas
    if num_replicas == 1 or target + num_replicas > n:
        return target
    plain = _Cuts(longest, max_tokens, row_cap, cost_model)
    speeds = np.ones(num_replicas)
    layout = _Layout(padded=longest, cost_model=cost_model, num_replicas=num_replicas,
                     accumulate_grad_batches=settings.accumulate_grad_batches, speeds=speeds, uniform=True,
                     drop_last=False, largest_first=settings.largest_first, rng=None)
    waste = []
    for k in (target, target + num_replicas):
        plan = layout.finish(order, plain.greedy(k), k, by_lpt=True)
        waste.append(hold_time(_batch_costs(longest, plan.rows, plan.batch_offsets, cost_model)[0], plan.assignment,
                               plan.accumulate_grad_batches, speeds))
    return target if waste[0] <= waste[1] else target + num_replicas


def _shifted_fill_count(longest: np.ndarray, shift: float, max_tokens: int, row_cap: int) -> int:
    """Micro-batches filled to the budget (:meth:`_Cuts.fill_count`) of the order whose row ``i`` is padded to
    ``longest[earlier[i]]``, ``earlier[i]`` the first row starting at least ``shift`` tokens before row ``i``.

    ``longest``: int64 ``[n]`` padded lengths, non-increasing (tokens). The same count as
    ``_Cuts(longest[np.searchsorted(position, position - shift)], ...).fill_count()`` with ``position`` the tokens
    before each row, computed on runs of equal lengths: row ``i`` takes run ``r``'s length once
    ``position[start_r - 1] < position[i] - shift`` (the search's float64 comparison), one search per run, not
    one per row.
    """
    n = longest.shape[0]
    run_starts = np.flatnonzero(longest[1:] != longest[:-1]) + 1  # where each run after the first starts
    values = longest[np.concatenate([[0], run_starts])]
    if shift > 0:
        position = np.cumsum(longest) - longest
        query = position - shift  # float64, as the search compares
        begins = np.searchsorted(query, position[run_starts - 1].astype(np.float64), side="right")
    else:
        begins = run_starts
    ends = np.append(begins, n)
    present = ends > np.concatenate([[0], begins])  # runs no row takes: none of the shifted order's lengths
    take = np.minimum(max_tokens // np.maximum(values[present], 1), row_cap)
    return _count_batches(take.tolist(), ends[present].tolist(), n)


def count_steps(lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings, num_replicas: int,
                min_steps: int, cost_model: CostModelProtocol | None = None) -> tuple[int, int, int | None]:
    """``(micro-steps, min_steps to plan with, micro-batches before min_steps)`` of a window's plan with equal rank
    speeds, without planning it.

    Mirrors :func:`plan_padded`'s count (the same for every epoch and cost model); the count is rounded up to a
    multiple of ``accumulate_grad_batches`` where the samples allow, so optimizer steps of consecutive windows stay
    aligned with the epoch's. ``lengths`` are the window's (int ``[n]``), ``mask`` its eligible samples (or None);
    the count never depends on ``cost_model``.
    """
    padded = padded_lengths(lengths, settings.pad_to_multiple_of)
    candidates = np.arange(padded.shape[0], dtype=np.int64) if mask is None else np.flatnonzero(mask)
    n = candidates.shape[0]
    if not n:
        return 0, 0, None
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
    k = count = _num_batches(padded, candidates, settings, num_replicas, row_cap)
    accumulate = settings.accumulate_grad_batches
    plan_min = max(int(min_steps), -(-(k // num_replicas) // accumulate) * accumulate)
    if plan_min * num_replicas > k:
        k = max(k, min(plan_min, n // num_replicas) * num_replicas)
    steps = n // num_replicas if settings.drop_last and n < k else k // num_replicas
    return steps, plan_min, count


@dataclass(frozen=True)
class _Layout:
    """What turns cut points into a plan, fixed for one epoch: costs, ranks, speeds and step settings.

    Attributes:
        padded: int64 ``[num_samples]`` padded lengths (tokens).
        cost_model: cost of a micro-batch.
        num_replicas: number of ranks.
        accumulate_grad_batches: micro-batches per rank per optimizer step.
        speeds: float64 ``[num_replicas]`` relative rank speeds.
        uniform: all speeds equal (ranks may be permuted within a step).
        drop_last: drop samples instead of adding fill rows when too few.
        largest_first: the step holding the longest row runs first.
        rng: generator for drops, rank permutations and step order (None: no shuffle).
    """

    padded: np.ndarray
    cost_model: CostModel
    num_replicas: int
    accumulate_grad_batches: int
    speeds: np.ndarray
    uniform: bool
    drop_last: bool
    largest_first: bool
    rng: np.random.Generator | None

    def finish(self, order: np.ndarray, ends: np.ndarray, target: int, *, by_lpt: bool) -> EpochPlan:
        """Split to ``target`` micro-batches (or fill / drop when too few samples), then assign steps and ranks.

        ``order`` holds sample indices in plan order and ``ends`` the end offsets of its micro-batches.
        ``by_lpt``: assign each step's micro-batches to ranks by LPT (else micro-batch ``k`` was cut for rank
        ``k % num_replicas``).
        """
        num_replicas, rng, padded = self.num_replicas, self.rng, self.padded
        accumulate = self.accumulate_grad_batches
        n = order.shape[0]
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64) if ends.size else np.empty(0, dtype=np.int64)
        starts, ends = _split_to(starts, ends, target)
        rows, offsets = order, np.append(starts, n)
        num_fill = 0
        dropped = np.empty(0, dtype=np.int64)
        if starts.shape[0] < target:  # every micro-batch is a single row: too few samples
            rows, dropped, num_fill = one_row_each(order, target, num_replicas, self.drop_last, rng)
            offsets = np.arange(rows.shape[0] + 1, dtype=np.int64)
        is_fill = np.zeros(rows.shape[0], dtype=bool)
        if num_fill:
            is_fill[-num_fill:] = True
        num_batches = offsets.shape[0] - 1
        num_steps = num_batches // num_replicas

        widths = np.maximum.reduceat(padded[rows], offsets[:-1]) if num_batches else np.zeros(0, np.int64)
        cost = np.asarray(self.cost_model.batch_cost(np.diff(offsets), widths), dtype=np.float64).reshape(-1)
        assignment = _assign(cost, num_steps, num_replicas, accumulate, self.speeds, by_lpt, self.uniform, rng)
        if self.largest_first and num_steps:
            assignment = longest_first(assignment, offsets, padded[rows], accumulate)

        return EpochPlan(
            rows=rows.astype(np.int64),
            is_fill=is_fill,
            batch_offsets=offsets.astype(np.int64),
            assignment=np.ascontiguousarray(assignment, dtype=np.int64),
            dropped=dropped,
            accumulate_grad_batches=int(accumulate),
        )


def _cut_points(take: np.ndarray, run_ends: np.ndarray) -> np.ndarray:
    """End offsets of greedy contiguous micro-batches: one starting in run ``r`` has ``take[r]`` rows.

    ``run_ends`` are the end offsets of runs of rows with equal caps; ``take`` holds one value per run.
    Runs are cut in one vectorised step each, so the Python loop runs about twice per run, not once per
    micro-batch.
    """
    n = int(run_ends[-1]) if run_ends.size else 0
    ends: list[np.ndarray] = []
    i = r = 0
    while i < n:
        while run_ends[r] <= i:
            r += 1
        step, run_end = int(take[r]), int(run_ends[r])
        full = (run_end - i) // step  # micro-batches that lie wholly inside this run
        if full:
            ends.append(np.arange(i + step, i + full * step + 1, step))
            i += full * step
        if i < run_end:  # one micro-batch that starts here and runs into the shorter rows after
            i = min(i + step, n)
            ends.append(np.array([i]))
    return np.concatenate(ends) if ends else np.empty(0, dtype=np.int64)


def _count_batches(take: list[int], run_ends: list[int], limit: int) -> int:
    """Number of micro-batches :func:`_cut_points` would make (plain lists), stopping early past ``limit``."""
    n = run_ends[-1] if run_ends else 0
    count = i = r = 0
    while i < n:
        while run_ends[r] <= i:
            r += 1
        step, run_end = take[r], run_ends[r]
        full = (run_end - i) // step
        count += full
        i += full * step
        if i < run_end:
            i = min(i + step, n)
            count += 1
        if count > limit:
            return count
    return count


def _split_to(starts: np.ndarray, ends: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the micro-batches with the most rows in half until there are ``target`` (or all are single).

    Only the ``target - len(starts)`` largest micro-batches can take part (each split takes the largest,
    ties to the earliest), so only they enter the heap.
    """
    need = target - starts.shape[0]
    if need <= 0:
        return starts, ends
    sizes = ends - starts
    top = np.argsort(-sizes, kind="stable")[:need]
    heap = [(-int(sizes[k]), int(starts[k]), int(ends[k])) for k in top]
    heapq.heapify(heap)
    while need and heap and -heap[0][0] >= 2:
        size, lo, hi = heapq.heappop(heap)
        mid = lo + (-size + 1) // 2
        heapq.heappush(heap, (lo - mid, lo, mid))
        heapq.heappush(heap, (mid - hi, mid, hi))
        need -= 1
    keep = np.ones(starts.shape[0], dtype=bool)
    keep[top] = False
    new_starts = np.concatenate([starts[keep], np.array([h[1] for h in heap], dtype=np.int64)])
    new_ends = np.concatenate([ends[keep], np.array([h[2] for h in heap], dtype=np.int64)])
    order = np.argsort(new_starts, kind="stable")
    return new_starts[order], new_ends[order]


def _order(padded: np.ndarray, candidates: np.ndarray, max_tokens: int, window: float,
           rng: np.random.Generator | None) -> np.ndarray:
    """Candidates longest first; with ``rng``, random ties and sort positions moved by up to ``window`` batches."""
    if rng is None:
        return candidates[longest_first_order(padded[candidates])]
    perm = rng.permutation(candidates)
    order = perm[longest_first_order(padded[perm])]
    if window > 0 and order.size:
        position = (np.cumsum(padded[order]) - padded[order]) / max_tokens  # in full micro-batches
        order = order[np.argsort(position + rng.uniform(0.0, window, order.size), kind="stable")]
    return order


def _cut_greedy(run_cost: np.ndarray, per_batch: float, run_take: np.ndarray, run_ends: np.ndarray,
                target: int) -> np.ndarray:
    """Greedy cuts under the lowest cost cap that still gives at most ``target`` micro-batches (bisection).

    A micro-batch starting in run ``r`` takes as many rows as keep ``per_batch + rows * run_cost[r]`` under
    the cap, and never more than ``run_take[r]`` (the hard budget).
    """
    ends_list = run_ends.tolist()
    most = float(run_take.max())

    def takes(cap: float) -> np.ndarray:
        with np.errstate(all="ignore"):  # extreme coefficients: inf / nan rows fall back to the budget
            rows = np.floor((cap - per_batch) / run_cost + 1e-9)
        # as np.nan_to_num(rows, nan=1, posinf=most, neginf=1) then np.clip(np.minimum(rows, run_take), 1, None),
        # without their per-call overhead (this runs up to 50 times per cut)
        rows[np.isnan(rows)] = 1.0
        rows[rows == np.inf] = most
        np.minimum(rows, run_take, out=rows)
        np.maximum(rows, 1.0, out=rows)
        return rows.astype(np.int64)

    hi = float((per_batch + run_take * run_cost).max())
    lo = 0.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _count_batches(takes(mid).tolist(), ends_list, target) <= target:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    return _cut_points(takes(hi), run_ends)


def _cut_equal(cum: list[float], take: list[int], weights: np.ndarray) -> np.ndarray:
    """Cut the order into ``len(weights)`` contiguous micro-batches of about equal summed row weight.

    ``cum`` is the cumulative row weight (``n + 1`` values from 0). Micro-batch ``k`` aims at the share
    ``weights[k] / sum(weights[k:])`` of the weight still to place (so errors do not pile up at the end),
    rounded to the nearest whole row, and never takes more than ``take[i]`` rows from its first row ``i`` (the
    hard budget), nor so many that a micro-batch still to cut would get no row (with a tiny weight next, the
    share before it is nearly all that is left). Returns end offsets; the last is below ``n`` when the budget
    forces more micro-batches.
    """
    n = len(cum) - 1
    total = cum[n]
    suffix = np.cumsum(weights[::-1])[::-1].tolist()
    w = weights.tolist()
    count = len(w)
    ends = []
    i = 0
    for k in range(count):
        if i >= n:
            break
        goal = cum[i] + (total - cum[i]) * w[k] / suffix[k]
        e = bisect.bisect_left(cum, goal, i + 1)
        e = min(e, n)
        if e > i + 1 and goal - cum[e - 1] < cum[e] - goal:
            e -= 1
        e = min(max(e, i + 1), i + take[i], max(n - (count - k - 1), i + 1))
        ends.append(e)
        i = e
    return np.asarray(ends, dtype=np.int64)


def _assign(cost: np.ndarray, num_steps: int, num_replicas: int, accumulate: int, speeds: np.ndarray,
            by_lpt: bool, uniform: bool, rng: np.random.Generator | None) -> np.ndarray:
    """Micro-steps x ranks: optimizer steps of similar-cost micro-batches, LPT within each step.

    Without ``by_lpt``, micro-batch ``k`` runs on rank ``k % num_replicas`` (it was cut for that rank's share).
    """
    if num_steps == 0:
        return np.empty((0, num_replicas), dtype=np.int64)
    by_cost = np.argsort(-cost, kind="stable")
    if not by_lpt:
        # Micro-batch k was cut for rank k % num_replicas (its share follows that rank's speed): each rank
        # runs its own, most costly first, so the j-th of every rank share a step.
        cls = np.arange(cost.shape[0]) % num_replicas
        out = np.empty((num_steps, num_replicas), dtype=np.int64)
        for r in range(num_replicas):
            mine = np.flatnonzero(cls == r)
            out[:, r] = mine[np.argsort(-cost[mine], kind="stable")]
    elif accumulate == 1:  # one micro-batch per rank and step: vectorised LPT (most costly on the fastest rank)
        out = fastest_rank_first(by_cost.reshape(num_steps, num_replicas), speeds, rng, uniform)
    else:  # optimizer steps of the costliest micro-batches in turn, LPT within each
        per_step = accumulate * num_replicas
        members = (by_cost[lo:lo + per_step] for lo in range(0, num_steps * num_replicas, per_step))
        out = np.concatenate(lpt_steps(members, cost, speeds, num_replicas, rng, uniform), axis=0)
    return out if rng is None else shuffle_steps(out, accumulate, rng)


def _batch_costs(padded: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                 cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
    """``(cost, slots)``, float64 and int64 ``[num_batches]``, from lengths already padded (see :func:`batch_costs`)."""
    sizes = np.diff(offsets)
    filled = sizes > 0
    width = np.zeros(sizes.shape[0], dtype=np.int64)
    if filled.any():  # segments of the non-empty batches are contiguous: empty ones hold no rows
        width[filled] = np.maximum.reduceat(padded[rows], offsets[:-1][filled])
    cost = np.where(filled, cost_model.batch_cost(sizes, width), 0.0) if sizes.shape[0] else np.zeros(0)
    return np.asarray(cost, dtype=np.float64).reshape(-1), sizes * width


def batch_costs(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
    """Each micro-batch's cost and padded token slots, its rows padded to its longest (empty micro-batches: 0).

    Args:
        lengths: int64 ``[num_samples]``: tokens per sample as planned.
        rows: int64 ``[num_rows]``: sample indices of all micro-batches, concatenated (fill rows included).
        offsets: int64 ``[num_batches + 1]``: micro-batch ``b`` is ``rows[offsets[b]:offsets[b + 1]]``.
        pad_to_multiple_of: rows are padded to a multiple of this (tokens).
        cost_model: the cost of a micro-batch.

    Returns:
        ``(cost, slots)``: float64 and int64 ``[num_batches]``; ``slots`` = rows x longest padded row.
    """
    return _batch_costs(padded_lengths(lengths, pad_to_multiple_of), rows, offsets, cost_model)


class PaddedPlanner:
    """The padded planner (the default, ``packing=False``): :func:`plan_padded`, :func:`count_steps`,
    :func:`batch_costs` (see :class:`~lit_balance.plan.epoch.Planner`)."""

    name = "padded"
    cost_unit = "padded slots"  # what the default cost model counts under this planner
    row_buckets = True  # rows of similar length share a micro-batch: bucket edges describe the plan
    packed_rows = False  # a micro-batch is rows padded to a common length (lit_balance.PadCollator)
    plan = staticmethod(plan_padded)
    count_steps = staticmethod(count_steps)
    batch_costs = staticmethod(batch_costs)

    @staticmethod
    def worst_case_batch(settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The largest padded micro-batch of ``length``-token rows within ``budget`` slots: as many rows as fit
        (``budget // padded(length)``, capped by ``max_batch_size``); None when not one fits.

        Example:
            >>> PaddedPlanner.worst_case_batch(BatchingSettings(max_tokens=64, pad_to_multiple_of=8), 100, 30)
            WorstCaseBatch(rows=(30, 30, 30), slots=96, squares=3072)
        """
        width = int(padded_lengths(np.array([length]), settings.pad_to_multiple_of)[0])
        rows = int(budget) // width
        if settings.max_batch_size is not None:
            rows = min(rows, settings.max_batch_size)
        if rows < 1:
            return None
        return WorstCaseBatch(rows=(int(length),) * rows, slots=rows * width, squares=rows * width * width)

    @staticmethod
    def collator_options(settings: BatchingSettings) -> dict:
        """Keyword arguments of the collator beyond the settings' padding: none (rows padded to their longest)."""
        return {}

    # -- a mixture's steps (lit_balance.plan.mixture): documents chosen per step, micro-batches of all steps at once

    @staticmethod
    def steps_together(settings: BatchingSettings) -> bool:
        """Whether :meth:`batch_steps` forms the micro-batches of these settings' mixture steps: always (one budget
        for every rank; per-rank budgets are another planner)."""
        return True

    @staticmethod
    def step_key(lengths: np.ndarray, settings: BatchingSettings) -> np.ndarray:
        """int64 ``[n]``: what a step's micro-batches are cut by: each length padded to ``pad_to_multiple_of``."""
        return padded_lengths(lengths, settings.pad_to_multiple_of)

    @staticmethod
    def step_budget(longest: int, settings: BatchingSettings) -> int:
        """The padded token slots of the costliest micro-batch a mixture step whose longest padded document is
        ``longest`` tokens can hold: as many rows of that length as ``max_tokens`` (and ``max_batch_size``) allow.
        A micro-batch holding that document costs at most this, whatever else it holds; the step's other
        micro-batches are cut to it, not to ``max_tokens``, so that none holds its rank longer than the one of the
        longest document must.

        Example:
            >>> PaddedPlanner.step_budget(3000, BatchingSettings(max_tokens=8192))
            6000
        """
        rows = settings.max_tokens // int(longest)
        if settings.max_batch_size is not None:
            rows = min(rows, settings.max_batch_size)
        return max(rows, 1) * int(longest)

    @staticmethod
    def step_fits(key: np.ndarray, num_micro: int, settings: BatchingSettings, budget: int | None = None) -> bool:
        """Whether documents of padded lengths ``key`` (int64 ``[n]``, any order) fit ``num_micro`` padded
        micro-batches of ``budget`` slots (None: ``max_tokens``;
        :func:`~lit_balance.plan.mixture_batches.padded_fits`, exact for cuts of the sorted order)."""
        row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
        return padded_fits(np.sort(key)[::-1], num_micro, settings.max_tokens if budget is None else int(budget),
                           row_cap)

    batch_steps = staticmethod(batch_padded_steps)

    @staticmethod
    def real_token_fraction_bound(lengths: np.ndarray) -> float | None:
        """None: free shapes set no bound on the real-token fraction (see ``Planner``)."""
        return None

    @staticmethod
    def micro_batch_shapes(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                           settings: BatchingSettings) -> tuple[list[tuple[int, int]], list[str]]:
        """Each non-empty micro-batch's shape ``(rows, longest padded row)`` and its key ``"RxT"``."""
        sizes = np.diff(offsets)
        filled = sizes > 0
        longest = np.maximum.reduceat(padded_lengths(lengths[rows], settings.pad_to_multiple_of),
                                      offsets[:-1][filled]) if filled.any() else np.zeros(0, np.int64)
        shape = list(zip(sizes[filled].tolist(), longest.tolist()))
        return shape, [f"{int(r)}x{int(t)}" for r, t in shape]
