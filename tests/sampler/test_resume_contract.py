"""One resume contract over every BalancedBatchSampler variant (as lhotse's ``SAMPLERS_TO_TEST`` does).

For each variant: run ``k`` micro-batches of an epoch on every rank, save ``state_dict()`` (through
``torch.save`` / ``torch.load(weights_only=True)``, as a Lightning checkpoint does), build fresh samplers
(on another number of ranks where the variant says so), load the state and finish the epoch. Compared with
an uninterrupted run:

* same number of ranks: each rank yields exactly the remaining micro-batches (indices, fill rows, step totals);
* another number of ranks: every sample of the uninterrupted epoch is trained exactly once over both halves
  (fill rows aside), with equal counts on the new ranks and every micro-batch within ``max_tokens`` (per-rank
  budgets: its own rank's; a resume onto another number of ranks gets a list of the new length);

and then the next epoch equals a fresh sampler's. Only the public keyword API is used. The property-based
checks of single behaviours (random lengths, any world sizes) are in ``test_resume.py``.
"""

import collections
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_balance import BalancedBatchSampler

MAX_TOKENS = 512
_FORTUNES = np.load(Path(__file__).parents[2] / "lit_balance/data/lengths/lengths_fortunes.npy")
LENGTHS = np.minimum(_FORTUNES[:240].astype(np.int64), MAX_TOKENS)
# a few samples longer than max_tokens, for too_long="skip"
LONG = np.concatenate([LENGTHS[:200], [MAX_TOKENS + 1, 3 * MAX_TOKENS], LENGTHS[200:]])


def _sampler(lengths=LENGTHS, speeds=None, budgets=None, **settings):
    """A factory: (num_replicas, rank) -> a BalancedBatchSampler of these settings; ``budgets`` maps a number of
    ranks to its ``max_tokens`` (default ``MAX_TOKENS``)."""

    def make(num_replicas, rank):
        extra = {"rank_speeds": speeds[num_replicas]} if speeds else {}
        max_tokens = budgets[num_replicas] if budgets else MAX_TOKENS
        return BalancedBatchSampler(lengths, max_tokens, num_replicas=num_replicas, rank=rank, seed=11,
                                    **settings, **extra)

    return make


# per-rank budgets (the largest is MAX_TOKENS, so too_long treats the same samples on every world size)
PER_RANK = {2: [MAX_TOKENS, MAX_TOKENS // 2], 3: [MAX_TOKENS // 2, MAX_TOKENS, 3 * MAX_TOKENS // 4]}
PER_RANK_SPEEDS = {2: [1.0, 0.5], 3: [0.5, 1.0, 0.75]}


# (id, factory, ranks before the checkpoint, ranks after it)
SAMPLERS_TO_TEST = [
    ("default", _sampler(), 2, 2),
    ("no_shuffle", _sampler(shuffle=False), 2, 2),
    ("shuffle_window_0", _sampler(shuffle_window=0.0), 2, 2),
    ("shuffle_window_4", _sampler(shuffle_window=4.0), 2, 2),
    ("rank_speeds", _sampler(speeds={2: [1.0, 1 / 1.5], 3: [1.0, 0.8, 0.5]}), 3, 3),
    ("accumulate_2", _sampler(accumulate_grad_batches=2), 2, 2),
    ("accumulate_3", _sampler(accumulate_grad_batches=3), 3, 3),
    ("drop_last", _sampler(drop_last=True), 3, 3),
    ("too_long_skip", _sampler(LONG, too_long="skip"), 2, 2),
    ("max_batch_size", _sampler(max_batch_size=3), 2, 2),
    ("pad_to_multiple_of_8", _sampler(pad_to_multiple_of=8), 2, 2),
    ("largest_first", _sampler(largest_first=True, accumulate_grad_batches=2), 2, 2),
    ("world_2_to_3", _sampler(), 2, 3),
    ("world_3_to_2", _sampler(), 3, 2),
    ("world_2_to_3_accumulate_2_no_shuffle", _sampler(accumulate_grad_batches=2, shuffle=False), 2, 3),
    ("world_3_to_2_max_batch_size", _sampler(max_batch_size=3), 3, 2),
    # planned in windows (4 windows of 60 samples), each window when the epoch reaches it
    ("windowed", _sampler(plan_window=70), 2, 2),
    ("windowed_no_shuffle_largest_first", _sampler(plan_window=70, shuffle=False, largest_first=True), 2, 2),
    ("windowed_accumulate_3", _sampler(plan_window=70, accumulate_grad_batches=3), 3, 3),
    ("windowed_rank_speeds", _sampler(plan_window=70, speeds={2: [1.0, 1 / 1.5], 3: [1.0, 0.8, 0.5]}), 2, 2),
    ("windowed_too_long_skip_drop_last", _sampler(LONG, plan_window=70, too_long="skip", drop_last=True), 3, 3),
    ("windowed_world_2_to_3", _sampler(plan_window=70), 2, 3),
    ("windowed_world_3_to_2_accumulate_2", _sampler(plan_window=70, accumulate_grad_batches=2), 3, 2),
    ("packed", _sampler(packing=True), 2, 2),
    ("packed_no_shuffle", _sampler(packing=True, shuffle=False), 2, 2),
    ("packed_rank_speeds", _sampler(packing=True, speeds={2: [1.0, 1 / 1.5], 3: [1.0, 0.8, 0.5]}), 3, 3),
    ("packed_accumulate_3", _sampler(packing=True, accumulate_grad_batches=3), 3, 3),
    ("packed_drop_last", _sampler(packing=True, drop_last=True), 3, 3),
    ("packed_too_long_skip", _sampler(LONG, packing=True, too_long="skip"), 2, 2),
    ("packed_too_long_truncate", _sampler(LONG, packing=True, too_long="truncate"), 2, 2),
    ("packed_max_batch_size", _sampler(packing=True, max_batch_size=3), 2, 2),
    ("packed_pad_to_multiple_of_8", _sampler(packing=True, pad_to_multiple_of=8), 2, 2),
    ("packed_largest_first", _sampler(packing=True, largest_first=True, accumulate_grad_batches=2), 2, 2),
    ("packed_world_2_to_3", _sampler(packing=True), 2, 3),
    ("packed_world_3_to_2", _sampler(packing=True), 3, 2),
    ("packed_world_2_to_3_accumulate_2_no_shuffle", _sampler(packing=True, accumulate_grad_batches=2, shuffle=False),
     2, 3),
    ("packed_world_3_to_2_max_batch_size", _sampler(packing=True, max_batch_size=3), 3, 2),
    ("per_rank", _sampler(budgets=PER_RANK), 2, 2),
    ("per_rank_speeds_accumulate_2", _sampler(budgets=PER_RANK, speeds=PER_RANK_SPEEDS, accumulate_grad_batches=2),
     3, 3),
    ("per_rank_too_long_skip_largest_first", _sampler(LONG, budgets=PER_RANK, too_long="skip", largest_first=True),
     2, 2),
    ("per_rank_world_2_to_3", _sampler(budgets=PER_RANK), 2, 3),
    ("per_rank_world_3_to_2_accumulate_2", _sampler(budgets=PER_RANK, accumulate_grad_batches=2), 3, 2),
    ("int_to_per_rank_world_2_to_3", _sampler(budgets={2: MAX_TOKENS, 3: PER_RANK[3]}), 2, 3),
    ("per_rank_windowed", _sampler(budgets=PER_RANK, plan_window=70), 2, 2),
    ("per_rank_windowed_world_3_to_2", _sampler(budgets=PER_RANK, plan_window=70), 3, 2),
    ("per_rank_packed", _sampler(budgets=PER_RANK, packing=True), 2, 2),
    ("per_rank_packed_speeds", _sampler(budgets=PER_RANK, speeds=PER_RANK_SPEEDS, packing=True), 3, 3),
    ("per_rank_packed_world_2_to_3_no_shuffle", _sampler(budgets=PER_RANK, packing=True, shuffle=False), 2, 3),
    ("per_rank_packed_world_3_to_2", _sampler(budgets=PER_RANK, packing=True), 3, 2),
    # a length warm-up (rows are pieces of documents; its resume on other ranks: tests/sampler/test_warmup_mode.py)
    ("length_warmup", _sampler(max_length_schedule=[[0, 32], [3, 128], [40, 512]]), 2, 2),
    ("length_warmup_packed_accumulate_2",
     _sampler(max_length_schedule=[[0, 64], [20, 512]], packing=True, accumulate_grad_batches=2), 2, 2),
]
EPOCH = 1  # a later epoch, so that the saved epoch is carried over


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _epoch(make, num_replicas, epoch):
    samplers = [make(num_replicas, r) for r in range(num_replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


def _real(batches):
    return [i for b in batches for i, fill in zip(b, b.is_fill) if not fill]


@pytest.mark.parametrize("cut", ["start", "one", "middle", "last"])
@pytest.mark.parametrize(("make", "old", "new"), [pytest.param(*case[1:], id=case[0]) for case in SAMPLERS_TO_TEST])
def test_resume_mid_epoch_continues_the_uninterrupted_run(make, old, new, cut):
    _, full = _epoch(make, old, EPOCH)  # the uninterrupted run, per rank
    n = len(full[0])
    assert n >= 4 and all(len(f) == n for f in full)
    k = {"start": 0, "one": 1, "middle": n // 2, "last": n - 1}[cut]

    # k micro-batches on every rank, then a checkpoint; the state is the same on every rank
    before = [make(old, r) for r in range(old)]
    heads = []
    for s in before:
        s.set_epoch(EPOCH)
        iterator = iter(s)
        heads.append([next(iterator) for _ in range(k)])
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)
    state = _roundtrip(states[0])

    after = [make(new, r) for r in range(new)]
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(EPOCH)  # what Lightning does at the epoch start: changes nothing
    rests = [list(s) for s in after]
    assert len({len(s) for s in after}) == 1 and len({len(r) for r in rests}) == 1  # equal counts on the new ranks

    if new == old:
        for r in range(old):
            assert len(after[r]) == n  # Lightning counts the epoch's batches from its start
            assert heads[r] + rests[r] == full[r]
            assert [(b.is_fill, b.step_real_tokens, b.step_rows) for b in heads[r] + rests[r]] == [
                (b.is_fill, b.step_real_tokens, b.step_rows) for b in full[r]]
            # a length warm-up's rows are pieces: the same pieces too
            assert [getattr(b, "piece_start", None) for b in heads[r] + rests[r]] == [
                getattr(b, "piece_start", None) for b in full[r]]
    else:
        assert len(after[0]) == k + len(rests[0])
        lengths = np.asarray(after[0].lengths)
        for rank, rest in enumerate(rests):
            budget = after[rank].settings.rank_max_tokens(new)[rank]  # this rank's own budget
            for b in rest:
                if after[0].packing:  # one row of whole documents, padded at its tail to the multiple
                    assert -(-int(lengths[list(b)].sum()) // after[0].pad_to_multiple_of) * after[0].pad_to_multiple_of \
                        <= budget
                else:
                    padded = -(-lengths[list(b)] // after[0].pad_to_multiple_of) * after[0].pad_to_multiple_of
                    assert len(b) * int(padded.max()) <= budget
        trained = collections.Counter(_real(h for head in heads for h in head) + _real(b for rest in rests for b in rest))
        expected = collections.Counter(_real(b for f in full for b in f))
        assert set(expected.values()) == {1}
        assert trained == expected  # every sample of the epoch exactly once: nothing lost, nothing repeated

    # then the next epoch is a fresh sampler's on the new ranks
    _, fresh = _epoch(make, new, EPOCH + 1)
    for r, s in enumerate(after):
        s.set_epoch(EPOCH + 1)
        assert list(s) == fresh[r]
