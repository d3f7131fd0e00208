"""Compare DDP batch samplers on real token-length distributions: padding, budget, rank balance, useful compute.

Run:
    python recipes/bench_samplers.py                                   # 8 and 64 ranks, every strategy
    python recipes/bench_samplers.py --ranks 8 --strategies sort_fill lit_balance --distributions fortunes
    pip install -e ".[bench]"                                          # optional peers: transformers, lhotse

Ranks are simulated in one process: one sampler per rank, each asked for its micro-batches of epochs 0 and 1
(no process group). Every strategy's output becomes the same thing, a list per rank of micro-batches (lists of
dataset indices), and one code path measures all of them (:func:`sampler_metrics`, :func:`batch_persistence`),
reusing :class:`lit_balance.stats.PlanStats` and :class:`lit_balance.cost.CostModel`.

Strategies (lengths capped at ``--max-length``; budget ``--max-tokens`` padded slots per micro-batch):

* ``distributed_fixed``: torch ``DistributedSampler`` (shuffle, ``drop_last=False``: pads the index list with
  repeats from its start to a multiple of the rank count) + ``BatchSampler`` of the fixed batch size
  ``max_tokens // longest capped length``, the largest that never exceeds the budget.
* ``hf_length_grouped``: Hugging Face ``transformers.trainer_pt_utils.DistributedLengthGroupedSampler`` (random
  mega-batches sorted by length, strided over ranks; pads like ``DistributedSampler``) + the fixed batch size.
* ``hf_batch_rebalance``: Hugging Face ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``),
  configured as the Trainer does: ``effective_batch_size = fixed batch size x ranks``, ``grad_accum=1``,
  ``drop_last=False``. Its micro-batch sizes vary; the budget is not one of its inputs.
* ``lhotse_dynamic``: lhotse ``DynamicBucketingSampler`` over cuts whose duration is the token count,
  ``max_duration=max_tokens`` (lhotse >= 1.4 counts ``rows x longest``, i.e. padded slots, but checks after
  adding a cut, so a longer last cut can overshoot), per rank ``world_size``/``rank``.
* ``sort_fill``: sort by length (random tie order), fill each micro-batch while the summed *real* length stays
  within the budget, shuffle the micro-batch order, deal round-robin to ranks (fairseq-style ``batch_by_size``
  on real tokens).
* ``lit_balance`` / ``lit_balance_attention``: :class:`lit_balance.BalancedBatchSampler` with
  ``cost_model=CostModel()`` / ``CostModel(linear=1, quadratic=1e-3)``, defaults otherwise.

Plan seconds: wall time to build the sampler and produce one rank's micro-batches of epoch 0, summed over ranks
(``plan_s``) and the slowest rank (``plan_rank_s``). ``hf_batch_rebalance`` and ``lhotse_dynamic`` run every
rank's identical global computation in each rank; rank 0 is timed and the other ranks' micro-batches are taken
from the same computation (the library's own per-rank selection code runs on it), so their ``plan_s`` is
rank 0's time x ranks.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler

import lit_balance
from lit_balance import BalancedBatchSampler
from lit_balance.cost import CostModel
from lit_balance.stats import PlanStats

LENGTHS_DIR = Path(lit_balance.__file__).resolve().parent / "data" / "lengths"
DISTRIBUTIONS = ("stdlib_docstrings", "pydocs_paragraphs", "fortunes")
STRATEGIES = ("distributed_fixed", "hf_length_grouped", "hf_batch_rebalance", "lhotse_dynamic", "sort_fill",
              "lit_balance", "lit_balance_attention")
EPOCHS = (0, 1)
#: Cost of a micro-batch in padded token slots, and with an attention term (per row ``L + 1e-3 L^2``).
TOKEN_COST = CostModel()
ATTENTION_COST = CostModel(linear=1.0, quadratic=1e-3)
COST_MODELS = {"tokens": TOKEN_COST, "attention": ATTENTION_COST}

RankBatches = list[list[list[int]]]  # [rank][step] -> dataset indices of that rank's micro-batch at that step


class PeerUnavailable(Exception):
    """A strategy that cannot run here; ``status`` is ``"not installed"`` or ``"unavailable"``."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class BenchConfig:
    """Settings shared by every strategy.

    Attributes:
        max_tokens: padded token slots per micro-batch, per rank (the budget).
        seed: base seed of every sampler.
        fixed_batch_size: rows per micro-batch of the fixed-size strategies (``max_tokens // longest length``).
    """

    max_tokens: int
    seed: int
    fixed_batch_size: int


@dataclass
class StrategyRun:
    """Micro-batches of one strategy for epochs 0 and 1, and how long epoch 0 took to plan.

    Attributes:
        batches: ``{epoch: [rank][step] -> indices]}``.
        rank_plan_s: seconds per rank to build its sampler and produce its epoch-0 micro-batches.
        timing: how ``rank_plan_s`` was measured.
        notes: what the strategy does that a reader of the table should know.
    """

    batches: dict[int, RankBatches]
    rank_plan_s: list[float]
    timing: str = "each rank timed"
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------------------
# Generic metrics: every strategy is measured from its per-rank lists of micro-batches.


def _flatten(rank_batches: RankBatches) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step-major flattening: ``(indices, batch_of_row, batch_rank, batch_step)`` (int64)."""
    num_steps = max((len(b) for b in rank_batches), default=0)
    rows: list[list[int]] = []
    ranks: list[int] = []
    steps: list[int] = []
    for s in range(num_steps):
        for r, batches in enumerate(rank_batches):
            if s < len(batches):
                rows.append(batches[s])
                ranks.append(r)
                steps.append(s)
    sizes = np.array([len(b) for b in rows], dtype=np.int64)
    flat = np.fromiter((i for b in rows for i in b), dtype=np.int64, count=int(sizes.sum()))
    return flat, np.repeat(np.arange(len(rows)), sizes), np.array(ranks, np.int64), np.array(steps, np.int64)


def _first_occurrence(flat: np.ndarray) -> np.ndarray:
    """bool mask of the rows that hold the first occurrence of their index (later ones are duplicates)."""
    first = np.zeros(flat.shape[0], dtype=bool)
    first[np.unique(flat, return_index=True)[1]] = True
    return first


def _check_indices(flat: np.ndarray, num_samples: int) -> None:
    if flat.size and (flat.min() < 0 or flat.max() >= num_samples):
        raise ValueError(f"micro-batches hold indices outside [0, {num_samples}): min {flat.min()}, max {flat.max()}")


def plan_stats_of(rank_batches: RankBatches, lengths: np.ndarray, cost_model: CostModel) -> PlanStats:
    """:class:`lit_balance.stats.PlanStats` of any sampler's micro-batches, one optimizer step per micro-batch.

    A rank that has no micro-batch at a step costs 0 there (it waits for the others). Only the first occurrence
    of an index in an epoch counts as real tokens; repeats count as padding, as fill rows do in ``plan_stats``.

    Args:
        rank_batches: ``[rank][step]`` -> dataset indices.
        lengths: int ``[num_samples]``: tokens per sample.
        cost_model: what a micro-batch costs.

    Raises:
        ValueError: an index outside ``[0, num_samples)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    num_replicas = len(rank_batches)
    flat, row_batch, batch_rank, batch_step = _flatten(rank_batches)
    _check_indices(flat, lengths.shape[0])
    num_batches = batch_rank.shape[0]
    sizes = np.bincount(row_batch, minlength=num_batches)
    width = np.zeros(num_batches, dtype=np.int64)
    if flat.size:
        np.maximum.at(width, row_batch, lengths[flat])
    cost = np.where(sizes > 0, cost_model.batch_cost(sizes, width), 0.0) if num_batches else np.zeros(0)
    num_steps = int(batch_step.max()) + 1 if num_batches else 0
    rank_cost = np.zeros((num_steps, num_replicas))
    rank_cost[batch_step, batch_rank] = cost
    real = _first_occurrence(flat)
    real_tokens = np.bincount(batch_rank[row_batch[real]], weights=lengths[flat[real]], minlength=num_replicas)
    return PlanStats(
        rank_cost=rank_cost,
        rank_real_tokens=real_tokens.astype(np.int64),
        rank_padded_tokens=np.bincount(batch_rank, weights=sizes * width, minlength=num_replicas).astype(np.int64),
        rank_micro_batches=np.array([len(b) for b in rank_batches], dtype=np.int64),
        real_cost=float(cost_model.real_cost(lengths[flat[real]]).sum()),
        max_batch_tokens=int((sizes * width).max()) if num_batches else 0,
    )


def sample_counts(rank_batches: RankBatches, num_samples: int) -> tuple[int, int]:
    """``(dropped, duplicated)`` over one epoch: indices never seen, and rows beyond each index's first."""
    flat = _flatten(rank_batches)[0]
    _check_indices(flat, num_samples)
    counts = np.bincount(flat, minlength=num_samples)
    return int((counts == 0).sum()), int(np.maximum(counts - 1, 0).sum())


def over_budget_ratio(rank_batches: RankBatches, lengths: np.ndarray, max_tokens: int) -> float:
    """Share of micro-batches whose padded slots (rows x longest row) exceed ``max_tokens``."""
    slots = [len(b) * int(lengths[b].max()) for batches in rank_batches for b in batches if len(b)]
    return float(np.mean(np.array(slots) > max_tokens)) if slots else 0.0


def batch_persistence(batches_a: Sequence[Sequence[int]], batches_b: Sequence[Sequence[int]],
                      num_samples: int) -> float:
    """Mean over samples of the share of their batch-mates in ``batches_a`` that are batch-mates again in ``batches_b``.

    The same measure as :func:`lit_balance.stats.batch_persistence`, over plain lists of micro-batches (all ranks):
    samples without batch-mates in ``batches_a`` are left out; a repeated index counts at its first occurrence
    only (later ones are treated like fill rows); samples missing from ``batches_b`` are left out of the mean.

    Returns:
        The mean share in [0, 1]; 0.0 when no sample has a batch-mate in ``batches_a``.
    """

    def batch_of(batches: Sequence[Sequence[int]]) -> tuple[np.ndarray, int]:
        sizes = np.array([len(b) for b in batches], dtype=np.int64)
        flat = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=int(sizes.sum()))
        _check_indices(flat, num_samples)
        row_batch = np.repeat(np.arange(len(batches)), sizes)
        out = np.full(num_samples, -1, dtype=np.int64)
        first = _first_occurrence(flat)
        out[flat[first]] = row_batch[first]
        return out, len(batches)

    (a, num_a), (b, num_b) = batch_of(batches_a), batch_of(batches_b)
    size_a = np.bincount(a[a >= 0], minlength=num_a)
    present = (a >= 0) & (b >= 0)
    a, b = a[present], b[present]
    _, inverse, counts = np.unique(a * (num_b + 1) + b, return_inverse=True, return_counts=True)
    mates_a = size_a[a] - 1
    has_mates = mates_a > 0
    if not has_mates.any():
        return 0.0
    return float(np.mean((counts[inverse] - 1)[has_mates] / mates_a[has_mates]))


def _global_order(rank_batches: RankBatches) -> list[list[int]]:
    num_steps = max((len(b) for b in rank_batches), default=0)
    return [batches[s] for s in range(num_steps) for batches in rank_batches if s < len(batches)]


def sampler_metrics(run: StrategyRun, lengths: np.ndarray, max_tokens: int) -> dict[str, Any]:
    """Every figure of the table for one strategy at one rank count (epoch 0; persistence epoch 0 -> 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    epoch0 = run.batches[0]
    counts = [len(b) for b in epoch0]
    stats = {name: plan_stats_of(epoch0, lengths, cm) for name, cm in COST_MODELS.items()}
    tok = stats["tokens"]
    dropped, duplicated = sample_counts(epoch0, lengths.shape[0])
    num_batches = int(sum(counts))
    out: dict[str, Any] = {
        "steps": max(counts, default=0),
        "batches_per_rank_min": min(counts, default=0),
        "batches_per_rank_max": max(counts, default=0),
        "uneven_batch_counts": len(set(counts)) > 1,
        "micro_batches": num_batches,
        "budget_fill_ratio": float(tok.rank_padded_tokens.sum()) / max(num_batches * max_tokens, 1),
        "padding_ratio": tok.padding_ratio,
        "over_budget_ratio": over_budget_ratio(epoch0, lengths, max_tokens),
        "max_batch_slots": tok.max_batch_tokens,
    }
    for name, st in stats.items():
        imbalance = st.step_imbalance
        out[f"imbalance_{name}_mean"] = float(imbalance.mean()) if imbalance.size else 1.0
        out[f"imbalance_{name}_p99"] = float(np.percentile(imbalance, 99)) if imbalance.size else 1.0
        out[f"useful_fraction_{name}"] = st.useful_fraction
    out["dropped"], out["duplicated"] = dropped, duplicated
    out["persistence"] = batch_persistence(_global_order(epoch0), _global_order(run.batches[1]), lengths.shape[0])
    out["plan_s"] = float(sum(run.rank_plan_s))
    out["plan_rank_s"] = float(max(run.rank_plan_s, default=0.0))
    out["plan_timing"] = run.timing
    out["notes"] = list(run.notes)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Strategies: each returns per-rank micro-batches of epochs 0 and 1.


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)`` with the cyclic garbage collector paused, so no strategy pays for another's garbage."""
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    finally:
        gc.enable()


def _as_lists(batches: Any) -> list[list[int]]:
    return [[int(i) for i in b] for b in batches]


def _hf_class(name: str, hint: str) -> Any:
    """``transformers.trainer_pt_utils.<name>``, or :class:`PeerUnavailable` saying why not."""
    try:
        import transformers
        from transformers import trainer_pt_utils
    except ImportError as exc:
        raise PeerUnavailable("not installed", f"transformers ({exc}); pip install -e '.[bench]'") from exc
    cls = getattr(trainer_pt_utils, name, None)
    if cls is None:
        raise PeerUnavailable("unavailable", f"transformers {transformers.__version__} has no "
                              f"trainer_pt_utils.{name}; {hint}")
    return cls


def _per_rank_epochs(num_replicas: int, build: Callable[[int], Any],
                     epoch: Callable[[int, Any], list[list[int]]]) -> tuple[dict[int, RankBatches], list[float]]:
    """Build each rank's sampler and draw epochs 0 and 1; time building plus epoch 0, per rank."""
    batches: dict[int, RankBatches] = {e: [] for e in EPOCHS}
    times = []
    for rank in range(num_replicas):
        (sampler, b0), seconds = _timed(lambda rank=rank: (s := build(rank), epoch(0, s)))
        batches[0].append(b0)
        batches[1].append(epoch(1, sampler))
        times.append(seconds)
    return batches, times


def _paired_epoch(e: int, pair: tuple[Any, BatchSampler]) -> list[list[int]]:
    """Epoch ``e`` of a (sampler, BatchSampler) pair."""
    pair[0].set_epoch(e)
    return _as_lists(pair[1])


def run_distributed_fixed(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """torch ``DistributedSampler`` (defaults: shuffle, ``drop_last=False``) + ``BatchSampler``."""
    def build(rank: int) -> tuple[DistributedSampler, BatchSampler]:
        sampler = DistributedSampler(range(lengths.shape[0]), num_replicas=num_replicas, rank=rank,
                                     shuffle=True, seed=cfg.seed)
        return sampler, BatchSampler(sampler, cfg.fixed_batch_size, drop_last=False)

    batches, times = _per_rank_epochs(num_replicas, build, _paired_epoch)
    notes = [(f"batch size {cfg.fixed_batch_size}; drop_last=False pads the index list with repeats to a multiple "
             "of the rank count; each rank's last micro-batch may be short")]
    return StrategyRun(batches, times, notes=notes)


def run_hf_length_grouped(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """Hugging Face ``DistributedLengthGroupedSampler`` + ``BatchSampler`` of the fixed batch size."""
    length_grouped_cls = _hf_class(
        "DistributedLengthGroupedSampler", "the Trainer groups by length with LengthGroupedSampler and shards "
        "with accelerate instead")
    length_list = lengths.tolist()

    def build(rank: int) -> tuple[Any, BatchSampler]:
        sampler = length_grouped_cls(cfg.fixed_batch_size, lengths=length_list, num_replicas=num_replicas,
                                     rank=rank, seed=cfg.seed)
        return sampler, BatchSampler(sampler, cfg.fixed_batch_size, drop_last=False)

    batches, times = _per_rank_epochs(num_replicas, build, _paired_epoch)
    mega = max(min(lengths.shape[0] // (cfg.fixed_batch_size * 4), 50), 1) * cfg.fixed_batch_size
    notes = [(f"batch size {cfg.fixed_batch_size}; drop_last=False pads like DistributedSampler; the Trainer of "
              "transformers 5 uses LengthGroupedSampler + accelerate sharding instead of this class; length-sorted "
              f"mega-batches of {mega} are dealt with stride {num_replicas}, so a micro-batch spans "
              f"{cfg.fixed_batch_size * num_replicas} sorted positions"
              + (" and mixes mega-batches" if mega < cfg.fixed_batch_size * num_replicas else ""))]
    return StrategyRun(batches, times, notes=notes)


def run_hf_batch_rebalance(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """Hugging Face ``BatchRebalanceSampler`` configured as ``Trainer(train_sampling_strategy="batch_rebalance")``.

    Every rank runs the same global assignment and yields its own column. Rank 0 is built and timed; its
    ``_assign`` (the per-global-batch assignment of every rank) is recorded and each rank's column is read from
    it, which ``tests/test_bench_samplers.py`` checks equals building that rank's sampler.
    """
    rebalance_cls = _hf_class(
        "BatchRebalanceSampler", "it came with huggingface/transformers#47340; transformers 5.24 has it")
    length_list = lengths.tolist()
    effective = cfg.fixed_batch_size * num_replicas
    batches: dict[int, RankBatches] = {}
    recorded: list[list[list[list[int]]]] = []

    def build() -> Any:
        sampler = rebalance_cls(length_list, effective_batch_size=effective, dp_size=num_replicas,
                                grad_accum=1, shuffle=True, seed=cfg.seed, rank=0, drop_last=False)
        assign = sampler._assign

        def recording_assign(indices: list[int], lens: list[int]) -> Any:
            rank_mbs = assign(indices, lens)
            recorded.append(rank_mbs)
            return rank_mbs

        sampler._assign = recording_assign
        return sampler

    def epoch(e: int, sampler: Any) -> RankBatches:
        recorded.clear()
        sampler.set_epoch(e)
        own = _as_lists(sampler)
        columns = [[[int(i) for i in step[r][0]] for step in recorded] for r in range(num_replicas)]
        if columns[0] != own:
            raise RuntimeError("BatchRebalanceSampler: recorded assignment does not match what rank 0 yielded")
        return columns

    (sampler, batches[0]), seconds = _timed(lambda: (s := build(), epoch(0, s)))
    batches[1] = epoch(1, sampler)
    notes = [(f"effective_batch_size {effective} (= {cfg.fixed_batch_size} x ranks, as the Trainer sets it), "
             "grad_accum=1, drop_last=False; micro-batch sizes vary and the token budget is not an input")]
    return StrategyRun(batches, [seconds] * num_replicas, timing="rank 0 timed, x ranks", notes=notes)


def _lhotse_cuts(lengths: np.ndarray) -> Any:
    from lhotse import CutSet, MonoCut

    return CutSet([MonoCut(id=str(i), start=0.0, duration=float(n), channel=0) for i, n in enumerate(lengths)])


def run_lhotse_dynamic(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig, cuts: Any = None) -> StrategyRun:
    """lhotse ``DynamicBucketingSampler`` with ``max_duration = max_tokens`` on cuts of duration = token count.

    Every rank draws the same global stream of batches and keeps every ``world_size``-th (redistributing the
    last ones so that all ranks get one). Rank 0 is built and timed and its stream (``_next_batch``) recorded;
    ranks 1.. are built with ``rank=r`` and replay that stream through lhotse's own selection code.
    """
    try:
        from lhotse.dataset import DynamicBucketingSampler
    except ImportError as exc:
        raise PeerUnavailable("not installed", f"lhotse ({exc}); pip install -e '.[bench]'") from exc
    cuts = cuts if cuts is not None else _lhotse_cuts(lengths)

    def make(rank: int, bins: Any = None) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "eagerly read CutSet": no effect on the batches
            return DynamicBucketingSampler(cuts, max_duration=float(cfg.max_tokens), shuffle=True, drop_last=False,
                                           world_size=num_replicas, rank=rank, seed=cfg.seed, duration_bins=bins)

    def ids(sampler: Any) -> list[list[int]]:
        return [[int(c.id.split("_")[0]) for c in batch] for batch in sampler]

    def epoch(e: int, leader: Any) -> RankBatches:
        stream: list[Any] = []
        next_batch = leader._next_batch

        def recording() -> Any:
            batch = next_batch()
            stream.append(batch)
            return batch

        leader._next_batch = recording
        leader.set_epoch(e)
        out = [ids(leader)]
        for rank in range(1, num_replicas):
            follower = make(rank, leader.duration_bins)
            replay = iter(stream)
            follower._next_batch = lambda replay=replay: next(replay)
            follower.set_epoch(e)
            out.append(ids(follower))
        return out

    batches: dict[int, RankBatches] = {}
    (leader, batches[0]), seconds = _timed(lambda: (s := make(0), epoch(0, s)))
    batches[1] = epoch(1, leader)
    notes = [("max_duration counts rows x longest (padded slots), but a cut is added before the check, so a "
              "longer cut arriving last can push a micro-batch past it; the last global batches are redistributed "
              "over ranks")]
    return StrategyRun(batches, [seconds] * num_replicas, timing="rank 0 timed, x ranks", notes=notes)


def sort_fill_batches(lengths: np.ndarray, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Sort by length (random order among equal lengths), cut whenever the summed real length would pass
    ``max_tokens``, shuffle the micro-batch order (fairseq ``batch_by_size`` on real tokens).

    Example:
        >>> sort_fill_batches(np.array([3, 1, 2, 3]), max_tokens=4, seed=0, epoch=0)
        [[3], [0], [1, 2]]
    """
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(lengths.shape[0])
    order = perm[np.argsort(lengths[perm], kind="stable")]
    total = np.concatenate([[0], np.cumsum(lengths[order])])
    batches = []
    start = 0
    while start < order.shape[0]:  # one step per micro-batch: the furthest end within the budget, at least one row
        end = max(int(np.searchsorted(total, total[start] + max_tokens, side="right")) - 1, start + 1)
        batches.append(order[start:end].tolist())
        start = end
    return [batches[k] for k in rng.permutation(len(batches))]


def run_sort_fill(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """:func:`sort_fill_batches`, micro-batch ``k`` to rank ``k % num_replicas``; each rank plans the whole epoch."""
    batches: dict[int, RankBatches] = {e: [] for e in EPOCHS}
    times = []
    for rank in range(num_replicas):
        b0, seconds = _timed(lambda rank=rank: sort_fill_batches(lengths, cfg.max_tokens, cfg.seed, 0)[rank::num_replicas])
        batches[0].append(b0)
        batches[1].append(sort_fill_batches(lengths, cfg.max_tokens, cfg.seed, 1)[rank::num_replicas])
        times.append(seconds)
    notes = [("budget on summed real tokens, so rows x longest can pass it; round-robin leaves ranks with "
             "different counts unless the micro-batch count divides evenly")]
    return StrategyRun(batches, times, notes=notes)


def _accepts_cost_model() -> bool:
    return "cost_model" in inspect.signature(BalancedBatchSampler.__init__).parameters


def _run_lit_balance(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig, cost_model: CostModel) -> StrategyRun:
    kwargs: dict[str, Any] = {"cost_model": cost_model} if _accepts_cost_model() else {}

    def build(rank: int) -> BalancedBatchSampler:
        return BalancedBatchSampler(lengths, cfg.max_tokens, num_replicas=num_replicas, rank=rank, seed=cfg.seed,
                                    **kwargs)

    def epoch(e: int, sampler: BalancedBatchSampler) -> list[list[int]]:
        sampler.set_epoch(e)
        return _as_lists(sampler)

    batches, times = _per_rank_epochs(num_replicas, build, epoch)
    notes = [(f"cost_model={cost_model}" if kwargs else
             "this BalancedBatchSampler has no cost_model argument: planned with its built-in padded-slot cost")]
    return StrategyRun(batches, times, notes=notes)


def run_lit_balance(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """:class:`lit_balance.BalancedBatchSampler` with ``cost_model=CostModel()``."""
    return _run_lit_balance(lengths, num_replicas, cfg, TOKEN_COST)


def run_lit_balance_attention(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """:class:`lit_balance.BalancedBatchSampler` with ``cost_model=CostModel(linear=1, quadratic=1e-3)``."""
    return _run_lit_balance(lengths, num_replicas, cfg, ATTENTION_COST)


RUNNERS: dict[str, Callable[..., StrategyRun]] = {
    "distributed_fixed": run_distributed_fixed,
    "hf_length_grouped": run_hf_length_grouped,
    "hf_batch_rebalance": run_hf_batch_rebalance,
    "lhotse_dynamic": run_lhotse_dynamic,
    "sort_fill": run_sort_fill,
    "lit_balance": run_lit_balance,
    "lit_balance_attention": run_lit_balance_attention,
}


# ------------------------------------------------------------------------------------------------------------------
# Command line, table, JSON.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=_positive_int, nargs="+", default=[8, 64], help="rank counts to simulate")
    p.add_argument("--max-tokens", type=_positive_int, default=4096,
                   help="budget: padded token slots (rows x longest row) per micro-batch, per rank")
    p.add_argument("--max-length", type=_positive_int, default=512,
                   help="documents are capped at this many tokens (must be <= --max-tokens)")
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS),
                   help=f"length arrays from {LENGTHS_DIR}")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--num-samples", type=_positive_int, default=None,
                   help="use only the first N documents of each distribution (quick runs)")
    p.add_argument("--seed", type=int, default=0, help="base seed of every sampler (>= 0)")
    p.add_argument("--shuffle-windows", type=float, nargs="*", default=[0.0, 0.25, 1.0, 2.0, 4.0],
                   help="lit_balance shuffle_window values for the padding / randomness trade-off table (none: skip)")
    p.add_argument("--skip-bound", action="store_true",
                   help="skip the table of lit_balance's persistence beside the best pool partitions")
    p.add_argument("--skip-million", action="store_true", help="skip the plan time of a million samples")
    p.add_argument("--output-dir", type=Path, default=Path("outputs/bench_samplers"),
                   help="results.json is written here")
    return p


def load_lengths(name: str, max_length: int, num_samples: int | None = None) -> np.ndarray:
    """Token counts of distribution ``name`` (int64), capped at ``max_length``, first ``num_samples`` only."""
    path = LENGTHS_DIR / f"lengths_{name}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"length array {path} not found; expected one of {DISTRIBUTIONS} in {LENGTHS_DIR}")
    lengths = np.load(path).astype(np.int64)
    if num_samples is not None:
        lengths = lengths[:num_samples]
    return np.minimum(lengths, max_length)


def _fmt(row: dict[str, Any]) -> list[str]:
    if row["status"] != "ok":
        return [row["strategy"], str(row["ranks"]), f"{row['status']}: {row['reason']}"] + [""] * 11
    counts = (str(row["batches_per_rank_min"]) if not row["uneven_batch_counts"]
              else f"**{row['batches_per_rank_min']}-{row['batches_per_rank_max']}**")
    return [
        row["strategy"], str(row["ranks"]), counts,
        f"{row['budget_fill_ratio']:.2f}", f"{row['padding_ratio']:.3f}", f"{row['over_budget_ratio']:.3f}",
        f"{row['imbalance_tokens_mean']:.2f} / {row['imbalance_tokens_p99']:.2f}",
        f"{row['imbalance_attention_mean']:.2f} / {row['imbalance_attention_p99']:.2f}",
        f"{row['useful_fraction_tokens']:.3f}", f"{row['useful_fraction_attention']:.3f}",
        str(row["dropped"]), str(row["duplicated"]), f"{row['persistence']:.3f}",
        f"{row['plan_s']:.2f} / {row['plan_rank_s']:.3f}" + ("*" if row["plan_timing"] != "each rank timed" else ""),
    ]


HEADER = ["strategy", "ranks", "steps (batches/rank)", "budget fill", "padding", "over budget",
          "imbalance tok mean / p99", "imbalance attn mean / p99", "U tok", "U attn", "dropped", "duplicated",
          "persistence", "plan s (sum / rank)"]

LEGEND = """\
steps: micro-batches per rank (bold range: ranks differ, which hangs DDP). budget fill: mean padded slots per
micro-batch / max_tokens. padding: 1 - real / padded slots (repeated samples count as padding). over budget:
share of micro-batches with rows x longest > max_tokens. imbalance: per step, max / mean cost over ranks (a rank
without a micro-batch costs 0); tok = CostModel() (padded slots), attn = CostModel(linear=1, quadratic=1e-3).
U: real-token cost / sum over steps of (ranks x slowest rank's cost); one optimizer step per micro-batch.
dropped / duplicated: samples never seen / extra rows of repeated samples in epoch 0. persistence: mean share of
a sample's epoch-0 batch-mates that are its batch-mates again in epoch 1. plan s: seconds to build the sampler and
produce epoch 0, summed over ranks / slowest rank (* rank 0 timed; every rank repeats the same work)."""


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table of result rows (any distributions)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(_fmt(r)) + " |" for r in rows]
    return "\n".join(lines)


def _source_state() -> dict[str, Any]:
    """Commit of the checkout this ran from and whether ``lit_balance/`` had uncommitted changes (None: no git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "lit_balance"], cwd=root, capture_output=True,
                                 text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "lit_balance_uncommitted_files": None}
    return {"commit": commit, "lit_balance_uncommitted_files": len(changed)}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
           "lit_balance": lit_balance.__version__}
    for name in ("transformers", "lhotse"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def window_tradeoff(lengths: np.ndarray, ranks: Sequence[int], windows: Sequence[float], cfg: BenchConfig,
                    ) -> list[dict[str, Any]]:
    """``shuffle_window`` (the knob that trades padding for randomness): padding, U and persistence per value."""
    from lit_balance.stats import batch_persistence as plan_persistence
    from lit_balance.stats import plan_stats

    rows = []
    for num_replicas in ranks:
        for window in windows:
            sampler = BalancedBatchSampler(lengths, cfg.max_tokens, num_replicas=num_replicas, rank=0, seed=cfg.seed,
                                           shuffle_window=window)
            p0, p1 = sampler.plan(0), sampler.plan(1)
            token, attention = plan_stats(p0, sampler.lengths, TOKEN_COST), plan_stats(p0, sampler.lengths,
                                                                                       ATTENTION_COST)
            rows.append({"ranks": num_replicas, "shuffle_window": window, "padding_ratio": token.padding_ratio,
                         "U_token": token.useful_fraction, "U_attention_with_token_plan": attention.useful_fraction,
                         "persistence": plan_persistence(p0, p1)})
    return rows


def pool_partition_frontier(lengths: np.ndarray, tokens_per_batch: float, num_lambdas: int = 60,
                            ) -> list[tuple[float, float]]:
    """Padding against persistence of the best *pool partitions* of ``lengths`` (an estimate, for comparison).

    A pool partition splits the distinct lengths into contiguous ranges (pools); every epoch it shuffles each
    pool and cuts it into micro-batches of ``tokens_per_batch / longest length in the pool`` rows, all padded to
    that longest length. Its expected padding slots are ``sum(pool max - length)``; a sample's expected
    persistence is ``(rows - 1) / (pool size - 1)`` (at most 1). An exact dynamic program over the distinct
    lengths minimises ``padding slots + lambda x summed persistence`` for ``num_lambdas`` values of lambda
    (log-spaced), giving points of the lower convex frontier. Noisy-sort orders (``shuffle_window``) are not
    pool partitions, but if this frontier needs more padding than a target allows, mixing lengths cannot
    reach that persistence cheaply either.

    Args:
        lengths: int ``[num_samples]``, tokens per sample (capped).
        tokens_per_batch: padded token slots per micro-batch (e.g. a plan's mean), > 0.

    Returns:
        ``(padding_ratio, persistence)`` points, global (all samples), one per lambda.
    """
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    cum_n = np.concatenate([[0], np.cumsum(counts)])
    cum_t = np.concatenate([[0], np.cumsum(counts * values)])
    total, num = float(cum_t[-1]), float(cum_n[-1])
    points = []
    for lam in np.geomspace(1e-2, 1e4, num_lambdas):
        best, pad, pers = np.zeros(values.size + 1), np.zeros(values.size + 1), np.zeros(values.size + 1)
        for j in range(1, values.size + 1):  # pools end at distinct length j - 1; i: first length of the pool
            i = np.arange(j)
            n = cum_n[j] - cum_n[i]
            pool_pad = n * values[j - 1] - (cum_t[j] - cum_t[i])
            rows = max(tokens_per_batch / values[j - 1], 1.0)
            pool_pers = n * np.minimum(1.0, (rows - 1.0) / np.maximum(n - 1, 1))
            k = int(np.argmin(best[i] + pool_pad + lam * pool_pers))
            best[j] = best[k] + pool_pad[k] + lam * pool_pers[k]
            pad[j], pers[j] = pad[k] + pool_pad[k], pers[k] + pool_pers[k]
        points.append((float(pad[-1] / (total + pad[-1])), float(pers[-1] / num)))
    return points


def persistence_bound_rows(lengths: np.ndarray, ranks: Sequence[int], cfg: BenchConfig) -> list[dict[str, Any]]:
    """lit_balance at defaults beside the best pool partitions (:func:`pool_partition_frontier`) per rank count.

    Pools are cut into micro-batches of the default plan's mean padded slots, so both use the same number of
    micro-batches. Rows: the default plan's padding ratio and persistence, the least persistence of any pool
    partition at no more padding, and the least padding of any pool partition with persistence <= 0.2.
    """
    from lit_balance.stats import batch_persistence as plan_persistence
    from lit_balance.stats import plan_stats

    rows = []
    for num_replicas in ranks:
        sampler = BalancedBatchSampler(lengths, cfg.max_tokens, num_replicas=num_replicas, rank=0, seed=cfg.seed)
        p0, p1 = sampler.plan(0), sampler.plan(1)
        stats = plan_stats(p0, sampler.lengths, TOKEN_COST)
        per_batch = float(stats.rank_padded_tokens.sum()) / max(p0.num_batches, 1)
        points = pool_partition_frontier(sampler.lengths, per_batch)
        pads = [pad for pad, pers in points if pers <= 0.2]
        rows.append({"ranks": num_replicas, "tokens_per_batch": per_batch, "padding_ratio": stats.padding_ratio,
                     "persistence": plan_persistence(p0, p1),
                     "pool_persistence_at_padding": min((pers for pad, pers in points
                                                         if pad <= stats.padding_ratio), default=1.0),
                     "pool_padding_for_0.2": min(pads) if pads else None})
    return rows


def plan_seconds_per_million(lengths: np.ndarray, ranks: Sequence[int], cfg: BenchConfig, repeats: int = 3,
                             ) -> list[dict[str, Any]]:
    """One rank's planning time for a million samples drawn from ``lengths`` (best of ``repeats``)."""
    big = np.random.default_rng(cfg.seed).choice(lengths, 1_000_000)
    rows = []
    for num_replicas in ranks:
        def plan(num_replicas: int = num_replicas) -> Any:
            return BalancedBatchSampler(big, cfg.max_tokens, num_replicas=num_replicas, rank=0, seed=cfg.seed).plan(0)

        best = min(_timed(plan)[1] for _ in range(repeats))
        rows.append({"ranks": num_replicas, "plan_s_per_million": best})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print one markdown table per distribution; write ``results.json``; return the results."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.ranks, args.distributions, args.strategies = (list(dict.fromkeys(v)) for v in  # drop repeats, keep order
                                                       (args.ranks, args.distributions, args.strategies))
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length ({args.max_length}) must be <= --max-tokens ({args.max_tokens}): a capped document "
                     "must fit one micro-batch; lower --max-length or raise --max-tokens")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"--output-dir {args.output_dir} exists and is not a directory; pass a directory path")
    start = time.perf_counter()
    print(f"lit_balance sampler benchmark: max_tokens={args.max_tokens} padded slots per micro-batch per rank, "
          f"documents capped at {args.max_length} tokens, ranks {args.ranks}, seed {args.seed}")
    print(f"versions: {_versions()}; BalancedBatchSampler accepts cost_model: {_accepts_cost_model()}\n")
    print(LEGEND + "\n")
    rows: list[dict[str, Any]] = []
    for dist_name in args.distributions:
        lengths = load_lengths(dist_name, args.max_length, args.num_samples)
        cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed,
                          fixed_batch_size=args.max_tokens // int(lengths.max()))
        print(f"## {dist_name}: {lengths.size} documents, {int(lengths.sum())} tokens after capping at "
              f"{args.max_length} ({int((lengths == args.max_length).sum())} capped), p50 {int(np.median(lengths))}, "
              f"fixed batch size {cfg.fixed_batch_size}\n")
        cuts = None
        dist_rows = []
        for num_replicas in args.ranks:
            for strategy in args.strategies:
                row: dict[str, Any] = {"distribution": dist_name, "strategy": strategy, "ranks": num_replicas,
                                       "num_samples": int(lengths.size), "fixed_batch_size": cfg.fixed_batch_size}
                try:
                    if strategy == "lhotse_dynamic":
                        if cuts is None:
                            try:
                                cuts = _lhotse_cuts(lengths)
                            except ImportError as exc:
                                raise PeerUnavailable("not installed",
                                                      f"lhotse ({exc}); pip install -e '.[bench]'") from exc
                        run = run_lhotse_dynamic(lengths, num_replicas, cfg, cuts=cuts)
                    else:
                        run = RUNNERS[strategy](lengths, num_replicas, cfg)
                    row.update(status="ok", reason="", **sampler_metrics(run, lengths, args.max_tokens))
                except PeerUnavailable as exc:
                    row.update(status=exc.status, reason=exc.reason)
                except (AssertionError, ValueError, TypeError, RuntimeError, IndexError) as exc:
                    # a peer refusing these inputs (hf samplers assert on their arguments) is a result, not a crash
                    row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
                dist_rows.append(row)
        print(markdown_table(dist_rows) + "\n")
        for row in dist_rows:
            if row["status"] == "ok" and row["uneven_batch_counts"]:
                print(f"- {row['strategy']} at {row['ranks']} ranks: ranks get {row['batches_per_rank_min']} to "
                      f"{row['batches_per_rank_max']} micro-batches; DDP would hang at the end of the epoch")
        rows += dist_rows
        print()
    notes = {}
    for row in rows:
        if row["status"] == "ok" and row["notes"]:
            notes.setdefault(row["strategy"], f"{row['notes'][0]} (at {row['ranks']} ranks)")
    print("Notes:\n" + "\n".join(f"- {name}: {note}" for name, note in notes.items()) + "\n")
    tradeoff: list[dict[str, Any]] = []
    if args.shuffle_windows:
        print("## lit_balance shuffle_window: padding for randomness (token cost)\n")
        print("| distribution | ranks | shuffle_window | padding | U tok | persistence |\n|---|---|---|---|---|---|")
        for dist_name in args.distributions:
            lengths = load_lengths(dist_name, args.max_length, args.num_samples)
            cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed, fixed_batch_size=1)
            for row in window_tradeoff(lengths, args.ranks, args.shuffle_windows, cfg):
                tradeoff.append({"distribution": dist_name, **row})
                print(f"| {dist_name} | {row['ranks']} | {row['shuffle_window']:g} | {row['padding_ratio']:.3f} | "
                      f"{row['U_token']:.3f} | {row['persistence']:.3f} |")
        print()
    bound: list[dict[str, Any]] = []
    if not args.skip_bound:
        print("## Persistence against padding: lit_balance defaults beside the best pool partitions\n")
        print("| distribution | ranks | slots per micro-batch | lit_balance padding | lit_balance persistence | "
              "best pool persistence at that padding | least pool padding for persistence <= 0.2 |\n"
              "|---|---|---|---|---|---|---|")
        for dist_name in args.distributions:
            lengths = load_lengths(dist_name, args.max_length, args.num_samples)
            cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed, fixed_batch_size=1)
            for row in persistence_bound_rows(lengths, args.ranks, cfg):
                bound.append({"distribution": dist_name, **row})
                need = row["pool_padding_for_0.2"]
                print(f"| {dist_name} | {row['ranks']} | {row['tokens_per_batch']:.0f} | {row['padding_ratio']:.3f} | "
                      f"{row['persistence']:.3f} | {row['pool_persistence_at_padding']:.3f} | "
                      f"{'none' if need is None else f'{need:.3f}'} |")
        print()
    million: list[dict[str, Any]] = []
    if not args.skip_million:
        lengths = load_lengths(args.distributions[-1], args.max_length)
        cfg = BenchConfig(max_tokens=args.max_tokens, seed=args.seed, fixed_batch_size=1)
        million = plan_seconds_per_million(lengths, args.ranks, cfg)
        print("lit_balance plan time of 1,000,000 samples drawn from " + args.distributions[-1] + " (one rank; "
              "every rank plans alone): " + ", ".join(f"{r['plan_s_per_million']:.2f} s at {r['ranks']} ranks"
                                                     for r in million) + "\n")
    elapsed = time.perf_counter() - start
    results = {
        "command": " ".join(["python", "recipes/bench_samplers.py", *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count()},
        "versions": _versions(),
        "source": _source_state(),
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "cost_models": {k: asdict(v) for k, v in COST_MODELS.items()},
                   "lit_balance_accepts_cost_model": _accepts_cost_model()},
        "rows": rows,
        "shuffle_window_tradeoff": tradeoff,
        "persistence_bound": bound,
        "plan_seconds_per_million": million,
        "wall_s": elapsed,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output_dir / 'results.json'}; total wall {elapsed:.1f} s")
    return results


if __name__ == "__main__":
    main()
