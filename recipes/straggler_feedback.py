"""Show measured-time feedback closing the straggler gap: 2 CPU ranks, one made slower on purpose.

Run:
    python recipes/straggler_feedback.py                       # conf/straggler_feedback.yaml: 2 ranks, 3 epochs
    python recipes/straggler_feedback.py epochs=2 num_docs=300 json=out.json

A Hydra application on ``conf/straggler_feedback.yaml`` (``key=value`` overrides a key of it). Rank
``slow_rank`` is slowed down by a demo-only model hook: after its forward pass and loss, it spins
(busy-waits, as a slower device computes longer; a sleep would add the scheduler's wake-up delay on a
busy machine) ``slowdown`` times the seconds they took (0.5: 1.5x slower), inside StragglerMonitor's
timed interval.
Epoch 0 is planned with the default cost model (padded token slots, equal ranks). At each epoch end,
CostModelFeedback fits seconds per padded token / squared length / micro-batch and each rank's speed from
the gathered timings and hands them to the sampler, which plans the next epoch with them. Prints, per
epoch, the straggler gap (max minus median over ranks of the epoch's summed compute seconds), the ratio,
each rank's compute and cost, and the fitted speeds; then the gap after feedback over the gap before.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from lit_balance import BalancedBatchSampler, PadCollator, TokenDataset, use_training_sampler
from lit_balance.demo import DemoTransformerLM
from lit_balance.callbacks import CostModelFeedback, StragglerMonitor, TimingWindow

LENGTHS = Path(__file__).resolve().parents[1] / "lit_balance/data/lengths/lengths_fortunes.npy"


class SyntheticText(L.LightningDataModule):
    """Random token ids with real document lengths (fortunes corpus), one BalancedBatchSampler per rank."""

    def __init__(self, num_docs: int, max_tokens: int, vocab_size: int) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        lengths = np.minimum(np.load(LENGTHS)[:num_docs].astype(np.int64), max_tokens)
        self.tokens = rng.integers(1, vocab_size, size=int(lengths.sum()))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.max_tokens = max_tokens

    def setup(self, stage: str | None = None) -> None:
        self.dataset = TokenDataset(self.tokens, self.offsets, np.arange(len(self.offsets) - 1))
        self.sampler = BalancedBatchSampler(self.dataset.lengths, self.max_tokens, num_replicas=self.trainer.world_size,
                                            rank=self.trainer.global_rank, seed=0)

    def train_dataloader(self) -> DataLoader:
        # Lightning reads len(loader) before set_epoch: select the new epoch first so that its length counts the
        # rank speeds handed over for it (as BalancedTextDataModule does)
        if self.trainer.current_epoch > self.sampler.epoch:
            self.sampler.set_epoch(self.trainer.current_epoch)
        use_training_sampler(self.trainer, self.sampler)  # the sampler CostModelFeedback hands its fit to
        return DataLoader(self.dataset, sampler=self.sampler, batch_size=None, collate_fn=PadCollator(0))


class SlowRankLM(DemoTransformerLM):
    """DemoTransformerLM whose rank ``slow_rank`` spins ``slowdown`` x its forward+loss time (demo only)."""

    def __init__(self, slow_rank: int, slowdown: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slow_rank, self.slowdown = slow_rank, slowdown

    def training_step(self, batch, batch_idx):
        start = time.perf_counter()
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.slow_rank and self.slowdown > 0:
            until = time.perf_counter() + self.slowdown * (time.perf_counter() - start)
            while time.perf_counter() < until:
                pass
        return loss


class EpochGap(L.Callback):
    """Per epoch: each rank's summed forward seconds and cost (from the monitor's windows) and the gap."""

    def __init__(self, monitor: StragglerMonitor) -> None:
        self.monitor = monitor
        self.epochs: list[dict] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.monitor.flush(trainer, pl_module)
        window = TimingWindow.concatenate(self.monitor.epoch_windows)
        compute = window.forward_s.sum(axis=1)
        median = float(np.median(compute))
        sampler = trainer.train_dataloader.sampler
        self.epochs.append({
            "epoch": trainer.current_epoch, "compute_s": compute.tolist(), "gap_s": float(compute.max()) - median,
            "ratio": float(compute.max()) / median, "cost": window.cost.sum(axis=1).tolist(),
            "micro_batches": window.num_micro_batches,
            "rank_speeds": None if sampler.rank_speeds is None else [float(s) for s in sampler.rank_speeds],
        })


class FitLog(CostModelFeedback):
    """CostModelFeedback that also keeps each epoch's handed-over cost model and speeds, for printing."""

    def __init__(self) -> None:
        super().__init__()
        self.fits: list[str] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.last_fit = None
        super().on_train_epoch_end(trainer, pl_module)
        if self.last_fit is not None:
            cost, speeds = self.last_fit
            self.fits.append(f"{cost}, rank_speeds={[round(s, 3) for s in speeds]}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="straggler_feedback")
def main(cfg: DictConfig) -> None:
    """Train ``cfg.epochs`` epochs with rank ``cfg.slow_rank`` slowed and print the straggler gap per epoch."""
    torch.manual_seed(0)
    data = SyntheticText(cfg.num_docs, cfg.max_tokens, vocab_size=512)
    model = SlowRankLM(cfg.slow_rank, cfg.slowdown, vocab_size=512, d_model=cfg.d_model, num_heads=4,
                       num_layers=2, dim_feedforward=4 * cfg.d_model)
    monitor = StragglerMonitor(log_every_n_micro_batches=1000, warn_ratio=10.0)
    gap = EpochGap(monitor)
    feedback = FitLog()
    trainer = L.Trainer(accelerator="cpu", devices=cfg.devices, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        callbacks=[monitor, gap, feedback], max_epochs=cfg.epochs,
                        reload_dataloaders_every_n_epochs=1,  # rank speeds can change the epoch length
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    if trainer.global_rank != 0:
        return
    print(f"world size {trainer.world_size}, rank {cfg.slow_rank} slowed {1 + cfg.slowdown:.2f}x, "
          f"max_tokens {cfg.max_tokens} per micro-batch per rank")
    print(f"{'epoch':>5} {'micro-batches':>13} {'compute s per rank':>24} {'gap s':>7} {'ratio':>6} "
          f"{'cost per rank':>20} planned speeds")
    for e in gap.epochs:
        comp = " ".join(f"{c:.3f}" for c in e["compute_s"])
        cost = " ".join(f"{c:.3g}" for c in e["cost"])
        speeds = "equal" if e["rank_speeds"] is None else " ".join(f"{s:.3f}" for s in e["rank_speeds"])
        print(f"{e['epoch']:>5} {e['micro_batches']:>13} {comp:>24} {e['gap_s']:>7.3f} {e['ratio']:>6.3f} "
              f"{cost:>20} {speeds}")
    for e, fit in zip(gap.epochs, feedback.fits):
        print(f"fitted at the end of epoch {e['epoch']}: {fit}")
    before, after = gap.epochs[0]["gap_s"], gap.epochs[-1]["gap_s"]
    print(f"straggler gap before feedback {before:.3f} s, after {after:.3f} s: after/before = {after / before:.3f}")
    if cfg.json:
        Path(cfg.json).write_text(json.dumps({"epochs": gap.epochs, "before_gap_s": before, "after_gap_s": after}))


if __name__ == "__main__":
    main()
