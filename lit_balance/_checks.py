"""Argument checks shared by the public classes: clear errors naming the setting and the value (NumPy only)."""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np

from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["MAX_TOKENS_LIMIT", "MIN_RANK_SPEED_RATIO", "check_bool", "check_callable", "check_int",
           "check_lengths", "check_number", "check_speeds"]


def check_int(name: str, value: Any, minimum: int, hint: str, maximum: int | None = None) -> int:
    """Return ``value`` as an int in ``[minimum, maximum]``; TypeError for non-ints (bools too), else ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an int >= {minimum}, got {value!r} of type {type(value).__name__}; "
                             f"{hint}", parameter=name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InputValueError(f"{name} must be {bound}, got {value}; {hint}", parameter=name)
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` as a bool; TypeError for anything but ``bool`` / ``numpy.bool_`` (e.g. ``"false"``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}",
                             parameter=name)
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
        raise InputTypeError(f"{name} must be a real number{bound}, got {value!r} of type "
                             f"{type(value).__name__}; {hint}", parameter=name)
    try:
        number = float(value)
    except OverflowError:  # a Python int beyond the float range
        number = math.inf if value > 0 else -math.inf
    finite = "" if allow_inf else "finite "
    if (math.isnan(number) or (math.isinf(number) and not allow_inf)
            or (low is not None and (number <= low if low_open else number < low))
            or (high is not None and (number >= high if high_open else number > high))):
        raise InputValueError(f"{name} must be a {finite}number{bound}, got {value}; {hint}", parameter=name)
    return number


def check_callable(name: str, value: Any, hint: str) -> Any:
    """Return ``value`` if it is callable; TypeError otherwise."""
    if not callable(value):
        raise InputTypeError(f"{name} must be callable, got {value!r} of type {type(value).__name__}; {hint}",
                             parameter=name)
    return value


def _torch():
    """The torch module if it is imported, else None: a tensor can only exist once torch is (no import here)."""
    return sys.modules.get("torch")


def _is_tensor(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


#: Largest accepted sample length and ``max_tokens`` (tokens); larger values are not token counts.
MAX_TOKENS_LIMIT = 2**40


def check_lengths(lengths: Any, keep_dtype: bool = False) -> np.ndarray:
    """Return ``lengths`` as int64 ``[num_samples]`` or raise ValueError naming the offending values.

    With ``keep_dtype``, an integer array (e.g. an int32 memory map) is returned as it is, without a copy.
    """
    hint = "pass integer token counts, e.g. np.asarray(lengths, dtype=np.int64)"
    if np.ma.isMaskedArray(lengths):
        raise InputValueError("lengths is a masked array: fill or drop the masked entries first (tokens per sample)")
    if lengths is None or isinstance(lengths, (dict, set, frozenset)):
        raise InputValueError(f"lengths must be a 1-D sequence, array or tensor of ints (tokens per sample), got "
                              f"{type(lengths).__name__}{'' if lengths is None else ' (unordered or keyed)'}; {hint}")
    if isinstance(lengths, (str, bytes)) or (not hasattr(lengths, "__len__") and hasattr(lengths, "__iter__")):
        raise InputValueError(
            f"lengths must be a 1-D sequence, array or tensor of ints (tokens per sample), got "
            f"{type(lengths).__name__}; e.g. pass list(...) of a generator"
        )
    if _is_tensor(lengths):
        t = lengths.detach().cpu()
        lengths = t.numpy() if not (t.is_floating_point() or t.is_complex() or t.dtype == _torch().bool) else t.tolist()
    if isinstance(lengths, (list, tuple)):
        for i, v in enumerate(lengths):
            if isinstance(v, (bool, np.bool_)):
                raise InputValueError(
                    f"lengths must be integers (tokens per sample); index {i} holds the bool {v!r}; {hint}"
                )
    try:
        arr = np.asarray(lengths)
    except (ValueError, TypeError) as exc:
        raise InputValueError(
            f"lengths must be a 1-D sequence of ints (tokens per sample); could not read it: {exc}"
        ) from exc
    if arr.ndim != 1:
        raise InputValueError(f"lengths must be 1-D (tokens per sample), got an array of shape {arr.shape}")
    if arr.size == 0:
        raise InputValueError("lengths is empty: expected at least one sample length (tokens per sample), got []")
    if arr.dtype.kind not in "iu":  # floats, bools, objects: accept only Python/numpy ints, name the first other
        values = arr.tolist()
        integral = [not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))
                    for v in values]
        i = integral.index(False) if False in integral else next(
            (k for k, v in enumerate(values) if not isinstance(v, int)), None)
        if i is not None:  # the first non-integral value, else the first integral float
            raise InputValueError(
                f"lengths must be integers (tokens per sample); index {i} holds {values[i]!r} "
                f"({type(values[i]).__name__}, array dtype {arr.dtype}); {hint}"
            )
        for i, v in enumerate(values):
            if not 1 <= v <= MAX_TOKENS_LIMIT:
                break
        else:
            return np.asarray(values, dtype=np.int64)
        raise InputValueError(f"every length must be in [1, {MAX_TOKENS_LIMIT}] tokens; index {i} holds {v}")
    if int(arr.min()) < 1 or int(arr.max()) > MAX_TOKENS_LIMIT:  # (no temporary arrays when all are fine)
        bad = np.flatnonzero((arr < 1) | (arr > MAX_TOKENS_LIMIT))
        shown = ", ".join(f"index {i}: {arr[i]}" for i in bad[:5])
        raise InputValueError(
            f"every length must be in [1, {MAX_TOKENS_LIMIT}] tokens; {bad.size} are not "
            f"({shown}{', ...' if bad.size > 5 else ''}); a length counts tokens per sample: "
            "drop empty samples, check the array"
        )
    return arr if keep_dtype else arr.astype(np.int64)


#: Floor of a rank's speed relative to the fastest rank's: slower ranks are planned at this ratio. A rank at a
#: millionth of the fastest one's speed already gets the least share a plan can give (one row per micro-batch:
#: its share of a micro-batch within a budget of up to a million padded tokens is below one token), and the
#: floor keeps the planner's ratios far from float underflow and overflow (speeds may span any range).
MIN_RANK_SPEED_RATIO = 1e-6


def check_speeds(rank_speeds: Any, num_replicas: int) -> np.ndarray | None:
    """Return ``rank_speeds`` as float64 ``[num_replicas]`` scaled so the fastest is 1, or None for equal ranks.

    A speed below :data:`MIN_RANK_SPEED_RATIO` of the fastest one's is raised to that ratio.
    """
    if rank_speeds is None:
        return None
    try:
        ndim = np.ndim(rank_speeds)
    except ValueError:  # ragged nesting
        ndim = -1
    if ndim != 1:
        raise InputValueError(f"rank_speeds must be 1-D, one number per rank ({num_replicas}), got {rank_speeds!r}")
    if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
               for x in np.asarray(rank_speeds, dtype=object)):
        raise InputTypeError(f"rank_speeds must be numbers (relative throughput per rank), got {rank_speeds!r}")
    try:
        speeds = np.asarray(rank_speeds, dtype=np.float64).reshape(-1)
    except OverflowError as exc:  # a Python int beyond the float range
        raise InputValueError(f"rank_speeds must hold {num_replicas} finite numbers > 0 (one relative throughput per "
                              f"rank), got {rank_speeds!r}; pass None for equal ranks") from exc
    except (TypeError, ValueError) as exc:
        raise InputTypeError(f"rank_speeds must be a sequence of {num_replicas} positive numbers, got "
                             f"{rank_speeds!r}", parameter="rank_speeds") from exc
    if speeds.shape[0] != num_replicas or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
        raise InputValueError(
            f"rank_speeds must hold {num_replicas} finite numbers > 0 (one relative throughput per rank), "
            f"got {rank_speeds!r}; pass None for equal ranks"
        )
    return np.maximum(speeds / speeds.max(), MIN_RANK_SPEED_RATIO)


def check_supervised_lengths(supervised: Any, lengths: np.ndarray) -> np.ndarray:
    """Return per-sample next-token target counts as int64 ``[num_samples]``, each in ``[0, max(length - 1, 0)]``.

    ``lengths`` are the samples' token counts as planned (after any truncation): a row of ``l`` tokens has at most
    ``l - 1`` targets after a causal LM's shift.
    """
    hint = ("pass supervised_lengths as the next-token targets of each sample as planned (after truncation): labels "
            "1 .. length-1 that are not -100, e.g. TokenDataset.supervised_lengths()")
    if _is_tensor(supervised):
        supervised = supervised.detach().cpu().numpy()
    try:
        arr = np.asarray(supervised)
    except (ValueError, TypeError) as exc:
        raise InputValueError(f"supervised_lengths must be a 1-D sequence of ints; could not read it: {exc}") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputValueError(f"supervised_lengths must be a 1-D sequence of ints, got shape {arr.shape} dtype "
                              f"{arr.dtype}; "
                              f"{hint}")
    if arr.shape != lengths.shape:
        raise InputValueError(f"supervised_lengths has {arr.size} entries but lengths has {lengths.size}; {hint}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr > np.maximum(lengths - 1, 0)))
    if bad.size:
        i = int(bad[0])
        raise InputValueError(f"supervised_lengths[{i}] = {int(arr[i])} is outside [0, {max(int(lengths[i]) - 1, 0)}] "
                              "for a "
                              f"sample of {int(lengths[i])} tokens as planned ({bad.size} such sample(s)); {hint}")
    return arr
