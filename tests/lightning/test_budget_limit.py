"""Training at the budget max_tokens="auto" chose stays under the memory limit: the probe, then 25 real training steps
(forward, backward, AdamW steps, the real loader) of the demo transformer on CPU, at a tight limit (about 160 MiB
above the process, a few rows of the longest documents' room at the target) and a loose one, 5 times each."""

import json
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]  # 2 processes, each 5 probes and 5 x 25 steps

SCRIPT = Path(__file__).with_name("budget_limit.py")
SEEDS = range(5)


def test_every_training_peak_after_the_probe_stays_under_the_limit(tmp_path):
    rooms = (160, 280)
    # a process each, side by side (peak resident memory is a whole process's), forked from one that imported torch
    # and Lightning once (launch.py); the seeds one after the other in each
    logs = run_scripts(SCRIPT, {room: [tmp_path / str(room), room, *SEEDS] for room in rooms}, 1800)
    results = [json.loads(line) for room in rooms for line in logs[room].splitlines() if line.startswith("{")]
    assert len(results) == len(rooms) * len(SEEDS), {room: logs[room][-3000:] for room in rooms}
    cases = [(room, seed) for room in rooms for seed in SEEDS]
    for (room, seed), r in zip(cases, results):
        assert r["steps"] == 25
        assert r["peak"] <= r["limit"], (room, seed, r)
    tight = [r["max_tokens"] for (room, _), r in zip(cases, results) if room == 160]
    loose = [r["max_tokens"] for (room, _), r in zip(cases, results) if room == 280]
    assert max(tight) < min(loose)  # the limit decides the budget
    print("tight", tight, "loose", loose, "peaks / limits MiB",
          [(r["peak"] >> 20, r["limit"] >> 20) for r in results])
