"""Run a test script several times, side by side, from one process that imported what it imports once.

Run: python tests/ddp/_zygote.py SCRIPT SPEC_JSON, SPEC_JSON a file holding a list of runs, each
``{"argv": [...], "port": MASTER_PORT, "log": path}``. This process runs SCRIPT's module body once (its imports and
definitions, not its ``__main__`` block), then forks one child per run: the child writes its stdout and stderr to
the run's log, sets ``MASTER_PORT`` and ``sys.argv`` and runs SCRIPT as ``__main__`` (its imports now cached), as
``python SCRIPT ARGV...`` would, each run a process (and its ranks' processes) of its own. Prints the runs' exit
statuses as one JSON list once all ended; a child dies with this process (a test's timeout kills it).
"""

import ctypes
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _run(script: str, run: dict) -> None:
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        log = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(run["port"])
        sys.argv = [script, *run["argv"]]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:  # as the interpreter ends: a message is printed, with status 1
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  as an uncaught exception in a process of its own: traceback, status 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    script, runs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    sys.path.insert(0, str(Path(script).resolve().parent))  # as for python SCRIPT
    runpy.run_path(script, run_name="_imported_once")
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for i, run in enumerate(runs):
        pid = os.fork()
        if pid == 0:
            _run(script, run)
        children[pid] = i
    status = [None] * len(runs)
    while children:
        pid, code = os.wait()
        if pid in children:
            status[children.pop(pid)] = os.waitstatus_to_exitcode(code)
    print(json.dumps(status))


if __name__ == "__main__":
    main()
