"""skip_steps with replace=True: on resume, the documents of a range of optimizer steps of the run are taken out and
the rest of the epoch is planned again over what is left, so the next documents take their places: the skipped
documents never train, every other document trains once, the run's steps have no gap, a mixture keeps its shares, and
the range stays right after a further restart on another number of ranks.

Ranks are simulated in process: one sampler per rank, each resumed from the same state."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BalancedTextDataModule
from lit_balance.ledger import ledger_columns, ledger_header
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.sampler.mixture import MixtureBatchSampler
from skip_ranks import sampler_ranks  # tests/skip_ranks.py

MAX_TOKENS = 64


def _ranks(lengths, num_replicas, kwargs, state=None, skip=None, replace=True):
    """One sampler per rank (:func:`skip_ranks.sampler_ranks`), replacing the skipped steps' documents."""
    return sampler_ranks(lengths, num_replicas, kwargs, state, skip, replace)


def _steps(samplers, limit=None):
    """``[(micro-batch of rank 0, ...), ...]`` the samplers yield (at most ``limit`` micro-steps), each micro-batch a
    tuple of ``(index, is_fill)``; checks the budget and equal counts."""
    per_rank = []
    for s in samplers:
        lengths = np.asarray(s.lengths)
        mine = []
        for mb in s:
            if limit is not None and len(mine) == limit:
                break
            rows = lengths[list(mb)]
            used = int(rows.sum()) if s.settings.packing else len(mb) * int(rows.max())
            assert used <= MAX_TOKENS  # the budget
            mine.append(tuple(zip((int(i) for i in mb), (bool(f) for f in mb.is_fill))))
        per_rank.append(mine)
    assert len({len(p) for p in per_rank}) == 1  # equal counts on every rank
    return [tuple(p[t] for p in per_rank) for t in range(len(per_rank[0]))]


def _real(steps):
    """The documents (sample indices) of real rows (fill rows excluded), in order."""
    return [i for step in steps for mb in step for i, fill in mb if not fill]


def _check_shares(sampler, steps, acc):
    """Each optimizer step (``acc`` micro-steps of every rank) holds each component within one document of the
    shares of the steps' tokens (the re-planned rest's realized shares)."""
    lengths = np.asarray(sampler.lengths, dtype=np.int64)
    real = np.asarray(_real(steps), dtype=np.int64)
    total = np.zeros(2)
    np.add.at(total, sampler.component_of(real), lengths[real])
    shares = total / max(total.sum(), 1)
    longest = int(lengths.max())
    for g in range(0, len(steps), acc):
        real = np.asarray(_real(steps[g:g + acc]), dtype=np.int64)
        units = np.zeros(2)
        np.add.at(units, sampler.component_of(real), lengths[real])
        assert (np.abs(units - shares * units.sum()) <= longest + 1e-6).all(), (g, units)


SETUP = dict(lengths=st.lists(st.integers(1, 60), min_size=20, max_size=120), worlds=st.tuples(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)), acc=st.integers(1, 3), packing=st.booleans(),
    mixture=st.booleans(), data=st.data())


@settings(max_examples=25, deadline=None)
@given(**SETUP)
def test_replaced_steps_never_train_every_other_document_trains_once_with_no_gap(
        lengths, worlds, acc, packing, mixture, data):
    r1, r2, r3 = worlds
    kwargs = dict(max_tokens=MAX_TOKENS, accumulate_grad_batches=acc, packing=packing, seed=3, drop_last=False,
                  mixture=mixture)
    epoch1 = _steps(_ranks(lengths, r1, kwargs))
    stop1 = data.draw(st.integers(0, len(epoch1) - 1), label="stop1 (micro-steps trained on the first world)")
    first = _ranks(lengths, r1, kwargs)
    trained1 = _steps(first, limit=stop1)
    state1 = first[0].state_dict(batches_consumed=stop1)

    plain2 = _steps(_ranks(lengths, r2, kwargs, state1))  # the plan without the skip on the second world
    end = stop1 + len(plain2)
    resume_step, steps_in_epoch = -(-stop1 // acc), -(-end // acc)
    if resume_step >= steps_in_epoch:
        return
    a = data.draw(st.integers(resume_step, steps_in_epoch - 1), label="a")
    b = data.draw(st.integers(a + 1, steps_in_epoch), label="b")
    replaced2 = _ranks(lengths, r2, kwargs, state1, skip=[(a, b)])
    length2 = len(replaced2[0])
    # a second restart, on a third world: before the range starts, or after it was replaced
    stop2 = data.draw(st.integers(stop1, length2), label="stop2 (micro-steps trained, counted in the epoch)")
    trained2 = _steps(replaced2, limit=stop2 - stop1)
    if stop2 > a * acc or stop2 == length2:  # the range was reached on the second world: its plan's steps a .. b - 1
        taken = plain2[a * acc - stop1:b * acc - stop1]
    else:  # reached on the third: the documents its plan (nothing replaced) has there
        reference = _ranks(lengths, r2, kwargs, state1)
        _steps(reference, limit=stop2 - stop1)
        plain3 = _steps(_ranks(lengths, r3, kwargs, reference[0].state_dict(batches_consumed=stop2)))
        taken = plain3[a * acc - stop2:b * acc - stop2]
    state2 = replaced2[0].state_dict(batches_consumed=stop2)
    assert state2.get("skip_replace", False) or state2["epoch"] == 1  # saved, until the epoch is done
    regive = data.draw(st.booleans(), label="the range given again")
    if state2["epoch"] == 0:
        third = _ranks(lengths, r3, kwargs, state2, skip=[(a, b)] if regive else None)
        length3 = len(third[0])
        trained3 = _steps(third)
        assert length3 == stop2 + len(trained3)  # len() counts the whole epoch as it runs: Lightning's batch_idx
    else:
        trained3 = []
    run = trained1 + trained2 + trained3

    # the skipped documents never train; every other document of the epoch trains once
    whole = Counter(_real(epoch1))
    gone = Counter(_real(taken))
    assert set(gone) <= set(whole)
    got = Counter(_real(run))
    assert max(got.values(), default=1) == 1
    assert set(got) == set(whole) - set(gone)
    # no gap: step a trains the next documents (the re-planned rest), unless nothing is left
    if set(whole) - set(gone) - set(_real(run[:a * acc])):
        assert _real(run[a * acc:(a + 1) * acc])
    if state2["epoch"] == 0:
        assert len(run) == len(third[0])
    if mixture:  # each step of the re-planned rest keeps the shares
        _check_shares(first[0], run[a * acc:], acc)


def test_replace_on_one_world_takes_out_the_range_and_plans_the_rest_again():
    s = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
    s.skip_steps([(1, 3)], replace=True)  # steps 1 and 2 (samples 4 .. 11) are taken out; the rest is one step
    assert len(s) == 2 and [list(mb) for mb in s] == [[0, 1], [12, 13]]
    assert s.skip_micro_steps == () and s.replaced_micro_steps == ((1, 3),)
    state = s.state_dict(batches_consumed=1)
    assert state["skip_steps"] == [[1, 3]] and state["skip_replace"] is True
    fresh = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
    fresh.load_state_dict(state)  # the range is saved: it holds without being given again
    assert len(fresh) == 2 and [list(mb) for mb in fresh] == [[12, 13]]


def test_the_ledger_numbers_the_replaced_rest_without_a_gap_and_names_the_range():
    s = BalancedBatchSampler([10] * 32, max_tokens=20, num_replicas=2, rank=0, shuffle=False,
                             accumulate_grad_batches=2)
    s.skip_steps([(1, 2)], replace=True)
    header = ledger_header(s)
    assert header["replaced_steps"] == [[1, 2]] and header["skip_micro_steps"] == []
    columns, _ = ledger_columns(s)
    steps = np.unique(columns["optimizer_step"])
    assert steps.tolist() == list(range(len(s) // 2))  # no gap
    taken = set(range(8, 16))  # the plan's step 1: micro-steps 2 and 3 of both ranks, samples 8 .. 15
    assert not taken & set(columns["sample"].tolist())
    assert set(columns["sample"].tolist()) == set(range(32)) - taken


@pytest.mark.parametrize("call, match", [
    (lambda s: s.skip_steps([(1, 2)], replace="yes"), r"replace must be True or False, got 'yes'"),
    (lambda s: s.skip_steps([(1, 9)], replace=True), r"replace=True runs past the end of epoch 0.*replace=False"),
])
def test_bad_replace_input_is_refused_by_name(call, match):
    s = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
    with pytest.raises((TypeError, ValueError), match=match):
        call(s)
    assert len(s) == 4 and s.replaced_micro_steps == ()  # a refused range leaves the sampler as it was


def test_replace_refuses_an_epoch_planned_in_windows_naming_both_settings():
    s = BalancedBatchSampler([10] * 64, max_tokens=20, num_replicas=2, rank=0, plan_window=16)
    with pytest.raises(ValueError, match=r"replace=True.*plan_window=16"):
        s.skip_steps([(1, 2)], replace=True)


def test_a_saved_range_of_the_other_replace_is_refused():
    s = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
    s.skip_steps([(2, 3)])
    state = s.state_dict(batches_consumed=0)
    fresh = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match=r"replace=True, but the checkpoint's ranges \[\(2, 3\)\] were saved with "
                                         r"replace=False"):
        fresh.skip_steps([(2, 3)], replace=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(replace=True), r"replace=True replaces the documents of skip_steps, but skip_steps is None"),
    (dict(replace=True, skip_steps=[]), r"skip_steps is \[\]"),
    (dict(replace=1, skip_steps=[(1, 2)]), r"replace must be True or False.*got 1 of type int"),
])
def test_the_datamodule_refuses_replace_without_skip_steps(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        BalancedTextDataModule("synthetic:tiny", max_tokens=256, **kwargs)


@pytest.mark.parametrize("packing", [False, True])
def test_a_fit_resumed_with_replace_trains_the_replanned_rest_as_its_ledger_says(tmp_path, packing):
    from tests.test_skip_steps import _fit, _Received, _SaveAt
    from lit_balance.callbacks import LedgerCheck
    from lit_balance.ledger import read_ledger, write_datamodule_ledger
    import torch

    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(80)]
    kwargs = dict(max_tokens=64, val_fraction=0.1, packing=packing, cache_dir=tmp_path / "cache", seed=2)
    whole = _Received()
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [whole])
    plan = [indices for _, indices in whole.batches]
    ckpt = tmp_path / "mid.ckpt"
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [_SaveAt(ckpt, 3)])  # after optimizer steps 0 and 1
    dm = BalancedTextDataModule(texts, skip_steps=[(3, 5)], replace=True, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    state = torch.load(ckpt, weights_only=True)["BalancedTextDataModule"]["train_sampler"]
    ledger = tmp_path / "rest.parquet"
    header = write_datamodule_ledger(ledger, dm, num_replicas=1, accumulate_grad_batches=2, sampler_state=state)
    assert header["replaced_steps"] == [[3, 5]] and header["skip_steps"] == []
    resumed = _Received()
    trainer = _fit(tmp_path, BalancedTextDataModule(texts, skip_steps=[(3, 5)], replace=True, **kwargs),
                   [resumed, LedgerCheck(ledger)], ckpt_path=ckpt)
    got = [indices for _, indices in resumed.batches]
    assert got[:2] == plan[4:6]  # step 2 as planned
    taken = {i for mb in plan[6:10] for i in mb}  # the plan's steps 3 and 4
    before = {i for mb in plan[:6] for i in mb}
    after = [i for mb in got[2:] for i in mb]
    assert after and not taken & set(after) and len(after) == len(set(after))
    assert set(after) == {i for mb in plan for i in mb} - taken - before  # every other document once
    assert [i for i, _ in resumed.batches] == list(range(4, 4 + len(got)))  # no gap in batch_idx
    table, _ = read_ledger(ledger)
    steps = sorted(set(table.column("optimizer_step").to_numpy().tolist()))
    assert steps == list(range(len(steps))) and trainer.global_step == steps[-1] + 1  # no gap


def test_replace_refuses_a_length_warm_up_and_a_weights_schedule_naming_both_settings():
    warm = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False,
                                max_length_schedule=[[0, 5], [2, 10]])
    with pytest.raises(ValueError, match=r"replace=True.*max_length_schedule"):
        warm.skip_steps([(1, 2)], replace=True)
    warm.skip_steps([(1, 2)])  # without replace the warm-up's steps are skipped as any
    mixed = MixtureBatchSampler([10] * 16, [8, 8], MixtureSettings(("a", "b"), (1, 1)), max_tokens=20,
                                num_replicas=2, rank=0, weights_schedule=[[0, {"a": 1, "b": 1}], [2, {"a": 1, "b": 3}]])
    with pytest.raises(ValueError, match=r"replace=True.*weights_schedule"):
        mixed.skip_steps([(1, 2)], replace=True)
    with pytest.raises(ValueError, match=r"replace=True.*max_length_schedule"):
        BalancedTextDataModule(["one two three"] * 20, max_tokens=256, max_length=None, skip_steps=[(1, 2)],
                               replace=True, max_length_schedule=[[0, 64], [4, 128]])
