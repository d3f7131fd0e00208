"""How tests, benchmarks and research/ start processes and ranks, always with a limit: :func:`finish` (a process and
its children, such as torchrun's ranks), :func:`run_script` (``python SCRIPT ARGV`` forked from a fork server that
imported torch once) and, in such a script, :func:`run_as_ranks` (its ranks forked, ``LOCAL_RANK`` set)."""

import contextlib
import ctypes
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PRELOAD = ["numpy", "torch", "lightning", "lit_balance.lightning", "lit_balance.callbacks", "lit_balance.demo"]


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
    """``main`` on each rank, forked, if :func:`run_script` started this process (``FORK_RANKS``); else once."""
    if num_ranks < 2 or "LOCAL_RANK" in os.environ or "FORK_RANKS" not in os.environ:
        return main()
    ranks = [lambda r=r: (os.environ.__setitem__("LOCAL_RANK", str(r)), main()) for r in range(num_ranks)]
    sys.exit(int(any(wait_all([fork(rank) for rank in ranks], grace_s=60))))  # 60 s to name a failure


def finish(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """``proc``'s output (text, stderr merged) once it exits; past ``timeout_s`` it is killed with its child processes
    (torchrun's ranks, Lightning's second rank): ``TimeoutExpired``."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    finally:
        for task in Path(f"/proc/{proc.pid}/task").glob("*/children"):  # none once it exited
            with contextlib.suppress(OSError):  # a thread or a child that ended meanwhile
                for child in map(int, task.read_text().split()):
                    os.kill(child, signal.SIGKILL)
        proc.kill()  # a no-op once it exited
        proc.wait()


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on localhost now (bound together, so no two are the same)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    ports = [s.bind(("127.0.0.1", 0)) or s.getsockname()[1] for s in sockets]
    return [s.close() or port for s, port in zip(sockets, ports)]


def ddp_env(port: int, root: Path = ROOT) -> dict[str, str]:
    """This environment with its own rendezvous port (``MASTER_PORT``) and ``root`` as ``PYTHONPATH``."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(root)}


def serve(script: str, runs: list[dict], env: dict, log: str, status_file: str) -> None:  # the fork server's child
    def output_to(path: str) -> None:
        for fd in (1, 2):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    output_to(log)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a process of its own (fork)
    sys.path[:0] = [str(Path(script).resolve().parent), *env.get("PYTHONPATH", "").split(os.pathsep)]
    runpy.run_path(script, run_name="_imported_once")

    def run(spec: dict) -> None:  # in a run's process
        output_to(spec["log"])
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
        env_ = ddp_env(free_ports(1)[0])
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
