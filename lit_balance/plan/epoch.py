"""One epoch's plan for all ranks: the arguments checked, then the planner the settings choose.

A planner turns the lengths of the samples to plan into an :class:`~lit_balance.plan.types.EpochPlan`. Two ship:
:class:`~lit_balance.plan.padded.PaddedPlanner` (rows padded to the longest of their micro-batch, the default) and
:class:`~lit_balance.plan.packed.PackedPlanner` (``BatchingSettings(packing=True)``: whole documents in one row).
:func:`planner_for` is the one place that chooses between them; everything that depends on the layout of a
micro-batch (the plan, a window's count, a micro-batch's cost, slots and shape, the unit a cost counts, the probe's
worst case, the collator's options, a mixture step's fit test and micro-batches) asks the planner, and only
:func:`planner_for` reads ``BatchingSettings.packing``: a new layout is a planner class and a line there.
With a budget per rank (``max_tokens`` a list), the planner chosen is wrapped in
:class:`~lit_balance.plan.budgets.PerRankPlanner`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from lit_balance._checks import check_int, check_lengths, check_speeds
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.budgets import PerRankPlanner
from lit_balance.plan.cost import CostModelProtocol, check_cost_model
from lit_balance.plan.packed import PackedPlanner
from lit_balance.plan.padded import PaddedPlanner
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.shapes import resolve_static_shapes, static_planner
from lit_balance.plan.types import EpochPlan, WorstCaseBatch

__all__ = ["PLANNERS", "Planner", "plan_epoch", "planner_for", "too_long"]


def too_long(lengths: np.ndarray, max_tokens: int, pad_to_multiple_of: int = 1) -> np.ndarray:
    """bool ``[num_samples]``: the samples too long for the budget, the one rule that the sampler's ``too_long``
    setting, the DataModule's corpus check and the planner's own check apply.

    A length (tokens) is too long when, padded up to a multiple of ``pad_to_multiple_of``, it exceeds ``max_tokens``
    padded token slots: exactly when it exceeds ``(max_tokens // pad_to_multiple_of) * pad_to_multiple_of``
    (:attr:`BatchingSettings.truncate_to`, where ``too_long="truncate"`` cuts). With per-rank budgets, pass the
    largest: such a sample is planned on a rank that holds it. The lengths are compared as they are (an int32 memory
    map is not copied).

    Example:
        >>> too_long(np.array([7, 8, 9, 16]), max_tokens=10, pad_to_multiple_of=4).tolist()
        [False, False, True, True]
    """
    return np.asarray(lengths) > (max_tokens // pad_to_multiple_of) * pad_to_multiple_of


class Planner(Protocol):
    """How micro-batches are laid out and planned: what every layout-dependent step asks.

    Attributes:
        name: ``"padded"`` or ``"packed"`` (the key in :data:`PLANNERS`).
        cost_unit: what the default :class:`~lit_balance.CostModel` counts under it (``"padded slots"``, ``"tokens"``).
        row_buckets: rows of similar length share a micro-batch, so length buckets describe its plans (reports show
            their edges).
        packed_rows: a micro-batch is one row of whole documents (:class:`~lit_balance.PackedCollator`), else rows
            padded to a common length (:class:`~lit_balance.PadCollator`).
    """

    name: str
    cost_unit: str
    row_buckets: bool
    packed_rows: bool

    def plan(self, lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
             epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
             num_batches: int | None = None) -> EpochPlan:
        """The plan of ``candidates`` (indices into int64 ``lengths``), arguments already checked."""

    def count_steps(self, lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings,
                    num_replicas: int, min_steps: int,
                    cost_model: CostModelProtocol) -> tuple[int, int, int | None]:
        """``(micro-steps, min_steps to plan with, num_batches to plan with or None)`` of a window's plan with equal
        rank speeds: the same for every epoch."""

    def batch_costs(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                    cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
        """``(cost, slots)``: float64 and int64 ``[num_batches]``, each micro-batch's cost and token slots."""

    def worst_case_batch(self, settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The largest micro-batch of ``length``-token rows (documents, packed) this planner may form within ``budget``
        padded token slots, as the token budget probe builds it; None when not one row fits."""

    def collator_options(self, settings: BatchingSettings) -> dict[str, Any]:
        """Keyword arguments of the collator of this planner's micro-batches beyond ``pad_to_multiple_of`` (static
        shapes); :func:`lit_balance.data.collate.collator_for` builds the collator from them and
        :attr:`packed_rows`."""

    def micro_batch_shapes(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                           settings: BatchingSettings) -> tuple[list[tuple[int, int]], list[str]]:
        """``(shapes, keys)`` of each non-empty micro-batch as collated: ``(rows, tokens)`` and a key naming what a
        compiled graph sees (:func:`~lit_balance.plan.shapes.epoch_shapes`)."""

    def real_token_fraction_bound(self, lengths: np.ndarray) -> float | None:
        """The most real-token fraction micro-batches of samples of ``lengths`` (int ``[n]``, the planned,
        non-fill samples) can have in this layout's shapes, or None where the layout has no fixed shapes."""

    def steps_together(self, settings: BatchingSettings) -> bool:
        """Whether :meth:`batch_steps` forms the micro-batches of a mixture's steps under ``settings`` at once
        (:mod:`lit_balance.plan.mixture`); False: each step is planned by :meth:`plan`."""

    def step_key(self, lengths: np.ndarray, settings: BatchingSettings) -> np.ndarray:
        """int64 ``[n]``: what a step's fit test and order read per document (padded lengths; packed: tokens)."""

    def step_budget(self, longest: int, settings: BatchingSettings) -> int:
        """The token slots of the costliest micro-batch a mixture step whose longest document (:meth:`step_key`) is
        ``longest`` can hold (padded: as many rows of that length as the budget holds; packed: ``max_tokens``); with
        one micro-batch per rank and step, the step is sized and cut to it."""

    def step_fits(self, key: np.ndarray, num_micro: int, settings: BatchingSettings, budget: int | None = None) -> bool:
        """The fast fit test of a mixture step: whether documents of ``key`` (:meth:`step_key`) fit ``num_micro``
        micro-batches of :meth:`batch_steps` of ``budget`` slots (None: ``max_tokens``; exact or sufficient)."""

    def batch_steps(self, members: np.ndarray, bounds: np.ndarray, lengths: np.ndarray, settings: BatchingSettings,
                    *, num_replicas: int, cost_model: CostModelProtocol,
                    budgets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, batch_sizes, assignment)`` of many mixture steps at once, step ``s`` cut under ``budgets[s]``
        slots (None: ``max_tokens``; :func:`~lit_balance.plan.mixture_batches.batch_padded_steps` describes the
        arrays)."""


_PADDED, _PACKED = PaddedPlanner(), PackedPlanner()
#: The planners by name.
PLANNERS: dict[str, Planner] = {_PADDED.name: _PADDED, _PACKED.name: _PACKED}


def planner_for(settings: BatchingSettings) -> Planner:
    """The planner ``settings`` choose: packed with ``packing=True``, else padded; with per-rank ``max_tokens`` (a
    list), that planner wrapped in :class:`~lit_balance.plan.budgets.PerRankPlanner` (its ``name`` is the wrapped
    planner's); with static shapes (``static_packing``, ``padded_shapes``), the planner of those shapes
    (:func:`lit_balance.plan.shapes.static_planner`; the shapes must have been chosen:
    :func:`~lit_balance.plan.shapes.resolve_static_shapes`).

    Example:
        >>> planner_for(BatchingSettings(max_tokens=64, packing=True)).name
        'packed'
    """
    if not isinstance(settings, BatchingSettings):
        raise InputTypeError(f"settings must be a lit_balance.BatchingSettings, got {type(settings).__name__}",
                             parameter="settings")
    static = static_planner(settings)
    if static is not None:
        return static
    planner = _PACKED if settings.packing else _PADDED
    return PerRankPlanner(planner) if settings.per_rank else planner


def plan_epoch(
    lengths: np.ndarray,
    settings: BatchingSettings,
    *,
    num_replicas: int,
    epoch: int,
    eligible: np.ndarray | None = None,
    cost_model: CostModelProtocol | None = None,
    rank_speeds: np.ndarray | None = None,
    min_steps: int = 0,
    num_batches: int | None = None,
) -> EpochPlan:
    """Plan one epoch for all ranks (pure: the same inputs give the same plan on every rank).

    Args:
        lengths: int ``[num_samples]``, tokens per sample, already truncated where that applies; every
            eligible sample must satisfy ``padded(length) <= settings.max_tokens`` (the largest of per-rank budgets).
        settings: the :class:`~lit_balance.BatchingSettings` (budget per rank, one int or one per rank, shuffle and
            its window, seed,
            drop_last, padding multiple, row cap, accumulation, largest_first, packing: the planner,
            :func:`planner_for`). ``too_long`` is not read here: the caller has already truncated the lengths or
            excluded samples through ``eligible``.
        num_replicas: number of ranks; the plan has ``num_micro_steps x num_replicas`` micro-batches.
        epoch: epoch number; with ``settings.shuffle`` it changes batch composition, rank assignment and step
            order (randomness comes from a local generator seeded by ``(settings.seed, epoch)``).
        eligible: bool ``[num_samples]`` mask of samples to plan (others are skipped), or None for all.
        cost_model: cost of a micro-batch (default: padded token slots).
        rank_speeds: float ``[num_replicas]`` relative throughput of each rank (None: all equal); a rank
            with half the speed gets about half the cost per optimizer step. Speeds below
            :data:`~lit_balance._checks.MIN_RANK_SPEED_RATIO` (a millionth) of the fastest are planned at that
            ratio, where such a rank already gets the least share, one row per micro-batch.
        min_steps: plan at least this many micro-steps (smaller micro-batches) where the samples allow, without
            fill rows; used to re-plan the rest of an epoch on a new number of ranks.
        num_batches: the epoch's micro-batch count over all ranks before ``min_steps``, as this function computes
            it from the lengths, eligible samples, settings and ``num_replicas`` (never from the epoch or cost
            model), or None to compute it here. A caller that plans the same samples every epoch may pass the
            count it computed once (windowed plans, :mod:`lit_balance.plan.windows`, do); another value gives another
            plan.

    Returns:
        The :class:`EpochPlan` of the epoch.

    Raises:
        TypeError: ``settings`` is not a :class:`~lit_balance.BatchingSettings`, ``cost_model`` not a
            :class:`~lit_balance.CostModel`, or ``rank_speeds`` not numbers.
        ValueError: ``lengths`` not 1-D positive ints; ``num_replicas < 1``, ``epoch < 0``, ``min_steps < 0`` or
            ``num_batches < 0``;
            ``eligible`` not a bool mask of ``num_samples``; an eligible sample whose padded length exceeds
            ``max_tokens``; ``rank_speeds`` of the wrong length, or not all finite and positive; per-rank
            ``max_tokens`` of another length than ``num_replicas``, or with a budget below every sample.

    Example:
        >>> plan = plan_epoch([95] * 5 + [20] * 5, BatchingSettings(max_tokens=100, shuffle=False), num_replicas=2,
        ...                   epoch=0)
        >>> plan.num_micro_steps, plan.assignment.tolist()
        (3, [[5, 0], [1, 2], [3, 4]])
    """
    if not isinstance(settings, BatchingSettings):
        raise InputTypeError(f"settings must be a lit_balance.BatchingSettings, got {type(settings).__name__}")
    cost_model = check_cost_model(cost_model)
    num_replicas = check_int("num_replicas", num_replicas, 1, "pass the world size")
    epoch = check_int("epoch", epoch, 0, "epochs count from 0")
    min_steps = check_int("min_steps", min_steps, 0, "0 plans as many micro-steps as the samples need")
    if num_batches is not None:
        num_batches = check_int("num_batches", num_batches, 0, "pass None to count the micro-batches here")
    settings.rank_max_tokens(num_replicas)  # per-rank budgets: one per rank
    lengths = check_lengths(lengths)
    candidates = _candidates(lengths, eligible, settings)
    if settings.static_packing or settings.padded_shapes is not None:  # shapes not chosen yet: from these samples
        planned = np.zeros(lengths.shape[0], dtype=bool)
        planned[candidates] = True
        settings = resolve_static_shapes(lengths, settings, planned, num_replicas)
    speeds = check_speeds(rank_speeds, num_replicas)
    speeds = np.ones(num_replicas) if speeds is None else speeds
    return planner_for(settings).plan(lengths, candidates, settings, num_replicas=num_replicas, epoch=epoch,
                                      cost_model=cost_model, speeds=speeds, min_steps=min_steps,
                                      num_batches=num_batches)


def _candidates(lengths: np.ndarray, eligible: np.ndarray | None, settings: BatchingSettings) -> np.ndarray:
    """int64 indices of the samples to plan: those ``eligible`` holds (all for None), each within the budget.

    Raises:
        ValueError: ``eligible`` is not a bool mask of the lengths' shape; an eligible sample whose padded length
            exceeds ``max_tokens``.
    """
    candidates = np.arange(lengths.shape[0], dtype=np.int64)
    if eligible is not None:
        mask = np.asarray(eligible)
        if mask.dtype != np.bool_ or mask.shape != lengths.shape:
            raise InputValueError(f"eligible must be a bool mask of shape {lengths.shape} (one flag per sample), got "
                                  f"dtype {mask.dtype} and shape {mask.shape}", parameter="eligible")
        candidates = candidates[mask]
    max_tokens, multiple = settings.largest_max_tokens, settings.pad_to_multiple_of
    over = candidates[too_long(lengths[candidates], max_tokens, multiple)]
    if over.size:
        raise InputValueError(f"{over.size} eligible sample(s) exceed max_tokens={max_tokens} padded token slots once "
                              f"padded to a multiple of {multiple} (first: index {int(over[0])}, "
                              f"{int(lengths[over[0]])} tokens); truncate them or leave them out through eligible")
    return candidates
