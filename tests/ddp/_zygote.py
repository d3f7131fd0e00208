"""Run a test script several times, side by side, in processes forked from one that imported torch and Lightning.

:func:`start` hands one call of :func:`serve` to a ``multiprocessing`` fork server (the standard library's
``forkserver`` start method): a process of this pytest worker's, started once, that imported the modules of
:data:`PRELOAD` and forks a fresh child for every call, so a call pays no import of torch or Lightning (seconds of
CPU each). The child runs SCRIPT's module body once (its other imports and definitions, not its ``__main__`` block),
then forks one process per run: it writes its stdout and stderr to the run's log, sets ``MASTER_PORT``, the run's
other variables, its working directory and ``sys.argv``, and runs SCRIPT as ``__main__``, as ``python SCRIPT
ARGV...`` would, each run a process (and its ranks' processes) of its own. A run dies with the child, and the child with a test's timeout (:meth:`Process.kill`).
"""

import json
import multiprocessing
import os
import runpy
import sys
from pathlib import Path

from _fork_ranks import run_in_child  # this script's folder is on sys.path

#: imported once by the fork server: what the test scripts import
PRELOAD = ["numpy", "torch", "torch.distributed", "lightning", "lightning.pytorch", "lit_balance",
           "lit_balance.lightning", "lit_balance.callbacks", "lit_balance.demo"]


def _run(script: str, run: dict) -> None:
    def body() -> None:
        log = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(run["port"])
        os.environ.update(run["env"])
        if run["cwd"] is not None:
            os.chdir(run["cwd"])
        sys.argv = [script, *run["argv"]]
        runpy.run_path(script, run_name="__main__")

    run_in_child(body)


def serve(script: str, runs: list[dict], env: dict[str, str], log: str, status_file: str) -> None:
    """In the fork server's child: ``env`` as the whole environment (the caller's of now; the fork server's own is the
    one its first caller had) and ``sys.path`` as for ``python SCRIPT`` (the script's folder, then ``PYTHONPATH``),
    output to ``log``; SCRIPT's body once, a forked process per run, their exit statuses written to ``status_file`` as
    one JSON list once all ended."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a process of its own (fork)
    sys.path[:0] = [str(Path(script).resolve().parent), *env.get("PYTHONPATH", "").split(os.pathsep)]
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
    Path(status_file).write_text(json.dumps(status))


def start(script: str, runs: list[dict], env: dict[str, str], log: str, status_file: str) -> multiprocessing.Process:
    """Start :func:`serve` in a child of this process's fork server (started, with :data:`PRELOAD`, on first use)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=serve, args=(script, runs, env, log, status_file), name="zygote")
    process.start()
    return process
