"""max_tokens="auto" on a tokenized store read in place: the probe measures the store's own documents, and the fit
trains as the int budget it found does, from the store and from the same token ids given as a list."""

from __future__ import annotations

import re

import lightning as L
import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule
from lit_balance.data.stores import MegatronSource
from lit_balance.demo import DemoTransformerLM
from tests.data._stores import VOCAB, documents, write_megatron

pytestmark = pytest.mark.slow  # three fits of two epochs, one with the probe


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


def _fit(corpus, tmp_path, max_tokens, limit=None):
    L.seed_everything(5)
    model = DemoTransformerLM(VOCAB, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    dm = BalancedTextDataModule(corpus, max_tokens=max_tokens, memory_limit=limit, vocab_size=VOCAB, pad_token_id=0,
                                val_fraction=0.1, seed=2, cache_dir=tmp_path / "cache")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(model, datamodule=dm)
    return model, dm


def test_an_auto_fit_from_a_megatron_store_trains_as_its_budget_does_from_the_store_and_the_list(tmp_path):
    docs = documents(num=160, seed=4, longest=60, empty_every=0)
    source = MegatronSource(write_megatron(tmp_path / "store" / "corpus", docs))
    auto_model, auto_dm = _fit(source, tmp_path, "auto", limit=_rss() + 256 * 2**20)
    budget = auto_dm.token_budget
    assert budget.source == "probe" and budget.max_tokens >= 60 and auto_dm.settings.max_tokens == budget.max_tokens
    assert budget.probe_slots >= sum(m.slots for m in budget.measurements) > 0
    assert not any((tmp_path / "cache").rglob("*"))  # the store is read in place: nothing cached
    for corpus in (source, [np.asarray(d) for d in docs]):
        int_model, int_dm = _fit(corpus, tmp_path, budget.max_tokens)
        assert int_dm.token_budget is None and len(int_dm.train_sampler) == len(auto_dm.train_sampler)
        for key, value in auto_model.state_dict().items():
            assert torch.equal(value, int_model.state_dict()[key]), key
