"""The data-parallel world of a torchrun loop without Lightning, on a real 4-process (dp=2, tp=2) gloo mesh."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ddp_env, finish, free_ports  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("torchrun_world.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun_world")
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT), str(out)],
                            env=ddp_env(port, SCRIPT.parents[2]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log = finish(proc, 240)
    assert proc.returncode == 0, log[-8000:]
    return [json.loads((out / f"rank{g}.json").read_text()) for g in range(4)]


def test_the_world_is_the_mesh_dp_dimension(ranks):
    # mesh (dp, tp) row-major: global rank g is dp rank g // 2; dp groups {0, 2} and {1, 3}
    assert [r["world"] for r in ranks] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert [r["by_group"] for r in ranks] == [r["world"] for r in ranks]


def test_collectives_run_over_the_data_parallel_group_only(ranks):
    assert [r["gathered"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["summed"] for r in ranks] == [2, 4, 2, 4]
    assert [r["broadcast"] for r in ranks] == [2, 3, 2, 3]  # dp rank 1 of each group: global ranks 2 and 3


def test_sampler_defaults_come_from_the_process_group_given(ranks):
    assert [r["sampler"] for r in ranks] == [r["world"] for r in ranks]
    assert ranks[0]["indices"] == ranks[1]["indices"] and ranks[2]["indices"] == ranks[3]["indices"]
    seen = sorted(i for r in (ranks[0], ranks[2]) for b in r["indices"] for i in b)
    assert seen == list(range(120))


def test_metric_sums_over_the_data_parallel_group(ranks):
    # group {0, 2}: (10 + 0 + 30 + 2) / (2 + 1 + 6 + 1); group {1, 3}: (20 + 1 + 40 + 3) / (4 + 1 + 8 + 1)
    assert [r["metric"] for r in ranks] == pytest.approx([42 / 10, 64 / 14, 42 / 10, 64 / 14])
