"""max_tokens="auto": the probe's fit and shapes, its saved state, and a real CPU run of the demo model under a
memory limit (the chosen budget against a bisection with the same measurements, and a full epoch under the limit)."""

import gc
import io
import re

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedTextDataModule, BatchingSettings
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.budget import TokenBudget, TokenBudgetProbe, _features, _rows, fit_memory

LENGTHS = np.load(__import__("lit_balance").__path__[0] + "/data/lengths/lengths_fortunes.npy")


@given(a=st.floats(1e6, 1e9), b=st.floats(0, 1e5), c=st.floats(0, 100),
       lengths=st.lists(st.integers(1, 512), min_size=2, max_size=6, unique=True))
@settings(max_examples=50, deadline=None)
def test_fit_memory_recovers_exact_coefficients(a, b, c, lengths):
    slots = [n * k for n in lengths for k in (1, 3)]
    squares = [n * n * k for n in lengths for k in (1, 3)]
    peaks = [a + b * s + c * q for s, q in zip(slots, squares)]
    fa, fb, fc = fit_memory(slots, squares, peaks)
    for s, q, p in zip(slots, squares, peaks):
        assert fa + fb * s + fc * q == pytest.approx(p, rel=1e-6, abs=1e-3)
    assert fb >= 0 and fc >= 0


def test_fit_memory_never_returns_a_negative_slope():
    a, b, c = fit_memory([100, 200, 400, 100], [1e4, 4e4, 1.6e5, 2e3], [1000, 1100, 1150, 1001])
    assert b >= 0 and c >= 0


@given(budget=st.integers(1, 5000), length=st.integers(1, 600), packing=st.booleans(),
       multiple=st.sampled_from([1, 8]), cap=st.one_of(st.none(), st.integers(1, 50)))
@settings(max_examples=200, deadline=None)
def test_probe_micro_batches_are_within_the_budget_and_as_large_as_it_allows(budget, length, packing, multiple, cap):
    s = BatchingSettings(max_tokens=4096, packing=packing, pad_to_multiple_of=multiple,  # max_tokens unused here
                         max_batch_size=None if packing else cap)
    rows = _rows(s, budget, length)
    width = -(-length // multiple) * multiple
    if rows is None:
        assert (budget // multiple) * multiple < length if packing else budget < width
        return
    slots, squares = _features(s, rows)
    assert slots <= budget and max(rows) == length
    if packing:
        assert sum(rows) == (budget // multiple) * multiple and squares == sum(r * r for r in rows)
    else:
        assert len(rows) == min(budget // width, cap or budget) and squares == slots * width


def test_token_budget_state_loads_with_weights_only_and_resumes_without_probing(tmp_path):
    budget = TokenBudget(max_tokens=384, per_rank=(512, 384), capacity_bytes=(2**30, 2**30), memory_fraction=0.9,
                         coefficients=((1e8, 1e4, 1.0), (1e8, 2e4, 1.0)), device="cpu", probe_seconds=1.5,
                         num_probes=5)
    buffer = io.BytesIO()
    torch.save(budget.to_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    restored = TokenBudget.from_dict(state)
    assert restored.source == "checkpoint" and restored == TokenBudget(**{**budget.__dict__, "source": "checkpoint"})
    docs = [np.arange(1, 1 + n) for n in (5, 9, 30, 12, 7, 3, 22)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", memory_limit=2**30, val_fraction=0, cache_dir=tmp_path)
    assert dm.max_tokens == "auto"
    dm.prepare_data()
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="Trainer.fit"):
        dm.train_dataloader()  # no Trainer, no saved budget: nothing to measure with
    dm.load_state_dict({"token_budget": budget.to_dict()})
    loader = dm.train_dataloader()
    assert dm.max_tokens == 384 and dm.train_sampler.settings.max_tokens == 384 and len(loader) > 0
    assert dm.token_budget.source == "checkpoint"
    assert dm.state_dict()["token_budget"]["max_tokens"] == 384
    with pytest.raises(ValueError, match="version"):
        TokenBudget.from_dict({**budget.to_dict(), "version": 99})


def test_auto_needs_a_memory_limit_on_cpu_and_no_settings_object(tmp_path):
    docs = [np.arange(1, 1 + n) for n in (5, 9, 30, 12)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", val_fraction=0, cache_dir=tmp_path)
    model = DemoTransformerLM(dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    with pytest.raises(ValueError, match="memory_limit"):
        dm.find_max_tokens(model)
    with pytest.raises(ValueError, match="settings"):
        BalancedTextDataModule(docs, max_tokens="auto", settings=BatchingSettings(max_tokens=64), cache_dir=tmp_path)


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


def _hwm() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmHWM:\s+(\d+)", handle.read()).group(1)) * 1024


class _EpochPeak(L.Callback):
    """Peak resident set size of the process over the training epoch (VmHWM reset at its start)."""

    def on_train_epoch_start(self, trainer, pl_module):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def on_train_epoch_end(self, trainer, pl_module):
        self.peak = _hwm()


@pytest.mark.slow  # about 40 s alone: two probes, a bisection and an epoch of a small real transformer
def test_cpu_budget_is_near_the_bisection_optimum_and_an_epoch_stays_under_the_limit(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 8000, size=int(n)) for n in LENGTHS[:400]]

    def make_dm(max_tokens="auto", limit=None):
        return BalancedTextDataModule(docs, max_tokens=max_tokens, memory_limit=limit, max_length=128,
                                      val_fraction=0, vocab_size=8000, cache_dir=tmp_path / "cache", seed=3)

    torch.manual_seed(0)
    model = DemoTransformerLM(8000, d_model=64, num_heads=2, num_layers=2, dim_feedforward=256)
    dm = make_dm(limit=1)
    dm.prepare_data()
    dm.setup("fit")
    limit = _rss() + 400 * 2**20  # the process as it is, and 400 MiB more
    lengths = dm.train_dataset.lengths
    probe = TokenBudgetProbe(model, lengths=lengths, settings=dm.settings, pad_token_id=dm.pad_token_id,
                             memory_limit=limit, token_ids=dm.train_dataset[0]["input_ids"])
    chosen = probe.run().max_tokens

    def fits(budget):
        return all(probe.measure(budget, shape).status == "ok" for shape in probe.shapes)

    with probe.probing():  # bisection on the same measurements: the largest budget that measures under target
        # bracketed from below, as the probe goes: passes far above the limit leave retained memory behind them
        lo, hi = probe.min_budget, min(probe.max_budget, 2 * chosen)
        assert fits(lo)
        if fits(hi):
            lo = hi
        while hi - lo > max(1, lo // 200):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    optimum = lo
    log = "\n".join(f"{m.budget} {m.shape} {m.slots} {m.peak_bytes >> 20} MiB {m.status}" for m in probe.measurements)
    print(log)
    assert 0.9 * optimum <= chosen <= 1.1 * optimum, (chosen, optimum, probe.target >> 20, log)
    assert chosen > probe.min_budget  # a budget found, not the floor

    # the same probe inside Trainer.fit, then a whole epoch at its budget: the process stays under the limit
    dm = make_dm(limit=limit)
    peak = _EpochPeak()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[peak])
    trainer.fit(model, datamodule=dm)
    budget = dm.token_budget
    assert budget.per_rank == (budget.max_tokens,) and dm.train_sampler.settings.max_tokens == budget.max_tokens
    # this probe measures a process that has run the probe and the bisection before (their retained memory counts)
    assert 0.8 * optimum <= budget.max_tokens <= 1.1 * optimum, (budget.max_tokens, optimum)
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == len(dm.train_sampler)
    assert peak.peak <= limit, (peak.peak, limit)
    print(f"chosen {chosen}, fit {budget.max_tokens}, bisection {optimum}; epoch peak {peak.peak / 2**20:.0f} MiB "
          f"of {limit / 2**20:.0f} MiB; probe {budget.probe_seconds:.2f} s")


def test_probing_leaves_the_garbage_collector_as_found(tmp_path):
    docs = [np.arange(1, 1 + n) for n in (5, 9, 30, 12)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", val_fraction=0, cache_dir=tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    model = DemoTransformerLM(dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    probe = TokenBudgetProbe(model, lengths=dm.train_dataset.lengths, settings=dm.settings,
                             pad_token_id=dm.pad_token_id, memory_limit=2**40)
    gc.unfreeze()  # a process that froze nothing: the probe freezes what was alive before it, and unfreezes it
    with probe.probing():
        frozen = gc.get_freeze_count()
        measured = probe.measure(probe.min_budget, "longest")
    assert frozen > 0 and gc.get_freeze_count() == 0 and measured.status == "ok" and measured.peak_bytes > 0
    gc.freeze()  # a process that froze objects itself keeps exactly those frozen
    held = gc.get_freeze_count()
    try:
        with probe.probing():
            inside = gc.get_freeze_count()
            probe.measure(probe.min_budget, "longest")
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert inside == held and after == held, (held, inside, after)
