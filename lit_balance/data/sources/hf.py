"""Hugging Face ``datasets`` objects as a corpus: ``Dataset``, ``DatasetDict``, ``IterableDataset`` and ``Column``.

``datasets`` is an optional dependency (``pip install -e ".[datasets]"`` in a clone): this module never imports it at
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

A stream has no length and may never end (``load_dataset(..., streaming=True)`` of a large corpus, a generator), so
an ``IterableDataset`` needs a stated bound, ``max_documents``: reading stops after that many rows (or at the
stream's end, if it comes first). Without one it is refused when the source is built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from lit_balance._checks import check_int
from lit_balance._fingerprint import sha256_of
from lit_balance.data.sources.base import CorpusSource, PromptCompletion, TokenIds
from lit_balance.errors import InputTypeError, InputValueError

__all__ = ["HuggingFaceSource", "is_datasets_object"]

INSTALL_HINT = 'pip install -e ".[datasets]" (in a clone of lit_balance)'
MODES = ("token_ids", "texts", "prompt_completion")
_READ_ROWS = 4096  # rows per batch read from a dataset


def is_datasets_object(obj: Any) -> bool:
    """Whether ``obj`` is an object of the Hugging Face ``datasets`` package (by its class's module).

    Example:
        >>> is_datasets_object(["a"])
        False
    """
    return type(obj).__module__.split(".")[0] == "datasets"


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"this corpus is a Hugging Face datasets object, but the datasets package cannot be "
                          f"imported ({error}); install it with: {INSTALL_HINT}") from error
    return datasets


def _int_list(value: Any, where: str, column: str) -> np.ndarray:
    if value is None:
        raise InputTypeError(f"{where}: column {column!r} is null; expected a list of ints")
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InputTypeError(f"{where}: column {column!r} must be a list of ints, got {type(value).__name__} with "
                             f"dtype {array.dtype} and shape {array.shape}")
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
                          "and 'completion'", parameter="text_key")


def _columns(split: Any) -> list[str]:
    columns = split.column_names
    if columns is None:  # an IterableDataset without features: its first row (read now) names them
        first = next(iter(split), None)
        if first is None:
            raise InputValueError("the Hugging Face IterableDataset yields no rows: corpus is empty")
        columns = list(first)
    return list(columns)


class HuggingFaceSource(CorpusSource):
    """A Hugging Face ``datasets`` object (see the module docstring for the columns read and the identity).

    Nothing is tokenized or fully read when the source is created; an ``IterableDataset`` without features
    yields its first row to name its columns.

    Args:
        dataset: a ``Dataset``, ``DatasetDict`` (its ``train`` split, and its ``validation`` split when present:
            :attr:`split_sizes`), ``IterableDataset`` or ``Column`` (one column of a ``Dataset``).
        text_key: the text column.
        max_documents: rows read at most from an ``IterableDataset`` (global: the whole corpus, before the
            validation split is drawn from it); required for one, since a stream may never end. Not accepted for
            the other kinds, which have a length (``dataset.select(range(n))`` takes the first ``n`` rows).

    Raises:
        ImportError: ``datasets`` cannot be imported (the message says how to install it).
        TypeError: another ``datasets`` object (e.g. an ``IterableDatasetDict``: pass its ``train`` split).
        ValueError: no usable column, a ``DatasetDict`` without a ``train`` split or whose ``validation`` split
            lacks a column or rows, an empty dataset; an ``IterableDataset`` without ``max_documents``, or
            ``max_documents`` with another kind.
        TypeError: ``max_documents`` not an int.
    """

    kind = "datasets"

    def __init__(self, dataset: Any, text_key: str = "text", max_documents: int | None = None) -> None:
        datasets = _import_datasets()
        if max_documents is not None:
            max_documents = check_int("max_documents", max_documents, 1, "rows read from an IterableDataset")
        if isinstance(dataset, datasets.IterableDataset) and max_documents is None:
            raise InputValueError(
                "the corpus is a Hugging Face IterableDataset: a stream has no length and may never end, so reading it "
                "into the cache needs a bound; pass max_documents=<rows to read> (BalancedTextDataModule(..., "
                "max_documents=...) or HuggingFaceSource(..., max_documents=...))",
                parameter="max_documents")
        if max_documents is not None and not isinstance(dataset, datasets.IterableDataset):
            raise InputValueError(
                f"max_documents={max_documents} bounds a streamed Hugging Face IterableDataset, but the corpus is a "
                f"{type(dataset).__name__}, which has a length: leave max_documents=None (to train on fewer rows, "
                "pass dataset.select(range(n)))", parameter="max_documents")
        self.max_documents = max_documents
        column_cls = getattr(datasets.arrow_dataset, "Column", None)
        if column_cls is not None and isinstance(dataset, column_cls):
            source = dataset.source.select_columns([dataset.column_name])
            first = next(iter(source[dataset.column_name][:1]), None)
            if first is None:
                raise InputValueError(f"corpus is empty: the column {dataset.column_name!r} has no rows")
            if isinstance(first, str):
                dataset, text_key = source, dataset.column_name
            else:
                dataset = (source.rename_column(dataset.column_name, "input_ids")
                           if dataset.column_name != "input_ids" else source)
        validation = None
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset:
                raise InputValueError(f"the DatasetDict has splits {sorted(dataset)} and no 'train' split; pass the "
                                      "split to train on (e.g. corpus=dataset_dict['<name>'])")
            train, validation = dataset["train"], dataset.get("validation")
            label, sizes = "Hugging Face DatasetDict", [f"train {len(train)} rows"]
            if validation is not None:
                sizes.append(f"validation {len(validation)} rows")
        elif isinstance(dataset, datasets.Dataset):
            train, label, sizes = dataset, "Hugging Face Dataset", [f"{len(dataset)} rows"]
        elif isinstance(dataset, datasets.IterableDataset):
            train, label, sizes = dataset, "Hugging Face IterableDataset", [f"at most {max_documents} rows"]
        else:
            raise InputTypeError(f"corpus is a {type(dataset).__module__}.{type(dataset).__qualname__}; expected a "
                                 "datasets.Dataset, DatasetDict (train and optional validation splits), "
                                 "IterableDataset or a Dataset column (for an IterableDatasetDict, pass its 'train' "
                                 "split)")
        mode, columns = _mode(_columns(train), text_key, f"the {label}")
        if validation is not None:
            missing = [c for c in columns if c not in validation.column_names]
            if missing:
                raise InputValueError(f"the DatasetDict's validation split lacks the column(s) {missing} that its "
                                      f"train split has ({list(columns)}); give both splits the same columns")
            if len(validation) == 0:
                raise InputValueError("the DatasetDict's validation split has no rows; drop it or add rows")
        identity = None
        if isinstance(train, datasets.Dataset):
            if len(train) == 0:
                raise InputValueError(f"corpus is empty: the {label} has no rows")
            identity = [mode, *columns, train._fingerprint, str(len(train))]
            if validation is not None:
                identity += ["validation", validation._fingerprint, str(len(validation))]
        sizes.append(f"column{'s' if len(columns) > 1 else ''} " + ", ".join(repr(c) for c in columns))
        self._mode, self._columns, self._train, self._validation = mode, columns, train, validation
        self._identity = None if identity is None else tuple(identity)
        self._description = f"{label} ({', '.join(sizes)})"
        self._read: dict[str, str] = {}  # an IterableDataset's content digest, once read to its end

    @property
    def mode(self) -> str:
        """``"token_ids"``, ``"texts"`` or ``"prompt_completion"``: what the columns read hold."""
        return self._mode

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns read, in order."""
        return self._columns

    @property
    def iterable(self) -> bool:
        """Whether the documents come from an ``IterableDataset`` (no length, no fingerprint)."""
        return self._identity is None

    def identity(self) -> tuple[str, ...]:
        """Mode, columns, the ``_fingerprint`` and row count of the training split (and of the validation split);
        for an ``IterableDataset``, mode and columns only (its content is hashed while it is read)."""
        return self._identity if self._identity is not None else (self._mode, *self._columns)

    @property
    def fingerprint(self) -> str:
        """sha256 of ``"datasets"`` and :meth:`identity`; for an ``IterableDataset``, of ``"datasets-iterable"``,
        its mode and columns (its content fingerprint is known once read: :meth:`content_fingerprint`)."""
        if self._identity is None:
            return sha256_of("datasets-iterable", self._mode, *self._columns)
        return super().fingerprint

    @property
    def description(self) -> str:
        """E.g. ``"Hugging Face Dataset (120 rows, column 'text')"``."""
        return self._description

    @property
    def holds_token_ids(self) -> bool:
        """Whether the ``input_ids`` column is read."""
        return self._mode == "token_ids"

    @property
    def split_sizes(self) -> tuple[int, int] | None:
        """``(training rows, validation rows)`` of a ``DatasetDict`` with a ``validation`` split, else None."""
        if self._validation is None:
            return None
        return len(self._train), len(self._validation)

    @property
    def key_after_reading(self) -> bool:
        """Whether this is an ``IterableDataset`` not read to its end yet in this process."""
        return self._identity is None and "digest" not in self._read

    @property
    def num_documents(self) -> int | None:
        """Rows of the training (and validation) split; None for an ``IterableDataset``."""
        if self._identity is None:
            return None
        return sum(self.split_sizes or (len(self._train),))

    def content_fingerprint(self) -> str:
        """:attr:`fingerprint`, or for an ``IterableDataset`` the sha256 of what it yielded.

        Raises:
            RuntimeError: an ``IterableDataset`` not read yet (see :attr:`key_after_reading`).
        """
        if self._identity is not None:
            return self.fingerprint
        if "digest" not in self._read:
            raise RuntimeError("the identity of an IterableDataset corpus is the hash of its content: read it "
                               "with iter_chunks() first (load_or_build does)")
        return self._read["digest"]

    def load_texts(self) -> list[str]:
        """The texts of the ``text_key`` column (see :meth:`CorpusSource.load_texts`).

        Raises:
            TypeError: the dataset holds token ids or prompt–completion records.
        """
        if not self.holds_token_ids and self._mode != "texts":
            raise InputTypeError("this corpus holds prompt–completion records, not only texts; call iter_chunks()")
        return super().load_texts()

    def read_records(self) -> Iterator[Any]:
        """The rows of the training split, then of the validation split, read in batches; reading an
        ``IterableDataset`` to its end records the sha256 of its content, its identity (:meth:`content_fingerprint`).

        Raises:
            ValueError, TypeError: a value of the wrong type (naming split, row and column), or no row at all.
        """
        digest = None
        if self._identity is None:
            digest = hashlib.sha256(b"datasets-iterable")
            for part in (self._mode, *self._columns):
                digest.update(part.encode() + b"\0")
        count = 0
        for name, split in (("train", self._train), ("validation", self._validation)):
            if split is None:
                continue
            row, bound = 0, self.max_documents
            for batch in split.select_columns(list(self._columns)).with_format(None).iter(batch_size=_READ_ROWS):
                n = len(batch[self._columns[0]])
                if bound is not None:
                    n = min(n, bound - row)
                for i in range(n):
                    yield self._record(batch, i, name, row + i, digest)
                row += n
                if bound is not None and row >= bound:
                    break  # the stated bound: a stream may never end
            count += row
        if count == 0:
            raise InputValueError(f"corpus is empty: the {self._description} yields no rows")
        if digest is not None:
            digest.update(count.to_bytes(8, "little"))
            self._read["digest"] = digest.hexdigest()

    def _record(self, batch: dict[str, list], i: int, split: str, row: int, digest: Any) -> Any:
        where = f"Hugging Face dataset, split {split!r}, row {row}"
        if self._mode == "token_ids":
            ids = _int_list(batch["input_ids"][i], where, "input_ids")
            labels = None
            if "labels" in batch:
                labels = _int_list(batch["labels"][i], where, "labels")
                if len(labels) != len(ids):
                    raise InputValueError(f"{where}: labels has {len(labels)} entries but input_ids has {len(ids)}; "
                                          "labels must hold one (unshifted) label per token, -100 where there is "
                                          "no target")
            if digest is not None:
                for array in (ids, labels):
                    data = b"" if array is None else np.ascontiguousarray(array, dtype="<i8").tobytes()
                    digest.update(len(data).to_bytes(8, "little") + data)
            return ids if labels is None else TokenIds(ids, labels)
        values = []
        for column in self._columns:
            value = batch[column][i]
            if not isinstance(value, str):
                raise InputTypeError(f"{where}: column {column!r} holds {type(value).__name__} {value!r:.60}, "
                                     "expected a string")
            values.append(value)
            if digest is not None:
                data = value.encode("utf-8")
                digest.update(len(data).to_bytes(8, "little") + data)
        return values[0] if self._mode == "texts" else PromptCompletion(values[0], values[1])
