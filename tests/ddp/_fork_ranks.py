"""Start the ranks of a test's multi-process Lightning run by forking the script's already-imported process.

Lightning's own launcher for ``strategy="ddp"`` started as ``python script.py`` runs the script again for every
other rank, and each new process imports torch and Lightning again (seconds of CPU each). Here the script's
process forks once its imports are done: each child sets ``LOCAL_RANK`` as that launcher does and runs ``main``,
so Lightning sees an externally launched rank (as under ``torchrun``) and every rank still is its own process in
one gloo process group. The parent is rank 0; like Lightning's launcher it watches the other ranks and ends the
run when one of them fails, and it exits non-zero when any rank did.
"""

import ctypes
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_child(body: Callable[[], object]) -> None:
    """In a forked child: die with the parent (a test's timeout kills the parent), run ``body``, and end the process
    as the interpreter would (exit status of ``SystemExit``, its message printed; traceback and 1 on an uncaught
    exception); never returns."""
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        body()
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  as an uncaught exception in a process of its own: traceback, status 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_child(main: Callable[[], object], local_rank: int) -> None:
    """Rank ``local_rank``: runs ``main`` in this forked child (:func:`run_in_child`)."""

    def body() -> None:
        os.environ["LOCAL_RANK"] = str(local_rank)
        main()

    run_in_child(body)


def run_as_ranks(main: Callable[[], object], num_ranks: int) -> None:
    """Run ``main`` once per rank, rank 0 in this process and ranks 1.. in forked children.

    With ``num_ranks`` below 2, or ``LOCAL_RANK`` already set (another launcher started this process), ``main`` runs
    once here. ``MASTER_ADDR``/``MASTER_PORT`` are set before the fork when missing, so every rank meets at one port.

    Raises:
        SystemExit: a child rank exited non-zero (status 1), after every rank ended.
    """
    if num_ranks < 2 or "LOCAL_RANK" in os.environ:
        main()
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for local_rank in range(1, num_ranks):
        pid = os.fork()
        if pid == 0:
            _run_child(main, local_rank)
        children.append(pid)
    os.environ["LOCAL_RANK"] = "0"
    status: dict[int, int] = {}
    reaping = threading.Lock()
    main_pid = os.getpid()

    def reap(pid: int, flags: int) -> None:
        with reaping:
            if pid not in status:
                done, code = os.waitpid(pid, flags)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(code)

    def watch() -> None:  # as Lightning's launcher: a failed rank ends the others (checked every 5 s)
        while len(status) < len(children):
            for pid in children:
                reap(pid, os.WNOHANG)
            if any(code != 0 for code in status.values()):
                for pid in children:
                    if pid not in status:
                        os.kill(pid, signal.SIGKILL)
                os.kill(main_pid, signal.SIGTERM)
                return
            time.sleep(5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        main()
    finally:
        for pid in children:  # rank 0 is done (or failed): wait for the others
            reap(pid, 0)
    if any(code != 0 for code in status.values()):
        sys.exit(1)
