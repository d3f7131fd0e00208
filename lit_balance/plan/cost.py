"""Cost models: what one micro-batch costs a rank, in padded tokens or (once fitted) seconds.

The planners, the statistics, the sampler's resume state and :class:`~lit_balance.callbacks.CostModelFeedback` see a
cost model only through :class:`CostModelProtocol`. :class:`CostModelBase` derives every cost from two members, the
cost of one row (or one packed document) ``row_cost(length)`` and the overhead ``per_batch`` of a micro-batch, so a new
cost model is a frozen dataclass with those two (``docs/extending.md`` has a worked example).
:class:`CostModel`, the default, is ``per_batch + rows * (linear * L + quadratic * L**2)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["CostModel", "CostModelBase", "CostModelProtocol", "check_cost_model"]


@runtime_checkable
class CostModelProtocol(Protocol):
    """What the planners, the statistics, resume and feedback need of a cost model.

    A cost model must also be hashable and compare equal by value (a frozen dataclass is): the sampler keys its cached
    plan by it. Units are the model's own (padded slots for the default, seconds once fitted); only ratios matter to
    the planners.

    Attributes:
        per_batch: cost of one micro-batch beyond its rows (kernel launches, bookkeeping), >= 0.
    """

    per_batch: float

    def row_cost(self, length: Any) -> np.ndarray:
        """Cost of one row padded to ``length`` tokens, or of one packed document of ``length`` tokens, without
        ``per_batch``: float64 of the same shape as ``length`` (broadcasts)."""

    def batch_cost(self, rows: Any, padded_length: Any) -> np.ndarray | float:
        """Cost of padded micro-batches of ``rows`` rows of ``padded_length`` tokens (broadcasts; float64)."""

    def packed_cost(self, lengths: Any, offsets: Any = None) -> np.ndarray | float:
        """Cost of packed micro-batches: ``per_batch`` plus the ``row_cost`` of each document (see
        :meth:`CostModelBase.packed_cost`)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values that :meth:`from_dict` turns back into an equal model (saved in resume state)."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CostModelProtocol:
        """The model :meth:`to_dict` describes; raise ``ValueError`` for values it does not describe."""


def _plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays as Python numbers and lists (nested in lists and dicts too)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check_coef(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputTypeError(f"CostModel.{name} must be a number >= 0, got {value!r} of type {type(value).__name__}",
                             parameter=name)
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise InputValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}", parameter=name)
    return value


class CostModelBase:
    """Base of cost models: every cost from ``row_cost`` and ``per_batch``; dictionaries from the dataclass fields.

    Subclass it as a frozen dataclass with a ``per_batch`` field and a :meth:`row_cost`; the planners, statistics,
    resume state and feedback then take it wherever they take :class:`CostModel`. To be refitted from measured
    seconds by :class:`~lit_balance.callbacks.CostModelFeedback`, it also needs a classmethod ``fit(rows,
    padded_length, seconds, *, min_samples)`` as :meth:`CostModel.fit`.

    Example:
        >>> @dataclass(frozen=True)
        ... class Slots(CostModelBase):  # padded token slots, plus 10 per micro-batch
        ...     per_batch: float = 10.0
        ...     def row_cost(self, length):
        ...         return np.asarray(length, dtype=np.float64)
        >>> Slots().batch_cost(4, 100), Slots().packed_cost([3, 4]), Slots.from_dict(Slots().to_dict()) == Slots()
        (410.0, 17.0, True)
    """

    per_batch: float = 0.0

    def row_cost(self, length: Any) -> np.ndarray:
        """Cost of one row of ``length`` tokens without ``per_batch`` (float64, same shape): defined by subclasses."""
        raise NotImplementedError(f"{type(self).__name__} must define row_cost(length)")

    def batch_cost(self, rows: Any, padded_length: Any) -> np.ndarray | float:
        """Cost of micro-batches of ``rows`` rows padded to ``padded_length`` tokens (broadcasts; float64):
        ``per_batch + rows * row_cost(padded_length)``."""
        cost = self.per_batch + np.asarray(rows, dtype=np.float64) * self.row_cost(padded_length)
        return float(cost) if np.ndim(cost) == 0 else cost

    def packed_cost(self, lengths: Any, offsets: Any = None) -> np.ndarray | float:
        """Cost of packed micro-batches: whole documents concatenated into one row, each attending to itself.

        ``cost = per_batch + sum over documents row_cost(l)``: no padding, and attention grows with each document's
        length, not the row's (a block-diagonal causal mask or a variable-length kernel such as FlashAttention's
        ``varlen``).

        Args:
            lengths: int ``[num_documents]``: tokens per document.
            offsets: int ``[num_batches + 1]``: micro-batch ``b`` holds ``lengths[offsets[b]:offsets[b + 1]]``;
                None for one micro-batch of all ``lengths``.

        Returns:
            A float (``offsets`` None) or float64 ``[num_batches]``.

        Example:
            >>> CostModel(linear=1.0, quadratic=1e-3, per_batch=5.0).packed_cost([100, 50])
            167.5
            >>> CostModel().packed_cost([3, 4, 5], [0, 2, 3]).tolist()
            [7.0, 5.0]
        """
        doc_cost = self.row_cost(np.asarray(lengths, dtype=np.int64).reshape(-1))
        if offsets is None:
            return float(self.per_batch + doc_cost.sum())
        offsets = np.asarray(offsets, dtype=np.int64)
        cumulative = np.concatenate([[0.0], np.cumsum(doc_cost)])
        return self.per_batch + cumulative[offsets[1:]] - cumulative[offsets[:-1]]

    def to_dict(self) -> dict[str, Any]:
        """The dataclass fields as plain Python values (NumPy scalars and arrays become ``int``, ``float`` and lists),
        so that a ``state_dict`` holding them loads with ``torch.load(weights_only=True)``."""
        return {name: _plain(value) for name, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CostModelBase:
        """Build from :meth:`to_dict`'s output: every field of the class, no other key.

        Raises:
            ValueError: ``values`` is not a mapping of exactly this class's fields (naming those expected and those
                given), or a value the class rejects.
        """
        names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        if not isinstance(values, Mapping) or set(values) != set(names):
            got = sorted(values) if isinstance(values, Mapping) else type(values).__name__
            raise InputValueError(f"a {cls.__name__} is described by the keys {names}, got {got}")
        return cls(**values)


@dataclass(frozen=True)
class CostModel(CostModelBase):
    """Cost of a micro-batch of ``rows`` rows padded to ``L`` tokens.

    ``cost = per_batch + rows * (linear * L + quadratic * L**2)``

    The linear term counts padded token slots (embeddings, MLPs, the LM head); the quadratic term models
    self-attention, whose work per row grows with the square of its padded length; ``per_batch`` is a fixed
    overhead per micro-batch (kernel launches, optimizer-free bookkeeping). The unit is whatever the
    coefficients make it: the default ``CostModel()`` counts padded token slots; a model fitted from measured
    timings (see :meth:`fit`) gives seconds. Counting the FLOPs of one transformer block, the quadratic
    coefficient is about ``1 / (6 * d_model)`` of the linear one (attention scores and values: ``4 L^2 d`` per
    layer against ``24 L d^2`` for the projections and MLP), e.g. about ``1e-3`` at ``d_model = 128``. The
    output layer (``2 d V`` per token for a vocabulary of ``V``) adds to the linear part only, so with a large
    vocabulary and few layers the ratio is far smaller: fit it (:meth:`fit`) rather than assume it.

    Args:
        linear: cost per padded token slot (>= 0).
        quadratic: cost per squared padded length per row (>= 0).
        per_batch: cost per micro-batch (>= 0).

    Raises:
        TypeError: a coefficient that is not a number.
        ValueError: a negative, NaN or infinite coefficient, or all three zero.

    Example:
        >>> CostModel().batch_cost(4, 100)
        400.0
        >>> CostModel(linear=1.0, quadratic=1e-3, per_batch=5.0).batch_cost(4, 100)
        445.0
    """

    linear: float = 1.0
    quadratic: float = 0.0
    per_batch: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_batch"):
            object.__setattr__(self, name, _check_coef(name, getattr(self, name)))
        if self.linear == 0 and self.quadratic == 0:
            raise InputValueError(
                "CostModel needs linear > 0 or quadratic > 0 (the cost must grow with tokens), got "
                f"linear={self.linear}, quadratic={self.quadratic}"
            )

    def row_cost(self, padded_length: Any) -> np.ndarray:
        """Cost of one row padded to ``padded_length`` tokens, without ``per_batch`` (float64, same shape)."""
        length = np.asarray(padded_length, dtype=np.float64)
        return self.linear * length + self.quadratic * length * length

    @classmethod
    def fit(
        cls,
        rows: Any,
        padded_length: Any,
        seconds: Any,
        *,
        min_samples: int = 3,
    ) -> CostModel:
        """Fit seconds per micro-batch as ``per_batch + rows * (linear * L + quadratic * L**2)``.

        Non-negative least squares over the three coefficients (each coefficient is kept at 0 when the fit
        would make it negative: every subset of the three is tried, the best non-negative one is kept).

        Args:
            rows: ``[n]`` rows of each timed micro-batch.
            padded_length: ``[n]`` padded length of each (tokens).
            seconds: ``[n]`` measured compute seconds of each.
            min_samples: fewest observations accepted.

        Returns:
            A :class:`CostModel` in seconds.

        Raises:
            TypeError: an array that is not of ints or floats (bools, strings, objects).
            ValueError: arrays of different shapes, fewer than ``min_samples`` observations, non-finite or
                negative values, or timings that no positive token coefficient explains.
        """
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise InputValueError(f"min_samples must be an int >= 1, got {min_samples!r}")
        arrays = []
        for name, value in (("rows", rows), ("padded_length", padded_length), ("seconds", seconds)):
            a = np.asarray(value)
            if a.dtype.kind not in "iuf":
                raise InputTypeError(f"CostModel.fit: {name} must be numbers (an int or float array), got dtype "
                                     f"{a.dtype} (e.g. {a.reshape(-1)[:3].tolist()!r})")
            arrays.append(a.astype(np.float64).reshape(-1))
        r, length, t = arrays
        if not (r.shape == length.shape == t.shape):
            raise InputValueError(
                f"rows, padded_length and seconds must have the same length, got {r.size}, {length.size}, {t.size}"
            )
        if r.size < min_samples:
            raise InputValueError(f"CostModel.fit needs at least {min_samples} timed micro-batches, got {r.size}")
        for name, a in (("rows", r), ("padded_length", length), ("seconds", t)):
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise InputValueError(f"CostModel.fit: {name} must be finite and >= 0")
        columns = np.stack([r * length, r * length * length, np.ones_like(r)], axis=1)
        scale = np.maximum(np.abs(columns).max(axis=0), 1e-300)
        best: tuple[float, np.ndarray] | None = None
        for subset in ((0, 1, 2), (0, 2), (1, 2), (0, 1), (0,), (1,), (2,)):
            a = columns[:, subset] / scale[list(subset)]
            try:
                coef, *_ = np.linalg.lstsq(a, t, rcond=None)
            except np.linalg.LinAlgError as exc:
                raise InputValueError(f"CostModel.fit: the timings cannot be fitted ({exc}); check for extreme "
                                      "values") from exc
            if np.any(coef < 0):
                continue
            resid = float(np.sum((a @ coef - t) ** 2))
            if best is None or resid < best[0] - 1e-15:
                full = np.zeros(3)
                full[list(subset)] = coef / scale[list(subset)]
                best = (resid, full)
        token_part = 0.0 if best is None else float(np.mean(columns[:, :2] @ best[1][:2]))
        if best is None or token_part <= 1e-6 * max(float(np.mean(t)), 1e-300):
            raise InputValueError("CostModel.fit: the timings do not grow with tokens; time more (or longer) "
                                  "micro-batches")
        linear, quadratic, per_batch = (float(x) for x in best[1])
        return cls(linear=linear, quadratic=quadratic, per_batch=per_batch)


_REQUIRED = ("per_batch", "row_cost", "batch_cost", "packed_cost", "to_dict", "from_dict")


#: lengths (tokens) at which a cost model's costs are checked when it is given: 1 to 2**20, about 4 per octave
_PROBE_LENGTHS = np.unique(np.geomspace(1, 2**20, 81).astype(np.int64))


def check_cost_model(cost_model: Any, parameter: str = "cost_model") -> CostModelProtocol:
    """Return ``cost_model``, or the default :class:`CostModel` (padded token slots) for None.

    A cost model other than :class:`CostModel` is also checked on lengths from 1 to 2**20 tokens: its ``row_cost``
    must return float costs of the lengths' shape, finite, >= 0 and not all 0, its ``per_batch`` a finite number >= 0;
    a :class:`CostModelBase` subclass must be a dataclass (its fields are what ``to_dict`` saves).

    Raises:
        TypeError: ``cost_model`` lacks a member of :class:`CostModelProtocol` (naming it), is not hashable, or is a
            :class:`CostModelBase` that is not a dataclass.
        ValueError: its costs are not finite, negative, all 0, or of another shape than the lengths.
    """
    if cost_model is None:
        return CostModel()
    missing = [name for name in _REQUIRED if not hasattr(cost_model, name)]
    if missing or isinstance(cost_model, type):
        raise InputTypeError(
            f"{parameter} must be a lit_balance.CostModel or None, or another cost model (an object with "
            f"{', '.join(_REQUIRED)}: see lit_balance.plan.CostModelBase); got {cost_model!r} of type "
            f"{type(cost_model).__name__}" + (f", which lacks {missing}" if missing and not isinstance(cost_model, type)
                                              else ""), parameter=parameter)
    try:
        hash(cost_model)
    except TypeError:
        raise InputTypeError(f"{parameter} must be hashable and compare by value (e.g. a frozen dataclass), got an "
                             f"unhashable {type(cost_model).__name__}", parameter=parameter) from None
    if type(cost_model) is not CostModel:
        _check_costs(cost_model, parameter)
    return cost_model


def _check_costs(cost_model: Any, parameter: str) -> None:
    """Raise unless ``cost_model`` is a dataclass (if a :class:`CostModelBase`) with sane costs on probe lengths."""
    name = type(cost_model).__name__
    if isinstance(cost_model, CostModelBase) and not dataclasses.is_dataclass(cost_model):
        raise InputTypeError(f"{parameter}: a CostModelBase subclass must be a (frozen) dataclass, whose fields "
                             f"to_dict() saves and from_dict() restores; decorate {name} with "
                             "@dataclass(frozen=True)", parameter=parameter)
    per_batch = cost_model.per_batch
    if isinstance(per_batch, (bool, np.bool_)) or not isinstance(per_batch, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(per_batch)) or per_batch < 0:
        raise InputValueError(f"{parameter}: {name}.per_batch must be a finite number >= 0 (the cost of one "
                              f"micro-batch beyond its rows), got {per_batch!r}", parameter=parameter)
    try:
        costs = np.asarray(cost_model.row_cost(_PROBE_LENGTHS), dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise InputValueError(f"{parameter}: {name}.row_cost(lengths) must return a float cost per length (an array "
                              f"of the lengths' shape); on an int64 array of {_PROBE_LENGTHS.size} lengths it raised "
                              f"{type(error).__name__}: {error}", parameter=parameter) from error
    if costs.shape != _PROBE_LENGTHS.shape:
        raise InputValueError(f"{parameter}: {name}.row_cost(lengths) must return one cost per length, shape "
                              f"{_PROBE_LENGTHS.shape}, got shape {costs.shape}", parameter=parameter)
    bad = np.flatnonzero(~np.isfinite(costs) | (costs < 0))
    if bad.size:
        i = int(bad[0])
        raise InputValueError(f"{parameter}: {name}.row_cost must be finite and >= 0 for every length, got "
                              f"{float(costs[i])} at a length of {int(_PROBE_LENGTHS[i])} tokens ({bad.size} of "
                              f"{costs.size} lengths from 1 to {int(_PROBE_LENGTHS[-1])})", parameter=parameter)
    if not costs.any():
        raise InputValueError(f"{parameter}: {name}.row_cost is 0 for every length from 1 to "
                              f"{int(_PROBE_LENGTHS[-1])} tokens; the cost must grow with tokens", parameter=parameter)
