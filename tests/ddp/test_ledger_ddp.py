"""The ledger of a plan is what real CPU ranks (gloo) train on, micro-batch by micro-batch, under LedgerCheck: one
corpus and a mixture, padded and packed, accumulate_grad_batches=2, stopped mid-epoch on 2 ranks and resumed on 3 (the
resumed run checked against the ledger of the checkpoint's rest of the epoch; also resumed with ``skip_steps``, checked
against the ledger that leaves those steps out); and a document swapped in one rank's loader stops every rank with an
error naming the optimizer step and rank."""

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real multi-rank CPU fits in subprocesses, ~15 s each alone

SCRIPT = Path(__file__).with_name("fit_ledger.py")
ROOT = SCRIPT.parents[2]
TIMEOUT_S = 600  # two fits at once: ~10 s on a quiet 2-core machine, ~60 s beside other CPU-bound jobs


def _fit_ledger():
    sys.path.insert(0, str(SCRIPT.parent))
    import fit_ledger

    return fit_ledger


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger_data")
    words = "the cat sat on a mat while dogs ran far away over green hills".split()
    (root / "web.jsonl").write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 14]
                                                                         for j in range(3 + (i * 7) % 45))}) + "\n"
                                            for i in range(90)))
    (root / "code.jsonl").write_text("".join(json.dumps({"text": " ".join(f"x{(i * j) % 7} = {j}"
                                                                          for j in range(2 + i % 16))}) + "\n"
                                             for i in range(60)))
    return root


def _datamodule(data, kind, layout, skip_steps=None, replace=False):
    dm = _fit_ledger().datamodule(data, kind, layout, skip_steps=skip_steps, replace=replace)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _ledger_rows(path):
    from lit_balance.ledger import read_ledger

    table, header = read_ledger(path)
    names = ("micro_step", "rank", "sample", "fill", "component", "document", "optimizer_step")
    return [dict(zip(names, row)) for row in zip(*(table.column(n).to_pylist() for n in names))], header


def _by_step(rows, rank):
    out = {}
    for row in rows:
        if row["rank"] == rank:
            indices, fill = out.setdefault(row["micro_step"], ([], []))
            indices.append(row["sample"])
            fill.append(row["fill"])
    return out


def _read(out, phase, devices):
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module", params=["plain", "mixture"])
def runs(request, data, tmp_path_factory):
    """Per layout: (the 2-rank ledger, the stopped run, the 3-rank ledger of the rest, the resumed run)."""
    from lit_balance.ledger import write_datamodule_ledger

    kind = request.param
    fit = _fit_ledger()
    dirs = {layout: (tmp_path_factory.mktemp(f"stop_{kind}_{layout}"), tmp_path_factory.mktemp(f"resume_{kind}_"
                                                                                                   f"{layout}"))
            for layout in ("padded", "packed")}
    for layout, (stop, _) in dirs.items():
        write_datamodule_ledger(stop / "ledger.parquet", _datamodule(data, kind, layout), num_replicas=2,
                                accumulate_grad_batches=fit.ACCUMULATE)
    run_scripts(SCRIPT, {layout: [stop, data, kind, layout, "stop", 2] for layout, (stop, _) in dirs.items()},
                TIMEOUT_S)
    for layout, (stop, resume) in dirs.items():
        shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
        state = torch.load(resume / "mid.ckpt", weights_only=True)["BalancedTextDataModule"]["train_sampler"]
        write_datamodule_ledger(resume / "ledger.parquet", _datamodule(data, kind, layout), num_replicas=3,
                                accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    run_scripts(SCRIPT, {layout: [resume, data, kind, layout, "resume", 3] for layout, (_, resume) in dirs.items()},
                TIMEOUT_S)
    from lit_balance.lightning.ledger_record import check_record

    return {layout: (_ledger_rows(stop / "ledger.parquet"), _read(stop, "stop", 2),
                     _ledger_rows(resume / "ledger.parquet"), _read(resume, "resume", 3),
                     [check_record([d / "received"], d / "ledger.parquet") for d in (stop, resume)])
            for layout, (stop, resume) in dirs.items()}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_each_rank_trains_exactly_the_ledgers_micro_batches_before_and_after_a_resume_on_three_ranks(runs, layout):
    (full, header2), stopped, (rest, header3), resumed, checks = runs[layout]
    stop_at = _fit_ledger().STOP_AT
    assert header2["num_replicas"] == 2 and header3["num_replicas"] == 3 and header3["first_micro_step"] == stop_at
    for rank, record in enumerate(stopped):
        planned = _by_step(full, rank)
        assert [b[0] for b in record["batches"]] == list(range(stop_at))
        assert {b[0]: (b[1], b[2]) for b in record["batches"]} == {s: planned[s] for s in range(stop_at)}
    for rank, record in enumerate(resumed):
        planned = _by_step(rest, rank)
        assert sorted(planned) == list(range(stop_at, header3["micro_steps"]))
        assert {b[0]: (b[1], b[2]) for b in record["batches"]} == planned
        assert record["global_step"] == header3["optimizer_steps"]
    # the two ledgers together hold every document of the uninterrupted epoch once, by component
    documents = lambda rows: Counter((r["component"], r["document"]) for r in rows if not r["fill"])  # noqa: E731
    first_part = [r for r in full if r["micro_step"] < stop_at]
    assert documents(first_part) + documents(rest) == documents(full)
    assert max(documents(full).values()) == 1
    # what every rank recorded (LedgerCheck(record=...)) passes lit-balance ledger check against both ledgers
    stopped_check, resumed_check = checks
    assert stopped_check.ok and stopped_check.ranks == (0, 1) and stopped_check.micro_batches == 2 * stop_at
    assert resumed_check.ok and resumed_check.ranks == (0, 1, 2)
    assert resumed_check.micro_batches == 3 * (header3["micro_steps"] - stop_at)


@pytest.fixture(scope="module")
def swapped(data, tmp_path_factory):
    from lit_balance.ledger import write_datamodule_ledger

    out = tmp_path_factory.mktemp("swap")
    fit = _fit_ledger()
    write_datamodule_ledger(out / "ledger.parquet", _datamodule(data, "mixture", "packed"), num_replicas=2,
                            accumulate_grad_batches=fit.ACCUMULATE)
    rows, _ = _ledger_rows(out / "ledger.parquet")
    planned = next(r["sample"] for r in rows if r["micro_step"] == 2 and r["rank"] == 1)
    delivered = next(r["sample"] for r in rows if r["micro_step"] == 2 and r["rank"] == 0)
    run_scripts(SCRIPT, {"swap": [out, data, "mixture", "packed", "swap", 2, planned, delivered]}, TIMEOUT_S)
    from lit_balance.lightning.ledger_record import check_record

    return _read(out, "swap", 2), planned, delivered, check_record([out / "received"], out / "ledger.parquet")


def test_a_document_swapped_in_one_ranks_loader_stops_every_rank_naming_the_step_and_rank(swapped):
    records, planned, delivered, check = swapped
    # the record written as the error stopped the ranks names the same step, rank and document
    assert [(m.optimizer_step, m.micro_step, m.rank, m.row, m.expected, m.received) for m in check.mismatches] == \
        [(1, 2, 1, 0, planned, delivered)]
    for record in records:
        assert record["mismatch"] is not None
        assert (f"optimizer step 1 (epoch 0, micro-step 2, micro-batch 0 of the step), rank 1, row 0: the rank "
                f"received sample {delivered} where the ledger has sample {planned}") in record["mismatch"]
        # stopped at the end of the step that differed: its two micro-batches trained, no later one
        assert [b[0] for b in record["batches"]] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def skipped(data, tmp_path_factory):
    """A 2-rank run stopped after two optimizer steps, resumed on 3 ranks with skip_steps=[SKIP_STEPS]: the ledgers of
    the rest with and without the skip, and what every rank trained."""
    from lit_balance.ledger import write_datamodule_ledger

    fit = _fit_ledger()
    stop, resume = tmp_path_factory.mktemp("skip_stop"), tmp_path_factory.mktemp("skip_resume")
    write_datamodule_ledger(stop / "ledger.parquet", _datamodule(data, "mixture", "padded"), num_replicas=2,
                            accumulate_grad_batches=fit.ACCUMULATE)
    run_scripts(SCRIPT, {"stop": [stop, data, "mixture", "padded", "stop", 2]}, TIMEOUT_S)
    shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
    state = torch.load(resume / "mid.ckpt", weights_only=True)["BalancedTextDataModule"]["train_sampler"]
    write_datamodule_ledger(resume / "plain.parquet", _datamodule(data, "mixture", "padded"), num_replicas=3,
                            accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    write_datamodule_ledger(resume / "ledger.parquet", _datamodule(data, "mixture", "padded", [fit.SKIP_STEPS]),
                            num_replicas=3, accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    run_scripts(SCRIPT, {"skip": [resume, data, "mixture", "padded", "skip", 3]}, TIMEOUT_S)
    return (_ledger_rows(stop / "ledger.parquet"), _ledger_rows(resume / "plain.parquet"),
            _ledger_rows(resume / "ledger.parquet"), _read(resume, "skip", 3))


def test_a_resume_on_three_ranks_with_skip_steps_trains_the_plan_less_those_steps_as_the_ledger_says(skipped):
    (full, _), (plain, plain_header), (rest, header), resumed = skipped
    fit = _fit_ledger()
    a, b = fit.SKIP_STEPS
    assert header["skip_steps"] == [[a, b]] and plain_header["optimizer_steps"] > b  # the range lies in the epoch
    # the skip ledger is the plain plan of the rest less the rows of the skipped steps, renumbered as batch_idx
    kept = [r for r in plain if not a <= r["optimizer_step"] < b]
    shift = (b - a) * fit.ACCUMULATE
    assert [(r["rank"], r["sample"], r["fill"], r["optimizer_step"]) for r in rest] == \
        [(r["rank"], r["sample"], r["fill"], r["optimizer_step"]) for r in kept]
    assert [r["micro_step"] for r in rest] == [r["micro_step"] - (shift if r["optimizer_step"] >= b else 0)
                                               for r in kept]
    for rank, record in enumerate(resumed):  # LedgerCheck passed on every rank, and each trained the ledger's rows
        assert record["mismatch"] is None
        assert {x[0]: (x[1], x[2]) for x in record["batches"]} == _by_step(rest, rank)
        assert record["global_step"] == plain_header["optimizer_steps"] - (b - a)  # skipped steps are not counted
    # nothing else lost: the stopped part, what trained after it and the skipped rows hold the epoch's documents once
    documents = lambda rows: Counter((r["component"], r["document"]) for r in rows if not r["fill"])  # noqa: E731
    skipped_rows = [r for r in plain if a <= r["optimizer_step"] < b]
    assert skipped_rows and documents([r for r in full if r["micro_step"] < fit.STOP_AT]) + documents(rest) + \
        documents(skipped_rows) == documents(full)


@pytest.fixture(scope="module")
def epochs(data, tmp_path_factory):
    """A 2-rank run stopped after two optimizer steps, resumed on 3 ranks for two epochs with skip ranges across the
    first epoch's end and inside the second, recorded; the ledgers of both epochs on 3 ranks with those ranges."""
    from lit_balance.ledger import write_datamodule_ledger
    from lit_balance.lightning.ledger_record import check_record

    fit = _fit_ledger()
    stop, resume = tmp_path_factory.mktemp("epochs_stop"), tmp_path_factory.mktemp("epochs_resume")
    write_datamodule_ledger(stop / "ledger.parquet", _datamodule(data, "mixture", "packed"), num_replicas=2,
                            accumulate_grad_batches=fit.ACCUMULATE)
    run_scripts(SCRIPT, {"stop": [stop, data, "mixture", "packed", "stop", 2]}, TIMEOUT_S)
    shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
    state = torch.load(resume / "mid.ckpt", weights_only=True)["BalancedTextDataModule"]["train_sampler"]
    plain = write_datamodule_ledger(resume / "plain.parquet", _datamodule(data, "mixture", "packed"), num_replicas=3,
                                    accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    e0 = plain["optimizer_steps"]  # the first epoch's optimizer steps of the run
    skip = [[e0 - 1, e0 + 1], [e0 + 2, e0 + 3]]
    ledger0 = write_datamodule_ledger(resume / "epoch0.parquet", _datamodule(data, "mixture", "packed", skip),
                                      num_replicas=3, accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    ledger1 = write_datamodule_ledger(resume / "epoch1.parquet", _datamodule(data, "mixture", "packed", skip),
                                      num_replicas=3, accumulate_grad_batches=fit.ACCUMULATE, epoch=1,
                                      first_optimizer_step=e0)
    run_scripts(SCRIPT, {"epochs": [resume, data, "mixture", "packed", "epochs", 3, json.dumps(skip)]}, TIMEOUT_S)
    return (e0, skip, ledger0, ledger1, _ledger_rows(resume / "epoch1.parquet")[0], _read(resume, "epochs", 3),
            [check_record([resume / "received"], resume / f"epoch{e}.parquet") for e in (0, 1)])


def test_skip_ranges_across_an_epochs_end_and_in_a_later_epoch_hold_on_three_real_ranks_as_the_ledgers_say(epochs):
    e0, skip, ledger0, ledger1, rows1, records, checks = epochs
    assert ledger0["skip_steps"] == [[e0 - 1, e0 + 1]] and ledger1["first_optimizer_step"] == e0
    assert ledger1["skip_steps"] == [[e0, e0 + 1], [e0 + 2, e0 + 3]]
    assert not {r["optimizer_step"] for r in rows1} & {e0, e0 + 2} and min(r["optimizer_step"] for r in rows1) == e0 + 1
    for check in checks:  # every rank's record of each epoch is the ledger's, micro-batch by micro-batch
        assert check.ok and check.ranks == (0, 1, 2)
    assert checks[1].micro_batches == 3 * ledger1["micro_steps"]
    for rank, record in enumerate(records):
        second = {b[0]: (b[1], b[2]) for b in record["batches"] if b[3] == 1}
        assert second == _by_step(rows1, rank)
        # Lightning counts what trained: the plans' steps of both epochs less the three skipped
        assert record["global_step"] == e0 + ledger1["optimizer_steps"] - 3


@pytest.fixture(scope="module")
def replaced(data, tmp_path_factory):
    """A 2-rank mixture run stopped after two optimizer steps, resumed on 3 ranks with skip_steps=[SKIP_STEPS],
    replace=True: the 2-rank ledger, the 3-rank ledgers of the rest without the skip and with it replaced, and what
    every rank trained."""
    from lit_balance.ledger import write_datamodule_ledger

    fit = _fit_ledger()
    stop, resume = tmp_path_factory.mktemp("replace_stop"), tmp_path_factory.mktemp("replace_resume")
    write_datamodule_ledger(stop / "ledger.parquet", _datamodule(data, "mixture", "packed"), num_replicas=2,
                            accumulate_grad_batches=fit.ACCUMULATE)
    run_scripts(SCRIPT, {"stop": [stop, data, "mixture", "packed", "stop", 2]}, TIMEOUT_S)
    shutil.copy(stop / "mid.ckpt", resume / "mid.ckpt")
    state = torch.load(resume / "mid.ckpt", weights_only=True)["BalancedTextDataModule"]["train_sampler"]
    write_datamodule_ledger(resume / "plain.parquet", _datamodule(data, "mixture", "packed"), num_replicas=3,
                            accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    write_datamodule_ledger(resume / "ledger.parquet",
                            _datamodule(data, "mixture", "packed", [fit.SKIP_STEPS], replace=True),
                            num_replicas=3, accumulate_grad_batches=fit.ACCUMULATE, sampler_state=state)
    run_scripts(SCRIPT, {"replace": [resume, data, "mixture", "packed", "replace", 3]}, TIMEOUT_S)
    return (_ledger_rows(stop / "ledger.parquet"), _ledger_rows(resume / "plain.parquet"),
            _ledger_rows(resume / "ledger.parquet"), _read(resume, "replace", 3))


def test_a_resume_on_three_ranks_with_replace_trains_the_replanned_rest_as_the_ledger_says(replaced):
    (full, _), (plain, _), (rest, header), resumed = replaced
    fit = _fit_ledger()
    a, b = fit.SKIP_STEPS
    assert header["replaced_steps"] == [[a, b]] and header["skip_steps"] == []
    for rank, record in enumerate(resumed):  # LedgerCheck passed on every rank, and each trained the ledger's rows
        assert record["mismatch"] is None
        assert {x[0]: (x[1], x[2]) for x in record["batches"]} == _by_step(rest, rank)
    steps = sorted({r["optimizer_step"] for r in rest})
    assert steps == list(range(steps[0], steps[-1] + 1)) and a in steps  # no gap: step a trains the next documents
    assert all(record["global_step"] == steps[-1] + 1 for record in resumed)
    # the replaced steps' documents never train; every other document of the epoch trains once
    documents = lambda rows: Counter((r["component"], r["document"]) for r in rows if not r["fill"])  # noqa: E731
    taken = documents([r for r in plain if a <= r["optimizer_step"] < b])
    before = documents([r for r in full if r["micro_step"] < fit.STOP_AT])
    trained = documents(rest)
    assert taken and not set(taken) & set(trained) and max(trained.values()) == 1
    assert set(before) | set(trained) | set(taken) == set(documents(full))
    assert not set(before) & set(trained)
