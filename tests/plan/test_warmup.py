"""Length warm-up plans: documents split into pieces of at most each optimizer step's max_length, no token lost."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BatchingSettings, plan_epoch
from lit_balance.plan import padded_lengths
from lit_balance.plan.warmup import length_pieces, max_length_function, plan_length_warmup, remaining_spans


def _schedule(points, values, linear):
    """A schedule of ``len(points)`` points: piecewise constant, or linear between them."""
    points = np.cumsum(points) - points[0]

    def value_at(step):
        if linear and len(points) > 1:
            return int(np.interp(step, points, values))
        return int(values[np.searchsorted(points, step, side="right") - 1])
    return value_at


@st.composite
def _cases(draw):
    max_tokens = draw(st.integers(16, 400))
    pad = draw(st.sampled_from([1, 1, 4]))
    packing = draw(st.booleans())
    settings_ = BatchingSettings(max_tokens=max_tokens, pad_to_multiple_of=pad, packing=packing,
                                 accumulate_grad_batches=draw(st.integers(1, 4)), shuffle=draw(st.booleans()),
                                 seed=draw(st.integers(0, 5)),
                                 max_batch_size=draw(st.one_of(st.none(), st.integers(1, 6))))
    top = settings_.truncate_to
    n = draw(st.integers(1, 150))
    lengths = np.array(draw(st.lists(st.integers(1, 3 * top), min_size=n, max_size=n)), dtype=np.int64)
    k = draw(st.integers(1, 4))
    points = draw(st.lists(st.integers(1, 12), min_size=k, max_size=k))
    values = draw(st.lists(st.integers(max(1, top // 10), top), min_size=k, max_size=k))
    schedule = _schedule(points, values, draw(st.booleans()))
    return lengths, settings_, schedule, draw(st.integers(1, 8)), draw(st.integers(1, 8))


def _check(warmup, lengths, settings_, schedule, num_replicas, covered=None):
    """The plan's invariants; returns ``covered`` (int ``[num_docs, max_len]`` counts of each token trained)."""
    plan, acc = warmup.plan, settings_.accumulate_grad_batches
    assert plan.assignment.shape[1] == num_replicas  # equal counts: one micro-batch per rank per micro-step
    assert sorted(plan.assignment.reshape(-1).tolist()) == list(range(plan.num_batches))
    assert plan.dropped.size == 0
    assert warmup.num_steps == -(-plan.num_micro_steps // acc)
    if covered is None:
        covered = np.zeros((lengths.shape[0], int(lengths.max(initial=1))), dtype=np.int64)
    for s in range(plan.num_micro_steps):
        step = warmup.first_step + s // acc
        limit = schedule(step)
        assert warmup.step_max_length[s // acc] <= limit
        for b in plan.assignment[s]:
            pieces, fill = plan.batch(int(b))
            lens = warmup.piece_length[pieces]
            assert lens.size >= 1
            assert lens.max() <= warmup.step_max_length[s // acc] <= limit  # every piece within its step's length
            padded = padded_lengths(lens, settings_.pad_to_multiple_of)
            if settings_.packing:
                assert -(-int(lens.sum()) // settings_.pad_to_multiple_of) * settings_.pad_to_multiple_of \
                    <= settings_.max_tokens
            else:
                assert lens.size * int(padded.max()) <= settings_.max_tokens
            if settings_.max_batch_size is not None:
                assert lens.size <= settings_.max_batch_size
            for p in pieces[~fill]:
                d, a, n = int(warmup.piece_doc[p]), int(warmup.piece_start[p]), int(warmup.piece_length[p])
                covered[d, a:a + n] += 1
    return covered


def _assert_every_token_once(covered, lengths):
    for d, n in enumerate(lengths.tolist()):
        assert (covered[d, :n] == 1).all(), f"document {d}: tokens trained {covered[d, :n].tolist()}"
        assert (covered[d, n:] == 0).all()


@settings(deadline=None, max_examples=60)
@given(case=_cases(), epoch=st.integers(0, 2))
def test_every_token_once_within_step_length_and_budget(case, epoch):
    lengths, settings_, schedule, num_replicas, _ = case
    warmup = plan_length_warmup(lengths, settings_, num_replicas=num_replicas, epoch=epoch, max_length=schedule,
                                min_chunk_steps=2)
    covered = _check(warmup, lengths, settings_, schedule, num_replicas)
    _assert_every_token_once(covered, lengths)
    real = warmup.plan.real_tokens_per_batch(warmup.piece_length)
    assert int(real.sum()) == int(lengths.sum())  # 0 tokens discarded
    again = plan_length_warmup(lengths, settings_, num_replicas=num_replicas, epoch=epoch, max_length=schedule,
                               min_chunk_steps=2)
    assert np.array_equal(again.plan.rows, warmup.plan.rows)  # the same on every rank
    assert np.array_equal(again.plan.assignment, warmup.plan.assignment)


@settings(deadline=None, max_examples=50)
@given(case=_cases(), data=st.data())
def test_resume_mid_epoch_on_another_world_size(case, data):
    """8 -> 6 -> 8 style: a run stopped after some optimizer steps goes on with another number of ranks from the
    tokens not yet trained; every token is still trained once and the schedule continues at the step reached."""
    lengths, settings_, schedule, first, second = case
    warmup = plan_length_warmup(lengths, settings_, num_replicas=first, epoch=0, max_length=schedule,
                                min_chunk_steps=2)
    covered = np.zeros((lengths.shape[0], int(lengths.max(initial=1))), dtype=np.int64)
    worlds = [first, second, first]
    for world, nxt in zip(worlds, worlds[1:]):
        done = data.draw(st.integers(0, warmup.num_steps))
        acc = settings_.accumulate_grad_batches
        head = warmup.plan.assignment[:done * acc]
        for b in head.reshape(-1):
            pieces, fill = warmup.plan.batch(int(b))
            for p in pieces[~fill]:
                a, n = int(warmup.piece_start[p]), int(warmup.piece_length[p])
                covered[int(warmup.piece_doc[p]), a:a + n] += 1
        spans = remaining_spans(warmup, done)
        assert int(spans[2].sum()) == int(lengths.sum()) - int(covered.sum())  # what is left, nothing more
        warmup = plan_length_warmup(lengths, settings_, num_replicas=nxt, epoch=0, max_length=schedule,
                                    first_step=warmup.first_step + done, spans=spans, min_chunk_steps=2)
    _check(warmup, lengths, settings_, schedule, first, covered)
    _assert_every_token_once(covered, lengths)


def test_without_a_schedule_below_the_lengths_the_plan_is_the_ordinary_one():
    """A max_length at least every length plans the documents whole; one chunk is the ordinary plan."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=300)
    s = BatchingSettings(max_tokens=512, accumulate_grad_batches=2)
    warmup = plan_length_warmup(lengths, s, num_replicas=4, epoch=1, max_length=s.truncate_to, min_chunk_steps=10**6)
    assert np.array_equal(warmup.piece_length, lengths[warmup.piece_doc])
    ordinary = plan_epoch(lengths[warmup.piece_doc], s, num_replicas=4, epoch=1)
    assert np.array_equal(ordinary.rows, warmup.plan.rows)
    assert np.array_equal(ordinary.assignment, warmup.plan.assignment)


def test_pieces_of_a_document_share_a_micro_batch_where_they_can():
    lengths = np.array([1000, 40, 40, 700])
    s = BatchingSettings(max_tokens=1024, shuffle=False)
    warmup = plan_length_warmup(lengths, s, num_replicas=1, epoch=0, max_length=256)
    assert warmup.piece_length.tolist().count(256) == 3 + 2
    batch_of = {}
    for b in range(warmup.plan.num_batches):
        for p in warmup.plan.batch(b)[0]:
            batch_of.setdefault(int(warmup.piece_doc[p]), set()).add(b)
    assert len(batch_of[0]) <= 2 and len(batch_of[3]) <= 2  # 4 and 3 pieces, of 4 rows per micro-batch at most


@pytest.mark.parametrize("packing", [False, True])
def test_the_full_pieces_of_a_document_are_trained_one_after_another(packing):
    """Full pieces (of the step's length) are interchangeable: along the training order they come in piece order,
    so a document's full pieces are next to each other; the plan's lengths per row are those the planner made."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 2000, size=400)
    s = BatchingSettings(max_tokens=1024, accumulate_grad_batches=2, packing=packing)
    warmup = plan_length_warmup(lengths, s, num_replicas=4, epoch=0, max_length=128)
    plan = warmup.plan
    order = plan.assignment.reshape(-1)
    rows = np.concatenate([plan.batch(int(b))[0] for b in order])
    fill = np.concatenate([plan.batch(int(b))[1] for b in order])
    full = rows[~fill & (warmup.piece_length[rows] == 128)]
    assert full.size > 100 and np.array_equal(full, np.sort(full))  # piece order along the training order
    doc = warmup.piece_doc[full]
    runs = 1 + int(np.count_nonzero(np.diff(doc)))
    assert runs == np.unique(doc).size  # each document's full pieces form one run: next to each other


def test_length_pieces_cover_each_span_in_order():
    span, start, length = length_pieces(np.array([7, 3, 1]), 3, np.array([2, 0, 5]))
    assert span.tolist() == [0, 0, 0, 1, 2]
    assert start.tolist() == [2, 5, 8, 0, 5]
    assert length.tolist() == [3, 3, 1, 3, 1]


@pytest.mark.parametrize("schedule, match", [
    (0, r"max_length_schedule \(at optimizer step 0\) must be .*>= 1|max_length_schedule.*0"),
    (129, r"max_length_schedule.*129.*max_tokens=128"),
    ([64, 64, 500], r"max_length_schedule \(at optimizer step 2\).*500.*max_tokens=128"),
    ([], r"max_length_schedule must hold at least one value"),
    ("long", r"max_length_schedule must be an int"),
    (True, r"max_length_schedule must be an int"),
])
def test_schedule_values_outside_one_to_the_budget_are_refused(schedule, match):
    s = BatchingSettings(max_tokens=128)
    with pytest.raises((ValueError, TypeError), match=match):
        plan_length_warmup(np.array([300, 20]), s, num_replicas=1, epoch=0, max_length=schedule)


def test_a_callable_schedule_is_checked_where_read():
    s = BatchingSettings(max_tokens=128)
    check = max_length_function(lambda g: 64 if g < 3 else 1000, s)
    assert check(2) == 64
    with pytest.raises(ValueError, match=r"optimizer step 3.*1000.*max_tokens=128"):
        check(3)


@pytest.mark.parametrize("change, names", [({"drop_last": True}, ("drop_last", "max_length_schedule")),
                                           ({"too_long": "truncate"}, ("too_long", "max_length_schedule")),
                                           ({"too_long": "skip"}, ("too_long", "max_length_schedule"))])
def test_settings_that_leave_tokens_out_are_refused_naming_both(change, names):
    s = BatchingSettings(max_tokens=128, **change)
    with pytest.raises(ValueError) as info:
        plan_length_warmup(np.array([300, 20]), s, num_replicas=1, epoch=0, max_length=64)
    assert all(name in str(info.value) for name in names)


def test_a_schedule_in_optimizer_steps_gives_the_length_rounded_down():
    from lit_balance import Schedule

    s = BatchingSettings(max_tokens=128)
    ramp = Schedule([(0, 16), (10, 128)], interpolation="linear", name="max_length_schedule")
    value_at = max_length_function(ramp, s)
    assert [value_at(g) for g in (0, 1, 10, 50)] == [16, 27, 128, 128]  # 16 + 112 / 10 = 27.2 -> 27
    lengths = np.array([300, 20, 129, 64])
    warmup = plan_length_warmup(lengths, s, num_replicas=2, epoch=0, max_length=ramp, min_chunk_steps=1)
    assert int(warmup.plan.real_tokens_per_batch(warmup.piece_length).sum()) == int(lengths.sum())
    assert all(m <= value_at(warmup.first_step + g) for g, m in enumerate(warmup.step_max_length.tolist()))
    with pytest.raises(ValueError, match=r"max_length_schedule.*unit 'tokens'.*optimizer steps"):
        max_length_function(Schedule([(0, 16)], unit="tokens", name="max_length_schedule"), s)
    with pytest.raises(ValueError, match=r"max_length_schedule \(at optimizer step 10\).*200.*max_tokens=128"):
        max_length_function(Schedule([(0, 16), (10, 200)], name="max_length_schedule"), s)  # before any step
