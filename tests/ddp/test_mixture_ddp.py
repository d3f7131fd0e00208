"""A mixture of three components, each written by its own producer (a Megatron store by megatron-core's
IndexedDatasetBuilder, an Arrow file by pyarrow, a JSONL file), trained on real 2-process CPU DDP (gloo), stopped
mid-epoch and resumed on 3 ranks and on 1: per component, exactly the documents of an uninterrupted run, and exactly its
tokens as MixtureMonitor logs them per step and rank; and the validation loss of every component logged as
val/loss/<name> beside val/loss."""

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real multi-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_mixture.py")
ROOT = SCRIPT.parents[2]
STOP_AT = 3  # as fit_mixture.py


def _write_components(data: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.data._stores import documents, write_arrow_ipc_file, write_megatron

    write_megatron(data / "megatron", documents(90, seed=3, longest=40, empty_every=0))
    write_arrow_ipc_file(data / "docs.arrow", documents(60, seed=4, longest=30, empty_every=0))
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    lines = [json.dumps({"text": " ".join(words[(i * j) % 10] for j in range(3 + i % 25))}) for i in range(80)]
    (data / "docs.jsonl").write_text("\n".join(lines) + "\n")


def _read(out: Path, phase: str, devices: int) -> list[dict]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("components")
    _write_components(data)
    stop_dir, full_dir = tmp_path_factory.mktemp("stop"), tmp_path_factory.mktemp("full")
    run_scripts(SCRIPT, {"stop": [stop_dir, data, "stop", 2], "full": [full_dir, data, "full", 2]}, 400)
    outs = {}
    for devices in (1, 3):
        outs[devices] = tmp_path_factory.mktemp(f"resume{devices}")
        shutil.copy(stop_dir / "mid.ckpt", outs[devices] / "mid.ckpt")
    run_scripts(SCRIPT, {devices: [out, data, "resume", devices] for devices, out in outs.items()}, 400)
    return (_read(stop_dir, "stop", 2), _read(full_dir, "full", 2),
            {devices: _read(out, "resume", devices) for devices, out in outs.items()})


def _documents(ranks: list[dict]) -> Counter:
    return Counter((c, d) for rank in ranks for batch in rank["batches"] for c, d in batch)


@pytest.mark.parametrize("devices", [3, 1])
def test_resume_on_another_world_reads_per_component_exactly_the_uninterrupted_documents(runs, devices):
    stopped, uninterrupted, resumed = runs
    assert all(len(rank["batches"]) == STOP_AT for rank in stopped)
    full = _documents(uninterrupted)
    assert max(full.values()) == 1  # every chosen document once
    assert {c for c, _ in full} == {0, 1, 2}  # all three components trained
    assert _documents(stopped) + _documents(resumed[devices]) == full
    assert len({len(rank["batches"]) for rank in resumed[devices]}) == 1  # equal counts on the new ranks


def test_validation_loss_is_logged_per_component(runs):
    _, uninterrupted, resumed = runs
    for ranks in (uninterrupted, resumed[1]):
        names = ranks[0]["names"]
        assert ranks[0]["val_names"] == names
        assert {"val/loss", *(f"val/loss/{n}" for n in names)} <= set(ranks[0]["metrics"])


def _logged_tokens(ranks: list[dict], world: int) -> tuple[Counter, list[int]]:
    """Each component's real and supervised tokens over the steps MixtureMonitor logged (rank 0's logger), checking
    that every step's global figure is the sum of its ranks' and that exactly ``world`` ranks are logged."""
    names, totals, steps = ranks[0]["names"], Counter(), []
    for step, metrics in ranks[0]["logged"]:
        steps.append(step)
        for name in names:
            for kind in ("tokens", "supervised_tokens"):
                per_rank = [metrics[f"train/{kind}/{name}_rank{r}"] for r in range(world)]
                assert metrics[f"train/{kind}/{name}"] == sum(per_rank)
                totals[(kind, name)] += metrics[f"train/{kind}/{name}"]
        assert f"train/tokens/{names[0]}_rank{world}" not in metrics
    return totals, steps


@pytest.mark.parametrize("devices", [3, 1])
def test_each_components_logged_tokens_add_up_over_a_resume_on_another_world(runs, devices):
    stopped, uninterrupted, resumed = runs
    before, stop_steps = _logged_tokens(stopped, 2)
    after, resume_steps = _logged_tokens(resumed[devices], devices)
    full, full_steps = _logged_tokens(uninterrupted, 2)
    assert stop_steps == list(range(STOP_AT)) and resume_steps[0] == STOP_AT  # one step per micro-batch, each once
    assert full_steps == list(range(len(full_steps)))
    assert all(full[("tokens", name)] > 0 for name in uninterrupted[0]["names"])
    assert before + after == full
