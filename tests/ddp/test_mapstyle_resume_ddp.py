"""balanced_dataloader handed the Trainer (trainer=self.trainer) under a real 2-process Trainer.fit (gloo, CPU), 2
persistent workers per rank: a resume from OnExceptionCheckpoint after a training step raised, and from a
ModelCheckpoint mid-epoch, trains every document of the epoch exactly once, as the uninterrupted run does: the loader
takes the fit loop's count from that Trainer."""

import shutil
from collections import Counter
from pathlib import Path

import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses with DataLoader workers

SCRIPT = Path(__file__).with_name("fit_mapstyle_resume.py")
MID, FAIL_AT, NUM_DOCUMENTS = 3, 5, 203  # as in the script


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{phase: [rank 0 record, rank 1 record]}: the uninterrupted run and the stopped one side by side, then the two
    resumes (from the stopped run's checkpoints) side by side."""
    dirs = {phase: tmp_path_factory.mktemp(phase) for phase in ("whole", "stop", "resume_mid", "resume_fail")}
    records = run_ranks(SCRIPT, {phase: (dirs[phase], [phase]) for phase in ("whole", "stop")}, 300)
    for phase, ckpt in (("resume_mid", "mid.ckpt"), ("resume_fail", "fail.ckpt")):
        shutil.copy(dirs["stop"] / ckpt, dirs[phase] / ckpt)
    records.update(run_ranks(SCRIPT, {phase: (dirs[phase], [phase]) for phase in ("resume_mid", "resume_fail")}, 300))
    return records


def _documents(batches_per_rank: list[list[list[int]]]) -> Counter:
    return Counter(i for batches in batches_per_rank for batch in batches for i in batch)


def _check_each_document_once(trained: Counter, whole: Counter) -> None:
    never, twice = whole - trained, trained - whole
    assert not never and not twice, (f"{sum(never.values())} of {sum(whole.values())} documents never trained, "
                                      f"{sum(twice.values())} trained twice")


def test_the_package_adds_no_callback_to_the_trainer(runs):
    assert not any(name.startswith("FitLoop") for records in runs.values() for r in records for name in r["callbacks"])


def test_a_resume_from_on_exception_checkpoint_reruns_the_failed_micro_batch_and_nothing_else(runs):
    whole, stop, resumed = runs["whole"], runs["stop"], runs["resume_fail"]
    assert sorted(_documents([r["finished"] for r in whole])) == list(range(NUM_DOCUMENTS))
    _check_each_document_once(_documents([r["finished"] for r in stop + resumed]),
                              _documents([r["finished"] for r in whole]))
    for r in (0, 1):
        expected = whole[r]["finished"]
        assert len(expected) > FAIL_AT + 4  # the workers (2 x prefetch 2) read ahead of the failure, inside the epoch
        assert stop[r]["started"] == expected[:FAIL_AT + 1]  # micro-batch FAIL_AT raised, on both ranks
        assert stop[r]["finished"] == expected[:FAIL_AT]
        assert resumed[r]["finished"][0] == expected[FAIL_AT]  # the failed micro-batch runs again, first
        assert stop[r]["finished"] + resumed[r]["finished"] == expected  # in the uninterrupted order


def test_a_resume_from_a_mid_epoch_model_checkpoint_continues_after_it(runs):
    whole, stop, resumed = runs["whole"], runs["stop"], runs["resume_mid"]
    _check_each_document_once(_documents([r["finished"][:MID] for r in stop] + [r["finished"] for r in resumed]),
                              _documents([r["finished"] for r in whole]))
    for r in (0, 1):
        expected = whole[r]["finished"]
        assert stop[r]["finished"][:MID] + resumed[r]["finished"] == expected  # in the uninterrupted order
