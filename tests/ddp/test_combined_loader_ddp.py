"""Two BalancedDataLoaders in Lightning's CombinedLoader(mode="max_size") under a real 2-process Trainer.fit (gloo,
CPU), one DataLoader worker each, 2 epochs: the short loader runs out mid-epoch and gives None for the rest of it,
each loader trains every micro-batch of its epoch once per epoch, and a resume from OnExceptionCheckpoint after the
short loader ran out continues both loaders exactly (the short one stays done in that epoch, and starts its next
epoch's plan in the next)."""

import shutil
from pathlib import Path

import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses with DataLoader workers

SCRIPT = Path(__file__).with_name("fit_combined_max_size.py")
FAIL_AT = 14  # as in the script


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dirs = {phase: tmp_path_factory.mktemp(phase) for phase in ("whole", "stop", "resume")}
    records = run_ranks(SCRIPT, {phase: (dirs[phase], [phase]) for phase in ("whole", "stop")}, 300)
    shutil.copy(dirs["stop"] / "fail.ckpt", dirs["resume"] / "fail.ckpt")
    records.update(run_ranks(SCRIPT, {"resume": (dirs["resume"], ["resume"])}, 300))
    return records


def _per_loader(finished: list, epoch: int, key: str) -> list:
    return [b[key] for e, b in finished if e == epoch and b[key] is not None]


def test_each_loader_trains_its_epoch_once_and_the_short_one_gives_none_after_its_end(runs):
    for record in runs["whole"]:
        lengths = record["lengths"]
        assert lengths["short"] < FAIL_AT < lengths["long"]  # the premise: the stop comes after the short one ended
        for epoch in (0, 1):
            batches = [b for e, b in record["finished"] if e == epoch]
            assert len(batches) == lengths["long"]
            assert [b["short"] is None for b in batches] == [i >= lengths["short"] for i in range(len(batches))]
            for key in ("long", "short"):
                trained = [i for batch in _per_loader(record["finished"], epoch, key) for i in batch]
                assert len(trained) == len(set(trained))  # no document twice in an epoch on a rank
        assert _per_loader(record["finished"], 0, "short") != _per_loader(record["finished"], 1, "short")
    for epoch in (0, 1):  # the ranks split each epoch: no document on both
        for key in ("long", "short"):
            a, b = ({i for batch in _per_loader(r["finished"], epoch, key) for i in batch} for r in runs["whole"])
            assert not a & b


def test_a_resume_after_the_short_loader_ran_out_continues_both_exactly(runs):
    for r in (0, 1):
        whole, stop, resumed = runs["whole"][r]["finished"], runs["stop"][r]["finished"], runs["resume"][r]["finished"]
        assert len(stop) == FAIL_AT
        assert stop + resumed == whole  # both loaders, both epochs, step for step
