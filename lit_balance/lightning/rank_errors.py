"""When one rank fails, every rank's error names the real cause: :func:`share_failure`.

A rank that fails while the others wait in a collective (a bad document that only it reads, a store file changed
under it) ends the run, and the other ranks stop with gloo's or NCCL's "Connection closed by peer" (or reset, or a
timeout): the cause is only in the failing rank's own output, which with DataLoader workers and many nodes is hard
to find or lost. :func:`share_failure` runs in every rank's ``on_exception`` hook (the DataModule's):

* a rank whose error is its own (not a communication error) writes ``"<type>: <message>"`` under
  ``lit_balance/<n>/failed/<rank>`` in the process group's key-value store (the rendezvous TCPStore every rank
  already reaches; ``n`` counts this process's failed fits, the same on every rank). When every other rank has failed
  by itself within :data:`ALL_FAILED_S` seconds (the same error on every rank), nobody waits on it and the process
  group stays as it is (a later fit in the same processes can use it). Otherwise it destroys its process group so
  that the ranks waiting on it stop now rather than at its exit or at the timeout, and waits (at most
  :data:`WAIT_S` seconds) until each of them has read the cause;
* a rank stopped by a communication error waits (at most :data:`WAIT_S` seconds) for another rank's cause, adds it to
  its own exception's message (as Lightning's strategies augment messages: ``exception.args``), marks it read, and
  raises as before.

The store lives in rank 0's process under Lightning's launchers (under ``torchrun``, in the agent's): that is why the
failing rank waits for the others to read before it exits.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import Any

__all__ = ["ALL_FAILED_S", "WAIT_S", "share_failure"]

#: Seconds a rank waits for another's cause, and a failing rank for the others to read its own.
WAIT_S = 20.0
#: Seconds a failing rank waits for every other rank to fail by itself before it ends the process group.
ALL_FAILED_S = 2.0
_POLL_S = 0.05
_failed_fits = itertools.count()
_COMMUNICATION = ("connection closed by peer", "connection reset by peer", "gloo", "nccl", "timed out",
                  "broken pipe", "socket")


def _world() -> tuple[Any, int, int] | None:
    """``(store, rank, world_size)`` of the default process group, or None outside a multi-process run."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        store = distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
    return store, dist.get_rank(), dist.get_world_size()


def is_communication_error(exception: BaseException) -> bool:
    """Whether ``exception`` says that a collective or the rendezvous failed (a peer gone, a timeout), rather than
    naming a cause of its own."""
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover
        DistError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(exception, DistError):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(word in text for word in _COMMUNICATION)


def _within(seconds: float, done: Any) -> bool:
    """Whether ``done()`` turned true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def share_failure(exception: BaseException, wait_s: float = WAIT_S) -> None:
    """Tell the other ranks why this one fails, or learn why another did (see the module docstring).

    Outside a multi-process run (no process group, one rank) it does nothing. It never raises: a store that cannot
    be reached (its host already gone) leaves the exception as it is.

    Args:
        exception: the exception this rank stops with; a communication error gets the cause that another rank
            wrote appended to its message (``exception.args``).
        wait_s: at most this many seconds of waiting (see the module docstring).
    """
    world = _world()
    if world is None or isinstance(exception, KeyboardInterrupt):
        return
    store, rank, world_size = world
    others = [r for r in range(world_size) if r != rank]
    fit = next(_failed_fits)
    failed, read = f"lit_balance/{fit}/failed/", f"lit_balance/{fit}/read/"
    try:
        store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
        if not is_communication_error(exception):
            cause = f"{type(exception).__name__}: {exception}"
            store.set(f"{failed}{rank}", cause.encode())
            if _within(ALL_FAILED_S, lambda: all(store.check([f"{failed}{r}"]) for r in others)):
                return  # every rank failed by itself: none waits on another
            import torch.distributed as dist

            dist.destroy_process_group()  # the ranks waiting on this one stop now (the store stays: we hold it)
            _within(wait_s, lambda: all(store.check([f"{read}{r}"]) or store.check([f"{failed}{r}"])
                                        for r in others))
            return
        deadline = time.monotonic() + wait_s
        causes: list[tuple[int, str]] = []
        while not causes and time.monotonic() < deadline:
            causes = [(r, store.get(f"{failed}{r}").decode()) for r in others if store.check([f"{failed}{r}"])]
            if not causes:
                time.sleep(_POLL_S)
        store.set(f"{read}{rank}", b"1")
    except Exception:  # noqa: BLE001  the store's host is gone, or never was: the exception stays as it is
        return
    if causes:
        told = "; ".join(f"rank {r} stopped first with {cause}" for r, cause in causes)
        message = f"{told}\n(this rank, {rank}, then lost its peers: {exception})"
        exception.args = (message, *exception.args[1:])
