"""Train from a Megatron store read in place on real 2-process CPU DDP (gloo), stop mid-epoch, resume on 1 and on 2
ranks: every document once, each with its own tokens, and on 2 ranks exactly the uninterrupted run's micro-batches."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _procs import ddp_env, finish, free_ports  # tests/ddp/_procs.py

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, > 10 s each

SCRIPT = Path(__file__).with_name("fit_store.py")
ROOT = SCRIPT.parents[2]
STOP_AT = 3  # as fit_store.py


def _start(out: Path, kind: str, store: Path, phase: str, devices: int, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), kind, str(store), phase, str(devices)],
                            env=ddp_env(port, ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, out: Path, phase: str, devices: int) -> list[dict]:
    log = finish(proc, 300)
    assert proc.returncode == 0, log[-8000:]
    paths = [out / f"{phase}_rank{r}.json" for r in range(devices)]
    for _ in range(300):  # rank 1 is a child process of rank 0 and may finish writing a moment later
        if all(p.exists() for p in paths):
            break
        time.sleep(0.1)
    return [json.loads(p.read_text()) for p in paths]


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
    stop_dir = tmp_path_factory.mktemp("stop")
    ports = free_ports(4)
    full_dir = tmp_path_factory.mktemp("full")
    stop = _start(stop_dir, kind, store, "stop", 2, ports[0])
    full = _start(full_dir, kind, store, "full", 2, ports[1])
    stopped = _wait(stop, stop_dir, "stop", 2)
    uninterrupted = _wait(full, full_dir, "full", 2)
    resumed = {}
    procs = {}
    for devices, port in ((1, ports[2]), (2, ports[3])):
        out = tmp_path_factory.mktemp(f"resume{devices}")
        shutil.copy(stop_dir / "mid.ckpt", out / "mid.ckpt")
        procs[devices] = (out, _start(out, kind, store, "resume", devices, port))
    for devices, (out, proc) in procs.items():
        resumed[devices] = _wait(proc, out, "resume", devices)
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
