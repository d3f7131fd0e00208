"""The plan report: what an epoch of token-budgeted micro-batches looks like before any training.

:func:`plan_report` plans one epoch with :class:`~lit_balance.BalancedBatchSampler` and, for comparison, with
PyTorch's ``DistributedSampler`` and the largest fixed batch size that never exceeds the budget, and measures both
(:class:`PlanReport`). :func:`~lit_balance.report.tables.format_report` renders per-rank tables and the epoch's figures
(rank imbalance, useful compute fraction, padding) with rich; :func:`~lit_balance.report.plots.save_plots` draws the
length histogram with the length buckets and the per-step, per-rank cost of both plans. For a mixture (a
:class:`~lit_balance.sampler.mixture.MixtureBatchSampler` passed as ``sampler``) the report also holds each component's
realized share of every optimizer step against its target (:func:`mixture_shares`), as a table and a plot.
``lit-balance plan`` (:mod:`lit_balance.cli`) wires them to the command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from lit_balance.errors import InputValueError
from lit_balance.plan.cost import CostModel, check_cost_model
from lit_balance.plan.epoch import planner_for
from lit_balance.plan.mixture import mixture_units
from lit_balance.plan.settings import STATIC_SHAPE_DEFAULTS, BatchingSettings
from lit_balance.plan.shapes import epoch_shapes
from lit_balance.plan.stats import PlanStats, plan_stats
from lit_balance.plan.types import EpochPlan, padded_lengths
from lit_balance.sampler.sampler import BalancedBatchSampler

__all__ = ["PlanReport", "distributed_sampler_plan", "mixture_lines", "mixture_shares", "plan_report", "summary_line",
           "write_summary"]


@dataclass(frozen=True)
class PlanReport:
    """One epoch planned two ways, with the settings that produced it.

    Attributes:
        lengths: int64 ``[num_samples]``: tokens per sample as planned (after truncation), global.
        settings: the planning settings as plain values: :meth:`BatchingSettings.to_dict` plus
            ``num_replicas``, ``epoch`` and ``cost_model`` (:meth:`CostModel.to_dict`).
        balanced: :class:`PlanStats` of :class:`BalancedBatchSampler`'s plan.
        baseline: :class:`PlanStats` of ``DistributedSampler`` with ``baseline_batch_size`` rows per batch.
        baseline_batch_size: the largest fixed batch size whose batches never exceed ``max_tokens``
            padded slots (rows), per rank.
        bucket_edges: float64: the edges (tokens) of the budget's length buckets: samples longer than
            ``max_tokens / (k + 1)`` and up to ``max_tokens / k`` take ``k`` rows per micro-batch; the edges of
            ``k`` = 1, 2, 3, 4, 6, 8, 12, 16, ... that fall within the planned lengths.
        cost_unit: what a cost counts (``"padded slots"`` for the default cost model, ``"tokens"`` when packed).
        shapes: the input shapes of the balanced plan's micro-batches as collated, all ranks
            (:func:`lit_balance.plan.shapes.epoch_shapes`): ``{"shapes": {"RxT": micro-batches}, "distinct_shapes",
            "real_token_fraction", "real_token_fraction_bound"}`` (the bound: with ``padded_shapes``, every sample padded
            to its shape's length with no empty row; else None); in :meth:`summary` only with static shapes (``static_packing``,
            ``padded_shapes``), so the summary of other settings is unchanged.
        mixture: for a mixture, :func:`mixture_shares` of the balanced plan (each component's share of every
            optimizer step against its target); None for a single corpus (then not in :meth:`summary`).
    """

    lengths: np.ndarray
    settings: dict[str, Any]
    balanced: PlanStats
    baseline: PlanStats
    baseline_batch_size: int
    bucket_edges: np.ndarray
    cost_unit: str
    shapes: dict[str, Any] | None = None
    mixture: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """Plain-Python figures of both plans (what ``plan_summary.json`` holds)."""
        out = {"settings": self.settings, "num_samples": int(self.lengths.size), "cost_unit": self.cost_unit,
               "baseline_batch_size": self.baseline_batch_size,
               "balanced": _figures(self.balanced), "distributed_sampler": _figures(self.baseline)}
        if self.shapes is not None and any(name in self.settings for name in STATIC_SHAPE_DEFAULTS):
            out["shapes"] = self.shapes
        if self.mixture is not None:
            out["mixture"] = self.mixture
        return out


def _figures(stats: PlanStats) -> dict[str, Any]:
    rank_total = stats.rank_cost.sum(axis=0)
    imbalance = stats.step_imbalance
    padded = stats.rank_padded_tokens
    return {
        "padding_ratio": stats.padding_ratio,
        "useful_fraction": stats.useful_fraction,
        "useful_fraction_bound": stats.useful_fraction_bound,
        "epoch_rank_imbalance": float(rank_total.max() / rank_total.mean()) if rank_total.mean() > 0 else 1.0,
        "mean_step_imbalance": float(imbalance.mean()) if imbalance.size else 1.0,
        "max_step_imbalance": float(imbalance.max()) if imbalance.size else 1.0,
        "micro_batches_per_rank": int(stats.rank_micro_batches[0]) if stats.rank_micro_batches.size else 0,
        "optimizer_steps": int(stats.rank_cost.shape[0]),
        "max_batch_tokens": stats.max_batch_tokens,
        "ranks": [
            {"rank": r, "micro_batches": int(stats.rank_micro_batches[r]),
             "real_tokens": int(stats.rank_real_tokens[r]), "padded_tokens": int(padded[r]),
             "padding_ratio": 1.0 - float(stats.rank_real_tokens[r]) / padded[r] if padded[r] else 0.0,
             "cost": float(rank_total[r])}
            for r in range(stats.rank_real_tokens.size)
        ],
    }


def distributed_sampler_plan(num_samples: int, batch_size: int, *, num_replicas: int, shuffle: bool, seed: int,
                             epoch: int, drop_last: bool) -> EpochPlan:
    """The epoch plan of ``DataLoader(batch_size=batch_size, sampler=DistributedSampler(...))`` on every rank.

    Each rank batches its ``DistributedSampler`` shard in order (the last batch may be short). Indices that
    ``DistributedSampler`` repeats to even out the shards (``drop_last=False``) are marked as fill rows.

    Args:
        num_samples: dataset size.
        batch_size: rows per batch, per rank.
        num_replicas: number of ranks.
        shuffle, seed, epoch, drop_last: as for ``DistributedSampler`` and its ``set_epoch``.

    Returns:
        An :class:`EpochPlan`; batch ``s * num_replicas + r`` is rank ``r``'s batch at step ``s``.

    Raises:
        ValueError: ``batch_size < 1`` or ``num_samples < 1``.

    Example:
        >>> plan = distributed_sampler_plan(5, 2, num_replicas=2, shuffle=False, seed=0, epoch=0, drop_last=False)
        >>> plan.assignment.tolist(), plan.rows.tolist(), plan.is_fill.tolist()
        ([[0, 1], [2, 3]], [0, 2, 1, 3, 4, 0], [False, False, False, False, False, True])
    """
    if batch_size < 1 or num_samples < 1:
        raise InputValueError(f"need batch_size >= 1 and num_samples >= 1, got {batch_size} and {num_samples}")
    shards, fills = [], []
    for rank in range(num_replicas):
        sampler = DistributedSampler(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(np.fromiter(sampler, dtype=np.int64))
        positions = rank + num_replicas * np.arange(len(sampler))  # positions in the padded global order
        fills.append(positions >= num_samples)
    per_rank = len(shards[0])
    num_steps = -(-per_rank // batch_size)
    rows, is_fill, sizes = [], [], []
    for step in range(num_steps):
        lo, hi = step * batch_size, min((step + 1) * batch_size, per_rank)
        for rank in range(num_replicas):
            rows.append(shards[rank][lo:hi])
            is_fill.append(fills[rank][lo:hi])
            sizes.append(hi - lo)
    return EpochPlan(
        rows=np.concatenate(rows) if rows else np.zeros(0, np.int64),
        is_fill=np.concatenate(is_fill) if is_fill else np.zeros(0, bool),
        batch_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        assignment=np.arange(num_steps * num_replicas, dtype=np.int64).reshape(num_steps, num_replicas),
        dropped=np.zeros(0, np.int64),
    )


def _bucket_edges(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Edges ``max_tokens / k`` (tokens) of the rows-per-micro-batch buckets, for k = 1, 2, 3, 4, 6, 8, 12, ..."""
    ks, k = [], 1
    while max_tokens / k >= lengths.min() and k <= max_tokens:
        ks.append(k)
        k = k + 1 if k < 4 else (k * 3 // 2 if (k & (k - 1)) == 0 else k * 4 // 3)  # 4, 6, 8, 12, 16, 24, ...
    edges = max_tokens / np.asarray(ks, dtype=np.float64)
    return edges[(edges >= lengths.min()) & (edges <= lengths.max() * 1.1)]


def plan_report(
    lengths: Any,
    max_tokens: int | None = None,
    *,
    settings: BatchingSettings | None = None,
    num_replicas: int,
    epoch: int = 0,
    cost_model: CostModel | None = None,
    sampler: BalancedBatchSampler | None = None,
    **settings_kwargs: Any,
) -> PlanReport:
    """Plan epoch ``epoch`` with :class:`BalancedBatchSampler` and with ``DistributedSampler``, and measure both.

    The baseline batches the same samples (those the balanced plan keeps) with ``DistributedSampler`` and
    the largest fixed batch size ``max_tokens // longest padded length`` (capped by ``max_batch_size``),
    so neither plan ever exceeds ``max_tokens`` padded slots per micro-batch (per-rank budgets: the smallest
    budget, and at least one row, so the baseline's longest rows may exceed a small rank's budget). With ``packing=True`` the balanced
    plan is packed (one row of whole documents per micro-batch, measured with its packed cost and zero padding
    but for the row's rounding to ``pad_to_multiple_of``), the baseline stays padded. Both are measured with
    :func:`lit_balance.plan.stats.plan_stats` under the same cost model, per optimizer step of
    ``settings.accumulate_grad_batches`` micro-batches per rank (ranks wait for each other once per step).

    Args:
        lengths: int ``[num_samples]``: tokens per sample.
        max_tokens: padded token slots per micro-batch, per rank (shorthand for ``settings.max_tokens``).
        settings: the :class:`~lit_balance.BatchingSettings`; or give them as keywords (``**settings_kwargs``),
            as for :class:`BalancedBatchSampler`.
        num_replicas: number of ranks (world size).
        epoch: the epoch to plan (as passed to ``set_epoch``).
        cost_model: cost of a micro-batch, which the sampler balances and both plans are measured in;
            default :class:`CostModel()` (padded token slots).
        sampler: a sampler to report in place of building one from ``lengths`` and the settings (which are then not
            used; ``num_replicas`` must be the sampler's), e.g. a
            :class:`~lit_balance.sampler.mixture.MixtureBatchSampler` (built with ``cost_model``): with several
            components (``sampler.num_components``) the report then holds :func:`mixture_shares` as ``mixture``; the
            baseline batches the samples the epoch reads.
        **settings_kwargs: settings by name (``shuffle=False``, ``accumulate_grad_batches=2``, ...).

    Returns:
        The :class:`PlanReport`.

    Raises:
        ValueError, TypeError: settings the sampler rejects (the message names the setting).

    Example:
        >>> report = plan_report([95] * 5 + [20] * 5, 100, num_replicas=2, shuffle=False)
        >>> report.baseline_batch_size, round(report.balanced.padding_ratio, 3), round(report.baseline.padding_ratio, 3)
        (1, 0.0, 0.0)
    """
    cost_model = check_cost_model(cost_model)
    if sampler is None:
        sampler = BalancedBatchSampler(lengths, max_tokens, settings=settings, num_replicas=num_replicas, rank=0,
                                       cost_model=cost_model, **settings_kwargs)
    elif sampler.num_replicas != num_replicas:
        raise InputValueError(f"plan_report got num_replicas={num_replicas} and a sampler for "
                              f"{sampler.num_replicas} ranks; pass the sampler's", parameter="num_replicas")
    settings = sampler.settings
    sampler.set_epoch(epoch)
    pieces = sampler.plan_pieces()  # under a length warm-up the plan's rows are pieces of documents
    planned = sampler.lengths if pieces is None else pieces[2]
    pad, accumulate = settings.pad_to_multiple_of, settings.accumulate_grad_batches
    planner = planner_for(settings)
    plan = sampler.plan()
    balanced = plan_stats(plan, planned, cost_model, pad_to_multiple_of=pad,
                          accumulate_grad_batches=accumulate, planner=planner,
                          max_tokens=settings.largest_max_tokens)

    # the samples this epoch reads (one corpus: every sample but those too_long="skip" leaves out)
    kept = np.union1d(plan.rows[~plan.is_fill], plan.dropped)
    mixture = mixture_shares(sampler, plan) if sampler.num_components > 1 else None
    kept_lengths = planned[kept]
    # one batch size for every rank: within the smallest per-rank budget where the longest sample allows
    smallest = min(settings.rank_max_tokens(sampler.num_replicas))
    batch_size = max(1, smallest // int(padded_lengths(kept_lengths, pad).max()))
    if settings.max_batch_size is not None:
        batch_size = min(batch_size, settings.max_batch_size)
    base_plan = distributed_sampler_plan(kept.size, batch_size, num_replicas=num_replicas, shuffle=settings.shuffle,
                                         seed=settings.seed, epoch=epoch, drop_last=settings.drop_last)
    baseline = plan_stats(base_plan, kept_lengths, cost_model, pad_to_multiple_of=pad,
                          accumulate_grad_batches=accumulate, max_tokens=settings.largest_max_tokens)
    summary = {**settings.to_dict(), "num_replicas": sampler.num_replicas, "epoch": sampler.epoch,
               "cost_model": cost_model.to_dict()}
    unit = planner.cost_unit if cost_model == CostModel() else "cost units"
    return PlanReport(lengths=kept_lengths, settings=summary, balanced=balanced, baseline=baseline,
                      baseline_batch_size=batch_size,
                      bucket_edges=(_bucket_edges(kept_lengths, settings.largest_max_tokens)
                                    if planner.row_buckets else np.zeros(0)),
                      cost_unit=unit,
                      shapes=epoch_shapes(plan, planned, settings, planner),  # sampler.plan(): the whole epoch
                      mixture=mixture)


def mixture_shares(sampler: Any, plan: EpochPlan | None = None) -> dict[str, Any]:
    """Each mixture component's units in every optimizer step of a plan, its realized share against its target.

    Units are the mixture's (``unit``): real tokens as planned (``sampler.lengths``), supervised tokens
    (``sampler.supervised_lengths``, else ``lengths - 1``) or documents; fill rows are not counted. Optimizer step
    ``g`` is micro-steps ``[g * accumulate_grad_batches, (g + 1) * accumulate_grad_batches)`` of every rank.

    Args:
        sampler: a sampler (its ``component_of``, ``mixture``, ``lengths`` and ``settings``; every
            :class:`~lit_balance.BalancedBatchSampler` has them, one corpus being a blend of one).
        plan: its plan of an epoch (default ``sampler.plan()``).

    Returns:
        Plain Python: ``names``, ``unit``, ``target`` (``[components]``, the mixture's shares; under a weight schedule
        the mean of the steps' scheduled shares), ``step_targets`` (``[steps][components]``, each step's scheduled
        shares, which the deviations are taken from; None for fixed weights), ``step_units``
        (``[steps][components]``, ints, global), ``step_shares`` (``[steps][components]``: each step's units over its
        total), ``epoch_shares`` (``[components]``), and per component the deviation of a step's share from its
        target in percentage points: ``max_deviation_pp`` and ``p95_deviation_pp`` (the 95th percentile over steps).

    Example:
        >>> from lit_balance.plan.mixture import MixtureSettings
        >>> from lit_balance.sampler.mixture import MixtureBatchSampler
        >>> s = MixtureBatchSampler([10] * 4 + [20] * 2, [4, 2], MixtureSettings(("a", "b"), (1, 1)), max_tokens=40,
        ...                         num_replicas=1, rank=0, shuffle=False)
        >>> shares = mixture_shares(s)
        >>> shares["step_units"], shares["max_deviation_pp"]
        ([[0, 40], [40, 0]], [50.0, 50.0])
    """
    plan = sampler.plan() if plan is None else plan
    mix = sampler.mixture
    num_components = len(mix.names)
    units = mixture_units(mix, sampler.lengths, sampler.supervised_lengths)  # the planner's own count of a unit
    accumulate = sampler.settings.accumulate_grad_batches
    num_steps = -(-plan.num_micro_steps // accumulate)
    batch_step = np.zeros(plan.num_batches, dtype=np.int64)
    batch_step[plan.assignment] = (np.arange(plan.num_micro_steps) // accumulate)[:, None]
    row_step = np.repeat(batch_step, np.diff(plan.batch_offsets))
    real = ~plan.is_fill
    rows = plan.rows[real]
    step_units = np.zeros((num_steps, num_components), dtype=np.int64)
    np.add.at(step_units, (row_step[real], sampler.component_of(rows)), units[rows])
    totals = step_units.sum(axis=1, keepdims=True)
    step_shares = step_units / np.maximum(totals, 1)
    target = np.asarray(mix.shares, dtype=np.float64)
    scheduled = sampler.step_targets() if plan is sampler.plan() else None  # a weight schedule: per step
    if scheduled is not None and scheduled.shape == step_shares.shape:
        target = scheduled.mean(axis=0) if num_steps else target
        deviation = 100.0 * np.abs(step_shares - scheduled)[totals[:, 0] > 0]
    else:
        scheduled = None
        deviation = 100.0 * np.abs(step_shares - target)[totals[:, 0] > 0]
    epoch_units = step_units.sum(axis=0)
    return {"names": list(mix.names), "unit": mix.unit, "target": target.tolist(),
            "step_targets": None if scheduled is None else scheduled.tolist(),
            "step_units": step_units.tolist(), "step_shares": step_shares.tolist(),
            "epoch_shares": (epoch_units / max(int(epoch_units.sum()), 1)).tolist(),
            "max_deviation_pp": deviation.max(axis=0).tolist() if deviation.size else [0.0] * num_components,
            "p95_deviation_pp": (np.percentile(deviation, 95, axis=0).tolist() if deviation.size
                                 else [0.0] * num_components)}


def summary_line(summary: dict[str, Any]) -> str:
    """One line of the balanced plan's figures from :meth:`PlanReport.summary` (what the recipes print before fit).

    Example:
        >>> print(summary_line(plan_report([95] * 5 + [20] * 5, 100, num_replicas=2, shuffle=False).summary()))
        plan for 2 ranks: padding ratio 0.0000 | useful compute fraction 0.9914 | micro-batches per rank 3
    """
    s, fig = summary["settings"], summary["balanced"]
    epoch = f", epoch {s['epoch']}" if s["epoch"] else ""
    line = (f"plan for {s['num_replicas']} ranks{epoch}: padding ratio {fig['padding_ratio']:.4f} | "
            f"useful compute fraction {fig['useful_fraction']:.4f} | "
            f"micro-batches per rank {fig['micro_batches_per_rank']}")
    if "mixture" in summary:
        line += "\n" + "\n".join(mixture_lines(summary["mixture"]))
    return line


def mixture_lines(mixture: dict[str, Any]) -> list[str]:
    """Lines of at most 80 characters after the first (names up to 12 characters): per component, its target share and
    how far its share of an optimizer step came from it (max and p95 over the epoch's steps, percentage points; under
    a weight schedule, ``step_targets``, from each step's scheduled share, the target shown being their mean), from
    :func:`mixture_shares` or :meth:`lit_balance.BalancedTextDataModule.plan_summary`'s ``"mixture"``.

    Example:
        >>> for line in mixture_lines({"names": ["web"], "unit": "tokens", "target": [1.0],
        ...                            "step_shares": [[1.0], [1.0]]}):
        ...     print(line)
        shares of tokens per optimizer step, 2 steps (deviation from target, pp):
          web          target 1.0000 | max 0.00 | p95 0.00
    """
    target = np.asarray(mixture.get("target", mixture.get("shares")), dtype=np.float64)
    shares = np.asarray(mixture["step_shares"], dtype=np.float64).reshape(-1, target.size)
    scheduled = mixture.get("step_targets")
    per_step = target if scheduled is None else np.asarray(scheduled, dtype=np.float64).reshape(shares.shape)
    deviation = 100.0 * np.abs(shares - per_step)
    unit = mixture["unit"].replace("_", " ")
    against = "target" if scheduled is None else "each step's scheduled share; target: mean over the steps"
    lines = [f"shares of {unit} per optimizer step, {shares.shape[0]} steps (deviation from {against}, pp):"]
    for c, name in enumerate(mixture["names"]):
        worst = float(deviation[:, c].max()) if shares.size else 0.0
        p95 = float(np.percentile(deviation[:, c], 95)) if shares.size else 0.0
        lines.append(f"  {name:<12} target {target[c]:.4f} | max {worst:.2f} | p95 {p95:.2f}")
    return lines


def write_summary(report: PlanReport, output_dir: str | Path) -> Path:
    """Write ``plan_summary.json`` (see :meth:`PlanReport.summary`) into ``output_dir``; return its path."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "plan_summary.json"
    path.write_text(json.dumps(report.summary(), indent=1), encoding="utf-8")
    return path
