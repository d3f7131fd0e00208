"""Argument checks shared by the public classes: clear errors naming the setting and the value."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_bool", "check_int"]


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
