"""A real 2-process torchrun loop (gloo, CPU, no Lightning) resumes mid-epoch exactly with 2 persistent workers."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from _procs import ddp_env, finish, free_ports  # tests/ddp/_procs.py

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # 2 processes under torchrun, each with 2 DataLoader workers

SCRIPT = Path(__file__).with_name("torchrun_resume.py")


def test_torchrun_loop_resumes_mid_epoch_with_persistent_workers(tmp_path):
    port, = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                             "--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT), str(tmp_path)],
                            env=ddp_env(port, SCRIPT.parents[2]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log = finish(proc, 240)
    assert proc.returncode == 0, log[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["states_equal"] and r["segments"] == [[2, 5]] for r in ranks)  # the steps trained, not fetched
    trained = Counter(i for r in ranks for batch in r["before"] + r["after"] for i in batch)
    whole = Counter(i for r in ranks for batch in r["whole"] for i in batch)
    assert trained == whole  # nothing skipped, nothing repeated
    assert sorted(trained) == list(range(200))
    for r in ranks:
        assert r["before"] + r["after"] == r["whole"]  # and in the uninterrupted order
