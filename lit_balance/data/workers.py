"""DataLoader worker processes that leave stopping to the main process: SIGINT and SIGTERM ignored in the workers.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the DataLoader's worker processes included,
and a scheduler's SIGTERM (``scancel``, ``kill -- -PGID``) often reaches the whole group too. A worker that dies of it
(PyTorch's worker loop ends quietly on ``KeyboardInterrupt``; SIGTERM kills it) makes the main process raise
``DataLoader worker (pid ...) exited unexpectedly`` at its next fetch, so a run that was told to stop at the end of
the optimizer step (:class:`~lit_balance.callbacks.LastStepCheckpoint`) fails instead. With
:func:`ignore_stop_signals_in_workers` as the loader's ``worker_init_fn`` the workers ignore both signals; the main
process decides when to stop, and its workers end with it (PyTorch's workers also exit when their parent is gone).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from lit_balance.errors import InputTypeError

__all__ = ["STOP_SIGNALS", "WorkerSignalsIgnored", "ignore_stop_signals_in_workers"]

#: The signals a worker ignores: the terminal's Ctrl-C and a scheduler's stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Lightning's worker seeding (``seed_everything(workers=True)`` sets this variable; Lightning then adds its own
# worker_init_fn to a loader only when it has none, so this one seeds the worker as Lightning would have)
_SEED_WORKERS_ENV = "PL_SEED_WORKERS"
_SEED_MODULES = ("lightning.fabric.utilities.seed", "lightning_fabric.utilities.seed")


class WorkerSignalsIgnored:
    """A DataLoader ``worker_init_fn``: SIGINT and SIGTERM ignored in the worker, then the ``worker_init_fn`` it wraps.

    Picklable (a module-level class holding the wrapped function), so it works with every multiprocessing start
    method. Wrapping one twice wraps once.

    Args:
        worker_init_fn: the loader's own ``worker_init_fn`` (called with the worker id after the signals are set), or
            None. With None and Lightning's worker seeding on (``seed_everything(workers=True)``), the worker is
            seeded as Lightning seeds it (``pl_worker_init_function``), which Lightning itself skips for a loader
            that already has a ``worker_init_fn``.

    Raises:
        TypeError: ``worker_init_fn`` is neither callable nor None.
    """

    def __init__(self, worker_init_fn: Callable[[int], Any] | None = None) -> None:
        if isinstance(worker_init_fn, WorkerSignalsIgnored):
            worker_init_fn = worker_init_fn.worker_init_fn
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise InputTypeError(f"worker_init_fn must be a function of the worker id or None, got "
                                 f"{worker_init_fn!r}", parameter="worker_init_fn")
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        elif os.environ.get(_SEED_WORKERS_ENV, "0") == "1":
            seed = next((sys.modules[m] for m in _SEED_MODULES if m in sys.modules), None)  # imported by the parent
            if seed is not None:
                seed.pl_worker_init_function(worker_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_init_fn!r})"


def ignore_stop_signals_in_workers(worker_init_fn: Callable[[int], Any] | None = None) -> WorkerSignalsIgnored:
    """``worker_init_fn`` for a DataLoader whose workers must leave Ctrl-C and SIGTERM to the main process.

    :class:`~lit_balance.BalancedDataLoader` (and so :func:`~lit_balance.data.loader.balanced_dataloader`) and every
    loader of :class:`~lit_balance.BalancedTextDataModule` use it, composed with a ``worker_init_fn`` given to them.

    Args:
        worker_init_fn: a function of the worker id to call afterwards, or None.

    Returns:
        A picklable :class:`WorkerSignalsIgnored`.

    Raises:
        TypeError: ``worker_init_fn`` is neither callable nor None.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), num_workers=1, worker_init_fn=ignore_stop_signals_in_workers())
        >>> sorted(int(x) for x in loader)
        [0, 1, 2, 3]
    """
    return WorkerSignalsIgnored(worker_init_fn)
