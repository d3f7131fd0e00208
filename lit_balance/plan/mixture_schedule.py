"""Mixture weights that change during a run: each optimizer step planned with the shares its schedule gives.

A weight schedule (:class:`~lit_balance.schedule.Schedule` whose values name every component) gives each optimizer
step ``g`` of the run weights ``w(g)``; the step's shares are ``s(g) = w(g) / sum(w(g))``. An epoch is planned as a
fixed mixture is (:mod:`lit_balance.plan.mixture`), with three changes:

1. **Selection** takes, of each component, what the schedule asks of it over the epoch: the epoch's shares are the
   schedule's mean over the steps the epoch is expected to have (the epoch's length estimated from the capacity of a
   step, twice refined), the limiting component is read whole (``max_repetition`` times), and every other component
   is given its expected units plus a margin (:data:`MARGIN` of them and its longest document), so that the epoch
   ends when the limiting component is read. What a component's selection holds beyond what its steps took goes back
   to the pool: :attr:`MixturePlan.chosen` holds the samples the epoch planned, each once.
2. **Steps.** The walk merges the streams by each document's midpoint tag against the *current* shares, starting from
   each component's **carried deficit** ``D_c`` (the units its schedule has asked of it so far, minus those it got):
   a document's tag is ``(U_c(j) + u_j / 2 - D_c) / s_c``. Where the shares change (a point of the schedule, every
   step of a linear ramp), the rest of the streams is merged again from the step's start with the new shares and the
   deficits at that point, so every step keeps ``|u_c - s_c(g) * U| <= B`` with the step's own shares (transition
   steps included) and the deficits stay within a document. A tiny weight (1e-6) thus accumulates its deficit until
   its next document's midpoint is due, and is never rounded to zero: over the run a component's units stay within
   one document of ``sum_g s_c(g) * U_g``. The deficits at the epoch's end are carried into the next epoch.
3. **The epoch's end.** The epoch ends where a component of positive share that has run out of selected documents
   would fall more than its longest document behind its schedule: before a step in which it would (a whole step of
   its share), and no later than the walk position where it does. The rest of an epoch resumed on other ranks (a
   given set of samples that must all be planned) instead continues without the components that ran out (their
   shares spread over the others), so nothing consumed is repeated and nothing selected is lost.

Steps keep their order (``shuffle`` shuffles the streams, not the steps: the schedule is per step), and a position
in tokens is the real tokens of every rank trained before the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.schedule import Schedule

__all__ = ["MARGIN", "StepShares", "check_weights_schedule"]

#: the share of its expected units a non-limiting component's selection holds beyond them (plus its longest document)
MARGIN = 0.05


def check_weights_schedule(schedule: Any, names: Sequence[str], *, name: str = "weights_schedule") -> Schedule:
    """A weight schedule for the components ``names``, checked: every point names exactly these components and has a
    positive sum.

    Args:
        schedule: a :class:`~lit_balance.schedule.Schedule` or what :meth:`Schedule.of` takes (a list of
            ``[step, {name: weight}]`` points, or a mapping with ``points``, ``unit``, ``interpolation``).
        names: the mixture's component names.
        name: the setting's name (in every error).

    Returns:
        The schedule (named ``name``).

    Raises:
        TypeError: values that are numbers, not ``{component: weight}``.
        ValueError: a point naming an unknown component or leaving one out (naming both lists); weights that sum to 0
            at a point; as :class:`~lit_balance.schedule.Schedule` (order, negative or NaN weights).
    """
    schedule = Schedule.of(schedule, name=name)
    if schedule.keys is None:
        raise InputTypeError(f"{name}: each point's value must be the weights of the components {list(names)} as "
                             f"{{name: weight}}, got a number ({schedule.values[0]!r})", parameter=name)
    unknown = [k for k in schedule.keys if k not in names]
    missing = [n for n in names if n not in schedule.keys]
    if unknown:
        raise InputValueError(f"{name}: names the component(s) {unknown}, which the mixture does not have; its "
                              f"components are {list(names)}", parameter=name)
    if missing:
        raise InputValueError(f"{name}: every point must give a weight to each of the mixture's components "
                              f"{list(names)}; it gives none to {missing} (a weight of 0 leaves one out)",
                              parameter=name)
    for at, value in schedule.points_as_given():
        if sum(value.values()) <= 0:
            raise InputValueError(f"{name}: the weights at {at} {schedule.unit} sum to 0 ({value}); at least one "
                                  "component needs a positive weight at every point", parameter=name)
    return schedule


@dataclass(frozen=True)
class StepShares:
    """A mixture's shares per optimizer step of one epoch, from a weight schedule and where the epoch starts.

    Args:
        schedule: the weight schedule (:func:`check_weights_schedule`).
        names: the components, in the mixture's order.
        first_step: the run's optimizer step of the epoch's first step (0-based).
        tokens_before: real tokens (all ranks) trained before the epoch (positions of a schedule in tokens).
        carry: each component's deficit carried into the epoch, in the mixture's unit: what the schedule asked of it
            before the epoch minus what it got (None: zeros).

    Example:
        >>> s = StepShares(Schedule([(0, {"a": 3, "b": 1}), (10, {"a": 1, "b": 1})]), ("a", "b"), first_step=8)
        >>> s.shares(1, 0).tolist(), s.shares(2, 0).tolist()
        ([0.75, 0.25], [0.5, 0.5])
    """

    schedule: Schedule
    names: tuple[str, ...]
    first_step: int = 0
    tokens_before: int = 0
    carry: tuple[float, ...] | None = None

    def shares(self, step: int, tokens: int) -> np.ndarray:
        """float64 ``[num_components]``: the normalised weights of the epoch's ``step`` (0-based), which starts after
        ``tokens`` real tokens of the epoch."""
        at = self.first_step + step if self.schedule.unit == "steps" else self.tokens_before + tokens
        w = np.asarray(self.schedule.vector_at(at, self.names), dtype=np.float64)
        return w / w.sum()

    def mean_shares(self, steps: float, tokens_per_step: float) -> np.ndarray:
        """float64 ``[num_components]``: the shares averaged over the epoch's first ``steps`` steps of
        ``tokens_per_step`` tokens each (an estimate; at most 4096 evaluations)."""
        count = max(int(math.ceil(steps)), 1)
        stride = max(count // 4096, 1)
        picks = np.arange(0, count, stride)
        rows = np.stack([self.shares(int(g), int(g * tokens_per_step)) for g in picks])
        return rows.mean(axis=0)

    @property
    def initial_carry(self) -> np.ndarray:
        """float64 ``[num_components]``: the deficits carried into the epoch."""
        return np.zeros(len(self.names)) if self.carry is None else np.asarray(self.carry, dtype=np.float64)


def select_scheduled(units: np.ndarray, layout: Any, mixture: Any, step_shares: StepShares, *, seed: int, epoch: int,
                     eligible: np.ndarray | None, tokens_per_step: float, tokens_per_unit: float) -> np.ndarray:
    """The samples an epoch of a weight schedule may read (stage 1 of the module docstring): bool ``[num_samples]``.

    Raises:
        ValueError: a component with a positive weight somewhere in the epoch but nothing to read.
    """
    n = layout.num_documents
    offsets = layout.offsets
    first = np.asarray(units[:n], dtype=np.int64)
    ok = np.ones(n, dtype=bool) if eligible is None else np.asarray(eligible[:n], dtype=bool)
    k = len(mixture.names)
    totals = np.array([int(first[offsets[c]:offsets[c + 1]][ok[offsets[c]:offsets[c + 1]]].sum()) for c in range(k)],
                      dtype=np.float64)
    longest = np.array([int(first[offsets[c]:offsets[c + 1]][ok[offsets[c]:offsets[c + 1]]].max(initial=0))
                        for c in range(k)], dtype=np.float64)
    reps = mixture.max_repetition
    carry = step_shares.initial_carry
    shares = step_shares.shares(0, 0)
    length = 0.0
    for _ in range(3):  # the epoch's length and its mean shares, refined
        live = shares > 0
        for c in np.flatnonzero(live & (totals <= 0)):
            raise InputValueError(f"component {mixture.names[c]!r} has weight {shares[c]:.3g} in the schedule but "
                                  f"no {mixture.unit} to read ({int(layout.sizes[c])} documents); give it documents "
                                  "or a weight of 0", parameter="weights_schedule")
        length = float(np.min(np.maximum(reps * totals[live] - carry[live], 0.0) / shares[live]))
        steps = length * tokens_per_unit / max(tokens_per_step, 1.0)
        shares = step_shares.mean_shares(steps, tokens_per_step)
    target = np.minimum(reps * totals, np.maximum(shares * length * (1 + MARGIN) + carry + longest, 0.0))
    chosen = np.zeros(layout.num_samples, dtype=bool)
    for c in range(k):
        if target[c] <= 0:
            continue
        docs = np.flatnonzero(ok[offsets[c]:offsets[c + 1]]) + offsets[c]
        full = min(int(math.floor(target[c] / totals[c] + 1e-9)), reps) if totals[c] > 0 else 0
        for copy in range(full):
            chosen[copy * n + docs] = True
        rest = target[c] - full * totals[c]
        if full < reps and rest > 0 and docs.size:
            rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), c, 0x6D6978]))
            order = docs[rng.permutation(docs.size)]
            cum = np.cumsum(first[order])
            j = min(int(np.searchsorted(cum, rest)) + 1, order.size)  # the fewest reaching rest
            chosen[full * n + order[:j]] = True
    return chosen


class ScheduledWalk:
    """The walk of :mod:`lit_balance.plan.mixture` under per-step shares: merged again from a step's start where the
    shares change, cut where the epoch ends. Positions are global (over the epoch's successive walks); a walk is
    merged again only forward, so a step's positions always lie in the current walk.

    Args:
        make_walk: ``(streams, shares, carry) -> walk`` (the planner's walk class).
        streams: each component's chosen samples in stream order.
        step_shares: the shares per step.
        units: int ``[num_samples]``: each sample's units.
        lengths: int ``[num_samples]``: each sample's tokens.
        exact: True when every sample of ``streams`` must be planned (the rest of a resumed epoch): no cut; a
            component that ran out leaves the shares.
        longest: float64 ``[num_components]``: each component's longest document, in units.
    """

    def __init__(self, make_walk: Any, streams: Sequence[np.ndarray], step_shares: StepShares, units: np.ndarray,
                 lengths: np.ndarray, *, exact: bool, longest: np.ndarray) -> None:
        self._make = make_walk
        self._step_shares = step_shares
        self._units, self._lengths = units, lengths
        self._exact, self._longest = exact, np.asarray(longest, dtype=np.float64)
        self._rest = [np.asarray(s, dtype=np.int64) for s in streams]  # each stream's documents not yet walked
        self._done: list[np.ndarray] = []  # positions before `base`, in walk order
        self.base, self.tokens_before = 0, 0
        self.carry = step_shares.initial_carry.copy()
        self.target = np.zeros(len(streams))
        self.inner = None
        self._rewalk(0, self._shares(step_shares.shares(0, 0)))
        self.targets: list[np.ndarray] = []  # each step's scheduled shares

    # -- the planner's walk interface, in global positions ---------------------------------------------------------

    @property
    def size(self) -> int:
        return self.base + self.inner.size

    @property
    def merged(self) -> _Merged:
        return _Merged(self)

    def end(self, a: int, last: int) -> int:
        return self.base + self.inner.end(a - self.base, last - self.base)

    def within(self, a: int, tokens: float) -> int:
        return self.base + self.inner.within(a - self.base, tokens)

    def defer(self, a: int, b: int, tokens: float) -> int:
        return self.base + self.inner.defer(a - self.base, b - self.base, tokens)

    def tokens(self, a: int, b: int) -> int:
        return self.inner.tokens(a - self.base, b - self.base)

    def units(self, a: int, b: int) -> np.ndarray:
        return self.inner.units(a - self.base, b - self.base)

    # -- the schedule ----------------------------------------------------------------------------------------------

    def _shares(self, shares: np.ndarray) -> np.ndarray:
        """The shares without the components that ran out (exact mode), renormalised."""
        if not self._exact:
            return shares
        out = np.where([r.size > 0 for r in self._rest], shares, 0.0)
        if out.sum() <= 0:  # only components of weight 0 are left: their own units share the steps
            left = np.array([float(self._units[r].sum()) for r in self._rest])
            return left / max(left.sum(), 1.0)
        return out / out.sum()

    def _rewalk(self, a: int, shares: np.ndarray) -> None:
        """Merge the streams' remaining documents again from global position ``a`` with ``shares``."""
        if self.inner is not None:
            local = a - self.base
            taken = self.inner.count[local]
            self.carry = self.inner.deficits(local)
            self._done.append(self.inner.merged[:local].copy())
            self.tokens_before += self.inner.tokens(0, local)
            for c, s in enumerate(self._rest):
                self._rest[c] = s[int(taken[c]):] if self.inner.walked[c] else s
        self.base = a
        self.target = shares
        walked = shares > 0
        streams = [s if walked[c] else s[:0] for c, s in enumerate(self._rest)]
        self.inner = self._make(streams, self._units, self._lengths, shares, self.carry)
        self.inner.walked = walked
        if not self._exact:
            self.inner.cut(self._limit(self.inner, shares))

    def _limit(self, inner: Any, shares: np.ndarray) -> int:
        """The last prefix of ``inner`` at which no component of positive share that ran out of documents is more
        than its longest document behind its schedule (the epoch ends there at the latest)."""
        limit = inner.size
        for c in np.flatnonzero(shares > 0):
            size = inner.stream_sizes[c]
            # no document of another component past the time at which c, read whole, falls that far behind
            total = float(inner.cum[inner.starts[c] + size])
            due = (self._longest[c] + total - float(self.carry[c])) / shares[c]
            limit = min(limit, int(np.searchsorted(inner.tags, due * (1 + 1e-12) + 1e-9, side="right")))
            q = int(np.searchsorted(inner.count[:, c], size, side="left")) if size else 0  # c runs out here
            if q > inner.size:
                continue
            behind = float(inner.deficits(q)[c])
            room = (self._longest[c] - behind) / shares[c]  # units the walk may go on after q
            if room < 0:
                limit = min(limit, q)
                continue
            last = int(np.searchsorted(inner.x, inner.x[q] + room * (1 + 1e-12) + 1e-9, side="right")) - 1
            limit = min(limit, max(last, q))
        return limit

    def begin_step(self, a: int, step: int, room_tokens: float) -> int:
        """Before step ``step`` starts at ``a``: merge again if its shares differ from the walk's; the walk's size,
        ``a`` when the epoch ends here (what is left goes back to the pool)."""
        shares = self._step_shares.shares(step, self.tokens_before + self.tokens(self.base, a))
        self.targets.append(shares)
        live = self._shares(shares)
        if not np.array_equal(live, self.target):
            self._rewalk(a, live)
        if not self._exact and a < self.size:  # a component that ran out and a whole step would put too far behind
            local = a - self.base
            out = np.array([self.inner.count[local, c] >= self.inner.stream_sizes[c] for c in range(len(live))])
            if (out & (live > 0)).any():
                per_unit = float(self.inner.x[-1]) / max(float(self.inner.t[-1]), 1.0)
                behind = self.inner.deficits(local) + live * room_tokens * per_unit
                if np.any(out & (live > 0) & (behind > self._longest)):
                    self.inner.cut(local)
        if a >= self.size:
            self.targets.pop()
        return self.size

    def finish(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The walk's order of the planned positions ``0 .. end`` and each component's deficit at ``end``."""
        local = end - self.base
        order = np.concatenate([*self._done, self.inner.merged[:local]]).astype(np.int64)
        return order, self.inner.deficits(local)


class _Merged:
    """``walk.merged[a:b]`` of a :class:`ScheduledWalk` in global positions."""

    def __init__(self, walk: ScheduledWalk) -> None:
        self._walk = walk

    def __getitem__(self, item: slice) -> np.ndarray:
        w = self._walk
        start = 0 if item.start is None else item.start
        if start >= w.base:
            stop = None if item.stop is None else item.stop - w.base
            return w.inner.merged[start - w.base:stop]
        whole = np.concatenate([*w._done, w.inner.merged])
        return whole[item]
