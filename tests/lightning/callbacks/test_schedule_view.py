"""What a user sees of a weight schedule: ``train/target/<name>`` beside ``train/share/<name>`` in a short fit's
``metrics.csv`` (the schedule's shares of each step, the transition step included, and the sampler's own planned
targets), the progress bar's target of the last logged step, and the plan figure's two series per component."""

import csv
import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_balance import BalancedTextDataModule, Schedule
from lit_balance.callbacks import MixtureMonitor
from lit_balance.lightning.callbacks._common import mixture_sampler
from lit_balance.lightning.callbacks.progress import bar_figures
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.report import mixture_figure, mixture_shares, save_mixture_plot
from lit_balance.sampler.mixture import MixtureBatchSampler

NAMES = ("short", "long")
SCHEDULE = {"points": [[0, {"short": 0.8, "long": 0.2}], [3, {"short": 0.3, "long": 0.7}]], "unit": "steps"}


def _docs(num, low, high, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, size=int(rng.integers(low, high))).tolist() for _ in range(num)]


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8)
        self.out = torch.nn.Linear(8, 100)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _rows(path):
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("train/target/short")]


@pytest.mark.parametrize("packing", [False, True])
def test_a_fit_logs_each_steps_scheduled_target_beside_its_share(tmp_path, packing):
    dm = BalancedTextDataModule({"components": {"short": {"corpus": _docs(160, 4, 20, 0), "weight": 1},
                                                "long": {"corpus": _docs(80, 30, 60, 1), "weight": 1}}},
                                vocab_size=100, pad_token_id=0, max_tokens=256, max_length=64, val_fraction=0.0,
                                cache_dir=tmp_path / "cache", seed=3, weights_schedule=SCHEDULE, packing=packing)
    monitor = MixtureMonitor(log_every_n_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                        logger=CSVLogger(tmp_path, name="logs", version=""), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[monitor])
    trainer.fit(Tiny(), datamodule=dm)
    rows = _rows(tmp_path / "logs" / "metrics.csv")
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(len(rows))) and len(rows) > 4  # every optimizer step once, across the transition
    schedule = Schedule.of(SCHEDULE, name="weights_schedule")
    planned = mixture_sampler(trainer).step_targets()  # the planner's own targets of the epoch's steps
    assert planned.shape == (len(rows), 2)
    for row in rows:
        step = int(row["step"])
        weights = np.array(schedule.vector_at(step, NAMES))
        for c, name in enumerate(NAMES):
            assert float(row[f"train/target/{name}"]) == pytest.approx(float(weights[c] / weights.sum()))
            assert float(row[f"train/target/{name}"]) == pytest.approx(float(planned[step, c]))
            share = float(row[f"train/share/{name}"])
            assert share == pytest.approx(float(row[f"train/tokens/{name}"]) / sum(
                float(row[f"train/tokens/{n}"]) for n in NAMES))
    # the transition: step 2 has the first point's shares, step 3 the second's
    assert [float(rows[2]["train/target/short"]), float(rows[3]["train/target/short"])] == pytest.approx([0.8, 0.3])
    # the bar shows the last logged step's scheduled target, not the mixture's own (equal) weights
    trainer.callbacks = [monitor]
    assert bar_figures(trainer)["long"].endswith("target 0.700)")


def test_a_schedule_in_tokens_logs_the_planned_target_of_each_step(monkeypatch):
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(4, 20, size=120), rng.integers(30, 60, size=60)])
    schedule = {"points": [[0, {"short": 0.8, "long": 0.2}], [800, {"short": 0.3, "long": 0.7}]], "unit": "tokens"}
    sampler = MixtureBatchSampler(lengths, [120, 60], MixtureSettings(NAMES, (1, 1)), max_tokens=256, num_replicas=1,
                                  rank=0, seed=3, weights_schedule=schedule)
    sampler.set_epoch(0)
    monitor = MixtureMonitor()
    planned = sampler.step_targets()
    assert not np.allclose(planned[0], planned[-1])  # the transition falls inside the epoch
    from lit_balance.lightning.callbacks import mixture as module

    monkeypatch.setattr(module, "mixture_sampler", lambda trainer: sampler)  # the trainer's training sampler
    monitor._attach(None)
    for step in range(planned.shape[0]):
        np.testing.assert_allclose(monitor._target(step), planned[step])
    assert monitor._target(planned.shape[0]) is None


def test_the_plan_figure_holds_the_scheduled_and_the_realized_share_per_step(tmp_path):
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(4, 20, size=200), rng.integers(30, 60, size=100)])
    sampler = MixtureBatchSampler(lengths, [200, 100], MixtureSettings(NAMES, (1, 1)), max_tokens=256, num_replicas=2,
                                  rank=0, seed=3, weights_schedule=SCHEDULE, accumulate_grad_batches=2)
    sampler.set_epoch(0)
    mixture = mixture_shares(sampler)
    assert mixture["step_targets"] is not None
    fig = mixture_figure(mixture)
    top = fig.axes[0]
    lines = {line.get_label(): np.asarray(line.get_ydata(), dtype=np.float64) for line in top.get_lines()}
    targets, shares = np.array(mixture["step_targets"]), np.array(mixture["step_shares"])
    for c, name in enumerate(NAMES):
        (realized,) = [v for k, v in lines.items() if k.startswith(f"{name}: max")]
        np.testing.assert_allclose(realized, shares[:, c])
        np.testing.assert_allclose(lines[f"{name} target"], targets[:, c])
        assert not np.allclose(targets[:, c], targets[0, c])  # the scheduled series changes at the transition
    bottom = fig.axes[1].get_lines()
    np.testing.assert_allclose(bottom[0].get_ydata(), 100 * (shares[:, 0] - targets[:, 0]))
    path = save_mixture_plot(mixture, tmp_path / "mixture_shares.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
