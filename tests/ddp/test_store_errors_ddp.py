"""A store document that only rank 1 reads holds an id beyond the vocabulary: on real 2-process CPU DDP (gloo), with
and without DataLoader workers, both ranks stop well within the process group's timeout and each one's error names
the real cause (the file, the document, the id), not only gloo's "Connection closed by peer"."""

import json
import sys
import time
from pathlib import Path

import pytest

from launch import run_script  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

SCRIPT = Path(__file__).with_name("fit_bad_store.py")
ROOT = SCRIPT.parents[2]
BAD_ID = 777


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, int]:
    """A Megatron store (megatron-core's IndexedDatasetBuilder) whose document ``bad``, planned into rank 1's fourth
    micro-batch and never onto rank 0, holds the id 777 (the vocabulary is 500)."""
    sys.path.insert(0, str(ROOT))
    import fit_bad_store

    from lit_balance.sampler import BalancedBatchSampler
    from tests.data._stores import documents, write_megatron

    root = tmp_path_factory.mktemp("bad_store")
    docs = documents(200, seed=4, longest=40, empty_every=0)
    prefix = write_megatron(root / "corpus", docs)
    dm = fit_bad_store.datamodule(str(prefix))
    dm.setup("fit")  # no Trainer: the plan of every rank is computed here as each rank computes its own

    def planned(rank: int) -> list[list[int]]:
        sampler = BalancedBatchSampler(dm.train_dataset.lengths, settings=dm.settings, num_replicas=2, rank=rank)
        sampler.set_epoch(0)
        return [[int(i) for i in micro_batch] for micro_batch in sampler]

    on_rank0 = {i for micro_batch in planned(0) for i in micro_batch}
    bad = next(i for i in planned(1)[3] if i not in on_rank0)  # no empty document: dataset index = store document
    docs[bad][0] = BAD_ID
    write_megatron(root / "corpus", docs)  # same lengths: the same plan
    return prefix, bad


@pytest.mark.parametrize("workers", [0, 1])
def test_every_rank_names_the_document_only_rank_1_read(store, tmp_path, workers):
    import fit_bad_store

    prefix, bad = store
    code, log = run_script(SCRIPT, [tmp_path, prefix, workers], 300)  # start-up included; the timeout is 40 s
    ended = time.time()
    assert code != 0
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    # both ranks, and the whole job, ended well within the process group's timeout after rank 1 failed
    assert ended - ranks[1]["time"] < fit_bad_store.PG_TIMEOUT_S, (ended - ranks[1]["time"], log[-4000:])
    assert abs(ranks[0]["time"] - ranks[1]["time"]) < fit_bad_store.PG_TIMEOUT_S
    cause = f"document {bad} of {prefix}.bin holds the token id {BAD_ID} at position 0"
    assert cause in log  # the job's output holds the real message
    assert cause in ranks[1]["error"]
    assert cause in ranks[0]["error"] and "rank 1 stopped first" in ranks[0]["error"], ranks[0]["error"]
