"""Pieces of documents as samples: what a length warm-up (:mod:`lit_balance.plan.warmup`) trains on.

A :class:`~lit_balance.plan.types.PieceMicroBatch` is a micro-batch of document indices that also says which tokens of each document its
row holds (``piece_start``, ``piece_length``); :class:`PieceDataset` reads exactly those tokens. Every piece is an
item of its own, so the collators treat it as a document: a padded row of its own, or, packed, a segment of its own
in ``cu_seq_lens_q/k`` with ``position_ids`` from 0 and -100 at its first label (no target predicted across a cut).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lit_balance.data.dataset import MicroBatchItems, TokenDataset
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.types import PieceMicroBatch

__all__ = ["PieceDataset"]


class PieceDataset(MicroBatchItems):
    """The pieces of a :class:`~lit_balance.TokenDataset`'s documents that :class:`PieceMicroBatch` lists name.

    ``dataset[piece_micro_batch]`` returns one item per row: ``input_ids`` (and ``labels``, unshifted, when the
    dataset has them) of tokens ``[start, start + length)`` of document ``index``, plus ``piece_start``; with the
    micro-batch's step totals as :class:`~lit_balance.TokenDataset` attaches them. A plain index (or list) reads the
    whole document, as the wrapped dataset does. A piece is read by slicing its document (its whole document is read and checked as :class:`~lit_balance.TokenDataset` reads it).

    Args:
        dataset: the documents, whole (``max_length=None``: a warm-up splits instead of truncating).

    Raises:
        TypeError: ``dataset`` is not a :class:`~lit_balance.TokenDataset`.
        ValueError: ``dataset`` truncates its documents (``max_length``); on reading, a piece outside its document.

    Example:
        >>> ds = PieceDataset(TokenDataset(np.arange(10, 17), np.array([0, 5, 7]), np.array([0, 1])))
        >>> items = ds[PieceMicroBatch([0, 0, 1], piece_start=[0, 3, 0], piece_length=[3, 2, 2])]
        >>> [it["input_ids"].tolist() for it in items]
        [[10, 11, 12], [13, 14], [15, 16]]
    """

    def __init__(self, dataset: TokenDataset) -> None:
        if not isinstance(dataset, TokenDataset):
            raise InputTypeError(f"dataset must be a lit_balance.TokenDataset, got {type(dataset).__name__}",
                                 parameter="dataset")
        if dataset.max_length is not None:
            raise InputValueError(f"a length warm-up (max_length_schedule) splits long documents instead of cutting "
                                  f"them, but the dataset truncates to max_length={dataset.max_length}: build it "
                                  "with max_length=None", parameter="max_length")
        self.dataset = dataset
        #: int64 ``[num_docs]``: tokens of each whole document.
        self.lengths = dataset.lengths

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def has_labels(self) -> bool:
        """Whether items carry ``labels``."""
        return self.dataset.has_labels

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        return self.dataset._item(i, is_fill)

    def _piece(self, i: int, start: int, length: int, is_fill: bool) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} documents")
        whole = int(self.lengths[i])
        if start < 0 or length < 1 or start + length > whole:
            raise InputValueError(f"piece [{start}, {start + length}) lies outside document {i} of {whole} tokens")
        item = self.dataset._item(i, is_fill)  # the whole document, its ids checked against the vocabulary
        item["input_ids"] = item["input_ids"][start:start + length]
        if "labels" in item:
            item["labels"] = item["labels"][start:start + length]
        item["piece_start"] = start
        return item

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        if not isinstance(indices, PieceMicroBatch):
            return super().__getitems__(indices)
        items = [self._piece(int(i), s, n, bool(f))
                 for i, s, n, f in zip(indices, indices.piece_start, indices.piece_length, indices.is_fill)]
        step = {k: int(getattr(indices, k)) for k in ("step_real_tokens", "step_rows", "step_supervised_tokens")
                if getattr(indices, k) is not None}
        for item in items:
            item.update(step)
        return items
