"""RunSummary: exact per-rank counts with a patched clock and a fake two-rank gather."""

from types import SimpleNamespace

import torch

from lit_balance.lightning.callbacks import summary as summary_mod
from lit_balance.lightning.callbacks.summary import RunSummary


class _TwoRankStrategy:
    """all_gather as two ranks would see it: this rank's tensor and a fixed tensor from rank 1."""

    def __init__(self, other):
        self.other = other
        self.distributed_sampler_kwargs = {"num_replicas": 2, "rank": 0}

    def all_gather(self, tensor):
        return torch.stack([tensor, self.other])


def test_counts_times_and_table(monkeypatch, capsys):
    # train start 100; three micro-batches: (wait, forward, rest) = (1, 2, 0.5), (0.5, 3, 0.5), (0, 1, -: no backward)
    times = [100.0,
             101.0, 103.0, 103.5,
             104.0, 107.0, 107.5,
             107.5, 108.5,
             112.5]
    clock = iter(times)
    monkeypatch.setattr(summary_mod.time, "perf_counter", lambda: next(clock))
    # rank 1: 2 micro-batches, 30 real tokens, 40 slots, compute 9 s, wait 1 s, wall 12 s
    other = torch.tensor([2.0, 30.0, 40.0, 9.0, 1.0, 12.0], dtype=torch.float64)
    trainer = SimpleNamespace(world_size=2, global_rank=0, strategy=_TwoRankStrategy(other), is_global_zero=True)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    for i, (real, padded) in enumerate([(7, 8), (10, 12), (5, 5)]):
        cb.on_train_batch_start(trainer, module, None, i)
        if i < 2:
            cb.on_before_backward(trainer, module, torch.tensor(0.0))
        cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": real, "num_padded_tokens": padded}, i)
    cb.on_train_end(trainer, module)

    assert cb.rows[0] == {"rank": 0, "micro_batches": 3.0, "real_tokens": 22.0, "padded_tokens": 25.0,
                          "compute_s": 6.0, "wait_s": 1.5, "wall_s": 12.5, "other_s": 5.0,
                          "padding_ratio": 1 - 22 / 25}
    assert cb.rows[1]["padding_ratio"] == 0.25 and cb.rows[1]["micro_batches"] == 2.0
    assert cb.rows[1]["compute_s"] == 9.0 and cb.rows[1]["other_s"] == 2.0  # per rank: not rank 0's
    assert cb.total == {"micro_batches": 5.0, "real_tokens": 52.0, "padded_tokens": 65.0, "compute_s": 15.0,
                        "wait_s": 2.5, "wall_s": 12.5, "other_s": 7.0, "padding_ratio": 1 - 52 / 65,
                        "straggler_ratio": 9.0 / 7.5}
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["rank", "micro-batches", "real", "tokens", "padded", "slots", "padding", "ratio",
                                "compute", "s", "wait", "s", "other", "s"]
    assert lines[1].split() == ["0", "3", "22", "25", "0.1200", "6.0", "1.5", "5.0"]
    assert lines[2].split() == ["1", "2", "30", "40", "0.2500", "9.0", "1.0", "2.0"]
    assert lines[3].split() == ["total", "5", "52", "65", "0.2000", "15.0", "2.5", "7.0"]
    assert lines[4].startswith("wall 12.5 s | straggler ratio 1.200 (largest compute s over the median) | ")


def test_other_ranks_do_not_print(capsys):
    other = torch.tensor([2.0, 30.0, 40.0, 5.0, 1.0, 11.0], dtype=torch.float64)  # rank 0's counts, as rank 1 gathers them
    strategy = SimpleNamespace(all_gather=lambda t: torch.stack([other, t]),
                               distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=strategy, is_global_zero=False)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": 3, "num_padded_tokens": 4}, 0)
    cb.on_train_end(trainer, module)
    assert capsys.readouterr().out == ""
    assert cb.total["real_tokens"] == 33.0 and cb.total["padded_tokens"] == 44.0 and len(cb.rows) == 2
    assert cb.rows[1]["real_tokens"] == 3.0 and cb.rows[1]["rank"] == 1


def test_one_rank_gathers_without_communicating():
    strategy = SimpleNamespace(all_gather=lambda t: 1 / 0)  # a single rank needs no collective
    trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=strategy, is_global_zero=False)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": 3, "num_padded_tokens": 4}, 0)
    cb.on_train_end(trainer, module)
    assert cb.total["real_tokens"] == 3.0 and cb.total["padded_tokens"] == 4.0 and len(cb.rows) == 1
