"""A real 2-process torchrun loop (gloo, CPU, no Lightning) resumes mid-epoch exactly with 2 persistent workers, and the
sampler's own state_dict() saved while those workers read ahead is refused or warned."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch import ddp_env, finish, free_ports  # launch.py (the repository root)

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


IDIOM = Path(__file__).with_name("torchrun_state_idiom.py")


def test_saving_the_samplers_own_state_while_workers_read_ahead_is_refused_or_warned(tmp_path):
    """The idiom of a plain loop, ``sampler.state_dict()`` after 5 trained micro-batches while 2 persistent workers
    read ahead: through balanced_dataloader the sampler knows the loop's count and refuses, naming both counts and
    what to call; through a plain DataLoader it sees its micro-batches sent to worker processes and warns once."""
    port, = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                             "--master_addr", "127.0.0.1", "--master_port", str(port), str(IDIOM), str(tmp_path)],
                            env=ddp_env(port, IDIOM.parents[2]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log = finish(proc, 240)
    assert proc.returncode == 0, log[-8000:]
    for r in range(2):
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        refused = record["balanced_dataloader"]
        assert refused["untrained"] is None, f"{len(refused['untrained'])} documents would never train"
        assert refused["error"] is not None
        assert re.fullmatch(
            r"BalancedBatchSampler\.state_dict\(\) was called without batches_consumed while a BalancedDataLoader "
            r"with num_workers=2 reads this sampler: the sampler has handed out (\d+) micro-batches of epoch 0, "
            r"training has consumed 5, so a resume from this state would skip (\d+) that never trained\. Save "
            r"loader\.state_dict\(\) instead \(it counts what training consumed; restore it with "
            r"loader\.load_state_dict\(\.\.\.\)\), or call sampler\.state_dict\(batches_consumed=5\)\.",
            refused["error"])
        handed, skipped = map(int, re.search(r"handed out (\d+).*skip (\d+)", refused["error"]).groups())
        assert handed == 5 + skipped and skipped > 0
        assert refused["warnings"] == []
        warned = record["DataLoader"]
        assert warned["error"] is None
        assert len(warned["warnings"]) == 1  # once, though the state was saved twice
        assert warned["warnings"][0].startswith(
            "RuntimeWarning: BalancedBatchSampler.state_dict() was called without batches_consumed while a "
            "DataLoader's worker processes read this sampler ahead of training: the state counts the ")
        assert warned["warnings"][0].endswith(
            "Build the loader with lit_balance.balanced_dataloader(...) and save loader.state_dict() after the steps "
            "trained (restore it with loader.load_state_dict(...)), or count the micro-batches the loop trained and "
            "call sampler.state_dict(batches_consumed=sampler.start_micro_step + trained).")
        assert warned["untrained"]  # what the warning is about: a resume from that state skips documents
