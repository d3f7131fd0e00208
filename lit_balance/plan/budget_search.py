"""The search of the automatic token budget, pure: the memory model, and the next budget to try from what was measured.

The probe (:mod:`lit_balance.lightning.budget`) measures the peak memory of worst-case micro-batches
(:meth:`~lit_balance.plan.epoch.Planner.worst_case_batch`) at the budgets this module proposes; nothing here runs a
model, reads a device or communicates, so the search is tested alone on scripted memory curves.

The memory of a micro-batch is modelled as ``a + b * slots + c * squares`` (:class:`MemoryModel`: ``slots`` its padded
token slots, ``squares`` the sum of its squared row lengths, or, packed, document lengths), fitted by least squares with
``b, c >= 0``. Any micro-batch the planner may form within a budget ``B`` from rows of at most ``L`` tokens has at most
``B`` slots and ``B * L`` squares, so its memory is at most ``a + b * B + c * B * L`` (:meth:`MemoryModel.bound`).

:func:`next_budget` proposes: the smallest budget (one row of the longest documents), then a second fixed one, then
the largest budget whose bound the fit puts under the target (the first time aiming :data:`MARGIN` below it), never
above a budget that failed and, until one fails, at most :data:`GROWTH` times the largest that fitted; after a pass over the target, no further than the interpolation between the largest budget
that fitted and the smallest that did not (regula falsi, 10 % short); after an out-of-memory error, which measures no
peak, halfway between them (bisection; the geometric mean while they are more than 2x apart); where the fit sees no
room worth a pass, just above the largest budget that fitted. It stops once the smallest budget that failed is within
:data:`TOLERANCE` above the largest that fitted (the boundary is bracketed), at ``max_budget``, or after
:data:`MAX_ROUNDS` budgets. The result (:func:`chosen_budget`) is the largest budget every
pass of which measured under the target: a budget is never chosen from the fit alone.

After the search, :func:`settled_budget` checks the chosen budget against passes in a row (what the allocator keeps
from one micro-batch to the next): the excess of their peak over the fit's bound comes off the target, once.

The fit-then-verify search follows the secant/regula-falsi idea of fitting a model of a monotone function and testing
its root (Press et al., "Numerical Recipes", 3rd ed., 9.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from dataclasses import asdict, dataclass, fields

import numpy as np

from lit_balance._checks import check_bool, check_int
from lit_balance.errors import InputValueError
from lit_balance.plan.epoch import Planner, planner_for

if TYPE_CHECKING:
    from lit_balance.plan.settings import BatchingSettings

__all__ = ["DEVICE_CODES", "GROWTH", "MARGIN", "MAX_ROUNDS", "TOLERANCE", "BudgetSpace", "MemoryMeasurement",
           "MemoryModel", "ProbeLayout", "ProbeResult", "RankOutcome", "chosen_budget", "next_budget", "probe_shapes",
           "settled_budget", "shared_budgets"]

#: The search stops once the smallest budget that failed is within this factor of the largest that fitted.
TOLERANCE = 1.04
#: The first fitted candidate aims this share below the room the fit gives (target less its intercept), so that its one
#: verifying pass usually fits.
MARGIN = 0.05
#: Budgets tried at most (each one collective round of the probe).
MAX_ROUNDS = 12
#: Until a budget fails, the next one is at most this many times the largest that fitted (a pass far over the target
#: costs as much as several near it).
GROWTH = 4.0

OK, OVER, OUT_OF_MEMORY = "ok", "over", "out of memory"


@dataclass(frozen=True)
class ProbeLayout:
    """How micro-batches are laid out, all the probe needs of the batching settings (``max_tokens`` is what it
    measures): which planner forms them, and the rounding and row cap its worst-case micro-batches keep to
    (:meth:`~lit_balance.plan.epoch.Planner.worst_case_batch` reads these two).

    Attributes:
        packing: True: padding-free micro-batches (one packed row of whole documents each); False: padded rows.
        pad_to_multiple_of: rows (packed: the row) are padded to a multiple of this many tokens.
        max_batch_size: rows per micro-batch at most, or None.
        static_packing, padded_shapes: the static shapes of :class:`~lit_balance.BatchingSettings` (off: False, None).

    Raises:
        TypeError, ValueError: a value of the wrong type or out of range (naming it).

    Example:
        >>> ProbeLayout(packing=True, pad_to_multiple_of=8).planner.name
        'packed'
    """

    packing: bool = False
    pad_to_multiple_of: int = 1
    max_batch_size: int | None = None
    static_packing: bool = False
    padded_shapes: int | tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        check_int("pad_to_multiple_of", self.pad_to_multiple_of, 1, "use 1 for no rounding")
        check_bool("static_packing", self.static_packing)
        self._unshaped()  # the other fields are checked by the settings they are passed on to

    @classmethod
    def of(cls, settings: object) -> ProbeLayout:
        """The layout of a :class:`~lit_balance.BatchingSettings` (or any object with the same attributes): its
        fields of the same names, passed on as they are."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def static(self) -> bool:
        """True with static shapes (``static_packing`` or ``padded_shapes``): the probe measures those shapes."""
        return self.static_packing or self.padded_shapes is not None

    def settings(self, max_tokens: int) -> BatchingSettings:
        """The :class:`~lit_balance.BatchingSettings` of this layout at a budget of ``max_tokens`` padded token slots
        (per micro-batch, per rank)."""
        from lit_balance.plan.settings import BatchingSettings

        return BatchingSettings(max_tokens=int(max_tokens), **asdict(self))

    def _unshaped(self) -> BatchingSettings:
        """This layout's settings without static shapes, at a budget that holds any row (the planner does not read
        it)."""
        from lit_balance.plan.settings import BatchingSettings

        return BatchingSettings(max_tokens=int(self.pad_to_multiple_of) << 20,
                                **{**asdict(self), "static_packing": False, "padded_shapes": None})

    @property
    def planner(self) -> Planner:
        """The planner that forms the micro-batches, without static shapes (:func:`~lit_balance.plan.planner_for` of
        this layout; the probe asks :func:`~lit_balance.plan.shapes.probe_planner` for static shapes)."""
        return planner_for(self._unshaped())


@dataclass(frozen=True)
class MemoryMeasurement:
    """One measured pass: a worst-case micro-batch at a budget, and its peak memory.

    Attributes:
        budget: the budget tried (padded token slots per micro-batch, per rank).
        slots: padded token slots of the micro-batch measured (at most ``budget``).
        squares: sum of its squared row (packed: document) lengths, tokens**2.
        peak_bytes: its peak memory (bytes); 0 when it ran out of memory (no peak measured).
        status: ``"ok"`` (at most the target), ``"over"`` (above the target) or ``"out of memory"``.
        shape: which rows it held (the probe's ``"longest"`` or ``"typical"``), for logs.
        row_length: tokens per row (packed: per document) of that shape.
    """

    budget: int
    slots: int
    squares: int
    peak_bytes: int
    status: str
    shape: str = ""
    row_length: int = 0


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of a micro-batch: ``intercept + per_slot * slots + per_square * squares`` (bytes).

    Attributes:
        intercept: bytes independent of the micro-batch (the model, its gradients and optimizer state, the process).
        per_slot: bytes per padded token slot (>= 0).
        per_square: bytes per squared token of row length (>= 0; attention scores).
    """

    intercept: float
    per_slot: float
    per_square: float

    @classmethod
    def fit(cls, measurements: Sequence[MemoryMeasurement]) -> MemoryModel:
        """Least squares over the measurements with a peak, each weighted by its slots (the budget is decided near
        the largest passes, where the small passes' noise would otherwise pull the extrapolated slope); a coefficient
        that comes out negative is set to 0 and the rest refitted.

        Raises:
            ValueError: no measurement has a peak.

        Example:
            >>> m = [MemoryMeasurement(0, s, q, int(1000 + 2 * s + 0.01 * q), OK)
            ...      for s, q in [(100, 1e4), (200, 4e4), (300, 2e3)]]
            >>> model = MemoryModel.fit(m)
            >>> round(model.intercept), round(model.per_slot, 3), round(model.per_square, 3)
            (1000, 2.0, 0.01)
        """
        used = [m for m in measurements if m.peak_bytes > 0]
        if not used:
            raise InputValueError("the memory model needs at least one measured peak, got none (every pass ran out of "
                                  "memory)", parameter="measurements")
        x = np.array([[1.0, m.slots, m.squares] for m in used])
        y = np.array([float(m.peak_bytes) for m in used])
        root = np.sqrt(np.array([max(m.slots, 1) for m in used], dtype=float))
        x, y = x * root[:, None], y * root
        active = [0, 1, 2]
        while True:
            coef = np.zeros(3)
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
            negative = [i for i in active[1:] if coef[i] < 0]
            if not negative:
                return cls(*(float(c) for c in coef))
            active.remove(min(negative, key=lambda i: coef[i]))

    def predict(self, slots: float, squares: float) -> float:
        """Bytes of a micro-batch of ``slots`` padded token slots and ``squares`` squared tokens."""
        return self.intercept + self.per_slot * slots + self.per_square * squares

    def bound(self, budget: int, longest: int) -> float:
        """Bytes of the largest micro-batch any planner forms within ``budget`` from rows of at most ``longest``
        tokens: ``slots <= budget`` and ``squares <= budget * longest``."""
        return self.predict(budget, budget * longest)

    def largest_budget(self, target: float, low: int, high: int, multiple: int, longest: int) -> int | None:
        """The largest multiple of ``multiple`` in ``[low, high]`` whose :meth:`bound` is at most ``target`` bytes, or
        None when ``low`` is already over (``low`` and ``high`` are multiples of ``multiple``)."""
        lo, hi = low // multiple, high // multiple
        if lo > hi or self.bound(lo * multiple, longest) > target:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bound(mid * multiple, longest) <= target else (lo, mid - 1)
        return lo * multiple


@dataclass(frozen=True)
class BudgetSpace:
    """Where the search looks, and what it aims at.

    Attributes:
        min_budget: the smallest budget: one row of the longest rows, padded (token slots).
        max_budget: the largest budget worth trying (e.g. the training split's padded tokens per rank).
        multiple: budgets are multiples of this (``pad_to_multiple_of``).
        longest: tokens of the longest row (after truncation).
        target: bytes a micro-batch may use (``memory_fraction`` of the capacity).
    """

    min_budget: int
    max_budget: int
    multiple: int
    longest: int
    target: float

    @property
    def second_budget(self) -> int:
        """The second budget tried: twice the smallest, and at least 512 slots, within ``max_budget``."""
        m = self.multiple
        return min(self.max_budget, max(2 * self.min_budget, -(-512 // m) * m))


def _by_budget(measurements: Sequence[MemoryMeasurement]) -> dict[int, list[MemoryMeasurement]]:
    out: dict[int, list[MemoryMeasurement]] = {}
    for m in measurements:
        out.setdefault(m.budget, []).append(m)
    return out


def _fitted(passes: list[MemoryMeasurement]) -> bool:
    return all(m.status == OK for m in passes)


def chosen_budget(measurements: Sequence[MemoryMeasurement]) -> int:
    """The budget the measurements support: the largest whose every pass measured under the target; after an
    out-of-memory error anywhere (which measures no peak, so the fit cannot vouch for the budgets between), the slots of
    the largest micro-batch that ran at that budget. 0 when none fitted.

    Example:
        >>> chosen_budget([MemoryMeasurement(100, 100, 0, 10, OK), MemoryMeasurement(300, 280, 0, 30, OK),
        ...                MemoryMeasurement(500, 500, 0, 90, OVER)])
        300
    """
    groups = _by_budget(measurements)
    fitted = [b for b, passes in groups.items() if _fitted(passes)]
    if not fitted:
        return 0
    best = max(fitted)
    if any(m.status == OUT_OF_MEMORY for m in measurements):
        return max(m.slots for m in groups[best])
    return best


def _interpolated(groups: dict[int, list[MemoryMeasurement]], best_ok: int, fail_min: int, target: float,
                  multiple: int) -> int | None:
    """After a pass over the target at ``fail_min``: 90 % of the way to where the peaks measured at ``best_ok`` and
    ``fail_min`` interpolate to the target (regula falsi); None when the failure measured no peak."""
    if any(m.status == OUT_OF_MEMORY for m in groups[fail_min]):  # no peak: bisection, geometric while far apart
        middle = (best_ok * fail_min) ** 0.5 if fail_min > 2 * best_ok else (best_ok + fail_min) / 2
        return int(middle) // multiple * multiple
    ok_peak = max(m.peak_bytes for m in groups[best_ok])
    fail_peak = max(m.peak_bytes for m in groups[fail_min])
    if fail_peak <= ok_peak:
        return None
    share = min(1.0, max(0.0, (target - ok_peak) / (fail_peak - ok_peak)))
    return (best_ok + int(0.9 * share * (fail_min - best_ok))) // multiple * multiple


def next_budget(measurements: Sequence[MemoryMeasurement], space: BudgetSpace) -> int | None:
    """The next budget to measure, from every pass measured so far on this rank (``measurements``, any order), or None
    when the search is done: a multiple of ``space.multiple`` in ``[min_budget, max_budget]`` not measured yet.

    Example:
        >>> space = BudgetSpace(min_budget=100, max_budget=10_000, multiple=1, longest=100, target=11_000)
        >>> def curve(slots):  # 1000 bytes and 2 per slot: the optimum is 5000 slots
        ...     return MemoryMeasurement(slots, slots, 0, 1000 + 2 * slots, OK if slots <= 5000 else OVER)
        >>> tried = []
        >>> while (budget := next_budget(tried, space)) is not None:
        ...     tried.append(curve(budget))
        >>> 0.96 * 5000 <= chosen_budget(tried) <= 5000, len({m.budget for m in tried}) <= MAX_ROUNDS
        (True, True)
    """
    groups = _by_budget(measurements)
    if not groups:
        return space.min_budget
    if not _fitted(groups.get(space.min_budget, [])) or len(groups) >= MAX_ROUNDS:
        return None  # not even the smallest budget fits (or nothing was measured there): nothing more to try
    if len(groups) == 1:
        second = space.second_budget
        return second if second > space.min_budget else None
    m = space.multiple
    failed = [b for b, passes in groups.items() if not _fitted(passes)]
    best_ok, fail_min = max(b for b in groups if b not in failed), min(failed, default=space.max_budget + m)
    upper = min(space.max_budget, fail_min - m) // m * m
    if upper <= best_ok * TOLERANCE:
        return None  # bracketed: the boundary lies within TOLERANCE above the largest budget that fitted
    reach = upper if failed else min(upper, max(best_ok, int(best_ok * GROWTH) // m * m))  # no failure yet: GROWTH
    candidate = _fitted_candidate(measurements, space, reach, first=len(groups) == 2)
    if failed:
        step = _interpolated(groups, best_ok, fail_min, space.target, m)
        if candidate is None or (step is not None and any(p.status == OUT_OF_MEMORY for p in groups[fail_min])):
            candidate = step  # an out-of-memory error: bisect (the fit never saw that failure)
        elif step is not None:
            candidate = min(candidate, max(best_ok, step))
    if candidate is None or candidate <= best_ok * TOLERANCE:
        # the fit (or the interpolation) sees no room worth a pass: test just above, to bracket the boundary
        candidate = min(upper, int(best_ok * TOLERANCE) // m * m + m)
    return None if candidate in groups or candidate <= best_ok else candidate


def _fitted_candidate(measurements: Sequence[MemoryMeasurement], space: BudgetSpace, upper: int,
                      first: bool) -> int | None:
    """The largest budget up to ``upper`` whose bound the fit puts under the target (the first time :data:`MARGIN`
    below it); None when no peak was measured or not even the smallest budget fits."""
    if not any(p.peak_bytes > 0 for p in measurements):
        return None
    model = MemoryModel.fit(measurements)
    aim = model.intercept + (space.target - model.intercept) * (1.0 - (MARGIN if first else 0.0))
    return model.largest_budget(aim, space.min_budget, upper, space.multiple, space.longest)


def settled_budget(peak: float, budget: int, measurements: Sequence[MemoryMeasurement],
                   space: BudgetSpace) -> int | None:
    """After passes in a row at ``budget`` peaked at ``peak`` bytes: None when that is at most the target (or
    ``budget`` is already the smallest), else the budget to check instead: the largest the memory model fitted to
    ``measurements`` puts under the target less the excess of ``peak`` over the model's bound at ``budget`` (the
    smallest budget when none is).

    Example:
        >>> space = BudgetSpace(min_budget=100, max_budget=10_000, multiple=1, longest=100, target=11_000)
        >>> tried = [MemoryMeasurement(b, b, 0, 1000 + 2 * b, OK) for b in (100, 1000, 5000)]
        >>> settled_budget(10_900, 5000, tried, space), settled_budget(12_000, 5000, tried, space)
        (None, 4500)
    """
    if peak <= space.target or budget <= space.min_budget:
        return None
    model = MemoryModel.fit(measurements)
    excess = max(0.0, peak - model.bound(budget, space.longest))
    smaller = model.largest_budget(space.target - excess, space.min_budget, budget - space.multiple, space.multiple,
                                   space.longest)
    return space.min_budget if smaller is None else smaller


@dataclass(frozen=True)
class RankOutcome:
    """What one rank found, gathered from every rank at the end of the probe.

    Attributes:
        budget: the budget it measured (padded token slots; 0: not one row of the longest documents fits).
        capacity_bytes: its capacity (device memory or ``memory_limit``).
        seconds: its probe's wall time.
        device_kind: its meter's device kind as a number (:data:`DEVICE_CODES`; another kind: their number).
        intercept, per_slot, per_square: its memory model (:class:`~lit_balance.plan.budget_search.MemoryModel`).
    """

    budget: int
    capacity_bytes: int
    seconds: float
    device_kind: int
    intercept: float
    per_slot: float
    per_square: float

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """Its memory model's ``(intercept, per_slot, per_square)``."""
        return (self.intercept, self.per_slot, self.per_square)

    def to_row(self) -> list[float]:
        """The outcome as numbers, in field order (what the ranks gather)."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankOutcome:
        """The outcome of :meth:`to_row`'s numbers."""
        values = dict(zip([f.name for f in fields(cls)], row))
        return cls(**{k: int(v) if k in ("budget", "capacity_bytes", "device_kind") else float(v)
                      for k, v in values.items()})


#: :attr:`RankOutcome.device_kind` of the meters' device kinds.
DEVICE_CODES = {"cpu": 0, "cuda": 1}


@dataclass(frozen=True)
class ProbeResult:
    """What :meth:`lit_balance.lightning.probe.TokenBudgetProbe.run` returns: every rank's :class:`RankOutcome` (the
    same on every rank) and this rank's passes.

    Attributes:
        outcomes: by rank.
        rounds: collective rounds (budgets tried, the warm-up and the settling included).
        measurements: this rank's measured passes.
        slots_run: padded token slots of every pass this rank ran (filler passes included).
        passes_run: passes this rank ran (the same on every rank).
    """

    outcomes: tuple[RankOutcome, ...]
    rounds: int
    measurements: tuple[MemoryMeasurement, ...]
    slots_run: int
    passes_run: int


def probe_shapes(lengths: np.ndarray) -> dict[str, int]:
    """``{"longest": L, "typical": median}`` row lengths (tokens) of the training split (after truncation)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise InputValueError("the probe needs the training split's document lengths; it has no documents",
                              parameter="lengths")
    longest, typical = int(lengths.max()), max(1, int(np.median(lengths)))
    return {"longest": longest} if typical == longest else {"longest": longest, "typical": typical}


def shared_budgets(measured: Sequence[int], devices: Sequence[tuple]) -> tuple[int, ...]:
    """The budget each rank plans with: the smallest measured among the ranks of the same device (the same type and
    capacity), so that measurement noise between equal devices never gives them different budgets; ranks of different
    devices keep their own.

    Args:
        measured: each rank's measured budget (padded token slots), by rank.
        devices: each rank's device, e.g. ``(device type, capacity in bytes)``, by rank.

    Returns:
        One budget per rank.

    Example:
        >>> shared_budgets([2526, 2348, 5100], [("cpu", 2**30), ("cpu", 2**30), ("cpu", 2**31)])
        (2348, 2348, 5100)
    """
    if len(measured) != len(devices):
        raise InputValueError(f"one device per rank: got {len(measured)} budgets and {len(devices)} devices",
                              parameter="devices")
    smallest: dict[tuple, int] = {}
    for budget, device in zip(measured, devices):
        smallest[tuple(device)] = min(int(budget), smallest.get(tuple(device), int(budget)))
    return tuple(smallest[tuple(d)] for d in devices)
