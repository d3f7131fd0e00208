"""What the benchmarks share besides their peers: argument types, the source state, and a DDP launcher.

:func:`launch` starts one job's ranks with torch's own launcher (``python -m torch.distributed.run``,
i.e. ``torchrun``), which sets the distributed environment of every rank and stops the others when one fails;
around it this module adds a wall-clock timeout that stops every rank, and one log file per job.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["ROOT", "git_state", "launch_ranks", "non_negative", "number", "positive_int"]

#: The repository root (benchmarks/ is one level below it).
ROOT = Path(__file__).resolve().parents[1]


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1, else ``ArgumentTypeError`` naming what arrived."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def number(check: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse ``type`` that parses a float and raises ``ArgumentTypeError`` unless ``check`` holds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


#: An argparse ``type``: a finite number >= 0.
non_negative = number(lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")


def git_state(*paths: str) -> tuple[str | None, int | None]:
    """``(commit, files with uncommitted changes under paths)`` of the checkout the benchmarks run from.

    Returns ``(None, None)`` where git or the repository is missing.
    """
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *paths],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, len(changed)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(c) for c in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop the launcher and every rank: SIGTERM to the launcher (it forwards it to its ranks), then SIGKILL to
    whatever is left after ``grace_s`` (the ranks run in sessions of their own, so each is killed by group)."""
    if proc.poll() is not None:
        return
    ranks = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *ranks]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def launch_ranks(command: Sequence[str], num_ranks: int, log_path: Path, cwd: Path, timeout_s: float,
                 ) -> tuple[str, int | None]:
    """Run ``command`` as ``num_ranks`` ranks of one single-node job under ``torchrun``, with a timeout.

    ``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every rank
    (Lightning then launches none itself) and, when a rank fails, stops the others; a job running past
    ``timeout_s`` is stopped whole. Every rank writes to ``log_path``. The repository root is put on the ranks'
    ``PYTHONPATH``, so ``command`` may be ``["-m", "benchmarks.<module>", ...]`` from any ``cwd``.

    Args:
        command: what each rank runs: a script path or ``-m module``, then its arguments.
        num_ranks: processes (``--nproc-per-node``).
        log_path: file that receives every rank's stdout and stderr.
        cwd: working directory of the ranks.
        timeout_s: wall-clock limit of the whole job, seconds.

    Returns:
        ``(status, returncode)``: ``("ok", 0)``; ``("failed", code)`` where a rank failed (``torchrun``'s exit
        code; the log names the rank and its own code); ``("timeout", None)``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(num_ranks),
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
                "--monitor-interval", "0.5", *command]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launcher, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return "timeout", None
    return ("ok", 0) if rc == 0 else ("failed", rc)
