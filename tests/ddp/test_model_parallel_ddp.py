"""Real multi-process CPU fits (gloo) with ModelParallelStrategy: tensor parallel, FSDP2, and both.

The processes of one replica (tensor-parallel peers) must train the same micro-batches; the data-parallel ranks
together every document once per epoch; each optimizer step's parameter update must equal one process's SGD update
on the token mean over the step's tokens of every data-parallel rank (within 1e-5); RunSummary and a TokenMeanLoss
over the data-parallel group sum over the data-parallel ranks only; StragglerMonitor's windows (what feedback
and accumulation decide on) are the same on every process.
"""

from pathlib import Path

import pytest
import torch

from lit_balance.lightning.loss import token_loss_sum

from launch import run_ranks  # launch.py (the repository root)
from fit_model_parallel import LR, TinyLM  # tests/ddp/fit_model_parallel.py

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2- and 4-process CPU fits in subprocesses

SCRIPT = Path(__file__).with_name("fit_model_parallel.py")
#: run -> (data-parallel size, tensor-parallel size, sharding)
RUNS = {"dp1xtp2": (1, 2, "tp"), "dp2xtp1": (2, 1, "tp"), "fsdp2": (2, 1, "fsdp2"), "dp2xtp2": (2, 2, "tp")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, the 2-process ones side by side, then the 4-process one; {run: (out_dir, records by global rank)}."""
    outs = {run: tmp_path_factory.mktemp(run) for run in RUNS}
    two = {run: (outs[run], [str(dp), str(tp), sharding]) for run, (dp, tp, sharding) in RUNS.items() if dp * tp == 2}
    records = run_ranks(SCRIPT, two, 240)
    records.update(run_ranks(SCRIPT, {"dp2xtp2": (outs["dp2xtp2"], ["2", "2", "tp"])}, 240, num_ranks=4))
    return {run: (outs[run], records[run]) for run in RUNS}


def replicas(ranks):
    """``{data-parallel rank: [records of its processes, by global rank]}``."""
    out = {}
    for record in ranks:
        out.setdefault(record["dp_rank"], []).append(record)
    return out


@pytest.mark.parametrize("run", RUNS)
def test_the_data_parallel_world_is_the_mesh_dimension(runs, run):
    dp, tp, _ = RUNS[run]
    _, ranks = runs[run]
    assert [r["world_size"] for r in ranks] == [dp * tp] * (dp * tp)
    assert [r["num_replicas"] for r in ranks] == [dp] * (dp * tp)
    # the mesh is (data_parallel, tensor_parallel), row-major: global rank g is data-parallel rank g // tp
    assert [r["dp_rank"] for r in ranks] == [g // tp for g in range(dp * tp)]
    assert all(r["sampler_kwargs"] == {"num_replicas": dp, "rank": r["dp_rank"]} for r in ranks)


@pytest.mark.parametrize("run", RUNS)
def test_peers_of_a_replica_train_identical_micro_batches(runs, run):
    out, ranks = runs[run]
    for peers in replicas(ranks).values():
        assert all(p["micro_batches"] == peers[0]["micro_batches"] for p in peers[1:])
        tensors = [torch.load(out / f"rank{p['global_rank']}.pt", weights_only=True) for p in peers]
        for other in tensors[1:]:
            assert len(other) == len(tensors[0])
            for a, b in zip(tensors[0], other):
                assert a["step"] == b["step"] and torch.equal(a["input_ids"], b["input_ids"])
                assert torch.equal(a["labels"], b["labels"])


@pytest.mark.parametrize("run", RUNS)
def test_straggler_windows_hold_the_data_parallel_ranks_and_are_the_same_on_every_process(runs, run):
    dp, _, _ = RUNS[run]
    _, ranks = runs[run]
    windows = ranks[0]["straggler_windows"]
    assert len(windows) >= 2 and all(len(w["real_tokens"]) == dp for w in windows)  # [num_replicas, micro-batches]
    assert all(r["straggler_windows"] == windows for r in ranks)  # what feedback and accumulation decide on
    first = [peers[0] for _, peers in sorted(replicas(ranks).items())]
    for d, record in enumerate(first):  # each data-parallel rank's row counts its own micro-batches' real tokens
        assert sum(t for w in windows for t in w["real_tokens"][d]) == sum(m[3] for m in record["micro_batches"])


@pytest.mark.parametrize("run", RUNS)
def test_every_document_once_per_epoch_over_the_data_parallel_ranks(runs, run):
    dp, _, _ = RUNS[run]
    _, ranks = runs[run]
    first = [peers[0] for _, peers in sorted(replicas(ranks).items())]
    assert len(first) == dp
    assert len({r["num_batches"] for r in ranks}) == 1
    assert all(len(r["micro_batches"]) == r["num_batches"] for r in ranks)
    seen = [i for r in first for _, idx, fill, _ in r["micro_batches"] for i, f in zip(idx, fill) if not f]
    assert sorted(seen) == list(range(first[0]["num_train"]))


@pytest.mark.parametrize("run", RUNS)
def test_each_update_equals_one_process_token_mean_step(runs, run):
    out, ranks = runs[run]
    first = [peers[0] for _, peers in sorted(replicas(ranks).items())]
    tensors = [torch.load(out / f"rank{r['global_rank']}.pt", weights_only=True) for r in first]
    params = torch.load(out / "params.pt", weights_only=True)
    steps = first[0]["steps"]
    assert len(params) == len(steps) + 1 >= 3
    assert all(r["steps"] == steps for r in ranks)  # every process logs the same global step loss and tokens
    assert {s["mode"] for s in steps} == {"plan"}
    model = TinyLM()
    total_loss, total_tokens = 0.0, 0
    for k, step in enumerate(steps):
        model.load_state_dict(params[k])
        model.zero_grad()
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        for micro in (m for rank_tensors in tensors for m in rank_tensors if m["step"] == k):
            s, n = token_loss_sum(model(micro["input_ids"]), micro["labels"])
            loss_sum, count = loss_sum + s.double(), count + int(n)
        (loss_sum / count).backward()
        assert step["tokens"] == count
        assert step["loss"] == pytest.approx(float(loss_sum.detach() / count), rel=1e-5)
        total_loss, total_tokens = total_loss + float(loss_sum.detach()), total_tokens + count
        moved = 0.0
        for name, p in model.named_parameters():
            expected = p.detach() - LR * p.grad
            torch.testing.assert_close(params[k + 1][name], expected, rtol=0, atol=1e-5)
            moved = max(moved, float((expected - p.detach()).abs().max()))
        assert moved > 1e-2  # the update is large against the tolerance: a wrong scale cannot pass
    assert sum(r["summary_real_tokens"] for r in ranks[:1]) == sum(m[3] for r in first for m in r["micro_batches"])
    assert all(r["summary_rows"] == len(first) for r in ranks)
    assert all(r["train_mean_loss"] == pytest.approx(total_loss / total_tokens, rel=1e-5) for r in ranks)
