"""A length warm-up (``max_length_schedule``) in real 2-rank CPU DDP fits (gloo): stopped mid-stage and resumed on 3
ranks, it trains the uninterrupted run's pieces up to the checkpoint, then exactly the pieces the sampler plans for
the rest on 3 ranks, every token of the data once, each piece within its optimizer step's ``max_length``."""

import json
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_warmup.py")


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2-rank epoch and the stopped one side by side, then the resume on 3 ranks. Quiet, the
    two runs take about 25 s and the resume about 15 s on 2 cores: limits of 240 s each."""
    full, stop, resume = (tmp_path_factory.mktemp(k) for k in ("full", "stop", "resume"))
    run_scripts(SCRIPT, {"full": [full, "full", 2], "stop": [stop, "stop", 2]}, 240)
    shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
    run_scripts(SCRIPT, {"resume": [resume, "resume", 3]}, 240)
    return _read(full, "full", 2), _read(stop, "stop", 2), _read(resume, "resume", 3), resume


def _pieces(record: dict) -> dict[int, list]:
    return {int(k): v for k, v in record["batches"].items()}


def test_resumed_on_three_ranks_mid_stage_trains_every_token_once_within_the_schedule(runs):
    fw = type("Script", (), runpy.run_path(str(SCRIPT), run_name="fit_warmup"))  # its constants
    full, stopped, resumed, resume_dir = runs
    lengths = np.array(full[0]["lengths"])
    for r in (0, 1):  # up to the checkpoint, the uninterrupted run's pieces
        before = _pieces(stopped[r])
        assert sorted(before) == list(range(fw.STOP_AT))
        assert [before[i] for i in range(fw.STOP_AT)] == [_pieces(full[r])[i] for i in range(fw.STOP_AT)]
    from lit_balance import BalancedBatchSampler, Schedule

    state = torch.load(resume_dir / "mid.ckpt", weights_only=True)
    schedule = Schedule.of(fw.SCHEDULE)
    covered = np.zeros((lengths.size, int(lengths.max())), dtype=np.int64)
    for record in [*stopped, *resumed]:
        for batch_idx, rows in _pieces(record).items():
            limit = int(schedule.value_at(batch_idx // fw.ACCUMULATE))  # epoch 0 starts the run
            for doc, start, n in rows:
                assert n <= limit, (batch_idx, doc, start, n, limit)
                covered[doc, start:start + n] += 1
    for d, n in enumerate(lengths.tolist()):  # nothing lost, nothing repeated
        assert (covered[d, :n] == 1).all() and (covered[d, n:] == 0).all(), d
    assert len({r["len"] for r in resumed}) == 1  # equal counts on the 3 ranks
    # after the checkpoint, exactly the pieces the sampler plans for the rest of the epoch on 3 ranks
    saved = state["BalancedTextDataModule"]["train_sampler"]
    assert saved["first_optimizer_step"] == 0 and saved["segments"] == [[2, fw.STOP_AT]]
    for r in range(3):
        sampler = BalancedBatchSampler(lengths, max_tokens=fw.MAX_TOKENS, num_replicas=3, rank=r, seed=3,
                                       accumulate_grad_batches=fw.ACCUMULATE, max_length_schedule=fw.SCHEDULE)
        sampler.load_state_dict(saved)
        expected = [[[int(d), s, n] for d, s, n, f in zip(mb, mb.piece_start, mb.piece_length, mb.is_fill) if not f]
                    for mb in sampler]
        after = _pieces(resumed[r])
        assert [after[i] for i in sorted(after)] == expected
        assert min(after) == fw.STOP_AT
