"""Tokenized stores written by their own producers (megatron-core, datasets, pyarrow), for the store tests."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

VOCAB = 500  # ids of the generated documents lie in [1, VOCAB)


def documents(num: int = 120, seed: int = 0, longest: int = 40, empty_every: int = 17) -> list[list[int]]:
    """Deterministic token-id documents of 0 to ``longest`` tokens (every ``empty_every``-th one empty)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(num):
        n = 0 if empty_every and i % empty_every == 5 else int(rng.integers(1, longest + 1))
        docs.append(rng.integers(1, VOCAB, size=n).tolist())
    return docs


def masked_labels(docs: list[list[int]]) -> list[list[int]]:
    """Labels of each document: its ids, the first third of each masked with -100 (a prompt)."""
    return [[-100] * (len(d) // 3) + d[len(d) // 3:] for d in docs]


def write_megatron(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> Path:
    """``prefix.bin`` / ``prefix.idx`` written by megatron-core's ``IndexedDatasetBuilder``, one document each."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        if doc:
            builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_save_to_disk(path: Path, docs: list[list[int]], labels: list[list[int]] | None = None,
                       num_shards: int = 2) -> Path:
    """A ``datasets.Dataset.save_to_disk`` directory with ``input_ids`` (and ``labels``)."""
    import datasets

    columns = {"input_ids": docs} if labels is None else {"input_ids": docs, "labels": labels}
    features = {"input_ids": datasets.List(datasets.Value("int32"))}
    if labels is not None:
        features["labels"] = datasets.List(datasets.Value("int32"))
    dataset = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    dataset.save_to_disk(str(path), num_shards=num_shards)
    return path


def write_to_parquet(path: Path, docs: list[list[int]], labels: list[list[int]] | None = None,
                     batch_size: int = 25) -> Path:
    """A Parquet file written by ``datasets.Dataset.to_parquet`` (row groups of ``batch_size`` rows)."""
    import datasets

    columns = {"input_ids": docs} if labels is None else {"input_ids": docs, "labels": labels}
    datasets.Dataset.from_dict(columns).to_parquet(str(path), batch_size=batch_size)
    return path


def write_arrow_ipc_file(path: Path, docs: list[list[int]], batch_rows: int = 30) -> Path:
    """An Arrow IPC file (file format) written by ``pyarrow.ipc.new_file`` in record batches of ``batch_rows``."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, len(docs), batch_rows):
            writer.write_batch(pa.record_batch([pa.array(docs[start:start + batch_rows], pa.list_(pa.int32()))],
                                               schema=schema))
    return path
