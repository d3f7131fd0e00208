"""The automatic token budget: measure a model's peak memory on worst-case micro-batches and pick ``max_tokens``.

``BalancedTextDataModule(max_tokens="auto")`` runs :class:`TokenBudgetProbe` once, before the first epoch; the probe
can also be run alone (:func:`find_max_tokens`, :meth:`BalancedTextDataModule.find_max_tokens`, ``lit-balance plan
--max_tokens auto``). How it works, per data-parallel rank, all ranks in lockstep:

1. Two shapes of micro-batch, built with the library's own collator (padded or packed, as configured): the longest
   rows the training split holds (its longest document after ``max_length`` truncation) and rows of typical length
   (its median document), as many as a budget of ``B`` token slots holds.
2. For each budget tried, a real forward + backward pass of the LightningModule's ``training_step`` on each shape;
   its peak memory is measured (CUDA: ``torch.cuda.max_memory_allocated`` after a reset; CPU: the process's peak
   resident set size, VmHWM, reset through ``/proc/self/clear_refs`` before each pass), plus the optimizer state that
   the first optimizer step will allocate (estimated from the optimizer's class, see :func:`optimizer_state_bytes`).
3. Memory is fitted by least squares as ``a + b * slots + c * squares`` (``slots``: padded token slots of the
   micro-batch; ``squares``: the sum of its squared row lengths, or, packed, of its squared document lengths), with
   ``b, c >= 0``. The largest budget ``B`` whose predicted peak for any micro-batch it admits (at most ``B`` slots,
   rows of at most the longest length ``L``: ``a + b * B + c * B * L``) is at most ``memory_fraction`` of the
   capacity (CUDA: the device's memory, or ``memory_limit`` if smaller; CPU: ``memory_limit``) is then run for the
   shape the fit predicts to need more there (the first time aiming 5 % below the fitted room); the fit is refined
   with every measurement until the next candidate is within 7 % of the largest budget measured under the target. The budget of a rank is the largest budget it measured under the
   target; after an out-of-memory error (which measures no peak), the token slots of the largest micro-batch that
   ran at that budget.

Each probe (one budget on every rank) ends in one ``all_gather`` of its outcome, so a rank that runs out of memory
(``torch.OutOfMemoryError``, ``MemoryError``, or a CPU peak above ``memory_limit``) tells every other rank in the
same collective, and an error of another kind in ``training_step`` is raised on every rank; no rank waits on another.
Gradients, the module's training mode, the random number generators and the state of any
:class:`~lit_balance.lightning.loss.StepTokenLoss` attribute are restored afterwards; the optimizer does not step.
The objects alive when the probe starts are frozen (``gc.freeze``) while it runs, so the garbage collection before
each pass walks only what the probe made; they are unfrozen afterwards (unless the process had frozen objects itself).
``self.log`` calls inside ``training_step`` are ignored during the probe.

The fit-then-verify search follows the secant/regula-falsi idea of fitting a model of a monotone function and
testing its root (e.g. Press et al., "Numerical Recipes", 9.2); the per-budget OOM agreement is what Composer's
automatic micro-batching lacks when only some ranks run out of memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from lit_balance._checks import check_int, check_number
from lit_balance.data.collate import collator_for
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.loss import StepTokenLoss
from lit_balance.plan.epoch import planner_for
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import padded_lengths
from lit_balance.world import DataParallelWorld, data_parallel_world

__all__ = ["DEFAULT_MEMORY_FRACTION", "ProbeMeasurement", "TokenBudget", "TokenBudgetProbe", "find_max_tokens",
           "optimizer_state_bytes"]

#: Share of a device's capacity the chosen budget's predicted and measured peak may use (the rest is headroom for
#: fragmentation, a longer validation batch, and memory the probe does not see).
DEFAULT_MEMORY_FRACTION = 0.9
#: Refinement stops when the fit's next candidate is within this factor of the largest budget measured under target.
_TOLERANCE = 1.07
#: The first candidate aims this share below the fitted room (target less the fit's intercept), so that its one
#: verifying pass usually fits and ends the probe.
_MARGIN = 0.05
_MAX_REFINE_ROUNDS = 4
_OK, _OVER, _OOM, _ERROR = 0, 1, 2, 3
_STATUS = {_OK: "ok", _OVER: "over", _OOM: "out of memory", _ERROR: "error"}
_STATE_VERSION = 1


class ProbeOutOfMemory(RuntimeError):
    """One probe pass exceeded the memory it may use (raised by a meter or the device)."""


SHARED_BUDGET_TOLERANCE = 0.05  # ranks measured within 5 % of the smallest budget plan with the smallest


@dataclass(frozen=True)
class ProbeMeasurement:
    """One forward + backward pass of the probe on this rank.

    Attributes:
        budget: the token budget tried (padded token slots per micro-batch, per rank).
        shape: ``"longest"`` or ``"typical"`` rows.
        row_length: tokens per row (packed: per document) of the shape.
        slots: padded token slots of the micro-batch built for it.
        squares: sum of squared row lengths (packed: of squared document lengths), tokens**2.
        peak_bytes: peak memory of the pass plus the optimizer state estimate (bytes; 0 when it failed).
        status: ``"ok"``, ``"over"`` (above ``memory_fraction`` of the capacity), ``"out of memory"``.
    """

    budget: int
    shape: str
    row_length: int
    slots: int
    squares: int
    peak_bytes: int
    status: str


@dataclass(frozen=True)
class TokenBudget:
    """The result of the probe: the budget used and what every rank measured (the same on every rank).

    Attributes:
        max_tokens: the budget used: padded token slots per micro-batch, per rank (the smallest of ``per_rank``).
        per_rank: each data-parallel rank's largest budget measured under its target, by rank.
        capacity_bytes: each rank's capacity (bytes): device memory or ``memory_limit``.
        memory_fraction: the share of the capacity a budget may use.
        coefficients: each rank's fit ``(a, b, c)``: bytes, bytes per token slot, bytes per squared token.
        device: ``"cpu"`` or ``"cuda"``.
        probe_seconds: wall time of the probe, the module restored included, the slowest rank (seconds).
        num_probes: probes run (each one collective).
        source: ``"probe"``, or ``"checkpoint"`` when restored from a saved state.
    """

    max_tokens: int
    per_rank: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    memory_fraction: float
    coefficients: tuple[tuple[float, float, float], ...]
    device: str
    probe_seconds: float
    num_probes: int
    source: str = "probe"
    measurements: tuple[ProbeMeasurement, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain types (a checkpoint loads them with ``weights_only=True``); this rank's measurements left out."""
        out = asdict(self)
        out.pop("measurements")
        out["per_rank"] = list(self.per_rank)
        out["capacity_bytes"] = list(self.capacity_bytes)
        out["coefficients"] = [list(c) for c in self.coefficients]
        out["version"] = _STATE_VERSION
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> TokenBudget:
        """Rebuild from :meth:`to_dict`; ``source`` becomes ``"checkpoint"``.

        Raises:
            ValueError: missing or unknown keys, or another version.
        """
        names = {f.name for f in cls.__dataclass_fields__.values()} - {"measurements"}
        if not isinstance(state, Mapping) or set(state) != names | {"version"} or state["version"] != _STATE_VERSION:
            got = sorted(state) if isinstance(state, Mapping) else state
            raise InputValueError(f"a saved token budget must have keys {sorted(names | {'version'})} and version "
                                  f"{_STATE_VERSION}, got {got!r}", parameter="token_budget")
        return cls(max_tokens=int(state["max_tokens"]), per_rank=tuple(int(b) for b in state["per_rank"]),
                   capacity_bytes=tuple(int(b) for b in state["capacity_bytes"]),
                   memory_fraction=float(state["memory_fraction"]),
                   coefficients=tuple(tuple(float(x) for x in c) for c in state["coefficients"]),
                   device=str(state["device"]), probe_seconds=float(state["probe_seconds"]),
                   num_probes=int(state["num_probes"]), source="checkpoint")

    def plan_max_tokens(self, num_replicas: int) -> int | tuple[int, ...]:
        """The ``max_tokens`` to plan with on ``num_replicas`` data-parallel ranks.

        Ranks whose measured budget is within :data:`SHARED_BUDGET_TOLERANCE` (5 %) of the smallest share the
        smallest (a few MiB of measurement noise must not split equal devices into budget classes); the others keep
        their own, as per-rank budgets (``docs/per_rank_budgets.md``). One int when every rank shares it, or when
        ``num_replicas`` is not the number of ranks that measured (a resume on another world size: the smallest).

        Args:
            num_replicas: data-parallel ranks of the run that plans.

        Returns:
            One int (padded token slots per micro-batch, every rank), or one per rank.

        Example:
            >>> budget = TokenBudget(max_tokens=1000, per_rank=(1000, 1030, 2100), capacity_bytes=(1, 1, 2),
            ...                      memory_fraction=0.9, coefficients=((0.0, 1.0, 0.0),) * 3, device="cpu",
            ...                      probe_seconds=1.0, num_probes=3)
            >>> budget.plan_max_tokens(3), budget.plan_max_tokens(2)
            ((1000, 1000, 2100), 1000)
        """
        if len(self.per_rank) != num_replicas:
            return self.max_tokens
        shared = self.max_tokens * (1 + SHARED_BUDGET_TOLERANCE)
        budgets = tuple(self.max_tokens if b <= shared else int(b) for b in self.per_rank)
        return self.max_tokens if len(set(budgets)) == 1 else budgets

    def describe(self) -> str:
        """One line for logs: the budget, every rank's, the capacity and the probe's cost."""
        gib = [f"{c / 2**30:.2f}" for c in self.capacity_bytes]
        return (f"max_tokens={self.max_tokens} padded token slots per micro-batch per rank ({self.source}; per rank "
                f"{list(self.per_rank)}; capacity {gib} GiB {self.device}, memory_fraction {self.memory_fraction}; "
                f"{self.num_probes} probes in {self.probe_seconds:.2f} s)")


# --- memory meters ------------------------------------------------------------------------------------------------
class _CudaMeter:
    """Peak allocated CUDA memory of a pass (``torch.cuda.max_memory_allocated``)."""

    device_kind = "cuda"

    def __init__(self, device: torch.device, memory_limit: int | None) -> None:
        self.device = device
        total = int(torch.cuda.get_device_properties(device).total_memory)
        self.capacity = total if memory_limit is None else min(total, memory_limit)

    def reset(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


class _CpuMeter:
    """Peak resident set size of this process (Linux: VmHWM, reset by writing 5 to ``/proc/self/clear_refs``)."""

    device_kind = "cpu"
    _HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")

    def __init__(self, memory_limit: int | None) -> None:
        if memory_limit is None:
            raise InputValueError("max_tokens='auto' on a CPU needs memory_limit: the bytes of resident memory one "
                                  "rank's process may use (e.g. memory_limit=8 * 2**30)", parameter="memory_limit")
        if not sys.platform.startswith("linux"):
            raise InputValueError(f"the CPU probe reads the peak resident set size from /proc (Linux); this is "
                                  f"{sys.platform}: set max_tokens to an int", parameter="max_tokens")
        self.capacity = memory_limit
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:  # not glibc: freed heap memory may stay resident, and probes then read high (safe side)
            self._trim = None

    def reset(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)  # hand freed heap memory back, so the next peak starts from what is in use
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def peak(self) -> int:
        with open("/proc/self/status") as handle:
            match = self._HWM.search(handle.read())
        if match is None:
            raise RuntimeError("/proc/self/status has no VmHWM line; set max_tokens to an int")
        return int(match.group(1)) * 1024


def _meter(device: torch.device, memory_limit: int | None) -> _CudaMeter | _CpuMeter:
    if device.type == "cuda":
        return _CudaMeter(device, memory_limit)
    if device.type == "cpu":
        return _CpuMeter(memory_limit)
    raise InputValueError(f"max_tokens='auto' measures CUDA or CPU memory; the model is on {device}: set max_tokens "
                          "to an int", parameter="max_tokens")


# --- optimizer state ----------------------------------------------------------------------------------------------
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "SparseAdam": 2,
                    "Adagrad": 0, "SGD": 1, "RMSprop": 1, "Rprop": 2, "ASGD": 1, "LBFGS": 2}


def _optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    """Every optimizer in what ``configure_optimizers`` returns (an optimizer, lists, tuples, dicts)."""
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    if isinstance(obj, Mapping):
        return _optimizers(obj.get("optimizer"))
    if isinstance(obj, (list, tuple)):
        return [o for item in obj for o in _optimizers(item)]
    return []


def optimizer_state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes the optimizers' first step will allocate for parameters that have no state yet.

    Adam-family optimizers keep two tensors per parameter (``exp_avg``, ``exp_avg_sq``), SGD with momentum and
    RMSprop one (RMSprop two with momentum, three centred); Adagrad allocates its state at construction (counted
    in the measured memory). An optimizer of another class counts two tensors per parameter.

    Args:
        optimizers: the optimizers (e.g. ``trainer.optimizers``).

    Returns:
        Bytes (per rank, of unsharded parameters as this process holds them).
    """
    total = 0
    for opt in optimizers:
        name = type(opt).__name__
        for group in opt.param_groups:
            per = _STATE_PER_PARAM.get(name, 2)
            if name == "SGD" and not group.get("momentum", 0):
                per = 0
            if name == "RMSprop":
                per = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
            if name in ("Adam", "AdamW") and group.get("amsgrad", False):
                per = 3
            for p in group["params"]:
                if p.requires_grad and not opt.state.get(p):
                    total += per * p.numel() * p.element_size()
    return total


# --- the shapes of the probe's micro-batches ------------------------------------------------------------------------
def _shape_lengths(lengths: np.ndarray) -> dict[str, int]:
    """``{"longest": L, "typical": median}`` row lengths (tokens) of the training split (after truncation)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise InputValueError("the probe needs the training split's document lengths; it has no documents",
                              parameter="lengths")
    longest, typical = int(lengths.max()), max(1, int(np.median(lengths)))
    return {"longest": longest} if typical == longest else {"longest": longest, "typical": typical}


def _rows(settings: BatchingSettings, budget: int, length: int) -> list[int] | None:
    """Row lengths (padded layout) or document lengths (packed) of the worst-case micro-batch of ``length``-token
    rows under ``budget``; None when not one fits."""
    m = settings.pad_to_multiple_of
    if planner_for(settings).name == "packed":
        room = (budget // m) * m  # real tokens of one packed row, as the packed planner allows
        if room < length:
            return None
        docs = [length] * (room // length)
        if room % length:
            docs.append(room % length)
        return docs
    width = int(padded_lengths(np.array([length]), m)[0])
    rows = budget // width
    if settings.max_batch_size is not None:
        rows = min(rows, settings.max_batch_size)
    return None if rows < 1 else [length] * rows


def _features(settings: BatchingSettings, rows: list[int]) -> tuple[int, int]:
    """``(padded token slots, sum of squared row or document lengths)`` of a probe micro-batch."""
    m = settings.pad_to_multiple_of
    if planner_for(settings).name == "packed":
        return int(padded_lengths(np.array([sum(rows)]), m)[0]), sum(r * r for r in rows)
    width = int(padded_lengths(np.array([max(rows)]), m)[0])
    return len(rows) * width, len(rows) * width * width


def fit_memory(slots: Sequence[float], squares: Sequence[float], peak_bytes: Sequence[float],
               weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """Least-squares fit ``peak = a + b * slots + c * squares`` with ``b, c >= 0`` (a coefficient that comes out
    negative is set to 0 and the rest refitted), each measurement weighted by ``weights`` (None: equally).

    Args:
        slots: padded token slots of each measured micro-batch.
        squares: sum of squared row lengths of each (tokens**2).
        peak_bytes: measured peak of each (bytes).
        weights: the weight of each measurement in the squared error (> 0), or None.

    Returns:
        ``(a, b, c)``: bytes, bytes per token slot, bytes per squared token.

    Example:
        >>> a, b, c = fit_memory([100, 200, 300], [1e4, 4e4, 2e3], [1300, 1800, 1620])  # 1000 + 2 s + 0.01 q
        >>> round(a), round(b, 6), round(c, 6)
        (1000, 2.0, 0.01)
    """
    x = np.column_stack([np.ones(len(slots)), np.asarray(slots, float), np.asarray(squares, float)])
    y = np.asarray(peak_bytes, float)
    if weights is not None:  # weighted least squares: scale each row by the square root of its weight
        root = np.sqrt(np.asarray(weights, float))
        x, y = x * root[:, None], y * root
    active = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active[1:] if coef[i] < 0]
        if not negative:
            return tuple(float(c) for c in coef)
        active.remove(min(negative, key=lambda i: coef[i]))


# --- the probe -------------------------------------------------------------------------------------------------------
class TokenBudgetProbe:
    """Measure a LightningModule's peak memory on worst-case micro-batches and pick the largest token budget.

    See the module docstring for the method. Every data-parallel rank of ``world`` must construct it alike and call
    :meth:`run` (or :meth:`measure` the same number of times: it takes part in no collective).

    Args:
        module: the LightningModule; its ``training_step(batch, 0)`` returns the loss (a tensor, or a mapping with
            ``"loss"``), on the device the module is on (the strategy's when a ``trainer`` is given).
        lengths: token lengths of the training split's documents (after ``max_length`` truncation), global.
        settings: the batching settings (padded or packed layout, ``pad_to_multiple_of``, ``max_batch_size``;
            ``max_tokens`` is ignored).
        pad_token_id: padding token id of the collator.
        token_ids: 1-D token ids to fill the probe's rows with (e.g. a real document, repeated), or None for
            ``pad_token_id + 1``.
        memory_limit: bytes one rank may use: on a CPU required (peak resident set size of the process), on CUDA
            optional (a cap below the device's memory).
        memory_fraction: share of the capacity the budget may use, in (0, 1].
        trainer: the Lightning Trainer, or None; with it, batches move to the device through its strategy, passes
            run in its precision context, its optimizers' state is estimated, and ``world`` defaults to its.
        world: the data-parallel world whose ranks probe together (default: ``data_parallel_world(trainer)``).
        max_budget: the largest budget to consider (padded token slots), e.g. the training split's tokens per rank;
            None for the split's padded tokens over the number of ranks.
        optimizers: optimizers whose first step's state to count (default: the Trainer's, else
            ``module.configure_optimizers()``'s).

    Raises:
        ValueError: a CPU module without ``memory_limit``; a ``memory_fraction`` outside (0, 1]; no documents.
        TypeError: a ``memory_limit`` that is not an int.
    """

    def __init__(self, module: Any, *, lengths: Any, settings: BatchingSettings, pad_token_id: int,
                 token_ids: Any = None, memory_limit: int | None = None,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, trainer: Any = None,
                 world: DataParallelWorld | None = None, max_budget: int | None = None,
                 optimizers: Sequence[torch.optim.Optimizer] | None = None) -> None:
        if memory_limit is not None:
            memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
        self.memory_fraction = check_number("memory_fraction", memory_fraction, 0.0, 1.0,
                                            "set the share of memory the budget may use, e.g. 0.9", low_open=True)
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a BatchingSettings, got {type(settings).__name__}",
                                 parameter="settings")
        self.module, self.settings, self.trainer = module, settings, trainer
        self.world = world if world is not None else data_parallel_world(trainer)
        self.device = torch.device(module.device)
        self.meter = _meter(self.device, memory_limit)
        self.target = int(self.memory_fraction * self.meter.capacity)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.shapes = _shape_lengths(lengths)
        self.min_budget = int(padded_lengths(np.array([self.shapes["longest"]]), settings.pad_to_multiple_of)[0])
        if max_budget is None:
            share = -(-int(padded_lengths(lengths, settings.pad_to_multiple_of).sum()) // self.world.num_replicas)
            max_budget = share
        self.max_budget = max(self.min_budget, int(max_budget))
        self.collator = collator_for(planner_for(settings).name, pad_token_id, settings.pad_to_multiple_of)
        ids = np.full(1, pad_token_id + 1, np.int64) if token_ids is None else np.asarray(token_ids, np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise InputValueError(f"token_ids must be a non-empty 1-D array of token ids, got shape {ids.shape}",
                                  parameter="token_ids")
        self._ids = ids
        if optimizers is None:
            optimizers = list(getattr(trainer, "optimizers", None) or []) if trainer is not None else []
            if not optimizers and hasattr(module, "configure_optimizers"):
                optimizers = _optimizers(module.configure_optimizers())
        self.state_bytes = optimizer_state_bytes(optimizers)
        self.measurements: list[ProbeMeasurement] = []
        self._warmup = 0

    # -- one pass --
    def _batch(self, rows: list[int]) -> dict[str, Any]:
        reps = -(-max(rows) // self._ids.size)
        ids = np.tile(self._ids, reps)
        batch = self.collator([{"input_ids": ids[:n], "index": i, "is_fill": False} for i, n in enumerate(rows)])
        if self.trainer is not None:
            return self.trainer.strategy.batch_to_device(batch)
        from lightning.fabric.utilities.apply_func import move_data_to_device
        return move_data_to_device(batch, self.device)

    def _forward_backward(self, batch: dict[str, Any]) -> None:
        context = (self.trainer.precision_plugin.train_step_context() if self.trainer is not None
                   else contextlib.nullcontext())
        with context:
            out = self.module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise InputTypeError(f"the probe runs training_step and needs its loss: a tensor or a mapping with "
                                 f"'loss', got {type(out).__name__}; set max_tokens to an int", parameter="max_tokens")
        loss.backward()

    def measure(self, budget: int, shape: str) -> ProbeMeasurement:
        """Run one forward + backward pass of the ``shape`` micro-batch of ``budget`` and measure its peak.

        Takes part in no collective. Call it inside :meth:`probing` (as :meth:`run` does) to leave the module as it
        was.

        Args:
            budget: padded token slots per micro-batch.
            shape: ``"longest"`` or ``"typical"``.

        Returns:
            The :class:`ProbeMeasurement` (``status`` ``"ok"``, ``"over"`` or ``"out of memory"``).

        Raises:
            ValueError: an unknown shape, or a budget that holds no row of it.
            Exception: whatever ``training_step`` raises other than out-of-memory errors.
        """
        if shape not in self.shapes:
            raise InputValueError(f"shape must be one of {sorted(self.shapes)}, got {shape!r}", parameter="shape")
        length = self.shapes[shape]
        rows = _rows(self.settings, int(budget), length)
        if rows is None:
            raise InputValueError(f"a budget of {budget} token slots holds no row of {length} tokens",
                                  parameter="budget")
        slots, squares = _features(self.settings, rows)
        status, peak = _OK, 0
        try:
            self.meter.reset()
            batch = self._batch(rows)
            self._forward_backward(batch)
            del batch
            peak = self.meter.peak() + self.state_bytes
            if peak > self.meter.capacity:
                status = _OOM
            elif peak > self.target:
                status = _OVER
        except (torch.OutOfMemoryError, MemoryError, ProbeOutOfMemory):
            status, peak = _OOM, 0
        finally:  # the next pass's meter.reset() collects garbage, and probing() does after the last
            for p in self.module.parameters():
                p.grad = None
        m = ProbeMeasurement(int(budget), shape, length, slots, squares, int(peak), _STATUS[status])
        self.measurements.append(m)
        return m

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Leave the module as it was: gradients, training mode, RNG states, ``StepTokenLoss`` state, logging."""
        module = self.module
        grads = [(p, p.grad) for p in module.parameters()]
        for p, _ in grads:
            p.grad = None
        was_training = module.training
        losses = {name: dict(vars(obj)) for name, obj in vars(module).items() if isinstance(obj, StepTokenLoss)}
        patched = {name: getattr(module, name) for name in ("log", "log_dict") if hasattr(module, name)}
        for name in patched:
            object.__setattr__(module, name, _ignore)
        devices = [self.device] if self.device.type == "cuda" else []
        # what was alive before the probe is not the probe's garbage: frozen, every pass's gc.collect() walks only
        # the objects made since (unless the process froze objects itself, whose choice is kept)
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.collect()
            gc.freeze()
        try:
            with torch.random.fork_rng(devices=devices):
                module.train()
                yield
        finally:
            gc.collect()  # the last pass's garbage (the probe's own objects: what it froze is not walked)
            if freeze:
                gc.unfreeze()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for name in patched:
                object.__delattr__(module, name)
            for name, saved in losses.items():
                obj = getattr(module, name)
                obj.__dict__.clear()
                obj.__dict__.update(saved)
            module.train(was_training)
            for p, g in grads:
                p.grad = g

    # -- the search --
    def _round(self, budget: int, shapes: Sequence[str], done: bool, best_ok: int) -> tuple[np.ndarray, Any]:
        """Measure ``shapes`` at ``budget`` (unless ``done``), then one all_gather of every rank's outcome.

        Returns ``(gathered [num_replicas, 5], this rank's error)``: columns status, budget, peak, done, best_ok.
        """
        status, peak, error = _OK, 0, None
        if not done:
            try:
                for shape in shapes:
                    m = self.measure(budget, shape)
                    peak = max(peak, m.peak_bytes)
                    code = {v: k for k, v in _STATUS.items()}[m.status]
                    status = max(status, code)
                    if status == _OOM:
                        break
            except Exception as exc:  # noqa: BLE001  the other ranks wait for this outcome: tell them, then raise
                status, error = _ERROR, exc
        local = torch.tensor([status, budget, peak, float(done), best_ok], dtype=torch.float64)
        return self.world.all_gather(local).numpy(), error

    def _candidate(self, upper: int, margin: float = 0.0) -> int | None:
        """Largest budget in ``[min_budget, upper]`` whose fitted peak, for every shape, is at most the target less
        ``margin`` of the room above the fit's intercept."""
        measured = [m for m in self.measurements[self._warmup:] if m.peak_bytes > 0]
        if not measured or upper < self.min_budget:
            return None
        # weighted by slots: the budget is decided near the largest passes, where small passes' noise (the fit's
        # intercept) would otherwise pull the extrapolated slope
        coef = fit_memory([m.slots for m in measured], [m.squares for m in measured],
                          [m.peak_bytes for m in measured], weights=[m.slots for m in measured])
        self.coefficients = coef
        target = coef[0] + (self.target - coef[0]) * (1.0 - margin)
        m = self.settings.pad_to_multiple_of

        longest = self.min_budget

        def fits(budget: int) -> bool:
            # any micro-batch within the budget: at most `budget` slots, rows of at most the longest length
            return coef[0] + coef[1] * budget + coef[2] * budget * longest <= target

        lo, hi = self.min_budget // m, upper // m
        if not fits(lo * m):
            return None
        while lo < hi:  # largest multiple of m that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * m) else (lo, mid - 1)
        return lo * m

    def _worst_shape(self, budget: int) -> str:
        """The shape whose micro-batch at ``budget`` the current fit predicts to need more memory."""
        _, b, c = self.coefficients
        predicted = {}
        for shape, length in self.shapes.items():
            rows = _rows(self.settings, budget, length)
            if rows is not None:
                slots, squares = _features(self.settings, rows)
                predicted[shape] = b * slots + c * squares
        return max(predicted, key=predicted.get)

    def run(self) -> TokenBudget:
        """Probe on every rank of the world together and return the budget (the same object on every rank).

        Raises:
            RuntimeError: on every rank: a rank fits no micro-batch of one longest row under its target (naming
                the ranks, their need and capacity, and the settings to change); ``training_step`` raised on some
                rank (that rank re-raises its own error).
        """
        # the first dataloader call of Trainer.fit may come from the sanity check, inside torch.inference_mode
        with torch.inference_mode(False), torch.enable_grad():
            return self._run()

    def _run(self) -> TokenBudget:
        start = time.perf_counter()
        self.coefficients = (0.0, 0.0, 0.0)
        m = self.settings.pad_to_multiple_of
        best_ok, fail_min, num_probes = 0, self.max_budget + m, 0
        blind_fail = fail_min
        best_ok_slots = 0
        best_ok_peak, fail_peak = 0, 0  # bytes: the peaks measured at best_ok and at fail_min
        first = [self.min_budget]
        second = min(self.max_budget, max(2 * self.min_budget, -(-512 // m) * m))
        if second > self.min_budget:
            first.append(second)
        with self.probing():
            # the first pass allocates once-only memory (thread pools, kernel caches): it stays out of the fit
            self._warmup = 1
            for round_index in range(len(first) + _MAX_REFINE_ROUNDS + 1):
                if round_index < len(first):  # the same budgets on every rank, both shapes
                    done = round_index > 0 and best_ok == 0  # the smallest budget failed here: nothing more to try
                    budget, shapes = first[round_index], list(self.shapes)
                else:  # this rank's own candidate, the shape the fit says needs more there
                    first_try = round_index == len(first)
                    candidate = self._candidate(min(self.max_budget, fail_min - m), _MARGIN if first_try else 0.0)
                    if candidate is not None and blind_fail <= self.max_budget:
                        # an out-of-memory error measures no peak: halve the gap to the smallest such budget
                        candidate = min(candidate, max(self.min_budget, (best_ok + blind_fail) // (2 * m) * m))
                    elif candidate is not None and best_ok and fail_peak > best_ok_peak:
                        # a pass measured over the target: interpolate between it and the largest budget that
                        # fitted (regula falsi), 10 % short of the interpolated point so that it is not missed again
                        share = min(1.0, max(0.0, (self.target - best_ok_peak) / (fail_peak - best_ok_peak)))
                        step = best_ok + int(0.9 * share * (fail_min - best_ok))
                        candidate = min(candidate, max(best_ok, step // m * m))
                    done = (candidate is None or candidate <= best_ok * _TOLERANCE
                            or round_index == len(first) + _MAX_REFINE_ROUNDS)
                    budget, shapes = (candidate, [self._worst_shape(candidate)]) if not done else (0, [])
                if done:
                    budget, shapes = 0, []
                gathered, error = self._round(budget, shapes, done, best_ok)
                num_probes += 1
                statuses = gathered[:, 0].astype(int)
                if (statuses == _ERROR).any():
                    if error is not None:
                        raise error
                    bad = [r for r in range(len(statuses)) if statuses[r] == _ERROR]
                    raise RuntimeError(f"the token budget probe failed on rank(s) {bad} (their training_step raised, "
                                       "see their log); no rank trains")
                if not done:
                    if statuses[self.world.rank] == _OK:
                        if budget > best_ok:
                            best_ok = budget
                            best_ok_slots = min(m.slots for m in self.measurements[-len(shapes):])
                            best_ok_peak = max(m.peak_bytes for m in self.measurements[-len(shapes):])
                    else:
                        if budget < fail_min:
                            fail_min, fail_peak = budget, self.measurements[-1].peak_bytes
                        if self.measurements[-1].peak_bytes == 0:
                            blind_fail = min(blind_fail, budget)
                if round_index >= len(first) and gathered[:, 3].all():
                    break
            if blind_fail <= self.max_budget:
                # an out-of-memory error measured no peak to fit: keep to micro-batches no larger than those run
                best_ok = best_ok_slots
        seconds = time.perf_counter() - start  # the module's state restored included
        final = torch.tensor([best_ok, *self.coefficients, seconds, self.meter.capacity], dtype=torch.float64)
        rows = self.world.all_gather(final).numpy()
        per_rank = tuple(int(b) for b in rows[:, 0])
        if min(per_rank) == 0:
            bad = [r for r, b in enumerate(per_rank) if b == 0]
            here = [m for m in self.measurements if m.budget == self.min_budget]
            mine = ("" if not here else "; this rank: out of memory" if min(m.peak_bytes for m in here) == 0
                    else f"; this rank measured {max(m.peak_bytes for m in here)} bytes")
            raise RuntimeError(
                f"max_tokens='auto': rank(s) {bad} cannot fit even one micro-batch of the longest rows "
                f"({self.shapes['longest']} tokens, budget {self.min_budget}) within memory_fraction="
                f"{self.memory_fraction} of their capacity ({[int(c) for c in rows[:, 5]]} bytes by rank"
                f"{mine}); lower max_length, raise "
                "memory_limit or memory_fraction, use a smaller model, or set max_tokens to an int")
        return TokenBudget(
            max_tokens=min(per_rank), per_rank=per_rank, capacity_bytes=tuple(int(c) for c in rows[:, 5]),
            memory_fraction=self.memory_fraction, coefficients=tuple(tuple(float(x) for x in r[1:4]) for r in rows),
            device=self.meter.device_kind, probe_seconds=float(rows[:, 4].max()), num_probes=num_probes,
            measurements=tuple(self.measurements))


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the probe: nothing is logged."""


def find_max_tokens(module: Any, datamodule: Any, *, memory_limit: int | None = None,
                    memory_fraction: float = DEFAULT_MEMORY_FRACTION, trainer: Any = None,
                    world: DataParallelWorld | None = None) -> TokenBudget:
    """Run only the probe: the largest token budget at which ``module`` trains on ``datamodule``'s micro-batches.

    Args:
        module: the LightningModule, on the device to measure (CPU or CUDA).
        datamodule: a :class:`~lit_balance.BalancedTextDataModule` (its training split, layout and padding id).
        memory_limit: bytes one rank may use (required on a CPU: the process's peak resident set size).
        memory_fraction: share of the capacity the budget may use.
        trainer: a Trainer whose strategy, precision and optimizers to use, or None.
        world: the data-parallel ranks that probe together (default: ``data_parallel_world(trainer)``; every one
            must call this function).

    Returns:
        The :class:`TokenBudget` (``max_tokens``: the smallest rank's budget; ``per_rank``: every rank's).

    Raises:
        RuntimeError, ValueError, TypeError: as :class:`TokenBudgetProbe` and :meth:`TokenBudgetProbe.run`.
    """
    return datamodule.find_max_tokens(module, memory_limit=memory_limit, memory_fraction=memory_fraction,
                                      trainer=trainer, world=world)
