"""StreamBatches on 1-4 ranks run as threads (tests/stream/threaded.py): the plan's guarantees window by window, the
stream's end on every rank at the same micro-step, exact resume on another number of ranks, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from lit_balance import BatchingSettings
from lit_balance.errors import InputValueError
from lit_balance.stream import StreamBatches, StreamCorpus, StreamRankError

from threaded import run_ranks

LAYOUTS = {
    "padded": {},
    "packed": {"packing": True},
    "padded_shapes": {"padded_shapes": 3},
    "static_packed": {"packing": True, "static_packing": True},
}


def seeded_stream(seed: int, num_documents: int, longest: int):
    """A generator function of ``num_documents`` token-id documents of seeded lengths in ``[1, longest]``."""
    def documents():
        rng = np.random.default_rng(seed)
        for i in range(num_documents):
            yield np.full(int(rng.integers(1, longest + 1)), i % 1000 + 1, dtype=np.int64)
    return documents


def _case(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    num_replicas, acc = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    step = num_replicas * acc
    window = step * int(rng.integers(1, 8))
    layout = list(LAYOUTS)[seed % len(LAYOUTS)]
    return {"num_replicas": num_replicas, "acc": acc, "window": window, "layout": layout,
            "num_documents": int(rng.integers(1, 6 * window + 2)), "max_tokens": int(rng.choice([64, 100, 256])),
            "seed": seed}


def _make(case: dict, **more):
    settings = BatchingSettings(max_tokens=case["max_tokens"], accumulate_grad_batches=case["acc"], seed=case["seed"],
                                **LAYOUTS[case["layout"]])
    corpus = StreamCorpus(seeded_stream(case["seed"], case["num_documents"], min(case["max_tokens"], 64)))
    return lambda rank: StreamBatches(corpus, settings, window_documents=case["window"],
                                      num_replicas=case["num_replicas"], rank=rank, **more)


def _check_run(case: dict, out: dict) -> None:
    assert out["errors"] == [None] * case["num_replicas"], out["errors"]
    runs = out["batches"]
    counts = [len(r) for r in runs]
    assert len(set(counts)) == 1, counts  # equal micro-batch counts
    trained = []
    last_window = (case["num_documents"] - 1) // case["window"]
    for run in runs:
        for indices, fills, padded, _ in run:
            assert padded <= case["max_tokens"]  # never over budget
            trained += [i for i, f in zip(indices, fills) if not f]
            if any(fills):  # fill rows only in the stream's last window
                assert all(i // case["window"] == last_window for i in indices), (indices, fills)
    assert sorted(trained) == list(range(case["num_documents"]))  # every document exactly once
    for step in range(counts[0]):  # the optimizer step's global sums agree on every rank
        assert len({run[step][3] for run in runs}) == 1
    states = [repr(s) for s in out["states"]]
    assert len(set(states)) == 1  # the same state on every rank


@pytest.mark.parametrize("seed", range(100))
def test_a_stream_is_planned_window_by_window_with_every_guarantee_and_ends_on_every_rank(seed):
    case = _case(seed)
    _check_run(case, run_ranks(_make(case), case["num_replicas"]))


def test_a_window_that_is_not_the_last_is_whole_optimizer_steps():
    case = {"num_replicas": 3, "acc": 2, "window": 24, "layout": "padded", "num_documents": 100, "max_tokens": 100,
            "seed": 3}
    out = run_ranks(_make(case), 3)
    _check_run(case, out)
    windows = [max(i for i, f in zip(idx, fills) if not f) // 24 if not all(fills) else None
               for idx, fills, _, _ in out["batches"][0]]
    boundaries = [k for k in range(1, len(windows)) if windows[k] != windows[k - 1] and windows[k] is not None]
    assert boundaries and all(k % 2 == 0 for k in boundaries)  # a window starts at an optimizer step


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_on_4_then_3_then_4_ranks_trains_the_documents_of_the_uninterrupted_run(layout, acc, capfd):
    case = {"num_replicas": 4, "acc": acc, "window": 24, "layout": layout, "num_documents": 150, "max_tokens": 100,
            "seed": 11}
    whole = run_ranks(_make(case), 4)
    _check_run(case, whole)
    first = run_ranks(_make(case), 4, stop_after=7)
    assert len({repr(s) for s in first["states"]}) == 1
    # the stopped run trained what the uninterrupted run trained in those micro-steps
    assert [r for r in first["batches"]] == [r[:7] for r in whole["batches"]]
    second = run_ranks(_make({**case, "num_replicas": 3}), 3, stop_after=5, state=first["states"][0])
    third = run_ranks(_make(case), 4, state=second["states"][0])
    for part in (first, second, third):
        assert part["errors"] == [None] * len(part["errors"])
        assert len({len(r) for r in part["batches"]}) == 1
    trained = [i for part in (first, second, third) for run in part["batches"] for idx, fills, _, _ in run
               for i, f in zip(idx, fills) if not f]
    assert sorted(trained) == list(range(150))  # none lost, none repeated
    assert first["states"][0]["shapes"] == second["states"][0]["shapes"] == third["states"][0]["shapes"]
    assert all(p <= 100 for part in (first, second, third) for run in part["batches"] for _, _, p, _ in run)
    assert "skipping the stream's first" in capfd.readouterr().err  # a generator cannot seek: said on stderr


def test_a_stream_that_raises_on_one_rank_stops_every_rank_with_that_error():
    def make(rank):
        def documents():
            for i in range(200):
                if rank == 1 and i == 90:
                    raise OSError("connection reset while reading shard 7")
                yield [5] * (i % 20 + 1)
        return StreamBatches(StreamCorpus(documents), BatchingSettings(max_tokens=64), window_documents=16,
                             num_replicas=3, rank=rank)

    out = run_ranks(make, 3)
    assert isinstance(out["errors"][1], OSError)
    for rank in (0, 2):
        assert isinstance(out["errors"][rank], StreamRankError)
        assert "rank 1" in str(out["errors"][rank]) and "connection reset while reading shard 7" in str(
            out["errors"][rank])
    assert len({len(r) for r in out["batches"]}) == 1  # every rank stopped after the same micro-batches


def test_a_stream_of_nothing_is_refused_on_every_rank():
    make = lambda rank: StreamBatches(StreamCorpus(list), BatchingSettings(max_tokens=64), window_documents=4,
                                      num_replicas=2, rank=rank)
    out = run_ranks(make, 2)
    for error in out["errors"]:
        assert isinstance(error, InputValueError) and "no documents" in str(error)


def test_a_record_without_the_text_key_names_the_setting():
    records = [{"text": "a b c"}] * 5 + [{"body": "d e"}] + [{"text": "f"}] * 5
    make = lambda rank: StreamBatches(StreamCorpus(records), BatchingSettings(max_tokens=64), window_documents=4,
                                      num_replicas=2, rank=rank)
    out = run_ranks(make, 2)
    reader = 5 % 2  # document 5 is tokenized by rank (5 - 4) % 2 == 1
    assert isinstance(out["errors"][reader], InputValueError)
    assert "'text'" in str(out["errors"][reader]) and "text_key" in str(out["errors"][reader])
    assert isinstance(out["errors"][1 - reader], StreamRankError) and "text_key" in str(out["errors"][1 - reader])


def test_a_window_smaller_than_one_optimizer_step_is_refused():
    with pytest.raises(ValueError, match=r"window_documents=5 .* accumulate_grad_batches=2 = 6"):
        StreamBatches(StreamCorpus([[1]]), BatchingSettings(max_tokens=8, accumulate_grad_batches=2),
                      window_documents=5, num_replicas=3, rank=0)


def test_a_document_over_the_budget_is_refused_on_every_rank_naming_max_tokens():
    docs = [[1] * 10] * 7 + [[1] * 99]
    make = lambda rank: StreamBatches(StreamCorpus(docs), BatchingSettings(max_tokens=64), window_documents=4,
                                      num_replicas=2, rank=rank)
    out = run_ranks(make, 2)
    for error in out["errors"]:
        assert isinstance(error, ValueError) and "max_tokens" in str(error)


def test_held_out_documents_are_not_trained_and_are_the_streams_first():
    corpus = StreamCorpus(seeded_stream(2, 60, 30))
    head = corpus.head(10)
    make = lambda rank: StreamBatches(corpus, BatchingSettings(max_tokens=64), window_documents=8, num_replicas=2,
                                      rank=rank, held_out=10)
    out = run_ranks(make, 2)
    trained = sorted(i for run in out["batches"] for idx, fills, _, _ in run for i, f in zip(idx, fills) if not f)
    assert trained == list(range(10, 60))
    assert [h.tolist() for h in head] == [d.tolist() for _, d in zip(range(10), seeded_stream(2, 60, 30)())]


def test_a_second_pass_starts_the_stream_again():
    batches = StreamBatches(StreamCorpus(seeded_stream(4, 30, 20)), BatchingSettings(max_tokens=64),
                            window_documents=8, num_replicas=1, rank=0)
    first = sorted(i for b in batches for i in b["indices"].tolist())
    second = sorted(i for b in batches for i in b["indices"].tolist())
    assert first == second == list(range(30)) and batches.epoch == 1


def test_the_state_after_an_earlier_micro_batch_is_the_one_taken_then():
    make = lambda: StreamBatches(StreamCorpus(seeded_stream(5, 120, 40)), BatchingSettings(max_tokens=64),
                                 window_documents=16, num_replicas=1, rank=0)
    batches, states = make(), []
    for _ in batches:
        states.append(batches.state_dict())
    for k in range(len(states) - 15, len(states)):
        assert batches.state_dict(micro_batches=k) == states[k - 1]
    assert batches.state_dict(micro_batches=len(states)) == {**states[-1], "finished": True}  # the loop ended
    with pytest.raises(RuntimeError, match="not held"):
        batches.state_dict(micro_batches=1)
    resumed = make()  # a resume at a prefetched loader's count trains the rest
    resumed.load_state_dict(batches.state_dict(micro_batches=len(states) - 3))
    rest = [i for b in resumed for i in b["indices"].tolist()]
    assert resumed._yielded == len(states)
    first = make()
    done = [i for _, b in zip(range(len(states) - 3), first) for i in b["indices"].tolist()]
    assert sorted(done + rest) == list(range(120))


def test_per_rank_budgets_and_loader_workers_are_refused_naming_the_setting():
    corpus = StreamCorpus(seeded_stream(1, 20, 10))
    with pytest.raises(ValueError, match="max_tokens"):
        StreamBatches(corpus, BatchingSettings(max_tokens=[64, 32]), window_documents=8, num_replicas=2, rank=0)
    batches = StreamBatches(corpus, BatchingSettings(max_tokens=64), window_documents=8, num_replicas=1, rank=0)
    import torch

    with pytest.raises(ValueError, match="num_workers=0"):
        next(iter(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=1)))


def test_a_loop_that_breaks_off_and_iterates_again_goes_on_where_it_stopped():
    batches = StreamBatches(StreamCorpus(seeded_stream(6, 70, 30)), BatchingSettings(max_tokens=64),
                            window_documents=16, num_replicas=1, rank=0)
    first = [i for _, b in zip(range(5), batches) for i in b["indices"].tolist()]
    rest = [i for b in batches for i in b["indices"].tolist()]
    assert sorted(first + rest) == list(range(70)) and batches.epoch == 0
