"""Waiting on a test's subprocess with a timeout: it finishes, or it is killed and the test fails; never a hang."""

import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import _zygote  # tests/ddp/_zygote.py


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for ``proc`` and return its output (stdout with stderr merged, text).

    Raises:
        subprocess.TimeoutExpired: ``proc`` ran past ``timeout_s`` seconds (it is killed first).
    """
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return log


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on localhost now (bound together, so no two are the same)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def ddp_env(port: int, root: Path | None = None) -> dict[str, str]:
    """The environment of one multi-rank run: its own rendezvous port (runs started side by side would otherwise
    each pick a free port at the same moment and may pick the same one), and ``root`` on ``PYTHONPATH``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if root is not None:
        env["PYTHONPATH"] = str(root)
    return env


def _forked_runs(script: Path, runs: dict[Hashable, list[str]], timeout_s: float, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> dict[Hashable, tuple[int, str]]:
    """``{key: (exit status, output)}`` of ``python script *arguments`` run once per run, side by side
    (:func:`run_scripts`), in ``cwd`` with ``env`` added to the environment."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = {key: Path(tmp) / f"run{i}.log" for i, key in enumerate(runs)}
        spec = [{"argv": [str(a) for a in args], "port": port, "log": str(logs[key]),
                 "cwd": None if cwd is None else str(cwd), "env": env or {}}
                for (key, args), port in zip(runs.items(), free_ports(len(runs)))]
        env = ddp_env(free_ports(1)[0], Path(__file__).resolve().parents[2])  # the repository root
        log, status_file = Path(tmp) / "zygote.log", Path(tmp) / "status.json"
        process = _zygote.start(str(script), spec, env, str(log), str(status_file))
        process.join(timeout_s)
        if process.is_alive():  # its runs die with it
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(str(script), timeout_s, output=log.read_text()[-8000:])
        assert process.exitcode == 0 and status_file.exists(), (process.exitcode, log.read_text()[-8000:])
        return {key: (code, logs[key].read_text())
                for key, code in zip(runs, json.loads(status_file.read_text()))}


def run_scripts(script: Path, runs: dict[Hashable, list[str]], timeout_s: float) -> dict[Hashable, str]:
    """Run ``python script *arguments`` once per run, all side by side, each in a process of its own; ``{key:
    output}`` (stdout with stderr merged) once all exited zero.

    The runs are forked from one process that imported torch and Lightning once for this pytest worker
    (``_zygote.py``), in this process's environment and working directory of now, each with its own rendezvous port
    (``MASTER_PORT``) and the repository root on ``PYTHONPATH``.

    Args:
        script: a test script whose ``__main__`` block runs it.
        runs: ``{key: arguments}``.
        timeout_s: the runs' limit in seconds; past it every run is killed and the test fails.

    Raises:
        AssertionError: a run exited non-zero (with the tail of its output).
        subprocess.TimeoutExpired: the runs ran past ``timeout_s``.
    """
    outputs = _forked_runs(script, runs, timeout_s)
    for key, (code, log) in outputs.items():
        assert code == 0, (key, code, log[-8000:])
    return {key: log for key, (_, log) in outputs.items()}


def run_script(script: Path, args: list[str], timeout_s: float, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python script *args`` once as :func:`run_scripts` does, in ``cwd`` (None: this process's) with ``env``
    added to the environment; its exit status and output (stdout with stderr merged), whatever the status.

    Raises:
        subprocess.TimeoutExpired: the run ran past ``timeout_s``.
    """
    return _forked_runs(script, {0: args}, timeout_s, cwd, env)[0]


def run_ranks(script: Path, runs: dict[Hashable, tuple[Path, list[str]]], timeout_s: float,
              num_ranks: int = 2) -> dict[Hashable, list[dict[str, Any]]]:
    """Run ``script`` once per run, all side by side (:func:`run_scripts`), and return each run's per-rank JSON
    records.

    Args:
        script: a fit script that writes ``rank<r>.json`` into the output directory it is given first.
        runs: ``{key: (output_dir, arguments after output_dir)}``.
        timeout_s: the runs' limit in seconds; past it every run is killed and the test fails.
        num_ranks: ranks per run whose records are read.

    Returns:
        ``{key: [rank 0 record, rank 1 record, ...]}``.

    Raises:
        AssertionError: a run exited non-zero (with the tail of its output).
        subprocess.TimeoutExpired: the runs ran past ``timeout_s``.
    """
    run_scripts(script, {key: [out, *args] for key, (out, args) in runs.items()}, timeout_s)
    return {key: [json.loads((out / f"rank{r}.json").read_text()) for r in range(num_ranks)]
            for key, (out, _) in runs.items()}
