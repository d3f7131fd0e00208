"""Peer baselines of the sampler benchmark: how other samplers and batching rules make DDP micro-batches.

Each is a pure function of (lengths, settings, seed, epoch) or drives a peer library's own sampler: torch
``DistributedSampler`` with a fixed batch size, Hugging Face ``DistributedLengthGroupedSampler`` and
``BatchRebalanceSampler``, lhotse ``DynamicBucketingSampler``, sort and fill (fairseq's ``batch_by_size``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler

from benchmarks._harness import timed
from lit_balance.plan import RankBatches

__all__ = ["EPOCHS", "BenchConfig", "PeerUnavailable", "StrategyRun", "fixed_batch_size", "run_distributed_fixed",
           "run_hf_batch_rebalance", "run_hf_length_grouped", "run_lhotse_dynamic", "run_sort_fill",
           "sort_fill_batches"]

#: The epochs every simulated strategy is drawn for (persistence compares them).
EPOCHS = (0, 1)


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


def as_lists(batches: Any) -> list[list[int]]:
    """Micro-batches as lists of Python ints."""
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


def per_rank_epochs(num_replicas: int, build: Callable[[int], Any],
                     epoch: Callable[[int, Any], list[list[int]]]) -> tuple[dict[int, RankBatches], list[float]]:
    """Build each rank's sampler and draw epochs 0 and 1; time building plus epoch 0, per rank."""
    batches: dict[int, RankBatches] = {e: [] for e in EPOCHS}
    times = []
    for rank in range(num_replicas):
        (sampler, b0), seconds = timed(lambda rank=rank: (s := build(rank), epoch(0, s)))
        batches[0].append(b0)
        batches[1].append(epoch(1, sampler))
        times.append(seconds)
    return batches, times


def _paired_epoch(e: int, pair: tuple[Any, BatchSampler]) -> list[list[int]]:
    """Epoch ``e`` of a (sampler, BatchSampler) pair."""
    pair[0].set_epoch(e)
    return as_lists(pair[1])


def run_distributed_fixed(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """torch ``DistributedSampler`` (defaults: shuffle, ``drop_last=False``) + ``BatchSampler``."""
    def build(rank: int) -> tuple[DistributedSampler, BatchSampler]:
        sampler = DistributedSampler(range(lengths.shape[0]), num_replicas=num_replicas, rank=rank,
                                     shuffle=True, seed=cfg.seed)
        return sampler, BatchSampler(sampler, cfg.fixed_batch_size, drop_last=False)

    batches, times = per_rank_epochs(num_replicas, build, _paired_epoch)
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

    batches, times = per_rank_epochs(num_replicas, build, _paired_epoch)
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
    it, which ``tests/benchmarks/test_bench_samplers.py`` checks equals building that rank's sampler.
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
        own = as_lists(sampler)
        columns = [[[int(i) for i in step[r][0]] for step in recorded] for r in range(num_replicas)]
        if columns[0] != own:
            raise RuntimeError("BatchRebalanceSampler: recorded assignment does not match what rank 0 yielded")
        return columns

    (sampler, batches[0]), seconds = timed(lambda: (s := build(), epoch(0, s)))
    batches[1] = epoch(1, sampler)
    notes = [(f"effective_batch_size {effective} (= {cfg.fixed_batch_size} x ranks, as the Trainer sets it), "
             "grad_accum=1, drop_last=False; micro-batch sizes vary and the token budget is not an input")]
    return StrategyRun(batches, [seconds] * num_replicas, timing="rank 0 timed, x ranks", notes=notes)


def lhotse_cuts(lengths: np.ndarray) -> Any:
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
    cuts = cuts if cuts is not None else lhotse_cuts(lengths)

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
    (leader, batches[0]), seconds = timed(lambda: (s := make(0), epoch(0, s)))
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
    lengths = np.asarray(lengths, dtype=np.int64)
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
        b0, seconds = timed(lambda rank=rank: sort_fill_batches(lengths, cfg.max_tokens, cfg.seed,
                                                                0)[rank::num_replicas])
        batches[0].append(b0)
        batches[1].append(sort_fill_batches(lengths, cfg.max_tokens, cfg.seed, 1)[rank::num_replicas])
        times.append(seconds)
    notes = [("budget on summed real tokens, so rows x longest can pass it; round-robin leaves ranks with "
             "different counts unless the micro-batch count divides evenly")]
    return StrategyRun(batches, times, notes=notes)


def fixed_batch_size(max_tokens: int, max_length: int) -> int:
    """Rows per micro-batch of the fixed-size baselines: the largest that never exceeds the budget.

    Args:
        max_tokens: padded token slots per micro-batch, per rank.
        max_length: the longest a row can be (documents are truncated to it), tokens.

    Raises:
        ValueError: ``max_length > max_tokens`` (not even one row fits) or a value < 1.

    Example:
        >>> fixed_batch_size(1024, 256)
        4
    """
    if max_tokens < 1 or max_length < 1:
        raise ValueError(f"max_tokens and max_length must be >= 1, got {max_tokens} and {max_length}")
    if max_length > max_tokens:
        raise ValueError(f"max_length={max_length} exceeds max_tokens={max_tokens}: no fixed batch size fits the "
                         "budget; lower --max-length or raise --max-tokens")
    return max_tokens // max_length
