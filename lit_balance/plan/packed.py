"""Packed epoch planning: whole documents concatenated into one row per micro-batch, balanced across ranks.

With ``BatchingSettings(packing=True)`` a micro-batch is a set of whole documents whose real tokens sum to at
most the budget (``max_tokens`` rounded down to a multiple of ``pad_to_multiple_of``: the packed row, padded at
its tail, stays within ``max_tokens``). Lengths mix freely, so batch composition changes every epoch, and a
micro-batch costs ``per_batch + sum over its documents (linear * l + quadratic * l**2)``
(:meth:`~lit_balance.CostModel.packed_cost`): attention stays within each document. The plan keeps the layout of
:class:`~lit_balance.plan.types.EpochPlan` (rows are documents), so resume, the optimizer step's token counts and
the loss work unchanged.

Worked example (``max_tokens=10``, ``num_replicas=2``, ``shuffle=False``, token cost)::

    lengths = [9, 6, 4, 3, 3, 2, 2, 1]          # 30 tokens: ceil(30 / (0.98 x 10)) = 4 micro-batches
    # all but the 1 are outliers (longer than an eighth of the budget): longest first, each to the least costly
    # micro-batch with room: [9] [6] [4] [3], then 3 -> [3 3], 2 -> [4 2], 2 -> [6 2]; the 1 goes to the
    # micro-batch furthest below its target: [9] [6 2 1] [4 2] [3 3], costs 9, 9, 6, 6
    # steps, most costly first: step 0 = [9] and [6 2 1]; step 1 = [4 2] and [3 3]

The plan is made in six stages, all vectorised with numpy except a heap over the few outliers and the exchanges
of stage 5:

1. **Count.** The number of micro-batches is fixed from the lengths and settings only, so every epoch has the
   same length whatever the cost model: the smallest multiple of ``num_replicas`` at or above the most of
   ``ceil(tokens / budget)`` (with 2 % headroom), the documents longer than half the budget (no two share a
   row) and ``ceil(documents / max_batch_size)``, for which the unshuffled token-cost packing below fits.
   With unequal rank speeds a larger count, at which the fastest rank's share fits the budget, is planned too and
   the one that wastes less rank time is kept; epoch 0 decides, and every later epoch plans at its count.
2. **Outliers.** Documents sorted longest first (ties at random with ``shuffle``); those longer than an eighth
   of the budget or costing more than a quarter of an even share of a micro-batch are placed one by one on the
   least costly micro-batch with room (Graham's LPT rule, a heap).
3. **Steps and targets.** Micro-batches, most costly first, are grouped ``num_replicas *
   accumulate_grad_batches`` at a time into optimizer steps; the ranks of a step wait for its slowest, so every
   micro-batch of a step may cost as much as the step's outlier without slowing it. Each micro-batch's target
   is that level, or a common water level found by bisection, capped by its room in tokens (with unequal rank
   speeds, scaled by its rank's speed). This is the "outlier delay" of WLB-LLM (Wang et al., "WLB-LLM:
   Workload-Balance 4D Parallelism for Large Language Model Training", OSDI 2025): costly documents run
   together in the same steps, and the other ranks of those steps take more of the short ones, instead of
   one rank straggling in every step.
4. **Fill.** The short documents, in random order, are dealt to the micro-batches by cumulative cost against
   their targets (less a reserve); the reserve, the shortest documents, then goes largest first to the
   micro-batches furthest below target, one round over the micro-batches at a time, which closes the gaps to
   about the size of the shortest documents (the last, shortest ones one at a time, with a heap). Documents
   that do not fit (tokens, ``max_batch_size``) move to the micro-batch furthest below target that has room, or
   swap with a shorter document whose micro-batch then has room. In an epoch where that fails (none of the
   shipped distributions in 10 epochs), the unshuffled token-cost packing of stage 1, which fits by
   construction, is used: the same micro-batches as every such epoch, in a new order.
5. **Exchanges.** With equal rank speeds and one micro-batch per rank and step, where uneven steps waste more than
   0.1 % of the epoch (few micro-batches of few documents each, e.g. long documents on many ranks), the most costly
   micro-batch of each step whose ranks wait more than 0.2 % of its time gives a document, or swaps one for a cheaper
   one, with a micro-batch that stays at or below its own step's most costly one; then steps that wait for one long
   document take cost from flat steps of lower level, whose levels fall. No step gets slower (:func:`_polish`).
6. **Ranks and order.** Within each step the micro-batches go to ranks by LPT (most costly on the fastest
   rank); with ``shuffle`` ranks are permuted within a step and steps run in random order; ``largest_first``
   moves the step holding the epoch's longest document to the front.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from dataclasses import dataclass

import numpy as np

from lit_balance.plan.assign import (
    fastest_rank_first,
    hold_time,
    longest_first,
    lpt,
    lpt_steps,
    one_row_each,
    shuffle_steps,
)
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.mixture_batches import batch_packed_steps, packed_fits
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, WorstCaseBatch, longest_first_order, padded_lengths

__all__ = ["PackedPlanner", "batch_costs", "count_steps", "packed_count", "plan_packed"]

_UNSHUFFLED_SEED = 20250  # the dealing order of unshuffled packings (fixed: the same every epoch)
_HEADROOM = 0.02  # share of the budget the count leaves free, so that cost-balanced rows rarely overflow


def _headroom(settings: BatchingSettings) -> float:
    """The count's headroom: none with ``static_packing``, where every row costs its whole ``max_tokens`` slots, so
    full rows matter more than rows cut to equal costs (a failed cost packing falls back as in stage 4)."""
    return 0.0 if settings.static_packing else _HEADROOM
_RESERVE_FACTOR = 1.5  # reserve (finishing) cost per micro-batch, in units of the largest short document's cost
_POLISH_LOSS = 0.002  # stage 5 polishes a step whose ranks wait more than this share of its slowest rank's time
_POLISH_GAIN = 0.001  # stage 5 runs only where uneven steps waste more than this share of the epoch's time
_POLISH_OPS = 4  # at most this many exchanges per micro-batch of a polished step
_POLISH_SCAN = 256  # swap partners examined per document of the costliest micro-batch
_POLISH_POOL = 2048  # bins of other steps, those with the most room, that a polished step may move cost into
_POLISH_DROP = 0.01  # least share of its level a flat step gives to uneven ones (fewer, deeper donors)


def _count_lower_bound(lengths: np.ndarray, capacity: int, doc_cap: int, num_replicas: int,
                       headroom: float = _HEADROOM) -> int:
    """The least multiple of ``num_replicas`` that can hold the documents, raised for headroom where that needs no
    fill rows."""
    total, n = int(lengths.sum()), lengths.shape[0]
    need = max(-(-total // capacity), int(np.count_nonzero(2 * lengths > capacity)), -(-n // doc_cap), 1)
    need = -(-need // num_replicas) * num_replicas
    roomy = -(-int(np.ceil(total / (capacity * (1.0 - headroom)))) // num_replicas) * num_replicas
    return max(need, min(roomy, (n // num_replicas) * num_replicas))


def packed_count(lengths: np.ndarray, settings: BatchingSettings, num_replicas: int) -> int:
    """Micro-batches of every epoch (all ranks) for documents of ``lengths``: see stage 1 of the module doc.

    Returns 0 for no documents. Depends only on the lengths (as a multiset: the unshuffled token-cost packing
    treats documents of equal length alike), the budget, ``max_batch_size`` and ``num_replicas``, so it is
    remembered for the last few such inputs (every epoch of a sampler asks for the same).
    """
    n = lengths.shape[0]
    if not n:
        return 0
    capacity = settings.truncate_to
    doc_cap = settings.max_batch_size or n
    if int(lengths.max()) < 2**24:
        histogram = np.bincount(lengths)
    else:  # huge lengths: the histogram of the values present
        histogram = np.concatenate(np.unique(lengths, return_counts=True))
    headroom = _headroom(settings)
    key = (hashlib.sha256(histogram.tobytes()).hexdigest(), histogram.shape[0], capacity, doc_cap, num_replicas,
           headroom)
    if key not in _COUNTS:
        if len(_COUNTS) >= _COUNTS_HELD:
            _COUNTS.pop(next(iter(_COUNTS)))
        _COUNTS[key] = _count(lengths, capacity, doc_cap, num_replicas, headroom)
    return _COUNTS[key]


_COUNTS: dict[tuple, int] = {}
_COUNTS_HELD = 4096  # counts remembered (a few hundred bytes each): every window of a corpus of billions of samples


def _count(lengths: np.ndarray, capacity: int, doc_cap: int, num_replicas: int, headroom: float = _HEADROOM) -> int:
    n = lengths.shape[0]
    k = _count_lower_bound(lengths, capacity, doc_cap, num_replicas, headroom)
    if n <= k:
        return k
    tries = 0
    while _pack(lengths, lengths.astype(np.float64), k, capacity, doc_cap, num_replicas, 1,
                np.ones(num_replicas), None, headroom) is None:
        tries += 1
        k += num_replicas * max(1, k // (20 * num_replicas)) if tries > 3 else num_replicas
        if k >= n:
            return -(-n // num_replicas) * num_replicas
    return k


def _water_level(base: np.ndarray, scale: np.ndarray, cost: np.ndarray, token_room: np.ndarray,
                 total: float) -> np.ndarray:
    """Per-bin cost room ``min(max(base, tau) * scale - cost, token_room)`` (>= 0) at the ``tau`` giving ``total``."""
    def room(tau: float) -> np.ndarray:
        return np.clip(np.minimum(np.maximum(base, tau) * scale - cost, token_room), 0.0, None)

    if total <= 0:
        return np.zeros_like(cost)
    full = np.clip(token_room, 0.0, None)
    if full.sum() <= total:
        return full
    lo, hi = 0.0, float(((cost + full) / scale).max()) + 1.0
    if room(lo).sum() >= total:
        return room(lo)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if room(mid).sum() < total:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return room(hi)


@dataclass
class _Bins:
    """Documents being packed into ``k`` bins (micro-batches); documents are in the packing order.

    Attributes:
        length, cost: int64 / float64 ``[n]``: each document's tokens and cost.
        bin_of: int64 ``[n]``: each document's bin, -1 while unplaced.
        tokens, bin_cost, count: int64 / float64 / int64 ``[k]``: each bin's tokens, cost and documents.
    """

    length: np.ndarray
    cost: np.ndarray
    bin_of: np.ndarray
    tokens: np.ndarray
    bin_cost: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls, length: np.ndarray, cost: np.ndarray, k: int) -> _Bins:
        return cls(length, cost, np.full(length.shape[0], -1, dtype=np.int64), np.zeros(k, dtype=np.int64),
                   np.zeros(k), np.zeros(k, dtype=np.int64))

    def move(self, i: int, b: int) -> None:
        """Put document ``i`` into bin ``b`` (out of its bin first, if it has one)."""
        if self.bin_of[i] >= 0:
            self.take_out(i)
        self.bin_of[i] = b
        self.tokens[b] += self.length[i]
        self.bin_cost[b] += self.cost[i]
        self.count[b] += 1

    def take_out(self, i: int) -> None:
        """Take document ``i`` out of its bin."""
        b = int(self.bin_of[i])
        self.bin_of[i] = -1
        self.tokens[b] -= self.length[i]
        self.bin_cost[b] -= self.cost[i]
        self.count[b] -= 1

    def fits(self, capacity: int, doc_cap: int) -> bool:
        """Every document placed, every bin within ``capacity`` tokens and ``doc_cap`` documents."""
        return not ((self.tokens > capacity).any() or (self.count > doc_cap).any() or (self.bin_of < 0).any())


def _pack(lengths: np.ndarray, cost: np.ndarray, k: int, capacity: int, doc_cap: int, num_replicas: int,
          accumulate: int, speeds: np.ndarray, rng: np.random.Generator | None,
          headroom: float = _HEADROOM) -> tuple | None:
    """Pack documents (``lengths``, ``cost`` per document) into ``k`` non-empty bins within ``capacity`` tokens.

    Stages 2 to 4 of the module docstring, in the order of documents longest first (ties at random with ``rng``).

    Returns ``(bin_of, group_of_bin)``: int64 ``[n]`` bin of each document and int64 ``[k]`` the optimizer-step
    group each bin was targeted for (bins of one group share a step); None when the documents do not fit.
    """
    n = lengths.shape[0]
    if n < k:
        return None
    key = (capacity - lengths).astype(np.uint16) if capacity < 2**16 else -lengths  # uint16: a radix sort
    if rng is not None:
        perm = rng.permutation(n)
        order = perm[np.argsort(key[perm], kind="stable")]
    else:
        order = np.argsort(key, kind="stable")
    bins = _Bins.empty(lengths[order], cost[order], k)
    share = float(bins.cost.sum()) / k
    outlier = (8 * bins.length > capacity) | (bins.cost > 0.25 * share)
    if not _place_outliers(bins, np.flatnonzero(outlier), capacity, doc_cap):
        return None
    group_of_bin, target = _targets(bins, outlier, capacity, num_replicas, accumulate, speeds, rng, headroom)
    rest = np.flatnonzero(~outlier)
    if rest.size:
        goal_cost = _deal(bins, rest, target, outlier, rng) + target
        if not _settle(bins, rest, goal_cost, capacity, doc_cap):
            return None
    if not _fill_empty_bins(bins) or not bins.fits(capacity, doc_cap):
        return None
    out = np.empty(n, dtype=np.int64)
    out[order] = bins.bin_of
    return out, group_of_bin


def _place_outliers(bins: _Bins, out_idx: np.ndarray, capacity: int, doc_cap: int) -> bool:
    """Stage 2: outliers (longest first) one per bin, then each on the least costly bin with room (a heap).

    Returns False when one finds no bin with room.
    """
    k = bins.tokens.shape[0]
    first = out_idx[:k]
    bins.bin_of[first] = np.arange(first.shape[0])
    bins.tokens[:first.shape[0]] = bins.length[first]
    bins.bin_cost[:first.shape[0]] = bins.cost[first]
    bins.count[:first.shape[0]] = 1
    if out_idx.shape[0] <= k:
        return True
    heap = [(float(bins.bin_cost[b]), b) for b in range(k)]
    heapq.heapify(heap)
    for i in out_idx[k:].tolist():
        held = []
        while heap:
            entry = heapq.heappop(heap)
            b = entry[1]
            if bins.tokens[b] + bins.length[i] <= capacity and bins.count[b] < doc_cap:
                break
            held.append(entry)
        else:
            return False
        bins.move(i, b)
        held.append((float(bins.bin_cost[b]), b))
        for entry in held:
            heapq.heappush(heap, entry)
    return True


def _targets(bins: _Bins, outlier: np.ndarray, capacity: int, num_replicas: int, accumulate: int,
             speeds: np.ndarray, rng: np.random.Generator | None,
             headroom: float = _HEADROOM) -> tuple[np.ndarray, np.ndarray]:
    """Stage 3: bins to optimizer steps (most costly first) and each bin's target cost for the short documents.

    Returns ``(group_of_bin, target)``: int64 ``[k]`` each bin's step and float64 ``[k]`` the cost of short documents
    it should take.
    """
    bin_cost, length, c = bins.bin_cost, bins.length, bins.cost
    k = bin_cost.shape[0]
    key = bin_cost if rng is None else bin_cost + rng.uniform(0.0, 1e-9 * max(float(bin_cost.max()), 1.0), k)
    by_cost = np.argsort(-key, kind="stable")
    per_step = num_replicas * accumulate
    group_of_bin = np.empty(k, dtype=np.int64)
    group_of_bin[by_cost] = np.arange(k) // per_step
    scale = np.ones(k)
    if not bool(np.all(speeds == speeds[0])):  # provisional ranks: within each step, LPT on the outliers' cost
        for g0 in range(0, k, per_step):
            members = by_cost[g0:g0 + per_step]
            slots = lpt(bin_cost[members], speeds, members.shape[0] // num_replicas)
            for r in range(num_replicas):
                scale[members[slots[:, r]]] = speeds[r]
    step_level = np.zeros(int(group_of_bin.max()) + 1)
    np.maximum.at(step_level, group_of_bin, bin_cost / scale)
    rest = np.flatnonzero(~outlier)
    rest_cost = float(c[rest].sum())
    per_token = rest_cost / max(int(length[rest].sum()), 1)
    # targets leave half the count's headroom free in every bin, for the dealing's rounding
    room = per_token * (capacity * (1.0 - 0.5 * headroom) - bins.tokens)
    return group_of_bin, _water_level(step_level[group_of_bin], scale, bin_cost, room, rest_cost)


def _deal(bins: _Bins, rest: np.ndarray, target: np.ndarray, outlier: np.ndarray,
          rng: np.random.Generator | None) -> np.ndarray:
    """Stage 4, first part: deal the short documents in random order against their targets, less a reserve of the
    shortest (left unplaced for :func:`_settle`). Returns float64 ``[k]``: the outliers' cost of each bin."""
    c, k = bins.cost, bins.tokens.shape[0]
    rest_cost = float(c[rest].sum())
    reserve_cost = min(rest_cost, _RESERVE_FACTOR * k * float(c[rest[0]]))
    cum_from_end = np.cumsum(c[rest][::-1])
    num_reserve = int(np.searchsorted(cum_from_end, reserve_cost, side="left")) + 1
    num_reserve = min(max(num_reserve, min(k, rest.size)), rest.size)
    mid = rest[:rest.size - num_reserve]
    if mid.size:
        mid_cost = float(c[mid].sum())
        goal = target * (mid_cost / max(float(target.sum()), 1e-300))
        # without shuffle a fixed generator deals (the same every epoch): sorted runs would make uneven bins
        deal = rng if rng is not None else np.random.default_rng(_UNSHUFFLED_SEED)
        bins_order = deal.permutation(k)
        dealt = deal.permutation(mid)
        edges = np.cumsum(goal[bins_order])
        middle = np.cumsum(c[dealt]) - 0.5 * c[dealt]
        where = np.minimum(np.searchsorted(edges, middle, side="right"), k - 1)
        bins.bin_of[dealt] = bins_order[where]
        bins.tokens += np.bincount(bins.bin_of[dealt], weights=bins.length[dealt], minlength=k).astype(np.int64)
        bins.bin_cost += np.bincount(bins.bin_of[dealt], weights=c[dealt], minlength=k)
        bins.count += np.bincount(bins.bin_of[dealt], minlength=k)
    return _placed_outlier_cost(bins.bin_of, c, outlier, k)


def _settle(bins: _Bins, rest: np.ndarray, goal_cost: np.ndarray, capacity: int, doc_cap: int) -> bool:
    """Stage 4, second part: place the reserve (:func:`_finish`), take the shortest documents out of over-full bins
    (:func:`_evict`), place those in rounds (:func:`_place_rounds`), and the rest one at a time on the bin furthest
    below its goal with room, or in exchange for a shorter placed document whose bin then has room.

    Returns False when a document finds neither.
    """
    length, c, bin_of, tokens, bin_cost, count = (bins.length, bins.cost, bins.bin_of, bins.tokens, bins.bin_cost,
                                                  bins.count)
    reserve = rest[bin_of[rest] < 0]
    leftovers = _finish(reserve, length, c, bin_of, tokens, bin_cost, count, goal_cost, capacity, doc_cap)
    # Over-full bins (tokens or documents) give back their shortest documents.
    leftovers = np.concatenate([leftovers, _evict(length, c, bin_of, tokens, bin_cost, count, capacity, doc_cap)])
    queue = _place_rounds(leftovers[np.argsort(-length[leftovers], kind="stable")], length, c, bin_of, tokens,
                          bin_cost, count, goal_cost, capacity, doc_cap).tolist()
    swaps, n = 0, length.shape[0]
    while queue:
        i = queue.pop(0)
        fits = (tokens + length[i] <= capacity) & (count < doc_cap)
        if not fits.any():  # swap with a shorter placed document whose bin then has room; place that one
            placed = np.flatnonzero(bin_of >= 0)
            ok = placed[(length[placed] < length[i])
                        & (tokens[bin_of[placed]] - length[placed] + length[i] <= capacity)]
            swaps += 1
            if not ok.size or swaps > n:
                return False
            j = int(ok[np.argmin(length[ok])])
            b = int(bin_of[j])
            bins.take_out(j)
            queue.append(j)
        else:
            b = int(np.argmax(np.where(fits, goal_cost - bin_cost, -np.inf)))
        bins.move(i, b)
    return True


def _fill_empty_bins(bins: _Bins) -> bool:
    """Every bin holds at least one document: an empty one takes the shortest of the bin with the most.

    Returns False when no bin has two documents to give.
    """
    for b in np.flatnonzero(bins.count == 0).tolist():
        donor = int(np.argmax(bins.count))
        if bins.count[donor] < 2:
            return False
        members = np.flatnonzero(bins.bin_of == donor)
        bins.move(int(members[np.argmin(bins.length[members])]), b)
    return True


def _place_rounds(docs: np.ndarray, length: np.ndarray, c: np.ndarray, bin_of: np.ndarray, tokens: np.ndarray,
                  bin_cost: np.ndarray, count: np.ndarray, goal_cost: np.ndarray, capacity: int,
                  doc_cap: int) -> np.ndarray:
    """Place documents (longest first) in rounds: each on a distinct bin with room, furthest below goal first.

    Returns those no bin had room for.
    """
    while docs.size:
        room = np.where(count < doc_cap, capacity - tokens, -1)
        open_bins = np.flatnonzero(room >= length[docs[-1]])
        if not open_bins.size:
            break
        open_bins = open_bins[np.argsort(-(goal_cost - bin_cost)[open_bins], kind="stable")]
        take = min(open_bins.size, docs.size)
        sel, batch = open_bins[:take], docs[:take]
        ok = room[sel] >= length[batch]
        if not ok.any():
            break
        sel, placed = sel[ok], batch[ok]
        bin_of[placed] = sel
        tokens[sel] += length[placed]
        bin_cost[sel] += c[placed]
        count[sel] += 1
        docs = np.concatenate([batch[~ok], docs[take:]])
    return docs


def _placed_outlier_cost(bin_of: np.ndarray, c: np.ndarray, outlier: np.ndarray, k: int) -> np.ndarray:
    """Cost of the outliers already in each bin (what the targets were measured from)."""
    idx = np.flatnonzero(outlier)
    return np.bincount(bin_of[idx], weights=c[idx], minlength=k) if idx.size else np.zeros(k)


def _finish(reserve: np.ndarray, length: np.ndarray, c: np.ndarray, bin_of: np.ndarray, tokens: np.ndarray,
            bin_cost: np.ndarray, count: np.ndarray, goal_cost: np.ndarray, capacity: int, doc_cap: int) -> np.ndarray:
    """Deal the reserve (longest first) to the bins furthest below their goal.

    All but the last ``2 * k`` documents go in rounds (one document to each bin with room that is at least half the
    next document below its goal, the longest to the furthest below) while an eighth of the bins or more take
    part; the rest, the shortest documents, go one at a time to the bin furthest
    below its goal among those with room for any of them (LPT, a heap), which closes the gaps the rounds leave.
    Returns the documents that did not fit
    the bin they were dealt to.
    """
    k = tokens.shape[0]
    left: list[np.ndarray] = []
    n_res = reserve.shape[0]
    pos, rounds_end = 0, max(n_res - 2 * k, 0)
    while pos < rounds_end:
        deficit = goal_cost - bin_cost
        head = reserve[pos]
        has_room = (tokens + length[head] <= capacity) & (count < doc_cap)
        needy = np.flatnonzero(has_room & (deficit > 0.5 * c[head]))  # the next document brings them nearer
        active = needy if needy.size else np.flatnonzero(has_room)
        if active.size * 8 < k:  # few bins left to close: the rest goes one at a time (below)
            break
        take = min(active.size, rounds_end - pos)
        sel = active[np.argsort(-deficit[active], kind="stable")[:take]]
        docs = reserve[pos:pos + take]
        pos += take
        ok = (tokens[sel] + length[docs] <= capacity) & (count[sel] < doc_cap)
        sel, placed = sel[ok], docs[ok]
        left.append(docs[~ok])
        bin_of[placed] = sel
        tokens[sel] += length[placed]
        bin_cost[sel] += c[placed]
        count[sel] += 1
    tail = reserve[pos:]
    if tail.size:
        longest = int(length[tail].max())  # only bins with room for any tail document take part
        open_bins = np.flatnonzero((tokens + longest <= capacity) & (count < doc_cap))
        heap = list(zip((bin_cost[open_bins] - goal_cost[open_bins]).tolist(), open_bins.tolist()))
        heapq.heapify(heap)
        tokens_list, count_list, cost_list = tokens.tolist(), count.tolist(), bin_cost.tolist()
        target_bin = np.full(tail.shape[0], -1, dtype=np.int64)
        for j, (t_len, t_cost) in enumerate(zip(length[tail].tolist(), c[tail].tolist())):
            if not heap:
                break
            over, b = heapq.heappop(heap)
            target_bin[j] = b
            tokens_list[b] += t_len
            count_list[b] += 1
            cost_list[b] += t_cost
            if tokens_list[b] + longest <= capacity and count_list[b] < doc_cap:
                heapq.heappush(heap, (over + t_cost, b))
        tokens[:] = tokens_list
        count[:] = count_list
        bin_cost[:] = cost_list
        placed = target_bin >= 0
        bin_of[tail[placed]] = target_bin[placed]
        left.append(tail[~placed])
    return np.concatenate(left) if left else np.empty(0, dtype=np.int64)


def _evict(length: np.ndarray, c: np.ndarray, bin_of: np.ndarray, tokens: np.ndarray, bin_cost: np.ndarray,
           count: np.ndarray, capacity: int, doc_cap: int) -> np.ndarray:
    """Take the shortest documents out of bins over ``capacity`` tokens or ``doc_cap`` documents; return them."""
    over = (tokens > capacity) | (count > doc_cap)
    if not over.any():
        return np.empty(0, dtype=np.int64)
    docs = np.flatnonzero(over[np.maximum(bin_of, 0)] & (bin_of >= 0))
    docs = docs[np.lexsort((length[docs], bin_of[docs]))]  # by bin, shortest first
    bins = bin_of[docs]
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    rank = np.arange(docs.shape[0]) - np.repeat(starts, np.diff(np.r_[starts, docs.shape[0]]))
    cum = np.cumsum(length[docs])
    before = np.repeat(np.r_[0, cum[starts[1:] - 1]], np.diff(np.r_[starts, docs.shape[0]]))
    removed_tokens = cum - before - length[docs]  # tokens of the shorter documents of the same bin
    excess_tokens = tokens[bins] - capacity
    excess_count = count[bins] - doc_cap
    evict = (removed_tokens < excess_tokens) | (rank < excess_count)
    out = docs[evict]
    np.subtract.at(tokens, bin_of[out], length[out])
    np.subtract.at(bin_cost, bin_of[out], c[out])
    np.subtract.at(count, bin_of[out], 1)
    bin_of[out] = -1
    return out


def plan_packed(lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
                epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0) -> EpochPlan:
    """Plan one packed epoch for all ranks (:func:`~lit_balance.plan_epoch` calls it when ``settings.packing``).

    Args:
        lengths: int64 ``[num_samples]``: tokens per document (already truncated where that applies).
        candidates: int64 indices of the documents to plan (every one within the budget).
        settings: the batching settings (``packing=True``).
        num_replicas: number of ranks.
        epoch: the epoch; with ``settings.shuffle`` the generator is seeded by ``(settings.seed, epoch)``.
        cost_model: the cost of a packed micro-batch (:meth:`CostModel.packed_cost`).
        speeds: float64 ``[num_replicas]`` relative rank speeds.
        min_steps: at least this many micro-steps where the documents allow (resume on other ranks).

    Returns:
        The :class:`EpochPlan`: ``rows`` are document indices, each micro-batch one packed row.

    Raises:
        RuntimeError: no packing fits (cannot happen for documents within the budget; a bug if it does).

    Example:
        >>> from lit_balance import BatchingSettings, plan_epoch
        >>> lengths = [9, 6, 4, 3, 3, 2, 2, 1]
        >>> plan = plan_epoch(lengths, BatchingSettings(max_tokens=10, shuffle=False, packing=True), num_replicas=2,
        ...                   epoch=0)
        >>> [[lengths[i] for i in plan.batch(b)[0]] for b in range(plan.num_batches)], plan.assignment.tolist()
        ([[9], [6, 2, 1], [4, 2], [3, 3]], [[0, 1], [2, 3]])
    """
    shuffle = settings.shuffle
    rng = np.random.default_rng(np.random.SeedSequence([int(settings.seed), int(epoch)])) if shuffle else None
    finish_rng = np.random.default_rng(np.random.SeedSequence([int(settings.seed), int(epoch), 1])) if shuffle else None
    accumulate = settings.accumulate_grad_batches
    capacity = settings.truncate_to
    doc_cap = settings.max_batch_size or max(int(candidates.shape[0]), 1)
    n = candidates.shape[0]
    doc_len = lengths[candidates]
    k = verified = packed_count(doc_len, settings, num_replicas)
    if min_steps * num_replicas > k:
        k = max(k, min(min_steps, n // num_replicas) * num_replicas)
    uniform = bool(np.all(speeds == speeds[0]))
    if n <= k:  # one document per micro-batch, and fill rows or drops to equal counts
        return _one_each(candidates, lengths, k, num_replicas, accumulate, speeds, settings, cost_model, finish_rng)
    doc_cost = cost_model.row_cost(doc_len)
    headroom = _headroom(settings)
    tried = [k]
    if not uniform:  # more micro-batches, so that the fastest rank's share fits the budget (least waste kept)
        share = speeds.max() / speeds.mean()
        k_fast = -(-int(np.ceil(doc_len.sum() * share / (capacity * (1 - headroom)))) // num_replicas) * num_replicas
        if k < k_fast < n:
            tried.append(k_fast)
    if len(tried) > 1 and shuffle and epoch != 0:  # the count epoch 0 chose: every epoch as long as len() said
        tried = [plan_packed(lengths, candidates, settings, num_replicas=num_replicas, epoch=0, cost_model=cost_model,
                             speeds=speeds, min_steps=min_steps).num_batches]
    best: tuple[float, EpochPlan] | None = None
    for count in tried:
        packed = _pack(doc_len, doc_cost, count, capacity, doc_cap, num_replicas, accumulate, speeds, rng, headroom)
        if packed is None and count == tried[0]:  # the unshuffled token-cost packing of the count fits by construction
            packed = _pack(doc_len, doc_len.astype(np.float64), verified, capacity, doc_cap, num_replicas, 1,
                           np.ones(num_replicas), None, headroom)
            if packed is not None:  # split to the count asked for (min_steps); its steps, most costly first
                bin_of = _split_bins(packed[0], verified, count)
                bin_cost = np.bincount(bin_of, weights=doc_cost, minlength=count)
                group_of_bin = np.empty(count, dtype=np.int64)
                group_of_bin[np.argsort(-bin_cost, kind="stable")] = np.arange(count) // (num_replicas * accumulate)
                packed = (bin_of, group_of_bin)
        if packed is None:
            if count == tried[0]:
                raise RuntimeError(f"packed planning found no packing of {n} documents into {count} micro-batches of "
                                   f"{capacity} tokens; please report this with the lengths")
            continue
        if uniform and accumulate == 1 and not settings.static_packing:
            packed = (_polish(doc_len, doc_cost, packed[0], packed[1], capacity, doc_cap), packed[1])
        plan = _layout(candidates, lengths, *packed, num_replicas, accumulate, speeds, settings, cost_model,
                       finish_rng)
        waste = hold_time(cost_model.packed_cost(lengths[plan.rows], plan.batch_offsets), plan.assignment,
                          plan.accumulate_grad_batches, speeds)
        if best is None or waste < best[0]:
            best = (waste, plan)
    return best[1]


def _polish(length: np.ndarray, cost: np.ndarray, bin_of: np.ndarray, group_of_bin: np.ndarray, capacity: int,
            doc_cap: int) -> np.ndarray:
    """Stage 5: lower the most costly micro-batch of each uneven step: move one of its documents, or swap one for a
    cheaper document, into room below another step's level (or, within its own step, below the lowered cost).

    Equal rank speeds and one micro-batch per rank and step: the ranks of a step wait for its most costly micro-batch,
    so cost moved from it into a micro-batch that stays at or below its own step's most costly one shortens the
    epoch and lengthens nothing. A local search in the manner of the exchange heuristics for multiprocessor
    scheduling (Finn and Horowitz, "A linear time approximation algorithm for multiprocessor scheduling", BIT 19,
    1979), applied only to steps whose ranks wait more than ``_POLISH_LOSS`` of their time, with a bounded number of
    exchanges: every document stays in exactly one micro-batch, within ``capacity`` tokens and ``doc_cap``
    documents, and no micro-batch empties.

    Args:
        length, cost: int64 / float64 ``[n]``: each document's tokens and cost.
        bin_of: int64 ``[n]``: each document's micro-batch (not changed; a new array is returned when one moves).
        group_of_bin: int64 ``[k]``: each micro-batch's step.

    Returns:
        int64 ``[n]``: each document's micro-batch after the exchanges.
    """
    k = group_of_bin.shape[0]
    if not k:
        return bin_of
    bin_cost = np.bincount(bin_of, weights=cost, minlength=k)
    num_groups = int(group_of_bin.max()) + 1
    level = np.zeros(num_groups)
    np.maximum.at(level, group_of_bin, bin_cost)
    size = np.bincount(group_of_bin, minlength=num_groups)
    loss = level * size - np.bincount(group_of_bin, weights=bin_cost, minlength=num_groups)
    todo = np.flatnonzero(loss > _POLISH_LOSS * level * size)
    if float(loss[todo].sum()) <= _POLISH_GAIN * float((level * size).sum()):  # uneven steps lose little: done
        return bin_of
    todo = todo[np.argsort(-loss[todo], kind="stable")]
    bin_of = bin_of.copy()
    tokens = np.bincount(bin_of, weights=length, minlength=k).astype(np.int64)
    count = np.bincount(bin_of, minlength=k)
    by_bin = np.argsort(bin_of, kind="stable")
    bin_start = np.searchsorted(bin_of[by_bin], np.arange(k + 1))
    moved_in: dict[int, list[int]] = collections.defaultdict(list)
    by_cost = np.argsort(cost, kind="stable")
    sorted_cost = cost[by_cost]
    bins_of_group = np.argsort(group_of_bin, kind="stable")
    group_start = np.searchsorted(group_of_bin[bins_of_group], np.arange(num_groups + 1))
    tiny = 1e-9 * max(float(level.max()), 1e-300)

    def members(b: int) -> np.ndarray:
        docs = np.concatenate([by_bin[bin_start[b]:bin_start[b + 1]], np.asarray(moved_in.get(b, ()), np.int64)])
        return np.unique(docs[bin_of[docs] == b])

    def roomiest() -> np.ndarray:
        """The bins with the most room below their step's level (at most ``_POLISH_POOL``)."""
        slack_all = level[group_of_bin] - bin_cost
        pool = np.flatnonzero(slack_all > tiny)
        if pool.size > _POLISH_POOL:
            pool = pool[np.argpartition(-slack_all[pool], _POLISH_POOL)[:_POLISH_POOL]]
        return pool

    def lower(s: int, goal: float | None, pool: np.ndarray) -> None:
        """Exchanges that bring step ``s``'s most costly micro-batch down towards ``goal`` (None: the step's mean),
        into bins of ``pool`` or of the step itself, or by a swap with any bin."""
        in_step = bins_of_group[group_start[s]:group_start[s + 1]]
        targets = np.concatenate([pool[group_of_bin[pool] != s], in_step])
        for _ in range(_POLISH_OPS * in_step.shape[0]):
            step_cost = bin_cost[in_step]
            top_at = int(np.argmax(step_cost))
            b, top = int(in_step[top_at]), float(step_cost[top_at])
            want = top - (float(step_cost.mean()) if goal is None else goal)
            if want <= tiny:
                break

            def slack(bins: np.ndarray) -> np.ndarray:
                """Room below the level of each of ``bins``; within the step, both end at or below top - delta."""
                out = np.where(group_of_bin[bins] == s, 0.5 * (top - bin_cost[bins]), level[group_of_bin[bins]]
                               - bin_cost[bins])
                return np.where(bins == b, -np.inf, out)

            docs = members(b)
            best = (np.inf, -1, -1, -1)  # (|delta - want|, document out of b, the other's document or -1, other bin)
            if count[b] > 1:  # move: the document of b nearest the want that some bin has room for
                target_slack = slack(targets)
                target_room = np.where(count[targets] < doc_cap, capacity - tokens[targets], -1)
                movable = docs[cost[docs] <= 2.0 * want]
                for a in movable[np.argsort(np.abs(cost[movable] - want), kind="stable")].tolist():
                    fit = np.flatnonzero((target_slack >= cost[a] - tiny) & (target_room >= length[a]))
                    if fit.size:
                        best = (abs(float(cost[a]) - want), a, -1, int(targets[fit[np.argmin(target_slack[fit])]]))
                        break
            tried: set[float] = set()
            for a in docs.tolist():  # swap: a cheaper document of another bin, the difference nearest the want
                ca = float(cost[a])
                if ca in tried:
                    continue
                tried.add(ca)
                mid = int(np.searchsorted(sorted_cost, ca - want, side="left"))
                lo = max(int(np.searchsorted(sorted_cost, ca - 2.0 * want, side="left")), mid - _POLISH_SCAN)
                hi = min(int(np.searchsorted(sorted_cost, ca - tiny, side="left")), mid + _POLISH_SCAN)
                cand = by_cost[lo:hi]
                other = bin_of[cand]
                delta = ca - cost[cand]
                ok = ((delta > tiny) & (slack(other) >= delta - tiny)
                      & (tokens[other] - length[cand] + length[a] <= capacity))
                if ok.any():
                    at = np.flatnonzero(ok)
                    at = int(at[np.argmin(np.abs(delta[at] - want))])
                    if abs(float(delta[at]) - want) < best[0]:
                        best = (abs(float(delta[at]) - want), a, int(cand[at]), int(other[at]))
            _, a, d, c = best
            if a < 0:
                break
            for doc, src, dst in ((a, b, c), (d, c, b)):
                if doc < 0:
                    continue
                bin_of[doc] = dst
                moved_in[dst].append(doc)
                tokens[src] -= length[doc]
                tokens[dst] += length[doc]
                count[src] -= 1
                count[dst] += 1
                bin_cost[src] -= cost[doc]
                bin_cost[dst] += cost[doc]
            level[s] = float(bin_cost[in_step].max())

    pool = roomiest()
    for s in todo.tolist():
        lower(s, None, pool)
    # Steps still uneven wait for a micro-batch that no exchange lowers (one long document): their room takes cost
    # from flat steps of lower level, whose levels then fall, the highest first.
    loss = level * size - np.bincount(group_of_bin, weights=bin_cost, minlength=num_groups)
    uneven = loss > _POLISH_LOSS * level * size
    if uneven.any():
        hole = float(loss[uneven].sum())
        donors = np.flatnonzero(~uneven & (level < level[uneven].max()))
        donors = donors[np.argsort(-level[donors], kind="stable")]
        per_bin = _POLISH_DROP * float(level[donors].mean()) if donors.size else 0.0
        donors = donors[:max(1, int(np.ceil(hole / max(per_bin * float(size.max()), 1e-300))))]
        if donors.size:
            drop = hole / float(size[donors].sum())
            pool = roomiest()
            for s in donors.tolist():
                in_step = bins_of_group[group_start[s]:group_start[s + 1]]
                lower(s, float(bin_cost[in_step].mean()) - drop, pool)
    return bin_of


def _split_bins(bin_of: np.ndarray, k: int, target: int) -> np.ndarray:
    """Split the bins holding the most documents in two until there are ``target`` (each part stays in budget)."""
    if target <= k:
        return bin_of
    bin_of = bin_of.copy()
    members = collections.defaultdict(list)
    for i, b in enumerate(bin_of.tolist()):
        members[b].append(i)
    heap = [(-len(docs), b) for b, docs in members.items()]
    heapq.heapify(heap)
    for new in range(k, target):
        size, b = heapq.heappop(heap)
        docs = members[b]
        moved = docs[len(docs) // 2:]  # -size >= 2: there are more documents than bins
        members[b], members[new] = docs[:len(docs) // 2], moved
        bin_of[moved] = new
        heapq.heappush(heap, (-len(members[b]), b))
        heapq.heappush(heap, (-len(moved), new))
    return bin_of


def _layout(candidates: np.ndarray, lengths: np.ndarray, bin_of: np.ndarray, group_of_bin: np.ndarray,
            num_replicas: int, accumulate: int, speeds: np.ndarray, settings: BatchingSettings,
            cost_model: CostModelProtocol, rng: np.random.Generator | None) -> EpochPlan:
    """Rows grouped by bin, and bins to micro-steps and ranks: each group is one optimizer step."""
    k = group_of_bin.shape[0]
    rows = candidates[np.argsort(bin_of.astype(np.uint16) if k < 2**16 else bin_of, kind="stable")]  # radix sort
    offsets = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=k))]).astype(np.int64)
    cost = cost_model.packed_cost(lengths[rows], offsets)
    uniform = bool(np.all(speeds == speeds[0]))
    num_groups = int(group_of_bin.max()) + 1 if k else 0
    if accumulate == 1:  # one micro-batch per rank and step: the most costly on the fastest rank, vectorised
        steps = np.lexsort((-cost, group_of_bin)).reshape(num_groups, num_replicas)
        assignment = fastest_rank_first(steps, speeds, rng, uniform)
    else:
        members_by_group = np.argsort(group_of_bin, kind="stable")
        bounds = np.searchsorted(group_of_bin[members_by_group], np.arange(num_groups + 1))
        groups = lpt_steps((members_by_group[bounds[g]:bounds[g + 1]] for g in range(num_groups)), cost, speeds,
                           num_replicas, rng, uniform)
        assignment = np.concatenate(groups, axis=0) if groups else np.empty((0, num_replicas), dtype=np.int64)
    if rng is not None:  # a shorter last step stays last, so accumulation windows stay aligned
        assignment = shuffle_steps(assignment, accumulate, rng)
    if settings.largest_first and assignment.shape[0]:
        assignment = longest_first(assignment, offsets, lengths[rows], accumulate)
    return EpochPlan(rows=rows.astype(np.int64), is_fill=np.zeros(rows.shape[0], dtype=bool), batch_offsets=offsets,
                     assignment=np.ascontiguousarray(assignment, dtype=np.int64),
                     dropped=np.empty(0, dtype=np.int64), accumulate_grad_batches=int(accumulate))


def _one_each(candidates: np.ndarray, lengths: np.ndarray, k: int, num_replicas: int, accumulate: int,
              speeds: np.ndarray, settings: BatchingSettings, cost_model: CostModelProtocol,
              rng: np.random.Generator | None) -> EpochPlan:
    """Too few documents for ``k`` micro-batches of several: one each, then fill rows or (drop_last) drops."""
    n = candidates.shape[0]
    order = candidates[longest_first_order(lengths[candidates])]
    dropped = np.empty(0, dtype=np.int64)
    fill = 0
    if n < k:
        order, dropped, fill = one_row_each(order, k, num_replicas, settings.drop_last, rng)
    m = order.shape[0]
    bin_of = np.arange(m, dtype=np.int64)
    cost = cost_model.packed_cost(lengths[order], np.arange(m + 1))
    by_cost = np.argsort(-cost, kind="stable")
    group_of_bin = np.empty(m, dtype=np.int64)
    group_of_bin[by_cost] = np.arange(m) // (num_replicas * accumulate)
    plan = _layout(order, lengths, bin_of, group_of_bin, num_replicas, accumulate, speeds, settings, cost_model, rng)
    is_fill = np.zeros(m, dtype=bool)
    if fill:
        is_fill[n:] = True  # rows keep the order of ``order`` (one per bin, bins in order)
    return EpochPlan(rows=plan.rows, is_fill=is_fill, batch_offsets=plan.batch_offsets, assignment=plan.assignment,
                     dropped=dropped, accumulate_grad_batches=plan.accumulate_grad_batches)


def batch_costs(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
    """Each packed micro-batch's cost and token slots (empty micro-batches: 0).

    Args:
        lengths: int64 ``[num_samples]``: tokens per document as planned.
        rows: int64 ``[num_rows]``: document indices of all micro-batches, concatenated (fill documents included:
            they run).
        offsets: int64 ``[num_batches + 1]``: micro-batch ``b`` is ``rows[offsets[b]:offsets[b + 1]]``.
        pad_to_multiple_of: the packed row is padded at its tail to a multiple of this (tokens).
        cost_model: the cost of a micro-batch (:meth:`~lit_balance.CostModel.packed_cost`).

    Returns:
        ``(cost, slots)``: float64 and int64 ``[num_batches]``; ``slots`` = the row's real tokens rounded up to
        ``pad_to_multiple_of``.
    """
    sizes = np.diff(offsets)
    cumulative = np.concatenate([[0], np.cumsum(lengths[rows], dtype=np.int64)])
    slots = padded_lengths(cumulative[offsets[1:]] - cumulative[offsets[:-1]], pad_to_multiple_of)
    cost = (np.where(sizes > 0, cost_model.packed_cost(lengths[rows], offsets), 0.0) if sizes.shape[0]
            else np.zeros(0))
    return np.asarray(cost, dtype=np.float64).reshape(-1), slots


def count_steps(lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings, num_replicas: int,
                min_steps: int, cost_model: CostModelProtocol) -> tuple[int, int, None]:
    """``(micro-steps, min_steps to plan with, None)`` of a window's packed plan with equal rank speeds.

    The count is fixed by the lengths and settings (stage 1 of the module docstring), whatever the epoch, so it is
    read from that count without planning (the same as :func:`~lit_balance.plan.assign.steps_by_planning` of
    :func:`plan_packed` learns by planning), rounded up to a multiple of ``accumulate_grad_batches`` where the
    documents allow. ``lengths`` are the window's (int ``[n]``), ``mask`` its eligible documents (or None).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    candidates = np.arange(lengths.shape[0], dtype=np.int64) if mask is None else np.flatnonzero(mask)
    steps = _micro_steps(lengths[candidates], settings, num_replicas, min_steps)
    accumulate = settings.accumulate_grad_batches
    aligned = -(-steps // accumulate) * accumulate
    if aligned == steps:
        return steps, min_steps, None
    return _micro_steps(lengths[candidates], settings, num_replicas, aligned), aligned, None


def _micro_steps(doc_len: np.ndarray, settings: BatchingSettings, num_replicas: int, min_steps: int) -> int:
    """Micro-steps of :func:`plan_packed`'s plan of documents of ``doc_len`` with equal rank speeds, any epoch, without
    planning it: the count of stage 1 (raised for ``min_steps``), or with fewer documents than that and
    ``drop_last``, one micro-batch per document on as many steps as every rank fills."""
    n = doc_len.shape[0]
    k = packed_count(doc_len, settings, num_replicas)
    if min_steps * num_replicas > k:
        k = max(k, min(min_steps, n // num_replicas) * num_replicas)
    if n < k and settings.drop_last:
        return n // num_replicas
    return k // num_replicas


class PackedPlanner:
    """The packed planner (``packing=True``): :func:`plan_packed`, :func:`count_steps`, :func:`batch_costs` (see
    :class:`~lit_balance.plan.epoch.Planner`)."""

    name = "packed"
    cost_unit = "tokens"  # what the default cost model counts under this planner
    row_buckets = False  # one row per micro-batch: no length buckets
    packed_rows = True  # a micro-batch is one row of whole documents (lit_balance.PackedCollator)

    @staticmethod
    def worst_case_batch(settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The largest packed micro-batch of ``length``-token documents within ``budget`` slots: one row of
        ``budget // length`` whole documents (the budget rounded down to ``pad_to_multiple_of``) and the rest of the
        row as one shorter document; None when not one document fits.

        Example:
            >>> PackedPlanner.worst_case_batch(BatchingSettings(max_tokens=64), 100, 30)
            WorstCaseBatch(rows=(30, 30, 30, 10), slots=100, squares=2800)
        """
        m = settings.pad_to_multiple_of
        room = (int(budget) // m) * m  # real tokens of one packed row, as the packed planner allows
        if room < length:
            return None
        docs = [int(length)] * (room // length) + ([room % length] if room % length else [])
        slots = int(padded_lengths(np.array([sum(docs)]), m)[0])
        return WorstCaseBatch(rows=tuple(docs), slots=slots, squares=sum(d * d for d in docs))

    @staticmethod
    def plan(lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int, epoch: int,
             cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
             num_batches: int | None = None) -> EpochPlan:
        """:func:`plan_packed` (``num_batches`` is not used: the packed count is its own)."""
        return plan_packed(lengths, candidates, settings, num_replicas=num_replicas, epoch=epoch,
                           cost_model=cost_model, speeds=speeds, min_steps=min_steps)

    count_steps = staticmethod(count_steps)
    batch_costs = staticmethod(batch_costs)

    @staticmethod
    def collator_options(settings: BatchingSettings) -> dict:
        """Keyword arguments of the collator beyond the settings' padding: none (the row as long as its documents)."""
        return {}

    # -- a mixture's steps (lit_balance.plan.mixture): documents chosen per step, micro-batches of all steps at once

    @staticmethod
    def steps_together(settings: BatchingSettings) -> bool:
        """Whether :meth:`batch_steps` forms these settings' mixture steps: without ``max_batch_size``."""
        return settings.max_batch_size is None

    @staticmethod
    def step_key(lengths: np.ndarray, settings: BatchingSettings) -> np.ndarray:
        """int64 ``[n]``: what a step's packed rows are filled by: the lengths themselves."""
        return np.asarray(lengths, dtype=np.int64)

    @staticmethod
    def step_budget(longest: int, settings: BatchingSettings) -> int:
        """``max_tokens``: a packed row fills to the budget with any documents, whatever the longest."""
        return int(settings.max_tokens)

    @staticmethod
    def step_fits(key: np.ndarray, num_micro: int, settings: BatchingSettings, budget: int | None = None) -> bool:
        """Whether documents of ``key`` tokens surely fit ``num_micro`` packed rows of the budget (``budget`` is not
        read; :func:`~lit_balance.plan.mixture_batches.packed_fits`, sufficient)."""
        return packed_fits(key, num_micro, settings.truncate_to)

    batch_steps = staticmethod(batch_packed_steps)

    @staticmethod
    def real_token_fraction_bound(lengths: np.ndarray) -> float | None:
        """None: free shapes set no bound on the real-token fraction (see ``Planner``)."""
        return None

    @staticmethod
    def micro_batch_shapes(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                           settings: BatchingSettings) -> tuple[list[tuple[int, int]], list[str]]:
        """Each non-empty micro-batch's shape ``(1, its tokens padded)`` and its key ``"1xT cuB"`` (``B`` the
        entries of ``cu_seq_lens``: documents + 1)."""
        sizes = np.diff(offsets)
        filled = sizes > 0
        cum = np.concatenate([[0], np.cumsum(lengths[rows])])
        width = padded_lengths(cum[offsets[1:]][filled] - cum[offsets[:-1]][filled], settings.pad_to_multiple_of)
        bounds = sizes[filled] + 1
        return [(1, int(w)) for w in width], [f"1x{int(w)} cu{int(b)}" for w, b in zip(width, bounds)]
