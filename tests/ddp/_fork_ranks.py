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


def wait_all(pids: list[int], stop_on_failure: bool) -> list[int]:
    """Exit statuses of ``pids`` once all ended; with ``stop_on_failure`` the first failure kills the others."""
    status: dict[int, int] = {}
    while len(status) < len(pids):
        pid, code = os.wait()  # the children of this process are pids
        status[pid] = os.waitstatus_to_exitcode(code)
        if status[pid] and stop_on_failure:  # the others get 5 s to end by themselves (Lightning's launcher looks
            time.sleep(5)                     # every 5 s), so that each rank reports its own error
            for other in (p for p in pids if p not in status):
                os.kill(other, signal.SIGKILL)  # a no-op on one that ended meanwhile; os.wait still gives its status
            stop_on_failure = False
    return [status[p] for p in pids]


def run_as_ranks(main: Callable[[], object], num_ranks: int) -> None:
    """``main`` on each rank, forked, if the rig started this process (``FORK_RANKS``); else once (any launcher's)."""
    if num_ranks < 2 or "LOCAL_RANK" in os.environ or "FORK_RANKS" not in os.environ:
        return main()
    ranks = [lambda r=r: (os.environ.__setitem__("LOCAL_RANK", str(r)), main()) for r in range(num_ranks)]
    sys.exit(int(any(wait_all([fork(rank) for rank in ranks], stop_on_failure=True))))
