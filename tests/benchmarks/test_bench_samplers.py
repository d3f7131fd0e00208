"""benchmarks/bench_samplers.py and the peers it runs: the table's figures on a hand-made case, peers against their
own per-rank samplers, the command line. The figures themselves are tested with lit_balance.plan_stats
(tests/plan/).

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
from lit_balance import BalancedBatchSampler, plan_stats

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


def test_sampler_metrics_hand_made():
    run = bench.StrategyRun({0: RANK_BATCHES, 1: RANK_BATCHES}, rank_plan_s=[0.25, 0.5])
    m = bench.sampler_metrics(run, LENGTHS, max_tokens=6)
    counts = (m["steps"], m["batches_per_rank_min"], m["batches_per_rank_max"], m["uneven_batch_counts"])
    assert counts == (3, 2, 3, True)
    assert m["micro_batches"] == 5 and m["budget_fill_ratio"] == pytest.approx(19 / 30)
    assert m["padding_ratio"] == pytest.approx(7 / 19) and m["over_budget_ratio"] == pytest.approx(0.2)
    imbalance = [8 / 5, 6 / 3.5, 2.0]
    assert m["imbalance_tokens_mean"] == pytest.approx(np.mean(imbalance))
    assert m["imbalance_tokens_p99"] == pytest.approx(6 / 3.5 + 0.98 * (2.0 - 6 / 3.5))  # linear interpolation
    assert m["useful_fraction_tokens"] == pytest.approx(0.375)
    attention = [2 * (4 + 1e-3 * 16), 1 * (2 + 1e-3 * 4)], [1 * (1 + 1e-3), 2 * (3 + 9e-3)], [0, 2 + 4e-3]
    slowest = sum(max(step) for step in attention)
    real = sum(n + 1e-3 * n * n for n in (4, 2, 2, 1, 3))
    assert m["useful_fraction_attention"] == pytest.approx(real / (2 * slowest))
    assert (m["dropped"], m["duplicated"]) == (1, 2)
    assert m["persistence"] == 1.0  # same batches in both epochs; 0 and 1 are the only samples with batch-mates
    assert (m["plan_s"], m["plan_rank_s"]) == (0.75, 0.5)


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


@pytest.mark.parametrize(("runner", "cost_model"), [("lit_balance", bench.TOKEN_COST),
                                                    ("lit_balance_attention", bench.ATTENTION_COST)])
def test_lit_balance_runners_are_the_sampler_planned_for_their_cost_model(runner, cost_model):
    cfg = peers.BenchConfig(max_tokens=256, seed=3, fixed_batch_size=4)
    lengths = _fortunes(300)
    run = bench.RUNNERS[runner](lengths, 2, cfg)
    for rank in range(2):
        sampler = BalancedBatchSampler(lengths, 256, num_replicas=2, rank=rank, seed=3, cost_model=cost_model)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert run.batches[epoch][rank] == [list(map(int, b)) for b in sampler]
    assert run.notes == [f"cost_model={cost_model}"] and len(run.rank_plan_s) == 2


def test_hf_batch_rebalance_columns_equal_per_rank_samplers():
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    if not hasattr(pt_utils, "BatchRebalanceSampler"):
        pytest.skip("this transformers has no BatchRebalanceSampler")
    lengths = _fortunes(301)
    cfg = peers.BenchConfig(max_tokens=256, seed=5, fixed_batch_size=4)
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
    cfg = peers.BenchConfig(max_tokens=256, seed=2, fixed_batch_size=4)
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
                       "fortunes", "--num-samples", "400", "--output-dir", str(tmp_path), "--skip-million", *extra])


def test_main_smoke_with_installed_peers(tmp_path, capsys):
    strategies = [s for s in bench.STRATEGIES if s != "lhotse_dynamic"]
    results = _main(tmp_path, "--strategies", *strategies)
    out = capsys.readouterr().out
    rows = {(r["strategy"], r["ranks"]): r for r in results["rows"]}
    assert set(rows) == {(s, r) for s in strategies for r in (2, 3)}
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    for (strategy, ranks), row in rows.items():
        assert f"| {strategy} | {ranks} |" in out
        if strategy.startswith("hf_") and row["status"] == "not installed":
            continue
        assert row["status"] == "ok", row
        assert 0 <= row["padding_ratio"] < 1 and 0 < row["useful_fraction_tokens"] <= 1
        assert row["imbalance_tokens_mean"] >= 1 and row["imbalance_tokens_p99"] >= row["imbalance_tokens_mean"] - 1e-9
    for ranks in (2, 3):
        ours = rows[("lit_balance", ranks)]
        assert (ours["over_budget_ratio"], ours["dropped"], ours["uneven_batch_counts"]) == (0.0, 0, False)
        fixed = rows[("distributed_fixed", ranks)]
        assert fixed["batches_per_rank_max"] == math.ceil(math.ceil(400 / ranks) / 4)  # batch size 4
        assert (fixed["dropped"], fixed["duplicated"]) == (0, (ranks - 400 % ranks) % ranks)
        assert fixed["over_budget_ratio"] == 0.0 and fixed["fixed_batch_size"] == 4
        assert (rows[("sort_fill", ranks)]["dropped"], rows[("sort_fill", ranks)]["duplicated"]) == (0, 0)


def test_main_lhotse_row(tmp_path):
    pytest.importorskip("lhotse")
    (row,) = _main(tmp_path, "--ranks", "3", "--strategies", "lhotse_dynamic")["rows"]
    assert row["status"] == "ok" and row["dropped"] == 0 and row["batches_per_rank_min"] >= 1


def test_missing_peers_are_rows_not_crashes(tmp_path, monkeypatch):
    for name in ("lhotse", "lhotse.dataset", "transformers", "transformers.trainer_pt_utils"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    rows = _main(tmp_path, "--ranks", "2", "--strategies", "lhotse_dynamic", "hf_length_grouped",
                 "hf_batch_rebalance", "lit_balance")["rows"]
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


def test_docstring_examples_of_the_benchmark_hold():
    import doctest

    result = doctest.testmod(peers)
    assert result.attempted >= 2 and result.failed == 0


def test_shuffle_window_table_trades_padding_for_randomness(tmp_path, capsys):
    results = _main(tmp_path, "--strategies", "lit_balance", "--shuffle-windows", "0", "4")
    rows = {(r["ranks"], r["shuffle_window"]): r for r in results["shuffle_window_tradeoff"]}
    assert set(rows) == {(2, 0.0), (2, 4.0), (3, 0.0), (3, 4.0)}
    for ranks in (2, 3):
        assert rows[ranks, 4.0]["persistence"] < rows[ranks, 0.0]["persistence"]
        assert rows[ranks, 4.0]["padding_ratio"] > rows[ranks, 0.0]["padding_ratio"]
    assert "shuffle_window" in capsys.readouterr().out
