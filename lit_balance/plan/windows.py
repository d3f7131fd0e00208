"""Plans in windows: an epoch of a very large corpus planned window by window, each with every guarantee.

A corpus of more than ``settings.plan_window`` samples is split into ``ceil(num_samples / plan_window)``
windows of about equal size by a seeded pseudo-random permutation of the sample indices (a Feistel network
with cycle-walking, as in Black and Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002; no index
array is stored, so a window's members cost memory proportional to the window). The windows are fixed by
``settings.seed`` alone; every epoch runs them in a new order (with ``shuffle``) and plans each one with
:func:`~lit_balance.plan_epoch`, which varies its batch composition and order by epoch. Each window's
plan has every guarantee of a whole-epoch plan (budget, equal counts on every rank, coverage, determinism), and
its number of micro-steps depends only on the window's lengths and the settings, so the epoch's length
(their sum) is known without planning any window and is the same every epoch (with equal rank speeds). Windows are
counted when first needed, in the epoch's order: the first micro-batch counts and plans the first window, and the
epoch's length counts the rest when it is first asked (:class:`WindowedPlan`).

Worked example (``plan_window=4``, 10 samples, so 3 windows of 3, 3 and 4 samples)::

    positions 0..9 of the seeded permutation -> window 0: positions 0-2, window 1: 3-5, window 2: 6-9
    members(0) = perm([0, 1, 2]), ...; epoch e runs the windows in a seeded order, e.g. [2, 0, 1]: the
    micro-steps of window 2's plan, then window 0's, then window 1's

The trade-off of fixing the membership by seed: batch-mates are drawn from the same window every epoch (a
million samples at the default), and the within-window order, composition and the order of windows change by
epoch. A membership that changed every epoch would change each window's micro-batch count, and with it the
epoch's length, which Lightning reads before it calls ``set_epoch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.epoch import plan_epoch, planner_for
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, empty_plan

__all__ = ["PlanWindows", "WindowedPlan"]

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


_CHUNK = 1 << 16  # samples per step of the permutation: its temporaries stay in the processor's cache
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray, scratch: np.ndarray | None = None, *, folded: bool = False) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea and Flood, OOPSLA 2014) on uint64, wrapping, in place on ``x``.

    ``scratch``: a uint64 array of ``x``'s shape to use as temporary storage (None: one is made). ``folded``: ``x``
    already holds ``x ^ (x >> 30)``, the first step.
    """
    t = np.empty_like(x) if scratch is None else scratch
    for shift, multiplier in ((_S30, _M1), (_S27, _M2)):
        if not folded or shift != _S30:
            np.right_shift(x, shift, out=t)
            np.bitwise_xor(x, t, out=x)
        np.multiply(x, multiplier, out=x)
    np.right_shift(x, _S31, out=t)
    np.bitwise_xor(x, t, out=x)
    return x


class PlanWindows:
    """The windows of a corpus: a seeded permutation of ``[0, num_samples)`` cut into equal runs of positions.

    Args:
        num_samples: samples in the corpus (``len(lengths)``).
        plan_window: most samples per window; ``ceil(num_samples / plan_window)`` windows of
            ``num_samples // num_windows`` or one more samples each.
        seed: the permutation's seed (the sampler's ``seed``).

    Example:
        >>> w = PlanWindows(10, 4, seed=0)
        >>> w.num_windows, [w.members(j).size for j in range(3)]
        (3, [3, 3, 4])
        >>> sorted(np.concatenate([w.members(j) for j in range(3)]).tolist()) == list(range(10))
        True
    """

    def __init__(self, num_samples: int, plan_window: int, seed: int) -> None:
        self.num_samples = int(num_samples)
        self.num_windows = max(1, -(-self.num_samples // int(plan_window)))
        self.bounds = (np.arange(self.num_windows + 1, dtype=np.int64) * self.num_samples) // self.num_windows
        self._half = max(1, math.ceil(max(1, (self.num_samples - 1).bit_length()) / 2))
        self._keys = np.random.SeedSequence([int(seed), 0x77696E646F77]).generate_state(_ROUNDS, np.uint64)

    def _feistel(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        """The Feistel network (or its inverse) on uint64 ``x``, ``_CHUNK`` values at a time; a new array."""
        out = np.empty_like(x)
        for start in range(0, x.shape[0], _CHUNK):
            out[start:start + _CHUNK] = self._feistel_block(x[start:start + _CHUNK], inverse)
        return out

    def _feistel_block(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        h, mask = np.uint64(self._half), np.uint64((1 << self._half) - 1)
        left, right = x >> h, x & mask
        work, scratch = np.empty_like(x), np.empty_like(x)
        keys = self._keys[::-1] if inverse else self._keys
        # halves below 2**30: (half ^ key) >> 30 == key >> 30, so mix's first step folds into the key
        folded = self._half <= 30
        for key in keys:  # forward: (left, right) <- (right, left ^ F(right)); inverse: the other way round
            source, target = (left, right) if inverse else (right, left)
            np.bitwise_xor(source, key ^ (key >> _S30) if folded else key, out=work)
            _mix(work, scratch, folded=folded)
            np.bitwise_and(work, mask, out=work)
            np.bitwise_xor(target, work, out=target)
            left, right = right, left
        np.left_shift(left, h, out=left)
        return np.bitwise_or(left, right, out=left)

    def _walk(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        """The permutation (or its inverse) on ``[0, num_samples)`` by cycle-walking the Feistel network."""
        y = self._feistel(x.astype(np.uint64), inverse)
        outside = np.flatnonzero(y >= np.uint64(self.num_samples))
        while outside.size:
            y[outside] = self._feistel(y[outside], inverse)
            outside = outside[y[outside] >= np.uint64(self.num_samples)]
        return y.astype(np.int64)

    def members(self, window: int) -> np.ndarray:
        """int64 ``[window size]``: the sample indices of ``window``, in permutation order."""
        lo, hi = int(self.bounds[window]), int(self.bounds[window + 1])
        return self._walk(np.arange(lo, hi, dtype=np.uint64), inverse=False)

    def window_of(self, index: int) -> int:
        """The window that holds sample ``index``."""
        position = int(self._walk(np.array([index], dtype=np.uint64), inverse=True)[0])
        return int(np.searchsorted(self.bounds, position, side="right") - 1)

    def order(self, epoch: int, settings: BatchingSettings, first: int | None = None) -> np.ndarray:
        """int64 ``[num_windows]``: the windows in the order epoch ``epoch`` runs them.

        With ``shuffle``, a permutation seeded by ``(seed, epoch)``; else ascending. ``first`` (the window
        holding the longest sample, with ``largest_first``) moves to the front.
        """
        order = np.arange(self.num_windows, dtype=np.int64)
        if settings.shuffle:
            order = np.random.default_rng(np.random.SeedSequence([settings.seed, int(epoch), 0x6F72])).permutation(
                self.num_windows)
        if first is not None:
            order = np.concatenate([[first], order[order != first]])
        return order

    def window_seed(self, seed: int, window: int) -> int:
        """The seed that window ``window``'s plans draw their randomness from (epoch-independent, >= 0)."""
        return int(np.random.SeedSequence([int(seed), 0x77, int(window)]).generate_state(1)[0])


@dataclass
class _Window:
    """One planned window: its plan in corpus indices and the real tokens / rows / next-token targets of each of its
    micro-steps."""

    plan: EpochPlan
    step_tokens: np.ndarray
    step_rows: np.ndarray
    step_supervised: np.ndarray


class WindowedPlan:
    """An epoch's plan made window by window, when it is reached; the same global plan on every rank.

    Micro-step ``s`` of the epoch belongs to the window ``order[j]`` with ``start(j) <= s < start(j + 1)``.
    Only the windows being read are held in memory (with those an optimizer step straddles).

    A window's micro-step count depends only on its samples and the settings, so with equal rank speeds windows are
    counted when they are first needed, in the epoch's order: the first micro-batch needs the first window only
    (its members drawn, counted and planned), and :attr:`num_micro_steps` (the sampler's ``len()``) counts the rest.
    Counts are kept in ``count_cache`` for every later epoch. A resumed epoch re-planned over new ranks
    (``min_steps``) and unequal rank speeds count every window when the plan is built, as those counts depend on each
    other (the rest of a resumed epoch) or are learnt by planning.

    Args:
        lengths: int ``[num_samples]`` tokens per sample (any integer dtype; a memory map is read window by window).
        settings: the batching settings (``plan_window`` below the number of samples).
        windows: the corpus's :class:`PlanWindows`.
        num_replicas, epoch, cost_model, rank_speeds: as for :func:`~lit_balance.plan_epoch`.
        eligible: bool ``[num_samples]`` of samples still to plan (a resumed epoch), or None for ``base_eligible``.
        base_eligible: bool ``[num_samples]`` of the samples every epoch plans (``too_long="skip"``), or None.
        min_steps: plan at least this many micro-steps in all, where the samples allow (windows with samples
            grow, in the epoch's order, until there are enough).
        count_cache: ``{(num_replicas, window): (steps, min_steps)}`` of whole windows, shared across epochs.
        supervised_lengths: int64 ``[num_samples]`` next-token targets per sample (masked labels), or None
            (``lengths - 1``): what :meth:`step_sums` counts as each micro-step's targets. Does not change the plan.
    """

    def __init__(self, lengths: np.ndarray, settings: BatchingSettings, windows: PlanWindows, *, num_replicas: int,
                 epoch: int, eligible: np.ndarray | None, base_eligible: np.ndarray | None,
                 cost_model: CostModelProtocol, rank_speeds: np.ndarray | None, min_steps: int = 0,
                 count_cache: dict | None = None, supervised_lengths: np.ndarray | None = None) -> None:
        self.lengths, self.settings, self.windows = lengths, settings, windows
        self.supervised_lengths = supervised_lengths
        self.num_replicas, self.epoch = int(num_replicas), int(epoch)
        self.cost_model, self.rank_speeds = cost_model, rank_speeds
        self.accumulate_grad_batches = settings.accumulate_grad_batches
        self._eligible, self._base_eligible = eligible, base_eligible
        self._cache = count_cache if count_cache is not None else {}
        self._masks: dict[int, np.ndarray | None] = {}
        self._plan_args: dict[int, tuple[int, int | None]] = {}  # (min_steps, num_batches) to plan with
        self._counts = np.full(windows.num_windows, -1, dtype=np.int64)  # by window id; -1: not counted yet
        self._drawn: tuple[int, np.ndarray] | None = None  # the members drawn last (a window counted, then planned)
        first = None
        if settings.largest_first:
            longest = _longest(lengths, eligible if eligible is not None else base_eligible)
            first = None if longest is None else windows.window_of(longest)
        self.order = windows.order(epoch, settings, first)
        self._starts = [0]  # micro-step at which each position of the order starts, for the positions counted
        uniform = rank_speeds is None or bool(np.all(rank_speeds == rank_speeds[0]))
        if min_steps > 0 or not uniform:
            self._count_all(int(min_steps), uniform)
        self._planned: dict[int, _Window] = {}

    def _count_all(self, min_steps: int, uniform: bool) -> None:
        """Count every window now: the rest of a resumed epoch grows windows until it has ``min_steps``; unequal
        speeds count each window by planning it."""
        counts = self._counts
        for j in range(self.windows.num_windows):
            self._count_window(j)
        nonempty = [int(j) for j in self.order if self._has_samples(int(j))]
        for j in nonempty:  # the rest of a resumed epoch: windows grow, first to last, until it is long enough
            deficit = min_steps - int(counts.sum())
            if deficit <= 0:
                break
            counts[j], self._plan_args[j] = self._count(j, self._members(j), int(counts[j]) + deficit)
        if not uniform:  # unequal speeds can lengthen a window's plan: count by planning each one
            for j in range(self.windows.num_windows):
                counts[j] = self._plan_local(j)[0].num_micro_steps if self._has_samples(j) else 0
        self._starts = [0, *np.cumsum(counts[self.order]).tolist()]

    def _members(self, j: int) -> np.ndarray:
        """int64: window ``j``'s members (the last window's drawn are kept: counting it comes right before planning
        it)."""
        if self._drawn is None or self._drawn[0] != j:
            self._drawn = None  # the window held before is let go first: one window's members in memory
            self._drawn = (j, self.windows.members(j))
        return self._drawn[1]

    def _count_window(self, j: int) -> int:
        """Micro-steps of window ``j`` (counted now unless known), its mask of samples to plan set."""
        if self._counts[j] >= 0:
            return int(self._counts[j])
        key = (self.num_replicas, j)
        eligible, base_eligible, cache = self._eligible, self._base_eligible, self._cache
        if eligible is None and base_eligible is None and key in cache:  # every sample, counted before
            self._masks[j] = None
            self._counts[j], self._plan_args[j] = cache[key]
            return int(self._counts[j])
        members = self._members(j)
        base = None if base_eligible is None else base_eligible[members]
        mask = base if eligible is None else eligible[members]
        whole = eligible is None or np.array_equal(mask, base if base is not None else np.ones_like(mask))
        self._masks[j] = None if mask is None or bool(mask.all()) else mask
        if whole and key in cache:
            self._counts[j], self._plan_args[j] = cache[key]
            return int(self._counts[j])
        self._counts[j], self._plan_args[j] = self._count(j, members, 0)
        if whole:
            cache[key] = (int(self._counts[j]), self._plan_args[j])
        return int(self._counts[j])

    def _count_through(self, position: int) -> None:
        """Count the windows of the order up to ``position`` (inclusive; clipped to the last)."""
        last = min(int(position), self.order.shape[0] - 1)
        while len(self._starts) <= last + 1:
            self._starts.append(self._starts[-1] + self._count_window(int(self.order[len(self._starts) - 1])))

    def _count_until(self, step: int) -> None:
        """Count windows of the order until those counted hold micro-step ``step`` (or every window is counted)."""
        while self._starts[-1] <= step and len(self._starts) <= self.order.shape[0]:
            self._count_through(len(self._starts) - 1)

    def start(self, position: int) -> int:
        """Micro-step of the epoch at which the ``position``-th window of the order starts (``position`` may be the
        number of windows: the epoch's end); counts the windows before it that are not counted yet."""
        self._count_through(int(position) - 1)
        return int(self._starts[position])

    @property
    def starts(self) -> np.ndarray:
        """int64 ``[num_windows + 1]``: :meth:`start` of every position of the order (counts every window)."""
        self._count_through(self.order.shape[0] - 1)
        return np.asarray(self._starts, dtype=np.int64)

    @property
    def counts(self) -> np.ndarray:
        """int64 ``[num_windows]``: micro-steps of each window, by window id (counts every window)."""
        self._count_through(self.order.shape[0] - 1)
        return self._counts

    def has_micro_steps(self) -> bool:
        """Whether the epoch has a micro-step: windows are counted, in order, until one has."""
        self._count_until(0)
        return self._starts[-1] > 0

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps of the epoch: micro-batches per rank (the same on every rank). Counts every window."""
        return self.start(self.order.shape[0])

    def _count(self, j: int, members: np.ndarray, min_steps: int) -> tuple[int, tuple[int, int | None]]:
        """``(micro-steps, (min_steps, num_batches) to plan with)`` of window ``j``, equal rank speeds, any epoch."""
        steps, plan_min, count = planner_for(self.settings).count_steps(
            self.lengths[members], self._masks[j], self.settings, self.num_replicas, min_steps, self.cost_model)
        return steps, (plan_min, count)

    def _has_samples(self, j: int) -> bool:
        mask = self._masks[j]
        return mask is None or bool(mask.any())

    def _plan_local(self, j: int) -> tuple[EpochPlan, np.ndarray, np.ndarray]:
        members = self._members(j)
        local = np.asarray(self.lengths[members], dtype=np.int64)
        settings = self.settings.replace(seed=self.windows.window_seed(self.settings.seed, j))
        plan = plan_epoch(local, settings, num_replicas=self.num_replicas, epoch=self.epoch, eligible=self._masks[j],
                          cost_model=self.cost_model, rank_speeds=self.rank_speeds, min_steps=self._plan_args[j][0],
                          num_batches=self._plan_args[j][1])
        return plan, members, local

    def window(self, position: int) -> _Window:
        """The plan of the ``position``-th window of the epoch's order (planned now unless held)."""
        j = int(self.order[position])
        held = self._planned.get(position)
        if held is not None:
            return held
        self._count_through(position)
        if not self._has_samples(j):
            plan = empty_plan(self.num_replicas, self.accumulate_grad_batches)
            held = _Window(plan, np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
        else:
            local_plan, members, local = self._plan_local(j)
            self._drawn = None  # planned: its members are held in the plan now
            if local_plan.num_micro_steps != self._counts[j]:
                raise RuntimeError(f"window {j} of epoch {self.epoch} planned {local_plan.num_micro_steps} "
                                   f"micro-steps, but its count was {int(self._counts[j])}: the windowed plan is "
                                   "inconsistent")
            a = local_plan.assignment
            step_tokens = local_plan.real_tokens_per_batch(local)[a].sum(axis=1).astype(np.int64)
            step_rows = local_plan.real_rows_per_batch()[a].sum(axis=1).astype(np.int64)
            if self.supervised_lengths is None:  # every token but a row's first is a target
                step_supervised = step_tokens - step_rows
            else:
                supervised = np.asarray(self.supervised_lengths[members], dtype=np.int64)
                step_supervised = local_plan.real_tokens_per_batch(supervised)[a].sum(axis=1).astype(np.int64)
            held = _Window(
                plan=EpochPlan(rows=members[local_plan.rows], is_fill=local_plan.is_fill,
                               batch_offsets=local_plan.batch_offsets, assignment=a,
                               dropped=np.sort(members[local_plan.dropped]),
                               accumulate_grad_batches=local_plan.accumulate_grad_batches),
                step_tokens=step_tokens, step_rows=step_rows, step_supervised=step_supervised,
            )
        self._planned[position] = held
        return held

    def _positions(self, lo: int, hi: int) -> range:
        """Positions in the epoch's order of the windows that hold micro-steps ``[lo, hi)`` (counting windows until
        those counted reach ``hi``)."""
        self._count_until(max(hi, lo + 1) - 1)
        starts = np.asarray(self._starts, dtype=np.int64)
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, max(hi, lo + 1) - 1, side="right")) - 1
        return range(max(first, 0), min(last, self.order.shape[0] - 1) + 1)

    def release_before(self, step: int) -> None:
        """Forget the plans of windows that end at or before micro-step ``step`` (memory)."""
        for position in [p for p in self._planned if self._starts[p + 1] <= step]:
            del self._planned[position]

    def step_sums(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``[min(hi, num_micro_steps) - lo]`` each: real tokens, rows and next-token targets
        (``supervised_lengths``), summed over the ranks, of micro-steps ``[lo, hi)`` (those before the epoch's end)."""
        parts: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] for _ in range(3)]
        if hi > lo:
            for position in self._positions(lo, hi):
                held, start = self.window(position), self.start(position)
                a, b = max(lo, start) - start, min(hi, self.start(position + 1)) - start
                for part, sums in zip(parts, (held.step_tokens, held.step_rows, held.step_supervised)):
                    part.append(sums[a:b])
        tokens, rows, supervised = (np.concatenate(part) for part in parts)
        return tokens, rows, supervised

    def consume(self, consumed: int, seen: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mark in ``seen`` the real rows of micro-steps ``[0, consumed)`` (all ranks); return their step sums
        (tokens, rows, next-token targets, as :meth:`step_sums`).

        Windows are planned one at a time and released, so memory stays that of one window.
        """
        parts: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] for _ in range(3)]
        for position in self._positions(0, consumed) if consumed else ():
            held, start = self.window(position), self.start(position)
            upto = min(consumed, self.start(position + 1)) - start
            held.plan.mark_rows(upto, seen)
            for part, sums in zip(parts, (held.step_tokens, held.step_rows, held.step_supervised)):
                part.append(sums[:upto])
            self._planned.pop(position, None)
        tokens, rows, supervised = (np.concatenate(part) for part in parts)
        return tokens, rows, supervised

    def materialise(self) -> EpochPlan:
        """The whole epoch as one :class:`~lit_balance.EpochPlan` (plans every window; memory of the epoch)."""
        rows, fills, offsets, assignments, dropped = [], [], [np.zeros(1, np.int64)], [], []
        num_rows = num_batches = 0
        for position in range(self.order.shape[0]):
            held = self.window(position).plan
            rows.append(held.rows)
            fills.append(held.is_fill)
            offsets.append(held.batch_offsets[1:] + num_rows)
            assignments.append(held.assignment + num_batches)
            dropped.append(held.dropped)
            num_rows += held.rows.shape[0]
            num_batches += held.num_batches
            self._planned.pop(position, None)
        return EpochPlan(rows=np.concatenate(rows) if rows else np.empty(0, np.int64),
                         is_fill=np.concatenate(fills) if fills else np.empty(0, bool),
                         batch_offsets=np.concatenate(offsets),
                         assignment=np.concatenate(assignments, axis=0) if assignments else
                         np.empty((0, self.num_replicas), np.int64),
                         dropped=np.sort(np.concatenate(dropped)) if dropped else np.empty(0, np.int64),
                         accumulate_grad_batches=self.accumulate_grad_batches)


def _longest(lengths: np.ndarray, mask: np.ndarray | None, chunk: int = 1 << 20) -> int | None:
    """Index of the first longest sample where ``mask`` holds (None: every sample), read ``chunk`` at a time."""
    best, at = -1, None
    for start in range(0, lengths.shape[0], chunk):
        part = np.asarray(lengths[start:start + chunk])
        if mask is not None:
            part = np.where(mask[start:start + chunk], part, -1)
        i = int(np.argmax(part)) if part.size else 0
        if part.size and int(part[i]) > best:
            best, at = int(part[i]), start + i
    return at
