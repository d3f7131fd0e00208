"""Packing peers: how other libraries build packed (padding-free) micro-batches for DDP ranks.

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-02-packed-micro-batches.md``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler

__all__ = ["PACKING_PEERS", "ffd_round_robin", "first_fit_decreasing", "flatten_with_collator",
           "flattening_batch_size", "greedy_packs", "greedy_sequential", "hf_flattening", "karmarkar_karp",
           "kk_balanced", "verl_workload"]


def _lengths(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or int(lengths.min()) < 1:
        raise ValueError(f"lengths must be a non-empty 1-D array of token counts >= 1, got shape {lengths.shape}")
    if int(lengths.max()) > max_tokens:
        raise ValueError(f"a document of {int(lengths.max())} tokens does not fit max_tokens={max_tokens}; cap the "
                         "lengths at the budget (--max-length) first")
    return lengths


def _dealt_by_distributed_sampler(num_items: int, num_replicas: int, seed: int, epoch: int, batch_size: int,
                                  ) -> list[list[list[int]]]:
    """Each rank's batches of item positions from torch ``DistributedSampler`` (shuffle, ``drop_last=False``)."""
    out = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(range(num_items), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        out.append([list(b) for b in BatchSampler(sampler, batch_size, drop_last=False)])
    return out


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
    batch_size = batch_size or flattening_batch_size(lengths, max_tokens)
    return _dealt_by_distributed_sampler(lengths.size, num_replicas, seed, epoch, batch_size)


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
    dealt = _dealt_by_distributed_sampler(len(packs), num_replicas, seed, epoch, 1)
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
