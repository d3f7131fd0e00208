"""A test script's ranks forked after its imports, each with ``LOCAL_RANK`` set: to Lightning, externally launched
ranks (as torchrun's). ``test_launcher_ddp.py`` runs the fits under Lightning's own launcher, as users do."""

import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable


def fork(body: Callable[[], object]) -> int:
    """The pid of a child that dies with this process, runs ``body`` and exits as the interpreter would."""
    sys.stdout.flush()
    sys.stderr.flush()
    if pid := os.fork():
        return pid
    code = 1
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        body()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if code and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  as an uncaught exception in a process of its own
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_all(pids: list[int], grace_s: float | None) -> list[int]:
    """Exit statuses of ``pids`` once all ended; with ``grace_s``, those left that long after a failure are killed."""
    status, kill_at = {}, float("inf")
    while len(status) < len(pids):
        pid, code = os.waitpid(-1, 0 if kill_at == float("inf") else os.WNOHANG)  # our children are pids
        if pid and status.setdefault(pid, os.waitstatus_to_exitcode(code)) and grace_s is not None:
            kill_at = min(kill_at, time.monotonic() + grace_s)
        for other in (p for p in pids if p not in status and time.monotonic() >= kill_at):
            os.kill(other, signal.SIGKILL)
        time.sleep(0 if pid else 0.05)
    return [status[p] for p in pids]


def run_as_ranks(main: Callable[[], object], num_ranks: int) -> None:
    """``main`` on each rank, forked, if the rig started this process (``FORK_RANKS``); else once (any launcher's)."""
    if num_ranks < 2 or "LOCAL_RANK" in os.environ or "FORK_RANKS" not in os.environ:
        return main()
    ranks = [lambda r=r: (os.environ.__setitem__("LOCAL_RANK", str(r)), main()) for r in range(num_ranks)]
    sys.exit(int(any(wait_all([fork(rank) for rank in ranks], grace_s=60))))  # 60 s to name a failure
