"""Resident memory does not grow with the stream: the peak over a stream 20 windows long, as a ratio of the peak after
its first window (both above the resident size at start), stays near 1. A ratio of two sizes of one run, not a time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a Python process that reads 40,000 documents

SCRIPT = Path(__file__).with_name("stream_memory.py")


def test_peak_resident_memory_over_a_stream_20_windows_long_stays_that_of_its_first_window():
    done = subprocess.run([sys.executable, str(SCRIPT), "2000", "20"], capture_output=True, text=True, timeout=300,
                          check=True)
    m = json.loads(done.stdout.strip().splitlines()[-1])
    first, end = m["first_window_peak_kb"] - m["base_kb"], m["end_peak_kb"] - m["base_kb"]
    assert first > 8_000  # the window is visible above the noise: about 2,000 documents of 500 int64 tokens
    assert end / first < 1.25, m
