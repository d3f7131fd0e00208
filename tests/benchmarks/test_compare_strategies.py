"""benchmarks/compare_strategies.py: the baseline batch builders it trains with, the figures of a run, the targets,
the command line, the torchrun launcher, and one small end-to-end run (2 CPU DDP ranks).

Run:
    python -m pytest tests/benchmarks/test_compare_strategies.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import compare_strategies as cs
from benchmarks import _training as training
from benchmarks import peers

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = np.minimum(np.load(ROOT / "lit_balance/data/lengths/lengths_stdlib_docstrings.npy")[:3000], 256)


pytestmark = pytest.mark.benchmark


# ---------------------------------------------------------------------------------------------------------------
# Baseline batch builders


def test_fixed_batch_size_is_the_largest_within_the_budget():
    assert peers.fixed_batch_size(1024, 256) == 4
    assert peers.fixed_batch_size(1000, 256) == 3  # 4 x 256 would pass 1000
    with pytest.raises(ValueError, match="max_length=300 exceeds max_tokens=256"):
        peers.fixed_batch_size(256, 300)


def _flat(batches):
    return sorted(i for b in batches for i in b)


def test_sorted_bucket_batches_cover_every_sample_once_in_sorted_fixed_size_buckets():
    batches = peers.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=0)
    assert _flat(batches) == list(range(len(LENGTHS)))
    sizes = sorted(len(b) for b in batches)
    assert sizes[1:] == [4] * (len(batches) - 1) and 1 <= sizes[0] <= 4  # one shorter bucket at most
    # buckets are contiguous in the length order: sorted by their shortest row, their length ranges never overlap
    ranges = sorted((LENGTHS[b].min(), LENGTHS[b].max()) for b in batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))
    assert batches == peers.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=0)  # deterministic per (seed, epoch)
    assert batches != peers.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=1)  # another order next epoch


def test_sort_fill_batches_fill_real_tokens_up_to_the_budget_and_can_pass_it_in_padded_slots():
    batches = peers.sort_fill_batches(LENGTHS, 1024, seed=0, epoch=0)
    assert _flat(batches) == list(range(len(LENGTHS)))
    real = np.array([LENGTHS[b].sum() for b in batches])
    assert (real <= 1024).all()  # every length <= 256 here, so no single row passes the budget
    padded = np.array([len(b) * LENGTHS[b].max() for b in batches])
    assert (padded > 1024).any()  # the real-token budget is not a padded-slot budget (what lit_balance enforces)
    # full: adding the next sample of the sorted order would have passed the budget (all but the last batch)
    assert (real >= 1024 - 256).mean() > 0.95


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 8])
def test_deal_even_gives_equal_counts_and_drops_fewer_than_the_rank_count(num_replicas):
    batches = peers.sort_fill_batches(LENGTHS, 1024, seed=0, epoch=0)
    per_rank, dropped = peers.deal_even(batches, num_replicas)
    assert len({len(r) for r in per_rank}) == 1
    assert len(dropped) == len(batches) % num_replicas < num_replicas
    assert sorted(map(tuple, [b for r in per_rank for b in r] + dropped)) == sorted(map(tuple, batches))
    assert per_rank[0][:2] == [batches[0], batches[num_replicas]]  # round-robin in training order
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        peers.deal_even(batches, 0)


def test_epoch_batch_sampler_ranks_yield_equal_counts_and_change_every_epoch():
    build = lambda e: peers.sort_fill_batches(LENGTHS, 1024, seed=0, epoch=e)  # noqa: E731
    samplers = [peers.EpochBatchSampler(build, 3, r) for r in range(3)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        out = [list(s) for s in samplers]
        assert len({len(o) for o in out}) == 1 and all(len(o) == len(s) for o, s in zip(out, samplers))
        seen = _flat([b for o in out for b in o] + samplers[0].dropped)
        assert seen == list(range(len(LENGTHS)))
        if epoch == 0:
            first = out[0]
    assert out[0] != first
    with pytest.raises(ValueError, match="rank must be in"):
        peers.EpochBatchSampler(build, 2, 2)


def test_split_documents_is_seeded_disjoint_and_subsets_training_documents():
    train, val = cs.split_documents(1000, 0.05, None)
    assert len(val) == 50 and len(train) == 950 and not set(train) & set(val)
    sub, val2 = cs.split_documents(1000, 0.05, 100)
    assert len(sub) == 100 and set(sub) <= set(train) and list(val2) == list(val)
    with pytest.raises(ValueError, match="none left"):
        cs.split_documents(1, 0.5, None)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("strategy", cs.STRATEGIES)
def test_each_strategy_gives_ranks_equal_counts_and_yields_what_it_plans(strategy, cache_dir):
    """Each strategy's loaders on 2 simulated ranks: equal counts, what is planned is what the ranks yield."""
    loaders, data = [], []
    for rank in range(2):
        dm = cs.CompareData(strategy, 1024, 256, 600, 0.05, seed=0, cache_dir=str(cache_dir))
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=1)
        dm.setup("fit")
        loaders.append(dm.train_dataloader())
        data.append(dm)
    lengths = data[0].train_dataset.lengths
    batches = [[b["indices"].tolist() for b in loader] for loader in loaders]
    assert len(batches[0]) == len(batches[1]) == len(loaders[0])
    rows = [i for rank in batches for b in rank for i in b]
    samples, tokens = data[0].planned_tokens(1)
    assert len(rows) == samples and int(lengths[rows].sum()) == tokens  # nothing repeated, planned == yielded
    dropped = len(lengths) - samples
    slots = [len(b) * int(lengths[b].max()) for rank in batches for b in rank]
    if strategy in ("random", "random_accum"):  # DistributedSampler(drop_last=True): the last len % ranks
        assert dropped == len(lengths) % 2 and max(len(b) for rank in batches for b in rank) == 4
        assert max(slots) <= 1024
    elif strategy == "lit_balance":
        assert dropped == 0 and max(slots) <= 1024
    else:  # the last micro-batch of the shuffled order when their number is odd
        left_out = data[0].sampler.dropped
        assert len(left_out) == len(data[0].sampler.build(1)) % 2 and dropped == sum(len(b) for b in left_out)
        if strategy == "sorted_buckets":
            assert max(slots) <= 1024
        else:
            assert max(slots) > 1024  # a real-token budget passes the padded budget (what the benchmark measures)
    data[0].trainer.current_epoch = 2  # a new epoch: train_dataloader selects it before Lightning reads the length
    data[0].train_dataloader()
    assert data[0].sampler.epoch == 2


# ---------------------------------------------------------------------------------------------------------------
# Figures of a run


def test_run_stats_on_a_hand_made_run():
    # 2 ranks, 4 micro-batches each: epochs 0, 0, 1, 1; optimizer steps 0, 0, 1, 2
    # columns: epoch, step, compute s, real tokens, padded slots
    r0 = [[0, 0, 1.0, 90, 100], [0, 0, 1.0, 80, 100], [1, 1, 2.0, 100, 100], [1, 2, 1.0, 50, 60]]
    r1 = [[0, 0, 1.0, 100, 100], [0, 0, 1.0, 100, 100], [1, 1, 1.0, 100, 100], [1, 2, 3.0, 100, 120]]
    gathered = np.array([r0, r1], dtype=float)
    intervals = np.array([[[0.0, 4.0], [5.0, 9.0]], [[0.0, 3.0], [5.0, 10.0]]])  # per-epoch slowest: 4 s, 5 s
    st = training.run_stats(gathered, intervals, np.array([700.0, 800.0]), max_tokens=100)
    assert st["real_tokens_per_s"] == pytest.approx(350 / 5)  # epoch 1 only
    assert st["real_tokens_per_s_all_epochs"] == pytest.approx(720 / 9)
    assert st["optimizer_steps_per_s"] == pytest.approx(2 / 5)
    assert st["padding_ratio"] == pytest.approx(1 - 720 / 780)
    assert st["straggler_ratio"] == pytest.approx(6 / 5.5)  # per-rank compute 5 and 6; the median of two: 5.5
    assert st["step_straggler_ratio"] == pytest.approx((2 + 2 + 3) / (2 + 1.5 + 2))
    assert st["peak_memory_mb"] == 800.0 and st["train_real_tokens"] == 720
    assert st["max_micro_batch_slots"] == 120 and st["over_budget_micro_batches"] == 1
    assert st["optimizer_steps"] == 3 and st["real_tokens_per_epoch"] == [370, 350]


def test_loss_curve_and_step_noise():
    gathered = np.zeros((2, 3, 5))
    gathered[:, :, 3] = [[10, 20, 30], [1, 2, 3]]
    tokens, losses = training.loss_curve([(2, 5.0), (3, 4.0)], gathered)
    assert tokens == [33.0, 66.0] and losses == [5.0, 4.0]
    rng = np.random.default_rng(0)
    noisy = 3.0 + rng.normal(0, 0.1, 4000)
    assert training.loss_step_noise(noisy) == pytest.approx(0.1, rel=0.05)
    assert math.isnan(training.loss_step_noise([1.0, 2.0, 3.0]))


def _result(run, strategy, tps, val, **kw):
    base = {"run": run, "strategy": strategy, "scenario": "main", "status": "ok", "real_tokens_per_s": tps,
            "real_tokens_per_s_all_epochs": tps, "peak_memory_mb": 1000.0, "val_loss": val,
            "over_budget_micro_batches": 0, "max_micro_batch_slots": 1000, "straggler_ratio": 1.01,
            "step_straggler_ratio": 1.02, "compute_s_per_padded_slot_per_rank": [1.0, 1.0]}
    return {**base, **kw}


def test_evaluate_targets_ratios_and_noise_rule():
    args = Namespace(max_tokens=1024, slow_rank=1)
    results = [
        _result("random", "random", 100.0, 5.00),  # one micro-batch per step: not the val-loss reference
        _result("random_accum", "random_accum", 110.0, 6.00),
        _result("random_accum_seed1", "random_accum", 110.0, 6.10),
        _result("random_accum_seed2", "random_accum", 110.0, 6.20),  # mean 6.1, std 0.1: allowed up to 6.3
        _result("dynamic", "dynamic", 290.0, 6.5, peak_memory_mb=1000.0),
        _result("lit_balance", "lit_balance", 310.0, 6.29, peak_memory_mb=1019.0),
        _result("dynamic_accum", "dynamic_accum", 300.0, 6.4),
        _result("lit_balance_slowed_no_feedback", "lit_balance", 200.0, 6.3, scenario="slowed_rank",
                compute_s_per_padded_slot_per_rank=[1.0, 1.5]),
        _result("lit_balance_slowed_feedback", "lit_balance", 230.0, 6.3, scenario="slowed_rank"),
    ]
    t = cs.evaluate_targets(results, args)
    assert t["tokens_per_s_vs_random"]["value"] == pytest.approx(3.1) and t["tokens_per_s_vs_random"]["met"]
    assert t["tokens_per_s_vs_dynamic"]["value"] == pytest.approx(310 / 290) and t["tokens_per_s_vs_dynamic"]["met"]
    assert t["peak_memory_vs_dynamic"]["met"] and t["micro_batches_over_budget"]["met"] and t["straggler_ratio"]["met"]
    assert t["val_loss_vs_random"]["random_accum_std"] == pytest.approx(0.1) and t["val_loss_vs_random"]["met"]
    assert t["val_loss_vs_random_run"]["value"] == pytest.approx(1.29) and t["val_loss_vs_random_run"]["met"] is None
    assert t["val_loss_vs_dynamic_accum_run"]["value"] == pytest.approx(-0.11)
    fb = t["feedback_vs_no_feedback"]
    assert fb["value"] == pytest.approx(1.15) and fb["met"] is False
    assert fb["measured_slow_rank_speed"] == pytest.approx(2 / 3) and fb["ideal_for_measured_speed"] == pytest.approx(1.25)
    results[5] = _result("lit_balance", "lit_balance", 299.0, 6.31, peak_memory_mb=1021.0, over_budget_micro_batches=1)
    t = cs.evaluate_targets(results, args)
    assert not any(t[k]["met"] for k in ("tokens_per_s_vs_random", "tokens_per_s_vs_dynamic", "val_loss_vs_random",
                                         "micro_batches_over_budget"))
    assert t["peak_memory_vs_dynamic"]["met"] is False  # 1021 / 1000 > 1.02
    # a failed run is reported, not judged
    results[0] = {**results[0], "status": "timeout"}
    assert "tokens_per_s_vs_random" not in cs.evaluate_targets(results, args)


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _args(argv):
    parser = cs.build_parser()
    return cs.resolve_args(parser.parse_args(argv), parser)


def test_plan_runs_quick_and_full():
    runs = cs.plan_runs(_args(["--quick"]))
    assert [r["run"] for r in runs] == [*cs.STRATEGIES, "random_accum_seed1", "lit_balance_slowed_no_feedback",
                                        "lit_balance_slowed_feedback"]
    main, slowed = runs[:7], runs[7:]
    assert all(r["num_docs"] == 256 and r["epochs"] == 2 and r["scenario"] == "main" for r in main)
    assert [r["seed"] for r in main] == [0] * 6 + [1]
    assert all(r["num_docs"] == 640 and r["epochs"] == 2 and r["scenario"] == "slowed_rank" for r in slowed)
    assert [r["feedback"] for r in slowed] == [False, True]
    assert all(r["target_tokens_per_step"] == 4 * 2 * 1024 for r in runs)
    full = cs.plan_runs(_args(["--seed", "5", "--strategies", "random_accum", "lit_balance"]))
    assert [r["run"] for r in full] == ["random_accum", "lit_balance", "random_accum_seed6",
                                        "lit_balance_slowed_no_feedback", "lit_balance_slowed_feedback",
                                        "random_accum_seed7"]
    assert {r["num_docs"] for r in full} == {2000} and [r["epochs"] for r in full] == [2, 2, 2, 3, 3, 2]
    assert [r["run"] for r in cs.plan_runs(_args(["--scenarios", "slowed_rank", "--slowed-num-docs", "50"]))] == [
        "lit_balance_slowed_no_feedback", "lit_balance_slowed_feedback"]



@pytest.mark.parametrize(("argv", "message"), [
    (["--max-tokens", "100", "--max-length", "200"], "--max-length 200 exceeds --max-tokens 100"),
    (["--devices", "0"], "expected a positive integer, got 0"),
    (["--devices", "1"], "slowed_rank scenario needs --devices >= 2"),
    (["--slow-rank", "2"], "--slow-rank must be in [0, 2), got 2"),
    (["--strategies", "fastest"], "invalid choice: 'fastest'"),
    (["--val-fraction", "1.5"], "expected a number in (0, 1), got 1.5"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--slowdown", "nan"], "expected a finite number >= 0"),
    pytest.param(["--accelerator", "gpu"], "no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is available here")),
])
def test_bad_command_line_input_is_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cs.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# The parent's table and plots for every strategy (synthetic results), and the script end to end


def _full_results():
    results = []
    for i, (run, strategy, scenario) in enumerate([(s, s, "main") for s in cs.STRATEGIES] + [
            ("random_accum_seed1", "random_accum", "main"),
            ("lit_balance_slowed_no_feedback", "lit_balance", "slowed_rank"),
            ("lit_balance_slowed_feedback", "lit_balance", "slowed_rank")]):
        r = _result(run, strategy, 100.0 + i, 6.0 + i / 10, scenario=scenario, padding_ratio=0.1, optimizer_steps=10,
                    optimizer_steps_per_s=1.0, loss_step_noise=0.05, train_real_tokens=1000,
                    accumulate_grad_batches=[1, 4] if strategy == "lit_balance" else [1],
                    val_losses=[{"epoch": 0, "tokens": 500.0, "val_loss": 7.0}, {"epoch": 1, "tokens": 1000.0,
                                                                               "val_loss": 6.0}],
                    curve={"tokens": list(np.linspace(100, 1000, 10)), "loss": list(np.linspace(9, 6, 10))})
        results.append(r)
    failed = {k: None for k in cs.RESULT_KEYS}  # what launch() records for a run that timed out
    results.append({**failed, "run": "sorted_buckets_seed9", "strategy": "sorted_buckets", "scenario": "main",
                    "status": "timeout"})
    return results


def test_table_and_plots_name_every_run(tmp_path):
    results = _full_results()
    table = cs.markdown_table(results, 1024)
    lines = table.splitlines()
    assert len(lines) == 2 + len(results) and all(line.count("|") == lines[0].count("|") for line in lines)
    for r in results:
        assert f"| {r['run']} | {r['scenario']} |" in table
    assert "| sorted_buckets_seed9 | main | timeout |" in table
    assert "| lit_balance | main | 105 |" in table and "| 1-4 |" in table
    paths = cs.plot(results, tmp_path)
    assert [p.name for p in paths] == ["loss_vs_tokens.png", "tokens_per_s.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    text = cs.targets_text(cs.evaluate_targets(results, Namespace(max_tokens=1024, slow_rank=1)))
    assert "tokens_per_s_vs_random: 1.050 (lit_balance / random real tokens/s >= 3): NOT met" in text


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize(("code", "timeout_s", "status", "returncode"), [
    ("sys.exit(3) if rank == 1 else time.sleep(120)", 60, "failed", 1),  # rank 0 would wait for rank 1 forever
    ("time.sleep(120)", 8, "timeout", None),
])
def test_launch_stops_every_rank_when_one_fails_or_time_runs_out(tmp_path, code, timeout_s, status, returncode):
    """Under torchrun: a failing rank stops the other (torchrun's exit code 1; the log names rank 1's code 3), and
    the timeout stops every rank; no rank outlives launch()."""
    spec = {"run": "r", "strategy": "random", "scenario": "main", "seed": 0, "feedback": True, "devices": 2}
    script = tmp_path / "rank.py"
    script.write_text("import os, pathlib, sys, time\nrank = int(os.environ['RANK'])\n"
                      f"pathlib.Path({str(tmp_path)!r}, f'pid{{rank}}').write_text(str(os.getpid()))\n{code}\n")
    r = cs.launch(spec, tmp_path, timeout_s, worker=[str(script)])
    assert r["status"] == status and r["returncode"] == returncode, r.get("log_tail")
    assert r["subprocess_wall_s"] < timeout_s + 40 and r["real_tokens_per_s"] is None
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert not any(_alive(pid) for pid in pids)
    if status == "failed":
        assert "exitcode  : 3" in r["log_tail"] or "exitcode: 3" in r["log_tail"], r["log_tail"]


def test_end_to_end_small_run_writes_results_plots_and_table(tmp_path, cache_dir):
    """The script as a user runs it, small: lit_balance (sampler, feedback, adaptive accumulation) on 2 CPU DDP ranks
    in a subprocess; the other strategies' loaders are checked above on simulated ranks."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.compare_strategies", "--model-size", "tiny", "--num-docs", "60", "--epochs", "2",
           "--val-fraction", "0.01", "--strategies", "lit_balance", "random_accum", "--scenarios", "main",
           "--random-seeds", "1",
           "--timeout-s", "120", "--output-dir", str(out), "--cache-dir", str(cache_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert isinstance(results, list) and [r["run"] for r in results] == ["lit_balance", "random_accum"], proc.stdout
    control = results[1]  # random batches, accumulated to about lit_balance's target of real tokens per step
    assert control["status"] == "ok", (out / "logs" / "random_accum.log").read_text()[-3000:]
    dm = cs.CompareData("random_accum", 512, 128, 60, 0.01, seed=0, cache_dir=str(cache_dir))
    mean_length = float(dm.datasets()[0].lengths.mean())
    assert control["accumulate_grad_batches"] == [cs.matched_accumulate(4 * 2 * 512, 2, 4, mean_length)]
    assert control["accumulate_grad_batches"][0] > 1 and control["fixed_batch_size"] == 4
    r = results[0]
    assert r["status"] == "ok", (out / "logs" / "lit_balance.log").read_text()[-3000:]
    assert set(cs.RESULT_KEYS) <= set(r) and r["strategy"] == "lit_balance" and r["scenario"] == "main"
    assert r["real_tokens_per_s"] > 0 and r["optimizer_steps_per_s"] > 0
    assert 0 <= r["padding_ratio"] < 0.5 and r["straggler_ratio"] >= 1 and r["step_straggler_ratio"] >= 1
    assert 100 < r["peak_memory_mb"] < 16000 and len(r["peak_memory_mb_per_rank"]) == 2
    assert 0 < r["val_loss"] < math.log(30522) + 1 and [v["epoch"] for v in r["val_losses"]] == [0, 1]
    assert r["all_planned_tokens_trained"] and r["world_size"] == 2 and r["headline_epochs"] == [1]
    assert r["dropped_samples_per_epoch"] == [0, 0] and r["train_documents"] == 60
    assert r["train_real_tokens"] == sum(r["trained_real_tokens_per_epoch"]) == 2 * r["planned_real_tokens_per_epoch"][0]
    assert r["over_budget_micro_batches"] == 0 and r["max_micro_batch_slots"] <= 512  # tiny: max_tokens 512
    assert max(r["accumulate_grad_batches"]) > 1  # AdaptiveGradAccumulation raised it towards 4 budgets per step
    curves = json.loads((out / "curves.json").read_text())
    assert len(curves["lit_balance"]["loss"]) == r["optimizer_steps"]
    assert curves["lit_balance"]["tokens"][-1] == r["train_real_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["cpu_count"] and summary["targets"]["micro_batches_over_budget"]["met"] is True
    for name in ("loss_vs_tokens.png", "tokens_per_s.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| lit_balance | main |" in (out / "results.md").read_text() and "wall time" in proc.stdout


def test_matched_accumulate_rounds_to_the_nearest_count_and_never_below_one():
    assert cs.matched_accumulate(8192, 2, 4, 47.8) == 21  # 8192 / 382.4 = 21.4
    assert cs.matched_accumulate(8192, 2, 4, 44.0) == 23  # 8192 / 352 = 23.3
    assert cs.matched_accumulate(100, 2, 4, 256.0) == 1  # one micro-batch already holds more
    assert cs.matched_accumulate(100, 2, 4, 0.0) == 1


def test_docstring_examples():
    import doctest

    for module in (cs, peers, training):
        assert doctest.testmod(module, verbose=False).failed == 0, module.__name__


def test_slowed_rank_hook_slows_own_compute_but_not_the_wait_for_other_ranks(monkeypatch):
    spun = []
    monkeypatch.setattr(training, "_spin", spun.append)
    clock = [100.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])
    model = training.CompareLM(slow_rank=1, slowdown=0.5, vocab_size=16, d_model=8, num_heads=2, num_layers=1,
                         dim_feedforward=16)
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    model.trainer = SimpleNamespace(global_rank=1, world_size=2, strategy=SimpleNamespace(model=ddp))

    def backward_taking(seconds):
        def backward(self, loss, *args, **kwargs):
            clock[0] += seconds
        return backward

    def micro_batch(syncs, forward_s, backward_s):
        model._forward_s = forward_s
        object.__setattr__(ddp, "require_backward_grad_sync", syncs)  # what DDP's no_sync() clears
        monkeypatch.setattr(training.DemoTransformerLM, "backward", backward_taking(backward_s))
        model.backward(None)  # the spin happens inside backward, as on a slower device

    micro_batch(False, 1.0, 2.0)  # inside no_sync: all of it is compute
    micro_batch(True, 1.0, 5.0)  # the step's last: 2 s of compute (the ratio), 3 s waiting in the all-reduce
    micro_batch(True, 0.5, 1.0)  # a wait shorter than the estimate is kept
    assert spun == pytest.approx([1.0, 1.0, 0.5])
    model.trainer = SimpleNamespace(global_rank=0, world_size=2, strategy=SimpleNamespace(model=ddp))
    micro_batch(False, 1.0, 2.0)  # not the slowed rank
    assert len(spun) == 3
