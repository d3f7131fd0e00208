"""Where each rank's time goes: known sleeps in a real 2-rank fit land in their own column, and only there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Clock
from lightning.pytorch.profilers import PassThroughProfiler

from lit_balance.lightning.callbacks.phases import PhaseClock
from lit_balance.report import read_metrics_csv, training_plot_data

from launch import run_script  # launch.py (the repository root)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("fit_phases.py")
PHASES = ("compute_s", "data_wait_s", "rank_wait_s", "other_s")
#: seconds slept: in fetching two batches on rank 1, in validation_step (both ranks), in on_save_checkpoint (both);
#: 10 % of them is above the waits a loaded machine adds to a window
DATA_S, VALIDATION_S, CHECKPOINT_S = 3.0, 3.0, 3.0
#: most seconds a column may hold beyond its own sleeps: the tiny model's, and the waits of a machine loaded by other
#: work; half a sleep, so a sleep counted in the wrong column (or twice) still fails however loaded the machine is
NOISE_S = 1.5


def _close(measured: float, injected: float) -> bool:
    """The sleep is there in full (a sleep is never shorter; the clock's rounding aside) and little else."""
    return 0.97 * injected <= measured <= injected + NOISE_S


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    out = tmp_path_factory.mktemp("phases")
    # about 15 s on 2 cores, 9 s of it the sleeps; forked from the process that imported Lightning (launch.py)
    code, log = run_script(SCRIPT, [out, DATA_S, VALIDATION_S, CHECKPOINT_S], 240)
    assert code == 0, log[-8000:]
    table = json.loads((out / "result.json").read_text())["rows"]
    return table, read_metrics_csv(out / "logs" / "metrics.csv")


def _column(metrics, phase, rank):
    steps, values = metrics[f"balance/{phase}_rank{rank}"]
    return dict(zip(steps.astype(int).tolist(), values.tolist()))


@pytest.mark.ddp
def test_each_sleep_lands_in_its_own_column_and_in_no_other(fit):
    _, metrics = fit
    # windows of 2 micro-batches, logged at the step of their last micro-batch: 1, 3, 5, and 6 (max_steps=7)
    window = {rank: {phase: _column(metrics, phase, rank) for phase in PHASES} for rank in (0, 1)}
    assert all(sorted(window[r][p]) == [1, 3, 5, 6] for r in (0, 1) for p in PHASES)
    expected = {  # (step, rank) -> the phase the sleep must land in and its seconds; nothing else anywhere
        (3, 1): {"data_wait_s": DATA_S, "other_s": CHECKPOINT_S},  # rank 1 fetches slowly; the checkpoint after step 2
        (3, 0): {"rank_wait_s": DATA_S, "other_s": CHECKPOINT_S},  # ... rank 0 waits for it before the all-reduce
        (5, 0): {"other_s": VALIDATION_S}, (5, 1): {"other_s": VALIDATION_S},  # the validation after step 4
    }
    for step in (1, 3, 5, 6):
        for rank in (0, 1):
            injected = expected.get((step, rank), {})
            for p in PHASES:
                measured, seconds = window[rank][p][step], injected.get(p)
                if seconds is not None:
                    assert _close(measured, seconds), (step, rank, p, measured, seconds)
                else:  # the tiny model's own seconds and a loaded machine's scheduling: far below any sleep
                    assert measured < NOISE_S, (step, rank, p, measured, window)


@pytest.mark.ddp
def test_the_table_the_csv_and_the_plot_agree(fit):
    table, metrics = fit
    assert [row["rank"] for row in table] == [0, 1]
    for row in table:
        r = row["rank"]
        assert row["micro_batches"] == 7
        total = sum(row[p] for p in PHASES)
        assert total == pytest.approx(row["wall_s"], rel=1e-9)  # every second in exactly one phase
        for p in PHASES:  # the windows cover the fit but its last hooks (on_train_epoch_end, on_train_end)
            assert abs(sum(_column(metrics, p, r).values()) - row[p]) < NOISE_S, (r, p, row, metrics)
    assert table[1]["data_wait_s"] >= 0.9 * DATA_S and table[0]["rank_wait_s"] >= 0.9 * DATA_S
    assert all(row["other_s"] >= 0.9 * (VALIDATION_S + CHECKPOINT_S) for row in table)
    # the plot draws exactly the file's points, one panel per phase, one series per rank
    panels = dict(training_plot_data(metrics))
    for p, label in zip(PHASES, ("compute s", "data wait s", "rank wait s", "other s")):
        (series,) = [s for key, s in panels.items() if key.startswith(label)]
        assert [name for name, _, _ in series] == ["rank 0", "rank 1"]
        for r, (_, steps, values) in enumerate(series):
            np.testing.assert_array_equal(steps, metrics[f"balance/{p}_rank{r}"][0])
            np.testing.assert_array_equal(values, metrics[f"balance/{p}_rank{r}"][1])


@pytest.mark.ddp
def test_one_step_numbering_for_every_key(fit):
    _, metrics = fit
    steps = {key: set(s.astype(int).tolist()) for key, (s, _) in metrics.items()}
    assert steps["train/loss"] == set(range(7))  # log_every_n_steps=1: Lightning's global_step of each micro-batch
    for key in ("balance/straggler_ratio", "balance/compute_s_rank0", "balance/other_s_rank1"):
        assert steps[key] == {1, 3, 5, 6} <= steps["train/loss"]  # the step of the window's last micro-batch


def test_phase_clock_forwards_every_call_and_splits_the_time():
    class Recording(PassThroughProfiler):
        def __init__(self):
            super().__init__()
            self.calls = []

        def start(self, action_name):
            self.calls.append(("start", action_name))

        def stop(self, action_name):
            self.calls.append(("stop", action_name))

    from types import SimpleNamespace

    inner, clock = Recording(), Clock()
    trainer = SimpleNamespace(world_size=1, lightning_module=None)
    phases = PhaseClock(trainer, inner, clock=clock)
    start = phases.totals()
    script = [  # (action, seconds inside it)
        ("[_TrainingEpochLoop].train_dataloader_next", 1.0), ("[Strategy]SingleDeviceStrategy.batch_to_device", 0.5),
        ("run_training_batch", 4.0), ("[Callback]BalanceProgressBar.on_train_batch_end", 0.25),
        ("[_EvaluationLoop].val_next", 2.0), ("save_checkpoint", 3.0),
    ]
    for action, seconds in script:
        with phases.profile(action):
            clock.tick(seconds)
    with phases.profile("run_training_batch"):  # a callback's hook inside a micro-batch is not compute
        clock.tick(1.0)
        with phases.profile("[Callback]Some.on_before_backward"):
            clock.tick(0.5)
        with phases.profile("[Strategy]SingleDeviceStrategy.backward"):  # one process: no barrier, compute
            clock.tick(2.0)
    clock.tick(0.125)  # outside every action: other (one process, so not Lightning's broadcast)
    spent = phases.totals() - start
    assert (spent.compute_s, spent.data_wait_s, spent.rank_wait_s) == (7.0, 1.5, 0.0)
    assert spent.other_s == 0.25 + 2.0 + 3.0 + 0.5 + 0.125 and spent.wall_s == 14.375
    assert [a for kind, a in inner.calls if kind == "start"] == [a for a, _ in script] + [
        "run_training_batch", "[Callback]Some.on_before_backward", "[Strategy]SingleDeviceStrategy.backward"]
