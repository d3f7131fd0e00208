"""RunSummary: exact per-rank counts and phases from a scripted clock, Lightning's profiler actions, a fake gather."""

import re
from types import SimpleNamespace

import torch
from conftest import Clock
from lightning.pytorch.profilers import PassThroughProfiler

from lit_balance.lightning.callbacks.phases import PhaseClock
from lit_balance.lightning.callbacks.summary import RunSummary


class _TwoRankStrategy:
    """all_gather as two ranks would see it: this rank's tensor and a fixed tensor from rank 1."""

    def __init__(self, other):
        self.other = other
        self.distributed_sampler_kwargs = {"num_replicas": 2, "rank": 0}

    def all_gather(self, tensor):
        return torch.stack([tensor, self.other])

    def barrier(self, name=None):
        pass


def _trainer(strategy, rank=0):
    return SimpleNamespace(world_size=2, global_rank=rank, strategy=strategy, is_global_zero=rank == 0,
                           profiler=PassThroughProfiler(), lightning_module=None)


def _act(trainer, clock, action, seconds):
    trainer.profiler.start(action)
    clock.tick(seconds)
    trainer.profiler.stop(action)


def test_counts_phases_and_table(capsys):
    clock = Clock()
    # rank 1: 2 micro-batches, 30 real tokens, 40 slots; compute 9 s, data wait 1 s, rank wait 0.5 s, other 1.5 s
    other = torch.tensor([2.0, 30.0, 40.0, 9.0, 1.0, 0.5, 1.5, 12.0], dtype=torch.float64)
    trainer = _trainer(_TwoRankStrategy(other))
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary(clock=clock)
    cb.setup(trainer, module, "fit")
    assert isinstance(trainer.profiler, PhaseClock)
    cb.on_train_start(trainer, module)
    for i, (real, padded) in enumerate([(7, 8), (10, 12), (5, 5)]):
        clock.tick(0.25)  # the loop's bookkeeping before Lightning's stop-flag broadcast: rank wait (2 ranks)
        _act(trainer, clock, "[_TrainingEpochLoop].train_dataloader_next", 0.5)  # data wait
        _act(trainer, clock, "[Strategy]DDPStrategy.batch_to_device", 0.125)  # data wait
        trainer.profiler.start("run_training_batch")
        clock.tick(2.0)  # compute
        _act(trainer, clock, "[Callback]Some.on_before_backward", 1.0)  # a callback inside: other
        trainer.profiler.stop("run_training_batch")
        _act(trainer, clock, "[Callback]Some.on_train_batch_end", 0.75)  # other
        cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": real, "num_padded_tokens": padded}, i)
    _act(trainer, clock, "[Strategy]DDPStrategy.validation_step", 3.0)  # validation: other
    _act(trainer, clock, "save_checkpoint", 2.0)  # other
    cb.on_train_end(trainer, module)
    cb.on_fit_end(trainer, module)
    cb.teardown(trainer, module, "fit")
    assert isinstance(trainer.profiler, PassThroughProfiler)  # the Trainer's own profiler is back

    assert cb.rows[0] == {"rank": 0, "micro_batches": 3.0, "real_tokens": 22.0, "padded_tokens": 25.0,
                          "compute_s": 6.0, "data_wait_s": 1.875, "rank_wait_s": 0.75, "other_s": 10.25,
                          "wall_s": 18.875, "padding_ratio": 1 - 22 / 25}
    assert cb.rows[1]["padding_ratio"] == 0.25 and cb.rows[1]["micro_batches"] == 2.0
    assert cb.rows[1]["compute_s"] == 9.0 and cb.rows[1]["other_s"] == 1.5  # per rank: not rank 0's
    assert cb.total == {"micro_batches": 5.0, "real_tokens": 52.0, "padded_tokens": 65.0, "compute_s": 15.0,
                        "data_wait_s": 2.875, "rank_wait_s": 1.25, "other_s": 11.75, "wall_s": 18.875,
                        "padding_ratio": 1 - 52 / 65, "straggler_ratio": 9.0 / 7.5}
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert lines[0].split() == ["rank", "micro-", "real", "padded", "padding", "compute", "data", "rank", "other"]
    assert lines[1].split() == ["batches", "tokens", "slots", "s", "wait", "s", "wait", "s", "s"]
    assert lines[2].split() == ["0", "3", "22", "25", "0.1200", "6.0", "1.9", "0.8", "10.2"]
    assert lines[3].split() == ["1", "2", "30", "40", "0.2500", "9.0", "1.0", "0.5", "1.5"]
    assert lines[4].split() == ["total", "5", "52", "65", "0.2000", "15.0", "2.9", "1.2", "11.8"]
    assert lines[5] == "wall 18.9 s (slowest rank) | straggler ratio 1.200 (whole run)"
    assert lines[6] == "straggler ratio: the largest compute s over the median"
    assert "other: validation, checkpointing, logging, callbacks" in lines[9]
    assert max(len(line) for line in lines) <= 80
    # each figure right-aligned under its header
    for row in lines[2:5]:
        assert [len(row[:m.end()]) for m in re.finditer(r"\S+", row)] == [m.end() for m in re.finditer(r"\S+", lines[0])]


def test_the_table_is_printed_at_fit_end_not_at_train_end(capsys):
    trainer = _trainer(SimpleNamespace(all_gather=lambda t: torch.stack([t, t]),
                                       distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": 3, "num_padded_tokens": 4}, 0)
    cb.on_train_end(trainer, module)
    assert capsys.readouterr().out == ""  # a progress bar may still be drawn here
    cb.on_fit_end(trainer, module)
    assert capsys.readouterr().out.startswith(" rank  micro-")


def test_other_ranks_do_not_print(capsys):
    # rank 0's counts, as rank 1 gathers them
    other = torch.tensor([2.0, 30.0, 40.0, 5.0, 1.0, 0.0, 5.0, 11.0], dtype=torch.float64)
    strategy = SimpleNamespace(all_gather=lambda t: torch.stack([other, t]),
                               distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    trainer = _trainer(strategy, rank=1)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": 3, "num_padded_tokens": 4}, 0)
    cb.on_train_end(trainer, module)
    cb.on_fit_end(trainer, module)
    assert capsys.readouterr().out == ""
    assert cb.total["real_tokens"] == 33.0 and cb.total["padded_tokens"] == 44.0 and len(cb.rows) == 2
    assert cb.rows[1]["real_tokens"] == 3.0 and cb.rows[1]["rank"] == 1


def test_one_rank_gathers_without_communicating():
    strategy = SimpleNamespace(all_gather=lambda t: 1 / 0)  # a single rank needs no collective
    trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=strategy, is_global_zero=False,
                              profiler=PassThroughProfiler(), lightning_module=None)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb = RunSummary()
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, {"num_real_tokens": 3, "num_padded_tokens": 4}, 0)
    cb.on_train_end(trainer, module)
    assert cb.total["real_tokens"] == 3.0 and cb.total["padded_tokens"] == 4.0 and len(cb.rows) == 1
