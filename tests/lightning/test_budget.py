"""max_tokens="auto": the saved budget, and a real CPU run of the demo model under a memory limit (the chosen budget
against a bisection with the same measurements, and a full epoch under the limit). The search alone:
tests/plan/test_budget_search.py; the module left as it was: test_budget_state.py."""

import gc
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_balance import BalancedTextDataModule, BatchingSettings
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.budget import TokenBudget, TokenBudgetProbe

from launch import run_script as _run_script  # launch.py: forked from a process that imported torch once

LENGTHS = np.load(__import__("lit_balance").__path__[0] + "/data/lengths/lengths_fortunes.npy")


def test_token_budget_state_loads_with_weights_only_and_resumes_without_probing(tmp_path):
    budget = TokenBudget(max_tokens=384, per_rank=(384, 384), measured=(512, 384), capacity_bytes=(2**30, 2**30),
                         memory_fraction=0.9, coefficients=((1e8, 1e4, 1.0), (1e8, 2e4, 1.0)), device="cpu",
                         probe_seconds=1.5, num_probes=5)
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
    with pytest.raises(RuntimeError, match="measured with the model at fit start"):
        dm.settings  # never a placeholder budget
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


@pytest.mark.slow  # about 25 s alone: two probes, a bisection and an epoch of a small real transformer
@pytest.mark.timeout(1200)  # beyond the run's own 600 s limit, so that limit ends a hang
def test_cpu_budget_is_near_the_bisection_optimum_and_an_epoch_stays_under_the_limit(tmp_path):
    # a process of its own: peak resident memory is the process's, and earlier tests leave allocations behind
    code, log = _run_script(Path(__file__).with_name("budget_bisection.py"), [tmp_path], 600)
    assert code == 0, log[-4000:]
    r = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    optimum, chosen = r["optimum"], r["chosen"]
    assert r["floor_fits"], r["log"]
    assert 0.9 * optimum <= chosen <= 1.1 * optimum, (chosen, optimum, r["target_mib"], r["log"])
    assert chosen > r["min_budget"]  # a budget found, not the floor
    assert r["fit_per_rank"] == [r["fit_max_tokens"]] and r["sampler_max_tokens"] == r["fit_max_tokens"]
    # this probe measures a process that has run the probe and the bisection before (their retained memory counts)
    assert 0.8 * optimum <= r["fit_max_tokens"] <= 1.1 * optimum, (r["fit_max_tokens"], optimum)
    assert r["completed"] == r["micro_batches"]
    assert r["peak"] <= r["limit"], (r["peak"], r["limit"])  # a whole epoch at that budget stays under the limit
    print(f"chosen {chosen}, fit {r['fit_max_tokens']}, bisection {optimum}; epoch peak {r['peak'] / 2**20:.0f} MiB "
          f"of {r['limit'] / 2**20:.0f} MiB; probe {r['probe_seconds']:.2f} s")


def test_probing_leaves_the_garbage_collector_as_found(tmp_path):
    docs = [np.arange(1, 1 + n) for n in (5, 9, 30, 12)]
    dm = BalancedTextDataModule(docs, max_tokens="auto", val_fraction=0, cache_dir=tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    model = DemoTransformerLM(dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    probe = TokenBudgetProbe(model, memory_limit=8 * 2**30, **dm.probe_inputs())
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
    # the probe neither froze more nor unfroze them (unfreezing empties the permanent generation); frozen objects
    # that die meanwhile leave it, so the count may only fall by those
    assert 0 < after <= inside <= held and after > held // 2, (held, inside, after)


def test_a_cpu_memory_limit_above_the_machine_is_refused(tmp_path):
    from lit_balance.lightning.meters import CpuMeter

    with open("/proc/meminfo") as handle:
        total = int(handle.read().split("MemTotal:")[1].split()[0]) * 1024
    with pytest.raises(ValueError, match=r"memory_limit=\d+ bytes exceeds this machine's memory"):
        CpuMeter(total + 1)
    assert CpuMeter(total // 4).capacity == total // 4


@pytest.mark.slow  # starts processes
@pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                    reason="the setting is glibc's")
def test_return_freed_memory_hands_back_what_freed_tensors_held():
    """Without the setting glibc keeps 2 MiB blocks freed between live ones resident; with it, they go back."""
    retained = []
    for flag in ("0", "1"):
        code, log = _run_script(Path(__file__).with_name("freed_memory.py"), [flag], 300)
        assert code == 0, log[-3000:]
        retained.append(int(log.split()[-1]) / 2**20)
    default, set_ = retained
    # 128 MiB in 2 MiB blocks were freed; the 16 MiB kept is resident either way
    assert default > 112 and set_ < 32, retained


@pytest.mark.slow  # starts a process: the allocator setting is the whole process's
@pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                    reason="the setting is glibc's")
def test_a_cpu_fit_with_auto_says_the_allocator_setting_once_and_leaves_it_as_glibc_keeps_it(tmp_path):
    code, log = _run_script(Path(__file__).with_name("allocator_after_fit.py"), [tmp_path], 300)
    assert code == 0, log[-3000:]
    r = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    # after the fit, 2 MiB blocks come from the heap again, which keeps them (as without the setting, see
    # freed_memory.py); a threshold left fixed at 256 KiB would hand back all but the 16 MiB kept
    assert r["retained"] > 112 * 2**20, r
    assert r["said"] == 1 and r["said_off"] == 0, r


def test_the_cpu_allocator_setting_is_held_for_a_fit_logged_once_set_back_and_can_be_turned_off(monkeypatch):
    from types import SimpleNamespace

    from lit_balance.lightning import budget as budget_module
    from lit_balance.lightning import meters

    calls, logged = [], []
    monkeypatch.setattr(meters, "_mallopt_mmap_threshold", lambda value: calls.append(value) or True)
    monkeypatch.setattr(budget_module, "rank_zero_info", logged.append)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    state = TokenBudget(max_tokens=384, per_rank=(384,), measured=(384,), capacity_bytes=(2**30,),
                        memory_fraction=0.9, coefficients=((1e8, 1e4, 1.0),), device="cpu", probe_seconds=1.5,
                        num_probes=5).to_dict()
    trainer = SimpleNamespace(lightning_module=SimpleNamespace(device=torch.device("cpu")))
    auto = budget_module.AutoTokenBudget(memory_limit=2**30)
    auto.load_state_dict(state)
    assert auto.resolve(trainer).max_tokens == 384 and auto.resolve(trainer).max_tokens == 384
    assert calls == [meters.CPU_MMAP_THRESHOLD] and len(logged) == 1 and "cpu_mmap_threshold=None" in logged[0]
    auto.release()  # the fit's end: glibc's own threshold cannot come back; its largest value does
    assert calls == [meters.CPU_MMAP_THRESHOLD, meters.GLIBC_MMAP_THRESHOLD_MAX]
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    auto.resolve(trainer)
    auto.release()  # a threshold the process was started with is the one set back
    assert calls[2:] == [meters.CPU_MMAP_THRESHOLD, 65536] and len(logged) == 2
    cuda = budget_module.AutoTokenBudget(memory_limit=2**30)
    cuda.load_state_dict({**state, "device": "cuda"})
    cuda.resolve(trainer)
    off = budget_module.AutoTokenBudget(memory_limit=2**30, cpu_mmap_threshold=None)
    off.load_state_dict(state)
    off.resolve(trainer)
    off.release()
    assert len(calls) == 4 and len(logged) == 2  # a budget measured on CUDA, or the setting turned off: nothing


def test_a_fit_that_stops_with_an_exception_sets_the_allocator_back_too(tmp_path, monkeypatch):
    from lit_balance.lightning import meters

    calls = []
    monkeypatch.setattr(meters, "_mallopt_mmap_threshold", lambda value: calls.append(value) or True)
    dm = BalancedTextDataModule([np.arange(1, 9)] * 4, max_tokens="auto", memory_limit=2**30, val_fraction=0,
                                cache_dir=tmp_path)
    assert dm.auto_budget.allocator.hold() is not None and calls == [meters.CPU_MMAP_THRESHOLD]
    dm.on_exception(RuntimeError("the probe failed"))  # Lightning calls no teardown after an exception
    assert not dm.auto_budget.allocator.held and len(calls) == 2


@pytest.mark.parametrize("options, planner, packed_rows", [
    ({}, "padded", False),
    ({"packing": True, "pad_to_multiple_of": 8}, "packed", True),
    ({"packing": True, "static_packing": True}, "packed", True),
    ({"padded_shapes": 3, "max_batch_size": 4}, "padded", False),
])
@pytest.mark.parametrize("max_tokens", [64, "auto"])
def test_the_batch_layout_is_the_settings_layout_and_names_its_planner(tmp_path, options, planner, packed_rows,
                                                                       max_tokens):
    from lit_balance.plan.budget_search import ProbeLayout

    docs = [np.arange(1, 1 + n) for n in (5, 9, 30, 12, 7, 3, 22)]
    extra = {"memory_limit": 2**30} if max_tokens == "auto" else {}
    dm = BalancedTextDataModule(docs, max_tokens=max_tokens, val_fraction=0, cache_dir=tmp_path, **options, **extra)
    layout = dm.batch_layout  # known before setup and before the budget is measured
    assert isinstance(layout, ProbeLayout)
    assert (layout.planner.name, layout.planner.packed_rows) == (planner, packed_rows)
    assert layout == ProbeLayout(**{k: v for k, v in options.items() if k != "max_batch_size"},
                                 max_batch_size=options.get("max_batch_size"))
    if max_tokens != "auto":
        dm.prepare_data()
        dm.setup("fit")
        assert ProbeLayout.of(dm.train_sampler.settings).planner.name == layout.planner.name
