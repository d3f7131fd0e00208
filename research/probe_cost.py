"""What ``max_tokens="auto"`` costs on the main job: the probe's wall time and token slots against one epoch.

Run:
    python -m research.probe_cost                                   # 3 limits, 3 runs each
    python -m research.probe_cost --memory-limits-mib 700 --runs 1  # a quick look

How it measures, and the figures of its runs: ``docs/benchmarks/reports/2026-12-03-token-budget-probe.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L

from benchmarks._harness import ROOT, positive_int, write_report

__all__ = ["ProbeCostRecorder", "main", "run_once"]

#: memory_limit per rank (MiB) for budgets near 1,000, 2,500 and 4,000 slots on the 2-core test machine.
DEFAULT_LIMITS_MIB = (1100, 1700, 2300)
_WARMUP_ITERATIONS = 2


class ProbeCostRecorder(L.Callback):
    """Rank 0 writes the probe's cost and the epoch's size and iteration time to ``path`` (JSON) at train end.

    Args:
        path: the JSON file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        from lit_balance.plan.stats import plan_stats

        dm = trainer.datamodule
        budget, sampler = dm.token_budget, dm.train_sampler
        stats = plan_stats(sampler.plan(0), sampler.lengths, pad_to_multiple_of=dm.settings.pad_to_multiple_of)
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:])][_WARMUP_ITERATIONS - 1:]
        out = {"max_tokens": budget.max_tokens, "per_rank": list(budget.per_rank), "probe_s": budget.probe_seconds,
               "num_probes": budget.num_probes, "probe_slots": budget.probe_slots,
               "passes": [[m.budget, m.shape, m.slots, m.status] for m in budget.measurements],
               "micro_batches_per_epoch": len(sampler), "epoch_slots_rank0": int(stats.rank_padded_tokens[0]),
               "iteration_s": statistics.median(gaps), "iterations_timed": len(gaps)}
        Path(self.path).write_text(json.dumps(out), encoding="utf-8")


def run_once(memory_limit: int, max_steps: int, work: Path, timeout_s: float) -> dict[str, Any]:
    """One run of the main job with ``max_tokens=auto``; the recorder's JSON, plus the ratios and the run's wall time.

    Raises:
        RuntimeError: the run failed (with the end of its output).
    """
    out = work / f"cost_{memory_limit}_{time.monotonic_ns()}.json"
    args = [sys.executable, "recipes/train.py", "data.max_tokens=auto", f"data.memory_limit={memory_limit}",
            f"trainer.max_steps={max_steps}", "trainer.enable_progress_bar=false",
            f"hydra.run.dir={work / out.stem}",
            "+callbacks.probe_cost._target_=research.probe_cost.ProbeCostRecorder", f"+callbacks.probe_cost.path={out}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode or not out.exists():
        raise RuntimeError(f"the run at memory_limit={memory_limit} failed (exit code {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    r = json.loads(out.read_text(encoding="utf-8"))
    epoch_s = r["iteration_s"] * r["micro_batches_per_epoch"]
    r.update(memory_limit=memory_limit, run_wall_s=time.perf_counter() - start, epoch_s_estimate=epoch_s,
             wall_ratio=r["probe_s"] / epoch_s, slot_ratio=r["probe_slots"] / r["epoch_slots_rank0"])
    return r


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per limit, each run and the medians."""
    lines = ["| memory_limit per rank | run | budget chosen | probe s | probe slots (rank 0) | epoch: micro-batches, "
             "slots (rank 0) | iteration s | epoch s (estimate) | probe / epoch, wall | probe / epoch, slots |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for limit in sorted({r["memory_limit"] for r in rows}):
        runs = [r for r in rows if r["memory_limit"] == limit]
        for i, r in enumerate(runs, 1):
            lines.append(f"| {limit >> 20} MiB | {i} | {r['max_tokens']} | {r['probe_s']:.2f} | {r['probe_slots']:,} | "
                         f"{r['micro_batches_per_epoch']}, {r['epoch_slots_rank0']:,} | {r['iteration_s']:.3f} | "
                         f"{r['epoch_s_estimate']:.1f} | {100 * r['wall_ratio']:.2f} % | {100 * r['slot_ratio']:.2f} % |")
        lines.append(f"| {limit >> 20} MiB | median | {statistics.median(r['max_tokens'] for r in runs):.0f} | "
                     f"{statistics.median(r['probe_s'] for r in runs):.2f} | | | | | "
                     f"{100 * statistics.median(r['wall_ratio'] for r in runs):.2f} % | "
                     f"{100 * statistics.median(r['slot_ratio'] for r in runs):.2f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limits-mib", type=positive_int, nargs="+", default=list(DEFAULT_LIMITS_MIB),
                        help="memory_limit per rank, MiB")
    parser.add_argument("--runs", type=positive_int, default=3, help="runs per limit")
    parser.add_argument("--max-steps", type=positive_int, default=16, help="optimizer steps per run (before the "
                        "main job's first validation at 20)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/probe_cost"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):  # the limits in turn, so that a change of the machine's load touches each alike
            for mib in args.memory_limits_mib:
                rows.append(run_once(mib << 20, args.max_steps, Path(tmp), args.timeout_s))
                print(json.dumps({k: rows[-1][k] for k in ("memory_limit", "max_tokens", "probe_s", "wall_ratio",
                                                           "slot_ratio")}), flush=True)
    print(table(rows))
    return write_report(args.output_dir, "research.probe_cost", argv, {"rows": rows})


if __name__ == "__main__":
    main()
