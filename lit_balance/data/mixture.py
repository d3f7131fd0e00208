"""A mixture corpus: named components, each any corpus the DataModule takes, with a weight; and the dataset that
reads the mixture's sample space (:class:`~lit_balance.plan.mixture.MixtureLayout`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lit_balance.data.dataset import MicroBatchItems
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings

__all__ = ["Mixture", "MixtureDataset"]


class Mixture:
    """A corpus blended from named components, each with a weight: pass it as ``corpus`` to
    :class:`~lit_balance.BalancedTextDataModule`.

    Args:
        components: ``{name: {"corpus": ..., "weight": w}}`` (a Hydra or YAML mapping reads so; optionally
            ``"max_documents": n``, the bound of a Hugging Face ``IterableDataset`` component, a stream), or
            ``{name: (corpus, weight)}``. A component's ``corpus`` is anything the DataModule takes as its corpus
            (text or ``.jsonl`` files, a list of texts or of token-id lists, a Hugging Face dataset or bounded
            stream, a Megatron, datatrove or Arrow store).
        unit: what the weights share: ``"tokens"`` (the default), ``"supervised_tokens"`` or ``"documents"``
            (:class:`~lit_balance.plan.mixture.MixtureSettings`).
        max_repetition: the most reads of a document in one epoch.
        tokens_per_epoch: the epoch's length in ``unit`` (global), or None: as long as the components allow.

    Raises:
        TypeError: ``components`` not a mapping, or a component neither a mapping nor a pair.
        ValueError: a component without ``corpus``, with unknown keys, and what
            :class:`~lit_balance.plan.mixture.MixtureSettings` refuses (weights, names, unit), before any token is read.

    Example:
        >>> mix = Mixture({"web": {"corpus": ["a b", "c"], "weight": 3}, "code": (["d e f"], 1)})
        >>> mix.names, mix.settings.shares.tolist()
        (('web', 'code'), [0.75, 0.25])
    """

    def __init__(self, components: Mapping[str, Any], *, unit: str = "tokens", max_repetition: int = 1,
                 tokens_per_epoch: int | None = None) -> None:
        if not isinstance(components, Mapping):
            raise InputTypeError(f"components must map each component's name to its corpus and weight, got "
                                 f"{type(components).__name__}", parameter="components")
        corpora, weights, bounds = [], [], []
        for name, spec in components.items():
            if isinstance(spec, Mapping):
                unknown = sorted(set(spec) - {"corpus", "weight", "max_documents"})
                if unknown or "corpus" not in spec:
                    raise InputValueError(f"component {name!r} must have 'corpus' and 'weight' (and, for a stream, "
                                          f"'max_documents'), got keys {sorted(spec)}", parameter=f"components.{name}")
                corpora.append(spec["corpus"])
                weights.append(spec.get("weight", 1.0))
                bounds.append(spec.get("max_documents"))
            elif isinstance(spec, (tuple, list)) and len(spec) == 2:
                corpora.append(spec[0])
                weights.append(spec[1])
                bounds.append(None)
            else:
                raise InputTypeError(f"component {name!r} must be {{'corpus': ..., 'weight': ...}} or (corpus, "
                                     f"weight), got {type(spec).__name__}", parameter=f"components.{name}")
        self.settings = MixtureSettings(tuple(components), tuple(weights), unit=unit, max_repetition=max_repetition,
                                        units_per_epoch=tokens_per_epoch)
        self.corpora = tuple(corpora)
        #: Per component: the rows read at most from a Hugging Face ``IterableDataset`` (a stream), or None.
        self.max_documents = tuple(bounds)

    @classmethod
    def of(cls, corpus: Any, *, name: str = "train", max_documents: int | None = None) -> Mixture:
        """The blend a DataModule reads: ``corpus`` itself when it is a :class:`Mixture`, a mixture built from the
        mapping of its arguments a config gives (``{"components": {...}, ...}``), else a blend of one component
        ``name`` (weight 1) whose corpus is ``corpus``, read to at most ``max_documents`` rows when it is a stream.

        Raises:
            ValueError: ``max_documents`` beside a mixture (give each stream component its own), and what
                :class:`Mixture` refuses.

        Example:
            >>> Mixture.of(["a b", "c"]).names, Mixture.of({"components": {"x": (["a"], 1)}}).names
            (('train',), ('x',))
        """
        if isinstance(corpus, Mapping) and "components" in corpus:
            corpus = cls(**corpus)
        if isinstance(corpus, Mixture):
            if max_documents is not None:
                raise InputValueError(
                    f"max_documents={max_documents!r} cannot bound a Mixture corpus (components "
                    f"{list(corpus.names)}): give a stream component its own bound, "
                    "{'corpus': stream, 'weight': w, 'max_documents': n}, and leave max_documents=None",
                    parameter="max_documents")
            return corpus
        return cls({name: {"corpus": corpus, "weight": 1, "max_documents": max_documents}})

    @property
    def plain(self) -> bool:
        """Whether the blend is planned as one corpus: one component, read once per epoch, to its end (a sampler
        of one corpus, :class:`~lit_balance.BalancedBatchSampler`, plans exactly its samples)."""
        s = self.settings
        return len(s.names) == 1 and s.max_repetition == 1 and s.units_per_epoch is None

    @property
    def names(self) -> tuple[str, ...]:
        """The components' names, in order."""
        return self.settings.names

    @property
    def description(self) -> str:
        """The components with their target shares and the unit, e.g. ``"mixture of web 0.6, code 0.4 (shares of
        tokens)"``."""
        parts = ", ".join(f"{n} {s:.4g}" for n, s in zip(self.names, self.settings.shares.tolist()))
        return f"mixture of {parts} (shares of {self.settings.unit.replace('_', ' ')})"

    def __repr__(self) -> str:
        weights = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.settings.weights))
        return f"Mixture({weights}, unit={self.settings.unit!r})"


class MixtureDataset(MicroBatchItems):
    """The components' datasets as one, indexed by the mixture's sample space.

    Sample ``i`` is item ``(i % N) - offsets[c]`` of component ``c``'s dataset; items carry ``index`` ``i`` (the
    sample index the sampler planned) and ``component`` ``c``. Indexing with a list (or a
    :class:`~lit_balance.MicroBatch`, whose fill mask and step totals are carried) returns the list of items.

    Args:
        datasets: one map-style dataset per component (``lengths`` and ``_item(i, is_fill)`` as
            :class:`~lit_balance.data.dataset.TokenDataset` has).
        max_repetition: copies of every document in the sample space.
    """

    def __init__(self, datasets: Sequence[Any], max_repetition: int = 1) -> None:
        self.datasets = list(datasets)
        self.layout = MixtureLayout(np.array([len(d) for d in self.datasets], dtype=np.int64), max_repetition)
        #: int64 ``[N]``: tokens per document, components in order (one copy).
        self.lengths = np.concatenate([np.asarray(d.lengths, dtype=np.int64) for d in self.datasets]) \
            if self.datasets else np.zeros(0, np.int64)
        self.labels = next((d.labels for d in self.datasets if getattr(d, "labels", None) is not None), None)

    def __len__(self) -> int:
        return self.layout.num_samples

    def supervised_lengths(self, max_length: int | None = None) -> np.ndarray:
        """int64 ``[N]``: next-token targets of each document (one copy), components in order."""
        return np.concatenate([np.asarray(d.supervised_lengths(max_length), dtype=np.int64) for d in self.datasets])

    def _item(self, i: int, is_fill: bool = False) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a mixture of {len(self)} samples")
        c, d = (int(v) for v in self.layout.locate(np.array([i]))[0])
        item = self.datasets[c]._item(d, is_fill)
        item["index"], item["component"] = i, c
        return item

