"""Memory meters of the token budget probe: the peak memory of one pass, and the capacity it is measured against.

A meter has ``device_kind`` (``"cpu"``, ``"cuda"`` or any other word for logs), ``capacity`` (bytes), ``reset()``
(start a pass: forget the previous peak) and ``peak()`` (bytes since the last ``reset``); :func:`meter_for` picks the
one of a device. :class:`~lit_balance.lightning.probe.TokenBudgetProbe` takes any object with those members
(``meter=``), e.g. a scripted one in tests.

On a CPU the probe's peak is what training reaches only if the process hands freed memory back: :class:`MmapThreshold`
fixes glibc's mmap threshold for that, held by :class:`~lit_balance.lightning.budget.AutoTokenBudget` for a fit with
``max_tokens="auto"`` (and by ``find_max_tokens`` for the probe alone) and set back when it ends; the meter itself
changes nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
from typing import Protocol

import torch

from lit_balance.errors import InputValueError

__all__ = ["CPU_MMAP_THRESHOLD", "GLIBC_MMAP_THRESHOLD_MAX", "CpuMeter", "CudaMeter", "MemoryMeter", "MmapThreshold",
           "meter_for", "return_freed_memory"]

#: Bytes from which glibc serves an allocation with its own mapping while :class:`MmapThreshold` holds (256 KiB).
CPU_MMAP_THRESHOLD = 256 * 1024
#: The largest mmap threshold glibc's own adjustment reaches on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB).
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


class MemoryMeter(Protocol):
    """What the probe asks a meter (see the module docstring)."""

    device_kind: str
    capacity: int

    def reset(self) -> None:
        """Start a pass: the next :meth:`peak` counts from now."""

    def peak(self) -> int:
        """Peak bytes since the last :meth:`reset`."""


class CudaMeter:
    """Peak allocated CUDA memory of a pass (``torch.cuda.max_memory_allocated`` after
    ``torch.cuda.reset_peak_memory_stats``).

    Args:
        device: the CUDA device.
        memory_limit: a cap below the device's memory (bytes), or None: the device's total memory.
    """

    device_kind = "cuda"

    def __init__(self, device: torch.device, memory_limit: int | None = None) -> None:
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


def _mallopt_mmap_threshold(value: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, value)``; False where glibc is not the allocator."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(value)))


def return_freed_memory(threshold: int = CPU_MMAP_THRESHOLD) -> bool:
    """Make this process's resident size follow the memory in use: glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)``.

    By default glibc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed, so later tensors of
    that size come from the heap, and the heap keeps what they free: a CPU training run's resident size then grows
    over micro-batches of different shapes to far more than one micro-batch needs (up to twice a probe pass's memory
    above the process, in 25 steps of the demo transformer). With the threshold fixed, each tensor of ``threshold``
    bytes or more has its own mapping, returned when it is freed, so the probe's peak is what training reaches.
    Smaller allocations stay on the heap. Each large allocation then costs fresh pages (page faults, a few per cent of
    a CPU step's time). The setting holds for the whole process until changed: :class:`MmapThreshold` sets it for a
    while and back.

    Returns:
        True where the setting was made (glibc); False elsewhere (nothing changes).
    """
    return _mallopt_mmap_threshold(threshold)


def _threshold_before() -> int:
    """The threshold to set back: the one the process was started with (``GLIBC_TUNABLES``'
    ``glibc.malloc.mmap_threshold`` or ``MALLOC_MMAP_THRESHOLD_``), else :data:`GLIBC_MMAP_THRESHOLD_MAX`."""
    tunables = re.search(r"glibc\.malloc\.mmap_threshold=(\d+)", os.environ.get("GLIBC_TUNABLES", ""))
    value = tunables.group(1) if tunables else os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(value) if value.isdigit() else GLIBC_MMAP_THRESHOLD_MAX


class MmapThreshold:
    """glibc's mmap threshold fixed at ``threshold`` bytes from :meth:`hold` to :meth:`release`, for the whole process.

    While it holds, training on a CPU keeps to the peak the probe measured (see :func:`return_freed_memory`). glibc
    offers no call that turns its own adjustment of the threshold back on, so :meth:`release` sets the threshold the
    process was started with (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`` or ``MALLOC_MMAP_THRESHOLD_``), else
    32 MiB, the value glibc's own adjustment grows to under large tensors: tensors below it come from the heap again,
    as by default. Holds nest: the last :meth:`release` sets it back.

    Args:
        threshold: bytes, or None to change nothing (:meth:`hold` then does nothing).

    Example:
        >>> setting = MmapThreshold(None)
        >>> setting.hold(), setting.held
        (None, False)
    """

    _holders = 0  # holds in this process

    def __init__(self, threshold: int | None = CPU_MMAP_THRESHOLD) -> None:
        self.threshold = threshold
        self.held = False

    def hold(self, until: str = "the fit ends") -> str | None:
        """Fix the threshold (once per object) until ``until``; returns the line to log when this made the setting,
        else None."""
        if self.threshold is None or self.held:
            return None
        if MmapThreshold._holders == 0 and not _mallopt_mmap_threshold(self.threshold):
            return None  # not glibc: nothing to set
        MmapThreshold._holders += 1
        self.held = True
        return (f"max_tokens='auto' on a CPU: glibc's mmap threshold is fixed at {self.threshold} bytes until {until}, "
                "so that freed tensors go back to the system and training keeps to the peak the probe measures "
                "(cpu_mmap_threshold=None leaves the allocator alone; docs/token_budget.md)")

    def release(self) -> None:
        """Set the threshold back (see the class docstring) when this was the last hold."""
        if not self.held:
            return
        self.held = False
        MmapThreshold._holders -= 1
        if MmapThreshold._holders == 0:
            _mallopt_mmap_threshold(_threshold_before())


class CpuMeter:
    """Peak resident set size of this process (Linux: VmHWM of ``/proc/self/status``, reset by writing 5 to
    ``/proc/self/clear_refs``); freed heap memory is handed back (glibc ``malloc_trim``) before each pass, so a peak
    starts from what is in use. It changes no allocator setting (:class:`MmapThreshold` does).

    Args:
        memory_limit: bytes of resident memory the process may use (required).

    Raises:
        ValueError: no ``memory_limit``, or one above the machine's memory; not Linux.
    """

    device_kind = "cpu"
    _HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")

    def __init__(self, memory_limit: int | None) -> None:
        if memory_limit is None:
            raise InputValueError("max_tokens='auto' on a CPU needs memory_limit: the bytes of resident memory one "
                                  "rank's process may use (e.g. memory_limit=8 * 2**30)", parameter="memory_limit")
        if not sys.platform.startswith("linux"):
            raise InputValueError(f"the CPU probe reads the peak resident set size from /proc (Linux); this is "
                                  f"{sys.platform}: set max_tokens to an int", parameter="max_tokens")
        total = _memory_total()
        if total is not None and memory_limit > total:
            raise InputValueError(f"memory_limit={memory_limit} bytes exceeds this machine's memory ({total} bytes, "
                                  "MemTotal of /proc/meminfo): the probe would try micro-batches the machine cannot "
                                  "hold; pass the bytes one rank's process may really use (its share of the memory)",
                                  parameter="memory_limit")
        self.capacity = int(memory_limit)
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: freed heap memory may stay resident, and passes then read
            # high (the safe side)
            self._trim = None

    def reset(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def peak(self) -> int:
        with open("/proc/self/status") as handle:
            match = self._HWM.search(handle.read())
        if match is None:
            raise RuntimeError("/proc/self/status has no VmHWM line; set max_tokens to an int")
        return int(match.group(1)) * 1024


def _memory_total() -> int | None:
    """This machine's memory (bytes, MemTotal of ``/proc/meminfo``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as handle:
            match = re.search(r"MemTotal:\s+(\d+)\s+kB", handle.read())
    except OSError:
        return None
    return None if match is None else int(match.group(1)) * 1024


def meter_for(device: torch.device, memory_limit: int | None) -> MemoryMeter:
    """The meter of ``device``: :class:`CudaMeter` or :class:`CpuMeter`.

    Raises:
        ValueError: another device type; a CPU without ``memory_limit``.
    """
    if device.type == "cuda":
        return CudaMeter(device, memory_limit)
    if device.type == "cpu":
        return CpuMeter(memory_limit)
    raise InputValueError(f"max_tokens='auto' measures CUDA or CPU memory; the model is on {device}: set max_tokens "
                          "to an int, or pass a meter", parameter="max_tokens")
