"""Hugging Face ``datasets`` objects as corpora: ``Dataset``, ``DatasetDict``, ``IterableDataset`` and a ``Column``.

``datasets`` is an optional dependency (``pip install "lit_balance[datasets]"``): this module never imports it at
import time; an object is recognised by the package its class comes from.

Which columns are read, in order of precedence:

1. ``input_ids`` (lists of ints): pre-tokenized documents, with ``labels`` (lists of ints, ``-100`` = no target,
   unshifted) when that column exists;
2. the ``text_key`` column (strings): documents tokenized by the DataModule's tokenizer;
3. ``prompt`` and ``completion`` (strings): prompt–completion records, tokenized as ``prompt + completion`` with
   labels ``-100`` on the prompt (TRL's convention; see :mod:`lit_balance.data.records`).

Identity (the cache key): a ``Dataset`` has a ``_fingerprint`` that ``datasets`` derives from its content and
every transform applied to it; the key hashes it with the columns read and the row count. An ``IterableDataset``
has none, so its key is the sha256 of what it yields (the values of the columns read, in order), computed while
it is read into the cache: it is read once per process that builds or looks up the cache entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance._fingerprint import sha256_of as _sha256
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["HFCorpus", "describe", "is_datasets_object", "new_digest"]

INSTALL_HINT = 'pip install "lit_balance[datasets]"'
MODES = ("token_ids", "texts", "prompt_completion")
_CHUNK_KIND = {"token_ids": "token_ids", "texts": "texts", "prompt_completion": "pairs"}


def is_datasets_object(obj: Any) -> bool:
    """Whether ``obj`` is an object of the Hugging Face ``datasets`` package (by its class's module)."""
    return type(obj).__module__.split(".")[0] == "datasets"


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"this corpus is a Hugging Face datasets object, but the datasets package cannot be "
                          f"imported ({error}); install it with: {INSTALL_HINT}") from error
    return datasets


@dataclass(frozen=True)
class HFCorpus:
    """What is read from a ``datasets`` object: the mode, the training and validation splits and their identity.

    Attributes:
        mode: ``"token_ids"``, ``"texts"`` or ``"prompt_completion"`` (see the module docstring).
        columns: the columns read, in order.
        train: the ``Dataset`` or ``IterableDataset`` of training documents.
        validation: the ``validation`` split of a ``DatasetDict``, or None.
        fingerprint: identity of the content, or None for an ``IterableDataset`` (hashed while reading).
        description: e.g. ``"Hugging Face Dataset (120 rows, column 'text')"``.
    """

    mode: str
    columns: tuple[str, ...]
    train: Any
    validation: Any
    fingerprint: str | None
    description: str

    @property
    def iterable(self) -> bool:
        """Whether the documents come from an ``IterableDataset`` (no length, no fingerprint)."""
        return self.fingerprint is None

    @property
    def split_sizes(self) -> tuple[int, int] | None:
        """``(training rows, validation rows)`` when a validation split is given, else None."""
        if self.validation is None:
            return None
        return len(self.train), len(self.validation)

    def iter_chunks(self, size: int, digest: Any = None) -> Iterator[tuple[str, list]]:
        """Batches of at most ``size`` rows as ``(kind, items)``: the training split, then the validation split.

        ``kind`` is ``"texts"`` (str items), ``"pairs"`` (``(prompt, completion)`` items) or ``"token_ids"``
        (``(ids, labels or None)`` items, int64 arrays), as :class:`lit_balance.data.sources.CorpusChunk` holds them.

        Args:
            size: documents per chunk.
            digest: a ``hashlib`` object updated with every value read (the identity of an ``IterableDataset``).

        Raises:
            ValueError, TypeError: a value of the wrong type (naming split, row and column).
        """
        for name, split in (("train", self.train), ("validation", self.validation)):
            if split is None:
                continue
            row = 0
            for batch in split.select_columns(list(self.columns)).with_format(None).iter(batch_size=size):
                n = len(batch[self.columns[0]])
                yield _CHUNK_KIND[self.mode], [self._item(batch, i, name, row + i, digest) for i in range(n)]
                row += n

    def _item(self, batch: dict[str, list], i: int, split: str, row: int, digest: Any) -> Any:
        where = f"Hugging Face dataset, split {split!r}, row {row}"
        if self.mode == "token_ids":
            ids = _int_list(batch["input_ids"][i], where, "input_ids")
            labels = None
            if "labels" in batch:
                labels = _int_list(batch["labels"][i], where, "labels")
                if len(labels) != len(ids):
                    raise InputValueError(f"{where}: labels has {len(labels)} entries but input_ids has {len(ids)}; "
                                     "labels must hold one (unshifted) label per token, -100 where there is no target")
            if digest is not None:
                for array in (ids, labels):
                    data = b"" if array is None else np.ascontiguousarray(array, dtype="<i8").tobytes()
                    digest.update(len(data).to_bytes(8, "little") + data)
            return ids, labels
        values = []
        for column in self.columns:
            value = batch[column][i]
            if not isinstance(value, str):
                raise InputTypeError(f"{where}: column {column!r} holds {type(value).__name__} {value!r:.60}, expected a "
                                "string")
            values.append(value)
            if digest is not None:
                data = value.encode("utf-8")
                digest.update(len(data).to_bytes(8, "little") + data)
        return values[0] if self.mode == "texts" else (values[0], values[1])


def _int_list(value: Any, where: str, column: str) -> np.ndarray:
    if value is None:
        raise InputTypeError(f"{where}: column {column!r} is null; expected a list of ints")
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InputTypeError(f"{where}: column {column!r} must be a list of ints, got {type(value).__name__} with dtype "
                        f"{array.dtype} and shape {array.shape}")
    return array.astype(np.int64)


def _mode(columns: list[str], text_key: str, what: str) -> tuple[str, tuple[str, ...]]:
    if "input_ids" in columns:
        return "token_ids", ("input_ids", "labels") if "labels" in columns else ("input_ids",)
    if text_key in columns:
        return "texts", (text_key,)
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion", ("prompt", "completion")
    raise InputValueError(f"{what} has columns {columns}; expected 'input_ids' (pre-tokenized, optional 'labels'), "
                     f"the text column {text_key!r} (set text_key= to the column holding the text), or 'prompt' "
                     "and 'completion'")


def _columns(split: Any) -> list[str]:
    columns = split.column_names
    if columns is None:  # an IterableDataset without features: its first row (read now) names them
        first = next(iter(split), None)
        if first is None:
            raise InputValueError("the Hugging Face IterableDataset yields no rows: corpus is empty")
        columns = list(first)
    return list(columns)


def describe(obj: Any, text_key: str) -> HFCorpus:
    """Read what a ``datasets`` object holds (nothing is tokenized or fully read yet).

    Args:
        obj: a ``Dataset``, ``DatasetDict`` (its ``train`` split, and its ``validation`` split when present),
            ``IterableDataset`` or ``Column`` (one column of a ``Dataset``).
        text_key: the text column.

    Raises:
        ImportError: ``datasets`` cannot be imported (the message says how to install it).
        TypeError: another ``datasets`` object (e.g. an ``IterableDatasetDict``: pass its ``train`` split).
        ValueError: no usable column, a ``DatasetDict`` without a ``train`` split, an empty dataset.
    """
    datasets = _import_datasets()
    column_cls = getattr(datasets.arrow_dataset, "Column", None)
    validation = None
    if column_cls is not None and isinstance(obj, column_cls):
        source = obj.source.select_columns([obj.column_name])
        first = next(iter(source[obj.column_name][:1]), None)
        if first is None:
            raise InputValueError(f"corpus is empty: the column {obj.column_name!r} has no rows")
        if isinstance(first, str):
            return describe(source, obj.column_name)
        return describe(source.rename_column(obj.column_name, "input_ids") if obj.column_name != "input_ids"
                        else source, text_key)
    if isinstance(obj, datasets.DatasetDict):
        if "train" not in obj:
            raise InputValueError(f"the DatasetDict has splits {sorted(obj)} and no 'train' split; pass the split to "
                             "train on (e.g. corpus=dataset_dict['<name>'])")
        train, validation = obj["train"], obj.get("validation")
        label, sizes = "Hugging Face DatasetDict", [f"train {len(train)} rows"]
        if validation is not None:
            sizes.append(f"validation {len(validation)} rows")
    elif isinstance(obj, datasets.Dataset):
        train, label, sizes = obj, "Hugging Face Dataset", [f"{len(obj)} rows"]
    elif isinstance(obj, datasets.IterableDataset):
        train, label, sizes = obj, "Hugging Face IterableDataset", []
    else:
        raise InputTypeError(f"corpus is a {type(obj).__module__}.{type(obj).__qualname__}; expected a datasets.Dataset, "
                        "DatasetDict (train and optional validation splits), IterableDataset or a Dataset column "
                        "(for an IterableDatasetDict, pass its 'train' split)")
    mode, columns = _mode(_columns(train), text_key, f"the {label}")
    if validation is not None:
        missing = [c for c in columns if c not in validation.column_names]
        if missing:
            raise InputValueError(f"the DatasetDict's validation split lacks the column(s) {missing} that its train split "
                             f"has ({list(columns)}); give both splits the same columns")
        if len(validation) == 0:
            raise InputValueError("the DatasetDict's validation split has no rows; drop it or add rows")
    fingerprint = None
    if isinstance(train, datasets.Dataset):
        if len(train) == 0:
            raise InputValueError(f"corpus is empty: the {label} has no rows")
        parts = ["datasets", mode, *columns, train._fingerprint, str(len(train))]
        if validation is not None:
            parts += ["validation", validation._fingerprint, str(len(validation))]
        fingerprint = _sha256(*parts)
    sizes.append(f"column{'s' if len(columns) > 1 else ''} " + ", ".join(repr(c) for c in columns))
    return HFCorpus(mode, columns, train, validation, fingerprint, f"{label} ({', '.join(sizes)})")


def new_digest(corpus: HFCorpus) -> Any:
    """The ``hashlib`` object an ``IterableDataset``'s identity is hashed into while it is read."""
    digest = hashlib.sha256(b"datasets-iterable")
    for part in (corpus.mode, *corpus.columns):
        digest.update(part.encode() + b"\0")
    return digest
