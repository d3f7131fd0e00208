"""Resume through Lightning checkpoints in one process, with DataLoader workers running ahead of training."""

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM


class Recorder(L.Callback):
    def __init__(self):
        self.batches = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.setdefault(trainer.current_epoch, []).append(batch["indices"].tolist())


def _fit(tmp_path, *, ckpt_path=None, max_steps=-1, callbacks=()):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, 240)]
    dm = BalancedTextDataModule(docs, max_tokens=128, max_length=None, val_fraction=0.05, num_workers=2,
                                cache_dir=tmp_path / "cache", seed=3)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, val_check_interval=4,
                        limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, *callbacks], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return rec, dm


def test_checkpoint_at_validation_end_resumes_exactly_with_workers(tmp_path):
    # ModelCheckpoint saves at validation end (4 micro-batches in); 2 workers have fetched further by then
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="mid")
    first, dm = _fit(tmp_path, max_steps=4, callbacks=[checkpoint])
    second, _ = _fit(tmp_path, ckpt_path=tmp_path / "ckpt" / "mid.ckpt")
    plan = dm.train_sampler.plan(0)
    expected = [plan.batch(int(b))[0].tolist() for b in plan.assignment[:, 0]]
    assert len(first.batches[0]) == 4
    assert first.batches[0] + second.batches[0] == expected  # nothing replayed, nothing skipped
