"""A stream (JSONL files read lazily) as the corpus of BalancedTextDataModule, in a real fit started as users start it
(``python fit_stream_dm.py`` with ``Trainer(devices=2, strategy="ddp")``; Lightning's launcher starts rank 1): it stops
after a checkpoint at optimizer step 3, resumes from it on 3 ranks, and the two runs train every document of the stream
but the held-out ones exactly once, with equal micro-batch counts on every rank and nothing over the budget."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launch import finish  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real CPU ranks in fresh processes, seconds each

SCRIPT = Path(__file__).with_name("fit_stream_dm.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400  # per run; 27-56 s each on 2 cores shared with other work (19 s of CPU for both): a hang fails
SIZES = (50, 5, 45)  # documents per file; the second is 10x shorter


def _write_stream(folder: Path) -> int:
    rng = np.random.default_rng(11)
    for k, count in enumerate(SIZES):
        lines = [json.dumps({"input_ids": rng.integers(1, 64, int(rng.integers(2, 40))).tolist()})
                 for _ in range(count)]
        (folder / f"part{k}.jsonl").write_text("\n".join(lines) + "\n")
    return sum(SIZES)


def _fit(data: Path, out: Path, phase: str, devices: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "FORK_RANKS"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(data), str(out), phase, str(devices), "padded"],
                            cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = finish(proc, TIMEOUT_S)
    assert proc.returncode == 0, log[-8000:]
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


def _trained(records, upto=None):
    return [i for rec in records for _, idx, fills, _ in rec["batches"][:upto] for i, f in zip(idx, fills) if not f]


def test_a_stream_datamodule_fit_on_2_ranks_stops_at_a_checkpoint_and_resumes_on_3_ranks_training_each_document_once(
        tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    total = _write_stream(data)
    held_out = 6  # fit_stream_dm.HELD_OUT: the stream's first documents, validation only
    stop = _fit(data, tmp_path, "stop", 2)
    resume = _fit(data, tmp_path, "resume", 3)
    for run in (stop, resume):
        assert len({len(r["batches"]) for r in run}) == 1  # equal micro-batch counts on every rank
        assert all(slots <= 96 for r in run for *_, slots in r["batches"])  # fit_stream_dm.MAX_TOKENS
    assert resume[0]["batches"][0][0] == 3  # it goes on from the checkpoint's optimizer step
    # the checkpoint holds the first 6 micro-batches of each rank (3 optimizer steps of 2), not the prefetched one
    trained = _trained(stop, 6) + _trained(resume)
    assert sorted(trained) == list(range(held_out, total))  # every trained document exactly once, none held out
    assert resume[0]["val"] and all(np.isfinite(resume[0]["val"]))  # validation on the held-out documents ran
