"""BalancedBatchSampler(max_length_schedule=...) and PieceDataset: every rank's collated micro-batches hold every token
of the data once, each piece a document of its own (position ids, cu_seq_lens, labels), and a resume on another world
size goes on."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lit_balance import BalancedBatchSampler, BatchingSettings, Schedule, TokenDataset
from lit_balance.data.collate import IGNORE_INDEX, collator_for
from lit_balance.data.pieces import PieceDataset
from lit_balance.plan.types import PieceMicroBatch


def _corpus(lengths, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(1, 1000, size=int(offsets[-1]))
    label_ids = np.where(rng.random(tokens.shape[0]) < 0.3, IGNORE_INDEX, tokens) if labels else None
    return TokenDataset(tokens, offsets, np.arange(len(lengths)), labels=label_ids), tokens, offsets


def _schedule(values, every):
    """A piecewise-constant schedule: ``values[i]`` from optimizer step ``i * every`` on."""
    return Schedule([(i * every, v) for i, v in enumerate(values)])


def _sampler(lengths, s, schedule, num_replicas, rank):
    return BalancedBatchSampler(lengths, settings=s, num_replicas=num_replicas, rank=rank,
                                max_length_schedule=schedule)


def _limit(schedule, step):
    return int(schedule.value_at(step))


def _run(samplers, dataset, collate, covered, stop=None):
    """Collate every rank's micro-batches (up to ``stop`` per rank); mark trained tokens; return the batches."""
    batches = []
    for sampler in samplers:
        mine = []
        for i, mb in enumerate(sampler):
            if stop is not None and i == stop:
                break
            assert isinstance(mb, PieceMicroBatch)
            mine.append(collate(dataset[mb]))
            for doc, start, n, fill in zip(mb, mb.piece_start, mb.piece_length, mb.is_fill):
                if not fill:
                    covered[doc, start:start + n] += 1
        batches.append(mine)
    return batches


@settings(deadline=None, max_examples=40)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=40), num_replicas=st.integers(1, 4),
       packing=st.booleans(), acc=st.integers(1, 3), values=st.lists(st.integers(8, 64), min_size=1, max_size=4),
       labels=st.booleans())
def test_collated_batches_train_every_token_once_each_piece_a_document(lengths, num_replicas, packing, acc, values,
                                                                       labels):
    lengths = np.array(lengths)
    dataset, tokens, offsets = _corpus(lengths, labels=labels)
    s = BatchingSettings(max_tokens=64, packing=packing, accumulate_grad_batches=acc)
    schedule = _schedule(values, 2)
    samplers = [_sampler(lengths, s, schedule, num_replicas, r) for r in range(num_replicas)]
    assert len({len(x) for x in samplers}) == 1  # equal counts
    pieces = PieceDataset(dataset)
    collate = collator_for(s, pad_token_id=0)
    covered = np.zeros((lengths.size, int(lengths.max())), dtype=np.int64)
    batches = _run(samplers, pieces, collate, covered)
    for d, n in enumerate(lengths.tolist()):
        assert (covered[d, :n] == 1).all() and (covered[d, n:] == 0).all()
    plan, (_, _, piece_length) = samplers[0].plan(), samplers[0].plan_pieces()
    real = 0
    for r, mine in enumerate(batches):
        assert len(mine) == len(samplers[r])
        for s_idx, batch in enumerate(mine):
            limit = _limit(schedule, s_idx // acc)
            assert batch["num_padded_tokens"] <= 64  # the budget
            assert batch["step_real_tokens"] == int(plan.real_tokens_per_batch(piece_length)[
                plan.assignment[(s_idx // acc) * acc:(s_idx // acc + 1) * acc].reshape(-1)].sum())
            fill = batch["is_fill"]
            if packing:
                cu = batch["cu_seq_lens_q"].tolist()
                seg = np.diff(cu)
                assert max(seg) <= limit
                pos = batch["position_ids"][0]
                for a, n in zip(cu[:-1], seg.tolist()):
                    assert pos[a:a + n].tolist() == list(range(n))  # each piece its own position ids from 0
                    assert int(batch["labels"][0, a]) == IGNORE_INDEX  # no target across a cut
                real += sum(int(n) for n, f in zip(seg.tolist(), fill.tolist()) if not f)
            else:
                rows = batch["attention_mask"].sum(1)
                assert int(rows.max()) <= limit
                real += int(rows[~fill].sum())
    assert real == int(lengths.sum())  # sum of trained tokens = data tokens


def test_pieces_read_the_document_tokens_and_labels_in_order():
    lengths = np.array([10, 3])
    dataset, tokens, offsets = _corpus(lengths, labels=True)
    ds = PieceDataset(dataset)
    items = ds[PieceMicroBatch([0, 0, 0, 1], piece_start=[0, 4, 8, 0], piece_length=[4, 4, 2, 3],
                               step_real_tokens=13, step_rows=4)]
    assert np.concatenate([it["input_ids"] for it in items[:3]]).tolist() == tokens[:10].tolist()
    assert np.concatenate([it["labels"] for it in items[:3]]).tolist() == \
        dataset[0]["labels"].tolist()
    assert [it["piece_start"] for it in items] == [0, 4, 8, 0]
    assert all(it["step_real_tokens"] == 13 and it["step_rows"] == 4 for it in items)
    assert ds[1]["input_ids"].tolist() == tokens[10:].tolist()  # a plain index: the whole document
    with pytest.raises(ValueError, match=r"piece \[8, 12\) lies outside document 0 of 10 tokens"):
        ds[PieceMicroBatch([0], piece_start=[8], piece_length=[4])]


def test_a_truncating_dataset_is_refused():
    dataset, _, _ = _corpus(np.array([10, 3]))
    truncated = TokenDataset(dataset.token_ids, dataset.offsets, np.arange(2), max_length=4)
    with pytest.raises(ValueError, match="max_length=4.*max_length=None"):
        PieceDataset(truncated)


def test_piece_micro_batches_survive_dataloader_workers():
    lengths = np.array([90, 30, 5, 64, 7])
    dataset, tokens, offsets = _corpus(lengths)
    s = BatchingSettings(max_tokens=64, packing=True)
    sampler = _sampler(lengths, s, [[0, 16], [1, 32]], 1, 0)
    mb = next(iter(sampler))
    assert pickle.loads(pickle.dumps(mb)).piece_length == mb.piece_length
    loader = DataLoader(PieceDataset(dataset), sampler=sampler, batch_size=None, num_workers=1,
                        collate_fn=collator_for(s, pad_token_id=0))
    assert sum(int(b["num_real_tokens"]) for b in loader) == int(lengths.sum())


@pytest.mark.parametrize("worlds", [(2, 3, 2), (4, 3), (3, 1)])
@pytest.mark.parametrize("packing", [False, True])
def test_resume_mid_stage_on_another_world_size(worlds, packing):
    """A run stopped inside a stage (2 -> 3 -> 2 ranks) trains the rest of its tokens once, the schedule continuing
    at the optimizer step reached."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, size=120)
    dataset, _, _ = _corpus(lengths)
    acc = 2
    s = BatchingSettings(max_tokens=128, packing=packing, accumulate_grad_batches=acc)
    schedule = _schedule([16, 32, 64, 128], 4)
    pieces, collate = PieceDataset(dataset), collator_for(s, pad_token_id=0)
    covered = np.zeros((lengths.size, int(lengths.max())), dtype=np.int64)
    state, step = None, 0
    for i, world in enumerate(worlds):
        samplers = [_sampler(lengths, s, schedule, world, r) for r in range(world)]
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
            assert samplers[0].state_dict()["first_optimizer_step"] == 0  # the epoch's start, saved
            assert samplers[0].first_micro_step == step * acc  # the schedule goes on at the step reached
        last = i == len(worlds) - 1
        stop = None if last else acc * 3  # three optimizer steps, inside the 2nd stage
        batches = _run(samplers, pieces, collate, covered, stop)
        for mine in batches:
            for j, batch in enumerate(mine):
                width = batch["cu_seq_lens_q"].diff().max() if packing else batch["attention_mask"].sum(1).max()
                assert int(width) <= _limit(schedule, step + j // acc)
        if not last:
            states = [sampler.state_dict(sampler.start_micro_step + stop) for sampler in samplers]
            assert all(st_ == states[0] for st_ in states)  # the same on every rank
            state = states[0]
            step += stop // acc
    for d, n in enumerate(lengths.tolist()):
        assert (covered[d, :n] == 1).all(), d


def test_resume_inside_an_optimizer_step_on_another_world_size_is_refused():
    lengths = np.arange(1, 60)
    s = BatchingSettings(max_tokens=64, accumulate_grad_batches=2)
    sampler = _sampler(lengths, s, 16, 2, 0)
    state = sampler.state_dict(1)
    other = _sampler(lengths, s, 16, 3, 0)
    with pytest.raises(ValueError, match="inside an optimizer step of accumulate_grad_batches=2"):
        other.load_state_dict(state)
    same = _sampler(lengths, s, 16, 2, 0)
    same.load_state_dict(state)
    assert len(same) == len(sampler) and same.start_micro_step == 1  # counted from the epoch's start
    assert list(same) == list(sampler)[1:]  # the first pass goes on from the position
    assert list(same) == list(sampler)  # a later pass yields the whole epoch
    assert same.state_dict()["segments"] == [[2, 0]] and same.state_dict()["epoch"] == 1  # consumed: next epoch


def test_len_counts_the_micro_steps_the_earlier_ranks_ran():
    lengths = np.arange(1, 200)
    s = BatchingSettings(max_tokens=64, accumulate_grad_batches=2)
    first = _sampler(lengths, s, [[0, 16], [1, 32], [2, 64]], 2, 1)
    state = first.state_dict(4)
    later = _sampler(lengths, s, [[0, 16], [1, 32], [2, 64]], 3, 2)
    later.load_state_dict(state)
    assert later.first_micro_step == later.start_micro_step == 4
    assert len(later) == 4 + later.plan().num_micro_steps == 4 + len(list(later))
    assert later.state_dict(5)["segments"] == [[2, 4], [3, 1]]
    with pytest.raises(ValueError, match="batches_consumed"):
        later.state_dict(3)  # before this world's plan began


def test_later_epochs_start_where_the_earlier_ended():
    lengths = np.full(50, 40)
    s = BatchingSettings(max_tokens=64)
    sampler = _sampler(lengths, s, [[0, 16], [20, 64]], 2, 0)
    first_steps = len(sampler)  # accumulate_grad_batches=1: a micro-step is an optimizer step
    assert int(sampler.plan_pieces()[2].max()) == 16 and first_steps < 20  # the first epoch stays below step 20
    sampler.set_epoch(1)
    assert sampler.state_dict(0)["first_optimizer_step"] == first_steps  # the second starts where the first ended
    piece_length = sampler.plan_pieces()[2]
    assert 16 in piece_length and 40 in piece_length  # cut until step 20, whole documents after it


def test_bad_schedules_are_refused_before_planning():
    s = BatchingSettings(max_tokens=64)
    with pytest.raises(ValueError, match=r"max_length_schedule.*65.*max_tokens=64"):
        _sampler([100], s, [[0, 16], [9, 65]], 1, 0)
    with pytest.raises(ValueError, match=r"max_length_schedule.*0"):
        _sampler([100], s, 0, 1, 0)
    with pytest.raises(ValueError, match=r"max_length_schedule.*unit='steps'"):
        _sampler([100], s, Schedule([(0, 16)], unit="tokens"), 1, 0)


@pytest.mark.parametrize("setting, value", [("drop_last", True), ("too_long", "skip"), ("padded_shapes", 2),
                                            ("static_packing", True)])
def test_settings_that_leave_tokens_out_or_fix_shapes_are_refused_naming_both(setting, value):
    extra = {"packing": True} if setting == "static_packing" else {}
    s = BatchingSettings(max_tokens=64, **extra, **{setting: value})
    with pytest.raises(ValueError, match=rf"{setting}.*max_length_schedule"):
        _sampler(np.arange(1, 50), s, 16, 2, 0)


def test_masked_labels_and_rank_speeds_are_refused_naming_both():
    s = BatchingSettings(max_tokens=64)
    with pytest.raises(ValueError, match=r"masked labels.*max_length_schedule"):
        BalancedBatchSampler(np.arange(2, 50), settings=s, num_replicas=1, rank=0, max_length_schedule=16,
                             supervised_lengths=np.ones(48, dtype=np.int64))
    with pytest.raises(ValueError, match=r"rank_speeds.*max_length_schedule"):
        BalancedBatchSampler(np.arange(2, 50), settings=s, num_replicas=2, rank=0, max_length_schedule=16,
                             rank_speeds=[1.0, 0.5])


def test_a_state_resumes_only_with_its_schedule():
    lengths = np.arange(1, 65)
    s = BatchingSettings(max_tokens=64)
    state = _sampler(lengths, s, [[0, 16], [4, 64]], 2, 0).state_dict(3)
    with pytest.raises(ValueError, match=r"checkpoint's max_length_schedule is \[\(0, 16.*4, 64.*this sampler's is"):
        _sampler(lengths, s, [[0, 16], [5, 64]], 2, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with a length warm-up.*max_length_schedule"):
        BalancedBatchSampler(lengths, settings=s, num_replicas=2, rank=0).load_state_dict(state)
    plain = BalancedBatchSampler(lengths, settings=s, num_replicas=2, rank=0).state_dict(1)
    with pytest.raises(ValueError, match="saved without a length warm-up.*max_length_schedule"):
        _sampler(lengths, s, 16, 2, 0).load_state_dict(plain)


@pytest.mark.parametrize("packing", [False, True])
def test_per_rank_budgets_hold_with_every_token_once(packing):
    """max_tokens per rank (a list): each rank's micro-batches within its own budget, every token once."""
    lengths = np.random.default_rng(0).integers(1, 400, 200)
    budgets = [128, 256]
    samplers = [BalancedBatchSampler(lengths, max_tokens=budgets, num_replicas=2, rank=r, packing=packing,
                                     max_length_schedule=[[0, 32], [5, 200]]) for r in range(2)]
    assert len(samplers[0]) == len(samplers[1])
    trained = np.zeros(lengths.size, dtype=np.int64)
    for r, sampler in enumerate(samplers):
        for mb in sampler:
            pieces = np.array(mb.piece_length)
            assert (pieces.sum() if packing else pieces.size * pieces.max()) <= budgets[r]
            np.add.at(trained, np.array(mb)[~np.array(mb.is_fill, dtype=bool)],
                      pieces[~np.array(mb.is_fill, dtype=bool)])
    assert (trained == lengths).all()


def test_the_plan_report_counts_pieces_and_the_ledger_refuses_naming_the_warm_up():
    from lit_balance.ledger import ledger_columns
    from lit_balance.report.figures import plan_report

    lengths = np.random.default_rng(1).integers(1, 300, 120)
    sampler = _sampler(lengths, BatchingSettings(max_tokens=128), [[0, 32], [4, 128]], 2, 0)
    report = plan_report(None, 128, num_replicas=2, sampler=sampler)
    assert int(report.lengths.sum()) == int(lengths.sum())  # the report's samples are the pieces: every token
    assert int(report.lengths.max()) <= 128 and report.lengths.size == sampler.plan_pieces()[0].size
    assert report.balanced.padding_ratio < 0.2
    with pytest.raises(ValueError, match=r"ledger.*max_length_schedule"):
        ledger_columns(sampler)


def test_the_epoch_after_a_resume_on_another_world_size_starts_where_it_ended():
    lengths = np.random.default_rng(2).integers(1, 200, 150)
    s = BatchingSettings(max_tokens=64, accumulate_grad_batches=2)
    schedule = [[0, 16], [6, 32], [40, 64]]
    state = _sampler(lengths, s, schedule, 2, 0).state_dict(4)  # 2 optimizer steps on 2 ranks
    later = _sampler(lengths, s, schedule, 3, 1)
    later.load_state_dict(state)
    steps = 2 + -(-later.plan().num_micro_steps // 2)  # the epoch's optimizer steps as it ran: 2, then 3 ranks
    end = later.state_dict(len(later))  # the whole epoch consumed: the next one's start
    assert end["epoch"] == 1 and end["first_optimizer_step"] == steps
    later.set_epoch(1)
    assert later.state_dict(0)["first_optimizer_step"] == steps
    fresh = _sampler(lengths, s, schedule, 3, 1)
    fresh.load_state_dict(end)  # a checkpoint at the epoch's end resumes the next epoch at that step
    assert len(fresh) == len(later)  # epochs differ in length under a warm-up: read len() after set_epoch
    assert list(fresh) == list(later)
