"""Real 2-process CPU DDP fits (gloo) of a map-style dataset of dicts through balanced_dataloader.

A sequence classifier under both values of ``Trainer(use_distributed_sampler=...)`` and a source/target model:
Lightning keeps the sampler and calls its ``set_epoch``, each rank trains on its column of each epoch's plan, the
ranks together cover every item once per epoch, every micro-batch stays within the budget, and each optimizer
step's loss is divided by the step's real rows over both ranks.
"""

from pathlib import Path

import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_mapstyle.py")
RUNS = [("classify", True, 0), ("classify", False, 1), ("seq2seq", True, 0)]  # task, use_distributed_sampler, workers
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, side by side (each is 2 ranks); returns {run: [rank 0 record, rank 1 record]}."""
    return run_ranks(SCRIPT, {(task, use_ds, workers): (tmp_path_factory.mktemp(f"{task}_ds{int(use_ds)}"),
                                                       [task, str(int(use_ds)), str(workers)])
                              for task, use_ds, workers in RUNS}, 300)


@pytest.mark.parametrize("run", RUNS, ids=[f"{t}-use_distributed_sampler={d}" for t, d, _ in RUNS])
def test_two_rank_map_style_fit_trains_each_ranks_plan_column_once_per_epoch(runs, run):
    task = run[0]
    ranks = runs[run]
    items = ranks[0]["items"]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert all(r["sampler_is_ours"] for r in ranks)  # Lightning neither replaced nor wrapped the sampler
    assert [r["sampler_epoch"] for r in ranks] == [1, 1]  # set_epoch reached it
    for epoch in ("0", "1"):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == ranks[0]["len"] > 1
        for rank, batches in zip(ranks, per_rank):
            assert [b["indices"] for b in batches] == rank["plans"][epoch]
        real = []
        for batches in per_rank:
            for b in batches:
                assert b["num_padded_tokens"] <= MAX_TOKENS
                for field in ("input_ids", "labels") if task == "seq2seq" else ("input_ids",):
                    rows, width = len(b[field]), len(b[field][0])
                    assert rows * width <= b["num_padded_tokens"] and width % 4 == 0
                for row, (i, fill) in enumerate(zip(b["indices"], b["is_fill"])):
                    ids = items[i]["input_ids"]
                    assert b["input_ids"][row] == ids + [0] * (len(b["input_ids"][row]) - len(ids))
                    assert sum(b["attention_mask"][row]) == len(ids)
                    if task == "classify":
                        assert b["label"][row] == (-100 if fill else items[i]["label"])
                    else:
                        target = [-100] * len(items[i]["labels"]) if fill else items[i]["labels"]
                        assert b["labels"][row][: len(target)] == target
                    if not fill:
                        real.append(i)
        assert sorted(real) == list(range(len(items)))  # disjoint ranks, together covering the epoch
    assert ranks[0]["epochs"]["0"] != ranks[0]["epochs"]["1"]  # epoch 1 is another plan
    # each optimizer step divides by its supervised rows (classify) or target tokens (seq2seq) over both ranks
    steps = list(zip(*(r["epochs"]["0"] + r["epochs"]["1"] for r in ranks)))
    expected = []
    for pair in steps:
        if task == "classify":
            expected.append(sum(not f for b in pair for f in b["is_fill"]))
        else:
            expected.append(sum(t != -100 for b in pair for row in b["labels"] for t in row[1:]))
    assert ranks[0]["divisors"] == ranks[1]["divisors"] == expected
