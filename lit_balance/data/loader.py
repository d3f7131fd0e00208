"""Any map-style dataset of dicts as token-budgeted micro-batches: lengths, a micro-batch view, a collator, a loader.

The four parts, used together (see ``docs/bring_your_own.md``)::

    train = MicroBatchDataset(my_dataset, length="input_ids")          # any dataset whose items are dicts
    sampler = BalancedBatchSampler(train.lengths, settings=settings,  # in setup() / train_dataloader()
                                   num_replicas=world.num_replicas, rank=world.rank)  # data_parallel_world(trainer)
    collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"])
    loader = balanced_dataloader(train, sampler, collate)

:func:`balanced_dataloader` builds ``DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=...)``: the
sampler is the loader's ``sampler`` (not its ``batch_sampler``) and a
:class:`~torch.utils.data.distributed.DistributedSampler`, so Lightning calls its ``set_epoch`` every epoch and
keeps it under both ``Trainer(use_distributed_sampler=True)`` (it injects a ``DistributedSampler`` only where the
loader has none) and ``False``; each index the sampler yields is a whole micro-batch, which
:class:`MicroBatchDataset` turns into the list of its items.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, default_collate

from lit_balance.data.collate import IGNORE_INDEX
from lit_balance.data.dataset import KnownLengths
from lit_balance.data.fit_loop import FitCount, fitting
from lit_balance.data.training_sampler import offer_training_loader, training_loaders
from lit_balance.data.workers import ignore_stop_signals_in_workers
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.types import MicroBatch, padded_lengths

__all__ = ["LOADER_STATE_VERSION", "BalancedDataLoader", "MicroBatchDataset", "MicroBatchItems", "PadFieldsCollator",
           "balanced_dataloader", "item_lengths"]

#: Version of :meth:`BalancedDataLoader.state_dict`'s layout.
LOADER_STATE_VERSION = 1

#: How to read a sample's planned length: a field name, several (their longest), or a function of the item.
LengthSpec = str | Sequence[str] | Callable[[Mapping[str, Any]], int]

# DataLoader arguments that would replace or undo the micro-batches (and the setting that holds each instead)
_LOADER_OWNED = {"batch_size": "max_tokens / max_batch_size", "batch_sampler": "the sampler argument",
                 "sampler": "the sampler argument", "shuffle": "shuffle", "drop_last": "drop_last"}


def _field_length(item: Mapping[str, Any], field: str, index: int) -> int:
    if not isinstance(item, Mapping):
        raise InputTypeError(f"item {index} is a {type(item).__name__}, expected a mapping (dict) of fields")
    if field not in item:
        raise InputValueError(f"item {index} has no field {field!r} (its fields: {sorted(item)}); pass the length "
                              "field "
                              "that holds the token ids, or a function of the item")
    value = item[field]
    if isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"item {index} field {field!r} is a bool; expected a sequence of tokens or an int length")
    if isinstance(value, (int, np.integer)) or (isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0):
        return int(value)
    try:
        return len(value)
    except TypeError:
        raise InputTypeError(f"item {index} field {field!r} is a {type(value).__name__}; expected a sequence of tokens "
                             "(its length counts) or an int length") from None


def _length_function(length: LengthSpec) -> Callable[[Mapping[str, Any], int], int]:
    if callable(length):
        return lambda item, index: length(item)
    if isinstance(length, str):
        fields = (length,)
    elif isinstance(length, Sequence) and length and all(isinstance(f, str) for f in length):
        fields = tuple(length)
    else:
        raise InputTypeError(f"length must be a field name, a non-empty list of field names or a function of the item, "
                             f"got {length!r}")
    return lambda item, index: max(_field_length(item, f, index) for f in fields)


def item_lengths(dataset: Any, length: LengthSpec) -> np.ndarray:
    """Tokens per item of a map-style dataset, as the sampler plans them.

    Args:
        dataset: anything with ``len()`` and ``dataset[i]`` returning a mapping (dict) of fields: a list of
            dicts, a :class:`torch.utils.data.Dataset`, a Hugging Face ``datasets.Dataset``.
        length: a field name (the field's ``len()``, or its value when it holds an int, e.g. a precomputed
            ``"length"`` column); a list of field names (the longest of them, e.g. ``["input_ids", "labels"]``
            for a source and a target, so that ``max_tokens`` bounds the padded slots of each field); or a
            function of the item returning an int.

    Returns:
        int64 ``[len(dataset)]``: tokens per item. Columns of a Hugging Face ``datasets.Dataset`` are read in
        Arrow, without a Python loop over the rows (a dataset of the ``datasets`` package's ``Dataset`` class); a
        dataset that declares its lengths (:class:`~lit_balance.data.dataset.KnownLengths`, e.g. a
        :class:`~lit_balance.data.dataset.TokenDataset`: a store's index) gives them without reading a token.

    Raises:
        TypeError: ``length`` is none of the above, an item is not a mapping, or a field holds neither a
            sequence nor an int.
        ValueError: a field is missing, or a length is below 1 (naming the item and its value).

    Example:
        >>> item_lengths([{"input_ids": [5, 6, 7], "labels": [1]}, {"input_ids": [8], "labels": [2, 3]}],
        ...              ["input_ids", "labels"]).tolist()
        [3, 2]
    """
    read = _length_function(length)
    fields = (length,) if isinstance(length, str) else length
    if not callable(length) and isinstance(dataset, KnownLengths):  # it declares its lengths (a store's index)
        lengths = dataset.lengths_of(fields)
        if lengths is not None and (not lengths.size or lengths.min() >= 1):
            return lengths  # no token read
    hf = sys.modules.get("datasets")  # a Hugging Face dataset exists only where its package was imported
    if hf is not None and not callable(length) and isinstance(dataset, hf.Dataset):
        fast = _arrow_lengths(dataset, fields, length)
        if fast is not None:
            return fast
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        value = read(dataset[i], i)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise InputTypeError(f"the length of item {i} is {value!r} ({type(value).__name__}); expected an int")
        if value < 1:
            raise InputValueError(f"item {i} has length {value} (length={length!r}); every item needs at least 1 "
                                  "token: "
                                  "drop empty items from the dataset first")
        out[i] = value
    return out


def _arrow_lengths(dataset: Any, fields: Sequence[str], length: LengthSpec) -> np.ndarray | None:
    """Lengths of a Hugging Face ``datasets.Dataset``'s columns ``fields``, read in Arrow (no Python loop over rows),
    or None.

    Used when ``fields`` are columns of the dataset that hold lists (their lengths) or integers; any other case (a
    missing column, other column types, nulls) returns None and is read item by item, where the message names the
    item. ``length`` is the argument as given, for the messages.
    """
    names = dataset.column_names
    if not all(isinstance(f, str) and f in names for f in fields) or len(dataset) == 0:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    columns = []
    for field in fields:
        column = table[field]
        kind = column.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            column = pc.list_value_length(column)
        elif not pa.types.is_integer(kind):
            return None
        if column.null_count:
            return None  # item by item, where the message names the item
        columns.append(np.asarray(column.to_numpy(), dtype=np.int64))
    lengths = np.max(np.stack(columns), axis=0)
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        i = int(bad[0])
        raise InputValueError(f"item {i} has length {int(lengths[i])} (length={length!r}); every item needs at least 1 "
                              "token: drop empty items from the dataset first")
    return lengths


class MicroBatchItems(list):
    """The items of one micro-batch (a ``list`` of dicts) with what the plan says about them.

    Attributes:
        indices: ``tuple[int, ...]``, dataset index of each item.
        is_fill: ``tuple[bool, ...]``, True for a fill row (see :class:`lit_balance.MicroBatch`).
        lengths: ``tuple[int, ...]``, each item's planned length (tokens).
        step_real_tokens, step_rows: the plan's totals of this micro-batch's optimizer step over all ranks
            (of the planned lengths, fill rows excluded), or None.
    """

    def __init__(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int], is_fill: Sequence[bool],
                 lengths: Sequence[int], step_real_tokens: int | None = None, step_rows: int | None = None) -> None:
        super().__init__(items)
        self.indices, self.is_fill, self.lengths = tuple(indices), tuple(is_fill), tuple(lengths)
        self.step_real_tokens, self.step_rows = step_real_tokens, step_rows


class MicroBatchDataset(Dataset):
    """A map-style dataset of dicts that a whole micro-batch indexes at once.

    ``dataset[i]`` is the wrapped item; ``dataset[micro_batch]`` (a :class:`lit_balance.MicroBatch` or a list of
    indices) is a :class:`MicroBatchItems`: the items, fetched with the wrapped dataset's ``__getitems__`` when it
    has one (Hugging Face ``datasets.Dataset`` does), carrying their indices, fill-row mask, planned lengths and
    the plan's step totals. This is what lets ``DataLoader(dataset, sampler=sampler, batch_size=None)`` take one
    micro-batch per index. The wrapped items are not modified.

    Args:
        dataset: items are mappings of fields (see :func:`item_lengths`).
        length: how to read an item's length (see :func:`item_lengths`), read once here.

    Attributes:
        lengths: int64 ``[len(dataset)]``, tokens per item: pass them to :class:`lit_balance.BalancedBatchSampler`.

    Raises:
        TypeError, ValueError: as :func:`item_lengths`.

    Example:
        >>> ds = MicroBatchDataset([{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}], "input_ids")
        >>> ds.lengths.tolist(), ds[MicroBatch([1, 0], is_fill=[False, True])].is_fill
        ([3, 1], (False, True))
    """

    #: Its items are collated whole (:class:`PadFieldsCollator` cuts nothing), so a sampler that plans them shorter
    #: (``too_long="truncate"``) is refused by :func:`balanced_dataloader` where an item is longer than ``truncate_to``.
    cut_by_collator = False

    def __init__(self, dataset: Any, length: LengthSpec) -> None:
        self.dataset = dataset
        self.length = length
        self.lengths = item_lengths(dataset, length)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int | Sequence[int]) -> Any:
        if isinstance(index, (int, np.integer)):
            return self.dataset[int(index)]
        return self.__getitems__(index)

    def __getitems__(self, indices: Sequence[int]) -> MicroBatchItems:
        positions = [int(i) for i in indices]
        for i in positions:
            if not 0 <= i < len(self):
                raise IndexError(f"index {i} out of range for a dataset of {len(self)} items")
        fetch = getattr(self.dataset, "__getitems__", None)
        items = list(fetch(positions)) if fetch is not None else [self.dataset[i] for i in positions]
        is_fill = indices.is_fill if isinstance(indices, MicroBatch) else (False,) * len(positions)
        return MicroBatchItems(items, positions, is_fill, [int(self.lengths[i]) for i in positions],
                               getattr(indices, "step_real_tokens", None), getattr(indices, "step_rows", None))


def _is_label(name: str) -> bool:
    return name in ("labels", "label") or name.endswith(("_labels", "_label"))


def _is_mask(name: str) -> bool:
    return name.endswith("attention_mask")


def _mask_name(field: str) -> str:
    return field[: -len("input_ids")] + "attention_mask" if field.endswith("input_ids") else f"{field}_attention_mask"


def _as_row(value: Any, field: str, index: Any) -> torch.Tensor:
    row = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if row.ndim != 1:
        raise InputValueError(f"item {index} field {field!r} has shape {tuple(row.shape)}; a sequence field must be "
                              "1-D "
                              "(list it in scalar_fields if it is one value per item)")
    if row.numel() and (row.dtype == torch.bool or row.is_floating_point()):
        return row
    return row.to(torch.long)  # token ids (and an empty row, which numpy makes float64)


class PadFieldsCollator:
    """Pad each listed sequence field to the micro-batch's longest row of that field; stack the scalar fields.

    Each sequence field ``f`` becomes a tensor ``[B, T_f]``, ``T_f`` the longest row of ``f`` in this micro-batch
    rounded up to ``pad_to_multiple_of`` (never a model maximum), padded after each row's end with its pad value:
    ``-100`` for a label field (``labels``, ``label`` or a name ending in ``_labels``), 0 for an attention mask
    (a name ending in ``attention_mask``) and ``pad_token_id`` for any other (token ids); ``pad_values`` overrides
    any of them. Integer fields become int64; float and bool fields keep their dtype.

    Every sequence field that is neither a label field nor a mask also gets a mask ``[B, T_f]`` (1 on its real
    tokens, 0 on padding), named as Hugging Face models expect: ``input_ids`` -> ``attention_mask``,
    ``decoder_input_ids`` -> ``decoder_attention_mask``, any other ``f`` -> ``f_attention_mask``; when the items
    already hold that mask it is padded instead (and must have the field's row lengths).

    Scalar fields (one value per item, e.g. a class label) are stacked by
    :func:`torch.utils.data.default_collate` into ``[B]`` (or ``[B, ...]`` for equal-shape arrays). On a fill
    row every label field, sequence or scalar, is ``-100``, so a loss with ``ignore_index=-100`` skips it.

    The batch also carries, when the items come from :class:`MicroBatchDataset`:

    * ``indices``: LongTensor ``[B]``, dataset index of each row; ``is_fill``: BoolTensor ``[B]``.
    * ``num_real_tokens``: int, the sum of the rows' planned lengths (per rank).
    * ``num_padded_tokens``: int, ``B x`` the longest planned length rounded up to ``pad_to_multiple_of``: the
      padded slots the sampler's budget bounds (``<= max_tokens``), per rank.
    * ``step_real_tokens``, ``step_rows``: ints, the plan's totals (planned lengths, fill rows excluded) of the
      micro-batch's optimizer step over all ranks, when the sampler attached them. There is no
      ``step_supervised_tokens``: which tokens carry a loss depends on the model, so
      :class:`lit_balance.StepTokenLoss` counts them with its all-reduce divisor, exact for any labels.

    Budget: no field's row may be longer than the row's planned length (checked: a ``ValueError`` names the
    item), so every field's padded slots ``B x T_f`` stay within ``num_padded_tokens <= max_tokens``. Several
    sequence fields (a source and a target) together take at most ``k x max_tokens`` slots for ``k`` fields;
    to hold their sum under a memory budget ``M``, plan with ``max_tokens = M // k``.

    Args:
        sequence_fields: the fields to pad, as a list of names or a mapping ``name -> pad value``.
        pad_token_id: the pad value of token-id fields (e.g. ``tokenizer.pad_token_id``); required when such a
            field is listed without a pad value.
        scalar_fields: fields stacked as they are (a class label, a score).
        drop_fields: fields left out of the batch (e.g. a raw ``"text"`` column). Any field of an item that is
            listed nowhere raises a ``ValueError``, so nothing is dropped silently.
        pad_values: pad value per field, overriding the defaults above.
        pad_to_multiple_of: ``T_f`` is rounded up to a multiple of this (tokens), as the sampler's setting.
        attention_masks: False to add no masks.

    Raises:
        ValueError, TypeError: bad arguments; at call time, an empty micro-batch, a missing or unlisted field, a
            sequence field that is not 1-D, a row longer than its planned length, a mask whose row lengths differ
            from its field's.

    Example:
        >>> collate = PadFieldsCollator(["input_ids"], pad_token_id=0, scalar_fields=["label"], pad_to_multiple_of=4)
        >>> batch = collate([{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["label"].tolist()
        ([[5, 6, 7, 0], [8, 0, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]], [1, 0])
    """

    def __init__(self, sequence_fields: Sequence[str] | Mapping[str, int | float], *, pad_token_id: int | None = None,
                 scalar_fields: Sequence[str] = (), drop_fields: Sequence[str] = (),
                 pad_values: Mapping[str, int | float] | None = None, pad_to_multiple_of: int = 1,
                 attention_masks: bool = True) -> None:
        explicit = dict(sequence_fields) if isinstance(sequence_fields, Mapping) else {}
        names = sequence_fields if isinstance(sequence_fields, str) else list(sequence_fields)
        for what, group in (("sequence_fields", names), ("scalar_fields", scalar_fields),
                            ("drop_fields", drop_fields)):
            if isinstance(group, str) or not all(isinstance(n, str) for n in group):
                raise InputTypeError(f"{what} must be a list of field names, got {group!r}")
        if not names:
            raise InputValueError("sequence_fields is empty; list the fields to pad, e.g. ['input_ids']")
        seen: dict[str, str] = {}
        for what, group in (("sequence_fields", names), ("scalar_fields", scalar_fields),
                            ("drop_fields", drop_fields)):
            for name in group:
                if name in seen:
                    where = f"twice in {what}" if seen[name] == what else f"in both {seen[name]} and {what}"
                    raise InputValueError(f"field {name!r} is listed {where}; list it once")
                seen[name] = what
        if pad_token_id is not None and (isinstance(pad_token_id, bool)
                                         or not isinstance(pad_token_id, (int, np.integer))):
            raise InputTypeError(f"pad_token_id must be an int or None, got {pad_token_id!r}")
        if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, (int, np.integer)) \
                or pad_to_multiple_of < 1:
            raise InputValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
        explicit.update(pad_values or {})
        unknown = sorted(set(explicit) - set(names))
        if unknown:
            raise InputValueError(f"pad_values names {unknown}, which are not in sequence_fields {names}")
        self.pad_values: dict[str, int | float] = {}
        for name in names:
            if name in explicit:
                self.pad_values[name] = explicit[name]
            elif _is_label(name):
                self.pad_values[name] = IGNORE_INDEX
            elif _is_mask(name):
                self.pad_values[name] = 0
            elif pad_token_id is None:
                raise InputValueError(f"sequence field {name!r} holds token ids (not a label or mask field by its "
                                      "name) "
                                      "and has no pad value: pass pad_token_id=tokenizer.pad_token_id, or "
                                      f"pad_values={{{name!r}: ...}}")
            else:
                self.pad_values[name] = int(pad_token_id)
        self.sequence_fields = tuple(names)
        self.scalar_fields = tuple(scalar_fields)
        self.drop_fields = frozenset(drop_fields)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        # field -> the mask computed for it (fields whose mask the items hold are checked against it instead)
        self.masks = {name: _mask_name(name) for name in names
                      if attention_masks and not _is_label(name) and not _is_mask(name)}
        self.label_fields = tuple(n for n in (*names, *scalar_fields) if _is_label(n))
        self._known = set(names) | set(scalar_fields) | self.drop_fields

    def _width(self, longest: int) -> int:
        m = self.pad_to_multiple_of
        return -(-longest // m) * m

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(samples) == 0:
            raise InputValueError("cannot collate an empty micro-batch: the sampler yielded no indices")
        meta = samples if isinstance(samples, MicroBatchItems) else None
        indices = meta.indices if meta is not None else tuple(range(len(samples)))
        for position, item in enumerate(samples):
            if not isinstance(item, Mapping):
                raise InputTypeError(f"item {indices[position]} is a {type(item).__name__}, expected a mapping of "
                                     "fields")
            unlisted = sorted(set(item) - self._known)
            if unlisted:
                raise InputValueError(f"item {indices[position]} has fields {unlisted} that PadFieldsCollator does not "
                                      f"list; add them to sequence_fields, scalar_fields or drop_fields")
        batch: dict[str, Any] = {}
        rows_of: dict[str, list[torch.Tensor]] = {}
        for field in self.sequence_fields:
            rows_of[field] = [_as_row(value, field, indices[position])
                              for position, value in enumerate(_field_values(samples, field, indices))]
        row_lengths = {f: [r.numel() for r in rows] for f, rows in rows_of.items()}
        if meta is not None:
            planned = list(meta.lengths)
        else:
            planned = [max(row_lengths[f][p] for f in self.sequence_fields) for p in range(len(samples))]
        for field, lengths in row_lengths.items():
            for position, (n, p) in enumerate(zip(lengths, planned)):
                if n > p:
                    raise InputValueError(f"item {indices[position]} field {field!r} has {n} tokens but was planned at "
                                          f"{p}: "
                                          "its padded slots could exceed max_tokens; make the dataset's length cover "
                                          "every "
                                          "sequence field (e.g. MicroBatchDataset(dataset, "
                                          f"length={list(self.sequence_fields)}))")
        for field, rows in rows_of.items():
            width = self._width(max(row_lengths[field]))
            dtype = next((r.dtype for r in rows if r.numel()), torch.long)
            padded = torch.full((len(rows), width), self.pad_values[field], dtype=dtype)
            if width:
                body = pad_sequence([r.to(dtype) for r in rows], batch_first=True, padding_value=self.pad_values[field])
                padded[:, : body.shape[1]] = body
            batch[field] = padded
        for field, mask in self.masks.items():
            width = batch[field].shape[1]
            lengths = torch.tensor(row_lengths[field], dtype=torch.long)
            if mask in rows_of:
                if row_lengths[mask] != row_lengths[field]:
                    raise InputValueError(f"field {mask!r} has row lengths {row_lengths[mask]} but {field!r} has "
                                          f"{row_lengths[field]}; a mask must have one entry per token of its field")
                continue
            batch[mask] = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        for field in self.scalar_fields:
            batch[field] = default_collate(_field_values(samples, field, indices))
        is_fill = torch.tensor(meta.is_fill if meta is not None else [False] * len(samples), dtype=torch.bool)
        if is_fill.any():
            for field in self.label_fields:
                batch[field] = batch[field].clone()
                batch[field][is_fill] = IGNORE_INDEX
        if meta is not None:
            batch["indices"] = torch.tensor(meta.indices, dtype=torch.long)
        batch["is_fill"] = is_fill
        batch["num_real_tokens"] = int(sum(planned))
        batch["num_padded_tokens"] = len(samples) * int(padded_lengths(np.array([max(planned)]),
                                                                        self.pad_to_multiple_of)[0])
        if meta is not None and meta.step_real_tokens is not None and meta.step_rows is not None:
            batch["step_real_tokens"], batch["step_rows"] = int(meta.step_real_tokens), int(meta.step_rows)
        return batch


def _field_values(samples: Sequence[Mapping[str, Any]], field: str, indices: Sequence[Any]) -> list[Any]:
    """``field`` of every item; an item without it raises naming its dataset index and its fields."""
    values = []
    for position, item in enumerate(samples):
        if field not in item:
            raise InputValueError(f"item {indices[position]} has no field {field!r} (its fields: {sorted(item)})")
        values.append(item[field])
    return values


_OWN_COUNT = "the loader's own count"


class _PassCount:
    """Micro-batches one pass of a :class:`BalancedDataLoader` handed to the loop, and where in the epoch it began."""

    def __init__(self) -> None:
        self.epoch: int | None = None  # the sampler's epoch, read at the first micro-batch handed out
        self.start = 0  # the epoch micro-step the pass began at
        self.yielded = 0


class _CountingIterator:
    """The DataLoader's iterator, counting the micro-batches it returns (to the training loop, not to the workers)."""

    def __init__(self, iterator: Any, count: _PassCount, sampler: Any, fit_count: FitCount | None,
                 loader: BalancedDataLoader) -> None:
        self._iterator, self._count, self._sampler, self._fit_count = iterator, count, sampler, fit_count
        self._loader, self._ended, self._begun = loader, False, False

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        count = self._count
        if not self._begun:  # the first next(): after Lightning's set_epoch
            self._begun = True
            if self._fit_count is not None:
                self._fit_count.check()  # before the first training step: the fit's batch count is this loader's
            ended, self._loader._ended_epoch = self._loader._ended_epoch, None
            self._ended = ended is not None and ended == self._sampler.epoch  # restored after its epoch ran out
        if self._ended:  # (CombinedLoader mode max_size): nothing more in this epoch
            raise StopIteration
        batch = next(self._iterator)
        if count.epoch is None:  # read now: the pass's start is known once the sampler has begun it
            count.epoch, count.start = self._sampler.epoch, self._sampler.start_micro_step
        count.yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._iterator)


def _checked_count(value: Any, source: str) -> int:
    """``value`` as a count of micro-batches; a bool, a float, a string or a negative value raises, naming
    ``source``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"batches_consumed must be an int >= 0 (the micro-batches of the current epoch consumed "
                             f"by training, counted from its start), but {source} returned {value!r} of type "
                             f"{type(value).__name__}; return the count as an int, e.g. "
                             "lambda: fit_batches_consumed(trainer) under Lightning", parameter="batches_consumed")
    if value < 0:
        raise InputValueError(f"batches_consumed must be an int >= 0 (the micro-batches of the current epoch consumed "
                              f"by training, counted from its start), but {source} returned {value}",
                              parameter="batches_consumed")
    return int(value)


class BalancedDataLoader(DataLoader):
    """A DataLoader over a :class:`~lit_balance.BalancedBatchSampler` that saves what training consumed.

    With ``num_workers > 0`` a DataLoader reads its sampler ahead of training (about ``num_workers *
    prefetch_factor`` micro-batches, more with ``persistent_workers=True`` across a checkpoint), so the sampler's own
    position counts micro-batches that were never trained, and a resume from it skips them. This loader counts the
    micro-batches its iterator hands to the loop and saves the sampler's state at that count,
    ``sampler.state_dict(batches_consumed=...)`` (the mechanism :class:`~lit_balance.BalancedTextDataModule` uses with
    Lightning's own count), as torchdata's ``StatefulDataLoader`` counts batches yielded rather than fetched.

    It is stateful as Lightning sees it (``state_dict`` / ``load_state_dict``): Lightning saves :meth:`state_dict` in
    the checkpoint's fit loop and restores it before the epoch's iterator is created, so ``Trainer.fit(ckpt_path=...)``
    resumes exactly, with workers. Under ``Trainer.fit`` (of ``lightning`` or ``pytorch_lightning``) hand the loader
    its Trainer, ``trainer=self.trainer`` in the ``train_dataloader`` hook: the count of a training loader is then
    Lightning's own (:func:`lit_balance.lightning.fit_batches_consumed`, :mod:`lit_balance.data.fit_loop`), the
    batches the fit loop counts as done when it restores the checkpoint, so a micro-batch whose training step raised
    (``OnExceptionCheckpoint``) runs again after the resume. Beside other training loaders in a ``CombinedLoader``,
    modes ``min_size`` and ``max_size`` train and resume exactly (with ``max_size`` a loader that runs out first
    gives None to the rest of the epoch, and its count stops at its end); ``max_size_cycle`` (the mode of a list or
    dict of loaders) beside a longer loader, which would start this one again within the epoch, is refused at its
    first micro-batch, before any training step, naming the modes that train (:class:`~lit_balance.data.fit_loop.
    FitCount`); Lightning refuses ``sequential`` for training itself. Without a Trainer (a plain loop: torchrun,
    Fabric; or a fit that gave none) the count is the micro-batches this loader's iterator handed to the loop: save
    :meth:`state_dict` after the micro-batches trained so far and restore it into a loader over a fresh sampler before
    iterating. That count includes a micro-batch whose step raised, so :meth:`state_dict` warns when it is called
    with it while an exception is being handled. While it iterates, the sampler's own ``state_dict()`` without a count
    refuses to save a position ahead of this count. Given a Trainer, the loader also hands its sampler to it for the
    callbacks and the loss that read the training sampler, while the Trainer trains from this loader
    (:func:`lit_balance.data.training_sampler.offer_training_loader`).

    Its worker processes ignore SIGINT and SIGTERM (a ``worker_init_fn`` given to it still runs, after that;
    :func:`lit_balance.data.workers.ignore_stop_signals_in_workers`): Ctrl-C in a terminal reaches every process of the
    group, and the main process, not a worker, decides how training stops.

    Build it with :func:`balanced_dataloader` (checked), or like a ``DataLoader`` with the sampler as ``sampler``
    (``batch_size=None``) or as ``batch_sampler``.

    Args:
        *args, **kwargs: ``DataLoader`` arguments.
        batches_consumed: a function of no argument returning the micro-batches of the current epoch consumed by
            training, counted from the epoch's start, as an int (or None to use the default count); it takes
            precedence over the default. None (the default): Lightning's count when ``trainer`` fits with this
            loader as a training loader, else this loader's.
        trainer: the ``lightning.Trainer`` (or ``pytorch_lightning.Trainer``) that iterates this loader, e.g.
            ``self.trainer`` in a ``train_dataloader`` hook (held by a weak reference; the Trainer holds this loader
            by a weak reference too, to find the training sampler). None: no Trainer.

    Raises:
        TypeError: the loader's ``sampler`` or ``batch_sampler`` is not a BalancedBatchSampler; ``batches_consumed``
            is not callable.
        ValueError: (at the first micro-batch) ``trainer`` fits more batches per epoch than this loader holds.

    Example:
        >>> from lit_balance import BalancedBatchSampler
        >>> sampler = BalancedBatchSampler([3, 5, 2, 7], max_tokens=8, num_replicas=1, rank=0, shuffle=False)
        >>> loader = BalancedDataLoader(list(range(4)), batch_sampler=sampler)
        >>> it = iter(loader); first = next(it)
        >>> fresh = BalancedDataLoader(list(range(4)), batch_sampler=BalancedBatchSampler(
        ...     [3, 5, 2, 7], max_tokens=8, num_replicas=1, rank=0, shuffle=False))
        >>> fresh.load_state_dict(loader.state_dict())
        >>> [b.tolist() for b in fresh] == [b.tolist() for b in it]
        True
    """

    def __init__(self, *args: Any, batches_consumed: Callable[[], int | None] | None = None, trainer: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the workers leave Ctrl-C and SIGTERM to the main process (lit_balance.data.workers)
        self.worker_init_fn = ignore_stop_signals_in_workers(self.worker_init_fn)
        from lit_balance.sampler.sampler import BalancedBatchSampler

        # the DataLoader draws its batches from batch_sampler when it has one, else from sampler (batch_size=None)
        sampler = self.sampler if self.batch_sampler is None else self.batch_sampler
        if not isinstance(sampler, BalancedBatchSampler):
            raise InputTypeError(f"BalancedDataLoader needs a lit_balance.BalancedBatchSampler as its sampler (with "
                                 f"batch_size=None) or batch_sampler, got sampler={type(self.sampler).__name__}, "
                                 f"batch_sampler={type(self.batch_sampler).__name__}")
        if batches_consumed is not None and not callable(batches_consumed):
            raise InputTypeError(f"batches_consumed must be a function of no argument or None, got "
                                 f"{batches_consumed!r}", parameter="batches_consumed")
        self.balanced_sampler = sampler
        self._batches_consumed = batches_consumed
        self._trainer_ref = None if trainer is None else weakref.ref(trainer)
        if trainer is not None:  # the callbacks' training sampler while the Trainer trains from this loader
            offer_training_loader(trainer, self)
        self._count_source: Callable[[], int | None] | None = None
        self._fit_count: FitCount | None = None
        self._count: _PassCount | None = None
        self._ended_epoch: int | None = None  # restored: the epoch this loader had run out of (mode max_size)

    def __iter__(self) -> Any:
        count = _PassCount()
        self._count = count
        trainer = None if self._trainer_ref is None else self._trainer_ref()  # the Trainer handed over, if any
        self._fit_count = FitCount(trainer, self) if trainer is not None and fitting(trainer) and any(
            x is self for x in training_loaders(trainer)) else None
        self.balanced_sampler._read_by(self)  # the sampler's own state_dict() then knows who counts its pass
        return _CountingIterator(super().__iter__(), count, self.balanced_sampler, self._fit_count, self)

    def set_count_source(self, source: Callable[[], int | None] | None) -> None:
        """Take the default count from ``source``, a training loop's own count (None: this loader's count again).

        It takes precedence over the fit loop's count of a ``trainer`` given to the constructor; a
        ``batches_consumed`` function given to the constructor takes precedence over both.

        Args:
            source: a function of no argument returning the micro-batches of the current epoch consumed by training,
                counted from the epoch's start, or None when it has no count (then this loader's count applies).

        Raises:
            TypeError: ``source`` is neither callable nor None.
        """
        if source is not None and not callable(source):
            raise InputTypeError(f"the count source must be a function of no argument or None, got {source!r}",
                                 parameter="source")
        self._count_source = source

    @property
    def batches_consumed(self) -> int:
        """Micro-batches of the sampler's current epoch consumed by training, counted from the epoch's start (the
        same on every rank): the ``batches_consumed`` function's value when given, else the count source's, else
        Lightning's when the ``trainer`` given fits with this loader, else the micro-batches this loader's latest
        iterator handed out plus where that pass began.

        Raises:
            TypeError: the function or the source returned something other than an int (a bool, a float, a string),
                naming ``batches_consumed`` and the value.
            ValueError: it returned a negative count.
        """
        return self._count_and_source()[0]

    def _count_and_source(self) -> tuple[int, str]:
        """:attr:`batches_consumed` and where it came from (for error messages)."""
        sampler = self.balanced_sampler
        for source, what in ((self._batches_consumed, "the batches_consumed function given to BalancedDataLoader"),
                             (getattr(self, "_count_source", None), "the loader's count source"),
                             (self._fit_count, "fit_batches_consumed of the Trainer given as trainer=")):
            if source is not None:
                given = source()
                if given is not None:
                    return _checked_count(given, what), what
        count = self._count
        if count is None or count.epoch is None or count.epoch != sampler.epoch:
            return sampler.start_micro_step, _OWN_COUNT  # nothing handed out in this epoch's pass yet
        return count.start + count.yielded, _OWN_COUNT

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the micro-batches consumed by training (:attr:`batches_consumed`).

        Returns:
            ``{"version": LOADER_STATE_VERSION, "sampler": BalancedBatchSampler.state_dict(batches_consumed=...)}``:
            plain types (``torch.load(weights_only=True)`` reads it), the same on every rank; with
            ``"ended_epoch": EPOCH`` too when, in a ``CombinedLoader`` of mode ``max_size``, this loader ran out before
            the fit's epoch ended (the sampler's state is then the next epoch's start, and Lightning sets the epoch
            back to EPOCH on resume: the restored loader yields nothing more in it).

        Raises:
            TypeError: the count is not an int (:attr:`batches_consumed`).
            ValueError: the count is negative or outside the current epoch (see
                :meth:`BalancedBatchSampler.state_dict`), naming ``batches_consumed`` and the value.
        """
        consumed, source = self._count_and_source()
        if source == _OWN_COUNT and sys.exc_info()[1] is not None and self._count is not None \
                and self._count.yielded:
            warnings.warn(
                f"BalancedDataLoader.state_dict() is saving {consumed} micro-batches consumed, by the loader's own "
                "count, while an exception is being handled: the micro-batch whose training step raised counts as "
                "trained, so a resume from this state skips it. Under Trainer.fit pass trainer=self.trainer to "
                "balanced_dataloader (the fit loop's count then applies); in a loop of your own pass "
                "batches_consumed= with the micro-batches it finished", RuntimeWarning, stacklevel=2)
        try:
            state = self.balanced_sampler.state_dict(batches_consumed=consumed)
        except InputValueError as error:
            raise InputValueError(f"{error} (the count came from {source})", parameter="batches_consumed") from error
        ended = self._fit_count is not None and self._fit_count.ran_out()
        return {"version": LOADER_STATE_VERSION, "sampler": state,
                **({"ended_epoch": int(self.balanced_sampler.epoch)} if ended else {})}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next iterator yields exactly the micro-batches an uninterrupted run
        would have yielded from there on (see :meth:`BalancedBatchSampler.load_state_dict`, also on another number
        of ranks).

        Raises:
            TypeError: ``state_dict`` is not a mapping.
            ValueError: other keys or version; a sampler state this sampler refuses (naming what differs).
        """
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(f"BalancedDataLoader.load_state_dict expects the dict its state_dict() returned, got "
                                 f"{type(state_dict).__name__}", parameter="state_dict")
        if not {"version", "sampler"} <= set(state_dict) <= {"version", "sampler", "ended_epoch"}:
            raise InputValueError(f"BalancedDataLoader state_dict must have keys ['sampler', 'version'] (and "
                                  f"'ended_epoch' when saved after the loader ran out), got {sorted(state_dict)}; a "
                                  "sampler's own state loads with sampler.load_state_dict(...)", parameter="state_dict")
        if state_dict["version"] != LOADER_STATE_VERSION:
            raise InputValueError(f"BalancedDataLoader state_dict version {state_dict['version']!r} is not supported "
                                  f"(this version reads {LOADER_STATE_VERSION})", parameter="state_dict")
        ended = state_dict.get("ended_epoch")
        if ended is not None and (isinstance(ended, bool) or not isinstance(ended, int) or ended < 0):
            raise InputValueError(f"BalancedDataLoader state_dict: ended_epoch must be an epoch (int >= 0), got "
                                  f"{ended!r}", parameter="state_dict")
        self.balanced_sampler.load_state_dict(dict(state_dict["sampler"]))
        self._count = None
        self._ended_epoch = ended


def balanced_dataloader(dataset: Dataset, sampler: Any, collate_fn: Callable[[Any], Any],
                        **dataloader_kwargs: Any) -> BalancedDataLoader:
    """``DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=collate_fn, ...)``, checked.

    The form that works under Lightning with either ``use_distributed_sampler``: Lightning keeps a
    ``DistributedSampler`` it finds in ``sampler`` and calls its ``set_epoch`` every epoch. Build it in
    ``setup()`` or ``train_dataloader()``, with the sampler built there for the data-parallel world
    (:func:`lit_balance.world.data_parallel_world` of the Trainer) and the Trainer's ``accumulate_grad_batches``.
    The loader is a :class:`BalancedDataLoader`: its ``state_dict()`` saves the micro-batches training consumed (not
    those its workers fetched ahead; under ``Trainer.fit``, the fit loop's own count when ``trainer=self.trainer`` is
    passed), and Lightning saves and restores it with every checkpoint.

    Args:
        dataset: a :class:`MicroBatchDataset` (or :class:`lit_balance.TokenDataset`): indexed by a whole
            micro-batch.
        sampler: a :class:`lit_balance.BalancedBatchSampler` over ``dataset.lengths``.
        collate_fn: turns a micro-batch's items into a batch, e.g. :class:`PadFieldsCollator`.
        **dataloader_kwargs: other DataLoader arguments (``num_workers``, ``pin_memory``, ...), and
            ``trainer`` and ``batches_consumed`` of :class:`BalancedDataLoader` (under ``Trainer.fit``, pass
            ``trainer=self.trainer``).

    Returns:
        A :class:`BalancedDataLoader` whose ``len()`` is the sampler's (micro-batches per rank per epoch).

    Raises:
        TypeError: a dataset that a micro-batch cannot index, a sampler that is not a BalancedBatchSampler, or a
            DataLoader argument that would replace the micro-batches (``batch_size``, ``batch_sampler``,
            ``sampler``, ``shuffle``, ``drop_last``: the sampler's settings hold these).
        ValueError: the sampler planned other lengths than the dataset's, or truncates samples
            (``too_long="truncate"``) that the collator would not truncate.
    """
    from lit_balance.data.dataset import TokenDataset
    from lit_balance.sampler.sampler import BalancedBatchSampler

    owned = sorted(set(dataloader_kwargs) & set(_LOADER_OWNED))
    if owned:
        raise InputTypeError(f"balanced_dataloader got {owned}: the sampler forms the micro-batches; set "
                             + "; ".join(f"{k} through {_LOADER_OWNED[k]}" for k in owned)
                             + " (BatchingSettings) instead")
    if not isinstance(dataset, (MicroBatchDataset, TokenDataset)):
        raise InputTypeError(f"dataset must be a MicroBatchDataset (or TokenDataset), got {type(dataset).__name__}; "
                             "wrap "
                             "it: MicroBatchDataset(dataset, length='input_ids')")
    if not isinstance(sampler, BalancedBatchSampler):
        raise InputTypeError(f"sampler must be a lit_balance.BalancedBatchSampler, got {type(sampler).__name__}")
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if sampler.lengths.shape != lengths.shape:
        raise InputValueError(f"the sampler plans {sampler.lengths.shape[0]} samples but the dataset holds "
                              f"{len(dataset)}; "
                              "build the sampler from dataset.lengths")
    if sampler.settings.too_long == "truncate" and not dataset.cut_by_collator:
        if np.any(lengths > sampler.truncate_to):
            raise InputValueError(f"too_long='truncate' plans {int(np.sum(lengths > sampler.truncate_to))} sample(s) "
                                  "at "
                                  f"{sampler.truncate_to} tokens, but the dataset's items are longer and the collator "
                                  "does not cut them: truncate the items first, or pass too_long='skip' or raise "
                                  "max_tokens")
    elif not np.array_equal(sampler.lengths, lengths):
        first = int(np.flatnonzero(sampler.lengths != lengths)[0])
        raise InputValueError(f"the sampler planned other lengths than the dataset's (index {first}: "
                              f"{int(sampler.lengths[first])} planned, {int(lengths[first])} in the dataset); "
                              "build the sampler from dataset.lengths")
    return BalancedDataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=collate_fn, **dataloader_kwargs)
