"""The token budget probe: measure a model's peak memory on worst-case micro-batches, in lockstep over the ranks.

:class:`TokenBudgetProbe` takes the training split's lengths and the micro-batch layout
(:class:`~lit_balance.plan.budget_search.ProbeLayout`), and runs three steps (``docs/token_budget.md``):

* **measure**: a forward and backward pass of ``training_step`` on the planner's worst-case micro-batch at a budget
  (:meth:`~lit_balance.plan.epoch.Planner.worst_case_batch`) of the split's longest or typical (median) rows, with the
  previous pass's gradients still allocated; its peak (:mod:`lit_balance.lightning.meters`) plus the optimizer state
  of the first step (:func:`~lit_balance.lightning.optimizer_state.optimizer_state_bytes`). The optimizer never steps.
* **lockstep rounds**: each budget the pure search proposes (:func:`~lit_balance.plan.budget_search.next_budget`) is
  one round, which runs the same number of passes on every rank: the ranks agree on it first, and a rank with fewer
  (its budget failed at the first shape, or its search is done) runs filler passes of one longest row, not measured,
  so a collective inside ``training_step`` (``self.all_gather``, ``torch.distributed.all_reduce``) always meets the
  same pass on the other ranks. The round ends in one ``all_gather`` of the outcomes: when ``training_step`` raised on
  a rank, every rank raises, with that rank's message.
* **settle**: passes in a row at the chosen budget (:data:`SETTLE_PASSES`, no reset of the meter between them); over
  the target, the budget shrinks by that excess (:func:`~lit_balance.plan.budget_search.settled_budget`), once.

Every rank's outcome is gathered as a :class:`~lit_balance.plan.budget_search.RankOutcome`;
:meth:`lit_balance.lightning.budget.TokenBudget.measure` makes the budget of them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_balance._checks import check_int, check_number
from lit_balance.data.collate import collator_for
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.meters import MemoryMeter, meter_for
from lit_balance.lightning.optimizer_state import optimizer_state_bytes, optimizers_of, refuse_manual_optimization
from lit_balance.lightning.probe_state import ModuleSnapshot
from lit_balance.plan.budget_search import (
    OK,
    OUT_OF_MEMORY,
    OVER,
    DEVICE_CODES,
    BudgetSpace,
    MemoryMeasurement,
    MemoryModel,
    ProbeLayout,
    ProbeResult,
    RankOutcome,
    chosen_budget,
    next_budget,
    probe_shapes,
    settled_budget,
)
from lit_balance.plan.shapes import probe_planner
from lit_balance.plan.types import padded_lengths
from lit_balance.world import DataParallelWorld, data_parallel_world

__all__ = ["DEFAULT_MEMORY_FRACTION", "SETTLE_PASSES", "ProbeRankError", "ProbeResult", "TokenBudgetProbe"]

#: Share of a device's capacity the chosen budget's measured peak may use (the rest is headroom for fragmentation, a
#: longer validation batch, and memory the probe does not see).
DEFAULT_MEMORY_FRACTION = 0.9
#: Passes in a row at the chosen budget that must peak under the target (the settling step).
SETTLE_PASSES = 2
#: Bytes of a failing rank's error message that reach the other ranks.
_MESSAGE_BYTES = 4096


class ProbeRankError(RuntimeError):
    """The probe failed on another rank: its error, as that rank raised it."""


class TokenBudgetProbe:
    """Measure a LightningModule's peak memory on worst-case micro-batches and find the largest token budget.

    See the module docstring. Every data-parallel rank of ``world`` constructs it alike and calls :meth:`run`.

    Args:
        module: the LightningModule; its ``training_step(batch, 0)`` returns the loss (a tensor, or a mapping with
            ``"loss"``), on the device the module is on (the strategy's when a ``trainer`` is given).
        lengths: token lengths of the training split's documents (after ``max_length`` truncation), global.
        layout: how micro-batches are laid out (:class:`~lit_balance.plan.budget_search.ProbeLayout`).
        pad_token_id: padding token id of the collator.
        token_ids: 1-D token ids to fill the rows with (e.g. a real document, repeated), or None for
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
            ``memory_fraction`` outside (0, 1]; no documents; empty ``token_ids``.
        TypeError: a ``memory_limit`` that is not an int; ``layout`` not a ProbeLayout.
    """

    def __init__(self, module: Any, *, lengths: Any, layout: ProbeLayout, pad_token_id: int, token_ids: Any = None,
                 memory_limit: int | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 trainer: Any = None, world: DataParallelWorld | None = None, max_budget: int | None = None,
                 optimizers: Sequence[torch.optim.Optimizer] | None = None, meter: MemoryMeter | None = None) -> None:
        refuse_manual_optimization(module)
        if memory_limit is not None:
            memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
        self.memory_fraction = check_number("memory_fraction", memory_fraction, 0.0, 1.0,
                                            "set the share of memory the budget may use, e.g. 0.9", low_open=True)
        if not isinstance(layout, ProbeLayout):
            raise InputTypeError(f"layout must be a lit_balance.plan.budget_search.ProbeLayout, got "
                                 f"{type(layout).__name__}", parameter="layout")
        self.module, self.layout, self.trainer = module, layout, trainer
        self.world = world if world is not None else data_parallel_world(trainer)
        self.device = torch.device(module.device)
        self.meter = meter if meter is not None else meter_for(self.device, memory_limit)
        self.target = int(self.memory_fraction * self.meter.capacity)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.shapes = probe_shapes(lengths)
        longest, multiple = self.shapes["longest"], layout.pad_to_multiple_of
        min_budget = int(padded_lengths(np.array([longest]), multiple)[0])
        if max_budget is None:
            max_budget = -(-int(padded_lengths(lengths, multiple).sum()) // self.world.num_replicas)
        top = max(min_budget, int(max_budget) // multiple * multiple)
        self.space = BudgetSpace(min_budget, top, multiple=multiple, longest=longest, target=self.target)
        # static shapes: the worst case at each budget is the static shape (rows of [1, budget]; the padded shape
        # that holds the longest rows), read from the layout's settings at the largest budget
        settings = layout.settings(top)
        static = probe_planner(settings, lengths) if layout.static else None
        self.planner = static if static is not None else layout.planner
        self._worst_of = settings if static is not None else layout
        self.collator = collator_for(settings, pad_token_id, planner=self.planner)
        ids = np.full(1, pad_token_id + 1, np.int64) if token_ids is None else np.asarray(token_ids, np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise InputValueError(f"token_ids must be a non-empty 1-D array of token ids, got shape {ids.shape}",
                                  parameter="token_ids")
        self._ids = ids
        if optimizers is None:
            optimizers = list(trainer.optimizers or []) if trainer is not None else []
            if not optimizers and hasattr(module, "configure_optimizers"):
                optimizers = optimizers_of(module.configure_optimizers())
        self.state_bytes = optimizer_state_bytes(optimizers)
        self.measurements: list[MemoryMeasurement] = []
        #: Padded token slots and number of every pass run so far (filler passes included), this rank.
        self.slots_run = self.passes_run = 0
        #: Peak bytes of the last passes in a row (settling), or None before.
        self.settled_peak: int | None = None

    min_budget = property(lambda self: self.space.min_budget, doc="The smallest budget: one longest row, padded.")
    max_budget = property(lambda self: self.space.max_budget, doc="The largest budget considered (token slots).")

    # -- one pass --
    def _pass(self, budget: int, shape: str) -> int:
        """Forward and backward of the worst-case micro-batch of ``shape`` at ``budget``; returns its slots."""
        worst = self.planner.worst_case_batch(self._worst_of, int(budget), self.shapes[shape])
        ids = np.tile(self._ids, -(-max(worst.rows) // self._ids.size))
        batch = self.collator([{"input_ids": ids[:n], "index": i, "is_fill": False} for i, n in enumerate(worst.rows)])
        if self.trainer is not None:
            batch = self.trainer.strategy.batch_to_device(batch)
            context = self.trainer.precision_plugin.train_step_context()
        else:
            from lightning.fabric.utilities.apply_func import move_data_to_device
            batch, context = move_data_to_device(batch, self.device), contextlib.nullcontext()
        self.slots_run += worst.slots
        self.passes_run += 1
        with context:
            out = self.module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise InputTypeError(f"the probe runs training_step and needs its loss: a tensor or a mapping with "
                                 f"'loss', got {type(out).__name__}; set max_tokens to an int", parameter="max_tokens")
        loss.backward()
        return worst.slots

    def measure(self, budget: int, shape: str) -> MemoryMeasurement:
        """Run one pass of the ``shape`` micro-batch at ``budget`` and measure its peak (no collective). Call it inside
        :meth:`probing` (as :meth:`run` does) to leave the module as it was.

        Args:
            budget: padded token slots per micro-batch.
            shape: ``"longest"`` or ``"typical"``.

        Returns:
            The :class:`~lit_balance.plan.budget_search.MemoryMeasurement`: ``status`` ``"ok"``, ``"over"`` (a peak
            above the target) or ``"out of memory"`` (the device raised: no peak).

        Raises:
            ValueError: an unknown shape, or a budget that holds no row of it.
            Exception: whatever ``training_step`` raises other than out-of-memory errors.
        """
        if shape not in self.shapes:
            raise InputValueError(f"shape must be one of {sorted(self.shapes)}, got {shape!r}", parameter="shape")
        worst = self.planner.worst_case_batch(self._worst_of, int(budget), self.shapes[shape])
        if worst is None:
            raise InputValueError(f"a budget of {budget} token slots holds no row of {self.shapes[shape]} tokens",
                                  parameter="budget")
        try:
            self.meter.reset()
            self._pass(budget, shape)
            peak = int(self.meter.peak()) + self.state_bytes
            status = OVER if peak > self.target else OK
        except (torch.OutOfMemoryError, MemoryError):
            status, peak = OUT_OF_MEMORY, 0
        m = MemoryMeasurement(int(budget), worst.slots, worst.squares, peak, status, shape, self.shapes[shape])
        self.measurements.append(m)
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

    # -- lockstep rounds --
    def _fits(self, budget: int) -> list[str]:
        return [s for s in self.shapes if self.planner.worst_case_batch(self._worst_of, budget, self.shapes[s])]

    def _shapes_at(self, budget: int) -> list[str]:
        """Every shape at the first two budgets; then the one the memory model predicts to need more at ``budget``."""
        fitted = [m for m in self.measurements if m.peak_bytes > 0]
        if len({m.budget for m in self.measurements}) < 2 or not fitted:
            return self._fits(budget)
        model = MemoryModel.fit(fitted)
        predicted = {s: model.predict(w.slots, w.squares) for s in self._fits(budget)
                     for w in [self.planner.worst_case_batch(self._worst_of, budget, self.shapes[s])]}
        return [max(predicted, key=predicted.get)]

    def _lockstep(self, passes: Sequence[Callable[[], bool]]) -> bool:
        """One round: this rank's ``passes`` (each returns False when the rest need not run), filled with filler passes
        up to the most any rank runs, then one all_gather of the outcomes. True when no rank had a pass to run. Raises
        on every rank when one failed: its own error there, the first failing rank's message elsewhere."""
        counts = self.world.all_gather(torch.tensor([len(passes)], dtype=torch.float64))
        error, ran = None, 0
        try:
            for run_pass in passes:
                ran += 1
                if not run_pass():
                    break
            for _ in range(int(counts.max()) - ran):  # the same number of passes on every rank
                with contextlib.suppress(torch.OutOfMemoryError, MemoryError):
                    self._pass(self.min_budget, "longest")
        except Exception as exc:  # noqa: BLE001  the other ranks wait for this outcome: tell them, then raise
            error = exc
        failed = self.world.all_gather(torch.tensor([error is not None], dtype=torch.float64)).flatten()
        if failed.any():
            self._raise_first(error, [r for r in range(self.world.num_replicas) if failed[r]])
        return bool((counts == 0).all())

    def _raise_first(self, error: BaseException | None, failed: list[int]) -> None:
        """Raise ``error`` here, or on a rank that did not fail, the first failing rank's error message."""
        text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        local = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.float64)
        local[0] = len(text)
        local[1:1 + len(text)] = torch.tensor(list(text), dtype=torch.float64)
        messages = self.world.all_gather(local)
        if error is not None:
            raise error
        first = messages[failed[0]]
        cause = bytes(int(b) for b in first[1:1 + int(first[0])]).decode(errors="replace")
        raise ProbeRankError(f"max_tokens='auto': the token budget probe failed on rank(s) {failed}, so no rank "
                             f"trains; rank {failed[0]}'s error: {cause}")

    def _measure_round(self, budget: int | None, record: bool = True) -> bool:
        """Measure ``budget`` (None: this rank is done) in one lockstep round; True when every rank is done."""
        shapes = [] if budget is None else self._shapes_at(budget)
        done = self._lockstep([lambda s=s: self.measure(budget, s).status == OK for s in shapes])
        if not record:
            del self.measurements[:]
        return done

    def _in_a_row(self, budget: int) -> list[Callable[[], bool]]:
        """:data:`SETTLE_PASSES` passes at ``budget``, the shapes in turn, with no reset of the meter between them;
        the last sets :attr:`settled_peak` (the capacity and one byte after an out-of-memory error)."""
        shapes = self._fits(budget)

        def run(i: int) -> bool:
            if i == 0:
                self.meter.reset()
            try:
                self._pass(budget, shapes[i % len(shapes)])
            except (torch.OutOfMemoryError, MemoryError):
                self.settled_peak = self.meter.capacity + 1
                return False
            if i == SETTLE_PASSES - 1:
                self.settled_peak = int(self.meter.peak()) + self.state_bytes
            return True

        return [lambda i=i: run(i) for i in range(SETTLE_PASSES)]

    def settle(self, budget: int) -> tuple[int, int]:
        """Settle ``budget`` (0: nothing fits, this rank only takes part) in lockstep: the budget whose passes in a row
        peak at most at the target, else the one the memory model puts there less that excess (checked once more), or
        the smallest budget. Returns it and the rounds that ran passes."""
        smallest, rounds = budget, 0
        for _ in range(2):
            if self._lockstep(self._in_a_row(budget) if budget else []):
                break  # no rank had passes to run
            rounds += 1
            budget = (settled_budget(self.settled_peak, budget, self.measurements, self.space) or 0) if budget else 0
            smallest = min(smallest, budget) if budget else smallest
        return smallest, rounds

    def run(self) -> ProbeResult:
        """Probe on every rank of the world together.

        Returns:
            The :class:`ProbeResult`, its outcomes the same on every rank.

        Raises:
            Exception: on every rank when ``training_step`` raised on some rank (that rank re-raises its own error;
                the others a :class:`ProbeRankError` with its message).
        """
        start = time.perf_counter()
        # the first dataloader call of Trainer.fit may come from the sanity check, inside torch.inference_mode
        with torch.inference_mode(False), torch.enable_grad(), self.probing():
            rounds = 1
            self._measure_round(self.min_budget, record=False)  # once-only allocations (thread pools, kernel caches)
            while not self._measure_round(next_budget(self.measurements, self.space)):
                rounds += 1
            settled, settle_rounds = self.settle(chosen_budget(self.measurements))
        self.meter.reset()  # hand back what the passes freed (CPU: the heap; CUDA: the cache): training starts clean
        fitted = [m for m in self.measurements if m.peak_bytes > 0]
        model = MemoryModel.fit(fitted) if fitted else MemoryModel(0.0, 0.0, 0.0)
        local = RankOutcome(settled, self.meter.capacity, time.perf_counter() - start,
                            DEVICE_CODES.get(self.meter.device_kind, len(DEVICE_CODES)), model.intercept,
                            model.per_slot, model.per_square)
        rows = self.world.all_gather(torch.tensor(local.to_row(), dtype=torch.float64)).tolist()
        outcomes = tuple(RankOutcome.from_row(row) for row in rows)
        return ProbeResult(outcomes, rounds + 1 + settle_rounds, tuple(self.measurements), self.slots_run,
                           self.passes_run)
