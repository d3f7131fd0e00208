"""What the benchmarks share besides their peers: argument types, the shipped length distributions, the machine and
source state, clocks, child processes (:func:`run_child`, :func:`child_main`) and the one results writer
(:func:`write_report`)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

import lit_balance
from launch import finish

__all__ = ["DISTRIBUTIONS", "LENGTHS_DIR", "ROOT", "child_main", "git_state", "load_lengths", "machine",
           "markdown_table", "number", "positive_int", "run_child", "status_kib", "timed", "versions",
           "write_report"]

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
    """Run ``python -m <module> --child <args>`` from the repository root in a fresh process, through the
    repository's one launcher (``launch.finish``: past ``timeout_s`` it is killed with its children); the JSON object
    the last line of its output prints.

    Raises:
        RuntimeError: the process failed (with the end of its output).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", module, "--child", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    out = finish(proc, timeout_s)
    if proc.returncode:
        raise RuntimeError(f"the {args[0]} subprocess failed (exit code {proc.returncode}):\n{out[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def child_main(argv: Sequence[str] | None, children: dict[str, Callable[..., dict[str, Any]]],
               ) -> dict[str, Any] | None:
    """In a process :func:`run_child` started (arguments ``--child KIND ARGS...``; ``argv`` None: ``sys.argv[1:]``):
    ``children[KIND](*ARGS)``, printed as one JSON line and returned; in any other process None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--child"]:
        return None
    out = children[argv[1]](*argv[2:])
    print(json.dumps(out))
    return out


def write_report(output_dir: Path, module: str, argv: Sequence[str] | None, results: dict[str, Any],
                 markdown: str | None = None) -> dict[str, Any]:
    """Write one run's dated report, ``output_dir/results.json`` (and ``results.md`` with ``markdown``): the command
    (``python -m <module> ARGV``; ``argv`` None: ``sys.argv[1:]``), the commit with the count of files
    changed under ``benchmarks/`` and ``lit_balance/``, the date and the machine, then ``results``; return it."""
    commit, dirty = git_state("benchmarks", "lit_balance")
    report = {"command": " ".join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]),
              "commit": commit, "uncommitted_files": dirty,
              "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(), **results}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    if markdown is not None:
        (output_dir / "results.md").write_text(f"Command: `{report['command']}`; commit {commit}; {report['date_utc']}; "
                                               f"{report['machine']['platform']}, {report['machine']['cpu_count']} "
                                               f"CPUs.\n\n{markdown}\n")
    print(f"wrote {output_dir / 'results.json'}" + (" and results.md" if markdown is not None else ""))
    return report
