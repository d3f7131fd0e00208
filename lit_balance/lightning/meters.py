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

__all__ = ["CPU_MMAP_THRESHOLD", "CpuMeter", "CudaMeter", "MemoryMeter", "meter_for", "return_freed_memory"]

#: Bytes from which glibc serves an allocation with its own mapping once :func:`return_freed_memory` ran (256 KiB).
CPU_MMAP_THRESHOLD = 256 * 1024
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


def return_freed_memory() -> bool:
    """Make this process's resident size follow the memory in use: glibc's ``mallopt(M_MMAP_THRESHOLD, 256 KiB)``.

    By default glibc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed, so later tensors of
    that size come from the heap, and the heap keeps what they free: a CPU training run's resident size then grows
    over micro-batches of different shapes to far more than one micro-batch needs (up to twice a probe pass's memory
    above the process, in 25 steps of the demo transformer). With the threshold fixed, each tensor of 256 KiB or more
    has its own mapping, returned when it is freed, so the probe's peak is what training reaches. The setting holds
    for the whole process from then on; smaller allocations stay on the heap. Each large allocation then costs fresh
    pages (page faults, a few per cent of a CPU step's time).

    Returns:
        True where the setting was made (glibc); False elsewhere (nothing changes).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD))


class CpuMeter:
    """Peak resident set size of this process (Linux: VmHWM of ``/proc/self/status``, reset by writing 5 to
    ``/proc/self/clear_refs``); freed heap memory is handed back (glibc ``malloc_trim``) before each pass, so a peak
    starts from what is in use. Constructing one calls :func:`return_freed_memory`, so that training after the probe
    keeps to what the probe measured.

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
        return_freed_memory()
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
