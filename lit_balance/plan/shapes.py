"""Static shapes: packed rows of one fixed layout, and padded micro-batches of at most K shapes.

Compilers and graph capture keep one program per input shape: ``torch.compile(dynamic=False)`` recompiles for each
new shape until its recompile limit (8) and then runs eagerly, CUDA graphs re-record, XLA recompiles. Two settings
of :class:`~lit_balance.BatchingSettings` bound the shapes an epoch uses (docs/compiling.md):

* ``static_packing=True`` (with ``packing``): every micro-batch is one row of exactly ``max_tokens`` token slots, and
  ``cu_seq_lens_q/k`` has ``cap + 1`` entries, ``cap = max_batch_size`` documents per row. The plan is the packed
  plan with that cap (:class:`StaticPackedPlanner`); the collator pads the row's tail and the boundaries.
  Without a ``max_batch_size`` the cap is chosen from the lengths (:func:`choose_document_cap`).
* ``padded_shapes``: every padded micro-batch has one of a few ``(rows, length)`` shapes. An int ``K`` chooses
  ``K`` lengths from the length distribution, the ones that pad the fewest token slots (an exact dynamic program
  over the distinct lengths, :func:`choose_padded_shapes`), each with the rows that its samples fill in the
  micro-batches the plan has: the fewest the budget allows, rounded up to a multiple of the ranks times
  ``accumulate_grad_batches`` (every rank runs as many), the micro-batches added spread over the shapes so that no
  micro-batch is left to shorter samples padded up or to empty rows. The plan is the padded plan of the lengths
  rounded up to their shape's length (:class:`ShapedPaddedPlanner`), so it keeps the padded planner's guarantees
  (budget, equal counts, windows, resume) and its rank assignment (LPT within each step), with each micro-batch
  taking the rows of its longest sample's shape rather than cut to equal costs (every micro-batch of a shape costs
  the same); each micro-batch is then padded to the smallest shape that holds it (:func:`shape_index`).

Worked example (``max_tokens=64``, lengths 3, 5, 9, 9, 30, ``padded_shapes=2``): the lengths 9 and 30 pad the
fewest slots (3 and 5 pad to 9, 9 stays, 30 stays: 10 slots of padding); the budget holds 7 rows of 9 and 2 of 30,
but one micro-batch of each holds all their samples, so the shapes are ``(4, 9)`` and ``(1, 30)``: a micro-batch of
the four shortest is ``[4, 9]``, one of the 30 ``[1, 30]``, with no empty row (``(7, 9)`` and ``(2, 30)`` would
pad 36 + 30 slots more).

The choices depend only on the lengths (as a multiset), the settings and the number of ranks, and are made once per
sampler, over all its samples (:func:`resolve_static_shapes`), so every window, epoch and rank uses the same shapes;
a resume on another number of ranks plans the rest of the epoch with that number's shapes
(:mod:`lit_balance.sampler.state`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.packed import PackedPlanner
from lit_balance.plan.padded import PaddedPlanner, count_filled_steps, plan_filled
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import EpochPlan, WorstCaseBatch, padded_lengths

__all__ = ["ShapedPaddedPlanner", "StaticPackedPlanner", "choose_document_cap", "choose_padded_shapes",
           "epoch_shapes", "length_histogram", "probe_planner", "resolve_split_shapes", "resolve_static_shapes",
           "shape_index", "static_planner"]

_DP_CANDIDATES = 1024  # most distinct lengths the shape choice considers (quantiles of the distinct ones beyond)


def length_histogram(lengths: np.ndarray, eligible: np.ndarray | None = None, chunk: int = 1 << 22) -> np.ndarray:
    """int64 ``[longest + 1]``: how many (eligible) samples have each length, read in chunks (a memory map stays
    one)."""
    n = int(lengths.shape[0])
    hist = np.zeros(1, dtype=np.int64)
    for lo in range(0, n, chunk):
        part = np.asarray(lengths[lo:lo + chunk], dtype=np.int64)
        if eligible is not None:
            part = part[np.asarray(eligible[lo:lo + chunk])]
        if part.size:
            counts = np.bincount(part)
            if counts.shape[0] > hist.shape[0]:
                counts[:hist.shape[0]] += hist
                hist = counts
            else:
                hist[:counts.shape[0]] += counts
    return hist


def choose_document_cap(hist: np.ndarray, settings: BatchingSettings) -> int:
    """The documents per packed row that ``static_packing`` pads ``cu_seq_lens`` to, when ``max_batch_size`` is None.

    The packed planner deals the short documents (at most an eighth of the row) at random over the rows, so a row of
    short documents only holds about ``capacity / mean`` of them, with a standard deviation of
    ``sqrt(capacity * var / mean**3)`` (renewal counting). The cap is that mean plus four standard deviations plus
    8 (the planner's finishing stage places the shortest documents last), rounded up to a multiple of 8, and never
    above the documents that fit a row at all (``capacity // shortest``) or the number of documents: the cap rarely
    binds, so the real-token fraction stays that of the free packed plan.

    Args:
        hist: int ``[longest + 1]``: samples per length (:func:`length_histogram`), the planned ones.
        settings: the batching settings (``truncate_to`` is the row's room in real tokens).

    Returns:
        The cap (documents per row, >= 1).
    """
    hist = np.asarray(hist, dtype=np.int64)
    values = np.flatnonzero(hist)
    if not values.size:
        return 1
    counts = hist[values].astype(np.float64)
    capacity = settings.truncate_to
    short = 8 * values <= capacity
    if not short.any():
        return 8 if int(counts.sum()) >= 8 else int(counts.sum())
    v, c = values[short].astype(np.float64), counts[short]
    mean = float((v * c).sum() / c.sum())
    var = float(((v - mean) ** 2 * c).sum() / c.sum())
    per_row = capacity / mean + 4.0 * math.sqrt(capacity * var / mean**3) + 8.0
    cap = -(-int(math.ceil(per_row)) // 8) * 8
    shortest = int(values[0]) if values[0] > 0 else 1
    return int(max(1, min(cap, capacity // shortest, int(counts.sum()))))


def choose_padded_shapes(hist: np.ndarray, settings: BatchingSettings, num_shapes: int,
                         num_replicas: int = 1) -> tuple[tuple[int, int], ...]:
    """``num_shapes`` padded shapes ``(rows, length)`` chosen from the length distribution.

    The lengths are the ``K`` that pad the fewest token slots when every sample is padded up to the next chosen
    length (lengths rounded up to ``pad_to_multiple_of`` first; the longest is always chosen): an exact dynamic
    program over the distinct padded lengths (at most 1,024 candidates, the quantiles of the distinct lengths
    beyond), ``O(K x candidates**2)``, the 1-D optimal bucketing of fairseq's and verl's length buckets done
    exactly. Each shape then gets the rows its samples fill (:func:`_shape_rows`): at most what the budget holds
    (``max_tokens // length``, and ``max_batch_size``), and no more than the micro-batches of the shape need, so
    that the plan's last micro-batch of a shape is full rather than padded from shorter samples or empty; the
    micro-batches the plan adds to give every rank as many (a multiple of ``num_replicas x
    accumulate_grad_batches``) are spread over the shapes by lowering their rows, rather than split from full
    micro-batches. The plan then comes within 0.2 points of the bound on the real length distributions at K = 32,
    on 1 to 64 ranks (docs/benchmarks.md).

    Args:
        hist: int ``[longest + 1]``: samples per length (:func:`length_histogram`), the planned ones.
        settings: the batching settings (``max_tokens``, ``pad_to_multiple_of``, ``max_batch_size``,
            ``accumulate_grad_batches``).
        num_shapes: ``K >= 1``; fewer shapes come back when there are fewer distinct padded lengths.
        num_replicas: the ranks the plan runs on (the rows depend on it, the lengths do not).

    Returns:
        The shapes, sorted by length (tokens), each ``rows x length <= max_tokens``; a micro-batch of the plan takes
        the rows of its longest sample's shape (:class:`ShapedPaddedPlanner`).

    Example:
        >>> hist = np.bincount([3, 5, 9, 9, 30])
        >>> choose_padded_shapes(hist, BatchingSettings(max_tokens=64), 2)
        ((4, 9), (1, 30))
    """
    hist = np.asarray(hist, dtype=np.int64)
    values = np.flatnonzero(hist)
    if not values.size:
        raise InputValueError("padded_shapes: no sample to choose shapes from", parameter="padded_shapes")
    m = settings.pad_to_multiple_of
    padded = padded_lengths(values, m)
    uniq, inverse = np.unique(padded, return_inverse=True)
    counts = np.bincount(inverse, weights=hist[values]).astype(np.float64)
    tokens = np.bincount(inverse, weights=hist[values] * values).astype(np.float64)
    cum_n, cum_t = np.concatenate([[0.0], np.cumsum(counts)]), np.concatenate([[0.0], np.cumsum(tokens)])
    cand = np.arange(uniq.shape[0])
    if cand.shape[0] > _DP_CANDIDATES:  # quantiles of the distinct lengths by samples, the longest kept
        q = np.searchsorted(cum_n[1:], np.linspace(0, cum_n[-1], _DP_CANDIDATES), side="left")
        cand = np.unique(np.concatenate([q, [uniq.shape[0] - 1]]))
    edge = uniq[cand].astype(np.float64)
    n_le, t_le = cum_n[cand + 1], cum_t[cand + 1]  # samples and tokens at or below each candidate
    n_lo, t_lo = np.concatenate([[0.0], n_le[:-1]]), np.concatenate([[0.0], t_le[:-1]])
    # pad[i, j]: padding of the samples above candidate i - 1, up to candidate j, padded to candidate j's length
    pad = edge[None, :] * (n_le[None, :] - n_lo[:, None]) - (t_le[None, :] - t_lo[:, None])
    pad[np.tril_indices(cand.shape[0], -1)] = np.inf
    k = min(int(num_shapes), cand.shape[0])
    best, back = pad[0].copy(), []  # best[j]: least padding of everything up to candidate j with the shapes so far
    for _ in range(1, k):
        total = np.concatenate([[np.inf], best[:-1]])[:, None] + pad
        arg = np.argmin(total, axis=0)
        back.append(arg)
        best = np.minimum(best, total[arg, np.arange(total.shape[1])])
        back[-1] = np.where(total[arg, np.arange(total.shape[1])] <= best, arg, -1)
    chosen, j = [cand.shape[0] - 1], cand.shape[0] - 1
    for arg in reversed(back):  # -1: that shape was not needed for candidates up to j
        i = int(arg[j])
        if i > 0:
            j = i - 1
            chosen.append(j)
    lengths = np.array(sorted({int(uniq[cand[c]]) for c in chosen}), dtype=np.int64)
    per_shape = np.bincount(np.searchsorted(lengths, uniq, side="left"), weights=counts, minlength=lengths.shape[0])
    rows = _shape_rows(lengths, np.rint(per_shape).astype(np.int64), settings.max_tokens, settings.max_batch_size,
                       int(num_replicas) * settings.accumulate_grad_batches)
    return tuple((int(r), int(L)) for r, L in zip(rows, lengths))


def _shape_rows(lengths: np.ndarray, counts: np.ndarray, max_tokens: int, max_batch_size: int | None,
                multiple: int = 1) -> np.ndarray:
    """int64 ``[K]``: the rows of each shape, so that its samples fill its micro-batches with few rows to spare, in a
    number of micro-batches that is a multiple of ``multiple`` (the ranks times ``accumulate_grad_batches``).

    The plan fills micro-batches longest first, each taking the rows of its first sample's shape, so the rows of a
    shape's last micro-batch that its own samples leave free go to the next shorter samples, padded up to the shape's
    length. Going from the longest shape down, a shape of length ``L`` with ``c`` samples still to place (its own,
    less those the longer shape took) holds at most ``R = max_tokens // L`` rows (and ``max_batch_size``);
    ``m = ceil(c / R)`` micro-batches of ``ceil(c / m)`` rows leave fewer than ``m`` rows to the next shape, where
    ``R`` rows leave up to ``R - 1``.

    Every rank runs the same number of micro-batches, so the plan's count is rounded up to that multiple: a
    micro-batch added to a plan of full shapes would be padded to a whole shape. The micro-batches up to the multiple
    are given to the shapes instead: one shape at a time loses a row, the one whose samples, spread over more
    micro-batches, add the fewest padded token slots per micro-batch added (the chain above evaluated for each
    shape), until the count is the multiple; the shapes then stay full at the count the plan needs.
    """
    most = max_tokens // lengths
    if max_batch_size is not None:
        most = np.minimum(most, max_batch_size)
    num = lengths.shape[0]
    length_list, count_list = lengths.tolist(), np.asarray(counts).tolist()

    def chain(cap: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each row of ``cap`` (int64 ``[trials, K]``, at most that many rows per shape): the rows and the samples
        left of each shape (``[trials, K]``), the micro-batches in all and their padded slots (``[trials]``)."""
        trials = cap.shape[0]
        rows, left_of = cap.copy(), np.zeros_like(cap)
        carry = np.zeros(trials, dtype=np.int64)  # rows the longer shape's last micro-batch leaves to this one
        count, slots = np.zeros(trials, dtype=np.int64), np.zeros(trials, dtype=np.int64)
        for k in range(num - 1, -1, -1):
            left = left_of[:, k] = count_list[k] - carry
            placed = left > 0
            batches = np.where(placed, -(-left // cap[:, k]), 0)
            rows[:, k] = np.where(placed, -(-left // np.maximum(batches, 1)), cap[:, k])
            count += batches
            slots += batches * rows[:, k] * length_list[k]
            carry = np.where(placed, batches * rows[:, k] - left, -left)
        return rows, left_of, count, slots

    cap = np.maximum(most, 1).astype(np.int64)[None, :]
    rows, left_of, count, slots = (x[0] for x in chain(cap))
    target = -(-int(count) // multiple) * multiple
    while count < target:
        movable = np.flatnonzero((left_of > 0) & (rows > 1))  # shapes whose samples can take one row less
        if not movable.size:
            break
        trial = np.repeat(cap, movable.shape[0], axis=0)
        trial[np.arange(movable.shape[0]), movable] = rows[movable] - 1
        t_rows, t_left, t_count, t_slots = chain(trial)
        fits = (t_count > count) & (t_count <= target)
        if not fits.any():  # no shape takes one more micro-batch within the multiple: the plan splits the rest
            break
        score = np.where(fits, (t_slots - slots) / np.maximum(t_count - count, 1), np.inf)
        best = int(np.argmin(score))  # the fewest padded slots per micro-batch added (ties: the shortest shape)
        cap = trial[best:best + 1]
        rows, left_of, count, slots = t_rows[best], t_left[best], t_count[best], t_slots[best]
    return np.asarray(rows, dtype=np.int64)


def resolve_static_shapes(lengths: np.ndarray, settings: BatchingSettings,
                          eligible: np.ndarray | None = None, num_replicas: int = 1) -> BatchingSettings:
    """``settings`` with their static shapes made explicit from the samples to plan: the document cap of
    ``static_packing`` (as ``max_batch_size``) and the shapes of an int ``padded_shapes``; ``settings`` itself when
    neither needs a choice. A sampler calls this once, over all its samples.

    Args:
        lengths: int ``[num_samples]``: tokens per sample as planned (after truncation).
        settings: the batching settings.
        eligible: bool ``[num_samples]``: the samples planned (None: all).
        num_replicas: the ranks the plan runs on (an int ``padded_shapes`` chooses rows for them).

    Raises:
        ValueError: an explicit ``padded_shapes`` whose longest shape is shorter than a planned sample (naming the
            setting, the sample and its length).
    """
    if not settings.static_packing and settings.padded_shapes is None:
        return settings
    if settings.static_packing and settings.max_batch_size is not None:
        return settings
    hist = length_histogram(lengths, eligible)
    if settings.static_packing:
        return settings.replace(max_batch_size=choose_document_cap(hist, settings))
    if isinstance(settings.padded_shapes, int):
        return settings.replace(padded_shapes=choose_padded_shapes(hist, settings, settings.padded_shapes,
                                                                   num_replicas))
    room = settings.padded_shapes[-1][1]
    longest = hist.shape[0] - 1
    if longest > room:
        mask = np.asarray(lengths) > room
        if eligible is not None:
            mask &= np.asarray(eligible)
        first = int(np.flatnonzero(mask)[0])
        if settings.too_long == "truncate":  # already truncating, at the budget: only a shorter cut helps
            cut = (f"too_long='truncate' cuts samples at {settings.truncate_to} tokens (max_tokens), not at the "
                   f"longest shape: truncate them to at most {room} tokens before planning (the DataModule's "
                   f"max_length={room})")
        else:
            cut = f"truncate the samples to at most {room} tokens (the DataModule's max_length={room})"
        raise InputValueError(
            f"padded_shapes {[list(s) for s in settings.padded_shapes]} cannot hold the longest sample: index {first} "
            f"has {int(np.asarray(lengths)[first])} tokens, the longest shape {room}; add a shape (rows, length) with "
            f"length >= {longest} and rows x length <= max_tokens={settings.max_tokens}, or {cut}",
            parameter="padded_shapes")
    return settings


def resolve_split_shapes(settings: BatchingSettings, *splits: np.ndarray, num_replicas: int = 1) -> BatchingSettings:
    """``settings`` with an int ``padded_shapes`` chosen from several splits' lengths together (the training and the
    validation split), so that the shapes hold every split's documents; ``settings`` itself otherwise (a list of
    shapes is the user's, and ``static_packing``'s cap is chosen by each sampler).

    Each split is counted as its sampler plans it: lengths over the budget (:attr:`BatchingSettings.truncate_to`)
    cut to it with ``too_long="truncate"``, left out otherwise (the sampler names them). The lengths are read in
    chunks (:func:`length_histogram`), so a memory map is not copied.

    Args:
        settings: the batching settings.
        splits: int ``[num_samples]`` each: tokens per sample of each split.
        num_replicas: the ranks the training plan runs on (the rows of the shapes depend on it).

    Example:
        >>> s = resolve_split_shapes(BatchingSettings(max_tokens=64, padded_shapes=2), np.array([3, 5]), np.array([9]))
        >>> s.padded_shapes
        ((2, 5), (1, 9))
    """
    if not isinstance(settings.padded_shapes, int):
        return settings
    room = settings.truncate_to
    hist = np.zeros(room + 1, dtype=np.int64)
    for lengths in splits:
        part = length_histogram(lengths)
        hist[:min(part.shape[0], room + 1)] += part[:room + 1]
        if settings.too_long == "truncate":
            hist[room] += part[room + 1:].sum()
    if not hist.any():
        return settings
    hist = hist[:int(np.flatnonzero(hist)[-1]) + 1]
    return settings.replace(padded_shapes=choose_padded_shapes(hist, settings, settings.padded_shapes, num_replicas))


def shape_index(shapes: tuple[tuple[int, int], ...], num_rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """int64 ``[num_batches]``: the shape of each micro-batch of ``num_rows`` rows whose longest is ``longest``
    tokens: the one of fewest slots among those with ``rows >= num_rows`` and ``length >= longest`` (ties: the
    shorter), or -1 where none holds it.

    Args:
        shapes: ``(rows, length)`` pairs sorted by length.
        num_rows, longest: int ``[num_batches]``.
    """
    num_rows, longest = np.atleast_1d(np.asarray(num_rows)), np.atleast_1d(np.asarray(longest))
    out = np.full(num_rows.shape[0], -1, dtype=np.int64)
    best = np.full(num_rows.shape[0], np.iinfo(np.int64).max)
    for k, (rows, length) in enumerate(shapes):
        fits = (num_rows <= rows) & (longest <= length) & (rows * length < best)
        out[fits], best[fits] = k, rows * length
    return out


class ShapedPaddedPlanner(PaddedPlanner):
    """The padded planner with ``padded_shapes``: every micro-batch fits one of ``shapes`` (see the module doc).

    Each sample is planned at its *shape length*: the length of the shortest shape that holds it. The micro-batches
    are filled longest first (:func:`~lit_balance.plan.padded.plan_filled`, samples of one shape length in random
    order), each taking the rows of its first (longest) sample's shape, so a micro-batch whose longest sample has
    shape ``k`` has at most ``rows_k`` rows, :func:`shape_index` finds it shape ``k`` (``rows_k x length_k <=
    max_tokens``), and the shapes are full. Costs and slots (:meth:`batch_costs`) are
    those of the shape each micro-batch is padded to.

    Args:
        shapes: ``(rows, length)`` pairs sorted by length, each within ``max_tokens``.
        max_tokens: the budget (padded token slots per micro-batch).
    """

    def __init__(self, shapes: tuple[tuple[int, int], ...], max_tokens: int) -> None:
        self.shapes = tuple(shapes)
        self.max_tokens = int(max_tokens)
        self._rows = np.array([r for r, _ in self.shapes], dtype=np.int64)
        self._lengths = np.array([length for _, length in self.shapes], dtype=np.int64)

    def _shape_of(self, lengths: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: the shape each sample is padded to (samples longer than every shape: the last)."""
        k = np.searchsorted(self._lengths, np.asarray(lengths, dtype=np.int64), side="left")
        return np.minimum(k, self._lengths.shape[0] - 1)

    def planned_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: each sample's shape length, as planned."""
        return self._lengths[self._shape_of(lengths)]

    def plan(self, lengths: np.ndarray, candidates: np.ndarray, settings: BatchingSettings, *, num_replicas: int,
             epoch: int, cost_model: CostModelProtocol, speeds: np.ndarray, min_steps: int = 0,
             num_batches: int | None = None) -> EpochPlan:
        """:func:`~lit_balance.plan.padded.plan_filled` on the shape lengths, each micro-batch taking the rows of
        the shape of its first (longest) sample."""
        shape = self._shape_of(lengths)
        return plan_filled(self._lengths[shape], candidates, settings, num_replicas=num_replicas, epoch=epoch,
                           cost_model=cost_model, speeds=speeds, min_steps=min_steps, num_batches=num_batches,
                           takes=self._rows[shape])

    def count_steps(self, lengths: np.ndarray, mask: np.ndarray | None, settings: BatchingSettings, num_replicas: int,
                    min_steps: int, cost_model: CostModelProtocol | None = None) -> tuple[int, int, int | None]:
        """:func:`~lit_balance.plan.padded.count_filled_steps` on the shape lengths and rows."""
        shape = self._shape_of(lengths)
        return count_filled_steps(self._lengths[shape], mask, settings, num_replicas, min_steps, cost_model,
                                  takes=self._rows[shape])

    def batch_costs(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                    cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
        """``(cost, slots)``, float64 and int64 ``[num_batches]``: each micro-batch's shape ``(R, T)``, costed as ``R``
        rows of ``T`` tokens (empty rows run too) with ``R x T`` slots; empty micro-batches 0."""
        index = self.batch_shapes(lengths, rows, offsets)
        filled = index >= 0
        r = np.where(filled, self._rows[np.maximum(index, 0)], 0)
        t = np.where(filled, self._lengths[np.maximum(index, 0)], 0)
        cost = np.where(filled, cost_model.batch_cost(np.maximum(r, 1), np.maximum(t, 1)), 0.0) if r.size else \
            np.zeros(0)
        return np.asarray(cost, dtype=np.float64).reshape(-1), r * t

    def batch_shapes(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """int64 ``[num_batches]``: index into :attr:`shapes` of each micro-batch (-1: empty)."""
        sizes = np.diff(offsets)
        longest = np.zeros(sizes.shape[0], dtype=np.int64)
        filled = sizes > 0
        if filled.any():
            longest[filled] = np.maximum.reduceat(np.asarray(lengths, dtype=np.int64)[rows], offsets[:-1][filled])
        index = shape_index(self.shapes, sizes, longest)
        return np.where(filled, index, -1)

    def worst_case_batch(self, settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The micro-batch of ``length``-token rows as collated: the shape that holds ``length`` (all its rows
        ``length`` tokens, padded to the shape's length); None when no shape holds it or it exceeds ``budget``."""
        k = int(np.searchsorted(self._lengths, int(length), side="left"))
        if k >= self._lengths.shape[0]:
            return None
        rows, width = int(self._rows[k]), int(self._lengths[k])
        if rows * width > budget:
            return None
        return WorstCaseBatch(rows=(int(length),) * rows, slots=rows * width, squares=rows * width * width)

    def collator_options(self, settings: BatchingSettings) -> dict:
        """The collator pads each micro-batch to its shape: ``{"shapes": shapes}``."""
        return {"shapes": self.shapes}

    def real_token_fraction_bound(self, lengths: np.ndarray) -> float | None:
        """The real-token fraction of ``lengths`` (int ``[n]``) each padded to the shortest shape length that holds it,
        no row empty: the most micro-batches of these shapes can reach."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not lengths.size:
            return 1.0
        padded_up = self._lengths[np.minimum(np.searchsorted(self._lengths, lengths), self._lengths.shape[0] - 1)]
        return float(lengths.sum() / padded_up.sum())

    def micro_batch_shapes(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                           settings: BatchingSettings) -> tuple[list[tuple[int, int]], list[str]]:
        """The shape each non-empty micro-batch is padded to, and its key ``"RxT"``."""
        shape = [self.shapes[i] for i in self.batch_shapes(lengths, rows, offsets) if i >= 0]
        return shape, [f"{int(r)}x{int(t)}" for r, t in shape]

    @staticmethod
    def steps_together(settings: BatchingSettings) -> bool:
        """False: a mixture's steps are planned one by one, each by this planner (its shapes)."""
        return False


class StaticPackedPlanner(PackedPlanner):
    """The packed planner with ``static_packing``: the packed plan with ``max_batch_size`` documents per row, every
    micro-batch costed and counted as the whole row of ``max_tokens`` slots.

    Args:
        max_tokens: the row's token slots.
        cap: documents per row (``cu_seq_lens`` has ``cap + 1`` entries).
    """

    def __init__(self, max_tokens: int, cap: int) -> None:
        self.max_tokens, self.cap = int(max_tokens), int(cap)

    def batch_costs(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, pad_to_multiple_of: int,
                    cost_model: CostModelProtocol) -> tuple[np.ndarray, np.ndarray]:
        """``(cost, slots)``: the packed cost of the documents, and ``max_tokens`` slots per non-empty micro-batch."""
        cost, _ = PackedPlanner.batch_costs(lengths, rows, offsets, pad_to_multiple_of, cost_model)
        return cost, np.where(np.diff(offsets) > 0, self.max_tokens, 0).astype(np.int64)

    def worst_case_batch(self, settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The packed worst case within ``budget`` with at most ``cap`` documents, as one row of ``budget`` slots."""
        case = PackedPlanner.worst_case_batch(settings, budget, length)
        if case is None:
            return None
        docs = case.rows[:self.cap]
        return WorstCaseBatch(rows=docs, slots=int(budget), squares=sum(d * d for d in docs))

    def collator_options(self, settings: BatchingSettings) -> dict:
        """Rows exactly ``max_tokens`` long with ``cap + 1`` boundaries: ``{"row_length", "max_documents"}``."""
        return {"row_length": self.max_tokens, "max_documents": self.cap}

    def micro_batch_shapes(self, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                           settings: BatchingSettings) -> tuple[list[tuple[int, int]], list[str]]:
        """Every non-empty micro-batch is ``[1, max_tokens]`` with ``cap + 1`` boundaries: key ``"1xT cuB"``."""
        filled = int((np.diff(offsets) > 0).sum())
        return [(1, self.max_tokens)] * filled, [f"1x{self.max_tokens} cu{self.cap + 1}"] * filled

    @staticmethod
    def steps_together(settings: BatchingSettings) -> bool:
        """False: a mixture's steps are planned one by one, each by this planner (its cap of documents)."""
        return False


@functools.lru_cache(maxsize=32)
def _cached(kind: str, key: tuple) -> PaddedPlanner | PackedPlanner:
    return ShapedPaddedPlanner(*key) if kind == "padded" else StaticPackedPlanner(*key)


def static_planner(settings: BatchingSettings) -> PaddedPlanner | PackedPlanner | None:
    """The planner of ``settings``' static shapes, or None when they have none.

    Raises:
        RuntimeError: static shapes not yet chosen from the lengths (an int ``padded_shapes``, or ``static_packing``
            without ``max_batch_size``): :func:`resolve_static_shapes` first (samplers do).
    """
    if settings.static_packing:
        if settings.max_batch_size is None:
            raise RuntimeError("static_packing without max_batch_size: the document cap is chosen from the lengths; "
                               "call lit_balance.plan.shapes.resolve_static_shapes(lengths, settings) first (the "
                               "sampler does), or set max_batch_size")
        return _cached("packed", (settings.max_tokens, settings.max_batch_size))
    if settings.padded_shapes is None:
        return None
    if isinstance(settings.padded_shapes, int):
        raise RuntimeError(f"padded_shapes={settings.padded_shapes}: the shapes are chosen from the lengths; call "
                           "lit_balance.plan.shapes.resolve_static_shapes(lengths, settings) first (the sampler does), "
                           "or give the shapes as a list of (rows, length)")
    return _cached("padded", (settings.padded_shapes, settings.max_tokens))


def epoch_shapes(plan: EpochPlan, lengths: np.ndarray, settings: BatchingSettings,
                 planner: PaddedPlanner | PackedPlanner | None = None) -> dict[str, object]:
    """The shapes an epoch's micro-batches have and its real-token fraction, as collated.

    ``planner`` is the planner whose layout the micro-batches have (:func:`~lit_balance.plan.planner_for` of
    ``settings``; it says each micro-batch's shape); None: the planner of ``settings``' static shapes, else the padded
    planner (as :func:`~lit_balance.plan.plan_stats`).

    Returns:
        ``{"shapes": {"RxT": micro-batches}, "distinct_shapes": int, "real_token_fraction": float,
        "real_token_fraction_bound": float | None}``: shapes as ``rows x tokens`` (packed: ``1xN cuS``, the row's
        length and the entries of ``cu_seq_lens``, whose shape changes a compiled graph too), the real (non-fill)
        tokens over all token slots of all micro-batches of all ranks (global); with ``padded_shapes``, the most that
        fraction can be with the shapes' lengths (every planned sample padded to the shortest shape length that holds
        it, no empty row: with an int ``K`` the best ``K`` lengths' fraction, :func:`choose_padded_shapes`), else
        None.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rows, offsets = plan.rows, plan.batch_offsets
    real_rows = np.where(plan.is_fill, 0, lengths[rows])
    real = int(real_rows.sum())
    if planner is None:
        planner = static_planner(settings) or PaddedPlanner()
    shape, keys = planner.micro_batch_shapes(lengths, rows, offsets, settings)
    bound = planner.real_token_fraction_bound(lengths[rows[~plan.is_fill]])
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    slots = sum(int(r) * int(t) for r, t in shape)
    return {"shapes": counts, "distinct_shapes": len(counts), "real_token_fraction": real / slots if slots else 1.0,
            "real_token_fraction_bound": bound}


class _ProbePlanner:
    """A planner whose worst-case micro-batch (:meth:`worst_case_batch`) is that of the static shapes at any budget,
    for the token budget probe, which tries budgets before ``max_tokens`` is known (:func:`probe_planner`)."""

    def __init__(self, base, hist: np.ndarray, settings: BatchingSettings) -> None:
        self.base, self.name, self.cost_unit = base, base.name, base.cost_unit
        self.row_buckets, self.packed_rows = base.row_buckets, base.packed_rows
        self._hist = hist
        shapes = settings.padded_shapes
        self._chosen = isinstance(shapes, int)
        if self._chosen:  # the lengths do not depend on the budget; the rows do (at most what the budget holds)
            shapes = choose_padded_shapes(hist, settings, shapes)
        self._shapes = shapes

    def collator_options(self, settings: BatchingSettings) -> dict:
        """None: the worst-case rows already fill the static shape."""
        return {}

    def worst_case_batch(self, settings: BatchingSettings, budget: int, length: int) -> WorstCaseBatch | None:
        """The static micro-batch of ``length``-token rows at ``budget``: packed, a full row of ``budget`` slots with
        at most the cap of segments (the cap chosen for that budget when not given; the last segment takes the rest
        of the row, as the tail does); padded, the shape that holds ``length``, its rows ``length`` rounded up to the
        shape's length, as many as the shape and the budget hold."""
        budget, length = int(budget), int(length)
        if self._shapes is None:  # static packing
            case = PackedPlanner.worst_case_batch(settings, budget, length)
            if case is None:
                return None
            cap = settings.max_batch_size or choose_document_cap(self._hist, settings.replace(max_tokens=budget))
            docs = list(case.rows)
            if len(docs) > cap:
                docs = docs[:cap - 1] + [sum(docs[cap - 1:])]
            return WorstCaseBatch(rows=tuple(docs), slots=case.slots, squares=sum(d * d for d in docs))
        fitting = [(r, t) for r, t in self._shapes if t >= length]
        if not fitting:
            return None
        rows, width = fitting[0]
        rows = budget // width if self._chosen else min(rows, budget // width)
        if settings.max_batch_size is not None:
            rows = min(rows, settings.max_batch_size)
        if rows < 1:
            return None
        return WorstCaseBatch(rows=(width,) * rows, slots=rows * width, squares=rows * width * width)


def probe_planner(settings: BatchingSettings, lengths: np.ndarray):
    """With static shapes, the planner the token budget probe (``max_tokens="auto"``) measures with: its worst-case
    micro-batch at each budget tried is the static shape (``[1, budget]`` with at most the cap of segments; the padded
    shape that holds the longest rows). None without static shapes (the probe uses
    :func:`~lit_balance.plan.planner_for`). ``settings``' ``max_tokens`` is not read; ``lengths`` (int
    ``[num_samples]``, the training split's) choose the shapes."""
    if not settings.static_packing and settings.padded_shapes is None:
        return None
    # the layout of the shapes (static packing is packed, padded shapes padded; one budget for every rank)
    base = PackedPlanner() if settings.static_packing else PaddedPlanner()
    return _ProbePlanner(base, length_histogram(np.asarray(lengths)), settings)
