"""Mixture plans: weighted blends of components, exact in tokens at every optimizer step.

A mixture names its components and gives each a weight: the share of the epoch's tokens (``unit="tokens"``, the
default), of its supervised tokens (``"supervised_tokens"``: the loss tokens of prompt-completion or masked data) or of
its documents (``"documents"``: sample weighting, what Megatron's ``BlendedDataset`` and Hugging Face's
``interleave_datasets`` do, for comparison). An epoch is planned in three stages, all pure functions of (lengths,
settings, mixture, seed, epoch, ranks):

1. **Selection.** The epoch's length in the unit, ``E``, is by default as long as the components allow without
   reading any document more than ``max_repetition`` times: ``E = min_c(max_repetition * T_c / w_c)`` over the
   components of weight ``w_c > 0`` holding ``T_c`` units. Each component then contributes ``w_c * E`` units: whole
   passes over its documents, then a random subset (a new one every epoch, from a generator seeded by
   ``(seed, epoch, component)``) whose units come nearest to what is left. With ``max_repetition=1`` the limiting
   component is read once and the others are subsampled. With ``units_per_epoch`` set, ``E`` is that number, and a
   component that cannot give ``w_c * E`` units within ``max_repetition`` reads is an error before training.
2. **Steps.** Each component's chosen documents form a stream (padded plans: sorted by length, longest first, with
   random jitter so batch-mates change between epochs; packed plans: in random order). The streams are merged into
   one walk by each document's midpoint tag ``(U_c(j) + u_j / 2) / s_c`` (``U_c(j)`` the units before document ``j``
   in its stream, ``u_j`` its units, ``s_c`` the component's share of the chosen units): every prefix of the walk
   then holds, of each component, the documents nearest its cumulative quota (the largest-remainder idea of
   proportional apportionment, applied to cumulative quotas), and each stream keeps its order. Optimizer steps are
   consecutive pieces of the walk. With ``D_c(p) = s_c * X(p) - U_c(p)`` the error of prefix ``p`` (``X(p)`` its
   units), a step from ``a`` to ``b`` holds ``u_c = s_c * U + D_c(a) - D_c(b)`` of component ``c``: a step ends at
   the last prefix within its fill whose errors keep **every component within one document of its share**,
   ``|u_c - s_c * U| <= B``, where ``B`` is the step's *boundary document*: the longest document (in the unit) next
   to a component's cut at the step's start or end (the last one each stream gives the step or an earlier one, and
   the first it leaves to a later one), so at most the mixture's longest document. One document always does
   (it moves each error by at most its own units), so such an end exists. Steps of at least 256k tokens also keep
   ``|u_c - s_c * U| <= 0.02 * U`` (unless one document alone is that long). Over the epoch the errors vanish:
   each component has exactly its share of the chosen units, which the selection puts within one document of its
   weight. A step's size starts at the micro-batches' capacity (``num_replicas * accumulate_grad_batches``
   budgets) times a fill ratio that adapts: a step whose documents do not fit its micro-batches is made 2 %
   smaller and formed again, and each step that fits lets the next be 0.2 % larger. The step's room is its
   micro-batches times the costliest micro-batch its longest document can be in
   (:meth:`~lit_balance.plan.epoch.Planner.step_budget`: padded, as many rows of that length as ``max_tokens``
   holds, so a step of 4,500-token documents under ``max_tokens=8192`` is cut into micro-batches of 4,500 slots, not
   left beside micro-batches of 8,192). With one micro-batch per rank and step (``accumulate_grad_batches=1``, where
   a rank's one micro-batch is all it runs in the step), two more rules keep every rank busy for as long as the
   costliest: a next document too large for the room left moves later in the walk, past the documents of other
   components that fill it (never past one of its own, so each stream keeps its order, and the step's bounds are
   checked as for any other end); and a step that fits is grown by 4, 2 and 1 % of its room where the larger step
   still fits. Padded (rows of similar length share a micro-batch), a step of two to four components
   (:data:`_WHOLE_COMPONENTS`) is then **rounded to whole micro-batches per component**: each component's documents
   from its cut, longest first, make full micro-batches of the step's budget, and a step that ends part-way through
   one leaves it part-filled (its rank idles, or shorter rows pad to its length). Every choice of, per component, one
   micro-batch fewer, the micro-batch boundary before the end, the end itself, or the boundary after it is tried at
   once (:func:`_whole`); of those that need no more micro-batches than the step has, keep the step's bounds and
   leave every error within one boundary document (so the next step starts within reach of its shares), the one of
   most tokens is kept, and the walk is regrouped to it (documents move across the step's end only, and each stream
   keeps its order).
3. **Micro-batches.** Whether a step fits is known without planning it, and the micro-batches of all steps are then
   formed at once (:mod:`lit_balance.plan.mixture_batches`: NumPy over the steps, a few hundred times faster than a
   planner call per step), exactly ``num_replicas * accumulate_grad_batches`` per step within the budget, with the
   cost per rank balanced; a step of fewer documents has one document per micro-batch and fill rows. With per-rank
   budgets, unequal rank speeds or static shapes, each step is planned by the planner the settings choose
   (:func:`~lit_balance.plan.planner_for`) instead. Length bands of one step sort into few micro-batches, so padding
   stays low. With ``shuffle`` the steps then run in random order; ``largest_first`` moves the step of the longest
   document first. With one budget for every rank and equal speeds, each step's shares of cost then go to the ranks
   that have cost least so far in the epoch (LPT over the steps), so the epoch's cost per rank is as even as one
   corpus's.

Samples live in one index space: sample ``copy * N + offset_c + d`` is document ``d`` of component ``c`` read for the
``copy``-th time in an epoch (``N`` documents over all components, ``copy < max_repetition``), so every sample is
planned at most once per epoch and the sampler's resume (which marks the samples consumed) works unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, empty_plan, padded_lengths

__all__ = ["MIXTURE_UNITS", "MixtureLayout", "MixturePlan", "MixtureSettings", "mixture_units", "plan_mixture",
           "select_epoch"]

#: Accepted values of :attr:`MixtureSettings.unit`.
MIXTURE_UNITS = ("tokens", "supervised_tokens", "documents")
_RANK_SUFFIX = re.compile(r"_rank(\d+)$")  # the per-rank metric keys' suffix: no component name ends so

_FILL_START = {"padded": 0.95, "packed": 0.98}  # first fill ratio of a step's capacity, by planner (else 0.95)
_FILL_SHRINK, _FILL_GROW = 0.98, 1.002  # a step that does not fit: 2 % smaller; one that fits: the next 0.2 % larger
_BIG_STEP_TOKENS, _BIG_STEP_SHARE = 256 * 1024, 0.02
_DEFER_LOOK = 4096  # a document that does not fit its step moves past at most this many walk positions
_BUDGET_TRIES = 3  # a step's room shrinks to what its longest document allows at most this many times
_GROW = (0.04, 0.02, 0.01)  # a step that fits: larger ones tried, by these shares of its room more
_WHOLE_COMPONENTS = 4  # steps rounded to whole micro-batches per component up to this many components (4**k tries)


@dataclass(frozen=True)
class MixtureSettings:
    """The components of a mixture, their weights and what an epoch is; checked once, at construction.

    Args:
        names: one name per component, unique (the names of ``val/loss/<name>`` and per-component figures): not
            empty, without ``/`` or surrounding spaces, not ending in ``_rank<digits>`` (the suffix of the per-rank
            keys ``train/tokens/<name>_rank<r>``, so ``web_rank0``'s keys would be ``web``'s on rank 0).
        weights: one weight per component, finite and non-negative, with a positive sum; normalised to shares
            (``[3, 1]`` is 75 % / 25 %). A weight of 0 leaves the component out of training.
        unit: what the weights share: ``"tokens"`` (real tokens, the default), ``"supervised_tokens"`` (next-token
            targets: tokens whose label is not masked) or ``"documents"`` (sample weighting).
        max_repetition: the most times a document is read in one epoch (int >= 1).
        units_per_epoch: the epoch's length in ``unit`` (global, all ranks), or None: as long as the components
            allow within ``max_repetition``.

    Raises:
        TypeError: a name that is not a string; a weight that is not a number; a non-int ``max_repetition``.
        ValueError: no component; names and weights of different lengths; an empty or repeated name, one with
            ``/`` or surrounding spaces, or ending in ``_rank<digits>``; a negative,
            NaN or infinite weight; weights summing to 0; an unknown ``unit``; ``max_repetition < 1``;
            ``units_per_epoch < 1``.

    Example:
        >>> MixtureSettings.from_weights({"web": 6, "code": 1, "books": 3}).shares.tolist()
        [0.6, 0.1, 0.3]
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    unit: str = "tokens"
    max_repetition: int = 1
    units_per_epoch: int | None = None

    def __post_init__(self) -> None:
        names, weights = tuple(self.names), tuple(self.weights)
        if not names:
            raise InputValueError("a mixture needs at least one component; got no component names",
                                  parameter="components")
        if len(names) != len(weights):
            raise InputValueError(f"a mixture needs one weight per component: {len(names)} names {list(names)} but "
                                  f"{len(weights)} weights {list(weights)}", parameter="weights")
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str):
                raise InputTypeError(f"component names must be strings, got {name!r} of type {type(name).__name__}",
                                     parameter="components")
            if not name.strip() or "/" in name or name != name.strip():
                raise InputValueError(f"component name {name!r} must be a non-empty string without '/' or leading "
                                      f"and trailing spaces (it names the metric val/loss/<name>)",
                                      parameter="components")
            clash = _RANK_SUFFIX.search(name)
            if clash:
                base, rank = name[:clash.start()], clash.group(1)
                raise InputValueError(f"component name {name!r} ends in '_rank<digits>', which the per-rank metric "
                                      f"keys add (train/tokens/<name>_rank<r>): its keys would collide with those of "
                                      f"a component {base!r} on rank {rank}; rename it (e.g. {base + '_r' + rank!r})",
                                      parameter="components")
            if name in seen:
                raise InputValueError(f"component name {name!r} is used twice in the mixture {list(names)}; give "
                                      "every component its own name", parameter="components")
            seen.add(name)
        checked = []
        for name, weight in zip(names, weights):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise InputTypeError(f"the weight of component {name!r} must be a number, got {weight!r} of type "
                                     f"{type(weight).__name__}", parameter=f"{name}.weight")
            weight = float(weight)
            if not math.isfinite(weight) or weight < 0:
                raise InputValueError(f"the weight of component {name!r} must be finite and >= 0, got {weight!r}; "
                                      "set its weight to its share (any positive scale)", parameter=f"{name}.weight")
            checked.append(weight)
        if sum(checked) <= 0:
            raise InputValueError(f"the weights of the mixture sum to {sum(checked)!r} ({dict(zip(names, checked))}); "
                                  "at least one component needs a positive weight", parameter="weights")
        if self.unit not in MIXTURE_UNITS:
            raise InputValueError(f"unit must be one of {list(MIXTURE_UNITS)}, got {self.unit!r}", parameter="unit")
        if isinstance(self.max_repetition, bool) or not isinstance(self.max_repetition, numbers.Integral):
            raise InputTypeError(f"max_repetition must be an int >= 1, got {self.max_repetition!r}",
                                 parameter="max_repetition")
        if self.max_repetition < 1:
            raise InputValueError(f"max_repetition must be >= 1 (reads of a document per epoch), got "
                                  f"{self.max_repetition}", parameter="max_repetition")
        if self.units_per_epoch is not None and (isinstance(self.units_per_epoch, bool) or not isinstance(
                self.units_per_epoch, numbers.Integral) or self.units_per_epoch < 1):
            raise InputValueError(f"units_per_epoch must be None (as long as the components allow) or an int >= 1, "
                                  f"got {self.units_per_epoch!r}", parameter="units_per_epoch")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "weights", tuple(checked))
        object.__setattr__(self, "max_repetition", int(self.max_repetition))
        if self.units_per_epoch is not None:
            object.__setattr__(self, "units_per_epoch", int(self.units_per_epoch))

    @classmethod
    def from_weights(cls, weights: Mapping[str, float], **kwargs: Any) -> MixtureSettings:
        """Build from ``{name: weight}`` (in order); ``kwargs`` are the other settings."""
        if not isinstance(weights, Mapping):
            raise InputTypeError(f"weights must be a mapping of component names to weights, got "
                                 f"{type(weights).__name__}", parameter="weights")
        return cls(tuple(weights), tuple(weights.values()), **kwargs)

    @property
    def shares(self) -> np.ndarray:
        """float64 ``[num_components]``: the weights normalised to sum to 1."""
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (a resume state keeps them)."""
        return {"names": list(self.names), "weights": list(self.weights), "unit": self.unit,
                "max_repetition": self.max_repetition, "units_per_epoch": self.units_per_epoch}


@dataclass(frozen=True)
class MixtureLayout:
    """Where each component's documents live in the mixture's sample space.

    Attributes:
        sizes: int64 ``[num_components]``: documents per component.
        max_repetition: copies of every document in the sample space.

    Sample ``i`` is document ``(i % N) - offsets[c]`` of component ``c`` (``N = sizes.sum()``), read for the
    ``i // N``-th time.

    Example:
        >>> layout = MixtureLayout(np.array([3, 2]), 2)
        >>> layout.num_samples, layout.locate(np.array([4, 8])).tolist()
        (10, [[1, 1], [1, 0]])
    """

    sizes: np.ndarray
    max_repetition: int = 1

    @property
    def num_documents(self) -> int:
        """Documents over all components (``N``)."""
        return int(np.sum(self.sizes))

    @property
    def num_samples(self) -> int:
        """Samples: ``max_repetition * N``."""
        return self.num_documents * self.max_repetition

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[num_components + 1]``: component ``c`` holds documents ``offsets[c]:offsets[c + 1]``."""
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    def component_of(self, samples: np.ndarray) -> np.ndarray:
        """int64: the component of each sample index."""
        doc = np.asarray(samples, dtype=np.int64) % max(self.num_documents, 1)
        return np.searchsorted(self.offsets, doc, side="right") - 1

    def locate(self, samples: np.ndarray) -> np.ndarray:
        """int64 ``[n, 2]``: ``(component, document within it)`` of each sample index."""
        doc = np.asarray(samples, dtype=np.int64) % max(self.num_documents, 1)
        comp = np.searchsorted(self.offsets, doc, side="right") - 1
        return np.stack([comp, doc - self.offsets[comp]], axis=1)

    def tile(self, values: np.ndarray) -> np.ndarray:
        """``values`` (``[N]``, one per document) repeated for every copy: ``[num_samples]``."""
        values = np.asarray(values)
        return values if self.max_repetition == 1 else np.tile(values, self.max_repetition)


@dataclass(frozen=True)
class MixturePlan:
    """A mixture epoch: the plan and what each optimizer step holds from each component.

    Attributes:
        plan: the :class:`~lit_balance.plan.types.EpochPlan` (sample indices of the mixture's sample space).
        chosen: bool ``[num_samples]``: the samples this epoch reads.
        step_units: int64 ``[num_optimizer_steps, num_components]``: units (the mixture's unit) of each component in
            each optimizer step, fill rows excluded.
        step_targets: float64 ``[num_optimizer_steps, num_components]``: each step's scheduled shares, with a weight
            schedule (:mod:`lit_balance.plan.mixture_schedule`); None for fixed weights.
        carry: float64 ``[num_components]``: each component's deficit at the epoch's end (units its schedule asked
            of it minus those it got), carried into the next epoch; None for fixed weights.
    """

    plan: EpochPlan
    chosen: np.ndarray
    step_units: np.ndarray
    step_targets: np.ndarray | None = None
    carry: np.ndarray | None = None


def mixture_units(mixture: MixtureSettings, lengths: np.ndarray, supervised: np.ndarray | None) -> np.ndarray:
    """int64 ``[num_samples]``: each sample's units in the mixture's unit (``lengths - 1`` supervised tokens when
    ``supervised`` is None)."""
    if mixture.unit == "tokens":
        return np.asarray(lengths, dtype=np.int64)
    if mixture.unit == "documents":
        return np.ones(np.shape(lengths), dtype=np.int64)
    return (np.asarray(lengths, dtype=np.int64) - 1) if supervised is None else np.asarray(supervised, np.int64)


def select_epoch(units: np.ndarray, layout: MixtureLayout, mixture: MixtureSettings, *, seed: int, epoch: int,
                 eligible: np.ndarray | None = None) -> np.ndarray:
    """The samples one epoch reads (stage 1 of the module docstring).

    Args:
        units: int ``[num_samples]``: each sample's units (the mixture's unit), tiled over copies.
        layout: the sample space.
        mixture: the mixture settings.
        seed: base seed; with ``epoch`` and the component it seeds each component's subset.
        epoch: the epoch.
        eligible: bool ``[num_samples]`` of the samples that may be read (``too_long="skip"`` leaves some out), or
            None for all.

    Returns:
        bool ``[num_samples]``: the chosen samples.

    Raises:
        ValueError: a component of positive weight with no unit to read (empty, or every document skipped); with
            ``units_per_epoch``, a component that cannot give its share within ``max_repetition`` reads (naming it,
            its units and what is needed).
    """
    n = layout.num_documents
    offsets, shares = layout.offsets, mixture.shares
    first = np.asarray(units[:n], dtype=np.int64)
    ok = np.ones(n, dtype=bool) if eligible is None else np.asarray(eligible[:n], dtype=bool)
    totals = np.array([int(first[offsets[c]:offsets[c + 1]][ok[offsets[c]:offsets[c + 1]]].sum())
                       for c in range(len(shares))], dtype=np.int64)
    for c, name in enumerate(mixture.names):
        if shares[c] > 0 and totals[c] <= 0:
            raise InputValueError(f"component {name!r} has weight {mixture.weights[c]} but no {mixture.unit} to read "
                                  f"({int(layout.sizes[c])} documents, {int(totals[c])} {mixture.unit} after "
                                  "too_long); give it documents or set its weight to 0", parameter=f"{name}.weight")
    reps = mixture.max_repetition
    if mixture.units_per_epoch is None:
        length = min(reps * totals[c] / shares[c] for c in range(len(shares)) if shares[c] > 0)
    else:
        length = float(mixture.units_per_epoch)
        for c, name in enumerate(mixture.names):
            need = shares[c] * length
            if need > reps * totals[c] * (1 + 1e-12):
                raise InputValueError(
                    f"component {name!r} holds {int(totals[c])} {mixture.unit} but its share {shares[c]:.4g} of "
                    f"units_per_epoch={mixture.units_per_epoch} needs {need:.0f}, more than max_repetition={reps} "
                    f"reads give ({reps * int(totals[c])}); lower units_per_epoch or its weight, raise "
                    "max_repetition, or give it more documents", parameter="units_per_epoch")
    chosen = np.zeros(layout.num_samples, dtype=bool)
    for c in range(len(shares)):
        if shares[c] <= 0:
            continue
        docs = np.flatnonzero(ok[offsets[c]:offsets[c + 1]]) + offsets[c]
        target = shares[c] * length
        full = min(int(math.floor(target / totals[c] + 1e-9)), reps)
        for copy in range(full):
            chosen[copy * n + docs] = True
        rest = target - full * totals[c]
        if full < reps and rest > 0 and docs.size:
            rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), c, 0x6D6978]))
            order = docs[rng.permutation(docs.size)]
            cum = np.concatenate([[0], np.cumsum(first[order])])  # units of the first j documents
            j = min(int(np.searchsorted(cum, rest)), cum.size - 1)  # the fewest reaching rest; one fewer may be nearer
            if j > 0 and rest - cum[j - 1] <= cum[j] - rest:
                j -= 1
            chosen[full * n + order[:j]] = True
    return chosen


def _streams(chosen: np.ndarray, layout: MixtureLayout, num_components: int, padded: np.ndarray, by_length: bool,
             shuffle: bool, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Each component's chosen samples in stream order (stage 2): longest first (jittered with ``shuffle``) when
    ``by_length`` (a planner whose rows of similar length share a micro-batch), else in index (or random) order."""
    out = []
    n, offsets = layout.num_documents, layout.offsets
    for c in range(num_components):
        # the component's samples of every copy, in index order
        mine = np.concatenate([np.flatnonzero(chosen[copy * n + offsets[c]:copy * n + offsets[c + 1]])
                               + (copy * n + offsets[c]) for copy in range(layout.max_repetition)])
        if rng is not None:
            mine = mine[rng.permutation(mine.size)]
        if by_length and mine.size:
            key = padded[mine].astype(np.float64)
            if shuffle and rng is not None:
                key *= rng.uniform(1.0, 1.05, mine.size)  # jitter: batch-mates change between epochs
            mine = mine[_descending(key)]
        out.append(mine)
    return out


def _descending(key: np.ndarray) -> np.ndarray:
    """A stable order of ``key`` (float64, >= 0), largest first: keys to 16 bits (NumPy sorts those by radix, in
    linear time), exact for integers up to 65535, else to 1/65535 of the largest key."""
    top = float(key.max())
    if top <= 65535 and np.array_equal(key, np.floor(key)):
        q = top - key
    else:
        q = np.floor((1.0 - key / top) * 65535.0)
    return np.argsort(q.astype(np.uint16), kind="stable")


def plan_mixture(lengths: np.ndarray, layout: MixtureLayout, mixture: MixtureSettings, settings: BatchingSettings, *,
                 num_replicas: int, epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray | None = None,
                 supervised_lengths: np.ndarray | None = None, eligible: np.ndarray | None = None,
                 plan_exactly: np.ndarray | None = None, step_shares: Any = None) -> MixturePlan:
    """Plan one mixture epoch for all ranks (pure: the same inputs give the same plan on every rank).

    Every optimizer step ``g`` holds, of each component ``c``, units ``u_c`` with ``|u_c - s_c * U| <= B_g`` (``U``
    the step's units, ``s_c`` the component's share of the epoch's chosen units, ``B_g`` the step's boundary
    document: the longest document, in units, next to a component's cut at the step's start or end); in steps of
    at least 256k tokens also ``|u_c - s_c * U| <= 0.02 * U`` (unless one document alone is that long). Over the
    epoch each component has exactly its share ``s_c`` of the chosen units, which is within one document of its
    weight (:func:`select_epoch`).

    Args:
        lengths: int64 ``[num_samples]``: tokens per sample as planned (truncated), tiled over copies.
        layout: the sample space (:class:`MixtureLayout`).
        mixture: weights, unit and epoch length (:class:`MixtureSettings`).
        settings: the batching settings: budget (``max_tokens``, per rank when a list), ``accumulate_grad_batches``,
            packing, shuffle and seed, ``largest_first``, ``drop_last``. ``plan_window`` is not used: a mixture is
            planned step by step. A step of fewer documents than micro-batches gets fill rows, with ``drop_last``
            too where the micro-batches are formed together (every chosen document is read); the planner called per
            step (per-rank budgets, unequal speeds, static shapes) applies ``drop_last`` as for one corpus.
        num_replicas: data-parallel ranks.
        epoch: the epoch (seeds the selection, the streams and the order of steps).
        cost_model: the cost of a micro-batch.
        speeds: float64 ``[num_replicas]`` relative rank speeds, or None for equal ranks.
        supervised_lengths: int64 ``[num_samples]`` next-token targets per sample (``unit="supervised_tokens"``), or
            None (``lengths - 1``).
        eligible: bool ``[num_samples]`` of samples that may be read (None: all).
        plan_exactly: bool ``[num_samples]``: plan exactly these samples, without selection (the rest of an epoch
            resumed on new ranks), or None to select the epoch's samples.
        step_shares: a :class:`~lit_balance.plan.mixture_schedule.StepShares` (weights per optimizer step from a
            schedule, where the epoch starts in the run, the deficits carried in), or None for the mixture's fixed
            weights. Steps then keep their order (``shuffle`` shuffles the streams only).

    Returns:
        The :class:`MixturePlan`; every optimizer step has ``accumulate_grad_batches`` micro-steps of
        ``num_replicas`` micro-batches, each within the budget.

    Raises:
        RuntimeError: a step that does not fit its micro-batches although its fit test passed (a bug).
        ValueError: ``step_shares`` with ``largest_first`` (the steps of a schedule keep their order).
    """
    if step_shares is not None and settings.largest_first:
        raise InputValueError("largest_first=True moves the step of the longest document first, but a "
                              "weights_schedule plans every optimizer step with its own shares in order; set "
                              "largest_first=False or give fixed weights", parameter="largest_first")
    lengths = np.asarray(lengths, dtype=np.int64)
    units = mixture_units(mixture, lengths, supervised_lengths)
    seed, acc = int(settings.seed), settings.accumulate_grad_batches
    from lit_balance.plan import mixture_schedule as scheduled  # imports nothing from here

    if plan_exactly is None and step_shares is not None:
        chosen = scheduled.select_scheduled(
            units, layout, mixture, step_shares, seed=seed, epoch=epoch, eligible=eligible,
            tokens_per_step=float(np.sum(settings.rank_max_tokens(num_replicas))) * acc * _FILL_START["padded"],
            tokens_per_unit=float(lengths.sum()) / max(float(units.sum()), 1.0))
    elif plan_exactly is None:
        chosen = select_epoch(units, layout, mixture, seed=seed, epoch=epoch, eligible=eligible)
    else:
        chosen = np.asarray(plan_exactly, dtype=bool)
    k = len(mixture.names)
    padded = padded_lengths(lengths, settings.pad_to_multiple_of)
    from lit_balance.plan.epoch import planner_for  # the planners import nothing from here; epoch imports them

    planner = planner_for(settings)
    rng = np.random.default_rng(np.random.SeedSequence([seed, int(epoch), 0x737472])) if settings.shuffle else None
    streams = _streams(chosen, layout, k, padded, planner.row_buckets, settings.shuffle, rng)
    if not any(s.size for s in streams):
        return MixturePlan(empty_plan(num_replicas, acc), chosen, np.zeros((0, k), dtype=np.int64))
    if step_shares is None:
        walk = _Walk(streams, units, lengths)
    else:  # a walk merged again where the step's shares change, cut where the epoch ends
        n_docs, ok = layout.num_documents, np.ones(layout.num_documents, dtype=bool) if eligible is None else eligible
        longest = np.array([float(units[:n_docs][o:e][ok[:n_docs][o:e]].max(initial=0))
                            for o, e in zip(layout.offsets[:-1], layout.offsets[1:])])
        walk = scheduled.ScheduledWalk(_Walk, streams, step_shares, units, lengths, exact=plan_exactly is not None,
                                       longest=longest)
    step_settings = settings.replace(shuffle=False, largest_first=False)
    num_micro = num_replicas * acc
    speeds = np.ones(num_replicas) if speeds is None else np.asarray(speeds, dtype=np.float64)
    # micro-batches of all steps at once (the planner's batch_steps) with equal rank speeds, where the planner can
    fast = bool(np.all(speeds == speeds[0])) and planner.steps_together(settings)
    key = planner.step_key(lengths, settings) if fast else None
    capacity = float(np.sum(settings.rank_max_tokens(num_replicas))) * acc  # token slots of a step
    fill = _FILL_START.get(planner.name, _FILL_START["padded"])
    # one micro-batch per rank and step: each is all a rank runs in its step, so a step is sized to the micro-batch
    # of its longest document and filled to its room (with accumulation, a rank's micro-batches even each other out)
    single = fast and acc == 1
    # rows of similar length share a micro-batch: each component's documents in a step are rounded to whole
    # micro-batches where the share bound allows (a few components: every rounding is tried); under a weight schedule
    # the walk is merged again where the shares change, and steps are not rounded
    whole = fast and planner.row_buckets and 1 < k <= _WHOLE_COMPONENTS and step_shares is None
    steps: list[tuple[int, int, EpochPlan | None]] = []  # (start, end, plan or None: batched below)
    sorted_members: list[np.ndarray] = []
    budgets: list[int] = []  # of the steps batched together: each micro-batch's budget
    unit_rows: list[np.ndarray] = []  # each step's units per component
    a, n = 0, walk.size
    while a < n:
        if step_shares is not None:  # the step's shares: the walk merged again where they change; or the epoch ends
            n = walk.begin_step(a, len(steps), capacity * fill)
            if a >= n:
                break
        budget, room, shrunk = settings.max_tokens, capacity, 0
        while True:
            b = walk.end(a, walk.within(a, fill * room))
            later = walk.defer(a, b, fill * room) if single else b  # a next document too large: smaller first
            if later > b:
                b = walk.end(a, later)
            members = walk.merged[a:b]
            if fast:  # fewer documents than micro-batches: one each (_parts), which fits
                values = key[members]
                least = planner.step_budget(int(values.max()), settings)
                if least < budget and shrunk < _BUDGET_TRIES:
                    # the micro-batch of the step's longest document costs at most `least`: the step's room is
                    # what every rank can hold alongside it, and a smaller step is formed
                    budget, shrunk = least, shrunk + 1
                    room = float(num_micro) * budget
                    continue
                fits = b - a < num_micro or planner.step_fits(values, num_micro, settings, budget)
                plan = None
            else:
                plan = planner.plan(lengths[members], np.arange(members.size, dtype=np.int64), step_settings,
                                    num_replicas=num_replicas, epoch=epoch, cost_model=cost_model, speeds=speeds,
                                    num_batches=num_micro, min_steps=acc)
                fits = plan.num_micro_steps <= acc
            if fits:
                break
            if b - a <= 1:  # cannot happen: every sample fits one micro-batch
                raise RuntimeError(f"a single sample of {int(lengths[members].sum())} tokens does not fit one "
                                   "micro-batch")
            fill = min(fill, walk.tokens(a, b) / room) * _FILL_SHRINK
        fill = min(fill * _FILL_GROW, 1.0)
        if plan is None and b - a >= num_micro and single:
            b = _grow(walk, a, b, room, key, planner, settings, num_micro, budget)
        if plan is None and whole:
            b = _whole(walk, a, b, key, planner, settings, num_micro, budget)
        if plan is None:
            members = walk.merged[a:b]
            values = key[members]
        steps.append((a, b, plan))
        unit_rows.append(walk.units(a, b))
        if plan is None:
            sorted_members.append(members[np.argsort(-values, kind="stable")])
            budgets.append(budget)
        a = b
    if not steps:  # a schedule whose components ran out before the epoch's first step
        _, carry = walk.finish(0)
        return MixturePlan(empty_plan(num_replicas, acc), np.zeros_like(chosen), np.zeros((0, k), dtype=np.int64),
                           np.zeros((0, k)), carry)
    parts = _parts(steps, sorted_members, budgets, walk, lengths, settings, num_replicas, cost_model, planner)
    step_units = np.stack(unit_rows).astype(np.int64)
    order = np.arange(len(parts))
    targets = carry = None
    if step_shares is not None:  # the steps of a schedule keep their order; the epoch holds what they planned
        order_walked, carry = walk.finish(a)
        chosen = np.zeros_like(chosen)
        chosen[order_walked] = True
        targets = np.stack(walk.targets)
    if settings.shuffle and step_shares is None:
        order = np.random.default_rng(np.random.SeedSequence([seed, int(epoch), 0x6F7264])).permutation(len(parts))
    if settings.largest_first:
        longest = int(np.argmax([int(lengths[p[0]].max()) for p in parts]))
        order = np.concatenate([[longest], order[order != longest]])
    short = np.array([parts[i][3].shape[0] < acc for i in order], dtype=bool)
    order = np.concatenate([order[~short], order[short]])  # a step of fewer micro-steps (the rest) runs last
    plan = _concat([parts[i] for i in order], num_replicas, acc)
    if not settings.per_rank and bool(np.all(speeds == speeds[0])):
        plan = _even_epoch(plan, lengths, planner, settings, cost_model)
    return MixturePlan(plan, chosen, step_units[order], None if targets is None else targets[order], carry)


def _even_epoch(plan: EpochPlan, lengths: np.ndarray, planner: Any, settings: BatchingSettings,
                cost_model: CostModelProtocol) -> EpochPlan:
    """``plan`` with each optimizer step's ranks permuted so that the epoch's cost per rank is even: step by step,
    the rank that has cost least so far takes the step's costliest share of cost (LPT over the epoch; every rank has
    the same budget and speed, so any rank may run any share). Each step's shares of cost are unchanged."""
    cost, _ = planner.batch_costs(lengths, plan.rows, plan.batch_offsets, settings.pad_to_multiple_of, cost_model)
    acc, old = plan.accumulate_grad_batches, plan.assignment
    num_micro_steps, num_replicas = old.shape
    steps = -(-num_micro_steps // acc)
    step_of = np.arange(num_micro_steps) // acc
    per_micro = np.zeros((steps * acc, num_replicas))
    per_micro[:num_micro_steps] = cost[old]
    share = per_micro.reshape(steps, acc, num_replicas).sum(axis=1)  # each step's cost per rank, as planned
    costliest = np.argsort(-share, axis=1, kind="stable")  # [steps, num_replicas]: the places of the order
    ordered = np.take_along_axis(share, costliest, axis=1).tolist()
    target = []
    load = [0.0] * num_replicas
    places = range(num_replicas)
    for g in range(steps):  # plain Python: a few ranks a step, thousands of steps
        least = sorted(places, key=load.__getitem__)
        target.append(least)
        for rank, c in zip(least, ordered[g]):
            load[rank] += c
    target = np.asarray(target, dtype=np.int64).reshape(steps, num_replicas)
    new = np.empty_like(old)
    rows = np.arange(num_micro_steps)[:, None]
    new[rows, target[step_of]] = old[rows, costliest[step_of]]
    return dataclasses.replace(plan, assignment=new)


def _whole(walk: _Walk, a: int, b: int, key: np.ndarray, planner: Any, settings: BatchingSettings, num_micro: int,
           budget: int) -> int:
    """The end of the step from ``a`` (formed as ``a:b``) with each component's documents rounded to whole
    micro-batches where the step's bounds allow, the walk regrouped to it; ``b`` when no rounding fits better.

    A component's documents from its cut at ``a``, in stream order (longest first), make full micro-batches of
    ``budget`` slots (as many rows as the first, longest, allows). The step ``a:b`` ends part-way through one of
    each component's micro-batches; left so, each such part-filled micro-batch holds its rank for less than the
    others (or pads shorter rows to its length). Every choice of, per component, one micro-batch fewer, the
    micro-batch boundary before ``b``, the count at ``b`` itself, or the boundary after ``b`` is tried at once; of those
    that need at most ``num_micro`` micro-batches, keep the step's bounds (:meth:`_Walk.end`'s rules, at the new
    cuts) and leave every component's error within the boundary document (the next step, formed on the walk, must
    reach its shares from there), the one of most tokens is kept (on a tie, the fewest part-filled micro-batches),
    if it holds at least the tokens of ``a:b`` and fits (:meth:`~lit_balance.plan.epoch.Planner.step_fits`).
    """
    k = walk.count.shape[1]
    row_cap = settings.max_batch_size if settings.max_batch_size is not None else settings.max_tokens
    start = walk.count[a].tolist()
    at_b = walk.count[b].tolist()
    stream_keys = walk.stream_keys(key)
    options, chunks = [], []  # per component: counts at four candidate cuts (stream positions); micro-batches each
    for c in range(k):
        # micro-batches from the component's cut at a, in stream order, up to its count at b: each holds as many rows
        # as its first document allows, then as many as the longest of those allows (streams are longest first only
        # up to the shuffle's jitter); documents past the first after b are not looked at
        p, q, size = start[c], at_b[c], walk.stream_sizes[c]
        n = min(size, q + 1) - p
        w = stream_keys[c][p:p + n].tolist()
        last = size - p
        bounds = [p]
        pos = 0
        while pos < n:
            v = w[pos]
            rows = budget // v if v else 0
            rows = row_cap if rows > row_cap else (rows if rows > 1 else 1)
            if rows > 1:
                longest = max(w[pos:pos + rows])  # (a slice past n ends at n)
                if longest != v:
                    rows = budget // longest
                    rows = row_cap if rows > row_cap else (rows if rows > 1 else 1)
            pos = pos + rows if pos + rows < last else last
            bounds.append(p + pos)
        i = len(bounds) - 1 if bounds[-1] <= q else len(bounds) - 2  # bounds[i] <= q < bounds[i + 1] (or the end)
        below = bounds[i - 1] if i >= 1 else bounds[i]
        after = bounds[i + 1] if i + 1 < len(bounds) else bounds[i]
        options.append((below, bounds[i], q, after))
        chunks.append((max(i - 1, 0), i, i + (q > bounds[i]), i + (after > bounds[i])))
    grid = _grid(k)  # flat indices into [k, 4]: every choice of one of four options per component
    options = np.array(options, dtype=np.int64)
    counts = options.reshape(-1)[grid]  # [4**k, k]
    need = np.array(chunks, dtype=np.int64).reshape(-1)[grid].sum(axis=1)
    at4 = options + walk.starts[:, None]
    units = walk.cum[at4].reshape(-1)[grid]
    x = units.sum(axis=1)
    begin = np.array(start, dtype=np.int64) + walk.starts
    tokens = walk.cum_tokens[at4].reshape(-1)[grid].sum(axis=1) - float(walk.cum_tokens[begin].sum())
    d = walk.shares * x[:, None] - units
    edge = walk.adjacent[at4].reshape(-1)[grid].max(axis=1)
    da, ea = walk._error_at(a)
    dev = np.abs(d - np.array(da)).max(axis=1)
    reach = np.maximum(edge, ea)
    ok = need <= num_micro
    ok &= counts.sum(axis=1) > sum(start)  # not every component at its cut (no count is below it)
    ok &= dev <= reach * (1 + 1e-12) + 1e-9
    ok &= np.abs(d).max(axis=1) <= reach  # the next step starts from these errors: within reach
    big = tokens >= _BIG_STEP_TOKENS
    ok &= ~big | (dev <= _BIG_STEP_SHARE * (x - float(walk.x[a])) + 1e-9)
    if not ok.any():
        return b
    score = np.where(ok, tokens, -np.inf)
    best = np.flatnonzero(score >= score.max() - 1e-9)
    if best.size == 1:
        choice = counts[best[0]]
    else:  # on a tie, the fewest part-filled micro-batches
        partial = (counts[best] != options[:, 1]).sum(axis=1) - (counts[best] == options[:, 0]).sum(axis=1)
        choice = counts[best[np.argmin(partial)]]
    if tokens[best[0]] < walk.tokens(a, b) or choice.tolist() == at_b:
        return b
    members = np.concatenate([stream_keys[c][start[c]:choice[c]] for c in range(k)])
    if not planner.step_fits(members, num_micro, settings, budget):
        return b
    end = walk.regroup(a, b, choice - np.array(start, dtype=np.int64))
    return b if end is None else end


@functools.lru_cache(maxsize=None)
def _grid(k: int) -> np.ndarray:
    """int64 ``[4**k, k]``: every choice of one of four options per component, as flat indices into a ``[k, 4]``
    array of per-component options."""
    choice = np.stack(np.meshgrid(*[np.arange(4)] * k, indexing="ij"), axis=-1).reshape(-1, k)
    return choice + 4 * np.arange(k)


def _grow(walk: _Walk, a: int, b: int, room: float, key: np.ndarray, planner: Any, settings: BatchingSettings,
          num_micro: int, budget: int) -> int:
    """The end of a larger step from ``a`` where one fits: steps of :data:`_GROW` more of the room than ``a:b``
    holds are tried (each within its bounds, a next document that does not fit passed over), the largest that fits
    its micro-batches kept; ``b`` when none does."""
    for extra in _GROW:
        have = walk.tokens(a, b) / room
        if have >= 1.0 - _GROW[-1]:
            break
        target = min(1.0, have + extra) * room
        b2 = walk.end(a, walk.within(a, target))
        if b2 < b:
            continue
        later = walk.defer(a, b2, target)  # moves documents after b2 only: the step a:b stays
        if later > b2:
            b2 = walk.end(a, later)
        if b2 <= b:
            continue
        values = key[walk.merged[a:b2]]
        if planner.step_budget(int(values.max()), settings) < budget:
            continue  # a longer document that would hold the ranks longer
        if planner.step_fits(values, num_micro, settings, budget):
            b = b2
    return b


class _Walk:
    """The components' streams merged into one walk, and each prefix's errors against the shares.

    Document ``j`` of component ``c`` is placed at its midpoint tag ``(U_c(j) + u_cj / 2) / s_c`` (``U_c(j)`` the
    units before it in its stream, ``s_c`` the component's share of the chosen units): every prefix of the walk
    then holds, of each component, the documents whose quota boundary at the prefix's tag is nearest (the
    cumulative quotas of proportional apportionment), and each stream keeps its order. ``D_c(p) = s_c * X(p) -
    U_c(p)`` is a prefix's error (``X(p)`` its units): a step from prefix ``a`` to ``b`` holds
    ``u_c = s_c * U + D_c(a) - D_c(b)``.
    """

    def __init__(self, streams: Sequence[np.ndarray], units: np.ndarray, lengths: np.ndarray,
                 shares: np.ndarray | None = None, carry: np.ndarray | None = None) -> None:
        per = [units[s].astype(np.float64) for s in streams]
        totals = np.array([u.sum() for u in per])
        grand = float(totals.sum())
        self.shares = totals / grand if grand > 0 else np.zeros(len(per))
        if shares is not None:  # a step's scheduled shares, from deficits carried in (lit_balance.plan.mixture_schedule)
            self.shares = np.asarray(shares, dtype=np.float64)
        self.carry = None if carry is None else np.asarray(carry, dtype=np.float64)
        tags = []
        for c, u in enumerate(per):
            if self.shares[c] > 0:
                due = np.cumsum(u) - 0.5 * u
                tags.append((due if self.carry is None else due - self.carry[c]) / self.shares[c])
            else:  # no units: spread evenly over the walk
                tags.append((np.arange(u.size) + 0.5) * (max(grand, 1.0) / max(u.size, 1)))
        order = np.argsort(np.concatenate(tags), kind="stable")  # k sorted runs: a merge; ties by component
        self.tags = None if shares is None else np.concatenate(tags)[order]  # a schedule's walk cuts by them
        # gathers from the streams' own arrays (each read in order) rather than from the samples at random
        self.merged = np.concatenate(streams)[order]
        self.comp = np.repeat(np.arange(len(per), dtype=np.int8 if len(per) < 128 else np.int64),
                              [u.size for u in per])[order]
        self.size = int(self.merged.size)
        merged_units = np.concatenate(per)[order]
        merged_tokens = merged_units if units is lengths else np.concatenate([lengths[s] for s in streams])[order]
        self.x = np.concatenate([[0.0], np.cumsum(merged_units, dtype=np.float64)])
        self.t = np.concatenate([[0], np.cumsum(merged_tokens, dtype=np.int64)])
        self._units, self._tokens = merged_units, merged_tokens  # per position (moved by defer)
        k = len(per)
        self.count = np.zeros((self.size + 1, k), dtype=np.int32 if self.size < 2**31 else np.int64, order="F")
        for c in range(k):  # documents of each component in each prefix (a column each: contiguous)
            np.cumsum(self.comp == c, out=self.count[1:, c])
        starts = np.concatenate([[0], np.cumsum([u.size + 1 for u in per])[:-1]])
        self.cum = np.concatenate([np.concatenate([[0.0], np.cumsum(u)]) for u in per])  # stream c at starts[c]
        # the larger of the documents on either side of a cut after j documents of a stream
        self.adjacent = np.concatenate([np.maximum(np.concatenate([[0.0], u]), np.concatenate([u, [0.0]]))
                                        for u in per])
        self.starts = starts.astype(np.int64)
        self.streams = list(streams)
        self.cum_tokens = self.cum if units is lengths else np.concatenate(
            [np.concatenate([[0.0], np.cumsum(lengths[s].astype(np.float64))]) for s in streams])
        self.stream_sizes = [u.size for u in per]
        self._last: tuple = (-1, None, None)  # the last end found, and its errors (the next step's start)
        self._keys: tuple = (None, None)  # a per-sample key and its values in each stream's order
        self._starts, self._shares = self.starts.tolist(), self.shares.tolist()  # for the errors of one prefix
        self._carry = None if self.carry is None else self.carry.tolist()

    def stream_keys(self, key: np.ndarray) -> list[np.ndarray]:
        """``key`` (``[num_samples]``) of each stream's documents in stream order (gathered once per ``key``)."""
        if self._keys[0] is not key:
            self._keys = (key, [key[s] for s in self.streams])
        return self._keys[1]

    def deficits(self, p: int) -> np.ndarray:
        """float64 ``[k]``: each component's error ``D_c(p)`` at prefix ``p`` (its carried deficit included)."""
        return self._errors(np.array([p]))[0][0]

    def cut(self, p: int) -> None:
        """End the walk at prefix ``p`` (the epoch ends there)."""
        self.size = int(p)

    def defer(self, a: int, b: int, tokens: float) -> int:
        """Let the step from ``a`` fill up to ``tokens`` past a next document that does not fit: when the document
        at position ``b`` would take the step over ``tokens``, it moves later in the walk, past the documents of other
        components after it that fit the room left (never past one of its own component, so every stream keeps its
        order), and the step may end after those. Returns the last prefix the step may end at (``b`` when nothing
        moves); :meth:`end` then keeps the step's bounds as for any prefix.
        """
        if b >= self.size or self.t[b + 1] - self.t[a] <= tokens:
            return b
        room = int(self.t[a]) + int(math.floor(tokens)) - int(self.t[b])
        hi = min(self.size, b + 1 + _DEFER_LOOK)
        own = np.flatnonzero(self.comp[b + 1:hi] == self.comp[b])
        stop = int(own[0]) if own.size else hi - b - 1
        k = int(np.searchsorted(np.cumsum(self._tokens[b + 1:b + 1 + stop]), room, side="right"))
        if k == 0:
            return b
        if self._last[0] > b:  # the errors kept of a prefix past the move are stale
            self._last = (-1, None, None)
        if self._tokens is self._units:  # one array for both (units are tokens): moved once below
            self._tokens = self._units.copy()
        idx = np.concatenate([np.arange(b + 1, b + k + 1), [b]])
        for array in (self.merged, self.comp, self._units, self._tokens):
            array[b:b + k + 1] = array[idx]
        self.x[b + 1:b + k + 2] = self.x[b] + np.cumsum(self._units[b:b + k + 1])
        self.t[b + 1:b + k + 2] = self.t[b] + np.cumsum(self._tokens[b:b + k + 1])
        onehot = self.comp[b:b + k + 1][:, None] == np.arange(self.count.shape[1])
        self.count[b + 1:b + k + 2] = self.count[b] + np.cumsum(onehot, axis=0)
        return b + k

    def regroup(self, a: int, b: int, counts: np.ndarray) -> int | None:
        """Make the step from ``a`` hold exactly ``counts[c]`` documents of each component ``c`` (int64 ``[k]``; the
        step ``a:b`` holds others): the last documents of a component beyond its count move after the step, and the
        next documents of a component short of its count (found within :data:`_DEFER_LOOK` positions after ``b``) move
        into it; everything else keeps its place and every stream its order. Returns the step's new end, or None
        (nothing moved) when a document to move in is not within reach."""
        have = self.count[b].astype(np.int64) - self.count[a]
        need = np.asarray(counts, dtype=np.int64)
        e = b
        for c in np.flatnonzero(need > have):
            extra = int(need[c] - have[c])
            pos = np.flatnonzero(self.comp[b:min(self.size, b + _DEFER_LOOK)] == c)
            if pos.size < extra:
                return None
            e = max(e, b + int(pos[extra - 1]) + 1)
        comp = self.comp[a:e].astype(np.int64)
        occurrence = np.empty(e - a, dtype=np.int64)  # each position's rank within its component in the segment
        for c in range(need.size):
            mine = np.flatnonzero(comp == c)
            occurrence[mine] = np.arange(mine.size)
        inside = occurrence < need[comp]
        idx = a + np.concatenate([np.flatnonzero(inside), np.flatnonzero(~inside)])
        if self._tokens is self._units:
            self._tokens = self._units.copy()
        for array in (self.merged, self.comp, self._units, self._tokens):
            array[a:e] = array[idx]
        self.x[a + 1:e + 1] = self.x[a] + np.cumsum(self._units[a:e])
        self.t[a + 1:e + 1] = self.t[a] + np.cumsum(self._tokens[a:e])
        onehot = self.comp[a:e][:, None] == np.arange(self.count.shape[1])
        self.count[a + 1:e + 1] = self.count[a] + np.cumsum(onehot, axis=0)
        self._last = (-1, None, None)
        return a + int(need.sum())

    def tokens(self, a: int, b: int) -> int:
        """Tokens of the walk's positions ``a:b``."""
        return int(self.t[b] - self.t[a])

    def units(self, a: int, b: int) -> np.ndarray:
        """float64 ``[k]``: each component's units in positions ``a:b``."""
        return self.cum[self.count[b] + self.starts] - self.cum[self.count[a] + self.starts]

    def within(self, a: int, tokens: float) -> int:
        """The last prefix after ``a`` whose tokens from ``a`` are at most ``tokens`` (at least ``a + 1``)."""
        limit = np.int64(int(self.t[a]) + int(math.floor(tokens)))  # an int: a float would convert the array
        return min(max(int(np.searchsorted(self.t, limit, side="right")) - 1, a + 1), self.size)

    def _errors(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(D [len(p), k], boundary document [len(p)])`` at prefixes ``p``."""
        at = self.count[p] + self.starts
        d = self.shares * self.x[p][:, None] - self.cum[at]
        return (d if self.carry is None else d + self.carry), self.adjacent[at].max(axis=1)

    def _error_at(self, p: int) -> tuple[list[float], float]:
        """``(D [k], boundary document)`` at prefix ``p`` as Python floats: :meth:`_errors` of one prefix, without
        array calls (the same float operations, so the same values)."""
        x = float(self.x[p])
        cum, adjacent = self.cum, self.adjacent
        at = [n + s for n, s in zip(self.count[p].tolist(), self._starts)]
        d = [s * x - float(cum[i]) for s, i in zip(self._shares, at)]
        if self._carry is not None:
            d = [v + c for v, c in zip(d, self._carry)]
        return d, max(float(adjacent[i]) for i in at)

    def end(self, a: int, last: int) -> int:
        """The last prefix in ``a + 1 .. last`` that keeps the step's bounds (``a + 1`` always does: one document
        ``l`` moves each error by at most ``l``)."""
        if self._last[0] == a:
            da, ea = self._last[1], self._last[2]
        else:
            da, ea = self._error_at(a)
        # `last` first (one prefix, in plain floats), then the few before it: one of them nearly always keeps the bounds
        d, edge = self._error_at(last)
        dev = max(abs(v - w) for v, w in zip(d, da))
        ok = dev <= max(edge, ea) * (1 + 1e-12) + 1e-9
        if ok and int(self.t[last]) - int(self.t[a]) >= _BIG_STEP_TOKENS:
            ok = dev <= _BIG_STEP_SHARE * (float(self.x[last]) - float(self.x[a])) + 1e-9
        if ok:
            self._last = (last, d, edge)
            return last
        if last == a + 1:
            self._last = (-1, None, None)
            return a + 1
        first, last = max(a + 1, last - 64), last - 1
        da = np.array(da)
        while True:
            p = np.arange(first, last + 1)
            d, edge = self._errors(p)
            dev = np.abs(d - da).max(axis=1)
            ok = dev <= np.maximum(edge, ea) * (1 + 1e-12) + 1e-9
            big = self.t[p] - self.t[a] >= _BIG_STEP_TOKENS
            ok &= ~big | (dev <= _BIG_STEP_SHARE * (self.x[p] - self.x[a]) + 1e-9)
            good = np.flatnonzero(ok)
            if good.size:
                j = good[-1]
                self._last = (int(p[j]), d[j].tolist(), float(edge[j]))
                return int(p[j])
            if first == a + 1:
                self._last = (-1, None, None)
                return a + 1
            first, last = max(a + 1, first - max(64, 4 * (last + 1 - first))), first - 1

def _parts(steps: Sequence[tuple[int, int, EpochPlan | None]], sorted_members: Sequence[np.ndarray],
           budgets: Sequence[int], walk: _Walk,
           lengths: np.ndarray, settings: BatchingSettings, num_replicas: int, cost_model: CostModelProtocol,
           planner: Any) -> list[tuple[np.ndarray, ...]]:
    """Per step ``(rows, is_fill, offsets, assignment, dropped)`` with sample indices; the steps without a plan
    batched together (the planner's ``batch_steps``)."""
    acc = settings.accumulate_grad_batches
    num_micro = num_replicas * acc
    batched: list[tuple[np.ndarray, ...]] = []
    empty = np.empty(0, dtype=np.int64)
    few = [m for m in sorted_members if m.size < num_micro]
    many = [m for m in sorted_members if m.size >= num_micro]
    if many:
        members = np.concatenate(many)
        bounds = np.concatenate([[0], np.cumsum([m.size for m in many])]).astype(np.int64)
        step_budgets = np.array([u for m, u in zip(sorted_members, budgets) if m.size >= num_micro], dtype=np.int64)
        rows, sizes, assignment = planner.batch_steps(members, bounds, lengths, settings, num_replicas=num_replicas,
                                                      cost_model=cost_model, budgets=step_budgets)
        offsets = np.concatenate([np.zeros((sizes.shape[0], 1), dtype=np.int64), np.cumsum(sizes, axis=1)], axis=1)
        flat = assignment.reshape(assignment.shape[0], acc, num_replicas)
        for s in range(sizes.shape[0]):
            r = rows[bounds[s]:bounds[s + 1]]
            batched.append((r, np.zeros(r.size, dtype=bool), offsets[s], flat[s], empty))
    spread = np.arange(num_micro).reshape(acc, num_replicas)
    out, it, it_few = [], iter(batched), iter(few)
    for a, b, plan in steps:
        if plan is None and b - a < num_micro:  # one document per micro-batch, then fill rows (duplicates)
            m = next(it_few)
            rows = np.concatenate([m, m[np.arange(num_micro - m.size) % m.size]])
            out.append((rows, np.arange(num_micro) >= m.size, np.arange(num_micro + 1), spread, empty))
        elif plan is None:
            out.append(next(it))
        else:
            members = walk.merged[a:b]
            out.append((members[plan.rows], plan.is_fill, plan.batch_offsets, plan.assignment,
                        members[plan.dropped]))
    return out


def _concat(parts: Sequence[tuple[np.ndarray, ...]], num_replicas: int, acc: int) -> EpochPlan:
    """One epoch plan of the steps' ``(rows, is_fill, offsets, assignment, dropped)``, in order."""
    rows, fill, offsets, assignment, dropped = [], [], [np.zeros(1, dtype=np.int64)], [], []
    row_base = batch_base = 0
    for r, is_fill, off, assign, drop in parts:
        rows.append(r)
        fill.append(is_fill)
        offsets.append(off[1:] + row_base)
        assignment.append(assign + batch_base)
        dropped.append(drop)
        row_base += r.size
        batch_base += off.size - 1
    return EpochPlan(rows=np.concatenate(rows).astype(np.int64), is_fill=np.concatenate(fill),
                     batch_offsets=np.concatenate(offsets).astype(np.int64),
                     assignment=np.concatenate(assignment).astype(np.int64).reshape(-1, num_replicas),
                     dropped=np.concatenate(dropped).astype(np.int64), accumulate_grad_batches=acc)
