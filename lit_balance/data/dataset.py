"""A map-style dataset over tokenized documents stored as one flat array plus offsets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lit_balance.data.records import supervised_counts
from lit_balance.errors import InputValueError
from lit_balance.plan.types import MicroBatch

__all__ = ["MicroBatchItems", "TokenDataset"]

_STEP_KEYS = ("step_real_tokens", "step_rows", "step_supervised_tokens")


class MicroBatchItems(Dataset):
    """A map-style dataset whose ``_item(index, is_fill)`` gives one sample's dict: ``dataset[i]`` is that item, and
    ``dataset[micro_batch]`` (``__getitems__``) its micro-batch's items, each with the plan's per-optimizer-step totals
    (global ints) when the sampler attaches them to the :class:`~lit_balance.plan.types.MicroBatch`."""

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, index: int | Sequence[int]) -> Any:
        if isinstance(index, (int, np.integer)):
            return self._item(int(index))
        return self.__getitems__(index)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        is_fill = indices.is_fill if isinstance(indices, MicroBatch) else (False,) * len(indices)
        items = [self._item(int(i), bool(f)) for i, f in zip(indices, is_fill)]
        step = {k: int(getattr(indices, k)) for k in _STEP_KEYS if getattr(indices, k, None) is not None}
        if step:
            for item in items:
                item.update(step)
        return items


class TokenDataset(MicroBatchItems):
    """Documents ``doc_ids`` of a flat token array, each truncated to ``max_length`` tokens.

    Item ``i`` is ``{"input_ids": int32 ndarray [len_i], "index": i, "is_fill": False}``, plus
    ``"labels"`` (int32 ndarray ``[len_i]``, unshifted, ``-100`` where a token has no target) when the
    dataset has labels (a prompt–completion corpus, or pre-tokenized labels). Indexing with
    a list of indices (or a :class:`lit_balance.MicroBatch`, whose fill mask is carried into
    ``is_fill``) returns the list of items, so the dataset works both with
    ``DataLoader(batch_sampler=...)`` and with ``DataLoader(sampler=..., batch_size=None)``. When the
    micro-batch carries the plan's ``step_real_tokens``, ``step_rows`` and ``step_supervised_tokens`` (ints,
    over all ranks and micro-batches of its optimizer step), every item of the list carries them too.

    Args:
        token_ids: int ``[num_tokens]``, all documents concatenated.
        offsets: int ``[num_docs + 1]``; document ``d`` is ``token_ids[offsets[d]:offsets[d + 1]]``.
        doc_ids: int ``[len(self)]``, which documents this dataset holds (e.g. a train split).
        max_length: keep at most this many tokens per document, or None.
        labels: int ``[num_tokens]`` aligned with ``token_ids`` (unshifted; ``-100``: no target), or None
            when every token is a target.

    Raises:
        ValueError: ``doc_ids`` out of range, ``max_length < 1``, or ``labels`` not shaped like ``token_ids``.

    Example:
        >>> ds = TokenDataset(np.array([1, 2, 3, 4, 5]), np.array([0, 3, 5]), np.array([1, 0]), max_length=2)
        >>> ds.lengths.tolist(), ds[1]["input_ids"].tolist()
        ([2, 2], [1, 2])
    """

    def __init__(
        self,
        token_ids: np.ndarray,
        offsets: np.ndarray,
        doc_ids: np.ndarray,
        max_length: int | None = None,
        labels: np.ndarray | None = None,
    ) -> None:
        if labels is not None and np.shape(labels) != np.shape(token_ids):
            raise InputValueError(f"labels must be shaped like token_ids {np.shape(token_ids)}, got {np.shape(labels)}")
        self.token_ids = token_ids
        self.labels = labels
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        num_docs = self.offsets.shape[0] - 1
        if self.doc_ids.size and (self.doc_ids.min() < 0 or self.doc_ids.max() >= num_docs):
            raise InputValueError(
                f"doc_ids must lie in [0, {num_docs}), got min {self.doc_ids.min()} max {self.doc_ids.max()}"
            )
        if max_length is not None and max_length < 1:
            raise InputValueError(f"max_length must be >= 1 or None, got {max_length}")
        self.max_length = max_length
        full = self.offsets[self.doc_ids + 1] - self.offsets[self.doc_ids]
        #: int64 ``[len(self)]``: tokens per item after truncation.
        self.lengths = full if max_length is None else np.minimum(full, max_length)

    def __len__(self) -> int:
        return int(self.doc_ids.shape[0])

    def supervised_lengths(self, max_length: int | None = None) -> np.ndarray:
        """int64 ``[len(self)]``: next-token targets of each item as a causal LM counts them after the shift.

        Labels ``1 .. length-1`` that are not ``-100`` (:func:`lit_balance.data.records.supervised_counts`); without
        labels, ``length - 1``. These are the per-sample counts a
        :class:`~lit_balance.BalancedBatchSampler` takes as ``supervised_lengths``.

        Args:
            max_length: count items cut further to this many tokens (e.g. the sampler's ``truncate_to`` with
                ``too_long="truncate"``), or None for :attr:`lengths`.
        """
        lengths = self.lengths if max_length is None else np.minimum(self.lengths, max_length)
        return supervised_counts(self.labels, self.offsets, self.doc_ids, lengths)

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} documents")
        start = int(self.offsets[self.doc_ids[i]])
        end = start + int(self.lengths[i])
        item = {"input_ids": np.asarray(self.token_ids[start:end]), "index": i, "is_fill": is_fill}
        if self.labels is not None:
            item["labels"] = np.asarray(self.labels[start:end])
        return item

