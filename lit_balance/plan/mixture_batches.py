"""Micro-batches of many mixture steps at once: the steps' documents to micro-batches, vectorised over the steps.

A mixture epoch (:mod:`lit_balance.plan.mixture`) is a sequence of optimizer steps whose documents are fixed first.
Calling a planner once per step costs about 2 ms a step (thousands of steps an epoch); these functions place the
documents of all steps together, with NumPy operations over the steps, where the settings allow it (one budget for
every rank, equal rank speeds, and a planner whose :meth:`~lit_balance.plan.epoch.Planner.steps_together` holds):
each step gets exactly ``num_micro = num_replicas * accumulate_grad_batches`` micro-batches within the budget.

* **Padded.** A step's documents sorted by padded length, longest first, are cut into ``num_micro`` contiguous
  micro-batches within the budget in three ways, and the one that holds the ranks least is kept (as the padded
  planner keeps the better of its cuts): greedily under the least cost cap (found by bisection) that needs at most
  ``num_micro`` micro-batches (fairseq's ``batch_by_size`` cuts a sorted order greedily under the budget; the cap
  evens the costs), a cut into fewer completed by halving its micro-batches of most rows; each micro-batch the rows
  nearest an equal share of the cost still to place; and each rank a contiguous run of ``accumulate_grad_batches``
  micro-batches under the least rank cost that fits (even at the grain of one row). A step fits iff the greedy cut
  under the budget alone needs at most ``num_micro`` (:func:`padded_fits`, exact).
* **Packed.** A step's documents, longest first, go each to the packed row of least cost that still holds it (the
  Longest Processing Time rule; Graham, SIAM J. Appl. Math. 17, 1969). :func:`packed_fits` is a sufficient test: the
  rule can only fail at a document of ``l`` tokens when every row holds more than ``capacity - l``, so the documents
  before it hold more than ``num_micro * (capacity - l)``; a step where that never happens fits.

Each step's micro-batches then go to the ranks, ``accumulate_grad_batches`` each, largest first to the least loaded
rank (LPT with a cardinality limit, in rounds of ``num_replicas``), except the rank-by-rank padded cut, whose runs are
the ranks'.
"""

from __future__ import annotations

import numpy as np

from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import padded_lengths

__all__ = ["batch_packed_steps", "batch_padded_steps", "packed_fits", "padded_fits"]

_BISECTIONS = 12  # the cost caps to 2.4e-4 of their first range


def padded_fits(padded_desc: np.ndarray, num_micro: int, max_tokens: int, row_cap: int) -> bool:
    """Whether padded lengths sorted longest first fit ``num_micro`` contiguous micro-batches of ``max_tokens``
    slots and at most ``row_cap`` rows (the greedy cut is the fewest)."""
    n = padded_desc.shape[0]
    if n <= num_micro or min(max_tokens // int(padded_desc[0]), row_cap) * num_micro >= n:
        return True
    jump = (np.arange(n) + np.maximum(np.minimum(max_tokens // padded_desc, row_cap), 1)).tolist()
    pos = 0
    for _ in range(num_micro):
        pos = jump[pos]
        if pos >= n:
            return True
    return False


def packed_fits(lengths: np.ndarray, num_micro: int, capacity: int) -> bool:
    """Whether the LPT packing of documents (any order) into ``num_micro`` rows of ``capacity`` tokens surely
    succeeds: sufficient, the tokens before each document longest first, but the ``num_micro`` longest, at most
    ``num_micro * (capacity - length)``. Only documents longer than ``capacity - total / num_micro`` can break it,
    and the documents before them are longer still, so only those are sorted."""
    large = lengths[lengths > capacity - int(lengths.sum()) / num_micro]
    if large.shape[0] <= num_micro:
        return True
    large = np.sort(large)[::-1]
    before = (np.cumsum(large) - large)[num_micro:]
    return bool(np.all(before <= num_micro * (capacity - large[num_micro:])))


def batch_padded_steps(members: np.ndarray, bounds: np.ndarray, lengths: np.ndarray, settings: BatchingSettings, *,
                       num_replicas: int, cost_model: CostModelProtocol,
                       budgets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded micro-batches and ranks of many steps at once (the padded planner's
    :meth:`~lit_balance.plan.padded.PaddedPlanner.batch_steps`).

    Args:
        members: int64 ``[n]``: sample indices of all steps, step after step, each step's longest first by padded
            length.
        bounds: int64 ``[num_steps + 1]``: step ``s`` holds ``members[bounds[s]:bounds[s + 1]]``; every step has at
            least ``num_replicas * accumulate_grad_batches`` samples and fits (:func:`padded_fits`).
        lengths: int64 ``[num_samples]``: tokens per sample.
        settings: the batching settings (one budget for every rank, no static shapes).
        num_replicas: ranks.
        cost_model: the cost of a micro-batch.
        budgets: int64 ``[num_steps]``: padded token slots each micro-batch of each step is cut under (at most
            ``max_tokens``; the step fits them), or None: ``max_tokens`` for every step.

    Returns:
        ``(rows, batch_sizes, assignment)``: int64 ``[n]`` the samples grouped by micro-batch, step after step;
        int64 ``[num_steps, num_micro]`` rows of each micro-batch of each step (in ``rows`` order); int64
        ``[num_steps, accumulate_grad_batches, num_replicas]`` the micro-batch (0 to ``num_micro - 1`` within its
        step) each rank runs at each micro-step.

    Raises:
        RuntimeError: a step that does not fit after all (a bug: the fit test is exact).
    """
    acc = settings.accumulate_grad_batches
    key = padded_lengths(lengths[members], settings.pad_to_multiple_of)
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
    num_steps = bounds.shape[0] - 1
    budgets = np.full(num_steps, settings.max_tokens, dtype=np.int64) if budgets is None else np.asarray(budgets,
                                                                                                      np.int64)
    sizes, assignment = _cut(key, bounds, num_replicas, acc, budgets, row_cap, cost_model)
    return members, sizes, assignment


def batch_packed_steps(members: np.ndarray, bounds: np.ndarray, lengths: np.ndarray, settings: BatchingSettings, *,
                       num_replicas: int, cost_model: CostModelProtocol,
                       budgets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed micro-batches and ranks of many steps at once (the packed planner's
    :meth:`~lit_balance.plan.packed.PackedPlanner.batch_steps`): as :func:`batch_padded_steps`, each step's members
    longest first by length, every step fitting by :func:`packed_fits`, and no ``max_batch_size``; every row holds
    up to the budget (``budgets`` is not read: a packed row fills with any document).

    Raises:
        RuntimeError: a step that does not fit after all (a bug: the fit test is sufficient).
    """
    acc = settings.accumulate_grad_batches
    num_micro = num_replicas * acc
    rows, sizes, costs = _pack(members, lengths[members], bounds, num_micro, settings.truncate_to, cost_model)
    return rows, sizes, _ranks(costs, num_replicas, acc)


def _greedy(key: np.ndarray, rc: np.ndarray, bounds: np.ndarray, cap: np.ndarray, num_micro: int, max_tokens: int,
            row_cap: int, per_batch: float, record: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Greedy cuts of every step under its cost cap: ``(fits, sizes [num_steps, num_micro] or None)``."""
    pos, end = bounds[:-1].copy(), bounds[1:]
    n = key.shape[0]
    sizes = np.zeros((pos.shape[0], num_micro), dtype=np.int64) if record else None
    room = np.maximum(cap - per_batch, 0.0)
    for j in range(num_micro):
        first = np.minimum(pos, n - 1)
        length, cost = key[first], rc[first]
        by_cost = np.where(cost > 0, np.floor(room / np.where(cost > 0, cost, 1.0)), np.inf)
        take = np.minimum(np.minimum(by_cost, max_tokens // length), row_cap)
        take = np.minimum(np.maximum(take, 1), end - pos).astype(np.int64)
        if record:
            sizes[:, j] = take
        pos = pos + take
    return pos >= end, sizes


def _greedy_ranks(key: np.ndarray, rc: np.ndarray, bounds: np.ndarray, cap: np.ndarray, num_replicas: int, acc: int,
                  max_tokens: int, row_cap: int, per_batch: float) -> tuple[np.ndarray, np.ndarray]:
    """Greedy cuts of every step into ranks of ``acc`` micro-batches, each rank's cost under the step's cap:
    ``(fits, sizes [num_steps, num_replicas * acc], rank r's micro-batches at r * acc ...)``; a rank's first
    micro-batch takes at least one row."""
    pos, end = bounds[:-1].copy(), bounds[1:]
    n = key.shape[0]
    sizes = np.zeros((pos.shape[0], num_replicas * acc), dtype=np.int64)
    for r in range(num_replicas):
        load = np.zeros(pos.shape[0])
        for j in range(acc):
            first = np.minimum(pos, n - 1)
            length, cost = key[first], rc[first]
            room = np.maximum(cap - load - per_batch, 0.0)
            by_cost = np.where(cost > 0, np.floor(room / np.where(cost > 0, cost, 1.0)), np.inf)
            take = np.minimum(np.minimum(by_cost, max_tokens // length), row_cap)
            if j == 0:
                take = np.maximum(take, 1)
            take = np.minimum(take, end - pos).astype(np.int64)
            sizes[:, r * acc + j] = take
            load += np.where(take > 0, per_batch + take * cost, 0.0)
            pos = pos + take
    return pos >= end, sizes


def _even(key: np.ndarray, rc: np.ndarray, bounds: np.ndarray, num_micro: int, max_tokens: int, row_cap: int,
          per_batch: float) -> tuple[np.ndarray, np.ndarray]:
    """Each micro-batch the rows nearest an equal share of the row cost still to place (padding counted as it
    comes): ``(within the budget, sizes [num_steps, num_micro])``."""
    pos, end = bounds[:-1].copy(), bounds[1:]
    n = key.shape[0]
    cum = np.concatenate([[0.0], np.cumsum(rc)])
    sizes = np.zeros((pos.shape[0], num_micro), dtype=np.int64)
    ok = np.ones(pos.shape[0], dtype=bool)
    for j in range(num_micro):
        first = np.minimum(pos, n - 1)
        length, cost = key[first], rc[first]
        left = num_micro - j
        if left == 1:
            take = end - pos
            ok &= (take * length <= max_tokens) & (take <= row_cap) & (take >= 1)
        else:
            share = (cum[end] - cum[pos]) / left
            take = np.rint(share / np.where(cost > 0, cost, 1.0))
            take = np.minimum(np.minimum(take, max_tokens // length), row_cap)
            take = np.clip(take, 1, np.maximum(end - pos - (left - 1), 1)).astype(np.int64)
        sizes[:, j] = take
        pos = pos + take
    return ok & (pos == end), sizes


def _fill_empty(sizes: np.ndarray, groups: int) -> np.ndarray:
    """Fill empty micro-batches (in place) by halving the one of most rows in the same group of ``sizes.shape[1] //
    groups`` consecutive micro-batches (each half stays within the budget); bool ``[num_steps]``: False where a
    group has fewer rows than micro-batches."""
    width = sizes.shape[1] // groups
    done = np.ones(sizes.shape[0], dtype=bool)
    for s in np.flatnonzero((sizes == 0).any(axis=1)):
        for g in range(groups):
            part = sizes[s, g * width:(g + 1) * width].tolist()
            if sum(part) < width:
                done[s] = False
                break
            while 0 in part:
                del part[part.index(0)]
                j = max(range(len(part)), key=part.__getitem__)
                half = part[j] // 2
                part[j] -= half
                part.insert(j + 1, half)
            sizes[s, g * width:(g + 1) * width] = part
    return done


def _cut(key: np.ndarray, bounds: np.ndarray, num_replicas: int, acc: int, max_tokens: np.ndarray, row_cap: int,
         cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
    """Padded: each step's sorted rows cut into ``num_micro`` micro-batches of at most ``max_tokens[step]`` slots
    (the module's three cuts, the one that holds the ranks least kept): ``(sizes [num_steps, num_micro],
    assignment [num_steps, acc, num_replicas])``."""
    num_micro = num_replicas * acc
    rc = np.asarray(cost_model.row_cost(key), dtype=np.float64).reshape(-1)
    per_batch = float(cost_model.per_batch)
    num_steps = bounds.shape[0] - 1
    fits, _ = _greedy(key, rc, bounds, np.full(num_steps, np.inf), num_micro, max_tokens, row_cap, per_batch, False)
    if not fits.all():
        raise RuntimeError(f"steps {np.flatnonzero(~fits)[:5].tolist()} of a mixture epoch do not fit their "
                           f"{num_micro} micro-batches; please report this with the lengths")
    # the cap: from the costliest single row (too small, unless each row is a micro-batch) to the costliest full
    # micro-batch under the budget alone (fits)
    step_of = np.repeat(np.arange(num_steps), np.diff(bounds))
    lo = np.zeros(num_steps)
    np.maximum.at(lo, step_of, rc + per_batch)
    rows_max = np.minimum(np.minimum(max_tokens[step_of] // key, row_cap), 1 << 40)
    hi = np.zeros(num_steps)
    np.maximum.at(hi, step_of, rows_max * rc + per_batch)
    full, single = hi.copy(), lo.copy()
    ok, _ = _greedy(key, rc, bounds, lo, num_micro, max_tokens, row_cap, per_batch, False)
    hi = np.where(ok, lo, hi)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        ok, _ = _greedy(key, rc, bounds, mid, num_micro, max_tokens, row_cap, per_batch, False)
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    _, sizes = _greedy(key, rc, bounds, hi, num_micro, max_tokens, row_cap, per_batch, True)
    _fill_empty(sizes, 1)  # fewer micro-batches than num_micro: every step has num_micro rows or more
    costs = _padded_costs(sizes, bounds, rc, per_batch)
    assignment = _ranks(costs, num_replicas, acc)
    hold = _hold(costs, num_replicas)
    ok, even = _even(key, rc, bounds, num_micro, max_tokens, row_cap, per_batch)
    even_costs = _padded_costs(even, bounds, rc, per_batch)
    even_hold = _hold(even_costs, num_replicas)
    better = ok & (even_hold < hold)
    sizes = np.where(better[:, None], even, sizes)
    assignment = np.where(better[:, None, None], _ranks(even_costs, num_replicas, acc), assignment)
    hold = np.where(better, even_hold, hold)
    # each rank a contiguous run of acc micro-batches under the least rank cost that fits: even at the row's grain;
    # from the rows' cost over the ranks (too small) to acc costliest full micro-batches (the budget alone decides)
    lo = np.maximum(single, np.bincount(step_of, weights=rc, minlength=num_steps) / num_replicas)
    hi = np.maximum(acc * full, lo)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        ok, _ = _greedy_ranks(key, rc, bounds, mid, num_replicas, acc, max_tokens, row_cap, per_batch)
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    ok, by_rank = _greedy_ranks(key, rc, bounds, hi, num_replicas, acc, max_tokens, row_cap, per_batch)
    ok &= _fill_empty(by_rank, num_replicas)
    rank_costs = _padded_costs(by_rank, bounds, rc, per_batch)
    better = ok & (rank_costs.reshape(num_steps, num_replicas, acc).sum(axis=2).max(axis=1) < hold)
    sizes = np.where(better[:, None], by_rank, sizes)
    contiguous = np.arange(num_micro).reshape(num_replicas, acc).T  # [acc, num_replicas]: rank r runs r * acc + j
    assignment = np.where(better[:, None, None], contiguous[None], assignment)
    return sizes, assignment


def _padded_costs(sizes: np.ndarray, bounds: np.ndarray, rc: np.ndarray, per_batch: float) -> np.ndarray:
    """Cost of each padded micro-batch: ``per_batch`` plus its rows times its first (longest) row's cost."""
    first = bounds[:-1, None] + np.concatenate([np.zeros((sizes.shape[0], 1), dtype=np.int64),
                                                np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    return per_batch + sizes * rc[np.minimum(first, rc.shape[0] - 1)]


def _pack(rows: np.ndarray, length: np.ndarray, bounds: np.ndarray, num_micro: int, capacity: int,
          cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed: each step's documents, longest first, to the row of least cost that holds them."""
    num_steps = bounds.shape[0] - 1
    counts = np.diff(bounds)
    width = int(counts.max())
    steps = np.arange(num_steps)
    rc = np.asarray(cost_model.row_cost(length), dtype=np.float64).reshape(-1)
    # [width, num_steps]: position i of every step in one contiguous row (a round); past a step's end: length 0
    index = bounds[:-1][None, :] + np.arange(width)[:, None]
    valid = index < bounds[1:][None, :]
    index = np.where(valid, index, 0)
    doc_len = np.where(valid, length[index], 0)
    tokens = np.zeros((num_steps, num_micro), dtype=np.int32 if capacity < 2**30 else np.int64)
    tokens += doc_len[:num_micro].T.astype(tokens.dtype)  # the num_micro longest: one row each
    bin_of = np.empty((width, num_steps), dtype=np.uint8 if num_micro < 255 else np.int64)
    bin_of[:num_micro] = np.arange(num_micro)[:, None]
    flat, base = tokens.reshape(-1), steps * num_micro
    ratio = rc / np.maximum(length, 1)
    if rc.size and ratio.max() - ratio.min() <= 1e-12 * ratio.max():
        # cost in proportion to tokens: the row of least cost is the row of fewest tokens, which holds the document
        # whenever the fit test passed
        for i in range(num_micro, width):
            b = np.argmin(tokens, axis=1)
            bin_of[i] = b
            flat[base + b] += doc_len[i]
    else:
        doc_cost = np.where(valid, rc[index], 0.0)
        cost = np.zeros((num_steps, num_micro))
        cost += doc_cost[:num_micro].T
        cost_flat = cost.reshape(-1)
        for i in range(num_micro, width):
            b = np.argmin(np.where(tokens + doc_len[i][:, None] <= capacity, cost, np.inf), axis=1)
            bin_of[i] = b
            flat[base + b] += doc_len[i]
            cost_flat[base + b] += doc_cost[i]
    if (tokens > capacity).any():
        raise RuntimeError("a mixture step's documents do not fit its packed rows; please report this with the "
                           "lengths")
    # rows grouped by row within each step, longest first within a row (a stable sort of small keys per step)
    key = np.where(valid, bin_of, num_micro).T  # [num_steps, width]; padding last
    key = key.astype(np.uint8 if num_micro < 255 else np.int64)
    order = np.argsort(key, axis=1, kind="stable")
    grouped = np.take_along_axis(index.T, order, axis=1)[np.arange(width)[None, :] < counts[:, None]]
    flat_bin = np.repeat(steps, counts) * num_micro + np.take_along_axis(key, order, axis=1)[
        np.arange(width)[None, :] < counts[:, None]]
    sizes = np.bincount(flat_bin, minlength=num_steps * num_micro).reshape(num_steps, num_micro)
    cost = np.bincount(flat_bin, weights=rc[grouped], minlength=num_steps * num_micro).reshape(num_steps, num_micro)
    return rows[grouped], sizes.astype(np.int64), cost + float(cost_model.per_batch)


def _hold(costs: np.ndarray, num_replicas: int) -> np.ndarray:
    """float64 ``[num_steps]``: the most loaded rank's cost in each step once :func:`_ranks` places the steps."""
    num_steps, num_micro = costs.shape
    acc = num_micro // num_replicas
    out = _ranks(costs, num_replicas, acc)
    load = costs[np.arange(num_steps)[:, None, None], out].sum(axis=1)
    return load.max(axis=1)


def _ranks(costs: np.ndarray, num_replicas: int, acc: int) -> np.ndarray:
    """``[num_steps, acc, num_replicas]``: each step's micro-batches, costliest first, ``num_replicas`` at a time to
    the ranks of least load so far."""
    num_steps = costs.shape[0]
    by_cost = np.argsort(-costs, axis=1, kind="stable")
    out = np.empty((num_steps, acc, num_replicas), dtype=np.int64)
    load = np.zeros((num_steps, num_replicas))
    steps = np.arange(num_steps)[:, None]
    for r in range(acc):
        batches = by_cost[:, r * num_replicas:(r + 1) * num_replicas]
        ranks = np.argsort(load, axis=1, kind="stable")  # least loaded first gets the costliest
        out[steps, r, ranks] = batches
        load[steps, ranks] += costs[steps, batches]
    return out
