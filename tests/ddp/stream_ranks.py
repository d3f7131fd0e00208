"""Ranks of a stream over gloo, without Lightning: each reads, plans and trains its column of a StreamBatches.

Run: python tests/ddp/stream_ranks.py OUT_DIR NUM_RANKS CONFIG_JSON  (forked into NUM_RANKS ranks by launch.py)
CONFIG_JSON keys: seeds (a list: one seeded stream per seed, each to its end, see seeded_config), or kind
(generator | hf | jsonl), seed, num_documents, window, max_tokens, acc, packing, stop_after (micro-batches, or null:
to the end), state_in (a state file to resume from, or null), fail_rank / fail_at (the generator raises on that rank
at that document), shards (hf: rows per shard), paths (jsonl files). Each rank writes OUT_DIR/rank{r}.json: its
micro-batches (indices, is_fill, padded slots), its state after them, and the error it stopped with (or null).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

from lit_balance import BatchingSettings
from lit_balance.stream import StreamBatches, StreamCorpus

from launch import run_as_ranks  # launch.py (the repository root)


def _generator(config, rank):
    def documents():
        rng = np.random.default_rng(config["seed"])
        for i in range(config["num_documents"]):
            if rank == config.get("fail_rank") and i == config.get("fail_at"):
                raise OSError(f"the object store refused shard {i // 100} (rank {rank})")
            yield np.full(int(rng.integers(1, 60)), i % 997 + 1, dtype=np.int64)
    return documents


def _hf(config):
    import datasets

    sizes = config["shards"]

    def rows(shards):
        for shard in shards:
            rng = np.random.default_rng(shard)
            for _ in range(sizes[shard]):
                yield {"input_ids": [shard + 1] * int(rng.integers(1, 60))}
    return datasets.IterableDataset.from_generator(rows, gen_kwargs={"shards": list(range(len(sizes)))})


def seeded_config(seed, num_ranks):
    """A seeded stream and settings: window, accumulation, layout, budget and length of the stream drawn from
    ``seed`` (the window a multiple of one optimizer step)."""
    rng = np.random.default_rng(seed)
    acc = int(rng.integers(1, 4))
    window = num_ranks * acc * int(rng.integers(1, 6))
    return {"kind": "generator", "seed": seed, "num_documents": int(rng.integers(1, 5 * window + 2)),
            "window": window, "max_tokens": int(rng.choice([64, 100, 256])), "acc": acc,
            "packing": bool(rng.integers(2))}


def run_seeds(out, rank, num_ranks, seeds):
    """One stream per seed, each to its end, in this one process group: what each rank trained, per seed."""
    record = {}
    for seed in seeds:
        config = seeded_config(seed, num_ranks)
        settings = BatchingSettings(max_tokens=config["max_tokens"], accumulate_grad_batches=config["acc"],
                                    packing=config["packing"], seed=seed)
        batches = StreamBatches(StreamCorpus(_generator(config, rank)), settings, window_documents=config["window"])
        record[seed] = {"num_documents": config["num_documents"], "max_tokens": config["max_tokens"],
                        "batches": [[b["indices"].tolist(), b["is_fill"].tolist(), int(b["num_padded_tokens"])]
                                    for b in batches]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def main():
    out, num_ranks, config = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=num_ranks, timeout=timedelta(seconds=60))
    if "seeds" in config:
        run_seeds(out, rank, num_ranks, config["seeds"])
        dist.destroy_process_group()
        return
    source = {"generator": lambda: _generator(config, rank), "hf": lambda: _hf(config),
              "jsonl": lambda: [Path(p) for p in config.get("paths", [])]}[config["kind"]]()
    settings = BatchingSettings(max_tokens=config["max_tokens"], accumulate_grad_batches=config["acc"],
                                packing=config["packing"], seed=config["seed"])
    batches = StreamBatches(StreamCorpus(source), settings, window_documents=config["window"])
    if config.get("state_in"):
        batches.load_state_dict(json.loads(Path(config["state_in"]).read_text()))
    record = {"batches": [], "state": None, "error": None, "error_type": None}
    try:
        for batch in batches:
            record["batches"].append([batch["indices"].tolist(), batch["is_fill"].tolist(),
                                      int(batch["num_padded_tokens"])])
            if config.get("stop_after") and len(record["batches"]) == config["stop_after"]:
                break
        record["state"] = batches.state_dict()
    except Exception as error:  # noqa: BLE001 (recorded for the test)
        record["error"], record["error_type"] = str(error), type(error).__name__
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[2]))
