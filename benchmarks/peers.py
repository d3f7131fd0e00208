"""Peer baselines of the sampler benchmark: how other samplers, batching rules and packers make DDP micro-batches.

Padded micro-batches: torch ``DistributedSampler`` with a fixed batch size, Hugging Face
``DistributedLengthGroupedSampler`` and ``BatchRebalanceSampler``, lhotse ``DynamicBucketingSampler``, sort and fill
(fairseq's ``batch_by_size``); each ``run_*`` drives the peer's own sampler, per rank, and returns a
:class:`StrategyRun`. Packed (padding-free) micro-batches: Hugging Face flattening, torchtune's greedy packs, NeMo's
first-fit-decreasing, verl's Karmarkar–Karp; each is a pure function ``peer(lengths, max_tokens, num_replicas, seed,
epoch) -> RankBatches`` (:data:`PACKING_PEERS`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler

from benchmarks._harness import timed
from lit_balance.plan import RankBatches

__all__ = ["EPOCHS", "PACKING_PEERS", "BenchConfig", "PeerUnavailable", "StrategyRun", "distributed_fixed",
           "ffd_round_robin", "first_fit_decreasing", "fixed_batch_size", "flatten_with_collator",
           "flattening_batch_size", "greedy_packs", "greedy_sequential", "hf_flattening", "karmarkar_karp",
           "kk_balanced", "run_distributed_fixed", "run_hf_batch_rebalance", "run_hf_length_grouped",
           "run_lhotse_dynamic", "run_sort_fill", "sort_fill_batches", "verl_workload"]

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
        settings: the ``BatchingSettings`` a lit_balance plan was made with (static shapes resolved); else None.
    """

    batches: dict[int, RankBatches]
    rank_plan_s: list[float]
    timing: str = "each rank timed"
    notes: list[str] = field(default_factory=list)
    settings: Any = None


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


def distributed_fixed(num_items: int, num_replicas: int, seed: int, epoch: int, batch_size: int) -> RankBatches:
    """Each rank's batches of item positions from torch ``DistributedSampler`` (shuffle, ``drop_last=False``: it
    repeats items from the start of its shuffled list to a multiple of ``num_replicas``) + ``BatchSampler``."""
    out = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(range(num_items), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        out.append([list(b) for b in BatchSampler(sampler, batch_size, drop_last=False)])
    return out


def run_distributed_fixed(lengths: np.ndarray, num_replicas: int, cfg: BenchConfig) -> StrategyRun:
    """:func:`distributed_fixed` of ``cfg.fixed_batch_size`` rows, every rank's epoch 0 timed together."""
    def deal(epoch: int) -> RankBatches:
        return distributed_fixed(lengths.shape[0], num_replicas, cfg.seed, epoch, cfg.fixed_batch_size)

    epoch0, seconds = timed(lambda: deal(0))
    notes = [(f"batch size {cfg.fixed_batch_size}; drop_last=False pads the index list with repeats to a multiple "
             "of the rank count; each rank's last micro-batch may be short")]
    return StrategyRun({0: epoch0, 1: deal(1)}, [seconds / num_replicas] * num_replicas,
                       timing="all ranks timed together, / ranks", notes=notes)


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


# Packed (padding-free) micro-batches.


def _lengths(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or int(lengths.min()) < 1:
        raise ValueError(f"lengths must be a non-empty 1-D array of token counts >= 1, got shape {lengths.shape}")
    if int(lengths.max()) > max_tokens:
        raise ValueError(f"a document of {int(lengths.max())} tokens does not fit max_tokens={max_tokens}; cap the "
                         "lengths at the budget (--max-length) first")
    return lengths


# Hugging Face: DataCollatorWithFlattening over DistributedSampler, a fixed number of documents per micro-batch.


def flattening_batch_size(lengths: np.ndarray, max_tokens: int) -> int:
    """Documents per micro-batch that make the mean packed row about ``max_tokens`` (``round(budget / mean)``).

    Example:
        >>> flattening_batch_size(np.array([10, 30]), 100)
        5
    """
    return max(1, round(max_tokens / float(np.mean(lengths))))


def hf_flattening(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, epoch: int,
                  batch_size: int | None = None) -> list[list[list[int]]]:
    """torch ``DistributedSampler`` (shuffle, ``drop_last=False``) + ``BatchSampler(batch_size)`` per rank.

    Each micro-batch is what ``DataCollatorWithFlattening`` flattens into one row. The budget enters only through
    ``batch_size`` (default :func:`flattening_batch_size`), so a row passes it whenever its documents run long;
    ``DistributedSampler`` repeats documents from the start of its shuffled list to a multiple of ``num_replicas``
    and a rank's last micro-batch may be short.
    """
    lengths = _lengths(lengths, max_tokens)
    return distributed_fixed(lengths.size, num_replicas, seed, epoch, batch_size or flattening_batch_size(lengths,
                                                                                                         max_tokens))


def flatten_with_collator(batch: Sequence[int], lengths: np.ndarray) -> dict:
    """Hugging Face ``DataCollatorWithFlattening`` on a micro-batch of documents (token ids stand in: each document
    is ``l`` copies of its index).

    Returns:
        The collator's output (``return_flash_attn_kwargs=True``, numpy): ``input_ids`` ``[1, N]``, ``labels``,
        ``position_ids``, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[D + 1]``, ``max_length_q`` / ``max_length_k``.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="np")
    return collator([{"input_ids": [int(i)] * int(lengths[i])} for i in batch])


# torchtune: greedy sequential packing in dataset order, packed once.


def greedy_packs(lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Documents in dataset order, appended to the current pack until the next one does not fit (torchtune
    ``PackedDataset`` with ``split_across_pack=False``; it pads each pack to ``max_seq_len``, which is left out here).

    Example:
        >>> greedy_packs(np.array([3, 4, 2, 5, 1]), 7)
        [[0, 1], [2, 3], [4]]
    """
    lengths = _lengths(lengths, max_tokens)
    packs, current, used = [], [], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > max_tokens:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    packs.append(current)
    return packs


def greedy_sequential(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, epoch: int,
                      ) -> list[list[list[int]]]:
    """:func:`greedy_packs` (packed once, the same every epoch), one pack per micro-batch, packs dealt by torch
    ``DistributedSampler`` (shuffle per epoch, ``drop_last=False``: repeats packs to a multiple of the ranks)."""
    packs = greedy_packs(lengths, max_tokens)
    dealt = distributed_fixed(len(packs), num_replicas, seed, epoch, 1)
    return [[packs[b[0]] for b in rank] for rank in dealt]


# NeMo / Megatron: first-fit-decreasing, dealt round-robin.


def first_fit_decreasing(lengths: np.ndarray, max_tokens: int, order: np.ndarray | None = None) -> list[list[int]]:
    """First-fit-decreasing bin packing: longest document first, each into the first pack it fits.

    The classic heuristic (Johnson, 1973; NeMo's ``first_fit_decreasing`` in ``sequence_packing_utils``), found
    with a max segment tree over the packs' free tokens instead of a scan: the same packs in
    ``O(n log packs)``.

    Args:
        lengths: int ``[num_documents]``, tokens per document, each <= ``max_tokens``.
        max_tokens: tokens per pack.
        order: documents in the order ties of equal length are taken (default: dataset order).

    Example:
        >>> first_fit_decreasing(np.array([3, 4, 2, 5, 1]), 7)
        [[3, 2], [1, 0], [4]]
    """
    lengths = _lengths(lengths, max_tokens)
    order = np.arange(lengths.size) if order is None else np.asarray(order)
    order = order[np.argsort(-lengths[order], kind="stable")]
    size = 1 << max(1, math.ceil(math.log2(lengths.size)))  # leaves: at most one pack per document
    tree = np.full(2 * size, max_tokens, dtype=np.int64)  # max free tokens below each node; unused packs are empty
    packs: list[list[int]] = []
    for doc in order.tolist():
        need, node = int(lengths[doc]), 1
        while node < size:  # descend to the leftmost leaf with room for `need`
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        leaf = node - size
        if leaf == len(packs):
            packs.append([])
        packs[leaf].append(doc)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return packs


def ffd_round_robin(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, epoch: int,
                    repack_each_epoch: bool = False) -> list[list[list[int]]]:
    """:func:`first_fit_decreasing`, packs shuffled by ``(seed, epoch)``, pack ``k`` to rank ``k % num_replicas``.

    NeMo writes the packs once before training (``prepare_packed_sequence_data``), so by default the packs are the
    same every epoch and only their order changes; ``repack_each_epoch`` re-packs with equal lengths in a random
    order each epoch. Round-robin leaves ranks with different counts unless the pack count divides evenly.
    """
    lengths = _lengths(lengths, max_tokens)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(lengths.size) if repack_each_epoch else None
    packs = first_fit_decreasing(lengths, max_tokens, order)
    packs = [packs[k] for k in rng.permutation(len(packs))]
    return [packs[r::num_replicas] for r in range(num_replicas)]


# verl: Karmarkar–Karp on 24576 L + L^2.


def verl_workload(lengths: np.ndarray) -> np.ndarray:
    """verl's workload of a document of ``L`` tokens, ``24576 L + L^2`` (FLOPs of a 7B model up to a factor; int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return 24576 * lengths + lengths * lengths


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Split items into ``k`` parts of near-equal sums by the largest differencing method.

    Karmarkar & Karp (1982), "The differencing method of set partitioning", in its k-way form as verl balances
    sequence lengths (``verl.utils.seqlen_balancing.karmarkar_karp``). Each partial solution holds ``k`` parts
    ordered by sum; the two with the largest spread (largest minus smallest sum) are merged, the largest part of
    one with the smallest of the other, until one remains. With ``equal_size`` the items, sorted, start as
    partial solutions of ``k`` consecutive items (one per part), so every part gets ``len(values) / k`` items.

    Args:
        values: item weights (ints).
        k: parts, ``1 <= k <= len(values)``.
        equal_size: every part gets the same number of items; ``len(values)`` must be a multiple of ``k``.

    Returns:
        ``k`` lists of item positions, each sorted, every position once.

    Raises:
        ValueError: ``k`` outside ``[1, len(values)]``, or ``equal_size`` with ``len(values) % k != 0``.

    Example:
        >>> karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)  # sums 7 + 5 + 4 = 16 and 8 + 6 = 14
        [[1, 3, 4], [0, 2]]
    """
    n = len(values)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] (one item per part at least), got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(values) a multiple of k, got {n} items and k={k}")
    order = sorted(range(n), key=lambda i: (values[i], i))
    tie = itertools.count()
    heap: list[tuple[int, int, int, list[tuple[int, list[int]]]]] = []

    def push(parts: list[tuple[int, list[int]]]) -> None:  # parts sorted by sum, largest first
        heapq.heappush(heap, (parts[-1][0] - parts[0][0], -parts[0][0], next(tie), parts))

    groups = ([order[i:i + k] for i in range(0, n, k)] if equal_size else [[i] for i in order])
    for group in groups:
        parts = [(int(values[i]), [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
        push(sorted(parts, key=lambda p: -p[0]))
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        push(sorted(merged, key=lambda p: -p[0]))
    return [sorted(items) for _, items in heap[0][3]]


def kk_balanced(lengths: np.ndarray, max_tokens: int, num_replicas: int, seed: int, epoch: int,
                docs_per_step: int | None = None) -> list[list[list[int]]]:
    """verl-style balanced micro-batches: shuffle, cut into global batches, balance ranks, split each rank.

    Per ``(seed, epoch)`` the documents are shuffled and cut into global batches of ``docs_per_step`` documents
    (default: the whole epoch, the most room to balance), rounded down to a multiple of ``num_replicas``; what is
    left over is dropped, as verl's dataloaders (``drop_last=True``) and its equal split need. Each global batch
    is split across ranks by :func:`karmarkar_karp` with equal counts on :func:`verl_workload`
    (``RayPPOTrainer._balance_batch``); each rank's share is split by :func:`karmarkar_karp` (unequal counts) into
    ``ceil(tokens / max_tokens)`` micro-batches, the largest count of any rank, raised by one until every rank's
    micro-batches fit the budget (``rearrange_micro_batches`` with ``same_micro_num_in_dp``), then ordered by
    workload, heaviest in the middle. Ties of equal length are broken by position in the shuffled batch.
    """
    lengths = _lengths(lengths, max_tokens)
    order = np.random.default_rng([seed, epoch]).permutation(lengths.size)
    step = docs_per_step or lengths.size
    step -= step % num_replicas
    if step < num_replicas:
        raise ValueError(f"a global batch must give each of {num_replicas} ranks a document, got "
                         f"{docs_per_step or lengths.size} documents per step ({lengths.size} in all); raise "
                         "docs_per_step or use fewer ranks")
    out: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    for start in range(0, order.size - step + 1, step):
        docs = order[start:start + step]
        work = verl_workload(lengths[docs]).tolist()
        shares = [docs[p] for p in karmarkar_karp(work, num_replicas, equal_size=True)]
        count = max(-(-int(lengths[s].sum()) // max_tokens) for s in shares)
        while True:
            split = [[s[p] for p in karmarkar_karp(verl_workload(lengths[s]).tolist(), min(count, s.size), False)]
                     for s in shares]
            if all(int(lengths[b].sum()) <= max_tokens for rank in split for b in rank):
                break
            count += 1
        for r, batches in enumerate(split):
            batches.sort(key=lambda b: (-int(verl_workload(lengths[b]).sum()), int(b[0])))
            batches = batches[::2][::-1] + batches[1::2]  # lightest at both ends
            out[r] += [b.tolist() for b in batches]
    return out


#: Name -> peer, each ``peer(lengths, max_tokens, num_replicas, seed, epoch) -> RankBatches``.
PACKING_PEERS = {
    "hf_flattening": hf_flattening,
    "greedy_sequential": greedy_sequential,
    "ffd_round_robin": ffd_round_robin,
    "ffd_repacked": lambda *args: ffd_round_robin(*args, repack_each_epoch=True),
    "kk_balanced": kk_balanced,
}
