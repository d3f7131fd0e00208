"""A plain torchrun training loop (no Lightning) that stops mid-epoch and resumes, with 2 persistent DataLoader workers.

Run by tests/ddp/test_torchrun_resume_ddp.py as ``python -m torch.distributed.run --nproc_per_node 2 torchrun_resume.py
OUT``. Each rank trains CUT micro-batches of epoch 0 (a DDP model over gloo), rank 0 saves the loader's state with
``torch.save``; then fresh loaders load it with ``torch.load(weights_only=True)`` and train the rest of the epoch; then
an uninterrupted epoch 0 runs for comparison. Each rank writes OUT/rank<r>.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader

CUT, MAX_TOKENS = 5, 64


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rng = np.random.default_rng(11)
    items = [{"input_ids": rng.integers(1, 50, size=int(n)).tolist()} for n in rng.integers(1, 30, 200)]
    train = MicroBatchDataset(items, length="input_ids")
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0)
    model = DistributedDataParallel(torch.nn.Embedding(50, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loader():  # num_replicas and rank from the initialised process group
        sampler = BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=2)
        return balanced_dataloader(train, sampler, collate, num_workers=2, persistent_workers=True)

    def step(batch) -> list[int]:
        optimizer.zero_grad()
        model(batch["input_ids"]).pow(2).mean().backward()  # DDP all-reduces the gradients over both ranks
        optimizer.step()
        return batch["indices"].tolist()

    first = loader()
    iterator = iter(first)
    before = [step(next(iterator)) for _ in range(CUT)]
    state = first.state_dict()
    states = [None, None]
    dist.all_gather_object(states, state)
    if rank == 0:
        torch.save(state, out / "state.pt")
    del iterator, first
    dist.barrier()

    resumed = loader()
    resumed.load_state_dict(torch.load(out / "state.pt", weights_only=True))
    after = [step(batch) for batch in resumed]
    whole = [step(batch) for batch in loader()]
    record = {"before": before, "after": after, "whole": whole, "states_equal": states[0] == states[1],
              "segments": state["sampler"]["segments"]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
