"""Argument checks shared by the public classes: clear errors naming the setting and the value."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["check_bool", "check_callable", "check_int", "check_number"]


def check_int(name: str, value: Any, minimum: int, hint: str, maximum: int | None = None) -> int:
    """Return ``value`` as an int in ``[minimum, maximum]``; TypeError for non-ints (bools too), else ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} of type {type(value).__name__}; {hint}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}; {hint}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` as a bool; TypeError for anything but ``bool`` / ``numpy.bool_`` (e.g. ``"false"``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_number(name: str, value: Any, low: float | None, high: float | None, hint: str, *,
                 low_open: bool = False, high_open: bool = False, allow_inf: bool = False) -> float:
    """Return ``value`` as a float between ``low`` and ``high`` (None: unbounded; ``*_open``: bound excluded).

    Python and numpy real numbers pass; TypeError for anything else (bools too), ValueError for NaN, for
    infinity unless ``allow_inf``, and for a value out of range.
    """
    if low is not None and high is not None:
        bound = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        bound = f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        bound = f" {'<' if high_open else '<='} {high}"
    else:
        bound = ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number{bound}, got {value!r} of type {type(value).__name__}; {hint}")
    number = float(value)
    finite = "" if allow_inf else "finite "
    if (math.isnan(number) or (math.isinf(number) and not allow_inf)
            or (low is not None and (number <= low if low_open else number < low))
            or (high is not None and (number >= high if high_open else number > high))):
        raise ValueError(f"{name} must be a {finite}number{bound}, got {value}; {hint}")
    return number


def check_callable(name: str, value: Any, hint: str) -> Any:
    """Return ``value`` if it is callable; TypeError otherwise."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r} of type {type(value).__name__}; {hint}")
    return value
