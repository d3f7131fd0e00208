"""Each layout (padded, packed, static packed, padded_shapes) on a mixture of three components (a Megatron store, an
Arrow file, a JSONL file), trained on real 2-process CPU DDP (gloo), stopped mid-epoch and resumed on 3 ranks: exactly
the documents of an uninterrupted run, equal counts on the new ranks, and every micro-batch in its layout's shape within
its budget (fit_mixture.py with a LAYOUT; test_mixture_ddp.py checks the padded run's metrics and 1-rank resume)."""

import json
import shutil
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)
from tests.ddp.test_mixture_ddp import STOP_AT, _documents, _write_components

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real multi-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_mixture.py")
LAYOUTS = ["padded", "packed", "static_packed", "padded_shapes"]


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("components")
    _write_components(root)
    return root


def _check_shapes(rank: dict, layout: str) -> None:
    budget = rank["budget"]
    for rows, length in rank["shapes"]:
        if layout == "padded":
            assert rows * length <= budget
        elif layout == "padded_shapes":
            assert [rows, length] in rank["padded_shapes"]
        elif layout == "packed":
            assert rows == 1 and length <= budget
        else:
            assert [rows, length] == [1, budget]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_resumes_a_mixture_on_three_ranks_exactly(data, tmp_path, layout):
    stop_dir, full_dir, resume_dir = tmp_path / "stop", tmp_path / "full", tmp_path / "resume"
    for d in (stop_dir, full_dir, resume_dir):
        d.mkdir()
    run_scripts(SCRIPT, {"stop": [stop_dir, data, "stop", 2, layout], "full": [full_dir, data, "full", 2, layout]},
                400)
    shutil.copy(stop_dir / "mid.ckpt", resume_dir / "mid.ckpt")
    run_scripts(SCRIPT, {"resume": [resume_dir, data, "resume", 3, layout]}, 400)
    stopped, full, resumed = _read(stop_dir, "stop", 2), _read(full_dir, "full", 2), _read(resume_dir, "resume", 3)
    assert all(len(rank["batches"]) == STOP_AT for rank in stopped)
    everything = _documents(full)
    assert max(everything.values()) == 1 and {c for c, _ in everything} == {0, 1, 2}
    assert _documents(stopped) + _documents(resumed) == everything
    assert len({len(rank["batches"]) for rank in full}) == 1
    assert len({len(rank["batches"]) for rank in resumed}) == 1
    for rank in stopped + full + resumed:
        _check_shapes(rank, layout)
