"""Whether every process planned the same data: a fingerprint of each rank's plan, compared in one all_gather.

:class:`lit_balance.BalancedTextDataModule` tokenizes, splits and plans on every rank independently (no rank sends
data to another). Ranks that read different corpus copies, tokenizers or settings would then train on plans that do
not fit together, silently. :func:`check_ranks_agree` catches that at ``setup``: every process contributes the
fingerprint of what it planned (:func:`plan_fingerprint`) to one ``all_gather`` of a small int64 tensor, and every
process raises, naming the ranks and fields that differ, when any does.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lit_balance._fingerprint import sha256_of, sha256_of_int64

__all__ = ["FINGERPRINT_FIELDS", "check_ranks_agree", "plan_fingerprint"]

#: Names of the fingerprint's fields, in order (see :func:`plan_fingerprint`).
FINGERPRINT_FIELDS = ("documents", "corpus token lengths", "tokenizer", "max_length", "seed", "val_fraction",
                      "batching settings", "training lengths", "validation lengths")


def _digest(*parts: str | bytes) -> int:
    """The first 8 bytes of :func:`sha256_of` as a signed int64."""
    return int.from_bytes(bytes.fromhex(sha256_of(*parts))[:8], "little", signed=True)


def _lengths_digest(values: Any, sha256: str | None = None) -> int:
    """The first 8 bytes of the int64 lengths' sha256 (hashed in chunks, no whole copy; ``sha256``: that hex digest,
    already known) as a signed int64."""
    return int.from_bytes(bytes.fromhex(sha256 or sha256_of_int64(np.asarray(values)))[:8], "little", signed=True)


def plan_fingerprint(*, corpus_lengths: Any, tokenizer_fingerprint: str, max_length: int | None, seed: int,
                     val_fraction: float, settings: dict[str, Any], train_lengths: Any,
                     val_lengths: Any = None, train_lengths_sha256: str | None = None) -> list[tuple[str, int, bool]]:
    """What one rank planned, as ``(field, int64 value, shown)`` per :data:`FINGERPRINT_FIELDS`.

    A field is a count or setting shown as it is (``shown``: its value helps the message), or the first 8 bytes of
    a sha256 (corpus and split token lengths, tokenizer, ``val_fraction``, batching settings).

    Args:
        corpus_lengths: int ``[num_documents]``: tokens of every corpus document (before truncation).
        tokenizer_fingerprint: the tokenizer's content fingerprint.
        max_length: truncation in tokens, or None.
        seed: the split's and samplers' seed.
        val_fraction: the share held out for validation.
        settings: the training sampler's batching settings as a dict of plain values.
        train_lengths, val_lengths: int tokens per item of the training and validation split (None: no
            validation split).
        train_lengths_sha256: the sha256 (hex) of ``train_lengths`` as little-endian int64 when already computed
            (the training sampler's :attr:`~lit_balance.BalancedBatchSampler.lengths_sha256`), or None to hash them.

    Example:
        >>> fields = plan_fingerprint(corpus_lengths=[3, 4], tokenizer_fingerprint="t", max_length=None, seed=0,
        ...                           val_fraction=0.0, settings={"max_tokens": 8}, train_lengths=[3, 4])
        >>> [(name, value) for name, value, shown in fields if shown]
        [('documents', 2), ('max_length', -1), ('seed', 0)]
    """
    empty = np.empty(0, np.int64)
    train_digest = _lengths_digest(train_lengths, train_lengths_sha256)
    # every document trains untruncated: the training split's lengths are the corpus's array, hashed once
    corpus_digest = train_digest if train_lengths is corpus_lengths else _lengths_digest(corpus_lengths)
    values = [
        (len(corpus_lengths), True),
        (corpus_digest, False),
        (_digest(tokenizer_fingerprint), False),
        (-1 if max_length is None else int(max_length), True),
        (int(seed), True),
        (_digest(repr(float(val_fraction))), False),
        (_digest(json.dumps(settings, sort_keys=True)), False),
        (train_digest, False),
        (_lengths_digest(empty if val_lengths is None else val_lengths), False),
    ]
    return [(name, value, shown) for name, (value, shown) in zip(FINGERPRINT_FIELDS, values)]


def _process_group_ready() -> bool:
    """Whether a torch.distributed process group exists (Lightning's DDP creates it before ``setup``)."""
    return dist.is_available() and dist.is_initialized()


def check_ranks_agree(trainer: Any, fields: list[tuple[str, int, bool]] | None,
                      error: BaseException | None = None, *, owner: str = "BalancedTextDataModule.setup") -> None:
    """Compare what every process planned; every process raises when any differs or failed.

    Gathers over **every process** of the Trainer (``trainer.world_size``, ``trainer.global_rank``, through
    ``trainer.strategy.all_gather``), not over the data-parallel ranks of :func:`lit_balance.world.data_parallel_world`
    alone: every process must hold the same corpus and settings, whatever part of the data it trains on. One
    ``all_gather`` of an int64 tensor ``[1 + len(FINGERPRINT_FIELDS)]`` per process (a failure flag, then the
    fingerprint), taken by every process even when its own planning failed (``error``), so that none waits for one
    that stopped. Without a Trainer, with one process, or without an initialised process group (ranks simulated by
    hand) it only raises ``error``.

    Args:
        trainer: the Lightning ``Trainer`` (or None).
        fields: this process's :func:`plan_fingerprint`; None when its planning failed.
        error: the exception of this process's planning, or None.
        owner: what planned, for the messages.

    Raises:
        BaseException: ``error`` itself, on the process whose planning failed (after the gather).
        RuntimeError: another process's planning failed, or the processes planned different data (naming the ranks,
            what differs, and the likely causes).
    """
    if error is None and fields is None:
        error = RuntimeError(f"{owner}: check_ranks_agree needs this rank's fingerprint (fields) or its error")
    if trainer is None or trainer.world_size <= 1 or not _process_group_ready():
        if error is not None:
            raise error
        return
    failed_row = [1] + [0] * len(FINGERPRINT_FIELDS)
    local = torch.tensor(failed_row if error is not None else [0] + [v for _, v, _ in fields], dtype=torch.int64)
    gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device))
    table = gathered.cpu().reshape(trainer.world_size, -1).tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        raise RuntimeError(f"{owner} failed on rank(s) {failed} (see their error); rank {trainer.global_rank} stops "
                           "too, so that no rank waits for the others")
    reference = table[0]
    differ = [r for r, row in enumerate(table) if row != reference]
    if not differ:
        return
    parts = []
    for i, (name, _, shown) in enumerate(fields, start=1):
        values = [row[i] for row in table]
        if len(set(values)) == 1:
            continue
        if shown:
            parts.append(f"{name}: " + ", ".join(f"rank {r} has {v}" for r, v in enumerate(values)))
        else:
            others = [r for r, v in enumerate(values) if v != values[0]]
            parts.append(f"{name} differ on rank(s) {others} from rank 0's")
    raise RuntimeError(
        f"ranks planned different data: rank(s) {differ} differ from rank 0 ({'; '.join(parts)}); every rank "
        "must tokenize the same corpus with the same tokenizer and settings. Likely causes: per-node corpus "
        "copies that differ (a stale copy on one node), a different tokenizer or tokenizer version, a "
        "different max_length, seed or val_fraction; make them the same on every rank"
    )
