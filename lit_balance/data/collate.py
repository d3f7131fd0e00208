"""Collation of micro-batches: pad to the longest row, or pack whole documents into one row; count tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["IGNORE_INDEX", "PackedCollator", "PadCollator", "collator_for"]


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
    tokens with a next-token target in that step, the divisor of :class:`lit_balance.StepTokenLoss`. It is
    the samples' ``step_supervised_tokens`` when they carry it (the plan counts masked labels exactly, see
    ``supervised_lengths`` of :class:`lit_balance.BalancedBatchSampler`), else ``step_real_tokens - step_rows``
    (a row of ``l`` tokens without masked labels supervises ``l - 1``).

    **Static shapes** (``shapes``, from ``BatchingSettings(padded_shapes=...)``): the batch is padded to the shape
    ``(R, T)`` of fewest slots that holds its ``B`` rows and longest row (:func:`lit_balance.plan.shapes.shape_index`):
    ``input_ids``, ``attention_mask`` and ``labels`` are ``[R, T]``, rows ``B ... R - 1`` empty (``pad_token_id``,
    attention mask 0, labels -100); ``indices`` and ``is_fill`` keep the ``B`` rows of the micro-batch, and
    ``num_padded_tokens`` is ``R * T``.

    Args:
        pad_token_id: token id written into padding positions.
        pad_to_multiple_of: ``T`` is rounded up to a multiple of this (tokens), e.g. 8 for tensor cores.
        max_length: rows longer than this many tokens are truncated (e.g. the sampler's ``truncate_to``
            with ``too_long="truncate"``), or None to keep them whole.
        shapes: ``(rows, length)`` pairs: every batch has one of these shapes; None (default) for free shapes.

    Raises:
        ValueError: bad arguments; an empty micro-batch or a row with no tokens (at call time); with ``shapes``, a
            micro-batch that no shape holds (naming its rows and longest row).

    Example:
        >>> collate = PadCollator(pad_token_id=0, pad_to_multiple_of=4)
        >>> batch = collate([{"input_ids": [5, 6, 7], "index": 3}, {"input_ids": [8], "index": 9}])
        >>> batch["input_ids"].tolist(), batch["num_real_tokens"], batch["num_padded_tokens"]
        ([[5, 6, 7, 0], [8, 0, 0, 0]], 4, 8)
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, max_length: int | None = None,
                 shapes: Sequence[Sequence[int]] | None = None) -> None:
        _check_collator_args(pad_token_id, pad_to_multiple_of, max_length)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.max_length = None if max_length is None else int(max_length)
        self.shapes = None
        if shapes is not None:
            if len(shapes) == 0 or any(len(s) != 2 or int(s[0]) < 1 or int(s[1]) < 1 for s in shapes):
                raise InputValueError(f"shapes must be a non-empty list of (rows, length) pairs of ints >= 1, got "
                                      f"{shapes!r}; pass BatchingSettings.padded_shapes as chosen by the sampler",
                                      parameter="shapes")
            self.shapes = tuple(sorted(((int(r), int(t)) for r, t in shapes), key=lambda s: (s[1], s[0])))

    def _shape(self, batch_size: int, width: int) -> tuple[int, int]:
        """``(rows, length)`` to pad a batch of ``batch_size`` rows of at most ``width`` tokens to."""
        if self.shapes is None:
            return batch_size, width
        from lit_balance.plan.shapes import shape_index

        k = int(shape_index(self.shapes, np.array([batch_size]), np.array([width]))[0])
        if k < 0:
            raise InputValueError(f"a micro-batch of {batch_size} rows, the longest {width} tokens, fits none of the "
                                  f"padded_shapes {[list(s) for s in self.shapes]}; collate the micro-batches of the "
                                  "sampler planned with these padded_shapes", parameter="padded_shapes")
        return self.shapes[k]

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(samples) == 0:
            raise InputValueError("cannot collate an empty micro-batch: the sampler yielded no indices")
        rows, row_labels = [], []
        for s in samples:
            ids = torch.from_numpy(np.array(s["input_ids"], dtype=np.int64)).reshape(-1)  # a writable copy
            label = None
            if s.get("labels") is not None:
                label = torch.from_numpy(np.array(s["labels"], dtype=np.int64)).reshape(-1)
                if label.numel() != ids.numel():
                    raise InputValueError(f"sample at dataset index {s.get('index')} has {label.numel()} labels for "
                                          f"{ids.numel()} input_ids; give one (unshifted) label per token")
            if self.max_length is not None:
                ids = ids[: self.max_length]
                label = None if label is None else label[: self.max_length]
            if ids.numel() == 0:
                raise InputValueError(f"sample at dataset index {s.get('index')} has no tokens; remove empty documents")
            rows.append(ids)
            row_labels.append(label)
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.long)
        m = self.pad_to_multiple_of
        width = -(-int(lengths.max()) // m) * m
        batch_size = len(rows)
        num_rows, width = self._shape(batch_size, width)
        input_ids = torch.full((num_rows, width), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : r.numel()] = r
        if num_rows > batch_size:  # static shape: empty rows at the end
            lengths = torch.cat([lengths, torch.zeros(num_rows - batch_size, dtype=torch.long)])
        attention_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        is_fill = torch.tensor([bool(s.get("is_fill", False)) for s in samples], dtype=torch.bool)
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        for i, label in enumerate(row_labels):
            if label is not None:
                labels[i, : label.numel()] = label
        labels[:batch_size][is_fill] = IGNORE_INDEX
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "indices": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
            "is_fill": is_fill,
            "num_real_tokens": int(lengths.sum()),
            "num_padded_tokens": num_rows * width,
        }
        batch.update(_step_totals(samples[0]))
        return batch


def _check_collator_args(pad_token_id: Any, pad_to_multiple_of: Any, max_length: Any) -> None:
    for name, value, low in (("pad_token_id", pad_token_id, 0), ("pad_to_multiple_of", pad_to_multiple_of, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InputValueError(f"{name} must be an int >= {low}, got {value!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer))
                                   or max_length < 1):
        raise InputValueError(f"max_length must be an int >= 1 or None, got {max_length!r}")


def _step_totals(first: Mapping[str, Any]) -> dict[str, int]:
    """The plan's per-optimizer-step totals carried by the micro-batch's samples (global ints), if any."""
    if "step_real_tokens" not in first or "step_rows" not in first:
        return {}
    out = {"step_real_tokens": int(first["step_real_tokens"]), "step_rows": int(first["step_rows"])}
    supervised = first.get("step_supervised_tokens")
    out["step_supervised_tokens"] = (out["step_real_tokens"] - out["step_rows"] if supervised is None
                                     else int(supervised))
    return out


class PackedCollator:
    """Concatenate a micro-batch's whole documents into one row (padding-free), with per-document boundaries.

    The layout is that of Hugging Face's ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, so a
    Hugging Face causal LM trains on the batch directly (``model(input_ids=..., position_ids=..., labels=...)``
    with ``attention_mask=None`` and ``use_cache=False``: transformers then masks attention per document from the
    restarting ``position_ids``; ``flash_attention_2`` reads ``cu_seq_lens_q/k`` and ``max_length_q/k``).
    :class:`lit_balance.demo.DemoTransformerLM` attends within each document too.

    Each sample is a mapping with ``input_ids`` (1-D ints), ``index`` (int: dataset index) and, optionally,
    ``is_fill`` (bool: a fill document, see :class:`lit_balance.MicroBatch`) and ``labels`` (1-D ints as long as
    ``input_ids``, -100 on tokens without a target, e.g. a prompt; default: ``input_ids``).

    With ``D`` documents of ``l_1 ... l_D`` tokens and ``N = ceil(sum(l) / pad_to_multiple_of) *
    pad_to_multiple_of``, the batch is a dict of:

    * ``input_ids``: LongTensor ``[1, N]``, the documents one after another, then ``N - sum(l)`` tail tokens of
      ``pad_token_id`` (none when ``pad_to_multiple_of`` is 1).
    * ``position_ids``: LongTensor ``[1, N]``, 0 at each document's first token, counting up within it.
    * ``labels``: LongTensor ``[1, N]``, the documents' labels (their ``input_ids`` when they carry none), with
      -100 at each document's first token (so that the shifted next-token loss never has one document predict the
      next one's first token), on every token of a fill document and on the tail padding. Not shifted.
    * ``cu_seq_lens_q``, ``cu_seq_lens_k``: IntTensor (int32) ``[D + 1]``, cumulative document lengths from 0:
      ``[0, l_1, l_1 + l_2, ..., N]``; the tail padding, if any, belongs to the last document's segment (it comes
      after every real token, so causal attention keeps it out of every real token's output), so the last entry
      is ``N``.
    * ``max_length_q``, ``max_length_k``: int, the longest segment (tokens).
    * ``indices``: LongTensor ``[D]``, dataset index of each document; ``is_fill``: BoolTensor ``[D]``.
    * ``num_real_tokens``: int, ``sum(l)`` (per rank); ``num_padded_tokens``: int, the token slots ``N`` (per
      rank). Packed, the padding ratio ``1 - num_real_tokens / num_padded_tokens`` is 0 unless
      ``pad_to_multiple_of`` adds a tail.
    * ``step_real_tokens``, ``step_rows``, ``step_supervised_tokens``: as for :class:`PadCollator`, when the
      samples carry the plan's step totals (rows are documents: ``step_supervised_tokens = step_real_tokens -
      step_rows``, a document of ``l`` tokens supervising ``l - 1``, unless the samples carry the plan's own
      ``step_supervised_tokens``, e.g. with label masks).

    **pad_to_multiple_of, packed.** The one row of a micro-batch, not each document, is padded: its length ``N``
    is the documents' total rounded up to a multiple (e.g. 8 or 64 for GPU kernels). The sampler with
    ``BatchingSettings(packing=True)`` keeps ``N <= max_tokens``.

    **Static packing** (``row_length`` and ``max_documents``, from ``BatchingSettings(static_packing=True)``: the
    planner's :meth:`collator` passes ``max_tokens`` and the cap ``max_batch_size``): every batch has one layout, so
    a compiler or graph capture keeps one program. ``N`` is ``row_length`` whatever the documents; the tail
    (``N - sum(l)`` tokens of ``pad_token_id``, label -100) has ``position_ids`` ``0, 1, ...`` (a segment of its own,
    never the continuation of a document); ``cu_seq_lens_q/k`` has exactly ``max_documents + 1`` entries: the
    documents' boundaries, then the tail's segment, then zero-length segments (``N`` repeated) to the end (with
    ``max_documents`` documents the tail closes the last document's segment, as above); ``max_length_q/k`` is the
    constant ``row_length`` (a bound on every segment: flash-attn's varlen kernels take any bound).

    Args:
        pad_token_id: token id of the tail padding.
        pad_to_multiple_of: ``N`` is rounded up to a multiple of this (tokens).
        max_length: documents longer than this many tokens are truncated (e.g. the sampler's ``truncate_to`` with
            ``too_long="truncate"``), or None to keep them whole.
        row_length: with ``max_documents``, every row is exactly this many tokens (static packing); None: ``N``
            as above.
        max_documents: with ``row_length``, ``cu_seq_lens_q/k`` has this many segments (``+ 1`` entries).

    Raises:
        ValueError: bad arguments (``row_length`` and ``max_documents`` are given together, each >= 1); at call time
            an empty micro-batch, a document with no tokens, or ``labels`` of another length than ``input_ids``
            (naming the dataset index); with static packing, more documents than ``max_documents`` or more tokens
            than ``row_length`` (naming the settings).

    Example:
        >>> collate = PackedCollator(pad_token_id=0, pad_to_multiple_of=4)
        >>> batch = collate([{"input_ids": [5, 6, 7], "index": 3}, {"input_ids": [8, 9], "index": 9}])
        >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7, 8, 9, 0, 0, 0]], [[0, 1, 2, 0, 1, 2, 3, 4]], [[-100, 6, 7, -100, 9, -100, -100, -100]])
        >>> batch["cu_seq_lens_q"].tolist(), batch["max_length_q"], batch["num_real_tokens"], batch["num_padded_tokens"]
        ([0, 3, 8], 5, 5, 8)
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, max_length: int | None = None,
                 row_length: int | None = None, max_documents: int | None = None) -> None:
        _check_collator_args(pad_token_id, pad_to_multiple_of, max_length)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.max_length = None if max_length is None else int(max_length)
        if (row_length is None) != (max_documents is None):
            raise InputValueError(f"row_length ({row_length!r}) and max_documents ({max_documents!r}) go together: "
                                  "both for static packing (max_tokens and the cap of documents per row), or neither",
                                  parameter="static_packing")
        for name, value in (("row_length", row_length), ("max_documents", max_documents)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < 1):
                raise InputValueError(f"{name} must be an int >= 1 or None, got {value!r}", parameter=name)
        self.row_length = None if row_length is None else int(row_length)
        self.max_documents = None if max_documents is None else int(max_documents)

    def _document(self, s: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(s["input_ids"], dtype=np.int64).reshape(-1)
        labels = ids if s.get("labels") is None else np.asarray(s["labels"], dtype=np.int64).reshape(-1)
        if labels.shape != ids.shape:
            raise InputValueError(f"sample at dataset index {s.get('index')} has {labels.size} labels for {ids.size} "
                                  "input_ids; labels must give one value (or -100) per token")
        if self.max_length is not None:
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        if ids.size == 0:
            raise InputValueError(f"sample at dataset index {s.get('index')} has no tokens; remove empty documents")
        labels = labels.copy()
        labels[0] = IGNORE_INDEX
        if s.get("is_fill", False):
            labels[:] = IGNORE_INDEX
        return ids, labels

    def _check_static(self, lengths: np.ndarray, samples: Sequence[Mapping[str, Any]]) -> int:
        """The static row's length, after checking that the documents fit it."""
        if lengths.size > self.max_documents:
            raise InputValueError(f"a micro-batch of {lengths.size} documents (dataset indices "
                                  f"{[s.get('index') for s in samples][:8]}...) exceeds the static row's cap of "
                                  f"{self.max_documents} documents; collate the micro-batches of the sampler planned "
                                  "with static_packing and this max_batch_size", parameter="max_batch_size")
        if int(lengths.sum()) > self.row_length:
            raise InputValueError(f"a micro-batch of {int(lengths.sum())} tokens exceeds the static row of "
                                  f"{self.row_length} tokens (max_tokens); collate the micro-batches of the sampler "
                                  "planned with static_packing and this max_tokens", parameter="max_tokens")
        return self.row_length

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(samples) == 0:
            raise InputValueError("cannot collate an empty micro-batch: the sampler yielded no indices")
        docs = [self._document(s) for s in samples]
        lengths = np.array([ids.size for ids, _ in docs], dtype=np.int64)
        real = int(lengths.sum())
        m = self.pad_to_multiple_of
        width = -(-real // m) * m if self.row_length is None else self._check_static(lengths, samples)
        tail = width - real
        input_ids = np.concatenate([ids for ids, _ in docs] + [np.full(tail, self.pad_token_id, dtype=np.int64)])
        labels = np.concatenate([lab for _, lab in docs] + [np.full(tail, IGNORE_INDEX, dtype=np.int64)])
        if self.row_length is not None and lengths.size < self.max_documents:
            # static: the tail is a segment of its own, then zero-length segments up to max_documents
            segments = np.zeros(self.max_documents, dtype=np.int64)
            segments[:lengths.size] = lengths
            segments[lengths.size] = tail
        else:
            segments = lengths.copy()
            segments[-1] += tail  # the tail padding ends the last document's segment
        cu = np.concatenate([[0], np.cumsum(segments)])
        position_ids = np.arange(width, dtype=np.int64) - np.repeat(cu[:-1], segments)
        if self.row_length is not None and tail:  # the tail's positions restart, whichever segment holds it
            position_ids[real:] = np.arange(tail, dtype=np.int64)
        cu_seq_lens = torch.from_numpy(cu.astype(np.int32))
        max_length = int(segments.max()) if self.row_length is None else self.row_length
        batch = {
            "input_ids": torch.from_numpy(input_ids).unsqueeze(0),
            "position_ids": torch.from_numpy(position_ids).unsqueeze(0),
            "labels": torch.from_numpy(labels).unsqueeze(0),
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
            "indices": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
            "is_fill": torch.tensor([bool(s.get("is_fill", False)) for s in samples], dtype=torch.bool),
            "num_real_tokens": real,
            "num_padded_tokens": int(width),
        }
        batch.update(_step_totals(samples[0]))
        return batch


def collator_for(settings: Any, pad_token_id: int, max_length: int | None = None, *,
                 planner: Any = None) -> PadCollator | PackedCollator:
    """The collator of the micro-batches that ``settings`` plan, chosen from their planner
    (:func:`lit_balance.plan.planner_for`), in this one place: :class:`PackedCollator` when the planner packs rows
    (``planner.packed_rows``), else :class:`PadCollator`, with the planner's ``collator_options(settings)`` (static
    shapes: ``padded_shapes`` pads to those shapes, ``static_packing`` to rows of exactly ``max_tokens``).

    Args:
        settings: the :class:`~lit_balance.BatchingSettings` as planned (a sampler's ``settings``: static shapes
            chosen from the lengths).
        pad_token_id, max_length: as for the collators (``pad_to_multiple_of`` is the settings').
        planner: the planner of ``settings`` when the caller holds it (default: ``planner_for(settings)``).

    Raises:
        TypeError: ``settings`` is not a :class:`~lit_balance.BatchingSettings`.

    Example:
        >>> from lit_balance import BatchingSettings
        >>> type(collator_for(BatchingSettings(max_tokens=64, packing=True), pad_token_id=0)).__name__
        'PackedCollator'
    """
    from lit_balance.plan import BatchingSettings, planner_for

    if not isinstance(settings, BatchingSettings):
        raise InputTypeError(f"collator_for takes the lit_balance.BatchingSettings of the plan (e.g. the sampler's "
                             f"settings), got {settings!r} of type {type(settings).__name__}", parameter="settings")
    planner = planner_for(settings) if planner is None else planner
    cls = PackedCollator if planner.packed_rows else PadCollator
    return cls(pad_token_id, settings.pad_to_multiple_of, max_length=max_length, **planner.collator_options(settings))
