"""DataLoader workers leave Ctrl-C and SIGTERM to the main process: the signals ignored in every worker of this
package's loaders, composed with the loader's own worker_init_fn; a SIGINT that reaches a worker (as a terminal's
Ctrl-C reaches the whole process group) does not end it."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lit_balance import BalancedBatchSampler
from lit_balance.data import MicroBatchDataset, PadFieldsCollator, balanced_dataloader
from lit_balance.data.workers import WorkerSignalsIgnored, ignore_stop_signals_in_workers

LENGTHS = [3, 5, 2, 7, 4, 6, 1, 8] * 5


class _Dispositions(torch.utils.data.Dataset):
    """Item i: the worker's pid and what SIGINT and SIGTERM do in it (0: default, 1: ignored, 2: a Python handler)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        kinds = [0 if h == signal.SIG_DFL else 1 if h == signal.SIG_IGN else 2
                 for h in (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))]
        return torch.tensor([os.getpid(), *kinds, int(os.environ.get("_SEEN_WORKER", "-1"))])


def _mark_worker(worker_id):  # a user's worker_init_fn (module level: picklable)
    os.environ["_SEEN_WORKER"] = str(worker_id + 10)


@pytest.mark.parametrize("user_fn", [None, _mark_worker], ids=["alone", "composed"])
def test_workers_ignore_both_signals_and_the_users_worker_init_fn_still_runs(user_fn):
    loader = DataLoader(_Dispositions(), batch_size=None, num_workers=1,
                        worker_init_fn=ignore_stop_signals_in_workers(user_fn))
    rows = torch.stack(list(loader))
    assert (rows[:, 0] != os.getpid()).all()  # read in a worker
    assert rows[:, 1:3].tolist() == [[1, 1]] * 4  # SIGINT and SIGTERM ignored there
    assert rows[:, 3].tolist() == [10 if user_fn else -1] * 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the main process is untouched


def test_the_wrapper_wraps_once_pickles_and_rejects_a_non_function():
    once = WorkerSignalsIgnored(WorkerSignalsIgnored(_mark_worker))
    assert once.worker_init_fn is _mark_worker
    assert pickle.loads(pickle.dumps(once)).worker_init_fn is _mark_worker
    with pytest.raises(TypeError, match="worker_init_fn must be a function of the worker id or None, got 3"):
        ignore_stop_signals_in_workers(3)


def _balanced_loader(**kwargs):
    items = [{"input_ids": np.arange(1, n + 1)} for n in LENGTHS]
    dataset = MicroBatchDataset(items, length="input_ids")
    sampler = BalancedBatchSampler(LENGTHS, max_tokens=8, num_replicas=1, rank=0, shuffle=False)
    return balanced_dataloader(dataset, sampler, PadFieldsCollator({"input_ids": 0}), **kwargs)


def _interrupted(loader):
    """The micro-batches of one pass over ``loader`` (one worker), its worker sent SIGINT after the first."""
    before = {p.pid for p in multiprocessing.active_children()}  # other tests of this process may have children
    it = iter(loader)
    got = [next(it)["input_ids"].tolist()]
    (worker,) = [p for p in multiprocessing.active_children() if p.pid not in before]  # the loader's one worker
    os.kill(worker.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to the whole group, worker included
    return got + [b["input_ids"].tolist() for b in it]


@pytest.mark.parametrize("user_fn", [None, _mark_worker], ids=["alone", "composed"])
def test_a_balanced_loaders_worker_survives_a_sigint_and_every_micro_batch_arrives(user_fn):
    expected = [b["input_ids"].tolist() for b in _balanced_loader()]
    loader = _balanced_loader(num_workers=1, prefetch_factor=1, worker_init_fn=user_fn)
    assert isinstance(loader.worker_init_fn, WorkerSignalsIgnored) and loader.worker_init_fn.worker_init_fn is user_fn
    assert _interrupted(loader) == expected  # no "DataLoader worker ... exited unexpectedly"


def test_a_plain_loaders_worker_ends_on_sigint():
    # what the wrapper prevents: PyTorch's worker loop ends quietly on KeyboardInterrupt, and the main process fails at
    # its next fetch (or while it reads a micro-batch the worker was sending)
    loader = _balanced_loader(num_workers=1, prefetch_factor=1)
    plain = DataLoader(loader.dataset, sampler=loader.sampler, batch_size=None, collate_fn=loader.collate_fn,
                       num_workers=1, prefetch_factor=1)
    with pytest.raises((RuntimeError, FileNotFoundError), match="exited unexpectedly|No such file"):
        _interrupted(plain)
