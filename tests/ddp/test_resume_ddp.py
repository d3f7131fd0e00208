"""Resume through a Lightning checkpoint taken mid-epoch, on real 2-process CPU DDP (gloo)."""

import json
import shutil
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_resume.py")
ACCUMULATE = 2  # the stop after 3 micro-batches falls inside an optimizer step's window


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank run (2 loader workers, which prefetch ahead of training) that saves a checkpoint mid-epoch inside
    an accumulation window and then fails inside training_step (OnExceptionCheckpoint saves another), then, side by
    side, the first resumed on 2 ranks (2 workers) and on 1 rank (no workers), the failure's on 2 ranks (2 workers,
    key "fail")."""
    stop_dir = tmp_path_factory.mktemp("stop")
    run_scripts(SCRIPT, {"stop": [stop_dir, "stop", 2, 2, ACCUMULATE]}, 240)
    stopped = _read(stop_dir, "stop", 2)
    resumes = {2: ("resume", "mid", 2, 2), 1: ("resume", "mid", 1, 0), "fail": ("resume_fail", "fail", 2, 2)}
    outs = {}
    for key, (phase, ckpt, devices, workers) in resumes.items():
        outs[key] = tmp_path_factory.mktemp(f"resume{key}")
        shutil.copy(stop_dir / f"{ckpt}.ckpt", outs[key] / f"{ckpt}.ckpt")
    run_scripts(SCRIPT, {key: [outs[key], phase, devices, workers, ACCUMULATE]
                         for key, (phase, _, devices, workers) in resumes.items()}, 240)
    resumed = {key: _read(outs[key], phase, devices) for key, (phase, _, devices, _) in resumes.items()}
    return stopped, resumed, tmp_path_factory.mktemp("plan")


def _uninterrupted(tmp_path: Path) -> list[dict]:
    """Epoch 0 of an uninterrupted run, per rank: the sampler's plan (same inputs, fresh process)."""
    import numpy as np

    from lit_balance import BalancedBatchSampler, BalancedTextDataModule

    lengths = np.load(SCRIPT.parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")[:301]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=min(int(n), 48)) for n in lengths]
    dm = BalancedTextDataModule(docs, max_tokens=256, max_length=None, val_fraction=0.0, cache_dir=tmp_path / "c0",
                                seed=7)
    dm.prepare_data()
    dm.setup("fit")
    return [list(BalancedBatchSampler(dm.train_dataset.lengths, 256, num_replicas=2, rank=r, seed=7,
                                      accumulate_grad_batches=ACCUMULATE)) for r in (0, 1)]


def test_checkpoint_mid_epoch_resumes_exactly(runs):
    stopped, resumed, plan_dir = runs
    resumed = resumed[2]
    expected0 = _uninterrupted(plan_dir)
    num_train = stopped[0]["num_train"]
    for r in (0, 1):
        before = stopped[r]["epochs"]["0"]
        assert len(before) == 3  # stopped after 3 micro-batches, prefetching workers ran ahead of that
        after = resumed[r]["epochs"]["0"]
        # no batch replayed, none skipped: the two halves are the uninterrupted epoch 0
        assert before + after == [list(b) for b in expected0[r]], (len(before), len(after), len(expected0[r]))
        # then a full epoch 1 on the plan
        assert resumed[r]["epochs"]["1"] == resumed[r]["plans"]["1"][r]
    for epoch in ("0", "1"):
        rows = [i for s in (stopped, resumed) for rank in s for b in rank["epochs"].get(epoch, []) for i in b]
        assert sorted(set(rows)) == list(range(num_train))


def test_resume_on_one_rank_replans_the_rest(runs):
    stopped, resumed, _ = runs
    resumed = resumed[1]
    num_train = stopped[0]["num_train"]
    seen = [i for rank in stopped for b in rank["epochs"]["0"] for i in b] + [
        i for b in resumed[0]["epochs"]["0"] for i in b]
    # every training sample once in epoch 0 (fill rows may repeat one; the corpus here needs none)
    assert sorted(seen) == list(range(num_train))
    assert resumed[0]["epochs"]["1"] == resumed[0]["plans"]["1"][0]


def test_resume_inside_an_accumulation_window_keeps_each_windows_divisor(runs):
    """The rest re-planned on 1 rank continues Lightning's windows: every micro-batch of an optimizer step carries
    the same step_supervised_tokens (the demo model's StepTokenLoss raises otherwise), also on 2 ranks."""
    stopped, resumed, _ = runs
    for devices, ranks in resumed.items():
        for epoch in ("0", "1"):
            windows = {}
            for rank in ranks:
                for batch_idx, tokens in rank["step_tokens"][epoch].items():
                    windows.setdefault(int(batch_idx) // ACCUMULATE, set()).add(tokens)
            assert all(len(v) == 1 for v in windows.values()), (devices, epoch, windows)
    # resumed on the same world, the window the stop cut keeps its divisor across the cut
    assert stopped[0]["step_tokens"]["0"]["2"] == resumed[2][0]["step_tokens"]["0"]["3"]


def test_resume_after_a_failure_in_training_step_reruns_only_the_failed_micro_batch(runs):
    stopped, resumed, plan_dir = runs
    resumed = resumed["fail"]
    expected0 = _uninterrupted(plan_dir)
    for r in (0, 1):
        done, started = stopped[r]["epochs"]["0"], stopped[r]["started"]["0"]
        expected = [list(b) for b in expected0[r]]
        assert started == done + [expected[3]]  # micro-batch 3 failed inside training_step, on both ranks
        after_started, after_done = resumed[r]["started"]["0"], resumed[r]["epochs"]["0"]
        assert after_started == after_done and after_done[0] == expected[3]  # the failed one runs again first
        assert done + after_done == expected  # nothing else repeated, nothing skipped
        assert resumed[r]["epochs"]["1"] == resumed[r]["plans"]["1"][r]
