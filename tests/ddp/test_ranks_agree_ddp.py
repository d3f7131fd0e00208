"""Ranks that planned different data fail together, on real 2-process CPU DDP (gloo)."""

from pathlib import Path

import pytest

from launch import run_script  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # a real 2-rank CPU fit in a subprocess, seconds

SCRIPT = Path(__file__).with_name("fit_disagree.py")


def test_a_document_missing_on_one_rank_stops_every_rank_with_the_cause(tmp_path):
    code, log = run_script(SCRIPT, [tmp_path], 480)  # never a hang: 4x the ranks' 120 s rendezvous and collective limit
    assert code != 0, log[-4000:]
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("RuntimeError: "), (rank, message)
        assert "rank 1" in message and "rank 0" in message, message
        assert "60 vs 59 documents" in message or "documents: rank 0 has 60, rank 1 has 59" in message, message
        assert "per-node" in message and "tokenizer" in message and "max_length" in message, message
