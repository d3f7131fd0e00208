"""MixtureDataModule: :class:`~lit_balance.BalancedTextDataModule` over a :class:`~lit_balance.data.mixture.Mixture`.

``BalancedTextDataModule(corpus=Mixture(...))`` builds one (the class is chosen by the corpus). Every component is
resolved, tokenized (or read in place, for a store) and split into training and validation documents on its own, with
the DataModule's settings; the vocabulary and pad id are the one tokenizer's, checked to agree for every component.
Training reads the mixture through :class:`~lit_balance.sampler.mixture.MixtureBatchSampler`; validation has one
loader per component (in the mixture's order; :attr:`MixtureDataModule.val_names` names them), so a model logs
``val/loss/<name>`` beside ``val/loss`` (the built-in :class:`~lit_balance.demo.model.DemoTransformerLM` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader

from lit_balance.data.collate import collator_for
from lit_balance.data.corpus_tokenizer import corpus_tokenizer
from lit_balance.data.mixture import Mixture, MixtureDataset
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.splits import resolve_val_fraction, split_corpus
from lit_balance.data.cache import open_corpus
from lit_balance.data.tokenizer import TokenizerAdapter
from lit_balance.data.vocabulary import components_vocabulary
from lit_balance.errors import InputValueError
from lit_balance.lightning.agreement import plan_fingerprint
from lit_balance.lightning.datamodule import BalancedTextDataModule, _Splits
from lit_balance.plan.epoch import planner_for
from lit_balance.sampler.mixture import MixtureBatchSampler

__all__ = ["MixtureDataModule"]


class _MixtureCorpus(NamedTuple):
    """The components' tokenized corpora, as one corpus for the resume and agreement checks."""

    corpora: tuple
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_empty(self) -> int:
        """Documents dropped as empty after tokenization, over the components."""
        return sum(int(c.num_empty) for c in self.corpora)


class MixtureDataModule(BalancedTextDataModule):
    """A :class:`~lit_balance.BalancedTextDataModule` whose corpus is a :class:`~lit_balance.data.mixture.Mixture`.

    Args:
        corpus: the :class:`~lit_balance.data.mixture.Mixture`.
        tokenizer, **kwargs: as :class:`~lit_balance.BalancedTextDataModule`; ``val_fraction`` holds out that share
            of every component (a Hugging Face ``DatasetDict`` component brings its own split).

    Attributes:
        mixture: the mixture.
        val_names: the names of the validation loaders, in order (components with validation documents).

    Raises:
        ValueError: components whose vocabularies or pad ids differ (naming both), and what the DataModule and
            :class:`~lit_balance.data.mixture.Mixture` refuse; all before any token is read.
    """

    def __init__(self, corpus: Mixture | Mapping[str, Any], tokenizer: Any = None, **kwargs: Any) -> None:
        if isinstance(corpus, Mapping):  # Mixture's arguments, as a config gives them
            corpus = Mixture(**corpus)
        if not isinstance(corpus, Mixture):
            raise InputValueError(f"MixtureDataModule takes a lit_balance.Mixture as corpus, got "
                                  f"{type(corpus).__name__}", parameter="corpus")
        self.mixture = corpus
        self._sources = [resolve_corpus(c, text_key=kwargs.get("text_key", "text"),
                                        txt_documents=kwargs.get("txt_documents", "line")) for c in corpus.corpora]
        super().__init__(None, tokenizer, **kwargs)
        self.source = self._sources[0]
        self._val_fractions = [resolve_val_fraction(kwargs.get("val_fraction"), s.split_sizes) for s in self._sources]
        self.val_fraction = max(self._val_fractions)
        self.val_names: list[str] = []
        self.val_datasets: list[Any] = []
        self.val_samplers: list[Any] = []

    @property
    def corpus_description(self) -> str:
        """The mixture's components and their target shares."""
        return self.mixture.description

    def _resolve_tokenizer(self, tokenizer: Any, vocab_size: Any, pad_token_id: Any) -> TokenizerAdapter:
        """The one tokenizer of every component: the vocabulary and pad id are decided here, once."""
        adapters = [corpus_tokenizer(s, tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                     add_special_tokens=self.add_special_tokens,
                                     allow_tokenizer_mismatch=self.allow_tokenizer_mismatch) for s in self._sources]
        return components_vocabulary(self.mixture.names, adapters)

    def _tokenized(self) -> _MixtureCorpus:
        corpora = tuple(open_corpus(s, self.tokenizer, self.cache_dir, progress=True) for s in self._sources)
        return _MixtureCorpus(corpora, np.concatenate([np.asarray(c.lengths, dtype=np.int64) for c in corpora]))

    def _splits(self) -> Any:
        corpus = self._tokenized()
        trains, vals = [], []
        for source, part, fraction in zip(self._sources, corpus.corpora, self._val_fractions):
            train, val = split_corpus(part, val_fraction=fraction, seed=self.seed, max_length=self.max_length,
                                      split_sizes=source.split_sizes)
            trains.append(train)
            vals.append(val)
        return _Splits(corpus, MixtureDataset(trains, self.mixture.settings.max_repetition), vals)

    def _build_samplers(self) -> None:
        """The mixture's training sampler (:class:`~lit_balance.sampler.mixture.MixtureBatchSampler`) and one
        validation sampler per component with validation documents."""
        vals = self.val_dataset
        world = self._world()
        sampler = self.training_sampler(self._train_settings(), world.num_replicas, rank=world.rank,
                                        cost_model=self.cost_model)
        val_settings = self.settings.replace(shuffle=False, drop_last=False, largest_first=False,
                                             accumulate_grad_batches=1)
        names, datasets, samplers = [], [], []
        for name, val in zip(self.mixture.names, vals):
            if val is not None:
                names.append(name)
                datasets.append(val)
                samplers.append(self._sampler(f"validation of {name!r}", val, val_settings, world))
        self.train_sampler = sampler
        self.val_names, self.val_datasets, self.val_samplers = names, datasets, samplers
        self.val_dataset = datasets[0] if datasets else None
        self.val_sampler = samplers[0] if samplers else None
        truncate = sampler.truncate_to if self.too_long == "truncate" else None
        self.collator = collator_for(sampler.settings, self.pad_token_id, max_length=truncate)

    def _fingerprint(self) -> list[tuple[str, int, bool]]:
        planned = self._settings is not None
        settings = self.train_sampler.settings.to_dict() if planned else {**self._batching, "max_tokens": "auto"}
        return plan_fingerprint(
            corpus_lengths=self.corpus.lengths, tokenizer_fingerprint=self.tokenizer.fingerprint,
            max_length=self.max_length, seed=self.seed, val_fraction=self.val_fraction, settings=settings,
            train_lengths=self.train_dataset.lengths, train_lengths_sha256=None,
            val_lengths=None if not self.val_datasets else np.concatenate([v.lengths for v in self.val_datasets]))

    def val_dataloader(self) -> DataLoader | list:
        """One loader of validation micro-batches per component with validation documents (:attr:`val_names`)."""
        self._plan(measure=True)
        return [self._loader(d, s) for d, s in zip(self.val_datasets, self.val_samplers)]

    def plan_summary(self, num_replicas: int, accumulate_grad_batches: int = 1, *, epoch: int = 0) -> dict[str, Any]:
        """Preview the training mixture's plan for ``num_replicas`` ranks (changes nothing on the DataModule).

        Returns:
            ``{"settings": {...}, "balanced": {padding_ratio, useful_fraction, micro_batches_per_rank,
            optimizer_steps}, "mixture": {names, shares (targets), step_shares (realized, one list per optimizer
            step, in the mixture's unit), max_step_deviation (per component)}}``.
        """
        from lit_balance.plan.cost import CostModel
        from lit_balance.plan.mixture import plan_mixture
        from lit_balance.plan.stats import plan_stats

        settings = self.settings.replace(accumulate_grad_batches=accumulate_grad_batches)
        train = self._splits().train_dataset
        lengths = train.layout.tile(np.minimum(train.lengths, settings.truncate_to))
        cost_model = self.cost_model if self.cost_model is not None else CostModel()
        mp = plan_mixture(lengths, train.layout, self.mixture.settings, settings, num_replicas=num_replicas,
                          epoch=epoch, cost_model=cost_model)
        stats = plan_stats(mp.plan, lengths, cost_model, pad_to_multiple_of=settings.pad_to_multiple_of,
                           accumulate_grad_batches=accumulate_grad_batches, planner=planner_for(settings))
        units = mp.step_units.astype(np.float64)
        shares = units / np.maximum(units.sum(axis=1, keepdims=True), 1.0)
        target = self.mixture.settings.shares
        return {"settings": {**settings.to_dict(), "num_replicas": num_replicas, "epoch": epoch},
                "balanced": {"padding_ratio": stats.padding_ratio, "useful_fraction": stats.useful_fraction,
                             "micro_batches_per_rank": mp.plan.num_micro_steps, "optimizer_steps": int(units.shape[0])},
                "mixture": {"names": list(self.mixture.names), "unit": self.mixture.settings.unit,
                            "shares": target.tolist(), "step_shares": shares.tolist(),
                            "max_step_deviation": np.abs(shares - target).max(axis=0).tolist() if units.size
                            else [0.0] * len(target)}}

    def training_sampler(self, settings: Any, num_replicas: int, *, rank: int = 0,
                         cost_model: Any = None) -> MixtureBatchSampler:
        """A training sampler of this mixture for ``num_replicas`` ranks with the :class:`~lit_balance.BatchingSettings`
        ``settings`` (after :meth:`setup`; changes nothing on the DataModule): what training uses and
        ``lit-balance plan`` reports."""
        train = self.train_dataset
        kwargs: dict[str, Any] = {}
        if train.labels is not None:
            cut = settings.truncate_to if settings.too_long == "truncate" else None
            kwargs["supervised_lengths"] = train.supervised_lengths(cut)
        if cost_model is not None:
            kwargs["cost_model"] = cost_model
        return MixtureBatchSampler(train.lengths, train.layout.sizes, self.mixture.settings, settings=settings,
                                   num_replicas=num_replicas, rank=rank, **kwargs)

    def component_tokens(self, indices: Any, is_fill: Any, lengths: Any) -> np.ndarray:
        """int64 ``[num_components]``: real tokens of each component among a batch's rows (``indices``, ``is_fill`` and
        each row's ``lengths``, per rank)."""
        indices, lengths = np.asarray(indices, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        keep = ~np.asarray(is_fill, dtype=bool)
        return np.bincount(self.train_sampler.component_of(indices[keep]), weights=lengths[keep],
                           minlength=len(self.mixture.names)).astype(np.int64)
