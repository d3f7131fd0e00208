"""The plan report: both plans measured alike, the unit of the planner's cost, the tables and the plots."""

from __future__ import annotations

import numpy as np
from rich.console import Console

from lit_balance.plan import CostModel
from lit_balance.report import distributed_sampler_plan, format_report, plan_report, save_plots


def test_distributed_sampler_baseline_counts_fill_rows():
    plan = distributed_sampler_plan(7, 2, num_replicas=3, shuffle=True, seed=1, epoch=0, drop_last=False)
    assert plan.assignment.shape == (2, 3) and int(plan.is_fill.sum()) == 2  # 9 slots for 7 samples
    assert sorted(plan.rows[~plan.is_fill].tolist()) == list(range(7))
    report = plan_report([10, 20, 30, 40, 50, 60, 70], 140, num_replicas=3, shuffle_window=0)
    assert report.baseline_batch_size == 2 and report.baseline.rank_real_tokens.sum() == 280
    assert report.baseline.max_batch_tokens <= 140 and report.balanced.max_batch_tokens <= 140


def test_the_unit_and_the_length_buckets_follow_the_planner():
    lengths = np.random.default_rng(0).integers(1, 300, 400)
    padded = plan_report(lengths, 1024, num_replicas=2)
    packed = plan_report(lengths, 1024, num_replicas=2, packing=True)
    assert padded.cost_unit == "padded slots" and packed.cost_unit == "tokens"
    assert padded.bucket_edges.size and not packed.bucket_edges.size  # a packed row has no length buckets
    assert plan_report(lengths, 1024, num_replicas=2, cost_model=CostModel(per_batch=5.0)).cost_unit == "cost units"
    assert packed.balanced.padding_ratio == 0.0 and packed.balanced.max_batch_tokens <= 1024


def test_tables_and_plots_render(tmp_path):
    report = plan_report(np.random.default_rng(1).integers(1, 300, 300), 1024, num_replicas=3)
    console = Console(record=True, width=160)
    for renderable in format_report(report):
        console.print(renderable)
    text = console.export_text()
    assert "BalancedBatchSampler: per rank, epoch 0" in text and "useful compute fraction" in text
    assert sum(line.split()[:1] == [str(r)] for line in text.splitlines() for r in range(3)) >= 6  # 3 ranks x 2
    paths = save_plots(report, tmp_path)
    assert [p.name for p in paths] == ["lengths_histogram.png", "step_cost.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
