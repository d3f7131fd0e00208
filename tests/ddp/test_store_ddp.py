"""Train from a Megatron store read in place on real 2-process CPU DDP (gloo), stop mid-epoch, resume on 1 and on 2
ranks: every document once, each with its own tokens, and on 2 ranks exactly the uninterrupted run's micro-batches."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_store.py")
ROOT = SCRIPT.parents[2]
STOP_AT = 3  # as fit_store.py


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


def megatron_store(root: Path) -> tuple[Path, list[list[int]]]:
    sys.path.insert(0, str(ROOT))
    from tests.data._stores import documents, write_megatron

    docs = documents(160, seed=9, longest=48)
    return write_megatron(root / "corpus", docs), docs


STORES = {"megatron": megatron_store}  # kind -> writer of (store path, documents); a datatrove writer joins here


@pytest.fixture(scope="module", params=sorted(STORES))
def runs(request, tmp_path_factory):
    kind = request.param
    store, docs = STORES[kind](tmp_path_factory.mktemp(f"{kind}_store"))
    stop_dir, full_dir = tmp_path_factory.mktemp("stop"), tmp_path_factory.mktemp("full")
    run_scripts(SCRIPT, {"stop": [stop_dir, kind, store, "stop", 2], "full": [full_dir, kind, store, "full", 2]}, 300)
    stopped, uninterrupted = _read(stop_dir, "stop", 2), _read(full_dir, "full", 2)
    outs = {}
    for devices in (1, 2):
        outs[devices] = tmp_path_factory.mktemp(f"resume{devices}")
        shutil.copy(stop_dir / "mid.ckpt", outs[devices] / "mid.ckpt")
    run_scripts(SCRIPT, {devices: [out, kind, store, "resume", devices] for devices, out in outs.items()}, 300)
    resumed = {devices: _read(out, "resume", devices) for devices, out in outs.items()}
    return docs, stopped, uninterrupted, resumed


def _rows(ranks: list[dict]) -> list[tuple[int, list[int]]]:
    return [(index, ids) for rank in ranks for batch in rank["batches"] for index, ids in batch]


def test_training_reads_each_document_from_the_store(runs):
    docs, _, uninterrupted, _ = runs
    kept = [d for d in docs if d]
    rows = _rows(uninterrupted)
    assert sorted(index for index, _ in rows) == list(range(len(kept)))  # every document once
    for index, ids in rows:
        assert ids == kept[index][:40]  # its own tokens, truncated to max_length
    assert not any(rank["cache_written"] for rank in uninterrupted)


@pytest.mark.parametrize("devices", [1, 2])
def test_resume_mid_epoch_trains_every_document_once(runs, devices):
    docs, stopped, uninterrupted, resumed = runs
    before = _rows(stopped)
    assert all(len(rank["batches"]) == STOP_AT for rank in stopped)
    after = _rows(resumed[devices])
    indices = sorted(index for index, _ in before + after)
    assert indices == sorted(index for index, _ in _rows(uninterrupted))  # every document once, as uninterrupted
    kept = [d for d in docs if d]
    assert all(ids == kept[index][:40] for index, ids in before + after)
    if devices == 2:  # same world: the two halves are the uninterrupted run's micro-batches, rank by rank
        for r in (0, 1):
            assert stopped[r]["batches"] + resumed[2][r]["batches"] == uninterrupted[r]["batches"]
