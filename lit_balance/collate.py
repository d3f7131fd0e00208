"""Pad-to-longest collation that counts real tokens and padded slots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "PadCollator"]

#: Label value ignored by :func:`torch.nn.functional.cross_entropy` (its default ``ignore_index``).
IGNORE_INDEX = -100


class PadCollator:
    """Pad a micro-batch to its longest row (rounded up to ``pad_to_multiple_of``), never to a model maximum.

    Each sample is a mapping with ``input_ids`` (1-D ints: token ids), ``index`` (int: dataset index)
    and, optionally, ``is_fill`` (bool: a fill row, see :class:`lit_balance.MicroBatch`) and ``labels``
    (1-D ints as long as ``input_ids``: unshifted labels, ``-100`` where a token has no target, e.g. a
    prompt's tokens).

    The batch is a dict, with ``B`` rows padded to ``T = padded(max row length)`` tokens:

    * ``input_ids``: LongTensor ``[B, T]``, ``pad_token_id`` after each row's end.
    * ``attention_mask``: LongTensor ``[B, T]``, 1 on real tokens, 0 on padding.
    * ``labels``: LongTensor ``[B, T]``, the sample's ``labels`` (or, without them, ``input_ids``) on real
      tokens of real rows and ``-100`` on padding and on every token of a fill row (unshifted: a causal LM
      shifts them itself).
    * ``indices``: LongTensor ``[B]``, the dataset index of each row.
    * ``is_fill``: BoolTensor ``[B]``, True for fill rows.
    * ``num_real_tokens``: int, non-padding tokens in the micro-batch (``attention_mask.sum()``), per rank.
    * ``num_padded_tokens``: int, padded token slots ``B * T`` (real plus padding), per rank; the
      micro-batch's padding ratio is ``1 - num_real_tokens / num_padded_tokens``.

    When the samples carry the plan's ``step_real_tokens`` and ``step_rows`` (see
    :class:`lit_balance.TokenDataset`), the batch also carries them (ints, global: all ranks and all
    micro-batches of the micro-batch's optimizer step, fill rows excluded) and ``step_supervised_tokens``: the
    tokens with a next-token target in that step, the divisor of :class:`lit_balance.loss.StepTokenLoss`. It is
    the samples' ``step_supervised_tokens`` when they carry it (the plan counts masked labels exactly, see
    ``supervised_lengths`` of :class:`lit_balance.BalancedBatchSampler`), else ``step_real_tokens - step_rows``
    (a row of ``l`` tokens without masked labels supervises ``l - 1``).

    Args:
        pad_token_id: token id written into padding positions.
        pad_to_multiple_of: ``T`` is rounded up to a multiple of this (tokens), e.g. 8 for tensor cores.
        max_length: rows longer than this many tokens are truncated (e.g. the sampler's ``truncate_to``
            with ``too_long="truncate"``), or None to keep them whole.

    Raises:
        ValueError: bad arguments; an empty micro-batch or a row with no tokens (at call time).

    Example:
        >>> collate = PadCollator(pad_token_id=0, pad_to_multiple_of=4)
        >>> batch = collate([{"input_ids": [5, 6, 7], "index": 3}, {"input_ids": [8], "index": 9}])
        >>> batch["input_ids"].tolist(), batch["num_real_tokens"], batch["num_padded_tokens"]
        ([[5, 6, 7, 0], [8, 0, 0, 0]], 4, 8)
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, max_length: int | None = None) -> None:
        for name, value, low in (("pad_token_id", pad_token_id, 0), ("pad_to_multiple_of", pad_to_multiple_of, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer))
                                       or max_length < 1):
            raise ValueError(f"max_length must be an int >= 1 or None, got {max_length!r}")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.max_length = None if max_length is None else int(max_length)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(samples) == 0:
            raise ValueError("cannot collate an empty micro-batch: the sampler yielded no indices")
        rows, row_labels = [], []
        for s in samples:
            ids = torch.from_numpy(np.array(s["input_ids"], dtype=np.int64)).reshape(-1)  # a writable copy
            label = None
            if s.get("labels") is not None:
                label = torch.from_numpy(np.array(s["labels"], dtype=np.int64)).reshape(-1)
                if label.numel() != ids.numel():
                    raise ValueError(f"sample at dataset index {s.get('index')} has {label.numel()} labels for "
                                     f"{ids.numel()} input_ids; give one (unshifted) label per token")
            if self.max_length is not None:
                ids = ids[: self.max_length]
                label = None if label is None else label[: self.max_length]
            if ids.numel() == 0:
                raise ValueError(f"sample at dataset index {s.get('index')} has no tokens; remove empty documents")
            rows.append(ids)
            row_labels.append(label)
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.long)
        m = self.pad_to_multiple_of
        width = -(-int(lengths.max()) // m) * m
        batch_size = len(rows)
        input_ids = torch.full((batch_size, width), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : r.numel()] = r
        attention_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        is_fill = torch.tensor([bool(s.get("is_fill", False)) for s in samples], dtype=torch.bool)
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        for i, label in enumerate(row_labels):
            if label is not None:
                labels[i, : label.numel()] = label
        labels[is_fill] = IGNORE_INDEX
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "indices": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
            "is_fill": is_fill,
            "num_real_tokens": int(lengths.sum()),
            "num_padded_tokens": batch_size * width,
        }
        first = samples[0]
        if "step_real_tokens" in first and "step_rows" in first:
            batch["step_real_tokens"] = int(first["step_real_tokens"])
            batch["step_rows"] = int(first["step_rows"])
            planned = first.get("step_supervised_tokens")
            batch["step_supervised_tokens"] = (batch["step_real_tokens"] - batch["step_rows"] if planned is None
                                               else int(planned))
        return batch
