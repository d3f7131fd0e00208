"""The data-parallel world of real 2-process Fabric runs (gloo): DDP (every process a replica) and tensor parallel
(one replica of 2 processes), its collectives through Fabric's strategy."""

from pathlib import Path

import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("fabric_world.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(SCRIPT, {mode: (tmp_path_factory.mktemp(mode), [mode]) for mode in ("ddp", "tp")}, 240)


def test_ddp_every_process_is_a_replica(runs):
    ranks = runs["ddp"]
    assert [r["world"] for r in ranks] == [[0, 2], [1, 2]]
    assert [r["gathered"] for r in ranks] == [[1.0, 2.0]] * 2
    assert [r["summed"] for r in ranks] == [3.0, 3.0] and [r["broadcast"] for r in ranks] == [1.0, 1.0]
    assert sorted(i for r in ranks for b in r["indices"] for i in b) == list(range(80))


def test_tensor_parallel_processes_are_one_replica_with_the_same_data(runs):
    ranks = runs["tp"]
    assert [r["world"] for r in ranks] == [[0, 1], [0, 1]]
    # one data-parallel rank: every figure is this process's own, nothing summed over the replica's peers
    assert [r["gathered"] for r in ranks] == [[1.0], [2.0]] and [r["summed"] for r in ranks] == [1.0, 2.0]
    assert ranks[0]["indices"] == ranks[1]["indices"]
    assert sorted(i for b in ranks[0]["indices"] for i in b) == list(range(80))
