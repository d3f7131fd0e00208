"""The wrong resume idiom of a plain torchrun loop: saving the sampler's own state_dict() while 2 persistent DataLoader
workers read it ahead of training.

Run by tests/ddp/test_torchrun_resume_ddp.py as ``python -m torch.distributed.run --nproc_per_node 2
torchrun_state_idiom.py OUT``. Each rank trains CUT micro-batches of epoch 0 (a DDP model over gloo) twice: through
balanced_dataloader (a BalancedDataLoader), then through a plain ``DataLoader(batch_sampler=sampler)``; after each it
calls ``sampler.state_dict()`` with no count and records what happened (the error, the warnings), and, where a state
came back, which documents a resume from it would never train. Each rank writes OUT/rank<r>.json.
"""

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lit_balance import BalancedBatchSampler, MicroBatchDataset, PadFieldsCollator, balanced_dataloader

CUT, MAX_TOKENS = 5, 64


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rng = np.random.default_rng(3)
    items = [{"input_ids": rng.integers(1, 50, size=int(n)).tolist()} for n in rng.integers(1, 30, 257)]
    train = MicroBatchDataset(items, length="input_ids")
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0)
    model = DistributedDataParallel(torch.nn.Embedding(50, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def sampler() -> BalancedBatchSampler:  # num_replicas and rank from the initialised process group
        return BalancedBatchSampler(train.lengths, max_tokens=MAX_TOKENS, seed=2)

    def step(batch) -> list[int]:
        optimizer.zero_grad()
        model(batch["input_ids"]).pow(2).mean().backward()  # DDP all-reduces the gradients over both ranks
        optimizer.step()
        return batch["indices"].tolist()

    def save_the_samplers_state(loader: DataLoader, used: BalancedBatchSampler) -> dict:
        iterator = iter(loader)
        trained = [step(next(iterator)) for _ in range(CUT)]
        record = {"error": None, "warnings": [], "untrained": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = used.state_dict()  # the wrong idiom: the workers have read ahead of the CUT steps trained
                used.state_dict()  # a second save: a warning comes once per sampler
            except RuntimeError as error:
                record["error"], state = str(error), None
        record["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                              if issubclass(w.category, RuntimeWarning)]
        if state is not None:  # what a resume from it would train, against the whole epoch
            fresh = sampler()
            fresh.load_state_dict(state)
            rest = [list(b) for b in fresh]
            whole = [list(b) for b in sampler()]
            seen = {i for batch in trained + rest for i in batch}
            record["untrained"] = sorted({i for batch in whole for i in batch} - seen)
        return record

    first = sampler()
    records = {"balanced_dataloader": save_the_samplers_state(
        balanced_dataloader(train, first, collate, num_workers=2, persistent_workers=True), first)}
    second = sampler()
    records["DataLoader"] = save_the_samplers_state(
        DataLoader(train, batch_sampler=second, collate_fn=collate, num_workers=2, persistent_workers=True), second)
    (out / f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
