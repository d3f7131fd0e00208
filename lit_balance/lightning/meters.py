"""Memory meters of the token budget probe: the peak memory of one pass, and the capacity it is measured against.

A meter has ``device_kind`` (``"cpu"``, ``"cuda"`` or any other word for logs), ``capacity`` (bytes), ``reset()``
(start a pass: forget the previous peak) and ``peak()`` (bytes since the last ``reset``); :func:`meter_for` picks the
one of a device. :class:`~lit_balance.lightning.budget.TokenBudgetProbe` takes any object with those members
(``meter=``), e.g. a scripted one in tests.
"""

from __future__ import annotations

import ctypes
import gc
import re
import sys
from typing import Protocol

import torch

from lit_balance.errors import InputValueError

__all__ = ["CpuMeter", "CudaMeter", "MemoryMeter", "meter_for"]


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


class CpuMeter:
    """Peak resident set size of this process (Linux: VmHWM of ``/proc/self/status``, reset by writing 5 to
    ``/proc/self/clear_refs``); freed heap memory is handed back (glibc ``malloc_trim``) before each pass, so a peak
    starts from what is in use.

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
        except OSError:  # not glibc: freed heap memory may stay resident, and passes then read high (the safe side)
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
