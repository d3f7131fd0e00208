"""A time model calibrated on measured DDP runs, and its projection of every strategy's plans to more ranks.

**The model.** A micro-batch of ``slots`` computed token positions (padded slots: rows x padded length; packed: the
row's tokens) and ``pairs`` attention pairs (padded: rows x padded length**2; packed: the sum of its documents'
squared lengths) takes, on rank ``r``,

    ``t = f_r * (per_micro_batch_s + per_token_s * slots + per_attention_pair_s * pairs)``

seconds, where ``f_r`` is the rank's known slowdown factor (1.0, or ``1 + slowdown`` on a rank slowed by the demo
hook). The token term is the linear FLOPs of the projections, MLP and LM head, the pair term the attention scores
and values (per layer ``24 L d^2`` and ``4 L^2 d`` FLOPs per row of length ``L``: the count of
:class:`lit_balance.CostModel`, whose ``batch_cost`` / ``packed_cost`` this term equals with
``linear=per_token_s, quadratic=per_attention_pair_s, per_batch=per_micro_batch_s``). An optimizer step adds
``per_step_sync_s`` once: the gradient all-reduce and the parameter update (data-parallel training's step is the
slowest rank's compute plus the all-reduce).

**Where ranks wait** (``barrier``). Under DDP alone, ranks meet once per optimizer step, in the all-reduce of its
last backward, so a step takes the slowest rank's *sum* over its micro-batches (``barrier="step"``). Lightning
>= 2.5 also broadcasts a SIGTERM flag from rank 0 before *every* training micro-batch
(``lightning/pytorch/loops/training_epoch_loop.py``, ``_broadcast_sigterm_tensor``, called in ``advance``), which
returns only when every rank has arrived (measured in ``docs/callbacks.md``: every micro-batch is a barrier), so
under Lightning a step takes the *sum over its micro-batches of the slowest rank's time* (``barrier="micro_batch"``,
the default, since ``research/compare_strategies.py`` trains under Lightning 2.6):

    ``T_step = sum over micro-steps i of max_r t(r, i) + per_step_sync_s``   (``"micro_batch"``)
    ``T_step = max_r sum over micro-steps i of t(r, i) + per_step_sync_s``   (``"step"``)

**Noise** (``noise_ratio``). Equal expected times are not equal times: each micro-batch's time on each rank is
taken as normal with standard deviation ``noise_ratio`` x its mean, independent between ranks and micro-batches, and
a wait for the slowest costs the *expected* largest of those times, computed with Clark's moments of the maximum of
normals (C. E. Clark, "The greatest of a finite set of random variables", Operations Research 9(2), 1961: exact
for two ranks, his standard approximation beyond). Without it a fit on 2 ranks puts the bias of the maximum (about
``0.56 x noise_ratio`` of a micro-batch when both ranks are equally loaded, less when one is clearly slower) into the
intercepts, and runs with balanced ranks and runs with unbalanced ones cannot both be predicted well; at 64 or
512 ranks the expected maximum of many noisy times grows further (about ``2.4`` and ``3`` standard deviations), for
every strategy.

**Measured step times** (:func:`measured_step_times`). From the trace (``benchmarks._training.TRACE_FIELDS``), per
rank: from the step's first micro-batch start to the next step's first start (the epoch's last step: to its last
micro-batch end); then the largest over ranks. Per rank these intervals sum exactly to the rank's epoch interval
(first start to last end); the runner's epoch seconds (``run_stats``) are the largest such interval over ranks. The
maximum over ranks of each step is at least the slowest rank's own share, so the steps sum to a little more than the
epoch seconds when ranks jitter; the fit rescales each epoch's step times to sum exactly to its epoch seconds (the
raw ratio is reported as ``step_sum_over_interval``), so that what is fitted is what the headline tokens/s divides.

**Fit** (:func:`fit_time_model`). All four coefficients at once over every run and strategy, non-negative: for a
fixed choice of which rank is the slowest at each micro-step (or step) the model is linear, so non-negative least
squares (``scipy.optimize.nnls``) alternates with re-choosing the slowest rank under the new coefficients until the
choice is stable; the best coefficients under the true maximum are then polished by
``scipy.optimize.least_squares`` (bounds >= 0) under the expected maximum. ``noise_ratio`` is read from the trace
before that: the spread of a rank's micro-batch seconds against the other ranks' at the same micro-step, on the
micro-batches inside accumulation windows (whose start-to-end seconds hold no wait), so a load that slows every rank
alike (another process on the machine) is not mistaken for it. Residuals are relative: each step's error over its
measured time, weighted ``1 / sqrt(steps of its run)`` so every run weighs alike whatever its length, plus one row per
run for its total time (the headline epochs' seconds), so every run's predicted tokens/s is pulled to its measured
one. Only the headline epochs are fitted (the first epoch carries warm-up). ``per_micro_batch_s`` and
``per_step_sync_s`` are told apart only by steps of more than one micro-batch (accumulation), and ``f_r`` scales the
former but not the latter.

**Projection** (:func:`project`). Every strategy's plan of one epoch (epoch 1, the first headline epoch) is built at
each world size exactly as the runner's strategies build it, timed with the fitted model on equal ranks
(``f_r = 1``), with the sync cost scaled from the measured world size ``w`` by the bytes each rank sends in a ring
all-reduce, ``2 (n - 1) / n`` of the gradient (P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009): ``per_step_sync_s x ring(n) / ring(w)``,
twice the 2-rank value at 512 ranks (``sync_scaling="none"`` keeps it constant). Assumptions of a projection, each one a
limit: the whole of ``per_step_sync_s`` is scaled (the parameter update inside it does not grow: an overestimate);
the all-reduce's latency term (``2 (n - 1)`` messages) and the per-micro-batch broadcast's ``log n`` growth are
left out; the noise of a micro-batch's time is the measured machine's and independent between ranks; the measured
machine's per-token speed holds for every rank.

Functions: :func:`fit_time_model`, :func:`predict_run`, :func:`project`,
:func:`plot_calibration`, :func:`plot_projection`; :func:`measured_step_times` for the measured side.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls
from scipy.special import ndtr

from research._training import TRACE_FIELDS

__all__ = ["BARRIERS", "PROJECTION_LABEL", "PROJECTION_STRATEGIES", "RunTrace", "TimeModel", "fit_time_model",
           "measured_step_times", "plot_calibration", "plot_projection", "predict_run", "project",
           "projection_size", "ring_factor"]

_COL = {name: i for i, name in enumerate(TRACE_FIELDS)}
#: Where ranks wait for each other: before every micro-batch (Lightning >= 2.5) or once per optimizer step (DDP).
BARRIERS = ("micro_batch", "step")
#: The label of every projection row.
PROJECTION_LABEL = "projection from measured costs"
#: Strategies :func:`project` can plan (the runner's names).
PROJECTION_STRATEGIES = ("random", "sorted_buckets", "dynamic", "dynamic_accum", "lit_balance",
                         "lit_balance_packed", "hf_flatten")
#: The epoch every projected plan is drawn for (the first headline epoch of the runner).
PROJECTION_EPOCH = 1
_SYNC_SCALINGS = ("ring", "none")
_NOISE_MODES = ("trace", "fit", "none")


# ------------------------------------------------------------------------------------------------------------------
# Inputs and the model.


@dataclass(frozen=True)
class RunTrace:
    """One measured run: its micro-batch trace and headline figure.

    Attributes:
        run: run name, e.g. ``"lit_balance_pair1"``.
        strategy: one of the runner's strategy names.
        trace: float64 ``[world_size, n, len(TRACE_FIELDS)]``: every rank's micro-batches in the order they ran
            (columns: ``benchmarks._training.TRACE_FIELDS``); every rank runs the same ``n`` micro-batches, grouped
            into the same optimizer steps.
        headline_epochs: the epochs whose tokens/s is the headline (e.g. ``(1,)``).
        rank_factors: ``[world_size]``: 1.0, or ``1 + slowdown`` on the slowed rank (its compute takes that much
            longer).
        measured_real_tokens_per_s: the runner's headline figure (``run_stats``), real tokens of all ranks / s.

    Raises:
        ValueError: a trace of the wrong shape or with non-finite values, steps that differ between ranks, a headline
            epoch absent from the trace, factors of the wrong length or not positive, a measured figure not > 0.
    """

    run: str
    strategy: str
    trace: np.ndarray
    headline_epochs: tuple[int, ...]
    rank_factors: tuple[float, ...]
    measured_real_tokens_per_s: float

    def __post_init__(self) -> None:
        trace = np.asarray(self.trace, dtype=np.float64)
        if trace.ndim != 3 or trace.shape[2] != len(TRACE_FIELDS) or trace.shape[0] < 1 or trace.shape[1] < 1:
            raise ValueError(f"RunTrace {self.run!r}: trace must be float [world_size >= 1, micro-batches >= 1, "
                             f"{len(TRACE_FIELDS)}] with columns {list(TRACE_FIELDS)}, got shape {trace.shape}; pass "
                             "Meter.trace as gathered")
        if not np.all(np.isfinite(trace)):
            raise ValueError(f"RunTrace {self.run!r}: trace must be finite, got {int((~np.isfinite(trace)).sum())} "
                             "non-finite values")
        for name in ("epoch", "step"):
            column = trace[:, :, _COL[name]]
            if not np.array_equal(column, np.broadcast_to(column[:1], column.shape)):
                raise ValueError(f"RunTrace {self.run!r}: every rank must run the same micro-batches in the same "
                                 f"{name}s; the {name} column differs between ranks")
        if np.any(np.diff(trace[0, :, _COL["step"]]) < 0):
            raise ValueError(f"RunTrace {self.run!r}: the step column must not decrease along a rank's micro-batches")
        if np.any(trace[:, :, _COL["end_s"]] < trace[:, :, _COL["start_s"]]):
            raise ValueError(f"RunTrace {self.run!r}: a micro-batch ends (end_s) before it starts (start_s)")
        epochs = set(np.unique(trace[0, :, _COL["epoch"]]).astype(int).tolist())
        headline = tuple(int(e) for e in self.headline_epochs)
        if not headline or not set(headline) <= epochs:
            raise ValueError(f"RunTrace {self.run!r}: headline_epochs must be a non-empty subset of the trace's epochs "
                             f"{sorted(epochs)}, got {list(headline)}")
        factors = tuple(float(f) for f in self.rank_factors)
        if len(factors) != trace.shape[0] or not all(math.isfinite(f) and f > 0 for f in factors):
            raise ValueError(f"RunTrace {self.run!r}: rank_factors must be {trace.shape[0]} positive numbers (one per "
                             f"rank), got {list(self.rank_factors)}")
        measured = float(self.measured_real_tokens_per_s)
        if not (math.isfinite(measured) and measured > 0):
            raise ValueError(f"RunTrace {self.run!r}: measured_real_tokens_per_s must be > 0, got {measured!r}")
        object.__setattr__(self, "trace", trace)
        object.__setattr__(self, "headline_epochs", headline)
        object.__setattr__(self, "rank_factors", factors)
        object.__setattr__(self, "measured_real_tokens_per_s", measured)

    @property
    def world_size(self) -> int:
        """Ranks of the run."""
        return int(self.trace.shape[0])


@dataclass(frozen=True)
class TimeModel:
    """Fitted seconds of a micro-batch and of an optimizer step's synchronisation (see the module docstring).

    Attributes:
        per_micro_batch_s: seconds per micro-batch (intercept; data loading, hooks, kernel launches).
        per_token_s: seconds per padded slot (padded) or packed token.
        per_attention_pair_s: seconds per squared sequence length (the ``attention_pairs`` column).
        per_step_sync_s: seconds per optimizer step (gradient all-reduce and parameter update), at the measured
            world size.
        barrier: ``"micro_batch"`` (every micro-batch a barrier, Lightning >= 2.5) or ``"step"``.
        world_size: ranks of the runs it was fitted on (the base of the sync scaling).
        noise_ratio: standard deviation of a micro-batch's time over its mean, independent between ranks and
            micro-batches (0: none). Ranks that wait for the slowest wait for the largest of noisy times, whose
            expectation exceeds the largest expectation (see the module docstring).
    """

    per_micro_batch_s: float
    per_token_s: float
    per_attention_pair_s: float
    per_step_sync_s: float
    barrier: str = "micro_batch"
    world_size: int = 2
    noise_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_micro_batch_s", "per_token_s", "per_attention_pair_s", "per_step_sync_s", "noise_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"TimeModel.{name} must be a finite number >= 0 (seconds), got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.barrier not in BARRIERS:
            raise ValueError(f"TimeModel.barrier must be one of {BARRIERS}, got {self.barrier!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, (int, np.integer)) \
                or self.world_size < 1:
            raise ValueError(f"TimeModel.world_size must be an int >= 1, got {self.world_size!r}")

    @property
    def coef(self) -> np.ndarray:
        """float64 ``[4]``: per micro-batch, per token, per attention pair, per step (seconds)."""
        return np.array([self.per_micro_batch_s, self.per_token_s, self.per_attention_pair_s, self.per_step_sync_s])

    def sync_s(self, num_replicas: int, sync_scaling: str = "ring") -> float:
        """Seconds of one optimizer step's sync at ``num_replicas`` ranks (:func:`ring_factor` relative to the
        measured world size, or unchanged with ``sync_scaling="none"``)."""
        if sync_scaling not in _SYNC_SCALINGS:
            raise ValueError(f"sync_scaling must be one of {_SYNC_SCALINGS}, got {sync_scaling!r}")
        if sync_scaling == "none":
            return self.per_step_sync_s
        base = ring_factor(self.world_size)
        return self.per_step_sync_s * (ring_factor(num_replicas) / base if base > 0 else 1.0)

    def to_dict(self) -> dict[str, Any]:
        """Plain floats (seconds; ``noise_ratio`` a ratio) plus ``barrier`` and ``world_size``, for JSON."""
        return {"per_micro_batch_s": self.per_micro_batch_s, "per_token_s": self.per_token_s,
                "per_attention_pair_s": self.per_attention_pair_s, "per_step_sync_s": self.per_step_sync_s,
                "barrier": self.barrier, "world_size": int(self.world_size), "noise_ratio": self.noise_ratio}


def ring_factor(num_replicas: int) -> float:
    """Bytes each rank sends in a ring all-reduce, per byte of gradient: ``2 (n - 1) / n`` (0 for one rank).

    Example:
        >>> ring_factor(2), ring_factor(8)
        (1.0, 1.75)
    """
    return 2.0 * (num_replicas - 1) / num_replicas


# ------------------------------------------------------------------------------------------------------------------
# The measured side: steps of a trace.


@dataclass(frozen=True)
class _Steps:
    """The headline epochs of one run, as the model sees them.

    ``x``: float64 ``[world, n, 3]`` per micro-batch ``f_r * (1, slots, pairs)``; ``step``: int ``[n]`` step of each
    micro-batch (0..S-1, over the headline epochs); ``measured``: float64 ``[S]`` scaled step seconds; ``raw``:
    unscaled; ``epoch_s``: the epochs' seconds (``run_stats``'s definition); ``real_tokens``: all ranks; ``own``:
    ``[world, n]`` each micro-batch's own seconds (end - start); ``inner``: bool ``[n]``, not the last micro-batch of
    its step (its own seconds hold no wait for the other ranks' gradients and no update).
    """

    x: np.ndarray
    step: np.ndarray
    measured: np.ndarray
    raw: np.ndarray
    epoch_s: np.ndarray
    real_tokens: float
    own: np.ndarray
    inner: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.measured.shape[0])


def _epoch_steps(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(step ids [n] 0..S-1, raw step seconds [S], epoch seconds)`` of one epoch's rows ``[world, n, F]``."""
    steps = trace[0, :, _COL["step"]]
    first = np.flatnonzero(np.concatenate([[True], np.diff(steps) != 0]))  # first micro-batch of each step
    ids = np.cumsum(np.concatenate([[0], (np.diff(steps) != 0).astype(np.int64)]))
    start, end = trace[:, :, _COL["start_s"]], trace[:, :, _COL["end_s"]]
    bounds = np.concatenate([start[:, first], end[:, -1:]], axis=1)  # [world, S + 1]
    per_rank = np.diff(bounds, axis=1)
    epoch_s = float((end[:, -1] - start[:, 0]).max())
    return ids, per_rank.max(axis=0), epoch_s


def _steps(run: RunTrace) -> _Steps:
    t = run.trace
    epochs = t[0, :, _COL["epoch"]].astype(int)
    xs, ids, measured, raw, epoch_s, own, inner = [], [], [], [], [], [], []
    real = 0.0
    offset = 0
    factors = np.asarray(run.rank_factors)[:, None, None]
    for e in run.headline_epochs:
        rows = t[:, epochs == e]
        step_ids, step_s, seconds = _epoch_steps(rows)
        xs.append(factors * np.stack([np.ones(rows.shape[:2]), rows[:, :, _COL["padded_slots"]],
                                      rows[:, :, _COL["attention_pairs"]]], axis=2))
        ids.append(step_ids + offset)
        offset += step_s.shape[0]
        raw.append(step_s)
        total = float(step_s.sum())
        measured.append(step_s * (seconds / total) if total > 0 else step_s)
        epoch_s.append(seconds)
        real += float(rows[:, :, _COL["real_tokens"]].sum())
        own.append(rows[:, :, _COL["end_s"]] - rows[:, :, _COL["start_s"]])
        inner.append(np.append(step_ids[1:] == step_ids[:-1], False))
    return _Steps(np.concatenate(xs, axis=1), np.concatenate(ids), np.concatenate(measured), np.concatenate(raw),
                  np.asarray(epoch_s), real, np.concatenate(own, axis=1), np.concatenate(inner))


def _trace_noise(data: Sequence[_Steps]) -> float | None:
    """``noise_ratio`` read from the trace: the spread of one rank's micro-batch time against the other ranks' at
    the same micro-step, or None when no step of any run holds two micro-batches (or one rank ran alone).

    Only micro-batches that are not the last of their step are used (their own seconds, start to end, hold no wait).
    Their seconds are fitted as ``f_r * (a + b slots + c pairs)`` (non-negative least squares on relative errors);
    each relative residual less its rank's mean in its run (a rank's steady offset is not noise) and less the mean
    over ranks at its micro-step (a load shared by all ranks delays none of them relative to the others) leaves
    ``(1 - 1 / world)`` of the independent variance; its robust spread (1.4826 x the median absolute value) scaled
    back is the estimate.
    """
    rows = [(s.x[:, s.inner], s.own[:, s.inner]) for s in data if s.inner.any() and s.x.shape[0] > 1]
    if not rows or sum(x.shape[1] for x, _ in rows) < 4:
        return None
    features = np.concatenate([x.reshape(-1, 3) for x, _ in rows])
    seconds = np.concatenate([d.reshape(-1) for _, d in rows])
    keep = seconds > 0
    if keep.sum() < 4:
        return None
    coef, _ = nnls(features[keep] / seconds[keep, None], np.ones(int(keep.sum())))
    centred = []
    for x, d in rows:
        predicted = x @ coef
        e = np.divide(d, predicted, out=np.ones_like(d), where=predicted > 0) - 1.0
        e = e - e.mean(axis=1, keepdims=True)
        centred.append((e - e.mean(axis=0, keepdims=True)).reshape(-1))
    world = data[0].x.shape[0]
    c = np.concatenate(centred)
    return float(1.4826 * np.median(np.abs(c)) * math.sqrt(world / (world - 1)))


def measured_step_times(run: RunTrace, scaled: bool = True) -> np.ndarray:
    """Seconds of each optimizer step of the run's headline epochs, in order (float64 ``[steps]``).

    Per rank: from the step's first micro-batch start to the next step's first start (the epoch's last step: to its
    last micro-batch end); the largest over ranks. Unscaled (``scaled=False``) they sum, per epoch, to the epoch's
    seconds (the slowest rank's first start to last end, ``run_stats``) when ranks leave each step together, a bit
    more when they jitter; scaled (the default, what :func:`fit_time_model` fits) each epoch's steps are multiplied
    by one factor so that they sum to its seconds exactly.
    """
    s = _steps(run)
    return s.measured if scaled else s.raw


# ------------------------------------------------------------------------------------------------------------------
# The model's side: step features under a choice of the slowest rank.


def _step_features(x: np.ndarray, step: np.ndarray, num_steps: int, coef3: np.ndarray, barrier: str) -> np.ndarray:
    """float64 ``[S, 4]``: per step the summed ``(1, slots, pairs)`` of the slowest rank under ``coef3``, and 1.

    ``x``: ``[world, n, 3]`` (slowdown factors already in); ``step``: ``[n]``. Ties go to the lowest rank.
    """
    out = np.zeros((num_steps, 4))
    out[:, 3] = 1.0
    if barrier == "micro_batch":
        slowest = np.argmax(x @ coef3, axis=0)  # [n]
        np.add.at(out[:, :3], step, x[slowest, np.arange(x.shape[1])])
    else:
        per_rank = np.zeros((x.shape[0], num_steps, 3))
        np.add.at(per_rank, (slice(None), step), x)
        slowest = np.argmax(per_rank @ coef3, axis=0)  # [S]
        out[:, :3] = per_rank[slowest, np.arange(num_steps)]
    return out


def _design(data: Sequence[_Steps], coef: np.ndarray, barrier: str,
            total_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Weighted rows ``(A, b)`` of the relative residuals: every step of every run, then every run's total."""
    blocks, targets = [], []
    totals, total_targets = [], []
    for s in data:
        f = _step_features(s.x, s.step, s.num_steps, coef[:3], barrier)
        w = 1.0 / (np.maximum(s.measured, 1e-12) * math.sqrt(s.num_steps))
        blocks.append(f * w[:, None])
        targets.append(s.measured * w)
        seconds = float(s.epoch_s.sum())
        totals.append(total_weight * f.sum(axis=0) / seconds)
        total_targets.append(total_weight)
    a = np.concatenate([*blocks, np.asarray(totals)])
    b = np.concatenate([*targets, np.asarray(total_targets)])
    return a, b


def _objective(data: Sequence[_Steps], coef: np.ndarray, barrier: str, total_weight: float) -> float:
    a, b = _design(data, coef, barrier, total_weight)
    return float(np.sum((a @ coef - b) ** 2))


def _expected_max(mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """float64 ``[k]``: expected largest of ``n`` independent normal times per row of ``mu``, ``sd`` ``[k, n]``.

    Clark's moments of the maximum of two normals (C. E. Clark, "The greatest of a finite set of random variables",
    Operations Research 9(2), 1961), applied rank by rank with the running maximum taken as normal (exact for two
    ranks; Clark's approximation beyond). With ``sd`` 0 it is the plain maximum.
    """
    m1, v1 = mu[:, 0].astype(np.float64), sd[:, 0].astype(np.float64) ** 2
    for j in range(1, mu.shape[1]):
        m2, v2 = mu[:, j], sd[:, j] ** 2
        theta = np.sqrt(v1 + v2)
        noisy = theta > 0
        alpha = np.divide(m1 - m2, theta, out=np.zeros_like(theta), where=noisy)
        cdf, cdf_neg = ndtr(alpha), ndtr(-alpha)
        pdf = np.exp(-0.5 * alpha * alpha) / math.sqrt(2 * math.pi)
        mean = m1 * cdf + m2 * cdf_neg + theta * pdf
        second = (m1 * m1 + v1) * cdf + (m2 * m2 + v2) * cdf_neg + (m1 + m2) * theta * pdf
        m1, v1 = np.where(noisy, mean, np.maximum(m1, m2)), np.where(noisy, np.maximum(second - mean * mean, 0.0), 0.0)
    return m1


def _predict_steps(x: np.ndarray, step: np.ndarray, num_steps: int, coef: np.ndarray, noise_ratio: float,
                   barrier: str) -> np.ndarray:
    """float64 ``[S]``: predicted seconds of each step (expected, with each micro-batch's time normal of standard
    deviation ``noise_ratio`` x its mean). ``x``: ``[world, n, 3]`` with the slowdown factors in."""
    t = x @ coef[:3]  # [world, n]
    if barrier == "micro_batch":
        longest = _expected_max(t.T, noise_ratio * t.T)
        return np.bincount(step, weights=longest, minlength=num_steps) + coef[3]
    mean = np.zeros((num_steps, t.shape[0]))
    square = np.zeros((num_steps, t.shape[0]))
    np.add.at(mean, step, t.T)
    np.add.at(square, step, (t * t).T)
    return _expected_max(mean, noise_ratio * np.sqrt(square)) + coef[3]


def _residuals(data: Sequence[_Steps], coef: np.ndarray, noise_ratio: float, barrier: str,
               total_weight: float) -> np.ndarray:
    """The fit's weighted relative residuals: every step of every run, then every run's total."""
    out, totals = [], []
    for s in data:
        predicted = _predict_steps(s.x, s.step, s.num_steps, coef, noise_ratio, barrier)
        out.append((predicted - s.measured) / (np.maximum(s.measured, 1e-12) * math.sqrt(s.num_steps)))
        seconds = float(s.epoch_s.sum())
        totals.append(total_weight * (float(predicted.sum()) - seconds) / seconds)
    return np.concatenate([*out, np.asarray(totals)])


def fit_time_model(runs: Sequence[RunTrace], *, barrier: str = "micro_batch", total_weight: float = 1.0,
                   noise: str = "trace", max_iterations: int = 50) -> TimeModel:
    """Fit the coefficients of the module's model jointly over every run (non-negative).

    Args:
        runs: measured runs of any strategies, all with the same world size (their headline epochs are fitted).
        barrier: ``"micro_batch"`` (Lightning >= 2.5: ranks wait before every micro-batch) or ``"step"``.
        total_weight: weight of each run's total-time row against its steps' rows (relative errors).
        noise: how ``noise_ratio`` is set: ``"trace"`` (default) read from the spread between ranks of the
            micro-batches inside accumulation windows (:func:`_trace_noise`; 0 when no run accumulates),
            ``"fit"`` fitted with the coefficients (bounded to [0, 0.5]), ``"none"`` 0.
        max_iterations: rounds of re-choosing the slowest rank.

    Returns:
        A :class:`TimeModel` in seconds, with ``barrier`` and the runs' ``world_size``.

    Raises:
        ValueError: no runs, runs of different world sizes, an unknown ``barrier`` or ``noise``, fewer than 4
            optimizer steps over all runs, or times no coefficient explains (all 0).
        TypeError: a run that is not a :class:`RunTrace`.

    Example:
        >>> model = fit_time_model(traces)  # doctest: +SKIP
        >>> predict_run(model, traces[0])["calibration_error"]  # doctest: +SKIP
    """
    if barrier not in BARRIERS:
        raise ValueError(f"barrier must be one of {BARRIERS}, got {barrier!r}")
    if noise not in _NOISE_MODES:
        raise ValueError(f"noise must be one of {_NOISE_MODES}, got {noise!r}")
    runs = list(runs)
    if not runs:
        raise ValueError("fit_time_model needs at least one RunTrace (a measured run with its trace), got 0 runs")
    bad = [type(r).__name__ for r in runs if not isinstance(r, RunTrace)]
    if bad:
        raise TypeError(f"fit_time_model needs RunTrace objects, got {bad}")
    worlds = sorted({r.world_size for r in runs})
    if len(worlds) != 1:
        raise ValueError(f"fit_time_model needs runs of one world size (sync is fitted at it), got world sizes "
                         f"{worlds}")
    data = [_steps(r) for r in runs]
    if sum(s.num_steps for s in data) < 4:
        raise ValueError(f"fit_time_model needs at least 4 optimizer steps over all runs to fit 4 coefficients, got "
                         f"{sum(s.num_steps for s in data)}; train longer or pass more runs")
    # column scales for conditioning: the mean of each feature over all steps
    scale = np.mean(np.concatenate([_step_features(s.x, s.step, s.num_steps, np.array([0.0, 1.0, 0.0]), barrier)
                                    for s in data]), axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    # 1. no noise: non-negative least squares, alternating with the choice of the slowest rank
    coef = np.array([0.0, 1.0, 0.0, 0.0])  # first guess of the slowest rank: the most padded slots
    best: tuple[float, np.ndarray, float] = (math.inf, coef.copy(), 0.0)
    seen: set[bytes] = set()
    for _ in range(max_iterations):
        a, b = _design(data, coef, barrier, total_weight)
        solution, _ = nnls(a / scale, b)
        coef = solution / scale
        value = _objective(data, coef, barrier, total_weight)
        if value < best[0]:
            best = (value, coef.copy(), 0.0)
        key = np.round(coef * scale, 12).tobytes()
        if key in seen:
            break
        seen.add(key)
    if not np.any(best[1][:3] > 0):
        raise ValueError("fit_time_model: the measured step times are explained by no micro-batch coefficient "
                         "(all fitted 0); check the trace's start_s / end_s columns")

    # 2. polish under the expected maximum (smooth once noise_ratio > 0); noise_ratio from the trace, fitted or 0
    fixed = (_trace_noise(data) or 0.0) if noise == "trace" else 0.0
    if fixed > 0:
        best = (float(np.sum(_residuals(data, best[1], fixed, barrier, total_weight) ** 2)), best[1], fixed)

    def residuals(z: np.ndarray) -> np.ndarray:
        return _residuals(data, z[:4] / scale, z[4] if noise == "fit" else fixed, barrier, total_weight)

    for start_noise in ((0.0, 0.05) if noise == "fit" else (fixed,)):
        z0 = np.append(best[1] * scale, start_noise)
        upper = np.append(np.full(4, np.inf), 0.5 if noise == "fit" else np.inf)
        polished = least_squares(residuals, z0, bounds=(0.0, upper), method="trf", x_scale="jac")
        value = float(np.sum(residuals(polished.x) ** 2))
        if value < best[0]:
            best = (value, polished.x[:4] / scale, float(polished.x[4]) if noise == "fit" else fixed)
    return TimeModel(*(float(max(c, 0.0)) for c in best[1]), barrier=barrier, world_size=worlds[0],
                     noise_ratio=max(best[2], 0.0))


def predict_run(model: TimeModel, run: RunTrace) -> dict[str, Any]:
    """The model's real tokens/s over the run's headline epochs beside the measured one.

    Predicted = real tokens of the headline epochs (all ranks) / the sum of their predicted step times, each step
    predicted from the micro-batches that ran in it on every rank (with the run's ``rank_factors``).

    Returns:
        ``predicted_real_tokens_per_s``, ``measured_real_tokens_per_s`` (the run's figure),
        ``calibration_error`` (predicted / measured - 1), ``trace_real_tokens_per_s`` (real tokens / epoch seconds
        from the trace itself; equals the measured figure when both come from one run), ``predicted_s`` and
        ``measured_s`` (headline seconds), ``step_sum_over_interval`` (unscaled step times summed over the epoch
        seconds, >= 1), ``step_error_median_abs`` (median over steps of |predicted / measured - 1|),
        ``optimizer_steps``.

    Raises:
        TypeError: ``model`` not a TimeModel or ``run`` not a RunTrace.
    """
    if not isinstance(model, TimeModel):
        raise TypeError(f"predict_run needs a TimeModel, got {type(model).__name__}")
    if not isinstance(run, RunTrace):
        raise TypeError(f"predict_run needs a RunTrace, got {type(run).__name__}")
    s = _steps(run)
    predicted_steps = _predict_steps(s.x, s.step, s.num_steps, model.coef, model.noise_ratio, model.barrier)
    predicted_s = float(predicted_steps.sum())
    measured_s = float(s.epoch_s.sum())
    predicted = s.real_tokens / predicted_s if predicted_s > 0 else float("inf")
    return {
        "run": run.run,
        "strategy": run.strategy,
        "predicted_real_tokens_per_s": predicted,
        "measured_real_tokens_per_s": run.measured_real_tokens_per_s,
        "calibration_error": predicted / run.measured_real_tokens_per_s - 1.0,
        "trace_real_tokens_per_s": s.real_tokens / measured_s if measured_s > 0 else float("nan"),
        "predicted_s": predicted_s,
        "measured_s": measured_s,
        "step_sum_over_interval": float(s.raw.sum()) / measured_s if measured_s > 0 else float("nan"),
        "step_error_median_abs": float(np.median(np.abs(predicted_steps / np.maximum(s.measured, 1e-12) - 1.0))),
        "optimizer_steps": s.num_steps,
    }


# ------------------------------------------------------------------------------------------------------------------
# Projection: every strategy's plan of one epoch at a world size, timed by the model.


@dataclass(frozen=True)
class _Plan:
    """One epoch's micro-batches at ``n`` ranks.

    ``slots``, ``pairs``, ``real``: float64 ``[B]`` per micro-batch; ``real_cost_tokens`` / ``real_cost_pairs``:
    sums over real (non-fill) documents of ``l`` and ``l**2``; ``assignment``: int ``[M, n]`` micro-batch of rank
    ``r`` at micro-step ``s`` (-1: none); ``step``: int ``[M]`` optimizer step of each micro-step.
    """

    slots: np.ndarray
    pairs: np.ndarray
    real: np.ndarray
    real_tokens: float
    real_pairs: float
    assignment: np.ndarray
    step: np.ndarray


def _segments(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, fill: np.ndarray | None,
              packed: bool, pad_to_multiple_of: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(slots, pairs, real)`` per micro-batch of concatenated ``rows`` cut at ``offsets``."""
    l = lengths[rows].astype(np.float64)
    sizes = np.diff(offsets)
    starts = offsets[:-1]
    nonempty = sizes > 0

    def seg(values: np.ndarray, fn: Any) -> np.ndarray:
        out = np.zeros(sizes.shape[0])
        if nonempty.any():
            out[nonempty] = fn.reduceat(values, starts[nonempty])
        return out

    real = seg(l if fill is None else np.where(fill, 0.0, l), np.add)
    if packed:
        total = seg(l, np.add)
        slots = np.ceil(total / pad_to_multiple_of) * pad_to_multiple_of
        pairs = seg(l * l, np.add)
    else:
        width = np.ceil(seg(l, np.maximum) / pad_to_multiple_of) * pad_to_multiple_of
        slots = sizes * width
        pairs = sizes * width * width
    return slots, pairs, real


def _plan_from_rows(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, fill: np.ndarray | None,
                    assignment: np.ndarray, step: np.ndarray, packed: bool, pad_to_multiple_of: int = 1) -> _Plan:
    slots, pairs, real = _segments(lengths, rows, offsets, fill, packed, pad_to_multiple_of)
    keep = np.ones(rows.shape[0], dtype=bool) if fill is None else ~fill
    real_l = lengths[rows[keep]].astype(np.float64)
    return _Plan(slots, pairs, real, float(real_l.sum()), float((real_l * real_l).sum()), assignment, step)


def _fixed_steps(num_micro_steps: int, accumulate: int) -> np.ndarray:
    return np.arange(num_micro_steps) // accumulate


def _distributed_fixed(lengths: np.ndarray, n: int, batch_size: int, seed: int, epoch: int, accumulate: int,
                       packed: bool) -> _Plan:
    """torch ``DistributedSampler(shuffle=True, drop_last=True)`` + ``BatchSampler(batch_size, drop_last=False)``
    on every rank, computed once: the sampler's permutation (``torch.randperm`` seeded ``seed + epoch``), cut to a
    multiple of ``n`` and strided by rank."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(lengths.shape[0], generator=g).numpy()
    per_rank = lengths.shape[0] // n  # drop_last=True: ceil((N - n) / n) == N // n
    per = perm[:per_rank * n].reshape(per_rank, n).T  # [n, per_rank]: rank r takes perm[r::n]
    k = -(-per_rank // batch_size)  # micro-batches per rank, the last maybe short
    padded = np.full((n, k * batch_size), -1, dtype=np.int64)
    padded[:, :per_rank] = per
    # micro-batch (s, r) = padded[r, s*bs:(s+1)*bs]; order micro-batches step-major: b = s * n + r
    cells = padded.reshape(n, k, batch_size).transpose(1, 0, 2).reshape(k * n, batch_size)
    valid = cells >= 0
    sizes = valid.sum(axis=1)
    rows = cells[valid]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    assignment = np.arange(k * n).reshape(k, n)
    return _plan_from_rows(lengths, rows, offsets, None, assignment, _fixed_steps(k, accumulate), packed)


def _dealt(lengths: np.ndarray, batches: list[list[int]], n: int, accumulate: int) -> _Plan:
    """Micro-batches dealt round-robin with the last ``len % n`` dropped (:func:`research.strategies.deal_even`)."""
    keep = len(batches) - len(batches) % n
    kept = batches[:keep]
    sizes = np.fromiter((len(b) for b in kept), dtype=np.int64, count=keep)
    rows = np.fromiter((i for b in kept for i in b), dtype=np.int64, count=int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    k = keep // n
    assignment = np.arange(keep).reshape(k, n)  # deal_even: rank r's s-th micro-batch is batches[s * n + r]
    return _plan_from_rows(lengths, rows, offsets, None, assignment, _fixed_steps(k, accumulate), False)


def _adaptive_steps(sampler: Any, target_tokens_per_step: int) -> np.ndarray:
    """Optimizer step of each micro-step of the sampler's epoch, as :class:`AdaptiveGradAccumulation` (its
    defaults, the runner's) sets ``accumulate_grad_batches``: the callback itself, driven through its hooks by a
    stand-in trainer that runs the epoch's micro-steps in order."""
    from lit_balance import use_training_sampler
    from lit_balance.callbacks import AdaptiveGradAccumulation

    callback = AdaptiveGradAccumulation(target_tokens_per_step=int(target_tokens_per_step))
    trainer = types.SimpleNamespace(
        accumulate_grad_batches=1, train_dataloader=types.SimpleNamespace(sampler=sampler),
        current_epoch=sampler.epoch, num_training_batches=len(sampler), world_size=sampler.num_replicas,
        is_global_zero=False, loggers=[], callback_metrics={}, global_step=0,
        strategy=types.SimpleNamespace(handles_gradient_accumulation=False), callbacks=[callback])
    use_training_sampler(trainer, sampler)  # the sampler whose plan the callback reads
    module = types.SimpleNamespace(automatic_optimization=True)
    callback.on_train_start(trainer, module)
    batch = {"num_real_tokens": 0}
    for i in range(len(sampler)):
        callback.on_train_batch_start(trainer, module, batch, i)
        callback.on_train_batch_end(trainer, module, None, batch, i)
    step = np.zeros(len(sampler), dtype=np.int64)
    for k, (_, first, count, _) in enumerate(callback.history):
        step[first:first + count] = k
    return step


def _balanced(lengths: np.ndarray, n: int, max_tokens: int, seed: int, epoch: int, target: int,
              packing: bool) -> _Plan:
    from lit_balance import BalancedBatchSampler

    sampler = BalancedBatchSampler(lengths, max_tokens, num_replicas=n, rank=0, seed=seed, packing=packing)
    sampler.set_epoch(epoch)
    plan = sampler.plan(epoch)
    step = _adaptive_steps(sampler, target)
    return _plan_from_rows(np.asarray(sampler.lengths, dtype=np.int64), plan.rows, plan.batch_offsets, plan.is_fill,
                           plan.assignment, step, packing, sampler.settings.pad_to_multiple_of)


def _build_plan(strategy: str, lengths: np.ndarray, n: int, *, max_tokens: int, max_length: int, accumulate: int,
                seed: int, epoch: int, cache: dict[str, Any] | None = None) -> _Plan:
    from benchmarks.peers import flattening_batch_size
    from benchmarks.peers import fixed_batch_size, sort_fill_batches
    from research.strategies import sorted_bucket_batches

    target = accumulate * n * max_tokens  # lit_balance's real tokens per optimizer step (AdaptiveGradAccumulation)
    bs = fixed_batch_size(max_tokens, max_length)
    if strategy == "random":
        return _distributed_fixed(lengths, n, bs, seed, epoch, 1, False)
    if strategy == "sorted_buckets":
        return _dealt(lengths, sorted_bucket_batches(lengths, bs, seed, epoch), n, 1)
    if strategy in ("dynamic", "dynamic_accum"):
        cache = {} if cache is None else cache  # the same micro-batches for both; only the steps differ
        if "sort_fill" not in cache:
            cache["sort_fill"] = sort_fill_batches(lengths, max_tokens, seed, epoch)
        return _dealt(lengths, cache["sort_fill"], n, accumulate if strategy == "dynamic_accum" else 1)
    if strategy in ("lit_balance", "lit_balance_packed"):
        return _balanced(lengths, n, max_tokens, seed, epoch, target, strategy == "lit_balance_packed")
    if strategy == "hf_flatten":
        return _distributed_fixed(lengths, n, flattening_batch_size(lengths, max_tokens), seed, epoch, 1, True)
    raise ValueError(f"project: unknown strategy {strategy!r}; expected one of {PROJECTION_STRATEGIES}")


def projection_size(num_documents: int, mean_length: float, num_replicas: int, max_tokens: int,
                    micro_batches_per_rank: int = 16) -> int:
    """Documents a projection plans at ``num_replicas`` ranks: the distribution's own count, or, when that gives
    fewer than ``micro_batches_per_rank`` full-budget micro-batches per rank, ``ceil(micro_batches_per_rank x
    num_replicas x max_tokens / mean_length)`` (lengths resampled with replacement).

    Example:
        >>> projection_size(8600, 45.0, 8, 1024), projection_size(8600, 45.0, 512, 1024)
        (8600, 186414)
    """
    needed = math.ceil(micro_batches_per_rank * num_replicas * max_tokens / mean_length)
    return max(num_documents, needed)


def _time_plan(model: TimeModel, plan: _Plan, n: int, sync_s: float) -> dict[str, Any]:
    coef = model.coef
    batch_s = coef[0] + coef[1] * plan.slots + coef[2] * plan.pairs
    m = np.append(batch_s, 0.0)[plan.assignment]  # [M, n]; -1 (no micro-batch) costs 0
    num_steps = int(plan.step[-1]) + 1 if plan.step.size else 0
    noise = model.noise_ratio
    if model.barrier == "micro_batch":
        compute = np.bincount(plan.step, weights=_expected_max(m, noise * m), minlength=num_steps)
    else:
        per_rank = np.zeros((num_steps, n))
        square = np.zeros((num_steps, n))
        np.add.at(per_rank, plan.step, m)
        np.add.at(square, plan.step, m * m)
        compute = _expected_max(per_rank, noise * np.sqrt(square))
    total_s = float(compute.sum() + num_steps * sync_s)
    real_cost = coef[1] * plan.real_tokens + coef[2] * plan.real_pairs
    slots = float(plan.slots.sum())
    steps_per = np.bincount(plan.step, minlength=num_steps)
    return {
        "predicted_real_tokens_per_s": plan.real_tokens / total_s if total_s > 0 else 0.0,  # 0: nothing planned
        "predicted_optimizer_steps_per_s": num_steps / total_s if total_s > 0 else 0.0,
        "predicted_epoch_s": total_s,
        "padding_ratio": 1.0 - plan.real_tokens / slots if slots > 0 else 0.0,
        "useful_compute_fraction": float(real_cost / (n * compute.sum())) if compute.sum() > 0 else 1.0,
        "sync_share": float(num_steps * sync_s / total_s) if total_s > 0 else 0.0,
        "max_rank_compute_s": float(m.sum(axis=0).max()),
        "max_micro_batch_slots": int(plan.slots.max()) if plan.slots.size else 0,
        "over_budget_micro_batches": None,  # filled by the caller (needs max_tokens)
        "micro_batches_per_rank": int(plan.assignment.shape[0]),
        "optimizer_steps": num_steps,
        "micro_batches_per_step_median": float(np.median(steps_per)) if num_steps else 0.0,
        "real_tokens": round(plan.real_tokens),
    }


def project(model: TimeModel, *, strategies: Sequence[str], lengths: Mapping[str, np.ndarray],
            num_replicas: Sequence[int] = (8, 64, 512), max_tokens: int, max_length: int, accumulate: int,
            seed: int = 0, sync_scaling: str = "ring", micro_batches_per_rank: int = 16) -> list[dict[str, Any]]:
    """Predict every strategy's throughput at every world size from its plan of one epoch (epoch 1).

    Each distribution's lengths are truncated to ``max_length``; at a world size where they give fewer than
    ``micro_batches_per_rank`` full-budget micro-batches per rank they are resampled with replacement to
    :func:`projection_size` documents (``numpy.random.default_rng([seed, num_replicas])``), the same documents for
    every strategy. Plans are built as the runner builds them: ``random`` torch ``DistributedSampler(drop_last=True)``
    + ``BatchSampler`` of ``max_tokens // max_length`` rows; ``sorted_buckets`` and ``dynamic`` / ``dynamic_accum``
    (``accumulate``) dealt round-robin with the remainder dropped; ``lit_balance`` / ``lit_balance_packed``
    :class:`lit_balance.BalancedBatchSampler` (padded / ``packing=True``) with steps as
    :class:`lit_balance.callbacks.AdaptiveGradAccumulation` sets them for ``accumulate x num_replicas x max_tokens``
    real tokens per step; ``hf_flatten`` ``DistributedSampler(drop_last=True)`` +
    ``BatchSampler`` of :func:`benchmarks.peers.flattening_batch_size` documents, each micro-batch one packed
    row (Hugging Face ``DataCollatorWithFlattening``).

    Args:
        model: the fitted :class:`TimeModel`.
        strategies: names from :data:`PROJECTION_STRATEGIES`.
        lengths: ``{distribution name: int [num_documents] tokens per document}``.
        num_replicas: world sizes.
        max_tokens: padded slots (packed: tokens) per micro-batch per rank.
        max_length: tokens kept per document.
        accumulate: ``dynamic_accum``'s ``accumulate_grad_batches`` and lit_balance's target in global budgets.
        seed: the samplers' seed and the resampling seed.
        sync_scaling: ``"ring"`` (``2 (n - 1) / n`` relative to the fitted world size) or ``"none"``.
        micro_batches_per_rank: the fewest full-budget micro-batches per rank before resampling.

    Returns:
        One row per (distribution, num_replicas, strategy): ``strategy``, ``distribution``, ``num_replicas``,
        ``predicted_real_tokens_per_s`` (real tokens of the epoch, all ranks / predicted epoch seconds),
        ``predicted_optimizer_steps_per_s``, ``predicted_epoch_s``, ``padding_ratio`` (1 - real / computed slots,
        all ranks), ``useful_compute_fraction`` (U = the model's cost of the real tokens, ``per_token_s x l +
        per_attention_pair_s x l**2`` summed over real documents, over ``num_replicas x`` the sum over optimizer steps
        of the step's predicted compute without sync; with ``barrier="step"`` exactly
        :attr:`lit_balance.PlanStats.useful_fraction` under ``CostModel(linear=per_token_s,
        quadratic=per_attention_pair_s, per_batch=per_micro_batch_s)``), ``sync_share`` (share of the epoch in sync),
        ``max_rank_compute_s`` (the busiest rank's own compute, s), ``max_micro_batch_slots``,
        ``over_budget_micro_batches`` (above ``max_tokens``), ``micro_batches_per_rank``, ``optimizer_steps``,
        ``micro_batches_per_step_median``, ``real_tokens``, ``num_documents`` (planned), ``resampled``,
        ``sync_scaling``, ``barrier``, and ``label`` = :data:`PROJECTION_LABEL`.

    Raises:
        ValueError: an unknown strategy or ``sync_scaling``; no strategies or distributions; a length array that is
            empty, not 1-D or with a value < 1; a world size, ``max_tokens``, ``max_length`` or ``accumulate`` < 1;
            ``max_length > max_tokens``.
        TypeError: ``model`` not a TimeModel.
    """
    if not isinstance(model, TimeModel):
        raise TypeError(f"project needs a TimeModel, got {type(model).__name__}")
    strategies = list(strategies)
    unknown = [s for s in strategies if s not in PROJECTION_STRATEGIES]
    if not strategies or unknown:
        raise ValueError(f"project: strategies must be a non-empty list from {PROJECTION_STRATEGIES}, got "
                         f"{strategies}")
    if sync_scaling not in _SYNC_SCALINGS:
        raise ValueError(f"project: sync_scaling must be one of {_SYNC_SCALINGS}, got {sync_scaling!r}")
    for name, value in (("max_tokens", max_tokens), ("max_length", max_length), ("accumulate", accumulate),
                        ("micro_batches_per_rank", micro_batches_per_rank),
                        *(("num_replicas", n) for n in num_replicas)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"project: {name} must be an int >= 1, got {value!r}")
    if not list(num_replicas):
        raise ValueError("project: num_replicas must name at least one world size, got none")
    if max_length > max_tokens:
        raise ValueError(f"project: max_length={max_length} exceeds max_tokens={max_tokens}; no fixed batch fits")
    if not lengths:
        raise ValueError("project: lengths must map at least one distribution name to its lengths, got none")
    rows: list[dict[str, Any]] = []
    for name, raw in lengths.items():
        arr = np.asarray(raw)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu" or int(arr.min()) < 1:
            raise ValueError(f"project: lengths[{name!r}] must be a non-empty 1-D int array of token counts >= 1, got "
                             f"shape {arr.shape}, dtype {arr.dtype}")
        arr = np.minimum(arr.astype(np.int64), max_length)
        for n in num_replicas:
            n = int(n)
            size = projection_size(arr.size, float(arr.mean()), n, max_tokens, micro_batches_per_rank)
            docs = arr if size == arr.size else np.random.default_rng([seed, n]).choice(arr, size, replace=True)
            sync_s = model.sync_s(n, sync_scaling)
            cache: dict[str, Any] = {}
            for strategy in strategies:
                plan = _build_plan(strategy, docs, n, max_tokens=max_tokens, max_length=max_length,
                                   accumulate=accumulate, seed=seed, epoch=PROJECTION_EPOCH, cache=cache)
                row = {"strategy": strategy, "distribution": name, "num_replicas": n,
                       **_time_plan(model, plan, n, sync_s)}
                row["over_budget_micro_batches"] = int((plan.slots > max_tokens).sum())
                row.update({"num_documents": int(size), "resampled": bool(size != arr.size),
                            "sync_scaling": sync_scaling, "barrier": model.barrier, "label": PROJECTION_LABEL})
                rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------------
# Plots.


def plot_calibration(runs_with_predictions: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Predicted against measured real tokens/s, one point per run, with y = x and a +-5 % band (PNG).

    Args:
        runs_with_predictions: dicts with ``predicted_real_tokens_per_s``, ``measured_real_tokens_per_s`` and
            ``strategy`` (e.g. :func:`predict_run`'s, or results.json objects).
        path: where to write the PNG.

    Raises:
        ValueError: no runs, or a run without those keys.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(runs_with_predictions)
    keys = ("predicted_real_tokens_per_s", "measured_real_tokens_per_s", "strategy")
    if not runs:
        raise ValueError("plot_calibration needs at least one run, got 0")
    for r in runs:
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"plot_calibration: every run needs keys {list(keys)}, run {r.get('run')!r} lacks "
                             f"{missing}")
    measured = np.array([float(r["measured_real_tokens_per_s"]) for r in runs])
    predicted = np.array([float(r["predicted_real_tokens_per_s"]) for r in runs])
    lo, hi = 0.9 * min(measured.min(), predicted.min()), 1.1 * max(measured.max(), predicted.max())
    fig, ax = plt.subplots(figsize=(6, 5.5))
    line = np.array([lo, hi])
    ax.fill_between(line, line * 0.95, line * 1.05, color="0.85", label="within 5 %")
    ax.plot(line, line, color="0.3", lw=1, label="predicted = measured")
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        idx = [i for i, r in enumerate(runs) if r["strategy"] == strategy]
        ax.scatter(measured[idx], predicted[idx], label=strategy, s=28, zorder=3)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured real tokens/s")
    ax.set_ylabel("predicted real tokens/s (time model)")
    ax.set_title("Time model calibration, one point per run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_projection(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Predicted real tokens/s per rank (all ranks' tokens/s over ``num_replicas``) against ``num_replicas``, one line
    per strategy, one panel per distribution (PNG). Per rank, so that perfect scaling is a flat line and the
    strategies' gaps stay readable.

    Raises:
        ValueError: no rows, or a row without ``strategy``, ``distribution``, ``num_replicas`` and
            ``predicted_real_tokens_per_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    keys = ("strategy", "distribution", "num_replicas", "predicted_real_tokens_per_s")
    if not rows:
        raise ValueError("plot_projection needs at least one row, got 0")
    for r in rows:
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"plot_projection: every row needs keys {list(keys)}, a row lacks {missing}")
    distributions = list(dict.fromkeys(r["distribution"] for r in rows))
    fig, axes = plt.subplots(1, len(distributions), figsize=(4.5 * len(distributions), 4.2), squeeze=False)
    for ax, dist in zip(axes[0], distributions):
        mine = [r for r in rows if r["distribution"] == dist]
        for strategy in dict.fromkeys(r["strategy"] for r in mine):
            pts = sorted((int(r["num_replicas"]), float(r["predicted_real_tokens_per_s"]) / int(r["num_replicas"]))
                         for r in mine if r["strategy"] == strategy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=strategy)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("num_replicas")
        ax.set_title(dist, fontsize=10)
    axes[0][0].set_ylabel("predicted real tokens/s per rank")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(PROJECTION_LABEL)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
