"""BatchingSettings: the batching settings of a plan, in one frozen object that checks itself once.

Every consumer (:class:`~lit_balance.BalancedBatchSampler`, :func:`~lit_balance.plan_epoch`,
:class:`~lit_balance.BalancedTextDataModule`, :func:`~lit_balance.plan_report`, ``lit-balance plan``) takes this
object, so a new setting is added here and nowhere else; the consumers' keyword arguments build it. The pattern
follows lhotse's samplers, which take one validated constraint dataclass (``TokenConstraint``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from lit_balance._checks import MAX_TOKENS_LIMIT, check_bool, check_int
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["DEFAULT_PLAN_WINDOW", "STATIC_SHAPE_DEFAULTS", "TOO_LONG_POLICIES", "BatchingSettings", "check_max_tokens"]

#: Default :attr:`BatchingSettings.plan_window`: corpora of up to this many samples (2**20 = 1,048,576) are
#: planned whole, as one window.
DEFAULT_PLAN_WINDOW = 1 << 20

#: Accepted values of :attr:`BatchingSettings.too_long`.
TOO_LONG_POLICIES = ("error", "skip", "truncate")


_MAX_TOKENS_HINT = ("set max_tokens to the padded token slots per micro-batch, per rank: one int for every rank, or a "
                    "list of one int per data-parallel rank")


def check_max_tokens(value: Any) -> int | tuple[int, ...]:
    """``max_tokens`` checked: an int, or a tuple of ints (one per data-parallel rank) from a list, tuple or 1-D array.

    Raises:
        TypeError: neither an int nor a sequence of ints (naming the entry at fault).
        ValueError: a value outside ``[1, MAX_TOKENS_LIMIT]``, or an empty sequence.
    """
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        value = [int(v) for v in value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise InputValueError(f"max_tokens must be an int or a non-empty list of ints (one per data-parallel rank), "
                                  f"got {value!r}; {_MAX_TOKENS_HINT}", parameter="max_tokens")
        return tuple(check_int(f"max_tokens[{r}]", v, 1, _MAX_TOKENS_HINT, MAX_TOKENS_LIMIT)
                     for r, v in enumerate(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"max_tokens must be an int >= 1, got {value!r} of type {type(value).__name__}; "
                             f"{_MAX_TOKENS_HINT}", parameter="max_tokens")
    return check_int("max_tokens", value, 1, _MAX_TOKENS_HINT, MAX_TOKENS_LIMIT)


def _help(text: str) -> dict[str, str]:
    """Field metadata: the one-line help that ``lit-balance plan --help`` shows for the setting."""
    return {"help": text}


@dataclass(frozen=True)
class BatchingSettings:
    """The fourteen settings that, with the lengths, world size, epoch, cost model and rank speeds, fix a plan.

    All budgets are per rank: ``max_tokens`` bounds each micro-batch of each rank, and may differ per data-parallel
    rank (a list of one budget per rank; see docs/per_rank_budgets.md). Values are checked and
    normalised once, at construction (numpy ints become ``int``, ``shuffle_window`` a ``float``); the object is
    frozen, so a plan's settings never change under it. Use :meth:`replace` for a variant.

    Args:
        max_tokens: padded token slots per micro-batch (rows x longest padded row), per rank: a hard cap. With
            ``packing``, the token slots of the one packed row of a micro-batch: its documents' real tokens summed,
            rounded up to a multiple of ``pad_to_multiple_of``. One int for every rank, or a sequence of one int per
            data-parallel rank (``max_tokens[r]`` bounds every micro-batch of rank ``r``; kept as a tuple, and its
            length must equal ``num_replicas`` wherever the settings are planned): ranks of different memory.
        shuffle: change batch composition and order every epoch (``set_epoch``).
        seed: base seed, the same on every rank; randomness comes from a generator seeded by (seed, epoch).
        drop_last: drop instead of duplicate when samples are too few for equal counts on every rank.
        too_long: what to do with a sample whose padded length exceeds ``max_tokens`` (with per-rank budgets, the
            largest, :attr:`largest_max_tokens`: a sample that only some ranks can hold goes to one of them):
            ``"error"`` raises,
            ``"skip"`` leaves it out, ``"truncate"`` keeps it at the largest multiple of ``pad_to_multiple_of``
            that fits (tokens).
        pad_to_multiple_of: rows are padded to a multiple of this many tokens. With ``packing``, the packed row
            (not each document) is padded: the collator pads the tail of the row so its length is a multiple of
            this, and the planner keeps ``ceil(sum of lengths / pad_to_multiple_of) * pad_to_multiple_of <=
            max_tokens``, i.e. a micro-batch's real tokens sum to at most :attr:`truncate_to`.
        max_batch_size: maximum rows per micro-batch, or None for no cap.
        shuffle_window: with ``shuffle``, each sample's place in the longest-first order moves later by a random
            amount of up to this many micro-batches' worth of tokens before micro-batches are cut: the knob that
            trades padding for randomness (0 shuffles only equal lengths).
        accumulate_grad_batches: micro-batches per rank per optimizer step that the plan balances together
            (the Trainer's value).
        largest_first: put the optimizer step that holds the epoch's longest sample first, so that an
            out-of-memory error shows at the first step.
        plan_window: most samples planned together. An epoch of more samples is planned window by window
            (:mod:`lit_balance.plan.windows`): the samples are split into ``ceil(num_samples / plan_window)`` windows of
            about equal size by a permutation seeded by ``seed``, and each window is planned, with every guarantee,
            only when the epoch reaches it; memory and the wait for the first micro-batch scale with the window,
            not the corpus. Up to ``plan_window`` samples, the epoch is planned whole (the plan does not depend on
            this value).
        packing: padding-free micro-batches: each micro-batch is a set of whole documents concatenated into one
            row (Hugging Face's ``DataCollatorWithFlattening`` layout), so lengths mix freely and batch
            composition changes every epoch; the plan balances ranks on the packed cost
            (:meth:`~lit_balance.CostModel.packed_cost`). ``shuffle_window`` does not apply (there is no padding
            to trade) and ``max_batch_size`` caps the documents per row. ``too_long``: a document longer than
            :attr:`truncate_to` is an error, skipped, or truncated to it.

        static_packing: with ``packing``, every micro-batch is exactly ``[1, max_tokens]`` (the row's tail is padding
            with label -100 and ``position_ids`` restarting at 0) and ``cu_seq_lens_q/k`` has ``max_batch_size + 1``
            entries (zero-length segments at the end); ``max_batch_size`` is the cap of documents per row, chosen
            from the lengths when None (:func:`lit_balance.plan.shapes.choose_document_cap`; the sampler's settings
            then hold it).
        padded_shapes: without ``packing``, every padded micro-batch has one of a few shapes ``(rows, length)``:
            an int ``K`` (>= 1) has the sampler choose ``K`` shapes from the lengths, their rows for its number of
            ranks (:func:`lit_balance.plan.shapes.choose_padded_shapes`; its settings then hold them), or a sequence of
            ``(rows, length)`` pairs gives them (each within ``max_tokens`` padded slots, lengths multiples of
            ``pad_to_multiple_of``, distinct). None (default): free shapes. Both static-shape settings (for
            ``torch.compile(dynamic=False)``, CUDA graphs, XLA; docs/compiling.md) are off by default and leave every
            plan as it was while off.

    Raises:
        TypeError: a setting of the wrong type (e.g. ``shuffle="false"``, ``max_tokens=1.5``).
        ValueError: a value out of range, naming the setting and the value: ``max_tokens`` outside
            ``[1, MAX_TOKENS_LIMIT]`` (or an empty list of them); ``pad_to_multiple_of`` below 1 or above the
            smallest ``max_tokens``; a negative
            ``seed``; ``max_batch_size`` or ``accumulate_grad_batches`` outside ``[1, MAX_TOKENS_LIMIT]``;
            ``shuffle_window`` negative or not finite; an unknown ``too_long``; ``plan_window`` below 1;
            ``static_packing`` without ``packing``; ``padded_shapes`` below 1, with ``packing``, or a shape over
            ``max_tokens``; either with per-rank ``max_tokens``.

    Example:
        >>> settings = BatchingSettings(max_tokens=4096, shuffle_window=0)
        >>> settings.shuffle_window, settings.replace(accumulate_grad_batches=2).accumulate_grad_batches
        (0.0, 2)
        >>> BatchingSettings.from_dict(settings.to_dict()) == settings
        True
        >>> BatchingSettings(max_tokens=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_balance.errors.InputValueError: max_tokens must be in [1, 1099511627776], got 0; set max_tokens to ...
    """

    max_tokens: int | tuple[int, ...] = field(
        metadata=_help("padded token slots per micro-batch, per rank; or a list of one per data-parallel rank"))
    shuffle: bool = field(default=True, metadata=_help("shuffle within length buckets and steps"))
    seed: int = field(default=0, metadata=_help("sampler seed, the same on every rank"))
    drop_last: bool = field(default=False, metadata=_help("drop instead of duplicating when too few"))
    too_long: Literal["error", "skip", "truncate"] = field(default="error",
                                                           metadata=_help("samples longer than max-tokens"))
    pad_to_multiple_of: int = field(default=1, metadata=_help("rows padded to a multiple of this (tokens)"))
    max_batch_size: int | None = field(default=None, metadata=_help("rows per micro-batch cap; null = none"))
    shuffle_window: float = field(
        default=0.25, metadata=_help("micro-batches' worth of tokens a sample may move in the length order each "
                                     "epoch (randomness for padding); 0 = least padding"))
    accumulate_grad_batches: int = field(
        default=1, metadata=_help("micro-batches per rank per optimizer step, balanced together (ranks wait once "
                                  "per optimizer step)"))
    largest_first: bool = field(default=False,
                                metadata=_help("the optimizer step holding the longest sample runs first"))
    plan_window: int = field(
        default=DEFAULT_PLAN_WINDOW, metadata=_help("most samples planned together; a larger epoch is planned in "
                                                    "windows of at most this many, each when it is reached"))
    packing: bool = field(default=False,
                          metadata=_help("padding-free: whole documents concatenated into one row per micro-batch, "
                                         "max-tokens = real tokens of the row"))
    # -- static shapes (docs/compiling.md): off by default; to_dict() leaves them out while off ------------------
    static_packing: bool = field(
        default=False, metadata=_help("with packing: every micro-batch exactly [1, max-tokens], cu_seq_lens of "
                                      "max-batch-size + 1 entries (null max-batch-size: chosen from the lengths)"))
    padded_shapes: int | tuple[tuple[int, int], ...] | None = field(
        default=None, metadata=_help("padded micro-batches of at most K shapes: K (chosen from the lengths) or a list "
                                     "of [rows, length] pairs; null = free shapes"))

    def __post_init__(self) -> None:
        max_tokens = check_max_tokens(self.max_tokens)
        pad = check_int("pad_to_multiple_of", self.pad_to_multiple_of, 1, "use 1 for no rounding")
        smallest = min(max_tokens) if isinstance(max_tokens, tuple) else max_tokens
        if pad > smallest:
            where = " on some rank" if smallest != max_tokens else ""
            raise InputValueError(
                f"pad_to_multiple_of ({pad}) exceeds max_tokens ({smallest}{where}): no row would fit; "
                "lower pad_to_multiple_of or raise max_tokens"
            )
        window = self.shuffle_window
        what = f"shuffle_window must be a finite number >= 0 (micro-batches), got {window!r}"
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Real):
            raise InputTypeError(f"{what} of type {type(window).__name__}; 0 shuffles only equal lengths")
        try:
            window = float(window)
        except OverflowError:  # a Python int beyond the float range
            window = math.inf
        if not math.isfinite(window) or window < 0:
            raise InputValueError(f"{what}; 0 shuffles only equal lengths")
        max_batch_size = self.max_batch_size
        if max_batch_size is not None:
            max_batch_size = check_int("max_batch_size", max_batch_size, 1, "or pass None for no row cap",
                                       MAX_TOKENS_LIMIT)
        if not isinstance(self.too_long, str) or self.too_long not in TOO_LONG_POLICIES:
            raise InputValueError(f"too_long must be one of {TOO_LONG_POLICIES}, got {self.too_long!r}")
        normalised = {
            "max_tokens": max_tokens,
            "pad_to_multiple_of": pad,
            "shuffle_window": float(window),
            "max_batch_size": max_batch_size,
            "seed": check_int("seed", self.seed, 0, "pass a non-negative int seed, the same on every rank"),
            "shuffle": check_bool("shuffle", self.shuffle),
            "drop_last": check_bool("drop_last", self.drop_last),
            "largest_first": check_bool("largest_first", self.largest_first),
            "plan_window": check_int("plan_window", self.plan_window, 1,
                                     "samples planned together (default 1048576); a larger epoch is planned in windows",
                                     MAX_TOKENS_LIMIT),
            "packing": check_bool("packing", self.packing),
            "accumulate_grad_batches": check_int("accumulate_grad_batches", self.accumulate_grad_batches, 1,
                                                 "pass the Trainer's accumulate_grad_batches (1 for none)",
                                                 MAX_TOKENS_LIMIT),
        }
        normalised.update(_check_static_shapes(self, max_tokens, pad, normalised["packing"]))
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def per_rank(self) -> bool:
        """``max_tokens`` is a sequence of one budget per data-parallel rank (possibly all equal)."""
        return isinstance(self.max_tokens, tuple)

    @property
    def largest_max_tokens(self) -> int:
        """The largest per-rank budget (padded token slots): ``max_tokens`` itself for one int."""
        return max(self.max_tokens) if isinstance(self.max_tokens, tuple) else self.max_tokens

    def rank_max_tokens(self, num_replicas: int) -> tuple[int, ...]:
        """The budget of each of ``num_replicas`` ranks (padded token slots), ``max_tokens[r]`` for rank ``r``.

        Raises:
            ValueError: a per-rank ``max_tokens`` whose length is not ``num_replicas``.
        """
        if not isinstance(self.max_tokens, tuple):
            return (self.max_tokens,) * int(num_replicas)
        if len(self.max_tokens) != num_replicas:
            raise InputValueError(
                f"max_tokens holds {len(self.max_tokens)} per-rank budgets {list(self.max_tokens)}, but the "
                f"data-parallel world has num_replicas={num_replicas} ranks; pass one budget per rank (a list of "
                f"{num_replicas} ints), or one int for every rank", parameter="max_tokens")
        return self.max_tokens

    @property
    def truncate_to(self) -> int:
        """Longest length (tokens) that fits the budget once padded: ``max_tokens`` rounded down to the multiple
        (with per-rank budgets, the largest: such a sample is planned on a rank that holds it)."""
        return (self.largest_max_tokens // self.pad_to_multiple_of) * self.pad_to_multiple_of

    def replace(self, **changes: Any) -> BatchingSettings:
        """A copy with ``changes`` applied and checked (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain Python values (``int``, ``float``, ``bool``, ``str``, None; per-rank ``max_tokens`` a
        ``list`` of ints; ``padded_shapes`` a list of ``[rows, length]``), in field order. The static-shape settings
        are left out while off (their defaults), so the dict of every earlier setting is unchanged."""
        values = {name: getattr(self, name) for name in self.names()}
        if isinstance(values["max_tokens"], tuple):
            values["max_tokens"] = list(values["max_tokens"])
        for name, off in STATIC_SHAPE_DEFAULTS.items():  # left out while off: saved states and reports stay the same
            if values[name] == off:
                del values[name]
        if isinstance(values.get("padded_shapes"), tuple):
            values["padded_shapes"] = [list(shape) for shape in values["padded_shapes"]]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> BatchingSettings:
        """Build from :meth:`to_dict`'s output; keys left out take their defaults (``max_tokens`` has none).

        Raises:
            TypeError: ``values`` is not a mapping.
            ValueError: unknown keys, no ``max_tokens``, or a value the settings reject.
        """
        if not isinstance(values, Mapping):
            raise InputTypeError(f"BatchingSettings.from_dict expects a mapping of setting names to values, got "
                                 f"{type(values).__name__}")
        unknown = sorted(set(values) - set(cls.names()), key=repr)
        if unknown:
            raise InputValueError(f"unknown batching settings {unknown}; the settings are {list(cls.names())}")
        if "max_tokens" not in values:
            raise InputValueError("BatchingSettings.from_dict needs max_tokens (padded token slots per micro-batch, "
                                  "per "
                                  "rank), which has no default")
        return cls(**values)

    @classmethod
    def build(cls, settings: BatchingSettings | None, keywords: Mapping[str, Any], *, owner: str) -> BatchingSettings:
        """The settings a consumer (``owner``) runs with: ``settings``, or one built from keyword arguments.

        With ``settings`` given, every keyword must agree with it (after checking): keywords say the same thing
        twice, never something else. Without, the keywords build the settings (``max_tokens`` is required).

        Raises:
            TypeError: ``settings`` is not a :class:`BatchingSettings`; an unknown keyword.
            ValueError: a keyword that disagrees with ``settings`` (naming both values); a bad value.
        """
        unknown = sorted(set(keywords) - set(cls.names()))
        if unknown:
            raise InputTypeError(f"{owner} got unexpected keyword argument(s) {unknown}; the batching settings are "
                                 f"{list(cls.names())}")
        if settings is None:
            return cls(**keywords)
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a lit_balance.BatchingSettings or None, got {settings!r} of type "
                                 f"{type(settings).__name__}")
        merged = settings.replace(**keywords)
        conflicts = [f"{name}={getattr(merged, name)!r} but settings.{name}={getattr(settings, name)!r}"
                     for name in keywords if getattr(merged, name) != getattr(settings, name)]
        if conflicts:
            raise InputValueError(f"{owner}: keyword arguments disagree with settings ({'; '.join(conflicts)}); pass "
                                  "the value once, in settings (settings.replace(...)) or as a keyword without "
                                  "settings")
        return settings


# -- static shapes: the checks of static_packing and padded_shapes ----------------------------------------------------

#: The static-shape settings and their values while off (:meth:`BatchingSettings.to_dict` leaves them out then).
STATIC_SHAPE_DEFAULTS: dict[str, Any] = {"static_packing": False, "padded_shapes": None}

_SHAPES_HINT = ("set padded_shapes to an int K >= 1 (K shapes chosen from the lengths), a list of [rows, length] pairs "
                "with rows x length <= max_tokens, or None for free shapes")


def _check_static_shapes(settings: BatchingSettings, max_tokens: int | tuple[int, ...], pad: int,
                         packing: bool) -> dict[str, Any]:
    """``static_packing`` and ``padded_shapes`` checked and normalised (shapes: a tuple of ``(rows, length)`` sorted by
    length).

    Raises:
        TypeError: a value of the wrong type.
        ValueError: ``static_packing`` without ``packing``; ``padded_shapes`` with ``packing``, below 1, with a shape
            over ``max_tokens``, a length not a multiple of ``pad_to_multiple_of`` or two shapes of one length;
            either with per-rank ``max_tokens``.
    """
    static = check_bool("static_packing", settings.static_packing)
    shapes = settings.padded_shapes
    if static and not packing:
        raise InputValueError("static_packing=True needs packing=True (it fixes the packed row to [1, max_tokens]); "
                              "set packing=True, or use padded_shapes for padded micro-batches",
                              parameter="static_packing")
    per_rank = isinstance(max_tokens, tuple)
    if per_rank and (static or shapes is not None):
        name = "static_packing" if static else "padded_shapes"
        raise InputValueError(f"{name} needs one max_tokens for every rank, got per-rank budgets {list(max_tokens)}; "
                              f"pass one int max_tokens, or turn {name} off", parameter=name)
    if shapes is None:
        return {"static_packing": static, "padded_shapes": None}
    if packing:
        raise InputValueError(f"padded_shapes={shapes!r} applies to padded micro-batches, but packing=True; use "
                              "static_packing=True for packed rows, or packing=False", parameter="padded_shapes")
    if isinstance(shapes, (int, np.integer)) and not isinstance(shapes, (bool, np.bool_)):
        return {"static_packing": static,
                "padded_shapes": check_int("padded_shapes", shapes, 1, _SHAPES_HINT, MAX_TOKENS_LIMIT)}
    if isinstance(shapes, np.ndarray):
        shapes = shapes.tolist()
    if not isinstance(shapes, (list, tuple)) or not shapes:
        raise InputTypeError(f"padded_shapes must be an int, a non-empty list of [rows, length] pairs or None, got "
                             f"{shapes!r}; {_SHAPES_HINT}", parameter="padded_shapes")
    out = []
    for i, shape in enumerate(shapes):
        if not isinstance(shape, (list, tuple)) or len(shape) != 2:
            raise InputTypeError(f"padded_shapes[{i}] must be a [rows, length] pair, got {shape!r}; {_SHAPES_HINT}",
                                 parameter="padded_shapes")
        rows = check_int(f"padded_shapes[{i}] rows", shape[0], 1, _SHAPES_HINT, MAX_TOKENS_LIMIT)
        length = check_int(f"padded_shapes[{i}] length", shape[1], 1, _SHAPES_HINT, MAX_TOKENS_LIMIT)
        if rows * length > max_tokens:
            raise InputValueError(f"padded_shapes[{i}] = ({rows}, {length}) holds {rows * length} padded token slots, "
                                  f"over max_tokens={max_tokens}; lower its rows or length, or raise max_tokens",
                                  parameter="padded_shapes")
        if length % pad:
            raise InputValueError(f"padded_shapes[{i}] length {length} is not a multiple of pad_to_multiple_of={pad}; "
                                  "round the shape's length up to a multiple", parameter="padded_shapes")
        out.append((rows, length))
    out.sort(key=lambda s: (s[1], s[0]))
    twice = [b for a, b in zip(out, out[1:]) if a[1] == b[1]]
    if twice:
        raise InputValueError(f"padded_shapes has two shapes of length {twice[0][1]}: {out}; keep one shape per "
                              "length (the one with the most rows)", parameter="padded_shapes")
    return {"static_packing": static, "padded_shapes": tuple(out)}


def delegate_settings(cls: type) -> type:
    """Class decorator: a read-only property per setting that returns ``self.settings.<name>``."""
    for name in BatchingSettings.names():
        if name in cls.__dict__:
            raise InputTypeError(f"{cls.__name__} already defines {name}")
        prop = property(lambda self, _name=name: getattr(self.settings, _name),
                        doc=f"``settings.{name}`` (read-only; see :class:`~lit_balance.BatchingSettings`).")
        setattr(cls, name, prop)
    return cls
