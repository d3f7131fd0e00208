"""The automatic token budget: measure a model's peak memory on worst-case micro-batches and pick ``max_tokens``.

``BalancedTextDataModule(max_tokens="auto")`` owns an :class:`AutoTokenBudget`, which runs :class:`TokenBudgetProbe`
once at fit start (or restores the budget a checkpoint saved); the probe can also be run alone
(:func:`find_max_tokens`, :meth:`BalancedTextDataModule.find_max_tokens`, ``lit-balance plan --max-tokens auto``). Its
parts, each testable alone:

* the planner's worst-case micro-batch at a budget (:meth:`~lit_balance.plan.epoch.Planner.worst_case_batch`), for
  the training split's longest rows and its typical (median) rows, built with the library's collator;
* a memory meter (:mod:`lit_balance.lightning.meters`: CUDA's peak allocated memory, a CPU process's peak resident set
  size, or any object passed as ``meter=``);
* the pure search (:mod:`lit_balance.plan.budget_search`): the memory model and the next budget to try;
* :class:`~lit_balance.lightning.probe_state.ModuleSnapshot`, which leaves the module as it was.

One pass is a forward and backward pass of the LightningModule's ``training_step``, with the gradients of the previous
pass still allocated (as in training, where the optimizer's ``zero_grad`` follows the next forward pass); its peak is
measured, plus the optimizer state the first optimizer step will allocate (:func:`optimizer_state_bytes`). The
optimizer never steps. The target is ``memory_fraction`` of the capacity (CUDA: the device's memory, or
``memory_limit`` if smaller; CPU: ``memory_limit``).

All data-parallel ranks probe in lockstep: each budget tried ends in one ``all_gather`` of every rank's outcome, so a
rank that runs out of memory or whose ``training_step`` raises tells every other rank in the same collective, and none
waits on another. Ranks of the same device (type and capacity) then plan with the smallest budget any of them measured
(:func:`~lit_balance.plan.budget_search.shared_budgets`): measurement noise never gives equal devices different
budgets; ranks of different capacity get per-rank budgets (``docs/per_rank_budgets.md``).

A module with manual optimization (``automatic_optimization = False``) is refused at once: its ``training_step`` steps
its optimizers itself. The per-budget out-of-memory agreement is what Composer's automatic micro-batching lacks when
only some ranks run out of memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from lit_balance._checks import check_int, check_number
from lit_balance.data.collate import collator_for
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.meters import MemoryMeter, meter_for, return_freed_memory
from lit_balance.lightning.probe_state import ModuleSnapshot
from lit_balance.plan.budget_search import (
    OK,
    OUT_OF_MEMORY,
    OVER,
    BudgetSpace,
    MemoryMeasurement,
    MemoryModel,
    chosen_budget,
    next_budget,
    shared_budgets,
)
from lit_balance.plan.epoch import planner_for
from lit_balance.plan.shapes import probe_planner
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.types import padded_lengths
from lit_balance.world import DataParallelWorld, data_parallel_world

__all__ = ["DEFAULT_MEMORY_FRACTION", "AutoTokenBudget", "ProbeMeasurement", "TokenBudget", "TokenBudgetProbe",
           "find_max_tokens", "optimizer_state_bytes"]

#: Share of a device's capacity the chosen budget's measured peak may use (the rest is headroom for fragmentation, a
#: longer validation batch, and memory the probe does not see).
DEFAULT_MEMORY_FRACTION = 0.9
#: One measured pass (:class:`lit_balance.plan.budget_search.MemoryMeasurement`).
ProbeMeasurement = MemoryMeasurement
_STATE_VERSION = 2
#: Passes in a row at the chosen budget that must peak under the target (:meth:`TokenBudgetProbe.settle`).
SETTLE_PASSES = 2
_DEVICE_CODES = {"cpu": 0, "cuda": 1}


@dataclass(frozen=True)
class TokenBudget:
    """The result of the probe: the budget the plan uses and what every rank measured (the same on every rank).

    Attributes:
        max_tokens: the smallest budget of ``per_rank`` (padded token slots per micro-batch).
        per_rank: each data-parallel rank's budget, by rank: the smallest measured among the ranks of its device (the
            same type and capacity).
        measured: each rank's own measurement (the largest budget whose passes measured under its target).
        capacity_bytes: each rank's capacity (bytes): device memory or ``memory_limit``.
        memory_fraction: the share of the capacity a budget may use.
        coefficients: each rank's memory model ``(a, b, c)``: bytes, bytes per token slot, bytes per squared token.
        device: ``"cpu"``, ``"cuda"``, or the meter's ``device_kind``.
        probe_seconds: wall time of the probe, the module restored included, the slowest rank (seconds).
        num_probes: collective rounds (budgets tried, the warm-up pass included).
        source: ``"probe"``, or ``"checkpoint"`` when restored from a saved state.
        measurements: this rank's measured passes (not saved in the state).
        probe_slots: padded token slots of every pass this rank ran (the warm-up and settling passes included): the
            probe's cost in micro-batch terms; 0 when restored (not saved in the state).
    """

    max_tokens: int
    per_rank: tuple[int, ...]
    measured: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    memory_fraction: float
    coefficients: tuple[tuple[float, float, float], ...]
    device: str
    probe_seconds: float
    num_probes: int
    source: str = "probe"
    measurements: tuple[ProbeMeasurement, ...] = field(default=(), repr=False, compare=False)
    probe_slots: int = field(default=0, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain types (a checkpoint loads them with ``weights_only=True``); this rank's measurements left out."""
        out = asdict(self)
        out.pop("measurements")
        out.pop("probe_slots")
        for name in ("per_rank", "measured", "capacity_bytes"):
            out[name] = list(getattr(self, name))
        out["coefficients"] = [list(c) for c in self.coefficients]
        out["version"] = _STATE_VERSION
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> TokenBudget:
        """Rebuild from :meth:`to_dict`; ``source`` becomes ``"checkpoint"``.

        Raises:
            ValueError: missing or unknown keys, or another version.
        """
        names = {f.name for f in cls.__dataclass_fields__.values()} - {"measurements", "probe_slots"}
        if not isinstance(state, Mapping) or set(state) != names | {"version"} or state["version"] != _STATE_VERSION:
            got = sorted(state) if isinstance(state, Mapping) else state
            raise InputValueError(f"a saved token budget must have keys {sorted(names | {'version'})} and version "
                                  f"{_STATE_VERSION}, got {got!r}", parameter="token_budget")
        ints = {name: tuple(int(b) for b in state[name]) for name in ("per_rank", "measured", "capacity_bytes")}
        return cls(max_tokens=int(state["max_tokens"]), **ints, memory_fraction=float(state["memory_fraction"]),
                   coefficients=tuple(tuple(float(x) for x in c) for c in state["coefficients"]),
                   device=str(state["device"]), probe_seconds=float(state["probe_seconds"]),
                   num_probes=int(state["num_probes"]), source="checkpoint")

    def plan_max_tokens(self, num_replicas: int) -> int | tuple[int, ...]:
        """The ``max_tokens`` to plan with on ``num_replicas`` data-parallel ranks: :attr:`per_rank` when its budgets
        differ and ``num_replicas`` ranks measured, else one int, :attr:`max_tokens` (a resume on another world size
        plans every rank with the smallest).

        Example:
            >>> budget = TokenBudget(max_tokens=1000, per_rank=(1000, 1000, 2100), measured=(1000, 1030, 2100),
            ...                      capacity_bytes=(1, 1, 2), memory_fraction=0.9, coefficients=((0.0, 1.0, 0.0),) * 3,
            ...                      device="cpu", probe_seconds=1.0, num_probes=3)
            >>> budget.plan_max_tokens(3), budget.plan_max_tokens(2)
            ((1000, 1000, 2100), 1000)
        """
        if len(self.per_rank) != num_replicas or len(set(self.per_rank)) == 1:
            return self.max_tokens
        return self.per_rank

    def describe(self, num_replicas: int | None = None) -> str:
        """One line for logs: the budget the plan on ``num_replicas`` ranks uses (default: the ranks that measured),
        what each rank measured, their capacity and the probe's cost."""
        planned = self.plan_max_tokens(len(self.per_rank) if num_replicas is None else num_replicas)
        used = (f"max_tokens={planned} padded token slots per micro-batch, every rank" if isinstance(planned, int)
                else f"max_tokens={list(planned)} padded token slots per micro-batch, by rank (capacities differ)")
        gib = [f"{c / 2**30:.2f}" for c in self.capacity_bytes]
        return (f"{used} ({self.source}; measured by rank {list(self.measured)}; capacity {gib} GiB {self.device}, "
                f"memory_fraction {self.memory_fraction}; {self.num_probes} probes in {self.probe_seconds:.2f} s)")


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


def _state_tensors(name: str, group: Mapping[str, Any]) -> int:
    """State tensors per parameter that an optimizer of class ``name`` keeps for a parameter group."""
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name in ("Adam", "AdamW") and group.get("amsgrad", False):
        return 3
    return _STATE_PER_PARAM.get(name, 2)


def optimizer_state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes the optimizers' first step will allocate for parameters that have no state yet.

    Adam-family optimizers keep two tensors per parameter (``exp_avg``, ``exp_avg_sq``; three with ``amsgrad``), SGD
    with momentum and RMSprop one (RMSprop two with momentum, three centred); Adagrad allocates its state at
    construction (counted in the measured memory). An optimizer of another class counts two tensors per parameter.

    Args:
        optimizers: the optimizers (e.g. ``trainer.optimizers``).

    Returns:
        Bytes (per rank, of unsharded parameters as this process holds them).
    """
    total = 0
    for opt in optimizers:
        for group in opt.param_groups:
            per = _state_tensors(type(opt).__name__, group)
            total += sum(per * p.numel() * p.element_size() for p in group["params"]
                         if p.requires_grad and not opt.state.get(p))
    return total


def _shape_lengths(lengths: np.ndarray) -> dict[str, int]:
    """``{"longest": L, "typical": median}`` row lengths (tokens) of the training split (after truncation)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise InputValueError("the probe needs the training split's document lengths; it has no documents",
                              parameter="lengths")
    longest, typical = int(lengths.max()), max(1, int(np.median(lengths)))
    return {"longest": longest} if typical == longest else {"longest": longest, "typical": typical}


def _refuse_manual_optimization(module: Any) -> None:
    if getattr(module, "automatic_optimization", True) is False:
        raise InputValueError(
            f"max_tokens='auto' measures memory by running training_step forward and backward, but "
            f"{type(module).__name__} uses manual optimization (automatic_optimization = False): its training_step "
            "steps its optimizers itself, which the probe must not do. Pass max_tokens as an int (padded token slots "
            "per micro-batch, per rank), e.g. one measured with dm.find_max_tokens(model) on a copy of the model with "
            "automatic optimization", parameter="max_tokens")


# --- the probe -------------------------------------------------------------------------------------------------------
class TokenBudgetProbe:
    """Measure a LightningModule's peak memory on worst-case micro-batches and pick the largest token budget.

    See the module docstring for the method. Every data-parallel rank of ``world`` must construct it alike and call
    :meth:`run` (or :meth:`measure` the same number of times: it takes part in no collective).

    Args:
        module: the LightningModule; its ``training_step(batch, 0)`` returns the loss (a tensor, or a mapping with
            ``"loss"``), on the device the module is on (the strategy's when a ``trainer`` is given).
        lengths: token lengths of the training split's documents (after ``max_length`` truncation), global.
        settings: the batching settings whose planner, ``pad_to_multiple_of`` and ``max_batch_size`` shape the
            micro-batches (``max_tokens`` is not read).
        pad_token_id: padding token id of the collator.
        token_ids: 1-D token ids to fill the probe's rows with (e.g. a real document, repeated), or None for
            ``pad_token_id + 1``.
        memory_limit: bytes one rank may use: on a CPU required (peak resident set size of the process), on CUDA
            optional (a cap below the device's memory). Not read when ``meter`` is given.
        memory_fraction: share of the capacity the budget may use, in (0, 1].
        trainer: the Lightning Trainer, or None; with it, batches move to the device through its strategy, passes
            run in its precision context, its optimizers' state is counted, and ``world`` defaults to its.
        world: the data-parallel world whose ranks probe together (default: ``data_parallel_world(trainer)``).
        max_budget: the largest budget to consider (padded token slots); None for the split's padded tokens over the
            number of ranks.
        optimizers: optimizers whose first step's state to count (default: the Trainer's, else
            ``module.configure_optimizers()``'s).
        meter: the memory meter (:mod:`lit_balance.lightning.meters`), or None for the device's.

    Raises:
        ValueError: a module with manual optimization; a CPU module without ``memory_limit`` or ``meter``; a
            ``memory_fraction`` outside (0, 1]; no documents.
        TypeError: a ``memory_limit`` that is not an int; ``settings`` not a BatchingSettings.
    """

    def __init__(self, module: Any, *, lengths: Any, settings: BatchingSettings, pad_token_id: int,
                 token_ids: Any = None, memory_limit: int | None = None,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, trainer: Any = None,
                 world: DataParallelWorld | None = None, max_budget: int | None = None,
                 optimizers: Sequence[torch.optim.Optimizer] | None = None, meter: MemoryMeter | None = None) -> None:
        _refuse_manual_optimization(module)
        if memory_limit is not None:
            memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
        self.memory_fraction = check_number("memory_fraction", memory_fraction, 0.0, 1.0,
                                            "set the share of memory the budget may use, e.g. 0.9", low_open=True)
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a BatchingSettings, got {type(settings).__name__}",
                                 parameter="settings")
        self.module, self.settings, self.trainer = module, settings, trainer
        self.planner = probe_planner(settings, lengths) or planner_for(settings)  # static shapes: their worst case
        self.world = world if world is not None else data_parallel_world(trainer)
        self.device = torch.device(module.device)
        self.meter = meter if meter is not None else meter_for(self.device, memory_limit)
        self.target = int(self.memory_fraction * self.meter.capacity)
        self.shapes = _shape_lengths(lengths)
        self.space = self._space(np.asarray(lengths, dtype=np.int64), max_budget)
        self.collator = collator_for(settings, pad_token_id, planner=self.planner)
        ids = np.full(1, pad_token_id + 1, np.int64) if token_ids is None else np.asarray(token_ids, np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise InputValueError(f"token_ids must be a non-empty 1-D array of token ids, got shape {ids.shape}",
                                  parameter="token_ids")
        self._ids = ids
        self.state_bytes = optimizer_state_bytes(self._find_optimizers(optimizers))
        self.measurements: list[ProbeMeasurement] = []
        #: Padded token slots of every pass run so far (the warm-up and the settling passes included), this rank.
        self.slots_run = 0
        #: Peak bytes of the last :meth:`settle` (passes in a row), or None before.
        self.settled_peak: int | None = None

    def _space(self, lengths: np.ndarray, max_budget: int | None) -> BudgetSpace:
        multiple = self.settings.pad_to_multiple_of
        longest = self.shapes["longest"]
        min_budget = int(padded_lengths(np.array([longest]), multiple)[0])
        if max_budget is None:
            max_budget = -(-int(padded_lengths(lengths, multiple).sum()) // self.world.num_replicas)
        top = max(min_budget, int(max_budget) // multiple * multiple)
        return BudgetSpace(min_budget=min_budget, max_budget=top, multiple=multiple, longest=longest,
                           target=self.target)

    def _find_optimizers(self, optimizers: Sequence[torch.optim.Optimizer] | None) -> list[torch.optim.Optimizer]:
        if optimizers is not None:
            return list(optimizers)
        found = list(self.trainer.optimizers or []) if self.trainer is not None else []
        if not found and hasattr(self.module, "configure_optimizers"):
            found = _optimizers(self.module.configure_optimizers())
        return found

    @property
    def min_budget(self) -> int:
        """The smallest budget: one row of the longest documents, padded (token slots)."""
        return self.space.min_budget

    @property
    def max_budget(self) -> int:
        """The largest budget considered (token slots)."""
        return self.space.max_budget

    # -- one pass --
    def _batch(self, rows: Sequence[int]) -> dict[str, Any]:
        ids = np.tile(self._ids, -(-max(rows) // self._ids.size))
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
        """Run one forward + backward pass of the ``shape`` micro-batch at ``budget`` and measure its peak.

        Takes part in no collective. Call it inside :meth:`probing` (as :meth:`run` does) to leave the module as it
        was.

        Args:
            budget: padded token slots per micro-batch.
            shape: ``"longest"`` or ``"typical"``.

        Returns:
            The :class:`ProbeMeasurement`: ``status`` ``"ok"``, ``"over"`` (a peak above the target, the capacity
            too) or ``"out of memory"`` (the device raised: no peak).

        Raises:
            ValueError: an unknown shape, or a budget that holds no row of it.
            Exception: whatever ``training_step`` raises other than out-of-memory errors.
        """
        if shape not in self.shapes:
            raise InputValueError(f"shape must be one of {sorted(self.shapes)}, got {shape!r}", parameter="shape")
        length = self.shapes[shape]
        worst = self.planner.worst_case_batch(self.settings, int(budget), length)
        if worst is None:
            raise InputValueError(f"a budget of {budget} token slots holds no row of {length} tokens",
                                  parameter="budget")
        try:
            self.meter.reset()
            self._forward_backward(self._batch(worst.rows))
            peak = int(self.meter.peak()) + self.state_bytes
            status = OVER if peak > self.target else OK  # a peak above the capacity too: it was measured
        except (torch.OutOfMemoryError, MemoryError):
            status, peak = OUT_OF_MEMORY, 0
        m = ProbeMeasurement(int(budget), worst.slots, worst.squares, peak, status, shape, length)
        self.measurements.append(m)
        self.slots_run += worst.slots
        return m

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Leave the module as it was (:class:`~lit_balance.lightning.probe_state.ModuleSnapshot`); passes run in
        training mode, starting without gradients."""
        devices = [self.device] if self.device.type == "cuda" else []
        with ModuleSnapshot(self.module, devices):
            for p in self.module.parameters():
                p.grad = None
            self.module.train()
            try:
                yield
            finally:
                for p in self.module.parameters():
                    p.grad = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    # -- the search, in lockstep over the ranks --
    def _shapes_at(self, budget: int) -> list[str]:
        """Every shape at the first two budgets; then the one the memory model predicts to need more at ``budget``."""
        fitted = [m for m in self.measurements if m.peak_bytes > 0]
        if len({m.budget for m in self.measurements}) < 2 or not fitted:
            return [s for s in self.shapes if self.planner.worst_case_batch(self.settings, budget, self.shapes[s])]
        model = MemoryModel.fit(fitted)
        predicted = {}
        for shape, length in self.shapes.items():
            worst = self.planner.worst_case_batch(self.settings, budget, length)
            if worst is not None:
                predicted[shape] = model.predict(worst.slots, worst.squares)
        return [max(predicted, key=predicted.get)]

    def _round(self, budget: int | None, record: bool = True) -> bool:
        """Measure ``budget`` (None: this rank is done), then one all_gather of every rank's outcome; True when every
        rank is done. A pass not recorded (the warm-up) is measured but left out of the search."""

        def measure() -> None:
            for shape in self._shapes_at(budget):
                if self.measure(budget, shape).status != OK:
                    break  # the budget fails: its other shape need not run
            if not record:
                del self.measurements[:]

        return self._collective(measure if budget is not None else None)

    def _collective(self, action: Any) -> bool:
        """Run ``action`` (None: nothing, this rank is done), then one all_gather of every rank's outcome, so that an
        error on any rank is raised on every rank; True when every rank is done."""
        error = None
        if action is not None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001  the other ranks wait for this outcome: tell them, then raise
                error = exc
        flags = self.world.all_gather(torch.tensor([error is not None, action is None], dtype=torch.float64))
        failed = [r for r in range(self.world.num_replicas) if flags[r, 0]]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"the token budget probe failed on rank(s) {failed} (their training_step raised, see "
                               "their log); no rank trains")
        return bool(flags[:, 1].all())

    def settle(self, budget: int) -> int:
        """The budget that stays under the capacity in training: ``budget`` if :data:`SETTLE_PASSES` passes in a row
        at it (the shapes in turn, without the meter's reset between them, so what the allocator keeps from one
        micro-batch to the next counts, as in training) peak at most at the target; else the largest budget the
        memory model puts there less that excess (checked the same way, once more). The rest of the capacity is left
        for what a long run adds beyond a few passes (the allocator's retained memory growing over many micro-batches
        of different shapes, the optimizer step's temporaries). The smallest budget when even it does not settle (its
        single passes fitted under the target). Takes part in no collective."""
        bound = self.target
        smallest = budget
        for _ in range(2):
            peak = self._passes_in_a_row(budget)
            self.settled_peak = peak
            if peak <= bound or budget <= self.min_budget:
                return budget
            model = MemoryModel.fit([m for m in self.measurements if m.peak_bytes > 0])
            excess = max(0.0, peak - model.bound(budget, self.space.longest))
            smaller = model.largest_budget(bound - excess, self.min_budget, budget - self.space.multiple,
                                           self.space.multiple, self.space.longest)
            budget = self.min_budget if smaller is None else smaller
            smallest = min(smallest, budget)
        return smallest

    def _passes_in_a_row(self, budget: int) -> int:
        """Peak bytes (optimizer state included) over :data:`SETTLE_PASSES` passes in a row at ``budget``."""
        self.meter.reset()
        shapes = [s for s in self.shapes if self.planner.worst_case_batch(self.settings, budget, self.shapes[s])]
        try:
            for i in range(SETTLE_PASSES):
                worst = self.planner.worst_case_batch(self.settings, budget, self.shapes[shapes[i % len(shapes)]])
                self.slots_run += worst.slots
                self._forward_backward(self._batch(worst.rows))
            return int(self.meter.peak()) + self.state_bytes
        except (torch.OutOfMemoryError, MemoryError):
            return self.meter.capacity + 1

    def run(self) -> TokenBudget:
        """Probe on every rank of the world together and return the budget (the same object on every rank).

        Raises:
            RuntimeError: on every rank: a rank fits no micro-batch of one longest row under its target (naming
                the ranks, their capacity, and the settings to change); ``training_step`` raised on some rank (that
                rank re-raises its own error).
        """
        start = time.perf_counter()
        # the first dataloader call of Trainer.fit may come from the sanity check, inside torch.inference_mode
        with torch.inference_mode(False), torch.enable_grad(), self.probing():
            rounds = 1
            self._round(self.min_budget, record=False)  # once-only allocations (thread pools, kernel caches)
            while not self._round(next_budget(self.measurements, self.space)):
                rounds += 1
            settled = chosen_budget(self.measurements)

            def settle() -> None:
                nonlocal settled
                settled = self.settle(settled)

            self._collective(settle if settled else None)
        self.meter.reset()  # hand back what the passes freed (CPU: the heap; CUDA: the cache): training starts clean
        return self._result(settled, time.perf_counter() - start, rounds + 2)

    def _result(self, chosen: int, seconds: float, rounds: int) -> TokenBudget:
        """Gather every rank's outcome into the :class:`TokenBudget`, or raise on every rank when one fits nothing."""
        fitted = [m for m in self.measurements if m.peak_bytes > 0]
        model = MemoryModel.fit(fitted) if fitted else MemoryModel(0.0, 0.0, 0.0)
        kind = _DEVICE_CODES.get(self.meter.device_kind, len(_DEVICE_CODES))
        local = [chosen, self.meter.capacity, seconds, kind, model.intercept,
                 model.per_slot, model.per_square]
        rows = self.world.all_gather(torch.tensor(local, dtype=torch.float64)).numpy()
        measured = tuple(int(b) for b in rows[:, 0])
        capacity = tuple(int(c) for c in rows[:, 1])
        if min(measured) == 0:
            self._raise_nothing_fits(measured, capacity)
        per_rank = shared_budgets(measured, list(zip(rows[:, 3].astype(int).tolist(), capacity)))
        return TokenBudget(max_tokens=min(per_rank), per_rank=per_rank, measured=measured, capacity_bytes=capacity,
                           memory_fraction=self.memory_fraction,
                           coefficients=tuple(tuple(float(x) for x in r[4:7]) for r in rows),
                           device=self.meter.device_kind, probe_seconds=float(rows[:, 2].max()), num_probes=rounds,
                           measurements=tuple(self.measurements), probe_slots=self.slots_run)

    def _raise_nothing_fits(self, measured: tuple[int, ...], capacity: tuple[int, ...]) -> None:
        bad = [r for r, b in enumerate(measured) if b == 0]
        here = [m for m in self.measurements if m.budget == self.min_budget]
        mine = ("" if not here else "; this rank: out of memory" if min(m.peak_bytes for m in here) == 0
                else f"; this rank measured {max(m.peak_bytes for m in here)} bytes")
        raise RuntimeError(
            f"max_tokens='auto': rank(s) {bad} cannot fit even one micro-batch of the longest rows "
            f"({self.shapes['longest']} tokens, budget {self.min_budget}) within memory_fraction="
            f"{self.memory_fraction} of their capacity ({list(capacity)} bytes by rank{mine}); lower max_length, raise "
            "memory_limit or memory_fraction, use a smaller model, or set max_tokens to an int")


# --- the owner of max_tokens="auto" ----------------------------------------------------------------------------------
class AutoTokenBudget:
    """``max_tokens="auto"``: the memory limit and fraction, and the budget once measured (or restored).

    :class:`~lit_balance.BalancedTextDataModule` holds one and asks it once, at fit start (:meth:`resolve`); its
    :meth:`state_dict` goes into the DataModule's, so that a resume plans with the saved budget instead of probing
    again.

    Args:
        memory_limit: bytes one rank may use (on a CPU required: the process's peak resident set size; on CUDA
            optional, a cap below the device's memory).
        memory_fraction: share of the capacity the budget may use, in (0, 1].
        meter: a memory meter to measure with instead of the device's (:mod:`lit_balance.lightning.meters`).

    Attributes:
        budget: the :class:`TokenBudget`, or None before :meth:`resolve` (or :meth:`load_state_dict`).

    Raises:
        TypeError, ValueError: a bad ``memory_limit`` or ``memory_fraction``.

    Example:
        >>> auto = AutoTokenBudget(memory_limit=8 * 2**30)
        >>> auto.budget is None, auto.state_dict()
        (True, {})
    """

    def __init__(self, memory_limit: int | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 meter: MemoryMeter | None = None) -> None:
        if memory_limit is not None:
            memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
        self.memory_limit = memory_limit
        self.memory_fraction = check_number("memory_fraction", memory_fraction, 0.0, 1.0,
                                            "the share of memory the budget may use, e.g. 0.9", low_open=True)
        self.meter = meter
        self.budget: TokenBudget | None = None

    def probe(self, module: Any, **kwargs: Any) -> TokenBudget:
        """Run :class:`TokenBudgetProbe` with this object's limit, fraction and meter (``kwargs``: the probe's other
        arguments); sets nothing."""
        return TokenBudgetProbe(module, memory_limit=self.memory_limit, memory_fraction=self.memory_fraction,
                                meter=self.meter, **kwargs).run()

    def resolve(self, trainer: Any, **kwargs: Any) -> TokenBudget:
        """The budget: the one restored or measured before, else measured now with ``trainer.lightning_module``.

        A CPU budget restored from a checkpoint sets the allocator as the probe's CPU meter does
        (:func:`~lit_balance.lightning.meters.return_freed_memory`), unless this object was given a ``meter``.

        Args:
            trainer: the fitting Trainer (its strategy, precision, optimizers and data-parallel world are used).
            **kwargs: :class:`TokenBudgetProbe`'s ``lengths``, ``settings``, ``pad_token_id``, ``token_ids``.

        Raises:
            RuntimeError: no budget yet and no Trainer with a module to measure; as :meth:`TokenBudgetProbe.run`.
        """
        if self.budget is None:
            if trainer is None or trainer.lightning_module is None:
                raise RuntimeError("max_tokens='auto' is measured with the model at fit start: run "
                                   "Trainer.fit(model, datamodule=dm), or call dm.find_max_tokens(model, ...) and pass "
                                   "its max_tokens")
            self.budget = self.probe(trainer.lightning_module, trainer=trainer, **kwargs)
        elif (self.meter is None and self.budget.device == "cpu" and trainer is not None
              and trainer.lightning_module is not None and trainer.lightning_module.device.type == "cpu"):
            return_freed_memory()  # a restored CPU budget trains as the probe measured it (see CpuMeter)
        return self.budget

    def state_dict(self) -> dict[str, Any]:
        """``{}`` before the budget is known, else :meth:`TokenBudget.to_dict`."""
        return {} if self.budget is None else self.budget.to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved budget (``{}`` restores nothing).

        Raises:
            ValueError: as :meth:`TokenBudget.from_dict`.
        """
        if state:
            self.budget = TokenBudget.from_dict(state)


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
