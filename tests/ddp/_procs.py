"""Tests' runs of processes with a limit, never a hang; scripts forked as ``python SCRIPT ARGV...`` would run."""

import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from _fork_ranks import fork, wait_all  # tests/ddp/_fork_ranks.py

PRELOAD = ["numpy", "torch", "lightning", "lit_balance.lightning", "lit_balance.callbacks", "lit_balance.demo"]


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """``proc``'s output (text, stderr merged) once it exits; past ``timeout_s`` it is killed: ``TimeoutExpired``."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    finally:
        proc.kill()  # a no-op once it exited


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on localhost now (bound together, so no two are the same)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    ports = [s.bind(("127.0.0.1", 0)) or s.getsockname()[1] for s in sockets]
    return [s.close() or port for s, port in zip(sockets, ports)]


def ddp_env(port: int, root: Path) -> dict[str, str]:
    """This environment with its own rendezvous port (``MASTER_PORT``) and ``root`` as ``PYTHONPATH``."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(root)}


def _output_to(path: str) -> None:
    for fd in (1, 2):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)


def serve(script: str, runs: list[dict], env: dict, log: str, status_file: str) -> None:  # the fork server's child
    _output_to(log)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a process of its own (fork)
    sys.path[:0] = [str(Path(script).resolve().parent), *env.get("PYTHONPATH", "").split(os.pathsep)]
    runpy.run_path(script, run_name="_imported_once")

    def run(spec: dict) -> None:  # in a run's process
        _output_to(spec["log"])
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        sys.argv = [script, *spec["argv"]]
        runpy.run_path(script, run_name="__main__")
    status = wait_all([fork(lambda spec=spec: run(spec)) for spec in runs], grace_s=None)
    Path(status_file).write_text(json.dumps(status))


def run_script(script: Path, args: list, timeout_s: float, cwd: Path | None = None, env: dict | None = None,
               runs: dict | None = None) -> tuple[int, str] | dict:
    """``(exit status, output)`` of ``python script *args``, forked, in this process's environment (plus ``env``) and
    working directory (or ``cwd``) of now, the repository root on ``PYTHONPATH``; with ``runs`` (``{key: args}``, side
    by side, each its own port): ``{key: (status, output)}``. Past ``timeout_s`` all are killed: ``TimeoutExpired``."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = [{"argv": [str(a) for a in argv], "log": f"{tmp}/{i}.log", "cwd": str(cwd or os.getcwd()),
                 "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "FORK_RANKS": "1", **(env or {})}}
                for i, (argv, port) in enumerate(zip((runs or {0: args}).values(), free_ports(len(runs or [0]))))]
        log, status = f"{tmp}/zygote.log", Path(tmp) / "status.json"
        (context := multiprocessing.get_context("forkserver")).set_forkserver_preload(PRELOAD)
        env_ = ddp_env(free_ports(1)[0], Path(__file__).parents[2])  # the repository root on PYTHONPATH
        (process := context.Process(target=serve, args=(str(script), spec, env_, log, str(status)))).start()
        process.join(timeout_s)
        if process.is_alive():  # its runs die with it
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(str(script), timeout_s, output=Path(log).read_text()[-8000:])
        assert process.exitcode == 0 and status.exists(), (process.exitcode, Path(log).read_text()[-8000:])
        out = [(code, Path(s["log"]).read_text()) for s, code in zip(spec, json.loads(status.read_text()))]
    return dict(zip(runs, out)) if runs else out[0]


def run_scripts(script: Path, runs: dict, timeout_s: float) -> dict:
    """``{key: output}`` of :func:`run_script`'s ``runs`` once all exited 0 (else ``AssertionError``)."""
    for key, (code, log) in (out := run_script(script, [], timeout_s, runs=runs)).items():
        assert code == 0, (key, code, log[-8000:])
    return {key: log for key, (_, log) in out.items()}


def run_ranks(script: Path, runs: dict, timeout_s: float, num_ranks: int = 2) -> dict:
    """``{key: [rank 0 record, ...]}``, the ``out_dir/rank<r>.json`` of fit runs ``{key: (out_dir, args)}``."""
    run_scripts(script, {key: [out, *args] for key, (out, args) in runs.items()}, timeout_s)
    return {key: [json.loads((out / f"rank{r}.json").read_text()) for r in range(num_ranks)]
            for key, (out, _) in runs.items()}
