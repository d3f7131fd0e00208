"""Training at the budget max_tokens="auto" chose stays under the memory limit: the probe, then 25 real training steps
(forward, backward, AdamW steps, the real loader) of the demo transformer on CPU, at a tight limit (about 160 MiB
above the process, a few rows of the longest documents' room at the target) and a loose one, 5 times each."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # 2 processes, each 5 probes and 5 x 25 steps

SCRIPT = Path(__file__).with_name("budget_limit.py")
SEEDS = range(5)


def _run(tmp_path: Path, room_mib: int) -> list[dict]:
    """The seeds one after the other in one process at ``room_mib`` of room."""
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / str(room_mib)), str(room_mib),
                           *map(str, SEEDS)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(SEEDS):]]


def test_every_training_peak_after_the_probe_stays_under_the_limit(tmp_path):
    rooms = (160, 280)
    with ThreadPoolExecutor(2) as pool:  # a process each: peak resident memory is a whole process's
        results = [r for runs in pool.map(lambda room: _run(tmp_path, room), rooms) for r in runs]
    cases = [(room, seed) for room in rooms for seed in SEEDS]
    for (room, seed), r in zip(cases, results):
        assert r["steps"] == 25
        assert r["peak"] <= r["limit"], (room, seed, r)
    tight = [r["max_tokens"] for (room, _), r in zip(cases, results) if room == 160]
    loose = [r["max_tokens"] for (room, _), r in zip(cases, results) if room == 280]
    assert max(tight) < min(loose)  # the limit decides the budget
    print("tight", tight, "loose", loose, "peaks / limits MiB",
          [(r["peak"] >> 20, r["limit"] >> 20) for r in results])
