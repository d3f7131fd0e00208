"""A mixture under a weight schedule on real 2-process CPU DDP (gloo): stopped mid-epoch before the schedule's
transition and resumed on 3 ranks across it: exactly the documents of the uninterrupted run, and every step of both runs
within one document of the shares the schedule gives it."""

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real multi-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_schedule.py")
STOP_AT, TRANSITION = 3, 5  # as fit_schedule.py
SHARES = {0: np.array([0.8, 0.2]), TRANSITION: np.array([0.3, 0.7])}


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    stop_dir, full_dir, resume_dir = (tmp_path_factory.mktemp(name) for name in ("stop", "full", "resume"))
    run_scripts(SCRIPT, {"stop": [stop_dir, "stop", 2], "full": [full_dir, "full", 2]}, 400)
    shutil.copy(stop_dir / "mid.ckpt", resume_dir / "mid.ckpt")
    run_scripts(SCRIPT, {"resume": [resume_dir, "resume", 3]}, 400)
    return _read(stop_dir, "stop", 2), _read(full_dir, "full", 2), _read(resume_dir, "resume", 3)


def _documents(ranks):
    return Counter((c, d) for rank in ranks for batch in rank["batches"] for c, d, _ in batch)


def _step_units(ranks):
    steps = len(ranks[0]["batches"])
    units = np.zeros((steps, 2))
    for rank in ranks:
        for g, batch in enumerate(rank["batches"]):
            for c, _, tokens in batch:
                units[g, c] += tokens
    return units


def _scheduled(step):
    return SHARES[TRANSITION] if step >= TRANSITION else SHARES[0]


def test_a_resume_on_three_ranks_across_the_transition_trains_the_uninterrupted_documents(runs):
    stopped, full, resumed = runs
    assert all(len(rank["batches"]) == STOP_AT for rank in stopped)
    assert len({len(rank["batches"]) for rank in resumed}) == 1  # equal counts on the new ranks
    whole = _documents(full)
    assert max(whole.values()) == 1
    assert _documents(stopped) + _documents(resumed) == whole
    longest = max(t for rank in full for batch in rank["batches"] for _, _, t in batch)
    # every optimizer step (one micro-batch per rank) of both runs within one document of its scheduled shares; on the
    # new ranks, the rest of the epoch holds exactly the documents left, so once a component of it has run out (no
    # units in this step nor any later one) its last steps share among the components left (docs/schedules.md)
    for units, first, rest in ((_step_units(full), 0, False), (_step_units(resumed), STOP_AT, True)):
        assert first + len(units) > TRANSITION  # the transition is crossed
        ran_out = np.flip(np.cumsum(np.flip(units, axis=0), axis=0), axis=0) == 0  # [steps, 2]: none from here on
        for g, row in enumerate(units):
            within = np.abs(row - _scheduled(first + g) * row.sum()).max() <= longest
            assert within or (rest and ran_out[g].any()), (first + g, row)
        assert not rest or not ran_out[:len(units) // 2].any()  # only the tail
    np.testing.assert_allclose(resumed[0]["targets"][TRANSITION - STOP_AT], SHARES[TRANSITION])
