"""A stream on real gloo ranks (2-4 processes): equal counts, nothing over budget, every document once, the end on
every rank without a hang (also with a shard 10x shorter), a resume 4 -> 3 -> 4 equal to the uninterrupted run, and
a stream that raises on one rank stopping every rank with that error."""

import json
from pathlib import Path

import pytest
from launch import run_script, run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real CPU ranks in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("stream_ranks.py")
TIMEOUT_S = 300  # a quiet run takes about 10-20 s on 2 cores: a hang fails the test


def _config(**changes):
    return {"kind": "generator", "seed": 0, "num_documents": 300, "window": 24, "max_tokens": 128, "acc": 1,
            "packing": False, "stop_after": None, "state_in": None, **changes}


def _records(out, num_ranks):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(num_ranks)]


def _runs(tmp_path, runs):
    """``{key: per-rank records}`` of runs ``{key: (num_ranks, config)}`` side by side."""
    dirs = {key: tmp_path / str(key) for key in runs}
    for d in dirs.values():
        d.mkdir()
    run_scripts(SCRIPT, {key: [dirs[key], n, json.dumps(c)] for key, (n, c) in runs.items()}, TIMEOUT_S)
    return {key: _records(dirs[key], n) for key, (n, _) in runs.items()}


def _trained(records):
    return [i for rec in records for idx, fills, _ in rec["batches"] for i, f in zip(idx, fills) if not f]


def _check(records, num_documents, max_tokens):
    assert [r["error"] for r in records] == [None] * len(records)
    assert len({len(r["batches"]) for r in records}) == 1  # equal micro-batch counts
    assert all(padded <= max_tokens for r in records for _, _, padded in r["batches"])
    assert sorted(_trained(records)) == list(range(num_documents))  # every document exactly once
    assert len({json.dumps(r["state"]) for r in records}) == 1  # one state on every rank


def test_streams_of_every_source_end_on_every_rank_with_every_guarantee(tmp_path):
    paths = []
    for k, count in enumerate((90, 9, 60)):  # one file 10x shorter
        path = tmp_path / f"part{k}.jsonl"
        path.write_text("".join(json.dumps({"text": "the stream " * (i % 17 + 1)}) + "\n" for i in range(count)))
        paths.append(str(path))
    runs = {
        "generator_acc2": (2, _config(seed=1, acc=2)),
        "hf_packed": (3, _config(kind="hf", shards=[120, 12, 120], packing=True, window=30)),
        "jsonl": (2, _config(kind="jsonl", paths=paths, window=16)),
        "seed7": (3, _config(seed=7, num_documents=97, window=18)),
    }
    out = _runs(tmp_path, runs)
    _check(out["generator_acc2"], 300, 128)
    _check(out["hf_packed"], 252, 128)
    _check(out["jsonl"], 159, 128)
    _check(out["seed7"], 97, 128)


def test_a_run_stopped_on_4_ranks_resumed_on_3_then_on_4_trains_the_documents_of_the_uninterrupted_run(tmp_path):
    config = _config(seed=3, num_documents=200, window=24)
    out = _runs(tmp_path, {"whole": (4, config), "first": (4, {**config, "stop_after": 5})})
    whole, first = out["whole"], out["first"]
    _check(whole, 200, 128)
    assert [r["batches"] for r in first] == [r["batches"][:5] for r in whole]
    (tmp_path / "s1.json").write_text(json.dumps(first[0]["state"]))
    second = _runs(tmp_path, {"second": (3, {**config, "stop_after": 6, "state_in": str(tmp_path / "s1.json")})})
    second = second["second"]
    assert len({json.dumps(r["state"]) for r in second}) == 1
    (tmp_path / "s2.json").write_text(json.dumps(second[0]["state"]))
    third = _runs(tmp_path, {"third": (4, {**config, "state_in": str(tmp_path / "s2.json")})})["third"]
    for part in (first, second, third):
        assert [r["error"] for r in part] == [None] * len(part)
        assert len({len(r["batches"]) for r in part}) == 1
    assert sorted(_trained(first) + _trained(second) + _trained(third)) == sorted(_trained(whole)) == list(range(200))


def test_a_stream_that_raises_on_one_rank_stops_every_rank_with_that_rank_error(tmp_path):
    out = tmp_path / "fail"
    out.mkdir()
    code, log = run_script(SCRIPT, [out, 3, json.dumps(_config(fail_rank=1, fail_at=150))], TIMEOUT_S)
    assert code == 0, log[-3000:]
    records = _records(out, 3)
    assert records[1]["error_type"] == "OSError" and "refused shard 1 (rank 1)" in records[1]["error"]
    for r in (0, 2):
        assert records[r]["error_type"] == "StreamRankError"
        assert "rank 1" in records[r]["error"] and "refused shard 1 (rank 1)" in records[r]["error"]
    assert len({len(r["batches"]) for r in records}) == 1  # every rank stopped at the same micro-step


FIT = Path(__file__).with_name("fit_stream.py")


def test_a_lightning_fit_from_a_stream_ends_with_it_and_resumes_from_a_checkpoint_on_3_ranks(tmp_path):
    run_scripts(FIT, {"full": [tmp_path, "full", 2], "stop": [tmp_path, "stop", 2]}, TIMEOUT_S)
    full = [json.loads((tmp_path / f"full_rank{r}.json").read_text()) for r in range(2)]
    assert len({len(r["batches"]) for r in full}) == 1  # the stream's end on both ranks, no len()

    def trained(records, upto=None):
        return [i for rec in records for step, idx, fills in rec["batches"][:upto] for i, f in zip(idx, fills)
                if not f]

    assert sorted(trained(full)) == list(range(150))
    run_scripts(FIT, {"resume": [tmp_path, "resume", 3]}, TIMEOUT_S)
    stop = [json.loads((tmp_path / f"stop_rank{r}.json").read_text()) for r in range(2)]
    resume = [json.loads((tmp_path / f"resume_rank{r}.json").read_text()) for r in range(3)]
    assert len({len(r["batches"]) for r in resume}) == 1
    assert resume[0]["batches"][0][0] == 3  # it goes on from optimizer step 3
    # the checkpoint holds the first 6 micro-batches (3 optimizer steps of 2), not the one Lightning prefetched
    assert sorted(trained(stop, 6) + trained(resume)) == list(range(150))


def test_100_seeded_streams_end_on_every_rank_without_a_hang(tmp_path):
    out = tmp_path / "seeds"
    out.mkdir()
    run_scripts(SCRIPT, {0: [out, 3, json.dumps({"seeds": list(range(100))})]}, TIMEOUT_S)  # a hang: the timeout
    records = _records(out, 3)
    assert len(records[0]) == 100
    for seed, first in records[0].items():
        runs = [r[seed] for r in records]
        _check([{"error": None, "batches": r["batches"], "state": None} for r in runs], first["num_documents"],
               first["max_tokens"])
