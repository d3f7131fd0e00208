"""One training run of a JSON spec as the ranks of a ``torchrun`` job, started and stopped by the repository's one
launcher (``launch.py``): :func:`launch_run`; and :func:`commit_label`, the checkout the runs measure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import git_state
from launch import ROOT, finish


def commit_label() -> str | None:
    """The short commit of the checkout, ``+local changes`` when ``benchmarks/`` or ``lit_balance/`` differ from it."""
    commit, dirty = git_state("benchmarks", "lit_balance")
    return None if commit is None else commit[:7] + ("+local changes" if dirty else "")


def launch_ranks(command: Sequence[str], num_ranks: int, log_path: Path, cwd: Path, timeout_s: float,
                 ) -> tuple[str, int | None]:
    """Run ``command`` as ``num_ranks`` ranks of ``python -m torch.distributed.run --standalone``, with a timeout.

    ``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every rank
    (Lightning then launches none itself) and, when a rank fails, stops the others; a job running past ``timeout_s``
    is killed, ranks included (:func:`launch.finish`). Every rank writes to ``log_path``. The repository root is put
    on the ranks' ``PYTHONPATH``, so ``command`` may be ``["-m", "research.<module>", ...]`` from any ``cwd``.

    Returns:
        ``(status, returncode)``: ``("ok", 0)``; ``("failed", code)`` where a rank failed (``torchrun``'s exit
        code; the log names the rank and its own code); ``("timeout", None)``.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={num_ranks}", *command], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=str(cwd))
        try:
            finish(proc, timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout", None
    return ("ok", 0) if proc.returncode == 0 else ("failed", proc.returncode)


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
