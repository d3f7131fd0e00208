"""Run a test script several times, side by side, from one process that imported what it imports once.

Run: python tests/ddp/_zygote.py SCRIPT SPEC_JSON, SPEC_JSON a file holding a list of runs, each
``{"argv": [...], "port": MASTER_PORT, "log": path}``. This process runs SCRIPT's module body once (its imports and
definitions, not its ``__main__`` block), then forks one child per run: the child writes its stdout and stderr to
the run's log, sets ``MASTER_PORT`` and ``sys.argv`` and runs SCRIPT as ``__main__`` (its imports now cached), as
``python SCRIPT ARGV...`` would, each run a process (and its ranks' processes) of its own. Prints the runs' exit
statuses as one JSON list once all ended; a child dies with this process (a test's timeout kills it).
"""

import json
import os
import runpy
import sys
from pathlib import Path

from _fork_ranks import run_in_child  # this script's folder is on sys.path


def _run(script: str, run: dict) -> None:
    def body() -> None:
        log = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(run["port"])
        sys.argv = [script, *run["argv"]]
        runpy.run_path(script, run_name="__main__")

    run_in_child(body)


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
