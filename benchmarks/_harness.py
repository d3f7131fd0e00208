"""What the benchmarks share besides their peers: argument types, the shipped length distributions, the machine and
source state, clocks, child processes and a DDP launcher.

:func:`launch_ranks` starts one job's ranks with torch's own launcher (``python -m torch.distributed.run``,
i.e. ``torchrun``), which sets the distributed environment of every rank and stops the others when one fails;
around it this module adds a wall-clock timeout that stops every rank, and one log file per job.
:func:`launch_run` runs one training run of a JSON spec that way and reads back its result.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import lit_balance

__all__ = ["DISTRIBUTIONS", "LENGTHS_DIR", "ROOT", "commit_label", "git_state", "launch_ranks", "launch_run",
           "load_lengths", "machine", "markdown_table", "non_negative", "number", "positive_int", "run_child",
           "status_kib", "timed", "versions"]

#: The repository root (benchmarks/ is one level below it).
ROOT = Path(__file__).resolve().parents[1]
#: The real token-length distributions shipped with the package (one int ``.npy`` per name).
LENGTHS_DIR = Path(lit_balance.__file__).resolve().parent / "data" / "lengths"
DISTRIBUTIONS = ("stdlib_docstrings", "pydocs_paragraphs", "fortunes")


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


def load_lengths(name: str, max_length: int | None = None, num_samples: int | None = None) -> np.ndarray:
    """Token counts (int64 ``[documents]``) of the shipped distribution ``name``, the first ``num_samples`` only,
    capped at ``max_length`` tokens (None: uncapped).

    Raises:
        FileNotFoundError: no such distribution (naming the ones there are).
    """
    path = LENGTHS_DIR / f"lengths_{name}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"length array {path} not found; expected one of {DISTRIBUTIONS} in {LENGTHS_DIR}")
    lengths = np.load(path).astype(np.int64)[:num_samples]
    return lengths if max_length is None else np.minimum(lengths, max_length)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of string cells, one list per row.

    Example:
        >>> print(markdown_table(["a", "b"], [["1", "2"]]))
        | a | b |
        |---|---|
        | 1 | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def versions() -> dict[str, str]:
    """Versions of Python and of the packages the benchmarks measure or compare with ("not installed" where absent)."""
    out = {"python": platform.python_version(), "numpy": np.__version__, "lit_balance": lit_balance.__version__}
    for name in ("torch", "lightning", "transformers", "lhotse"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def machine() -> dict[str, Any]:
    """The machine a run measures: platform, processor, CPU count, the 1-minute load average, the CUDA device."""
    cuda = None
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        cuda = sys.modules["torch"].cuda.get_device_name(0)
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "cuda": cuda, **versions()}


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


def commit_label() -> str | None:
    """The short commit of the checkout, ``+local changes`` when ``benchmarks/`` or ``lit_balance/`` differ from it."""
    commit, dirty = git_state("benchmarks", "lit_balance")
    return None if commit is None else commit[:7] + ("+local changes" if dirty else "")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)`` with the cyclic garbage collector paused, so no strategy pays for another's garbage."""
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    finally:
        gc.enable()


def status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of ``/proc/self/status``, in KiB.

    Raises:
        RuntimeError: no such line (the memory figures need Linux).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    raise RuntimeError(f"/proc/self/status has no {field} line; the memory figures need Linux")


def run_child(module: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m <module> --child <args>`` from the repository root in a fresh process; the JSON object its
    last line of stdout prints.

    Raises:
        RuntimeError: the process failed (with the end of its stderr).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", module, "--child", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=ROOT, check=False)
    if done.returncode:
        raise RuntimeError(f"the {args[0]} subprocess failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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


def launch_run(spec: dict[str, Any], out_dir: Path, timeout_s: float, worker: Sequence[str],
               keys: Sequence[str]) -> dict[str, Any]:
    """Run one training run as ``spec["devices"]`` ranks under :func:`launch_ranks`; return its result dict.

    The spec is written to ``runs/<run>.spec.json`` with ``result_path`` (``runs/<run>.json``, which rank 0 of a
    successful run writes) and ``trace_path`` (``runs/<run>.trace.npy``, where the run may save its trace) added;
    every rank runs ``[*worker, <spec path>]`` and logs to ``logs/<run>.log``.

    Args:
        spec: the run's settings, with ``run`` (its name) and ``devices``.
        out_dir: where ``runs/`` and ``logs/`` go (also the ranks' working directory).
        timeout_s: wall-clock limit of the run, seconds.
        worker: what each rank runs before the spec's path, e.g. ``["-m", "benchmarks.<module>", "--_worker"]``.
        keys: the spec's entries a failed run's result repeats.

    Returns:
        The result rank 0 wrote, or for a run that failed, timed out or wrote nothing: the ``keys`` of the spec,
        ``status`` (``"failed"`` or ``"timeout"``), ``returncode`` and ``log_tail``; either way with
        ``subprocess_wall_s`` and the 1-minute load average before and after.
    """
    runs_dir, logs_dir = out_dir / "runs", out_dir / "logs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    logs_dir.mkdir(parents=True, exist_ok=True)
    result_path, trace_path = (runs_dir / f"{spec['run']}.json").resolve(), (runs_dir / f"{spec['run']}.trace.npy")
    spec = {**spec, "result_path": str(result_path), "trace_path": str(trace_path.resolve())}
    result_path.unlink(missing_ok=True)
    trace_path.unlink(missing_ok=True)
    spec_path = runs_dir / f"{spec['run']}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = logs_dir / f"{spec['run']}.log"
    load_before, start = os.getloadavg()[0], time.perf_counter()
    status, rc = launch_ranks([*worker, str(spec_path.resolve())], spec["devices"], log_path, out_dir, timeout_s)
    wall = time.perf_counter() - start
    if status == "ok" and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {k: spec.get(k) for k in keys}
        result.update(status="failed" if status == "ok" else status, returncode=rc,
                      log_tail=log_path.read_text(errors="replace")[-2000:])
    result.update(subprocess_wall_s=wall, load_avg_1min_before=load_before, load_avg_1min_after=os.getloadavg()[0])
    return result
