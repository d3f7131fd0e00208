"""benchmarks/bench_samplers.py and the peers it runs: a row's figures on hand-made micro-batches (padded and packed)
and on lit_balance's plans, peers against their own per-rank samplers, refusals and missing peers as rows, the whole
command (every strategy, both kinds of workload, the tables and the report) and its arguments. The figures themselves
are tested with lit_balance.plan_stats (tests/plan/).

Run:
    python -m pytest tests/benchmarks/test_bench_samplers.py -q
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import warnings

import numpy as np
import pytest

from benchmarks import bench_samplers as bench
from benchmarks import peers
from benchmarks._harness import load_lengths
from benchmarks.peers import BenchConfig, StrategyRun
from lit_balance import BalancedBatchSampler, BatchingSettings, plan_epoch, plan_stats

pytestmark = pytest.mark.benchmark


def sample_counts(rank_batches, lengths):
    """(dropped, duplicated) of one epoch of per-rank micro-batches."""
    stats = plan_stats(rank_batches, lengths)
    return stats.dropped_samples, stats.duplicated_rows


# Hand-made: 6 samples, 2 ranks, rank 1 has one micro-batch more; sample 4 and 1 repeat, sample 5 never appears.
LENGTHS = np.array([4, 2, 2, 1, 3, 5])
RANK_BATCHES = [
    [[0, 1], [3]],  # rank 0: 2 x 4 = 8 slots (real 6); 1 slot (real 1)
    [[2], [4, 4], [1]],  # rank 1: 2 slots (real 2); 2 x 3 = 6 slots (real 3, one repeat); 2 slots (a repeat)
]


def test_row_figures_of_padded_rank_lists():
    m = bench.row_figures(StrategyRun({0: RANK_BATCHES, 1: RANK_BATCHES}, rank_plan_s=[0.25, 0.5]), LENGTHS, 6,
                          packed=False)
    assert (m["steps_min"], m["steps_max"], m["equal_counts"]) == (2, 3, False)
    assert m["micro_batches"] == 5 and m["budget_fill_ratio"] == pytest.approx(19 / 30)
    assert m["padding_ratio"] == pytest.approx(7 / 19) and m["over_budget_ratio"] == pytest.approx(0.2)
    assert m["max_batch_tokens"] == 8 and m["max_batch_ratio"] == pytest.approx(8 / 6)
    imbalance = [8 / 5, 6 / 3.5, 2.0]
    assert m["imbalance_tokens_mean"] == pytest.approx(np.mean(imbalance))
    assert m["imbalance_tokens_p99"] == pytest.approx(6 / 3.5 + 0.98 * (2.0 - 6 / 3.5))  # linear interpolation
    assert m["U_tokens"] == pytest.approx(0.375)
    attention = [2 * (4 + 1e-3 * 16), 1 * (2 + 1e-3 * 4)], [1 * (1 + 1e-3), 2 * (3 + 9e-3)], [0, 2 + 4e-3]
    slowest = sum(max(step) for step in attention)
    real = sum(n + 1e-3 * n * n for n in (4, 2, 2, 1, 3))
    assert m["U_attn_1e-3"] == pytest.approx(real / (2 * slowest))
    assert (m["dropped"], m["duplicated_marked"], m["duplicated_unmarked"]) == (1, 0, 2)
    assert m["persistence"] == 1.0  # same batches in both epochs; 0 and 1 are the only samples with batch-mates
    assert (m["plan_s"], m["plan_rank_s"]) == (0.75, 0.5)


EPOCH0 = [[[0, 1], [3]], [[2, 4], [4, 5]]]  # rank 1 repeats 4 (unmarked); every document present
EPOCH1 = [[[1, 0], [3]], [[2, 5], [4]]]  # 0 and 1 stay together; 2 and 4 part


def test_row_figures_of_packed_rank_lists():
    r = bench.row_figures(StrategyRun({0: EPOCH0, 1: EPOCH1}, [1.0]), LENGTHS, 6, packed=True)
    assert (r["steps_min"], r["steps_max"], r["equal_counts"]) == (2, 2, True)
    # packed rows: 6, 1 | 5, 8 tokens: one of four over the budget of 6, the largest 8 / 6
    assert r["over_budget_ratio"] == pytest.approx(0.25) and r["max_batch_ratio"] == pytest.approx(8 / 6)
    assert r["budget_fill_ratio"] == pytest.approx(20 / 24) and r["padding_ratio"] == pytest.approx(3 / 20)
    assert (r["dropped"], r["duplicated_marked"], r["duplicated_unmarked"]) == (0, 0, 1)
    assert r["U_tokens"] == pytest.approx(17 / (2 * (6 + 8)))  # real tokens / ranks x slowest per step
    real = sum(n + 1e-3 * n * n for n in LENGTHS)
    cost = [[4 + 2 + 1e-3 * 20, 2 + 3 + 1e-3 * 13], [1 + 1e-3, 3 + 5 + 1e-3 * 34]]
    assert r["U_attn_1e-3"] == pytest.approx(real / (2 * sum(max(step) for step in cost)))
    # of 0, 1, 2, 4 (3 and 5 have no real batch-mate), 0 and 1 keep theirs
    assert r["persistence"] == pytest.approx(0.5) and r["plan_s"] == r["plan_rank_s"] == 1.0


def test_row_figures_of_a_padded_plan_count_marked_fills():
    lengths = np.array([30, 20, 20, 10, 10])
    settings = BatchingSettings(max_tokens=40, shuffle=False)
    plans = [plan_epoch(lengths, settings, num_replicas=2, epoch=e) for e in (0, 1)]
    r = bench.row_figures(StrategyRun(dict(enumerate(plans)), [0.0]), lengths, 40, packed=False)
    assert r["duplicated_marked"] == int(plans[0].is_fill.sum()) and r["duplicated_unmarked"] == 0
    assert r["over_budget_ratio"] == 0 and r["equal_counts"] and r["dropped"] == 0


def _fortunes(n: int, cap: int = 64) -> np.ndarray:
    return load_lengths("fortunes", cap, n)


def test_sort_fill_batches_fill_real_tokens_and_keep_every_sample():
    lengths = _fortunes(2000)
    batches = peers.sort_fill_batches(lengths, 300, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(lengths.size))
    sums = [int(lengths[b].sum()) for b in batches]
    assert all(s <= 300 for s in sums)
    by_length = sorted(batches, key=lambda b: (lengths[b].min(), lengths[b].max()))
    assert all(lengths[x].max() <= lengths[y].min() for x, y in itertools.pairwise(by_length))  # contiguous in length
    # a micro-batch is cut only when the next sample would pass the budget (all but the last one)
    assert sum(int(lengths[x].sum() + lengths[y].min()) <= 300 for x, y in itertools.pairwise(by_length)) <= 1
    assert peers.sort_fill_batches(lengths, 300, seed=1, epoch=0) == batches
    assert peers.sort_fill_batches(lengths, 300, seed=1, epoch=1) != batches


@pytest.mark.parametrize(("strategy", "packing", "cost"), [("lit_padded", False, "tokens"),
                                                           ("lit_padded_attn_1e-3", False, "attn_1e-3"),
                                                           ("lit_packed_attn_1.2e-4", True, "attn_1.2e-4")])
def test_lit_balance_strategies_are_what_each_ranks_sampler_yields(strategy, packing, cost):
    lengths = _fortunes(300)
    run = bench.run_strategy(strategy, lengths, 2, BenchConfig(256, 3, 4))
    row = bench.run_row({"name": "w"}, lengths, strategy, 2, BenchConfig(256, 3, 4))
    assert (row["packed"], row["planned_for"], len(run.rank_plan_s)) == (packing, cost, 1)
    for rank in range(2):
        sampler = BalancedBatchSampler(lengths, settings=BatchingSettings(max_tokens=256, seed=3, packing=packing),
                                       num_replicas=2, rank=rank, cost_model=bench.COSTS[cost])
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            plan = run.batches[epoch]
            mine = [sorted(plan.batch(plan.assignment[s, rank])[0].tolist()) for s in range(plan.num_micro_steps)]
            assert mine == [sorted(map(int, b)) for b in sampler]


def test_hf_batch_rebalance_columns_equal_per_rank_samplers():
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    if not hasattr(pt_utils, "BatchRebalanceSampler"):
        pytest.skip("this transformers has no BatchRebalanceSampler")
    lengths = _fortunes(301)
    cfg = BenchConfig(max_tokens=256, seed=5, fixed_batch_size=4)
    run = peers.run_hf_batch_rebalance(lengths, 3, cfg)
    for epoch in (0, 1):
        for rank in range(3):
            s = pt_utils.BatchRebalanceSampler(lengths.tolist(), effective_batch_size=12, dp_size=3, grad_accum=1,
                                               seed=5, rank=rank, drop_last=False)
            s.set_epoch(epoch)
            assert run.batches[epoch][rank] == [list(map(int, b)) for b in s]
    # 301 = 25 x 12 + 1: the last global batch of 1 sample is padded with 2 repeats to give each rank one row
    assert sample_counts(run.batches[0], lengths) == (0, 2)


def test_lhotse_columns_equal_per_rank_samplers():
    pytest.importorskip("lhotse")
    from lhotse.dataset import DynamicBucketingSampler

    lengths = _fortunes(700)
    cfg = BenchConfig(max_tokens=256, seed=2, fixed_batch_size=4)
    cuts = peers.lhotse_cuts(lengths)
    run = peers.run_lhotse_dynamic(lengths, 3, cfg, cuts=cuts)
    for epoch in (0, 1):
        for rank in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eagerly read CutSet
                s = DynamicBucketingSampler(cuts, max_duration=256.0, shuffle=True, drop_last=False, world_size=3,
                                            rank=rank, seed=2)
            s.set_epoch(epoch)
            assert run.batches[epoch][rank] == [[int(c.id.split("_")[0]) for c in b] for b in s]
    dropped, duplicated = sample_counts(run.batches[0], lengths)
    assert dropped == 0 and duplicated < 3  # lhotse repeats at most world_size - 1 cuts to give every rank one


def _main(tmp_path, *extra):
    return bench.main(["--ranks", "2", "3", "--max-tokens", "256", "--max-length", "64", "--distributions",
                       "fortunes", "--long-distributions", "--num-samples", "400", "--output-dir", str(tmp_path),
                       "--shuffle-windows", *extra])


def test_padded_strategies_at_two_rank_counts(tmp_path):
    strategies = [s for s in bench.PADDED_PEERS if s != "lhotse_dynamic"] + ["lit_padded"]
    results = _main(tmp_path, "--strategies", *strategies)
    rows = {(r["strategy"], r["ranks"]): r for r in results["rows"]}
    assert set(rows) == {(s, r) for s in strategies for r in (2, 3)}
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    report = (tmp_path / "results.md").read_text()
    for (strategy, ranks), row in rows.items():
        assert f"| {strategy} | - | {ranks} |" in report or f"| {strategy} | tokens | {ranks} |" in report
        if strategy.startswith("hf_") and row["status"] == "not installed":
            continue
        assert row["status"] == "ok", row
        assert 0 <= row["padding_ratio"] < 1 and 0 < row["U_tokens"] <= 1
        assert row["imbalance_tokens_mean"] >= 1 and row["imbalance_tokens_p99"] >= row["imbalance_tokens_mean"] - 1e-9
    for ranks in (2, 3):
        ours = rows[("lit_padded", ranks)]
        assert (ours["over_budget_ratio"], ours["dropped"], ours["equal_counts"]) == (0.0, 0, True)
        fixed = rows[("distributed_fixed", ranks)]
        assert fixed["steps_max"] == math.ceil(math.ceil(400 / ranks) / 4)  # batch size 4
        assert (fixed["dropped"], fixed["duplicated_unmarked"]) == (0, (ranks - 400 % ranks) % ranks)
        assert fixed["over_budget_ratio"] == 0.0 and fixed["fixed_batch_size"] == 4
        assert (rows[("sort_fill", ranks)]["dropped"], rows[("sort_fill", ranks)]["duplicated_unmarked"]) == (0, 0)


def test_command_runs_every_strategy_on_both_workloads_and_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    results = bench.main(["--num-samples", "200", "--ranks", "2", "--distributions", "fortunes",
                          "--long-distributions", "stdlib_docstrings", "--shuffle-windows", "0", "4",
                          "--output-dir", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(results["rows"]))
    assert [(r["workload"], r["strategy"]) for r in saved["rows"]] == [
        (w, s) for w in ("fortunes cap 512", "stdlib_docstrings cap 4096 (long documents)") for s in bench.STRATEGIES]
    for row in saved["rows"]:
        if row["strategy"].startswith(("hf_", "lhotse")) and row["status"] in ("not installed", "unavailable"):
            continue
        assert row["status"] == "ok", row
        assert 0 < row["U_tokens"] <= 1 and 0 < row["U_attn_1e-3"] <= row["U_bound_attn_1e-3"] + 1e-12
        assert row["packed"] == (row["strategy"] in peers.PACKING_PEERS or row["strategy"].startswith("lit_packed"))
        if row["strategy"].startswith("lit_"):  # our plans: every document once, fills marked, equal counts
            assert row["dropped"] == row["duplicated_unmarked"] == row["over_budget_ratio"] == 0 and row["equal_counts"]
    for row in saved["rows"]:  # static shapes: what a compiler sees; the fraction within what the K lengths allow
        if row["strategy"].startswith("lit_padded_K"):
            k = int(row["strategy"].removeprefix("lit_padded_K"))
            assert row["distinct_shapes"] <= row["distinct_shapes_two_epochs"] <= k
            assert 0 < row["real_token_fraction"] <= row["length_padding_bound"] + 1e-12
        elif row["strategy"] == "lit_packed_static":
            assert row["distinct_shapes_two_epochs"] == 1 and row["length_padding_bound"] is None
        elif row["strategy"].startswith("lit_"):
            assert row["distinct_shapes_two_epochs"] > 1 and 0 < row["real_token_fraction"] <= 1  # free shapes
        else:
            assert "distinct_shapes" not in row
    hf = [r for r in saved["rows"] if r["strategy"] == "hf_flattening"]
    assert all(r["collator_mismatches"] == 0 and r["collator_longest_row"] == r["max_batch_tokens"] for r in hf)
    assert {w["max_length"] for w in saved["workloads"]} == {512, 4096}
    windows = {(t["workload"], t["shuffle_window"]): t for t in saved["shuffle_window_tradeoff"]}
    assert set(windows) == {("fortunes cap 512", 0.0), ("fortunes cap 512", 4.0)}  # the capped workload only
    assert windows["fortunes cap 512", 4.0]["persistence"] < windows["fortunes cap 512", 0.0]["persistence"]
    assert windows["fortunes cap 512", 4.0]["padding_ratio"] > windows["fortunes cap 512", 0.0]["padding_ratio"]
    report = (out / "results.md").read_text()
    assert report.count("| strategy | planned for |") == 2 and report.startswith("Command: `python -m benchmarks.")
    assert all(f"| {s} |" in report for s in bench.STRATEGIES) and "shuffle_window" in report
    assert saved["commit"] is None or len(saved["commit"]) == 40


def test_a_peer_refusing_its_inputs_gives_a_refused_row():
    workload, cfg = {"name": "tiny"}, BenchConfig(4096, 0, 1)
    row = bench.run_row(workload, np.array([5, 7, 9]), "kk_balanced", 4, cfg)  # 3 documents cannot fill 4 ranks
    assert row["status"] == "refused" and "each of 4 ranks a document" in row["reason"]
    assert "| kk_balanced | verl workload | 4 | refused: " in "| " + " | ".join(bench.fmt_row(row)) + " |"
    assert bench.run_row(workload, np.array([5, 7, 9]), "lit_packed", 4, cfg)["status"] == "ok"


def test_missing_peers_are_rows_not_crashes(tmp_path, monkeypatch):
    for name in ("lhotse", "lhotse.dataset", "transformers", "transformers.trainer_pt_utils"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    rows = _main(tmp_path, "--ranks", "2", "--strategies", "lhotse_dynamic", "hf_length_grouped",
                 "hf_batch_rebalance", "lit_padded")["rows"]
    assert [r["status"] for r in rows] == ["not installed"] * 3 + ["ok"]


def test_peer_class_missing_from_installed_package_is_unavailable(tmp_path, monkeypatch):
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    monkeypatch.delattr(pt_utils, "BatchRebalanceSampler", raising=False)
    (row,) = _main(tmp_path, "--ranks", "2", "--strategies", "hf_batch_rebalance")["rows"]
    assert row["status"] == "unavailable" and "has no trainer_pt_utils.BatchRebalanceSampler" in row["reason"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-length", "300"], "--max-length (300) must be <= --max-tokens (256)"),
        (["--ranks", "0"], "expected a positive integer, got 0"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--distributions", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        _main(tmp_path, *args)
    assert message in capsys.readouterr().err


def test_docstring_examples_of_the_peers_hold():
    import doctest

    result = doctest.testmod(peers)
    assert result.attempted >= 6 and result.failed == 0
