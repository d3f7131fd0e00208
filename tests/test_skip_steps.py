"""skip_steps: on resume, the documents of a range of optimizer steps of the run are left out; every other step trains
what the plan has there, also after a further restart on another number of ranks; bad ranges are refused by name.

Ranks are simulated in process: one sampler per rank, each resumed from the same state."""

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BalancedTextDataModule
from lit_balance.callbacks import LedgerCheck, LedgerMismatchError
from lit_balance.demo import DemoTransformerLM
from lit_balance.errors import InputError
from lit_balance.ledger import check_ledger_header, ledger_columns, ledger_header, read_ledger, write_datamodule_ledger
from skip_ranks import sampler_ranks  # tests/skip_ranks.py
from lit_balance.sampler.state import plan_micro_step


def _ranks(lengths, num_replicas, kwargs, state=None, skip=None):
    """One sampler per rank (:func:`skip_ranks.sampler_ranks`), skipping without replacing."""
    return sampler_ranks(lengths, num_replicas, kwargs, state, skip)


def _steps(samplers):
    """The micro-steps the samplers yield: ``[(micro-batch of rank 0, micro-batch of rank 1, ...), ...]``."""
    per_rank = [[tuple(int(i) for i in mb) for mb in s] for s in samplers]
    assert len({len(p) for p in per_rank}) == 1  # equal counts on every rank
    return [tuple(p[t] for p in per_rank) for t in range(len(per_rank[0]))]


def _docs(steps):
    return sorted(i for step in steps for mb in step for i in mb)


SETUP = dict(lengths=st.lists(st.integers(1, 60), min_size=20, max_size=120), worlds=st.tuples(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)), acc=st.integers(1, 3), packing=st.booleans(),
    window=st.sampled_from([None, 16]), mixture=st.booleans(), data=st.data())


@settings(max_examples=30, deadline=None)
@given(**SETUP)
def test_a_resume_with_skip_steps_trains_the_plan_less_those_steps_also_after_a_second_restart(
        lengths, worlds, acc, packing, window, mixture, data):
    r1, r2, r3 = worlds
    kwargs = dict(max_tokens=64, accumulate_grad_batches=acc, packing=packing, seed=3, drop_last=False,
                  mixture=mixture)
    if window is not None and not mixture:  # a mixture plans whole epochs (it refuses a window)
        kwargs["plan_window"] = window
    first = _ranks(lengths, r1, kwargs)
    epoch1 = _steps(first)
    stop1 = data.draw(st.integers(0, len(epoch1) - 1), label="stop1 (micro-steps trained on the first world)")
    state1 = first[0].state_dict(batches_consumed=stop1)

    plain2 = _ranks(lengths, r2, kwargs, state1)  # the uninterrupted plan on the second world
    planned = _steps(plain2)  # epoch micro-steps stop1 .. end
    end = stop1 + len(planned)
    steps_in_epoch = -(-end // acc)
    resume_step = -(-stop1 // acc)
    if resume_step >= steps_in_epoch:
        return
    a = data.draw(st.integers(resume_step, steps_in_epoch - 1), label="a")
    b = data.draw(st.integers(a + 1, steps_in_epoch), label="b")
    skipped2 = _ranks(lengths, r2, kwargs, state1, skip=[(a, b)])
    trained2 = _steps(skipped2)
    in_range = [stop1 + i in range(a * acc, b * acc) for i in range(len(planned))]
    assert trained2 == [step for step, out in zip(planned, in_range) if not out]
    assert len(skipped2[0]) == stop1 + len(trained2)  # len() counts the micro-steps trained, as Lightning's batch_idx
    assert skipped2[0].start_micro_step == stop1  # the range starts at or after the resume: nothing skipped before

    # nothing else lost, nothing repeated: the epoch's documents are those trained plus those skipped
    left_out = [step for step, out in zip(planned, in_range) if out]
    all_docs = _docs(epoch1[:stop1]) + _docs(trained2) + _docs(left_out)
    assert sorted(set(all_docs)) == sorted(set(_docs(epoch1)))  # the uninterrupted epoch's samples

    # a second restart, on a third world, after some of the skipped run trained: the range stays right
    stop2 = data.draw(st.integers(skipped2[0].start_micro_step, len(skipped2[0])),
                      label="stop2 (trained micro-steps, counted in the epoch)")
    state2 = skipped2[0].state_dict(batches_consumed=stop2)
    # the plan position of stop2 trained micro-steps: past the skipped range once it is reached
    plan_position = stop2 if stop2 < a * acc else min(stop2 + len(range(a * acc, min(b * acc, end))), end)
    reference_state = plain2[0].state_dict(batches_consumed=plan_position)  # the same position, nothing skipped
    if plan_position >= end:
        assert state2["epoch"] == 1 and "skip_micro_steps" not in state2
        return
    assert state2["segments"] == reference_state["segments"]
    assert state2["skip_micro_steps"] == [[a * acc, b * acc]]
    regive = data.draw(st.booleans(), label="the range given again")
    third = _ranks(lengths, r3, kwargs, state2, skip=[(a, b)] if regive else None)
    plain3 = _steps(_ranks(lengths, r3, kwargs, reference_state))
    end3 = plan_position + len(plain3)
    expected3 = [step for i, step in enumerate(plain3) if not a * acc <= plan_position + i < b * acc]
    assert _steps(third) == expected3
    assert len(third[0]) == end3 - sum(1 for t in range(a * acc, min(b * acc, end3)))


def _sampler(**kwargs):
    return BalancedBatchSampler([10] * 32, max_tokens=20, num_replicas=2, rank=0, shuffle=False, **kwargs)


def test_the_skip_is_saved_in_the_state_and_restored_on_the_same_world():
    s = _sampler(accumulate_grad_batches=2)
    s.skip_steps([(1, 3)])  # micro-steps 2 .. 5 of 8
    assert len(s) == 4 and s.skip_micro_steps == ((2, 6),)
    batches = [list(mb) for mb in s]
    state = s.state_dict(batches_consumed=2)  # after step 0: the plan resumes past the skipped steps
    assert state["segments"] == [[2, 6]] and state["skip_micro_steps"] == [[2, 6]]
    fresh = _sampler(accumulate_grad_batches=2)
    fresh.load_state_dict(state)
    assert fresh.start_micro_step == 2 and len(fresh) == 4
    assert [list(mb) for mb in fresh] == batches[2:]


@pytest.mark.parametrize("skip, match", [
    ([(3, 2)], r"skip_steps range \(3, 2\) must have 0 <= a < b.*reversed"),
    ([(2, 2)], r"skip_steps range \(2, 2\).*reversed or empty"),
    ([(-1, 2)], r"skip_steps range \(-1, 2\).*negative"),
    ([(0, 3), (2, 4)], r"skip_steps ranges \(0, 3\) and \(2, 4\) overlap"),
])
def test_bad_ranges_are_refused_naming_skip_steps(skip, match):
    with pytest.raises(ValueError, match=match):
        _sampler().skip_steps(skip)


@pytest.mark.parametrize("skip", ["0-3", [(0, 1.5)], [(True, 3)], [(1, 2, 3)], 5])
def test_ranges_of_the_wrong_type_are_refused_naming_skip_steps(skip):
    with pytest.raises(TypeError, match="skip_steps must be a list of"):
        _sampler().skip_steps(skip)


def test_a_range_in_the_past_of_the_checkpoint_is_refused_before_anything_is_read():
    state = _sampler().state_dict(batches_consumed=5)
    s = _sampler()
    s.load_state_dict(state)
    with pytest.raises(ValueError, match=r"skip_steps range \(4, 6\) starts in the past of the checkpoint: the run "
                                         r"resumes at optimizer step 5") as info:
        s.skip_steps([(4, 6)])
    assert isinstance(info.value, InputError)
    assert s.skip_micro_steps == () and s.start_micro_step == 5  # nothing changed
    s.skip_steps([(5, 6)])  # at the resume step: allowed
    assert s.skip_micro_steps == ((5, 6),)


def test_a_new_range_that_overlaps_a_saved_one_is_refused():
    s = _sampler()
    s.skip_steps([(4, 6)])
    state = s.state_dict(batches_consumed=3)
    resumed = _sampler()
    resumed.load_state_dict(state)
    resumed.skip_steps([(4, 6)])  # the saved range, given again
    with pytest.raises(ValueError, match=r"skip_steps ranges overlap: optimizer steps \[4, 6\) and \[5, 7\) of the "
                                         r"run, one given or saved in the checkpoint"):
        resumed.skip_steps([(5, 7)])
    assert resumed.skip_micro_steps == ((4, 6),)


def test_the_micro_step_totals_skip_the_skipped_steps():
    s = _sampler(accumulate_grad_batches=2)
    tokens, _ = s.micro_step_totals()
    s.skip_steps([(1, 2)])
    skipped, _ = s.micro_step_totals()
    assert skipped.tolist() == np.delete(tokens, [2, 3]).tolist() and len(skipped) == len(s)


@settings(max_examples=20, deadline=None)
@given(worlds=st.tuples(st.integers(1, 3), st.integers(1, 4)), acc=st.integers(1, 3), packing=st.booleans(),
       data=st.data())
def test_the_ledger_of_a_resume_with_skip_steps_lists_what_trains_and_leaves_the_skipped_steps_out(
        worlds, acc, packing, data):
    lengths = [1 + (i * 13) % 50 for i in range(90)]
    kwargs = dict(max_tokens=64, accumulate_grad_batches=acc, packing=packing, seed=1)
    r1, r2 = worlds
    first = _ranks(lengths, r1, kwargs)
    stop = data.draw(st.integers(0, len(first[0]) - 1), label="stop")
    state = first[0].state_dict(batches_consumed=stop)
    plain = _ranks(lengths, r2, kwargs, state)
    end = plain[0].first_plan_micro_step + sum(p.num_micro_steps for p in plain[0].plan_parts())
    resume, last = -(-stop // acc), -(-end // acc)
    if resume >= last:
        return
    a = data.draw(st.integers(resume, last - 1), label="a")
    b = data.draw(st.integers(a + 1, last), label="b")
    skipped = _ranks(lengths, r2, kwargs, state, skip=[(a, b)])
    columns, _ = ledger_columns(skipped[0], first_optimizer_step=7)
    start = skipped[0].start_micro_step
    expected = []
    for i, step in enumerate(_steps(skipped)):
        expected += [(start + i, rank, int(x)) for rank, mb in enumerate(step) for x in mb]
    rows = list(zip(columns["micro_step"].tolist(), columns["rank"].tolist(), columns["sample"].tolist()))
    assert [r for r in rows if r[0] >= start] == expected
    before = ledger_columns(plain[0])[0]  # on the same world the ledger starts at the epoch's start
    earlier = zip(before["micro_step"].tolist(), before["rank"].tolist(), before["sample"].tolist())
    assert [r for r in rows if r[0] < start] == [r for r in earlier if r[0] < start]
    steps = set(columns["optimizer_step"].tolist())
    assert not steps & set(range(7 + a, 7 + b))  # the skipped steps are absent, the numbering keeps them
    plain_steps = set(ledger_columns(plain[0], first_optimizer_step=7)[0]["optimizer_step"].tolist())
    assert steps == plain_steps - set(range(7 + a, 7 + b))
    header = ledger_header(skipped[0], first_optimizer_step=7)
    assert header["skip_steps"] == [[7 + a, 7 + b]] and header["micro_steps"] == len(skipped[0])
    with pytest.raises(ValueError, match=r"skip_micro_steps: ledger \[\], run \[\["):
        check_ledger_header(ledger_header(plain[0]), ledger_header(skipped[0]))


class _Received(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((batch_idx, batch["indices"].tolist()))


class _SaveAt(L.Callback):
    """Saves a checkpoint after micro-batch ``batch_idx`` (the end of an optimizer step) and stops the fit."""

    def __init__(self, path, batch_idx):
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _fit(tmp_path, dm, callbacks, max_steps=-1, ckpt_path=None, max_epochs=1):
    L.seed_everything(0, verbose=False)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=2, callbacks=callbacks,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("packing, num_workers", [(False, 0), (True, 0), (False, 2)])
def test_a_fit_resumed_with_skip_steps_trains_the_plan_less_those_steps_as_its_ledger_says(tmp_path, packing,
                                                                                         num_workers):
    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(80)]
    kwargs = dict(max_tokens=64, val_fraction=0.1, packing=packing, cache_dir=tmp_path / "cache", seed=2,
                  num_workers=num_workers)
    whole = _Received()
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [whole])
    ckpt = tmp_path / "mid.ckpt"
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [_SaveAt(ckpt, 3)])  # after optimizer steps 0 and 1
    dm = BalancedTextDataModule(texts, skip_steps=[(3, 5)], **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    state = torch.load(ckpt, weights_only=True)["BalancedTextDataModule"]["train_sampler"]
    ledger = tmp_path / "rest.parquet"
    header = write_datamodule_ledger(ledger, dm, num_replicas=1, accumulate_grad_batches=2, sampler_state=state)
    assert header["skip_steps"] == [[3, 5]]
    resumed = _Received()
    trainer = _fit(tmp_path, BalancedTextDataModule(texts, skip_steps=[(3, 5)], **kwargs),
                   [resumed, LedgerCheck(ledger)], ckpt_path=ckpt)
    plan = [indices for _, indices in whole.batches]
    assert [indices for _, indices in resumed.batches] == plan[4:6] + plan[10:]  # step 2, then steps 5 on
    assert [i for i, _ in resumed.batches] == list(range(4, 4 + len(plan) - 8))  # batch_idx counts what trains
    assert trainer.global_step == len(plan) // 2 - 2 + (len(plan) % 2)  # the two skipped steps are not counted
    table, _ = read_ledger(ledger)
    assert not set(table.column("optimizer_step").to_numpy().tolist()) & {3, 4}

    # a document swapped at the first step after the range is named by the ledger's step number (5), not Lightning's
    micro, sample = table.column("micro_step").to_numpy(), table.column("sample").to_numpy()
    step = table.column("optimizer_step").to_numpy()
    planned = int(sample[step == 5][0])
    swapped = _Swapping(texts, skip_steps=[(3, 5)], **kwargs)
    swapped.swap = (planned, int(sample[step == 2][0]))
    first = int(micro[step == 5][0])
    with pytest.raises(LedgerMismatchError, match=rf"at optimizer step 5 \(epoch 0, micro-step {first}, "
                                                  rf"micro-batch 0 of the step\), rank 0, row 0: the rank received "
                                                  rf"sample {swapped.swap[1]} where the ledger has sample {planned}"):
        _fit(tmp_path, swapped, [LedgerCheck(ledger)], ckpt_path=ckpt)


class _Swapping(BalancedTextDataModule):
    """Its training dataset hands one planned sample's item in place of another (a loader bug)."""

    swap = None

    def setup(self, stage=None):
        super().setup(stage)
        if self.swap is not None:
            dataset, (planned, delivered) = self.train_dataset, self.swap
            item = dataset._item
            dataset._item = lambda i, is_fill=False: item(delivered if i == planned else i, is_fill)


def test_a_datamodule_refuses_a_range_in_the_past_of_the_checkpoint_before_reading_a_batch(tmp_path):
    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(80)]
    kwargs = dict(max_tokens=64, val_fraction=0.1, cache_dir=tmp_path / "cache", seed=2)
    ckpt = tmp_path / "mid.ckpt"
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [_SaveAt(ckpt, 5)])  # after optimizer steps 0 to 2
    received = _Received()
    with pytest.raises(ValueError, match=r"skip_steps range \(1, 4\) starts in the past of the checkpoint: the run "
                                         r"resumes at optimizer step 3"):
        _fit(tmp_path, BalancedTextDataModule(texts, skip_steps=[(1, 4)], **kwargs), [received], ckpt_path=ckpt)
    assert received.batches == []


@pytest.mark.parametrize("skip, error", [([(2, 1)], ValueError), ([(0, 2), (1, 3)], ValueError), ("1:3", TypeError),
                                         ([(-2, 1)], ValueError)])
def test_a_datamodule_refuses_bad_skip_steps_at_construction(tmp_path, skip, error):
    with pytest.raises(error, match="skip_steps"):
        BalancedTextDataModule(["a b c"] * 4, max_tokens=64, skip_steps=skip, cache_dir=tmp_path)


def _run_epochs(samplers, epochs, acc):
    """Iterate ``samplers`` (one per rank) through ``epochs`` (the first continues where they stand) and return
    ``[(optimizer step of the run, (micro-batch of rank 0, ...)), ...]`` in running order, numbered as the ledger does
    (the plan's steps, skipped ones counted)."""
    out = []
    for i, epoch in enumerate(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        first, skips = samplers[0].first_optimizer_step, samplers[0].skip_micro_steps
        start = samplers[0].start_micro_step if i == 0 else 0
        steps = _steps(samplers)
        out += [(first + plan_micro_step(skips, start + t) // acc, step) for t, step in enumerate(steps)]
    return out


@settings(max_examples=25, deadline=None)
@given(**SETUP)
def test_ranges_in_any_epoch_and_across_an_epochs_end_leave_out_exactly_those_steps_also_after_a_second_restart(
        lengths, worlds, acc, packing, window, mixture, data):
    r1, r2, r3 = worlds
    kwargs = dict(max_tokens=64, accumulate_grad_batches=acc, packing=packing, seed=3, drop_last=False,
                  mixture=mixture)
    if window is not None and not mixture:
        kwargs["plan_window"] = window
    first = _ranks(lengths, r1, kwargs)
    stop1 = data.draw(st.integers(0, len(first[0]) - 1), label="stop1")
    state1 = first[0].state_dict(batches_consumed=stop1)
    plain = _run_epochs(_ranks(lengths, r2, kwargs, state1), [0, 1, 2], acc)  # the run without skips
    resume = -(-stop1 // acc)
    last = plain[-1][0] + 1
    assert [s for s, _ in plain] == sorted(s for s, _ in plain) and plain[0][0] >= resume - 1
    cuts = sorted(data.draw(st.lists(st.integers(resume, last + 2), min_size=2, max_size=6, unique=True),
                            label="range ends"))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
    skipped = _ranks(lengths, r2, kwargs, state1, skip=ranges)
    trained = _run_epochs(skipped, [0, 1, 2], acc)
    out = lambda step: any(a <= step < b for a, b in ranges)  # noqa: E731
    assert trained == [(s, step) for s, step in plain if not out(s)]

    # a second restart inside epoch 1 on a third world, the ranges not given again: they still hold
    again = _ranks(lengths, r2, kwargs, state1, skip=ranges)
    for s in again:
        s.set_epoch(1)
    trained1 = len(again[0])
    stop2 = data.draw(st.integers(0, trained1), label="stop2 (trained micro-steps of epoch 1)")
    state2 = again[0].state_dict(batches_consumed=stop2)
    position = min(plan_micro_step(again[0].skip_micro_steps, stop2),
                   again[0].first_plan_micro_step + sum(p.num_micro_steps for p in again[0].plan_parts()))
    reference = _ranks(lengths, r2, kwargs, state1)  # the run without skips, at the same plan position
    for s in reference:
        s.set_epoch(1)
    state_ref = reference[0].state_dict(batches_consumed=position)
    epochs = [state2["epoch"], *range(state2["epoch"] + 1, 3)]
    expected = [(s, step) for s, step in _run_epochs(_ranks(lengths, r3, kwargs, state_ref), epochs, acc)
                if not out(s)]
    assert _run_epochs(_ranks(lengths, r3, kwargs, state2), epochs, acc) == expected


def test_the_sampler_counts_the_runs_optimizer_steps_over_epochs_and_saves_them():
    s = _sampler(accumulate_grad_batches=3)  # 8 micro-steps an epoch on 2 ranks: 3 optimizer steps (the last short)
    assert s.first_optimizer_step == 0
    s.set_epoch(1)
    assert s.first_optimizer_step == 3
    s.set_epoch(3)
    assert s.first_optimizer_step == 9
    state = s.state_dict(batches_consumed=len(s))  # the end of epoch 3: the start of epoch 4
    assert state["epoch"] == 4 and state["first_optimizer_step"] == 12
    s.set_epoch(0)
    assert s.first_optimizer_step == 0
    fresh = _sampler(accumulate_grad_batches=3)
    fresh.load_state_dict(state)
    assert fresh.first_optimizer_step == 12
    fresh.skip_steps([(13, 14)])  # step 1 of epoch 4
    assert fresh.skip_micro_steps == ((3, 6),)


def test_a_range_across_an_epochs_end_skips_the_end_of_one_and_the_start_of_the_next():
    s = _sampler(accumulate_grad_batches=2)  # 4 optimizer steps an epoch
    batches = [list(mb) for mb in s]
    s.skip_steps([(3, 5)])  # the last step of epoch 0, the first of epoch 1
    assert [list(mb) for mb in s] == batches[:6]
    s.set_epoch(1)
    assert s.skip_micro_steps == ((0, 2),) and [list(mb) for mb in s] == batches[2:]
    s.set_epoch(2)
    assert s.skip_micro_steps == () and len(s) == 8


def test_a_state_saved_without_the_runs_steps_in_a_later_epoch_needs_first_optimizer_step():
    s = _sampler()
    s.set_epoch(1)
    state = s.state_dict(batches_consumed=2)
    assert state["first_optimizer_step"] == 8
    del state["first_optimizer_step"]  # as a checkpoint saved before the sampler counted them
    fresh = _sampler()
    fresh.load_state_dict(state)
    assert fresh.first_optimizer_step is None
    with pytest.raises(ValueError, match=r"does not know how many ran before epoch 1.*pass first_optimizer_step"):
        fresh.skip_steps([(10, 11)])
    fresh.skip_steps([(10, 11)], first_optimizer_step=8)
    assert fresh.skip_micro_steps == ((2, 3),)


class _ReceivedEpochs(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch["indices"].tolist()))


@pytest.mark.parametrize("resume", [False, True])
def test_a_fit_skips_ranges_in_a_later_epoch_and_across_an_epochs_end_as_the_ledgers_of_those_epochs_say(
        tmp_path, resume):
    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(80)]
    kwargs = dict(max_tokens=64, val_fraction=0.1, cache_dir=tmp_path / "cache", seed=2, shuffle=True)
    whole = _ReceivedEpochs()
    _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [whole], max_epochs=2)
    per_epoch = [[b for e, b in whole.batches if e == epoch] for epoch in (0, 1)]
    steps0 = -(-len(per_epoch[0]) // 2)  # optimizer steps of epoch 0 (accumulate_grad_batches=2)
    assert len(per_epoch[1]) > 8 and steps0 > 3
    skip = [(steps0 - 1, steps0 + 1), (steps0 + 3, steps0 + 4)]  # across the epoch's end; inside epoch 1
    ckpt = tmp_path / "mid.ckpt"
    if resume:
        _fit(tmp_path, BalancedTextDataModule(texts, **kwargs), [_SaveAt(ckpt, 1)], max_epochs=2)  # after step 0
    record = tmp_path / "received"
    skipped = _ReceivedEpochs()
    dm = BalancedTextDataModule(texts, skip_steps=skip, **kwargs)
    _fit(tmp_path, dm, [skipped, LedgerCheck(record=record)], max_epochs=2, ckpt_path=ckpt if resume else None)
    n0 = len(per_epoch[0])
    keep0 = [b for t, b in enumerate(per_epoch[0]) if not steps0 - 1 <= t // 2 < steps0]
    keep1 = [b for t, b in enumerate(per_epoch[1]) if t // 2 not in (0, 3)]
    start = 2 if resume else 0
    assert [b for e, b in skipped.batches if e == 0] == keep0[start:] and n0 > len(keep0)
    assert [b for e, b in skipped.batches if e == 1] == keep1

    # the ledger of each epoch, written before training, names the run's steps and leaves the skipped ones out
    from lit_balance.lightning.ledger_record import check_record
    plan = BalancedTextDataModule(texts, skip_steps=skip, **kwargs)
    plan.prepare_data()
    plan.setup("fit")
    for epoch in (0, 1):
        ledger = tmp_path / f"epoch{epoch}.parquet"
        header = write_datamodule_ledger(ledger, plan, num_replicas=1, accumulate_grad_batches=2, epoch=epoch)
        assert header["first_optimizer_step"] == (0 if epoch == 0 else steps0)
        table, _ = read_ledger(ledger)
        steps = set(table.column("optimizer_step").to_pylist())
        assert not steps & {steps0 - 1, steps0, steps0 + 3}
        result = check_record([record], ledger)
        assert result.ok and result.micro_batches == len(keep0 if epoch == 0 else keep1) - (start if epoch == 0
                                                                                            else 0)
