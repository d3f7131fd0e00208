"""Weights set by the training itself (MixtureWeightsHook) on real 2-process CPU DDP (gloo): rank 0's weights hold on
both ranks from the next epoch's first step, each step of that epoch holds them within one document, and a resume
from a checkpoint in that epoch trains the uninterrupted run's documents."""

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("fit_online_weights.py")
NEW = np.array([0.25, 0.75])  # fit_online_weights.RANK0_WEIGHTS, components (short, long)


def _read(out, phase, devices=2):
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    stop, full, resume = (tmp_path_factory.mktemp(n) for n in ("stop", "full", "resume"))
    # a quiet run takes about 20 s; 400 s leaves more than 5x
    run_scripts(SCRIPT, {"stop": [stop, "stop", 2], "full": [full, "full", 2]}, 400)
    shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
    run_scripts(SCRIPT, {"resume": [resume, "resume", 2]}, 400)
    return _read(stop, "stop"), _read(full, "full"), _read(resume, "resume")


def test_rank_0_weights_hold_on_every_rank_from_the_next_epoch(runs):
    _, full, _ = runs
    first = full[0]["first_step_epoch1"]
    assert [r["edits"] for r in full] == [[[first, {"short": 0.25, "long": 0.75}]]] * 2
    assert full[0]["schedule"] == full[1]["schedule"]
    for rank in full:
        assert np.allclose(rank["targets_epoch1"], NEW)
    # realised shares of epoch 1's optimizer steps (both ranks' micro-batches; accumulation 1): within one document
    steps = [b for b in full[0]["batches"] if b[0] == 1]
    other = [b for b in full[1]["batches"] if b[0] == 1]
    assert len(steps) == len(other)
    longest = max(t for rank in full for _, rows in rank["batches"] for _, _, t in rows)
    for (_, a), (_, b) in list(zip(steps, other))[:-1]:  # the epoch's last step may run out of a component
        units = np.zeros(2)
        for c, _, t in a + b:
            units[c] += t
        assert np.all(np.abs(units - NEW * units.sum()) <= longest)
    # epoch 0 kept its own shares (0.8/0.2): its long share is far below epoch 1's
    def long_share(epoch):
        u = np.zeros(2)
        for rank in full:
            for e, rows in rank["batches"]:
                if e == epoch:
                    for c, _, t in rows:
                        u[c] += t
        return u[1] / u.sum()
    assert long_share(0) < 0.4 < 0.6 < long_share(1)


def test_a_resume_reproduces_the_run(runs):
    stopped, full, resumed = runs
    def docs(ranks, epoch):
        return Counter((c, d) for rank in ranks for e, rows in rank["batches"] if e == epoch for c, d, _ in rows)
    assert docs(stopped, 1) + docs(resumed, 1) == docs(full, 1)
    assert [r["edits"] for r in resumed] == [r["edits"] for r in full]
    assert resumed[0]["schedule"] == full[0]["schedule"]
