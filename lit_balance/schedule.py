"""Schedule: a value that changes during a run, given as points in optimizer steps or in tokens.

A schedule is a list of points ``(at, value)``: ``at`` an optimizer step (``unit="steps"``: the step's index from
the run's start, 0-based) or the tokens trained before a step (``unit="tokens"``: real tokens of every rank), and
``value`` a number or a mapping of names to numbers (a mixture's weights). Between two points the value is
piecewise constant (``interpolation="constant"``: the value of the last point at or before ``at``) or linear
(``"linear"``); before the first point it is the first point's value, after the last the last's. The same points
give the same values on every rank: a schedule is a pure function of its position.

This is the one schedule class of the package: the mixture's weights, the tokens per optimizer step and the longest
document length are each one :class:`Schedule` (docs/schedules.md). It follows the step schedules of Megatron-LM
(``--step-batch-size-schedule``) and levanter's stages, with positions in optimizer steps or tokens rather than
samples.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from lit_balance._fingerprint import sha256_of
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["SCHEDULE_INTERPOLATIONS", "SCHEDULE_UNITS", "Schedule"]

#: Accepted values of :attr:`Schedule.unit`.
SCHEDULE_UNITS = ("steps", "tokens")
#: Accepted values of :attr:`Schedule.interpolation`.
SCHEDULE_INTERPOLATIONS = ("constant", "linear")
_VERSION = 1

Value = Union[float, dict[str, float]]


def _position(at: Any, name: str, i: int) -> int:
    """A point's position: an int >= 0 (an integral float such as ``1e6`` is accepted)."""
    if isinstance(at, bool) or not isinstance(at, numbers.Real):
        raise InputTypeError(f"{name}: point {i} must be at an int >= 0 (an optimizer step or tokens), got {at!r} of "
                             f"type {type(at).__name__}", parameter=name)
    if not math.isfinite(float(at)) or float(at) < 0 or float(at) != math.floor(float(at)):
        raise InputValueError(f"{name}: point {i} must be at an int >= 0 (an optimizer step or tokens), got {at!r}",
                              parameter=name)
    return int(at)


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name}: the value {where} must be a number, got {value!r} of type "
                             f"{type(value).__name__}", parameter=name)
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise InputValueError(f"{name}: the value {where} must be finite and >= 0, got {value!r}", parameter=name)
    return value


@dataclass(frozen=True)
class Schedule:
    """A value over a run: points in optimizer steps or tokens, piecewise constant or linear between them.

    Args:
        points: the points, ``[(at, value), ...]`` or ``{at: value, ...}``, with ``at`` strictly increasing ints
            >= 0 (optimizer steps, or tokens trained before a step: global, all ranks) and each value a finite
            number >= 0 or a mapping ``{name: number}`` with the same names at every point. At least one point.
        unit: ``"steps"`` (default) or ``"tokens"``: what ``at`` counts.
        interpolation: ``"constant"`` (default: the last point's value holds until the next point) or ``"linear"``.
        name: the setting this schedule gives (named in every error, e.g. ``"weights_schedule"``).

    Raises:
        TypeError: points that are not a sequence of pairs or a mapping; a position or value of the wrong type.
        ValueError: no point; positions negative, not integral or not strictly increasing (points out of order or
            twice at one position, naming both); a negative, NaN or infinite value; mapping values whose names differ
            between points; an unknown ``unit`` or ``interpolation``.

    Example:
        >>> s = Schedule([(0, 256), (100, 4096)], interpolation="linear", name="max_length")
        >>> s.value_at(0), s.value_at(50), s.value_at(1000)
        (256.0, 2176.0, 4096.0)
        >>> w = Schedule({0: {"web": 0.6, "code": 0.4}, 900: {"web": 0.3, "code": 0.7}})
        >>> w.value_at(899), w.value_at(900)
        ({'web': 0.6, 'code': 0.4}, {'web': 0.3, 'code': 0.7})
    """

    points: tuple
    unit: str = "steps"
    interpolation: str = "constant"
    name: str = "schedule"

    def __post_init__(self) -> None:
        name = self.name if isinstance(self.name, str) and self.name else "schedule"
        object.__setattr__(self, "name", name)
        if self.unit not in SCHEDULE_UNITS:
            raise InputValueError(f"{name}: unit must be one of {list(SCHEDULE_UNITS)}, got {self.unit!r}",
                                  parameter=name)
        if self.interpolation not in SCHEDULE_INTERPOLATIONS:
            raise InputValueError(f"{name}: interpolation must be one of {list(SCHEDULE_INTERPOLATIONS)}, got "
                                  f"{self.interpolation!r}", parameter=name)
        raw = self.points
        if isinstance(raw, Mapping):
            raw = list(raw.items())
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise InputTypeError(f"{name}: points must be a list of (at, value) pairs or a mapping {{at: value}}, got "
                                 f"{type(raw).__name__}", parameter=name)
        if not raw:
            raise InputValueError(f"{name}: a schedule needs at least one point, got none", parameter=name)
        keys: tuple[str, ...] | None = None
        checked = []
        previous = None
        for i, point in enumerate(raw):
            if isinstance(point, (str, bytes)) or not isinstance(point, Sequence) or len(point) != 2:
                raise InputTypeError(f"{name}: point {i} must be a pair (at, value), got {point!r}", parameter=name)
            at = _position(point[0], name, i)
            if previous is not None and at <= previous:
                raise InputValueError(f"{name}: points must be in strictly increasing order of position; point {i} "
                                      f"is at {at} {self.unit}, not after point {i - 1} at {previous} {self.unit}",
                                      parameter=name)
            previous = at
            value = point[1]
            if isinstance(value, Mapping):
                these = tuple(value)
                for key in these:
                    if not isinstance(key, str):
                        raise InputTypeError(f"{name}: point {i}'s names must be strings, got {key!r}", parameter=name)
                if keys is None:
                    keys = these
                if set(these) != set(keys):
                    raise InputValueError(f"{name}: every point must name the same components; point 0 names "
                                          f"{sorted(keys)}, point {i} (at {at}) names {sorted(these)}", parameter=name)
                if i == 0 and not keys:
                    raise InputValueError(f"{name}: point 0 names no component", parameter=name)
                value = tuple(_number(value[k], name, f"of {k!r} at point {i} ({at} {self.unit})") for k in keys)
            else:
                if keys is not None:
                    raise InputTypeError(f"{name}: point {i} (at {at}) is a number but point 0 is a mapping; give "
                                         f"every point as {{name: value}}", parameter=name)
                value = _number(value, name, f"at point {i} ({at} {self.unit})")
            checked.append((at, value))
        if keys is not None and not isinstance(checked[0][1], tuple):
            raise InputTypeError(f"{name}: point 0 is a number but a later point is a mapping; give every point as "
                                 "{name: value}", parameter=name)
        object.__setattr__(self, "points", tuple(checked))
        object.__setattr__(self, "_keys", keys)

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def constant(cls, value: Any, *, unit: str = "steps", name: str = "schedule") -> Schedule:
        """A schedule of one point: ``value`` from step 0 on."""
        return cls(((0, value),), unit=unit, name=name)

    @classmethod
    def of(cls, value: Any, *, name: str = "schedule") -> Schedule:
        """A :class:`Schedule` from what a config gives: a schedule (returned as it is, renamed), a number or a
        mapping of names to numbers (constant), a list of ``[at, value]`` pairs, or a mapping with ``points`` and
        optionally ``unit`` and ``interpolation`` (Hydra, LightningCLI).

        Raises:
            TypeError, ValueError: as :class:`Schedule`; a mapping with other keys than those above.
        """
        if isinstance(value, Schedule):
            return value if value.name == name else cls(value.points_as_given(), value.unit, value.interpolation,
                                                        name)
        if isinstance(value, Mapping) and "points" in value:
            extra = set(value) - {"points", "unit", "interpolation", "version", "name"}
            if extra:
                raise InputValueError(f"{name}: a schedule mapping takes 'points', 'unit' and 'interpolation', got "
                                      f"also {sorted(extra)}", parameter=name)
            return cls(_points_from_config(value["points"]), value.get("unit", "steps"),
                       value.get("interpolation", "constant"), name)
        if isinstance(value, (numbers.Real, Mapping)) and not isinstance(value, bool):
            return cls.constant(value, name=name)
        return cls(_points_from_config(value), name=name)

    # --- values -------------------------------------------------------------------------------------------------

    @property
    def keys(self) -> tuple[str, ...] | None:
        """The names of mapping values (in point 0's order), or None for numbers."""
        return self._keys  # type: ignore[attr-defined]

    @property
    def positions(self) -> tuple[int, ...]:
        """The points' positions, increasing (in :attr:`unit`)."""
        return tuple(at for at, _ in self.points)

    @property
    def values(self) -> tuple[Value, ...]:
        """The points' values, as given (numbers as floats)."""
        return tuple(self._out(v) for _, v in self.points)

    @property
    def is_constant(self) -> bool:
        """True when every point has the same value (the schedule never changes)."""
        return all(v == self.points[0][1] for _, v in self.points)

    def points_as_given(self) -> list[tuple[int, Value]]:
        """``[(at, value), ...]`` with mapping values as dicts (what the constructor takes)."""
        return [(at, self._out(v)) for at, v in self.points]

    def _out(self, raw: Any) -> Value:
        return dict(zip(self.keys, raw)) if self.keys is not None else raw

    def _raw_at(self, at: float) -> Any:
        points = self.points
        if at <= points[0][0]:
            return points[0][1]
        if at >= points[-1][0]:
            return points[-1][1]
        lo, hi = 0, len(points) - 1  # the last point at or before `at`: bisection over positions
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if points[mid][0] <= at:
                lo = mid
            else:
                hi = mid
        (a, va), (b, vb) = points[lo], points[lo + 1]
        if self.interpolation == "constant" or at == a:
            return va
        t = (at - a) / (b - a)
        if isinstance(va, tuple):
            return tuple(x + (y - x) * t for x, y in zip(va, vb))
        return va + (vb - va) * t

    def value_at(self, at: float) -> Value:
        """The value at position ``at``.

        Args:
            at: an optimizer step (``unit="steps"``) or the tokens trained before a step (``unit="tokens"``), >= 0.

        Returns:
            A float, or a dict ``{name: float}`` for mapping values.

        Raises:
            ValueError: ``at`` negative or NaN.
        """
        if isinstance(at, bool) or not isinstance(at, numbers.Real) or math.isnan(float(at)) or at < 0:
            raise InputValueError(f"{self.name}: value_at needs a position >= 0 ({self.unit}), got {at!r}",
                                  parameter=self.name)
        return self._out(self._raw_at(float(at)))

    def vector_at(self, at: float, keys: Sequence[str] | None = None) -> tuple[float, ...]:
        """The value at ``at`` as a tuple: mapping values in the order of ``keys`` (default :attr:`keys`); a number
        as a 1-tuple."""
        value = self.value_at(at)
        if isinstance(value, dict):
            return tuple(value[k] for k in (self.keys if keys is None else keys))
        return (value,)

    # --- state --------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (``torch.load(weights_only=True)`` reads them): ``version``, ``unit``,
        ``interpolation``, ``name`` and ``points`` as ``[[at, value], ...]``."""
        return {"version": _VERSION, "unit": self.unit, "interpolation": self.interpolation, "name": self.name,
                "points": [[at, v] for at, v in self.points_as_given()]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Schedule:
        """The schedule :meth:`to_dict` saved.

        Raises:
            ValueError: not a mapping of those keys, another version, or points the constructor refuses.
        """
        if not isinstance(state, Mapping) or set(state) != {"version", "unit", "interpolation", "name", "points"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise InputValueError(f"a saved schedule is a mapping with keys ['interpolation', 'name', 'points', "
                                  f"'unit', 'version'], got {got}", parameter="schedule")
        if state["version"] != _VERSION:
            raise InputValueError(f"a saved schedule of version {state['version']!r} cannot be read (this version "
                                  f"reads {_VERSION})", parameter=str(state.get("name", "schedule")))
        return cls(_points_from_config(state["points"]), state["unit"], state["interpolation"], state["name"])

    @property
    def fingerprint(self) -> str:
        """sha256 hex digest of the unit, interpolation and points (not the name): equal schedules share it."""
        body = {"unit": self.unit, "interpolation": self.interpolation,
                "points": [[at, v] for at, v in self.points_as_given()]}
        return sha256_of("lit_balance.Schedule", json.dumps(body, sort_keys=True, separators=(",", ":")))

    # --- resume edits -------------------------------------------------------------------------------------------

    def first_difference(self, other: Schedule, before: int) -> str | None:
        """Where ``other`` gives another value than this schedule at a position before ``before``, in words; None
        when both give the same value at every integer position ``0 .. before - 1`` (so an edit of points at or after
        ``before`` only, the future of a run resumed at ``before``, is no difference).

        Both are piecewise constant or linear between their points, so they agree on ``0 .. before - 1`` when they
        agree at every point of either below ``before``, the position after each such point and ``before - 1``.

        Args:
            other: the other schedule (e.g. the one given at a resume; this one is the saved one).
            before: the first position not compared (the resume step, or the tokens trained before it).

        Returns:
            None, or a sentence naming the first differing position and the points of both schedules there.
        """
        if self.unit != other.unit:
            if before <= 0:
                return None
            return (f"the saved {self.name} counts its points in {self.unit}, the new one in {other.unit}; at "
                    f"{before} {self.unit} trained the unit cannot change")
        if self.keys != other.keys and (self.keys is None or other.keys is None or set(self.keys) != set(other.keys)):
            if before <= 0:
                return None
            return f"the saved {self.name} names {list(self.keys or [])}, the new one {list(other.keys or [])}"
        probe = set()
        for at in self.positions + other.positions:
            for x in (at - 1, at, at + 1):
                if 0 <= x < before:
                    probe.add(x)
        if before >= 1:
            probe.update({0, before - 1})
        keys = self.keys
        for x in sorted(probe):
            mine, theirs = self.value_at(x), other.value_at(x)
            if keys is not None:
                same = all(_close(mine[k], theirs[k]) for k in keys)
            else:
                same = _close(mine, theirs)
            if not same:
                return (f"the first point that differs before {before} {self.unit} is at {x} {self.unit}: saved "
                        f"{_show(mine)} ({self._near(x)}), new {_show(theirs)} ({other._near(x)})")
        return None

    def set_from(self, at: int, value: Value) -> Schedule:
        """This schedule with ``value`` from position ``at`` on (its points before ``at`` kept, those at or after it
        replaced): a future edit, which gives the same value as this schedule at every position before ``at``.

        Under ``"linear"`` a point at ``at - 1`` with this schedule's value there is kept too, so the ramp before
        ``at`` is unchanged (a jump to ``value`` at ``at``).

        Raises:
            ValueError: ``at`` < 0; a value the constructor refuses.

        Example:
            >>> Schedule([(0, 1.0), (10, 2.0)]).set_from(5, 3.0).points_as_given()
            [(0, 1.0), (5, 3.0)]
        """
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise InputValueError(f"{self.name}: set_from needs a position >= 0 ({self.unit}), got {at!r}",
                                  parameter=self.name)
        points = [(p, v) for p, v in self.points_as_given() if p < at]
        if self.interpolation == "linear" and at >= 1 and (not points or points[-1][0] < at - 1):
            points.append((at - 1, self.value_at(at - 1)))
        points.append((at, value))
        edited = Schedule(points, self.unit, self.interpolation, self.name)
        self.check_unchanged_before(edited, at)
        return edited

    def check_unchanged_before(self, other: Schedule, before: int) -> None:
        """Refuse ``other`` as a resume of this (saved) schedule when it changes a value before ``before``.

        Raises:
            ValueError: naming the setting, the first differing point and what may change (points at or after
                ``before``).
        """
        difference = self.first_difference(other, before)
        if difference is not None:
            raise InputValueError(f"cannot resume with another {self.name}: the run has trained up to {before} "
                                  f"{self.unit}, and {difference}. Only points at or after {before} {self.unit} "
                                  f"(the future) may change at a resume; give the saved points before it unchanged",
                                  parameter=self.name)

    def _near(self, x: int) -> str:
        """The points of this schedule that give its value at ``x``, in words."""
        given = self.points_as_given()
        before = [p for p in given if p[0] <= x]
        after = [p for p in given if p[0] > x]
        if before and (self.interpolation == "constant" or before[-1][0] == x or not after):
            return f"point ({before[-1][0]}, {_show(before[-1][1])})"
        if not before:
            return f"point ({after[0][0]}, {_show(after[0][1])})"
        return (f"between points ({before[-1][0]}, {_show(before[-1][1])}) and ({after[0][0]}, "
                f"{_show(after[0][1])})")

    def __repr__(self) -> str:
        return (f"Schedule({self.points_as_given()!r}, unit={self.unit!r}, interpolation={self.interpolation!r}, "
                f"name={self.name!r})")


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {v:.6g}" for k, v in value.items()) + "}"
    return f"{value:.6g}"


def _points_from_config(points: Any) -> Any:
    """Points from a config: a mapping ``{at: value}`` (keys may be strings of ints, as YAML and JSON give them) or
    a list of pairs; passed on unchanged when neither (the constructor names what is wrong)."""
    if isinstance(points, Mapping):
        out = []
        for at, value in points.items():
            if isinstance(at, str):
                try:
                    at = int(float(at)) if float(at) == math.floor(float(at)) else at
                except ValueError:
                    pass
            out.append((at, value))
        return out
    if isinstance(points, Sequence) and not isinstance(points, (str, bytes)):
        return [tuple(p) if isinstance(p, Sequence) and not isinstance(p, (str, bytes, Mapping)) else p
                for p in points]
    return points
