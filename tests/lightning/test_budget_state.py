"""The token budget probe leaves the module exactly as it was, and a fit with max_tokens="auto" trains exactly as a
fit with the int budget it found: a model with BatchNorm (buffers move in training mode), one that draws from NumPy's
and Python's global generators in training_step, and one with manual optimization (refused at once)."""

import random
import re

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lit_balance import BalancedTextDataModule
from lit_balance.lightning.budget import TokenBudget, TokenBudgetProbe
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum
from lit_balance.lightning.probe_state import ModuleSnapshot

VOCAB = 64


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


class BatchNormLM(L.LightningModule):
    """Embedding -> BatchNorm over the embedding features -> LM head: its running statistics move in training mode."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, VOCAB)

    def logits(self, batch):
        x = self.embed(batch["input_ids"])  # [B, T, 16]
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))

    def training_step(self, batch, batch_idx):
        loss_sum, n = token_loss_sum(self.logits(batch), batch["labels"])
        return loss_sum / max(int(n), 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RandomDrawingLM(BatchNormLM):
    """Scales its loss by numbers drawn from NumPy's and Python's global generators, and uses dropout (torch's)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def training_step(self, batch, batch_idx):
        loss_sum, n = token_loss_sum(self.drop(self.logits(batch)), batch["labels"])
        scale = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        return scale * loss_sum / max(int(n), 1)


class ManualLM(BatchNormLM):
    """Manual optimization: its training_step steps the optimizer itself."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


def _docs():
    rng = np.random.default_rng(0)
    return [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(2, 40, 120)]


def _dm(tmp_path, max_tokens, limit=None):
    return BalancedTextDataModule(_docs(), max_tokens=max_tokens, memory_limit=limit, max_length=None,
                                  val_fraction=0.1, vocab_size=VOCAB, cache_dir=tmp_path / "cache", seed=1)


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            torch.get_rng_state(), np.random.get_state(), random.getstate(), model.training)


def _assert_same(before, after):
    (s0, g0, t0, n0, r0, m0), (s1, g1, t1, n1, r1, m1) = before, after
    assert s0.keys() == s1.keys()
    for k in s0:  # bitwise: parameters and buffers (running_mean, running_var, num_batches_tracked)
        assert s0[k].dtype == s1[k].dtype and torch.equal(s0[k], s1[k]), k
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1))
    assert torch.equal(t0, t1) and m0 == m1 and r0 == r1
    assert n0[0] == n1[0] and np.array_equal(n0[1], n1[1]) and n0[2:] == n1[2:]


@pytest.mark.parametrize("model_class", [BatchNormLM, RandomDrawingLM])
def test_the_probe_leaves_parameters_buffers_gradients_and_every_generator_as_they_were(tmp_path, model_class):
    dm = _dm(tmp_path, "auto")
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(3)
    model = model_class()
    model.train(False)  # a mode other than training: restored too
    model.head.weight.grad = torch.full_like(model.head.weight, 0.5)  # a gradient left by the user
    np.random.seed(5)
    random.seed(6)
    before = _state(model)
    probe = TokenBudgetProbe(model, memory_limit=_rss() + 512 * 2**20, **dm.probe_inputs())
    budget = TokenBudget.measure(probe)
    assert budget.max_tokens >= probe.min_budget and len(probe.measurements) >= 2
    assert any(m.status == "ok" for m in probe.measurements)
    _assert_same(before, _state(model))


def test_manual_optimization_is_refused_at_once_and_nothing_changes(tmp_path):
    dm = _dm(tmp_path, "auto", limit=2**40)
    dm.prepare_data()
    dm.setup("fit")
    model = ManualLM()
    before = _state(model)
    with pytest.raises(ValueError, match=r"max_tokens='auto'.*manual optimization.*Pass max_tokens as an int"):
        TokenBudgetProbe(model, memory_limit=2**40, **dm.probe_inputs())
    _assert_same(before, _state(model))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(model, datamodule=dm)
    _assert_same(before, _state(model))


def _fit(tmp_path, model_class, max_tokens, limit=None):
    L.seed_everything(11)
    np.random.seed(11)
    random.seed(11)
    model = model_class()
    dm = _dm(tmp_path, max_tokens, limit)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(model, datamodule=dm)
    return model, dm


@pytest.mark.parametrize("model_class", [BatchNormLM, RandomDrawingLM])
def test_an_auto_fit_ends_with_the_weights_of_a_fit_with_the_budget_it_found(tmp_path, model_class):
    auto_model, auto_dm = _fit(tmp_path, model_class, "auto", limit=_rss() + 512 * 2**20)
    found = auto_dm.token_budget.max_tokens
    assert auto_dm.max_tokens == found and auto_dm.settings.max_tokens == found
    int_model, int_dm = _fit(tmp_path, model_class, found)
    assert int_dm.max_tokens == found
    a, b = auto_model.state_dict(), int_model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _open_step_loss():
    """A StepTokenLoss in the middle of an optimizer step (one micro-batch in, the plan path)."""
    loss = StepTokenLoss(sync_log=False)
    module = nn.Linear(2, 2)
    loss.micro_batch(module, {"step_supervised_tokens": 10}, torch.tensor(4.0), 4)
    return loss, module


def test_the_loss_state_round_trips_through_a_weights_only_checkpoint_and_continues_the_step(tmp_path):
    loss, module = _open_step_loss()
    torch.save(loss.state_dict(), tmp_path / "loss.pt")
    fresh = StepTokenLoss(sync_log=True)
    fresh.load_state_dict(torch.load(tmp_path / "loss.pt", weights_only=True))
    for each in (loss, fresh):
        each.micro_batch(module, {"step_supervised_tokens": 10}, torch.tensor(6.0), 6)
    assert float(fresh.finish_step(module)) == float(loss.finish_step(module)) == 1.0  # (4 + 6) / 10 tokens
    assert fresh.last_step_tokens == loss.last_step_tokens == 10 and fresh.sync_log is False


@pytest.mark.parametrize(("change", "match"), [
    (lambda s: s.pop("step_tokens"), r"missing \['step_tokens'\]"),
    (lambda s: s.update(extra=1), r"unknown \['extra'\]"),
    (lambda s: s.update(version=99), "version 99 is not supported"),
])
def test_a_loss_state_with_other_keys_or_version_is_refused(change, match):
    state = _open_step_loss()[0].state_dict()
    change(state)
    with pytest.raises(ValueError, match=match):
        StepTokenLoss().load_state_dict(state)


def test_the_module_snapshot_restores_a_loss_in_the_middle_of_a_step_through_its_state_dict():
    loss, module = _open_step_loss()
    module.step_loss = loss
    before = loss.state_dict()
    with ModuleSnapshot(module, devices=()):
        loss.micro_batch(module, {"step_supervised_tokens": 10}, torch.tensor(6.0), 6)  # a probe pass
        loss.finish_step(module)
        assert loss.state_dict()["step_open"] is False  # the pass changed it
    after = loss.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(before[k])) if k == "step_loss_sum"
               else after[k] == before[k] for k in before)
