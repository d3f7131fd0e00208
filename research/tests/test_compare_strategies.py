"""research/compare_strategies.py and research/_training.py: the baseline batch builders it trains with, each
strategy's data on simulated ranks, the meter's trace, the figures of a run, the per-pair ratios and targets, the
command line and its pairs, the torchrun launcher, and one small end-to-end run (2 CPU DDP ranks, one pair of three
strategies, with the time model's calibration and projection).

Run:
    python -m pytest -m benchmark research/tests/test_compare_strategies.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from research import _training as training
from research import compare_strategies as cs
from research import strategies
from benchmarks import peers
from benchmarks._harness import ROOT, load_lengths

LENGTHS = load_lengths("stdlib_docstrings", 256, 3000)


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
    batches = strategies.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=0)
    assert _flat(batches) == list(range(len(LENGTHS)))
    sizes = sorted(len(b) for b in batches)
    assert sizes[1:] == [4] * (len(batches) - 1) and 1 <= sizes[0] <= 4  # one shorter bucket at most
    # buckets are contiguous in the length order: sorted by their shortest row, their length ranges never overlap
    ranges = sorted((LENGTHS[b].min(), LENGTHS[b].max()) for b in batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in pairwise(ranges))
    assert batches == strategies.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=0)  # deterministic per (seed, epoch)
    assert batches != strategies.sorted_bucket_batches(LENGTHS, 4, seed=0, epoch=1)  # another order next epoch


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
    per_rank, dropped = strategies.deal_even(batches, num_replicas)
    assert len({len(r) for r in per_rank}) == 1
    assert len(dropped) == len(batches) % num_replicas < num_replicas
    assert sorted(map(tuple, [b for r in per_rank for b in r] + dropped)) == sorted(map(tuple, batches))
    assert per_rank[0][:2] == [batches[0], batches[num_replicas]]  # round-robin in training order
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        strategies.deal_even(batches, 0)


def test_epoch_batch_sampler_ranks_yield_equal_counts_and_change_every_epoch():
    build = lambda e: peers.sort_fill_batches(LENGTHS, 1024, seed=0, epoch=e)
    samplers = [strategies.EpochBatchSampler(build, 3, r) for r in range(3)]
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
        strategies.EpochBatchSampler(build, 2, 2)


def test_split_documents_is_seeded_disjoint_and_subsets_training_documents():
    train, val = training.split_documents(1000, 0.05, None)
    assert len(val) == 50 and len(train) == 950 and not set(train) & set(val)
    sub, val2 = training.split_documents(1000, 0.05, 100)
    assert len(sub) == 100 and set(sub) <= set(train) and list(val2) == list(val)
    with pytest.raises(ValueError, match="none left"):
        training.split_documents(1, 0.5, None)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def documents(cache_dir):
    """600 training documents of the built-in corpus and the held-out ones, as every run of the benchmark gets them."""
    return training.corpus_documents(600, 0.05, str(cache_dir))


def test_corpus_documents_are_the_split_of_the_built_in_corpus(documents, cache_dir):
    from lit_balance.data import load_or_build, resolve_corpus, resolve_tokenizer

    corpus = load_or_build(resolve_corpus(None), resolve_tokenizer(None), str(cache_dir))
    train_docs, val_docs = training.split_documents(len(corpus), 0.05, 600)
    train, val = documents
    assert len(train) == 600 and len(val) == len(val_docs) == round(0.05 * len(corpus))
    for got, docs in ((train, train_docs), (val, val_docs)):
        assert all(np.array_equal(g, corpus.document(d)) for g, d in zip(got, docs))


@pytest.mark.parametrize("strategy", cs.STRATEGIES)
def test_each_strategy_gives_ranks_equal_counts_and_yields_what_it_plans(strategy, documents, cache_dir):
    """Each strategy's loaders on 2 simulated ranks: equal counts, what is planned is what the ranks yield; the
    training documents truncated to max_length, and the same padded validation of the held-out ones for every
    strategy."""
    loaders, data = [], []
    for rank in range(2):
        dm = cs.CompareData(strategy, *documents, 1024, 256, seed=0, cache_dir=str(cache_dir))
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=1, strategy=SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}))
        dm.prepare_data()
        dm.setup("fit")
        loaders.append(dm.train_dataloader())
        data.append(dm)
    lengths = data[0].train_dataset.lengths
    assert lengths.tolist() == [min(len(d), 256) for d in documents[0]]
    batches = [[b["indices"].tolist() for b in loader] for loader in loaders]
    assert len(batches[0]) == len(batches[1]) == len(loaders[0])
    rows = [i for rank in batches for b in rank for i in b]
    samples, tokens = data[0].planned_tokens(1)
    assert len(rows) == samples and int(lengths[rows].sum()) == tokens  # nothing repeated, planned == yielded
    dropped = len(lengths) - samples
    slots = [len(b) * int(lengths[b].max()) for rank in batches for b in rank]
    if strategy in cs._PACKED:  # one packed row: its slots are its documents' tokens
        slots = [int(lengths[b].sum()) for rank in batches for b in rank]
    if strategy in ("random", "hf_flatten"):  # DistributedSampler(drop_last=True): the last len % ranks
        size = 4 if strategy == "random" else peers.flattening_batch_size(lengths, 1024)
        assert dropped == len(lengths) % 2 and max(len(b) for rank in batches for b in rank) == size
        assert data[0].batch_size == size
        if strategy == "random":
            assert max(slots) <= 1024
        else:
            assert max(slots) > 1024  # a fixed number of documents per row passes the budget when they run long
    elif strategy in ("lit_balance", "lit_balance_packed"):
        assert dropped == 0 and max(slots) <= 1024
    else:  # the last micro-batch of the shuffled order when their number is odd
        left_out = data[0].sampler.dropped
        assert len(left_out) == len(data[0].sampler.build(1)) % 2 and dropped == sum(len(b) for b in left_out)
        if strategy == "sorted_buckets":
            assert max(slots) <= 1024
        else:
            assert max(slots) > 1024  # a real-token budget passes the padded budget (what the benchmark measures)
    first = next(iter(loaders[0]))
    assert ("cu_seq_lens_q" in first) == (strategy in cs._PACKED)
    val = list(data[0].val_dataloader())  # no process group here: one simulated rank validates on every document
    assert all("attention_mask" in b and b["attention_mask"].shape[1] <= 256 for b in val)
    assert sorted(i for b in val for i in b["indices"].tolist()) == list(range(len(documents[1])))
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


def test_meter_trace_rows_follow_the_trace_fields(monkeypatch):
    """One rank, a padded then a packed micro-batch, with a fixed clock: every column of the trace row."""
    from lit_balance import PackedCollator, PadCollator

    clock = iter([10.0, 10.5, 11.0, 20.0, 20.25, 21.0])  # start, before backward, end; per micro-batch
    monkeypatch.setattr(training.time, "perf_counter", lambda: next(clock))
    meter = training.Meter()
    trainer = SimpleNamespace(current_epoch=0, global_step=0, world_size=1)
    module = SimpleNamespace(device=torch.device("cpu"))
    padded = PadCollator(0)([{"input_ids": [5, 6, 7], "index": 0}, {"input_ids": [8], "index": 1,
                                                                   "is_fill": True}])
    packed = PackedCollator(0)([{"input_ids": [5, 6, 7], "index": 0}, {"input_ids": [8, 9], "index": 1}])
    for step, batch in ((0, padded), (3, packed)):
        trainer.global_step = step
        meter.on_train_batch_start(trainer, module, batch, 0)
        meter.on_before_backward(trainer, module, None)
        meter.on_train_batch_end(trainer, module, None, batch, 0)
    meter.on_train_end(trainer, module)
    assert meter.trace.shape == (1, 2, len(training.TRACE_FIELDS))
    rows = [dict(zip(training.TRACE_FIELDS, row)) for row in meter.trace[0].tolist()]
    assert rows[0] == {"epoch": 0, "step": 0, "start_s": 10.0, "end_s": 11.0, "compute_s": 0.5, "real_tokens": 3,
                       "padded_slots": 6, "rows": 2, "attention_pairs": 2 * 3**2}  # the fill row's token excluded
    assert rows[1] == {"epoch": 0, "step": 3, "start_s": 20.0, "end_s": 21.0, "compute_s": 0.25, "real_tokens": 5,
                       "padded_slots": 5, "rows": 2, "attention_pairs": 3**2 + 2**2}
    assert meter.gathered.tolist() == [[[0, 0, 0.5, 3, 6], [0, 3, 0.25, 5, 5]]]
    assert meter.epoch_intervals.tolist() == [[[10.0, 21.0]]] and meter.peak_memory_mb[0] > 0


def test_loss_curve_puts_each_step_loss_at_the_real_tokens_trained_up_to_it():
    gathered = np.zeros((2, 3, 5))
    gathered[:, :, 3] = [[10, 20, 30], [1, 2, 3]]
    tokens, losses = training.loss_curve([(2, 5.0), (3, 4.0)], gathered)
    assert tokens == [33.0, 66.0] and losses == [5.0, 4.0]


def _result(run, strategy, tps, val, pair=1, **kw):
    base = {"run": run, "strategy": strategy, "scenario": "main", "pair": pair, "feedback": True, "status": "ok",
            "real_tokens_per_s": tps, "real_tokens_per_s_all_epochs": tps, "peak_memory_mb": 1000.0, "val_loss": val,
            "over_budget_micro_batches": 0, "max_micro_batch_slots": 1000, "straggler_ratio": 1.01,
            "step_straggler_ratio": 1.02, "compute_s_per_padded_slot_per_rank": [1.0, 1.0], "padding_ratio": 0.1,
            "calibration_error": 0.01}
    return {**base, **kw}


def _pair(pair, random, dynamic, lit, packed, no_fb, fb, slow_speed=2 / 3):
    return [
        _result(f"random_pair{pair}", "random", random, 7.0, pair),
        _result(f"dynamic_pair{pair}", "dynamic", dynamic, 6.5, pair, over_budget_micro_batches=5),
        _result(f"lit_balance_pair{pair}", "lit_balance", lit, 6.3, pair),
        _result(f"lit_balance_packed_pair{pair}", "lit_balance_packed", packed, 6.3, pair),
        _result(f"lit_balance_slowed_no_feedback_pair{pair}", "lit_balance", no_fb, 6.3, pair, scenario="slowed_rank",
                feedback=False, compute_s_per_padded_slot_per_rank=[1.0, 1 / slow_speed]),
        _result(f"lit_balance_slowed_feedback_pair{pair}", "lit_balance", fb, 6.3, pair, scenario="slowed_rank"),
    ]


def test_pair_ratios_and_targets_are_medians_over_pairs_of_same_pair_ratios():
    args = Namespace(max_tokens=1024, slow_rank=1, quick=True)
    # slowed rank at 2/3 speed on 2 ranks: ideal 1.25x; recovery (1.2 - 1) / 0.25 = 0.8, then 0.4, then 1.0
    results = (_pair(1, 100.0, 290.0, 310.0, 320.0, 200.0, 240.0) + _pair(2, 90.0, 300.0, 297.0, 300.0, 200.0, 220.0)
               + _pair(3, 110.0, 280.0, 330.0, 340.0, 200.0, 250.0))
    ratios = cs.pair_ratios(results, slow_rank=1)
    lr = ratios["lit_balance/random"]
    assert lr["per_pair"] == pytest.approx({1: 3.1, 2: 3.3, 3: 3.0}) and lr["median"] == pytest.approx(3.1)
    assert (lr["min"], lr["max"]) == pytest.approx((3.0, 3.3)) and lr["pairs"] == 3
    assert ratios["lit_balance/dynamic"]["median"] == pytest.approx(310 / 290)
    assert ratios["lit_balance_packed/lit_balance"]["per_pair"][2] == pytest.approx(300 / 297)
    assert ratios["random/lit_balance"]["per_pair"][1] == pytest.approx(100 / 310)
    assert ratios["slowed_ideal"]["per_pair"] == pytest.approx({1: 1.25, 2: 1.25, 3: 1.25})
    assert ratios["slowed_recovery"]["per_pair"] == pytest.approx({1: 0.8, 2: 0.4, 3: 1.0})
    t = cs.evaluate_targets(results, ratios, args, wall_s=500.0)
    assert t["tokens_per_s_vs_random"]["met"] and t["tokens_per_s_vs_dynamic"]["met"]
    assert t["micro_batches_over_budget"]["met"] and t["micro_batches_over_budget"]["dynamic_over_budget"] == [5] * 3
    packed = t["packed_vs_padded"]  # 320/310, 300/297, 340/330: median 1.0303
    assert packed["value"] == pytest.approx(340 / 330) and packed["met"]
    assert t["slowed_rank_recovery"]["value"] == pytest.approx(0.8) and t["slowed_rank_recovery"]["met"]
    assert t["calibration"]["value"] == pytest.approx(0.01) and t["calibration"]["met"]
    assert t["wall_time"]["met"] and "projection_64_main_corpus" not in t
    # one bad pair does not move a median; two do
    results[results.index(next(r for r in results if r["run"] == "lit_balance_pair2"))].update(
        real_tokens_per_s=250.0, over_budget_micro_batches=1, calibration_error=-0.08)
    results[results.index(next(r for r in results if r["run"] == "lit_balance_pair3"))]["real_tokens_per_s"] = 260.0
    ratios = cs.pair_ratios(results, slow_rank=1)
    t = cs.evaluate_targets(results, ratios, args, wall_s=700.0)
    assert not any(t[k]["met"] for k in ("tokens_per_s_vs_random", "tokens_per_s_vs_dynamic", "calibration",
                                         "micro_batches_over_budget", "wall_time"))
    assert t["packed_vs_padded"]["met"]  # 300/250 and 340/260 are well above 1.02
    # a failed run leaves its pair out of every ratio that needs it, and a target with no pair is not judged
    results = [r if r["strategy"] != "random" else {**r, "status": "timeout"} for r in results]
    ratios = cs.pair_ratios(results, slow_rank=1)
    assert ratios["lit_balance/random"]["pairs"] == 0
    assert cs.evaluate_targets(results, ratios, args)["tokens_per_s_vs_random"]["met"] is None


def test_projection_targets_compare_the_better_lit_balance_with_the_best_other_strategy():
    args = Namespace(max_tokens=1024, slow_rank=1, quick=False)
    rows = []
    for d, values in {cs.MAIN_CORPUS: {"random": 10.0, "dynamic": 70.0, "lit_balance": 80.0,
                                       "lit_balance_packed": 95.0},
                      "fortunes": {"random": 10.0, "dynamic": 50.0, "lit_balance": 49.0, "lit_balance_packed": 51.0}
                      }.items():
        rows += [{"distribution": d, "num_replicas": n, "strategy": s,
                  "predicted_real_tokens_per_s": v if n == 64 else 9 * v} for s, v in values.items() for n in (8, 64)]
    t = cs.evaluate_targets([], cs.pair_ratios([]), args, projection=rows)
    main = t["projection_64_main_corpus"]
    assert main["value"] == pytest.approx(95 / 70) and main["met"]
    shipped = t["projection_64_shipped"]
    assert shipped["value"] == pytest.approx(51 / 50) and shipped["met"]
    assert main["upper_bound_per_distribution"] == {}  # rows without U: no bound is claimed


def test_projection_bound_is_lit_balance_at_full_useful_compute_over_the_best_other_strategy():
    args = Namespace(max_tokens=1024, slow_rank=1, quick=False)
    at64 = {"random": {"predicted_real_tokens_per_s": 10.0, "useful_compute_fraction": 0.15, "sync_share": 0.0},
            "dynamic": {"predicted_real_tokens_per_s": 70.0, "useful_compute_fraction": 0.8, "sync_share": 0.0},
            "lit_balance": {"predicted_real_tokens_per_s": 72.0, "useful_compute_fraction": 0.9, "sync_share": 0.1},
            "lit_balance_packed": {"predicted_real_tokens_per_s": 73.0, "useful_compute_fraction": 0.95,
                                   "sync_share": 0.2}}
    # lit_balance: 72 / (0.9 x 0.9) = 88.9; packed: 73 / (0.95 x 0.8) = 96.1, the larger; over dynamic's 70
    assert cs.projection_bound(at64) == pytest.approx(73 / (0.95 * 0.8) / 70)
    assert cs.projection_bound({s: r for s, r in at64.items() if s.startswith("lit_balance")}) is None
    assert cs.projection_bound({**at64, "lit_balance": {"predicted_real_tokens_per_s": 72.0},
                                "lit_balance_packed": {"predicted_real_tokens_per_s": 73.0}}) is None
    rows = [{"distribution": cs.MAIN_CORPUS, "num_replicas": 64, "strategy": s, **r} for s, r in at64.items()]
    main = cs.evaluate_targets([], cs.pair_ratios([]), args, projection=rows)["projection_64_main_corpus"]
    assert main["value"] == pytest.approx(73 / 70) and not main["met"]
    assert main["upper_bound_per_distribution"] == {cs.MAIN_CORPUS: pytest.approx(73 / (0.95 * 0.8) / 70)}
    text = cs.targets_text({"projection_64_main_corpus": main})
    assert f"upper bound (U = 1, no sync): {cs.MAIN_CORPUS} 1.372" in text and "NOT met" in text


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _args(argv):
    parser = cs.build_parser()
    return cs.resolve_args(parser.parse_args(argv), parser)


def test_plan_runs_alternate_the_order_of_every_pair():
    runs = cs.plan_runs(_args(["--quick"]))
    one = [*[f"{s}_pair1" for s in cs.STRATEGIES], "lit_balance_slowed_no_feedback_pair1",
           "lit_balance_slowed_feedback_pair1"]
    assert [r["run"] for r in runs] == one + [r.replace("pair1", "pair2") for r in one[::-1]]
    assert [r["pair"] for r in runs] == [1] * 9 + [2] * 9 and [r["seed"] for r in runs] == [0] * 9 + [1] * 9
    main = [r for r in runs if r["scenario"] == "main"]
    slowed = [r for r in runs if r["scenario"] == "slowed_rank"]
    assert all(r["num_docs"] == cs.QUICK["num_docs"] and r["epochs"] == 2 for r in main)
    assert all(r["num_docs"] == cs.QUICK["slowed_num_docs"] and r["epochs"] == cs.QUICK["slowed_epochs"]
               for r in slowed)
    assert [r["feedback"] for r in slowed] == [False, True, True, False]
    assert all(r["target_tokens_per_step"] == 4 * 2 * 1024 and r["strategy"] in cs.STRATEGIES for r in runs)
    full = cs.plan_runs(_args(["--seed", "5", "--strategies", "random", "lit_balance", "--scenarios", "main"]))
    assert [r["run"] for r in full] == ["random_pair1", "lit_balance_pair1", "lit_balance_pair2", "random_pair2",
                                        "random_pair3", "lit_balance_pair3"]
    assert [r["seed"] for r in full] == [5, 5, 6, 6, 7, 7]
    assert {r["num_docs"] for r in full} == {cs.FULL["num_docs"]}
    assert {r["epochs"] for r in full} == {cs.FULL["epochs"]}
    assert len(cs.plan_runs(_args(["--scenarios", "slowed_rank", "--pairs", "4"]))) == 8


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
    for pair in (1, 2):
        for i, (run, strategy, scenario) in enumerate([(s, s, "main") for s in cs.STRATEGIES] + [
                ("lit_balance_slowed_no_feedback", "lit_balance", "slowed_rank"),
                ("lit_balance_slowed_feedback", "lit_balance", "slowed_rank")]):
            r = _result(f"{run}_pair{pair}", strategy, 100.0 + i + pair, 6.0 + i / 10, pair, scenario=scenario,
                        feedback=run != "lit_balance_slowed_no_feedback", optimizer_steps=10,
                        optimizer_steps_per_s=1.0, train_real_tokens=1000,
                        accumulate_grad_batches=[1, 4] if strategy == "lit_balance" else [1],
                        val_losses=[{"epoch": 0, "tokens": 500.0, "val_loss": 7.0},
                                    {"epoch": 1, "tokens": 1000.0, "val_loss": 6.0}],
                        curve={"tokens": list(np.linspace(100, 1000, 10)), "loss": list(np.linspace(9, 6, 10))})
            results.append(r)
    failed = {k: None for k in cs.RESULT_KEYS}  # what launch() records for a run that timed out
    results.append({**failed, "run": "sorted_buckets_pair3", "strategy": "sorted_buckets", "scenario": "main",
                    "pair": 3, "status": "timeout"})
    return results


def test_tables_and_plots_name_every_run_and_ratio(tmp_path):
    results = _full_results()
    table = cs.runs_table(results, 1024)
    lines = table.splitlines()
    assert len(lines) == 2 + len(results) and all(line.count("|") == lines[0].count("|") for line in lines)
    for r in results:
        assert f"| {r['run']} | {r['pair']} | {r['scenario']} |" in table
    assert "| sorted_buckets_pair3 | 3 | main | timeout |" in table
    assert "| lit_balance_pair1 | 1 | main | 105 |" in table and "| 1-4 |" in table
    ratios = cs.pair_ratios(results)
    text = cs.ratios_table(ratios, 3)
    assert "| lit_balance/random | 1.040 | 1.039 | - | 1.039 | 1.039 | 1.040 |" in text  # 105/101, 106/102
    assert all(f"| {s}/lit_balance |" in text for s in cs.STRATEGIES if s != "lit_balance")
    paths = cs.plot(results, tmp_path)
    assert [p.name for p in paths] == ["tokens_per_s.png", "loss_vs_tokens.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    targets = cs.targets_text(cs.evaluate_targets(results, ratios, Namespace(max_tokens=1024, slow_rank=1,
                                                                             quick=True)))
    assert "| tokens_per_s_vs_random | 1.039 | 1.039 - 1.040 | median over pairs of lit_balance / random" in targets
    assert targets.splitlines()[2].endswith("| NOT met |")
    assert "no calibration" in cs.calibration_table(None) and "no projection" in cs.projection_table(None)


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


def test_end_to_end_small_run_writes_results_traces_ratios_and_projection(tmp_path, cache_dir):
    """The script as a user runs it, small: random, lit_balance (sampler, feedback, adaptive accumulation) and
    lit_balance_packed, one pair on 2 CPU DDP ranks in a subprocess; the other strategies' loaders are checked above on
    simulated ranks."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    strategies = ["random", "lit_balance", "lit_balance_packed"]
    cmd = [sys.executable, "-m", "research.compare_strategies", "--model-size", "tiny", "--num-docs", "60",
           "--epochs", "2", "--pairs", "1", "--val-fraction", "0.01", "--strategies", *strategies,
           "--scenarios", "main", "--timeout-s", "120", "--output-dir", str(out), "--cache-dir", str(cache_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in results] == [f"{s}_pair1" for s in strategies], proc.stdout
    traces = np.load(out / "traces.npz")
    assert sorted(traces.files) == sorted(r["run"] for r in results)
    f = {name: i for i, name in enumerate(training.TRACE_FIELDS)}
    for r in results:
        assert r["status"] == "ok", (out / "logs" / f"{r['run']}.log").read_text()[-3000:]
        assert set(cs.RESULT_KEYS) <= set(r) and r["pair"] == 1 and r["scenario"] == "main"
        assert r["real_tokens_per_s"] > 0 and 0 < r["val_loss"] < math.log(30522) + 1
        assert r["all_planned_tokens_trained"] and r["headline_epochs"] == [1] and r["world_size"] == 2
        t = traces[r["run"]]
        assert t.shape == (2, r["micro_batches_per_rank"], len(training.TRACE_FIELDS))
        assert (t[:, :, f["real_tokens"]] <= t[:, :, f["padded_slots"]]).all()
        assert (t[:, :, f["end_s"]] >= t[:, :, f["start_s"]]).all() and (t[:, :, f["compute_s"]] > 0).all()
        assert (np.diff(t[:, :, f["step"]], axis=1) >= 0).all() and (t[:, :, f["step"]] == t[:1, :, f["step"]]).all()
        assert len(np.unique(t[0, :, f["step"]])) == r["optimizer_steps"] and t[0, 0, f["step"]] == 0
        assert int(t[:, :, f["real_tokens"]].sum()) == r["train_real_tokens"]
        assert int(t[:, :, f["padded_slots"]].sum()) == r["train_padded_slots"]
        assert t[:, :, f["padded_slots"]].max() == r["max_micro_batch_slots"]
        assert r["padding_ratio"] == pytest.approx(1 - r["train_real_tokens"] / r["train_padded_slots"])
        if r["strategy"] in cs._PACKED:  # documents of one row: sum of their squares <= the row's length squared
            assert (t[:, :, f["attention_pairs"]] <= t[:, :, f["padded_slots"]] ** 2).all()
            assert r["padding_ratio"] == 0
        else:  # padded: rows x padded length**2 = padded slots**2 / rows
            assert np.allclose(t[:, :, f["attention_pairs"]] * t[:, :, f["rows"]], t[:, :, f["padded_slots"]] ** 2)
        if r["strategy"] in cs._LIT_BALANCE:
            assert (t[:, :, f["padded_slots"]] <= 512).all() and r["over_budget_micro_batches"] == 0  # tiny: 512
            assert max(r["accumulate_grad_batches"]) > 1  # AdaptiveGradAccumulation raised it towards the target
        assert r["predicted_real_tokens_per_s"] > 0
        assert r["calibration_error"] == pytest.approx(r["predicted_real_tokens_per_s"] / r["real_tokens_per_s"] - 1)
    by = {r["strategy"]: r for r in results}
    assert by["random"]["fixed_batch_size"] == 4 and by["random"]["dropped_samples_per_epoch"] == [0, 0]
    assert by["lit_balance"]["train_real_tokens"] == by["lit_balance_packed"]["train_real_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    ratios = summary["ratios"]
    tps = {s: by[s]["real_tokens_per_s"] for s in strategies}
    assert ratios["lit_balance/random"]["per_pair"]["1"] == pytest.approx(tps["lit_balance"] / tps["random"])
    assert ratios["lit_balance_packed/lit_balance"]["median"] == pytest.approx(tps["lit_balance_packed"]
                                                                               / tps["lit_balance"])
    assert summary["targets"]["tokens_per_s_vs_random"]["value"] == pytest.approx(tps["lit_balance"] / tps["random"])
    assert summary["targets"]["micro_batches_over_budget"]["met"] is True
    assert summary["calibration"] == {r["run"]: r["calibration_error"] for r in results}
    assert summary["machine"]["cpu_count"] and "commit" in summary and summary["wall_s"] > 0
    assert set(summary["time_model"]) >= {"per_micro_batch_s", "per_token_s", "per_attention_pair_s",
                                          "per_step_sync_s"}
    rows = json.loads((out / "projection.json").read_text())
    assert {r["distribution"] for r in rows} == {cs.MAIN_CORPUS, *cs.SHIPPED_LENGTHS}
    assert {r["num_replicas"] for r in rows} == {8, 64, 512} and {r["strategy"] for r in rows} == set(cs.STRATEGIES)
    for name in ("tokens_per_s.png", "loss_vs_tokens.png", "calibration.png", "projection.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert md.startswith("Command: `python -m research.compare_strategies --model-size tiny")
    for heading in ("### Runs", "### Ratios per pair", "### Targets", "### Calibration", "### Projection"):
        assert heading in md
    assert "| lit_balance_pair1 | 1 | main |" in md and "wall time" in proc.stdout


def test_docstring_examples():
    import doctest

    from benchmarks import _harness

    for module in (cs, peers, strategies, training, _harness):
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
