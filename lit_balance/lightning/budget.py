"""The automatic token budget's owner: the budget record and ``max_tokens="auto"``.

``BalancedTextDataModule(max_tokens="auto")`` owns an :class:`AutoTokenBudget`: at fit start it runs the probe
(:class:`~lit_balance.lightning.probe.TokenBudgetProbe`: measure, lockstep rounds, settle) once, or restores the
budget a checkpoint saved, and hands the DataModule a :class:`TokenBudget` to plan with. The probe can also be run
alone (:func:`find_max_tokens`, :meth:`BalancedTextDataModule.find_max_tokens`, ``lit-balance plan --max-tokens auto``).

Ranks of the same device (type and capacity) plan with the smallest budget any of them measured
(:func:`~lit_balance.plan.budget_search.shared_budgets`): measurement noise never gives equal devices different
budgets; ranks of different capacity get per-rank budgets (``docs/per_rank_budgets.md``). On a CPU, glibc's mmap
threshold is fixed while the budget is measured and used (:class:`~lit_balance.lightning.meters.MmapThreshold`,
``cpu_mmap_threshold``), said once in the log and set back when the fit ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lit_balance._checks import check_int, check_number
from lit_balance.lightning.meters import CPU_MMAP_THRESHOLD, MemoryMeter, MmapThreshold
from lit_balance.lightning.optimizer_state import optimizer_state_bytes
from lit_balance.lightning.probe import DEFAULT_MEMORY_FRACTION, ProbeResult, TokenBudgetProbe
from lit_balance.plan.budget_search import MemoryMeasurement, shared_budgets
from lit_balance.errors import InputValueError
from lit_balance.world import DataParallelWorld, data_parallel_world

__all__ = ["DEFAULT_MEMORY_FRACTION", "AutoTokenBudget", "ProbeMeasurement", "TokenBudget", "TokenBudgetProbe",
           "find_max_tokens", "optimizer_state_bytes"]

#: One measured pass (:class:`lit_balance.plan.budget_search.MemoryMeasurement`).
ProbeMeasurement = MemoryMeasurement
_STATE_VERSION = 2


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

    @classmethod
    def measure(cls, probe: TokenBudgetProbe) -> TokenBudget:
        """Run ``probe`` (on every rank of its world) and make the budget of every rank's outcome.

        Raises:
            RuntimeError: on every rank, when a rank fits no micro-batch of one row of the longest documents under its
                target (naming the ranks, their capacity and the settings to change); as
                :meth:`~lit_balance.lightning.probe.TokenBudgetProbe.run`.
        """
        result: ProbeResult = probe.run()
        outcomes = result.outcomes
        measured = tuple(o.budget for o in outcomes)
        capacity = tuple(o.capacity_bytes for o in outcomes)
        if min(measured) == 0:
            bad = [r for r, b in enumerate(measured) if b == 0]
            here = [m for m in result.measurements if m.budget == probe.min_budget]
            mine = ("" if not here else "; this rank: out of memory" if min(m.peak_bytes for m in here) == 0
                    else f"; this rank measured {max(m.peak_bytes for m in here)} bytes")
            raise RuntimeError(
                f"max_tokens='auto': rank(s) {bad} cannot fit even one micro-batch of the longest rows "
                f"({probe.shapes['longest']} tokens, budget {probe.min_budget}) within memory_fraction="
                f"{probe.memory_fraction} of their capacity ({list(capacity)} bytes by rank{mine}); lower max_length, "
                "raise memory_limit or memory_fraction, use a smaller model, or set max_tokens to an int")
        per_rank = shared_budgets(measured, [(o.device_kind, o.capacity_bytes) for o in outcomes])
        return cls(max_tokens=min(per_rank), per_rank=per_rank, measured=measured, capacity_bytes=capacity,
                   memory_fraction=probe.memory_fraction, coefficients=tuple(o.coefficients for o in outcomes),
                   device=probe.meter.device_kind, probe_seconds=max(o.seconds for o in outcomes),
                   num_probes=result.rounds, measurements=result.measurements, probe_slots=result.slots_run)

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


class AutoTokenBudget:
    """``max_tokens="auto"``: the memory limit and fraction, and the budget once measured (or restored).

    :class:`~lit_balance.BalancedTextDataModule` holds one and asks it once, at fit start (:meth:`resolve`), and
    :meth:`release`\ s it when the fit ends; its :meth:`state_dict` goes into the DataModule's, so that a resume plans
    with the saved budget instead of probing again.

    Args:
        memory_limit: bytes one rank may use (on a CPU required: the process's peak resident set size; on CUDA
            optional, a cap below the device's memory).
        memory_fraction: share of the capacity the budget may use, in (0, 1].
        meter: a memory meter to measure with instead of the device's (:mod:`lit_balance.lightning.meters`).
        cpu_mmap_threshold: on a CPU (with the device's meter), glibc's mmap threshold in bytes from :meth:`resolve`
            to :meth:`release` (:class:`~lit_balance.lightning.meters.MmapThreshold`), so that training keeps to the
            peak the probe measured; None leaves the allocator alone.

    Attributes:
        budget: the :class:`TokenBudget`, or None before :meth:`resolve` (or :meth:`load_state_dict`).

    Raises:
        TypeError, ValueError: a bad ``memory_limit``, ``memory_fraction`` or ``cpu_mmap_threshold``.

    Example:
        >>> auto = AutoTokenBudget(memory_limit=8 * 2**30)
        >>> auto.budget is None, auto.state_dict()
        (True, {})
    """

    def __init__(self, memory_limit: int | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 meter: MemoryMeter | None = None, cpu_mmap_threshold: int | None = CPU_MMAP_THRESHOLD) -> None:
        if memory_limit is not None:
            memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
        if cpu_mmap_threshold is not None:
            cpu_mmap_threshold = check_int("cpu_mmap_threshold", cpu_mmap_threshold, 1,
                                           "bytes, e.g. 262144, or None to leave glibc's allocator alone")
        self.memory_limit = memory_limit
        self.memory_fraction = check_number("memory_fraction", memory_fraction, 0.0, 1.0,
                                            "the share of memory the budget may use, e.g. 0.9", low_open=True)
        self.meter = meter
        self.allocator = MmapThreshold(None if meter is not None else cpu_mmap_threshold)
        self.budget: TokenBudget | None = None

    def probe(self, module: Any, **kwargs: Any) -> TokenBudget:
        """Run :class:`~lit_balance.lightning.probe.TokenBudgetProbe` with this object's limit, fraction and meter
        (``kwargs``: the probe's other arguments, e.g. ``**dm.probe_inputs()``); sets nothing."""
        return TokenBudget.measure(TokenBudgetProbe(module, memory_limit=self.memory_limit,
                                                    memory_fraction=self.memory_fraction, meter=self.meter, **kwargs))

    def resolve(self, trainer: Any, **kwargs: Any) -> TokenBudget:
        """The budget: the one restored or measured before, else measured now with ``trainer.lightning_module``.

        On a CPU, holds :attr:`allocator` first (logged once), for the probe and the training after it, measured or
        restored alike, until :meth:`release`.

        Args:
            trainer: the fitting Trainer (its strategy, precision, optimizers and data-parallel world are used).
            **kwargs: :class:`~lit_balance.lightning.probe.TokenBudgetProbe`'s ``lengths``, ``layout``,
                ``pad_token_id``, ``token_ids``.

        Raises:
            RuntimeError: no budget yet and no Trainer with a module to measure; as :meth:`TokenBudget.measure`.
        """
        module = None if trainer is None else trainer.lightning_module
        if self.budget is None and module is None:
            raise RuntimeError("max_tokens='auto' is measured with the model at fit start: run "
                               "Trainer.fit(model, datamodule=dm), or call dm.find_max_tokens(model, ...) and pass "
                               "its max_tokens")
        if module is not None and module.device.type == "cpu" and (self.budget is None or self.budget.device == "cpu"):
            message = self.allocator.hold()
            if message:
                rank_zero_info(message)
        if self.budget is None:
            self.budget = self.probe(module, trainer=trainer, **kwargs)
        return self.budget

    def release(self) -> None:
        """Set back what :meth:`resolve` held (glibc's mmap threshold); the budget stays."""
        self.allocator.release()

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
                    world: DataParallelWorld | None = None, meter: MemoryMeter | None = None,
                    cpu_mmap_threshold: int | None = CPU_MMAP_THRESHOLD) -> TokenBudget:
    """Run only the probe: the largest token budget at which ``module`` trains on ``datamodule``'s micro-batches.

    Args:
        module: the LightningModule, on the device to measure (CPU or CUDA).
        datamodule: a :class:`~lit_balance.BalancedTextDataModule`
            (:meth:`~lit_balance.BalancedTextDataModule.probe_inputs`: its training split's lengths, layout and padding
            id); left as it was.
        memory_limit: bytes one rank may use (required on a CPU: the process's peak resident set size).
        memory_fraction: share of the capacity the budget may use.
        trainer: a Trainer whose strategy, precision and optimizers to use, or None.
        world: the data-parallel ranks that probe together (default: ``data_parallel_world(trainer)``; every one
            must call this function).
        meter: a memory meter to measure with instead of the device's.
        cpu_mmap_threshold: on a CPU (with the device's meter), glibc's mmap threshold while the probe runs, set back
            after it (:class:`~lit_balance.lightning.meters.MmapThreshold`); None leaves the allocator alone. Train
            with the budget under the same setting (``MmapThreshold(...).hold()``) to keep to the measured peak.

    Returns:
        The :class:`TokenBudget` (``max_tokens``: the smallest rank's budget; ``per_rank``: every rank's).

    Raises:
        RuntimeError, ValueError, TypeError: as :class:`~lit_balance.lightning.probe.TokenBudgetProbe` and
            :meth:`TokenBudget.measure`.
    """
    probe = TokenBudgetProbe(module, memory_limit=memory_limit, memory_fraction=memory_fraction, trainer=trainer,
                             world=world if world is not None else data_parallel_world(trainer), meter=meter,
                             **datamodule.probe_inputs())
    allocator = MmapThreshold(cpu_mmap_threshold if meter is None and probe.device.type == "cpu" else None)
    message = allocator.hold(until="the probe ends")
    if message:
        rank_zero_info(message)
    try:
        return TokenBudget.measure(probe)
    finally:
        allocator.release()
