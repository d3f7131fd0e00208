"""BalancedTextDataModule: tokenize a corpus once, feed every rank token-budgeted micro-batches.

Lightning glue over the data layer. The corpus is always a blend of named components (:class:`~lit_balance.Mixture`;
a plain corpus is a blend of one, ``train``): :mod:`lit_balance.data` tokenizes and caches each component and splits it
(:mod:`lit_balance.data.splits`); the training split is planned for this rank of the data-parallel world
(:func:`lit_balance.world.data_parallel_world`) by :meth:`BalancedTextDataModule.training_sampler` (a blend of one by
:class:`~lit_balance.BalancedBatchSampler`, as one corpus always was; several components by
:class:`~lit_balance.sampler.mixture.MixtureBatchSampler`), each component's validation split by its own sampler; and
:mod:`lit_balance.lightning.agreement` checks at ``setup`` that every process planned the same data.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_balance._checks import check_bool, check_int
from lit_balance.data.cache import open_corpus
from lit_balance.data.collate import PackedCollator, PadCollator, collator_for
from lit_balance.data.corpus_tokenizer import check_cache_dir, corpus_tokenizer
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.mixture import Mixture, MixtureDataset, check_distinct_components
from lit_balance.data.pieces import PieceDataset
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.splits import check_supervised_targets, check_too_long, resolve_val_fraction, split_corpus
from lit_balance.data.stores import TokenizedCorpus
from lit_balance.data.tokenizer import TokenizerAdapter
from lit_balance.data.training_sampler import use_training_sampler
from lit_balance.data.vocabulary import components_vocabulary
from lit_balance.data.workers import ignore_stop_signals_in_workers
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.agreement import check_ranks_agree, plan_fingerprint
from lit_balance.lightning.budget import DEFAULT_MEMORY_FRACTION, TokenBudget, find_max_tokens
from lit_balance.lightning.meters import CPU_MMAP_THRESHOLD
from lit_balance.lightning.dm_settings import DEFAULT_MAX_TOKENS, auto_budget, batching_settings
from lit_balance.lightning.rank_errors import share_failure
from lit_balance.lightning.stream_data import stream_component
from lit_balance.lightning.resume_checks import (
    TrainLoader,
    check_saved_data,
    data_identity,
    fit_batches_consumed,
    settings_advice,
)
from lit_balance.plan.budget_search import ProbeLayout
from lit_balance.plan.cost import CostModel, check_cost_model
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.shapes import resolve_split_shapes
from lit_balance.plan.mixture_schedule import check_weights_schedule
from lit_balance.plan.warmup import check_warmup_settings
from lit_balance.sampler.mixture import MixtureBatchSampler
from lit_balance.sampler.plans import LengthWarmupPlans
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.sampler.state import SettingsMismatchError, check_skip_steps
from lit_balance.schedule import Schedule
from lit_balance.world import DataParallelWorld, data_parallel_world

__all__ = ["DEFAULT_MAX_TOKENS", "BalancedTextDataModule", "fit_batches_consumed"]


class _Corpora(NamedTuple):
    """Several components' tokenized corpora, in the blend's order, as one corpus for the resume and agreement checks
    (one component's corpus is its own :class:`~lit_balance.data.stores.TokenizedCorpus`).

    Attributes:
        corpora: one :class:`~lit_balance.data.stores.TokenizedCorpus` per component.
        lengths: int64 ``[documents]``: every component's token lengths, concatenated.
    """

    corpora: tuple[TokenizedCorpus, ...]
    lengths: np.ndarray

    @classmethod
    def of(cls, corpora: tuple[TokenizedCorpus, ...]) -> TokenizedCorpus | _Corpora:
        """``corpora[0]`` for one component, else the components as one."""
        if len(corpora) == 1:
            return corpora[0]
        return cls(corpora, np.concatenate([np.asarray(c.lengths, dtype=np.int64) for c in corpora]))

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_empty(self) -> int:
        """Documents dropped as empty after tokenization, over the components."""
        return sum(int(c.num_empty) for c in self.corpora)


class _Splits(NamedTuple):
    """The tokenized components, each component's training dataset, the training dataset (one component's
    :class:`TokenDataset`, or the blend's :class:`MixtureDataset` over them) and each component's validation dataset
    (None where it has none)."""

    corpora: tuple[TokenizedCorpus, ...]
    train_splits: list[TokenDataset]
    train_dataset: TokenDataset | MixtureDataset
    val_splits: list[TokenDataset | None]


def _setting(name: str) -> property:
    """A read-only property of the DataModule that returns the batching setting ``name``."""
    return property(lambda self: self._batching[name],
                    doc=f"``settings.{name}`` (read-only; see :class:`~lit_balance.BatchingSettings`).")


class BalancedTextDataModule(L.LightningDataModule):
    """A LightningDataModule that tokenizes a corpus and feeds each rank token-budgeted micro-batches.

    With no arguments it uses the built-in corpus (the docstrings of the running Python's standard
    library, so it needs no download) and the built-in BERT-uncased WordPiece tokenizer (30,522 tokens).

    The corpus is a blend of named components (:attr:`mixture`): a plain corpus is a blend of one, named ``train``;
    a :class:`~lit_balance.Mixture` names its components and weights them (docs/mixtures.md). Every step below runs
    once per component, with the same code whatever their number.

    Data flow: ``prepare_data`` (one process per node) tokenizes each component into a cache of plain
    arrays keyed by corpus and tokenizer; ``setup`` loads them on every rank, splits each component's documents into
    train and validation (a permutation seeded by ``seed``), truncates each to ``max_length`` tokens, and
    builds the samplers for this rank of the data-parallel world
    (:func:`lit_balance.world.data_parallel_world`: the rank and size of the strategy's
    ``distributed_sampler_kwargs``; processes of one tensor-parallel replica get the same micro-batches): the training
    split's (:meth:`training_sampler`) with :attr:`settings` and the Trainer's ``accumulate_grad_batches``, one
    :class:`BalancedBatchSampler` per component's validation split, with the training sampler's settings (static
    shapes included) but unshuffled, without drop_last, largest_first or accumulation, with the default cost model.
    :meth:`val_dataloader` returns one loader per component with validation documents, named by :attr:`val_names`
    (a model logs ``val/loss``, and ``val/loss/<name>`` when there are several, as
    :class:`~lit_balance.demo.model.DemoTransformerLM` does). Loaders are
    ``DataLoader(dataset, sampler=sampler, batch_size=None)``: because the sampler is a ``DistributedSampler``,
    Lightning calls its ``set_epoch`` every epoch and leaves it in place under either value of
    ``Trainer(use_distributed_sampler=...)``. The training loader is stateful as Lightning sees it (``state_dict``
    / ``load_state_dict``, with no state of its own): it resumes mid-epoch through its sampler, whose position
    :meth:`state_dict` saves.

    Batches are those of :class:`PadCollator`: ``input_ids``, ``attention_mask``, ``labels`` ``[B, T]``,
    ``indices``, ``is_fill`` ``[B]``, ``num_real_tokens``, ``num_padded_tokens`` (per rank). With ``packing=True``
    they are those of :class:`PackedCollator`: one row ``[1, N]`` of whole documents (``input_ids``,
    ``position_ids``, ``labels``) with ``cu_seq_lens_q/k``, ``max_length_q/k``, ``indices``, ``is_fill`` ``[D]`` and
    the same token counts; validation batches are packed too.

    Args:
        corpus: None or ``"stdlib_docstrings"`` for the built-in corpus; a :class:`~lit_balance.stream.StreamCorpus`
            (a stream of unknown length, planned window by window while training; see ``window_documents``); a list
            of strings (documents);
            a path or list of paths to UTF-8 text files (one document per non-blank line) or ``.jsonl``
            files (one object per line: text under ``text_key``, or a prompt–completion record with
            ``prompt`` and ``completion``); a list of token-id sequences; or a Hugging Face
            ``datasets.Dataset``, ``DatasetDict`` or ``IterableDataset`` (columns ``input_ids`` with optional
            ``labels``, the ``text_key`` column, or ``prompt`` and ``completion``; see
            :mod:`lit_balance.data.sources.hf`); or a :class:`~lit_balance.Mixture` of such corpora with weights (or
            a mapping of its arguments, ``{"components": {...}}``; docs/mixtures.md): every component is resolved,
            tokenized and split with this DataModule's settings, and ``val_fraction`` holds out that share of each.
            Prompt–completion records and ``labels`` mask tokens: batches
            carry their labels (``-100`` on a prompt), and the plan's ``step_supervised_tokens`` counts exactly
            the targets left.
        tokenizer: None for the built-in tokenizer, a ``tokenizers.Tokenizer``, a Hugging Face tokenizer
            object, or a path to a ``tokenizer.json``. Ignored for token-id corpora unless given.
        max_tokens: padded token slots per micro-batch, per rank (the memory budget): one int for every rank, a
            list of one per data-parallel rank (ranks of different memory; its length must be the world size), or
            ``"auto"``: measured once at fit start by :attr:`auto_budget` (an
            :class:`~lit_balance.lightning.budget.AutoTokenBudget`: the model's ``training_step`` forward and backward
            on worst-case micro-batches, ``docs/token_budget.md``), logged, and saved by :meth:`state_dict` so that a
            resume plans with it; until then ``dm.max_tokens`` reads ``"auto"`` and ``dm.settings`` raises. None (the
            default): 4096, or ``settings.max_tokens``. Not ``"auto"`` with ``settings``.
        memory_limit: with ``max_tokens="auto"``: bytes one rank may use (on a CPU required: the process's peak
            resident set size; on CUDA optional, a cap below the device's memory). Ignored otherwise.
        memory_fraction: with ``max_tokens="auto"``: share of the capacity the budget may use, in (0, 1].
        cpu_mmap_threshold: with ``max_tokens="auto"`` on a CPU: glibc's mmap threshold (bytes) from the probe to the
            end of the fit, so that training keeps to the peak the probe measured; said once in the log, set back at
            ``teardown`` (:class:`~lit_balance.lightning.meters.MmapThreshold`, ``docs/token_budget.md``). None leaves
            the allocator alone.
        max_length: keep at most this many tokens of each document (truncation), or None.
        val_fraction: share of documents held out for validation, in ``[0, 1)``; 0 disables validation. None
            (the default): 0.05, or, for a ``DatasetDict`` with a ``validation`` split, that split (nothing is
            held out of ``train``); a number together with such a split is a ValueError (pass
            ``corpus=dataset_dict["train"]`` to split the training rows by ``val_fraction`` instead).
        seed: seed of the train/validation split and of the samplers (the same on every rank).
        num_workers: DataLoader worker processes per rank.
        shuffle, drop_last, too_long, pad_to_multiple_of, max_batch_size, shuffle_window, largest_first, packing:
            batching settings, see :class:`~lit_balance.BatchingSettings` (``too_long`` only matters when
            ``max_length`` exceeds ``max_tokens``; ``packing=True``: padding-free micro-batches, one row of whole
            documents each). None (the default, also ``seed``): the BatchingSettings default, or ``settings``'.
        static_packing, padded_shapes: static shapes for compilers (docs/compiling.md): every packed micro-batch
            ``[1, max_tokens]``, or padded micro-batches of at most K shapes; the packed cap chosen from the training
            split, K padded shapes from the training and validation splits together (they hold every document). None
            (the default): off, or ``settings``'.
        settings: all batching settings as one :class:`~lit_balance.BatchingSettings` instead of the keywords
            above (``max_tokens`` ... ``packing``); a keyword given beside it (not None) must agree with it (else a
            ValueError names both). Its ``accumulate_grad_batches`` is used only without a Trainer.
        cost_model: cost of a training micro-batch, see :class:`BalancedBatchSampler`: a
            :class:`~lit_balance.CostModel` or any other cost model (:class:`~lit_balance.plan.CostModelProtocol`,
            e.g. a :class:`~lit_balance.plan.CostModelBase` subclass); default: padded tokens.
        text_key: field holding the text in ``.jsonl`` files, or column holding it in a Hugging Face dataset.
        txt_documents: how plain-text (non-``.jsonl``) corpus files split into documents: ``"line"`` (the
            default: each non-blank line) or ``"paragraph"`` (runs of non-blank lines separated by blank
            lines, joined with ``"\\n"``, so wrapped paragraphs stay one document). Part of the cache key.
        max_documents: rows read at most from a Hugging Face ``IterableDataset`` corpus (global, before the
            validation split), which needs this bound: a stream may never end, and one without it is refused. None
            (the default) for every other corpus, which is read to its end; a number beside one is a ValueError. A
            stream component of a :class:`~lit_balance.Mixture` takes its own (``{"corpus": stream, "weight": w,
            "max_documents": n}``); a number here beside a mixture is a ValueError.
        add_special_tokens: add the tokenizer's own special tokens to every document, exactly as
            ``tokenizer(text, add_special_tokens=True)`` does in Hugging Face: the built-in BERT tokenizer
            gives ``[CLS] ... [SEP]``, a Llama-style tokenizer a BOS, GPT-2 none (its template adds nothing;
            append its EOS to the texts yourself). ``max_length`` truncation keeps the first tokens, so it
            may cut the closing token. Part of the cache key. Default False: no special tokens. A token-id
            corpus is used as given: True is then a ValueError.
        pad_token_id: padding id for tokenizers or token-id corpora that do not define one (default 0
            for token-id corpora).
        vocab_size: vocabulary size for token-id corpora without a tokenizer (default: largest id + 1).
            With a tokenizer (text corpora always have one) the vocabulary is the tokenizer's; a
            ``vocab_size`` given then must equal it (leave it None).
        cache_dir: where tokenized corpora are cached (default ``$LIT_BALANCE_CACHE`` or
            ``~/.cache/lit_balance``).
        pin_memory: passed to the DataLoaders (True or False).
        allow_tokenizer_mismatch: train a tokenized store (or a mixture component) with a ``tokenizer`` other than
            the one the store says it was written with (a warning instead of the ValueError naming both; see
            :mod:`lit_balance.data.tokenizer_identity`, ``docs/store_checks.md``). Default False.
        skip_steps: ``[(a, b), ...]``: leave out the documents of optimizer steps ``a .. b - 1`` of the run
            (inclusive-exclusive, counted from the start of training as the ledger's ``optimizer_step``), typically on
            a resume after a loss spike (:meth:`BalancedBatchSampler.skip_steps`, ``docs/ledger.md``). Applied once per
            fit, after a checkpoint is restored and before any batch is read; every other step trains what the plan
            has there, on any number of ranks, and the ranges are saved in the checkpoint. Ranges may lie in any epoch
            (or across an epoch's end) and must start at or after the step the checkpoint resumes at. None (the
            default): nothing skipped.
        max_length_schedule: a length warm-up that loses no tokens (``docs/schedules.md``): the longest training row
            per optimizer step of the run, a :class:`~lit_balance.Schedule` in steps, a list of ``[step, max_length]``
            points, or ``{"points": ..., "interpolation": "constant" | "linear"}`` (a linear one rounded down to whole
            tokens). A document longer than its step's value is trained as pieces of at most that many tokens, each a
            document of its own (a padded row, or a packed segment with position ids from 0), so every token is
            trained once per epoch; the budget and equal counts hold. Saved in the checkpoint; a resume (on any
            number of ranks, at an optimizer step's end) needs the same schedule. Needs ``max_length=None`` (the
            documents whole) and one corpus; not with ``static_packing``, ``padded_shapes``, ``drop_last``,
            ``too_long`` other than ``"error"`` or masked labels (each refused naming both settings). Values within
            ``[1, max_tokens]``. None (the default): whole documents (up to ``max_length``).
        weights_schedule: the mixture's weights per optimizer step of the run (a mixture of two or more components):
            a :class:`~lit_balance.Schedule` whose values name every component, a list of ``[step, {name: weight}]``
            points, or ``{"points": ..., "unit": "steps" | "tokens", "interpolation": "constant" | "linear"}``. Every
            optimizer step holds each component within one boundary document of the share the schedule gives that
            step; saved in the checkpoint, where a resume may change only points at or after the resume step
            (``docs/schedules.md``). None (the default): the mixture's fixed weights. Not with
            ``largest_first``.
        window_documents: with a stream corpus (a :class:`~lit_balance.stream.StreamCorpus`, docs/streams.md):
            documents read, exchanged and planned together, global (the same on any number of ranks and when
            resuming); None: 4096. A stream is trained window by window while training: no cache, no pass before
            training, no ``len()``; the run ends at the stream's end or ``max_steps``. A number beside a finite corpus
            is a ValueError.
        val_documents: with a stream corpus: its first documents held out for validation (read by every rank at
            ``setup``, never trained); None: none.
        val_corpus: with a stream corpus: a finite validation corpus instead (anything ``corpus`` takes but a
            mixture or a stream; tokenized into the cache by ``prepare_data``). Not beside ``val_documents``.
        replace: with ``skip_steps``, the next documents take the skipped steps' places: at each range's first step
            the documents its steps would train are taken out and the rest of the epoch is planned again, so the run's
            optimizer steps have no gap and a mixture keeps its shares (``skip_steps(..., replace=True)``,
            ``docs/ledger.md``). Each range must end in the epoch it starts in; not with ``plan_window`` below the
            corpus or a ``weights_schedule``. Default False: the skipped steps' micro-batches are consumed untrained.

    Attributes:
        stream: the :class:`~lit_balance.lightning.stream_data.StreamComponent` of a stream corpus (its description,
            its ``batches`` once training started), or None for a finite corpus.
        mixture: the blend of named components (:class:`~lit_balance.Mixture`; one corpus: ``Mixture.of(corpus)``,
            one component ``train``).
        sources: one :class:`~lit_balance.data.sources.CorpusSource` per component, in order (``source``: the first).
        val_names: after ``setup``: the names of the validation loaders, in order (components with validation
            documents); ``val_datasets`` and ``val_samplers`` hold theirs (``val_dataset``, ``val_sampler``: the
            first, or None).
        settings: the :class:`~lit_balance.BatchingSettings`, checked at construction (with ``max_tokens="auto"``,
            once measured); its fields are also readable as attributes (``dm.max_tokens``, ``dm.shuffle``, ...).
        vocab_size: number of token ids, known at construction.
        txt_documents, add_special_tokens: the tokenization options as given.
        pad_token_id: padding token id, known at construction.

    Raises:
        FileNotFoundError: a corpus path does not exist.
        ValueError: a bad setting (with the value), e.g. a ``vocab_size`` that differs from the
            tokenizer's; mixture components whose vocabularies or pad ids differ, or that read the same file or
            corpus object (naming both, :func:`~lit_balance.data.mixture.check_distinct_components`); an unreadable,
            non-UTF-8 or empty corpus; a list of str that names files; a
            ``val_fraction`` beside a ``DatasetDict``'s ``validation`` split; a token-id ``IterableDataset``
            without ``vocab_size`` or tokenizer; a dataset without a usable column.
        TypeError: a setting of the wrong type (e.g. ``pin_memory="yes"``, ``cache_dir=5``), or a
            corpus or tokenizer of an unsupported type.
        ImportError: a Hugging Face ``datasets`` object while ``datasets`` cannot be imported (the message
            says ``pip install -e ".[datasets]"``).

    Example:
        >>> dm = BalancedTextDataModule(["the cat sat", "a dog ran far away"], max_tokens=64, val_fraction=0,
        ...                             cache_dir=getfixture("tmp_path"))
        >>> dm.prepare_data(); dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> sorted(batch["indices"].tolist()), dm.vocab_size
        ([0, 1], 30522)
    """

    def __init__(
        self,
        corpus: Any = None,
        tokenizer: Any = None,
        *,
        max_tokens: int | list[int] | Literal["auto"] | None = None,
        max_length: int | None = 512,
        val_fraction: float | None = None,
        seed: int | None = None,
        num_workers: int = 0,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        too_long: str | None = None,
        pad_to_multiple_of: int | None = None,
        max_batch_size: int | None = None,
        shuffle_window: float | None = None,
        cost_model: CostModel | None = None,
        largest_first: bool | None = None,
        packing: bool | None = None,
        static_packing: bool | None = None,
        padded_shapes: int | list[tuple[int, int]] | None = None,
        settings: BatchingSettings | None = None,
        text_key: str = "text",
        txt_documents: Literal["line", "paragraph"] = "line",
        max_documents: int | None = None,
        add_special_tokens: bool = False,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        pin_memory: bool = False,
        memory_limit: int | None = None,
        memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        cpu_mmap_threshold: int | None = CPU_MMAP_THRESHOLD,
        allow_tokenizer_mismatch: bool = False,
        skip_steps: list[tuple[int, int]] | None = None,
        max_length_schedule: dict[str, Any] | list[Any] | int | None = None,
        weights_schedule: dict[str, Any] | list[Any] | None = None,
        window_documents: int | None = None,
        val_documents: int | None = None,
        val_corpus: Any = None,
        replace: bool = False,
    ) -> None:
        super().__init__()
        #: Optimizer steps of the run whose documents are left out (``(a, b)`` pairs, ``a .. b - 1``), or None.
        self.skip_steps = None if skip_steps is None else check_skip_steps(skip_steps)
        if not isinstance(replace, bool):
            raise InputTypeError(f"replace must be True or False (with skip_steps: the next documents take the skipped "
                                 f"steps' places), got {replace!r} of type {type(replace).__name__}",
                                 parameter="replace")
        if replace and not self.skip_steps:
            raise InputValueError(f"replace=True replaces the documents of skip_steps, but skip_steps is "
                                  f"{skip_steps!r}; give skip_steps=[(a, b), ...] or leave replace=False",
                                  parameter="replace")
        #: Whether the next documents take the places of :attr:`skip_steps`' (``skip_steps(..., replace=True)``).
        self.replace = replace
        self._skip_pending = self.skip_steps is not None
        if val_fraction is not None:
            resolve_val_fraction(val_fraction)  # its type and range, before the corpus is read
        given = {k: v for k, v in (("max_tokens", max_tokens), ("shuffle", shuffle), ("seed", seed),
                                   ("drop_last", drop_last), ("too_long", too_long),
                                   ("pad_to_multiple_of", pad_to_multiple_of), ("max_batch_size", max_batch_size),
                                   ("shuffle_window", shuffle_window), ("largest_first", largest_first),
                                   ("packing", packing), ("static_packing", static_packing),
                                   ("padded_shapes", padded_shapes)) if v is not None}
        #: The owner of ``max_tokens="auto"`` (:class:`~lit_balance.lightning.budget.AutoTokenBudget`), or None.
        self.auto_budget = auto_budget(given, settings, memory_limit, memory_fraction, cpu_mmap_threshold)
        self.memory_limit, self.memory_fraction = memory_limit, memory_fraction
        self._settings, self._batching = batching_settings(settings, given, auto=self.auto_budget is not None)
        if max_length is not None:
            max_length = check_int("max_length", max_length, 1, "tokens kept per document, or None for no truncation")
        self.max_length = max_length
        self.num_workers = check_int("num_workers", num_workers, 0, "DataLoader worker processes per rank")
        self.pin_memory = check_bool("pin_memory", pin_memory)
        self.add_special_tokens = check_bool("add_special_tokens", add_special_tokens)
        self.txt_documents = txt_documents
        self.cache_dir = check_cache_dir(cache_dir)
        self.mixture = Mixture.of(corpus, max_documents=max_documents)
        self.sources = [resolve_corpus(c, text_key=text_key, txt_documents=txt_documents, max_documents=bound)
                        for c, bound in zip(self.mixture.corpora, self.mixture.max_documents)]
        check_distinct_components(self.mixture.names, self.sources, self.mixture.corpora)
        #: The length warm-up (:class:`~lit_balance.Schedule` of the longest row per optimizer step), or None.
        self.max_length_schedule = self._check_length_schedule(max_length_schedule, max_length)
        #: The mixture's weights per optimizer step (:class:`~lit_balance.Schedule`), or None for fixed weights.
        self.weights_schedule = self._check_weights_schedule(weights_schedule, settings, largest_first)
        #: The stream and its validation when the corpus is a stream (docs/streams.md), else None.
        self.stream = stream_component(
            self.mixture.names, self.sources, self.mixture.plain, settings=self._settings, batching=self._batching,
            auto=self.auto_budget is not None, num_workers=self.num_workers, val_fraction=val_fraction,
            skip_steps=self.skip_steps, window_documents=window_documents, val_documents=val_documents,
            val_corpus=val_corpus, text_key=text_key, txt_documents=txt_documents)
        if replace and self.max_length_schedule is not None:
            raise InputValueError("replace=True (skip_steps' documents replaced by the next ones) is not supported "
                                  "with a length warm-up (max_length_schedule): pass replace=False or leave "
                                  "max_length_schedule unset", parameter="replace")
        if replace and self.weights_schedule is not None:
            raise InputValueError("replace=True (skip_steps' documents replaced by the next ones) is not supported "
                                  "with a weights_schedule: the re-planned rest would need the schedule's shares from "
                                  "the range on; pass replace=False or leave weights_schedule unset",
                                  parameter="replace")
        self.max_documents = max_documents
        self._val_fractions = [0.0 if s.streamed else resolve_val_fraction(val_fraction, s.split_sizes)
                               for s in self.sources]
        #: Share of each component held out for validation (0.0 when a component brings its own validation split;
        #: the largest over the components).
        self.val_fraction = max(self._val_fractions)
        self.allow_tokenizer_mismatch = check_bool("allow_tokenizer_mismatch", allow_tokenizer_mismatch)
        self.tokenizer = self._resolve_tokenizer(tokenizer, vocab_size, pad_token_id)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.vocab_size = self.tokenizer.vocab_size
        self.cost_model = None if cost_model is None else check_cost_model(cost_model)
        self._train_sampler_state: dict[str, Any] | None = None
        self._saved_data: dict[str, Any] | None = None
        self._warned_zero_targets = False
        #: After ``setup``: each component's tokenized corpus, in order; ``corpus``: the one corpus (several
        #: components: all of them as one, for counts and lengths).
        self.corpora: tuple[TokenizedCorpus, ...] = ()
        self.corpus: TokenizedCorpus | _Corpora | None = None
        self.train_dataset: TokenDataset | MixtureDataset | None = None
        self._train_splits: list[TokenDataset] = []
        self._val_splits: list[TokenDataset | None] = []
        self.val_names: list[str] = []
        self.val_datasets: list[TokenDataset] = []
        self.val_samplers: list[BalancedBatchSampler] = []
        self.train_sampler: BalancedBatchSampler | None = None
        self.collator: PadCollator | PackedCollator | None = None
        self._train_loader: weakref.ReferenceType | None = None  # the last training loader built

    # ---- the batching settings ------------------------------------------------------------------------------------
    @property
    def settings(self) -> BatchingSettings:
        """The :class:`~lit_balance.BatchingSettings` (``max_tokens`` the measured one with ``max_tokens="auto"``).

        Raises:
            RuntimeError: ``max_tokens="auto"`` before the budget is measured (at fit start) or restored.
        """
        if self._settings is None:
            raise RuntimeError("max_tokens='auto' is measured with the model at fit start, so the batching settings "
                               "are known after that: read dm.settings (or preview the plan) after Trainer.fit starts, "
                               "or pass the max_tokens of dm.find_max_tokens(model, ...) (or of lit-balance plan "
                               "--max-tokens auto --config <fit config>) as an int")
        return self._settings

    @property
    def max_tokens(self) -> int | tuple[int, ...] | str:
        """``settings.max_tokens`` (read-only); ``"auto"`` while ``max_tokens="auto"`` is not measured yet."""
        return getattr(self._settings, "max_tokens", "auto")

    @property
    def source(self) -> Any:
        """The first component's :class:`~lit_balance.data.sources.CorpusSource` (one corpus: its source)."""
        return self.sources[0]

    @property
    def corpus_description(self) -> str:
        """What the corpus is, in a line (several components: each with its target share)."""
        return self.source.description if len(self.sources) == 1 else self.mixture.description

    @property
    def val_dataset(self) -> TokenDataset | None:
        """The first validation dataset (one corpus: its validation split), or None (after ``setup``)."""
        return self.val_datasets[0] if self.val_datasets else None

    @property
    def val_sampler(self) -> BalancedBatchSampler | None:
        """The first validation sampler (one corpus: its validation split's), or None (after ``setup``)."""
        return self.val_samplers[0] if self.val_samplers else None

    @property
    def token_budget(self) -> TokenBudget | None:
        """The probe's result with ``max_tokens="auto"`` once known (measured or restored); None otherwise."""
        return None if self.auto_budget is None else self.auto_budget.budget

    shuffle = _setting("shuffle")
    seed = _setting("seed")
    drop_last = _setting("drop_last")
    too_long = _setting("too_long")
    pad_to_multiple_of = _setting("pad_to_multiple_of")
    max_batch_size = _setting("max_batch_size")
    shuffle_window = _setting("shuffle_window")
    largest_first = _setting("largest_first")
    plan_window = _setting("plan_window")
    packing = _setting("packing")
    accumulate_grad_batches = _setting("accumulate_grad_batches")  # the Trainer's is used under a Trainer

    def _check_length_schedule(self, schedule: Any, max_length: int | None) -> Schedule | None:
        """The length warm-up's schedule checked against the other settings, before any token is read."""
        if schedule is None:
            return None
        if max_length is not None:
            raise InputValueError(
                f"max_length_schedule splits long documents into pieces instead of cutting them, but "
                f"max_length={max_length} truncates every document first: set max_length=None (the schedule's values "
                "are the longest rows) or leave max_length_schedule unset", parameter="max_length")
        if not self.mixture.plain:
            raise InputValueError(
                f"max_length_schedule is planned for one corpus, but the corpus is a mixture of components "
                f"{list(self.mixture.names)}: train one corpus, or leave max_length_schedule unset",
                parameter="max_length_schedule")
        check_warmup_settings(**{name: self._batching.get(name) for name in ("static_packing", "padded_shapes",
                                                                             "drop_last", "too_long")})
        return LengthWarmupPlans(schedule).schedule

    def _check_weights_schedule(self, schedule: Any, settings: BatchingSettings | None,
                                largest_first: bool | None) -> Any:
        """The weight schedule checked against the mixture's components, before any token is read."""
        if schedule is None:
            return None
        if len(self.mixture.names) < 2:
            raise InputValueError(f"weights_schedule sets the shares of a mixture's components, but the corpus is one "
                                  f"component ({list(self.mixture.names)}); pass a Mixture of two or more components "
                                  "as the corpus, or leave weights_schedule unset", parameter="weights_schedule")
        schedule = check_weights_schedule(schedule, self.mixture.names)
        if largest_first or (settings is not None and settings.largest_first):
            raise InputValueError("largest_first=True moves the step of the longest document first, but a "
                                  "weights_schedule plans every optimizer step with its own shares in order; set "
                                  "largest_first=False or leave weights_schedule unset", parameter="largest_first")
        return schedule

    # ---- the corpus -------------------------------------------------------------------------------------------------
    def _resolve_tokenizer(self, tokenizer: Any, vocab_size: Any, pad_token_id: Any) -> TokenizerAdapter:
        """The one tokenizer (and vocabulary) of every component, checked now: the components must agree."""
        if self.stream is not None:
            return self.stream.tokenizer(tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                         add_special_tokens=self.add_special_tokens,
                                         allow_tokenizer_mismatch=self.allow_tokenizer_mismatch)
        adapters = [corpus_tokenizer(s, tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                     add_special_tokens=self.add_special_tokens,
                                     allow_tokenizer_mismatch=self.allow_tokenizer_mismatch) for s in self.sources]
        return components_vocabulary(self.mixture.names, adapters)

    def _tokenized(self) -> tuple[TokenizedCorpus, ...]:
        """The tokenized components: each read in place from a tokenized store, else from the cache, or tokenized
        into it."""
        return tuple(open_corpus(s, self.tokenizer, self.cache_dir, progress=True) for s in self.sources)

    def prepare_data(self) -> None:
        """Tokenize every component into the cache (once per node; other ranks wait at Lightning's barrier); a stream
        is read while training (only its finite ``val_corpus`` is tokenized here)."""
        if self.stream is not None:
            return self.stream.prepare_data(self)
        self._tokenized()

    def _world(self) -> DataParallelWorld:
        """The data-parallel rank and number of ranks the samplers are built for."""
        return data_parallel_world(self.trainer)

    def _splits(self) -> _Splits:
        """Load the cache and split every component into training and validation documents; changes nothing on the
        DataModule. The training dataset is one component's split (a blend of one, planned as one corpus), or the
        blend's :class:`~lit_balance.data.mixture.MixtureDataset` over every component's.

        Raises:
            ValueError: as :func:`lit_balance.data.splits.split_corpus`.
        """
        corpora = self._tokenized()
        trains, vals = [], []
        for name, source, part, fraction in zip(self.mixture.names, self.sources, corpora, self._val_fractions):
            try:
                train, val = split_corpus(part, val_fraction=fraction, seed=self.seed, max_length=self.max_length,
                                          split_sizes=source.split_sizes)
            except InputValueError as error:
                if len(corpora) == 1 or error.parameter != "val_fraction":
                    raise
                raise InputValueError(  # a mixture: name the component; val_fraction holds out a share of each
                    f"mixture component {name!r} has {len(part)} document(s); val_fraction={fraction} holds out that "
                    f"share of every component (at least one document each) and leaves it no document for "
                    f"training: lower val_fraction, or give {name!r} more documents", parameter="val_fraction") \
                    from error
            trains.append(train)
            vals.append(val)
        blend = trains[0] if self.mixture.plain else MixtureDataset(trains, self.mixture.settings.max_repetition)
        return _Splits(corpora, trains, blend, vals)

    def _train_settings(self) -> BatchingSettings:
        """:attr:`settings` with the Trainer's ``accumulate_grad_batches`` at setup time (the plan balances each
        optimizer step)."""
        if self.trainer is None:
            return self.settings
        accumulate = getattr(self.trainer, "accumulate_grad_batches", 1)
        try:
            return self.settings.replace(accumulate_grad_batches=1 if accumulate is None else accumulate)
        except (TypeError, ValueError) as error:
            raise type(error)(f"the Trainer's accumulate_grad_batches={accumulate!r} cannot be planned: {error}; "
                              "set Trainer(accumulate_grad_batches=...) to an int >= 1") from error

    def _sampler(self, split: str, dataset: TokenDataset, settings: BatchingSettings, world: DataParallelWorld,
                 **kwargs: Any) -> BalancedBatchSampler:
        if dataset.labels is not None:  # masked labels: the plan counts each sample's next-token targets exactly
            cut = settings.truncate_to if settings.too_long == "truncate" else None
            kwargs["supervised_lengths"] = dataset.supervised_lengths(cut)
        try:
            return BalancedBatchSampler(dataset.lengths, settings=settings, num_replicas=world.num_replicas,
                                        rank=world.rank, **kwargs)
        except ValueError as error:
            raise InputValueError(f"{split} split ({len(dataset)} documents, val_fraction={self.val_fraction}): "
                                  f"{error}") from error

    def setup(self, stage: str | None = None) -> None:
        """Load the cache, split train/validation and build the samplers for this rank.

        Under a Trainer with several processes, the processes then compare what they planned (corpus document
        count and token lengths, tokenizer, ``max_length``, ``seed``, ``val_fraction``, batching settings, split
        lengths) in one small ``all_gather`` (:func:`lit_balance.lightning.agreement.check_ranks_agree`); every
        process takes part even when its own setup failed, and every process raises when any differs or failed,
        so no rank trains on a plan the others do not share and none waits forever.

        Raises:
            ValueError: the corpus is too small for the requested validation split; with
                ``too_long="error"``, a document longer than ``max_tokens`` after ``max_length``
                truncation (naming its index in the corpus); a split the sampler cannot plan; a masked-label corpus
                (prompt–completion records, ``labels``) whose training records keep no next-token target at all.

        Warns:
            UserWarning: once, when some training records of a masked-label corpus keep no next-token target (e.g.
                a prompt that fills ``max_length``): their count, the first corpus records and the setting to
                change.
            RuntimeError: the ranks planned different data (naming the ranks, what differs and the likely
                cause), or another rank's setup failed.
        """
        error: BaseException | None = None
        fields = None
        if self.stream is not None:  # validation only: the stream is read window by window while training
            try:
                fields = self.stream.setup(self)
            except Exception as exc:  # noqa: BLE001  as below
                error = exc
            return check_ranks_agree(self.trainer, fields, error)
        try:
            self.corpora, self._train_splits, self.train_dataset, self._val_splits = self._splits()  # built once
            self.corpus = _Corpora.of(self.corpora)
            self.train_sampler = self.collator = None
            named = [(n, v) for n, v in zip(self.mixture.names, self._val_splits) if v is not None]
            self.val_names, self.val_datasets = [n for n, _ in named], [v for _, v in named]
            self.val_samplers = []
            if self.auto_budget is not None:
                self._settings = None  # each fit plans with the budget auto_budget resolves at its start
            self._plan(measure=False)
            fields = self._fingerprint()
        except Exception as exc:  # noqa: BLE001  the other ranks wait on this one's fingerprint: tell them, then raise
            error = exc
        check_ranks_agree(self.trainer, fields, error)

    def _plan(self, measure: bool) -> None:
        """Build this rank's samplers and collator over the split of :meth:`setup`, unless built. With
        ``max_tokens="auto"`` and ``measure`` (the first dataloader call of a fit, after the strategy set the model
        up), first ask :attr:`auto_budget` for the budget (restored, or measured now) and log what the plan uses.

        Raises:
            ValueError: with ``too_long="error"``, a document longer than ``max_tokens`` after ``max_length``
                truncation (naming its index in the corpus); a split the sampler cannot plan.
            RuntimeError: as :meth:`~lit_balance.lightning.budget.AutoTokenBudget.resolve`.
        """
        if self.train_sampler is not None or self.train_dataset is None:
            return
        if self._settings is None:  # max_tokens="auto": planned once the budget is known
            if not measure:
                return
            budget = self.auto_budget.resolve(self.trainer, **self.probe_inputs())
            num_replicas = self._world().num_replicas
            planned = budget.plan_max_tokens(num_replicas)
            if isinstance(planned, tuple) and (self._batching.get("static_packing")
                                               or self._batching.get("padded_shapes") is not None):
                planned = budget.max_tokens  # static shapes take one budget for every rank: the smallest measured
                rank_zero_info(f"BalancedTextDataModule token budget: max_tokens={planned} on every rank (static "
                               f"shapes take one budget; the ranks measured {list(budget.per_rank)})")
            else:
                rank_zero_info(f"BalancedTextDataModule token budget: {budget.describe(num_replicas)}")
            self._settings = BatchingSettings(**self._batching, max_tokens=planned)
        self._build_samplers()

    def _build_samplers(self) -> None:
        """Build this rank's training sampler (:meth:`training_sampler`), one validation sampler per component with
        validation documents, and the collator, over the split, with the budget known (:meth:`_plan`); the too-long
        and supervised-target checks run on every component."""
        train, names = self.train_dataset, self.mixture.names
        if self.too_long == "error" and self.max_length_schedule is None:  # a warm-up splits long documents
            for part in self.corpora:
                check_too_long(part, self.max_length, self.pad_to_multiple_of, self.settings.largest_max_tokens)
        world = self._world()
        # an int padded_shapes: the shapes are chosen from the training and validation lengths together, so they
        # hold every validation document, with rows that fill the micro-batches of this number of ranks
        settings = resolve_split_shapes(self._train_settings(), train.lengths,
                                        *(val.lengths for val in self.val_datasets), num_replicas=world.num_replicas)
        try:
            train_sampler = self.training_sampler(settings, world.num_replicas, rank=world.rank,
                                                  cost_model=self.cost_model)
        except ValueError as error:
            raise InputValueError(f"training split ({len(train)} samples, val_fraction={self.val_fraction}): "
                                  f"{error}", parameter=getattr(error, "parameter", None)) from error
        # the training sampler's settings: the static shapes the collator pads to
        val_settings = train_sampler.settings.replace(shuffle=False, drop_last=False, largest_first=False,
                                                      accumulate_grad_batches=1)
        val_samplers = [self._sampler("validation" if len(names) == 1 else f"validation of {name!r}", val,
                                      val_settings, world) for name, val in zip(self.val_names, self.val_datasets)]
        truncate = train_sampler.truncate_to if self.too_long == "truncate" else None
        supervised = train_sampler.supervised_lengths
        if supervised is not None:  # one copy of every document, components in order (a sampler tiles repetitions)
            first = 0
            for part, dataset in zip(self.corpora, self._train_splits):
                mine = np.asarray(supervised[first:first + len(dataset)])
                first += len(dataset)
                if dataset.labels is not None:
                    self._warned_zero_targets |= check_supervised_targets(
                        part, dataset, mine, truncate, self.max_length, warn=not self._warned_zero_targets)
        self.train_sampler = train_sampler
        self.val_samplers = val_samplers
        # the sampler's settings: static shapes are chosen from the split's lengths when it is built
        self.collator = collator_for(train_sampler.settings, self.pad_token_id, max_length=truncate)

    def _fingerprint(self) -> list[tuple[str, int, bool]]:
        """What this rank planned at ``setup``: :func:`lit_balance.lightning.agreement.plan_fingerprint`."""
        sampler = self.train_sampler  # it hashed the same array when it holds the split's lengths
        same = sampler is not None and sampler.lengths is self.train_dataset.lengths
        accumulate = self._batching["accumulate_grad_batches"] if self.trainer is None else (
            getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
        vals = [v.lengths for v in self.val_datasets]
        return plan_fingerprint(
            corpus_lengths=self.corpus.lengths, tokenizer_fingerprint=self.tokenizer.fingerprint,
            max_length=self.max_length, seed=self.seed, val_fraction=self.val_fraction,
            settings={**self._batching, "max_tokens": self.max_tokens, "accumulate_grad_batches": accumulate,
                      "mixture": self.mixture.settings.to_dict(),
                      **({} if self.max_length_schedule is None else
                         {"max_length_schedule": self.max_length_schedule.to_dict()})},
            train_lengths=self.train_dataset.lengths, train_lengths_sha256=sampler.lengths_sha256 if same else None,
            val_lengths=None if not vals else vals[0] if len(vals) == 1 else np.concatenate(
                [np.asarray(v, dtype=np.int64) for v in vals]))

    @property
    def batch_layout(self) -> ProbeLayout:
        """How the micro-batches are laid out (:class:`~lit_balance.plan.budget_search.ProbeLayout`: packing, pad
        multiple, row cap, static shapes), known before the budget is (also with ``max_tokens="auto"``); its
        ``planner`` (:func:`~lit_balance.plan.planner_for`) answers what depends on the layout, such as its
        ``packed_rows`` and ``cost_unit``."""
        return ProbeLayout(**{f.name: self._batching[f.name] for f in dataclasses.fields(ProbeLayout)
                              if f.name in self._batching})

    # ---- max_tokens="auto" ------------------------------------------------------------------------------------
    def probe_inputs(self) -> dict[str, Any]:
        """The :class:`~lit_balance.lightning.probe.TokenBudgetProbe` arguments this DataModule gives: ``lengths``
        (the training split's, after ``max_length``), ``layout`` (:class:`~lit_balance.plan.budget_search.ProbeLayout`:
        packing, pad multiple, row cap), ``pad_token_id`` and ``token_ids`` (its longest document's)."""
        train = self.train_dataset if self.train_dataset is not None else self._splits().train_dataset
        lengths = np.asarray(train.lengths, dtype=np.int64)
        return {"lengths": lengths, "layout": self.batch_layout, "pad_token_id": self.pad_token_id,
                "token_ids": np.asarray(train[int(np.argmax(lengths))]["input_ids"], dtype=np.int64)}

    def find_max_tokens(self, model: Any, *, memory_limit: int | None = None, memory_fraction: float | None = None,
                        trainer: Any = None, world: DataParallelWorld | None = None) -> TokenBudget:
        """Run only the probe (:func:`lit_balance.lightning.budget.find_max_tokens`) for ``model`` on this
        DataModule's training split and layout; the DataModule is left as it was.

        Args:
            model: the LightningModule, on the device to measure.
            memory_limit: bytes one rank may use (default: this DataModule's ``memory_limit``); required on a CPU.
            memory_fraction: share of the capacity (default: this DataModule's ``memory_fraction``).
            trainer: a Trainer whose strategy, precision and optimizers to use, or None.
            world: the data-parallel ranks that probe together (default: ``data_parallel_world(trainer)``); all
                of them must call this.

        Returns:
            The :class:`~lit_balance.lightning.budget.TokenBudget`, the same on every rank.

        Raises:
            RuntimeError: a rank fits not even one row of the longest documents; ``training_step`` failed.
            ValueError: on a CPU without ``memory_limit``; a model with manual optimization; bad arguments.
        """
        auto = self.auto_budget
        return find_max_tokens(model, self, memory_limit=self.memory_limit if memory_limit is None else memory_limit,
                               memory_fraction=self.memory_fraction if memory_fraction is None else memory_fraction,
                               trainer=trainer, world=world, meter=None if auto is None else auto.meter,
                               cpu_mmap_threshold=None if auto is None else auto.allocator.threshold)

    def teardown(self, stage: str) -> None:
        """Set back what ``max_tokens="auto"`` held for the fit (glibc's mmap threshold on a CPU)."""
        if self.auto_budget is not None:
            self.auto_budget.release()

    def plan_summary(self, num_replicas: int, accumulate_grad_batches: int = 1, *, epoch: int = 0) -> dict[str, Any]:
        """Preview the training split's plan for ``num_replicas`` ranks, without a Trainer or the CLI.

        Tokenizes into the cache (as :meth:`prepare_data`), splits train/validation as :meth:`setup` does, and
        plans epoch ``epoch`` of the training split with :func:`lit_balance.report.plan_report` (the figures
        are :func:`lit_balance.plan.stats.plan_stats`'s). It changes nothing on the DataModule (its datasets,
        samplers and collator stay as they were) and communicates with no other rank, so any rank may call it,
        before or after ``setup``.

        Args:
            num_replicas: ranks (world size) to plan for.
            accumulate_grad_batches: micro-batches per optimizer step, per rank (the Trainer's).
            epoch: the epoch to plan (as ``set_epoch``).

        Returns:
            :meth:`lit_balance.report.PlanReport.summary` of :meth:`training_sampler`'s plan: ``summary["balanced"]``
            holds ``padding_ratio``, ``useful_fraction``, ``micro_batches_per_rank`` (``len(train_sampler)`` under
            that world size), ``optimizer_steps``, ...; ``summary["distributed_sampler"]`` the fixed-batch-size
            comparison; with several components ``summary["mixture"]``
            (:func:`lit_balance.report.figures.mixture_shares`: ``names``, ``unit``, ``target``, ``step_units``,
            ``step_shares``, ``max_deviation_pp``, ...; and ``max_step_deviation``, per component, as a fraction);
            under a length warm-up ``summary["max_length_schedule"]`` (the schedule's ``to_dict()``), the samples
            counted being the pieces.

        Raises:
            ValueError, TypeError: as :meth:`setup`, or a bad ``num_replicas`` / ``accumulate_grad_batches``.

        Example:
            >>> dm = BalancedTextDataModule(["the cat sat", "a dog ran far away"], max_tokens=64, val_fraction=0,
            ...                             cache_dir=getfixture("tmp_path"))
            >>> dm.plan_summary(num_replicas=1)["balanced"]["micro_batches_per_rank"]
            1
        """
        from lit_balance.report import plan_report

        if self.stream is not None:
            raise RuntimeError(f"a stream ({self.stream.description}) has no plan before training: it is planned "
                               "window by window while training (docs/streams.md)")
        settings = self.settings.replace(accumulate_grad_batches=accumulate_grad_batches)
        cost_model = self.cost_model if self.cost_model is not None else CostModel()
        sampler = self._training_sampler(self._splits().train_dataset, settings, num_replicas, rank=0,
                                         cost_model=cost_model)
        summary = plan_report(None, num_replicas=num_replicas, epoch=epoch, cost_model=cost_model,
                              sampler=sampler).summary()
        if "mixture" in summary:
            summary["mixture"]["max_step_deviation"] = [pp / 100 for pp in summary["mixture"]["max_deviation_pp"]]
        if self.max_length_schedule is not None:  # the plan's samples are pieces of documents
            summary["max_length_schedule"] = self.max_length_schedule.to_dict()
        return summary

    def training_sampler(self, settings: BatchingSettings, num_replicas: int, *, rank: int = 0,
                         cost_model: Any = None) -> BalancedBatchSampler:
        """A sampler of the training split for ``num_replicas`` ranks with ``settings`` (after :meth:`setup`; changes
        nothing on the DataModule): what training uses and ``lit-balance plan`` reports.

        A blend of one component (one corpus; :attr:`Mixture.plain <lit_balance.Mixture.plain>`) is planned by a
        :class:`~lit_balance.BalancedBatchSampler` over its documents, as one corpus always was; several components
        (or one read more than once, or to a set length) by a :class:`~lit_balance.sampler.mixture.MixtureBatchSampler`
        (each optimizer step holds each component's share). Both answer :attr:`~BalancedBatchSampler.mixture` and
        :meth:`~BalancedBatchSampler.component_of`.

        Args:
            settings: the :class:`~lit_balance.BatchingSettings` (an int or per-rank ``max_tokens``).
            num_replicas: ranks to plan for.
            rank: this rank.
            cost_model: the cost model (None: padded tokens).

        Raises:
            RuntimeError: called before :meth:`setup`.
            ValueError: as the sampler.
        """
        if self.stream is not None:
            raise RuntimeError(f"a stream ({self.stream.description}) has no training sampler: it is planned window by "
                               "window while training (docs/streams.md)")
        if self.train_dataset is None:
            raise RuntimeError("training_sampler needs the training split: call setup() first")
        return self._training_sampler(self.train_dataset, settings, num_replicas, rank=rank, cost_model=cost_model)

    def _training_sampler(self, train: Any, settings: BatchingSettings, num_replicas: int, *, rank: int,
                          cost_model: Any) -> BalancedBatchSampler:
        kwargs: dict[str, Any] = {}
        if train.labels is not None:  # masked labels: the plan counts each sample's next-token targets exactly
            cut = settings.truncate_to if settings.too_long == "truncate" else None
            kwargs["supervised_lengths"] = train.supervised_lengths(cut)
        if cost_model is not None:
            kwargs["cost_model"] = cost_model
        if self.mixture.plain:
            return BalancedBatchSampler(train.lengths, settings=settings, num_replicas=num_replicas, rank=rank,
                                        max_length_schedule=self.max_length_schedule, **kwargs)
        return MixtureBatchSampler(train.lengths, train.layout.sizes, self.mixture.settings, settings=settings,
                                   num_replicas=num_replicas, rank=rank, weights_schedule=self.weights_schedule,
                                   **kwargs)

    def component_tokens(self, indices: Any, is_fill: Any, lengths: Any) -> np.ndarray:
        """int64 ``[num_components]``: real tokens of each component among a batch's rows (``indices``, ``is_fill``
        and each row's ``lengths``, per rank; after :meth:`setup`)."""
        indices, lengths = np.asarray(indices, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        keep = ~np.asarray(is_fill, dtype=bool)
        return np.bincount(self.train_sampler.component_of(indices[keep]), weights=lengths[keep],
                           minlength=len(self.mixture.names)).astype(np.int64)

    @property
    def num_empty_documents(self) -> int:
        """Documents dropped because they were empty after tokenization (global count; after ``setup``).

        Raises:
            RuntimeError: called before ``setup``.
        """
        if self.corpus is None:
            raise RuntimeError("num_empty_documents is known after setup(); call setup() first")
        return int(self.corpus.num_empty)

    def _loader(self, dataset: TokenDataset | None, sampler: BalancedBatchSampler | None,
                loader_class: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        if dataset is None or sampler is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return loader_class(
            dataset,
            sampler=sampler,
            batch_size=None,
            collate_fn=self.collator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            worker_init_fn=ignore_stop_signals_in_workers(),  # Ctrl-C and SIGTERM are the main process's to handle
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Training micro-batches of this rank; ``len()`` is the same on every rank.

        With ``max_tokens="auto"`` the first call plans with :attr:`auto_budget`'s budget (measured now, or restored).
        After a checkpoint is restored (:meth:`load_state_dict`), the sampler continues the saved epoch (after
        checking that the training split is the saved one). When the trainer has moved on to a later epoch, the
        sampler is set to it here, before Lightning reads ``len()`` (with ``reload_dataloaders_every_n_epochs=1``,
        the length then counts rank speeds handed over by :class:`~lit_balance.callbacks.CostModelFeedback`). The
        training sampler is handed to the Trainer (:func:`~lit_balance.use_training_sampler`) for the callbacks and
        the loss that read it.
        """
        if self.stream is not None:
            return self.stream.train_loader(self)
        self._plan(measure=True)
        self._check_epoch_reload()
        if self._train_sampler_state is not None and self.train_sampler is not None:
            if self._saved_data is not None:
                check_saved_data(self._saved_data, data_identity(self))
            try:
                self.train_sampler.load_state_dict(self._train_sampler_state)
            except SettingsMismatchError as error:
                raise InputValueError(settings_advice(error.differences), parameter="settings") from error
            self._train_sampler_state = None
        if self._skip_pending and self.train_sampler is not None:
            self._apply_skip_steps()
        trainer = self.trainer
        if trainer is not None and self.train_sampler is not None and trainer.current_epoch > self.train_sampler.epoch:
            # Lightning reads len(loader) before it calls set_epoch; select the new epoch first, so that its
            # length counts a cost model or rank speeds handed over for it (unequal speeds can lengthen it).
            self.train_sampler.set_epoch(int(trainer.current_epoch))
        loader = self._loader(self._train_items(), self.train_sampler, TrainLoader, batches_consumed=self._consumed)
        self._train_loader = weakref.ref(loader)
        if trainer is not None:  # the training sampler of the callbacks and the loss
            use_training_sampler(trainer, self.train_sampler)
        return loader

    def _check_epoch_reload(self) -> None:
        """Under a length warm-up every epoch has its own number of micro-batches (each is cut to the steps it falls
        on), and Lightning fixes an epoch's length when it loads the loader: refuse a run of more than one epoch that
        does not reload the loader every epoch.

        Raises:
            ValueError: ``max_length_schedule`` with a Trainer whose ``max_epochs`` is not 1 and whose
                ``reload_dataloaders_every_n_epochs`` is not 1, naming both.
        """
        trainer = self.trainer
        if self.max_length_schedule is None or trainer is None or trainer.max_epochs == 1:
            return
        reload = trainer.reload_dataloaders_every_n_epochs
        if reload != 1:
            raise InputValueError(
                f"max_length_schedule gives every epoch its own number of micro-batches, and Lightning fixes an "
                f"epoch's length when it loads the training loader, which reload_dataloaders_every_n_epochs={reload} "
                f"does not do every epoch (max_epochs={trainer.max_epochs}): pass "
                "Trainer(reload_dataloaders_every_n_epochs=1), or max_epochs=1",
                parameter="reload_dataloaders_every_n_epochs")

    def _train_items(self) -> Any:
        """What the training loader reads: the training split, or under a length warm-up its documents' pieces
        (:class:`~lit_balance.data.pieces.PieceDataset`: each row of a micro-batch the tokens its piece names)."""
        if self.max_length_schedule is None or self.train_dataset is None:
            return self.train_dataset
        return PieceDataset(self.train_dataset)

    def _apply_skip_steps(self) -> None:
        """Hand :attr:`skip_steps` to the training sampler (after a restored position, before any batch is read); the
        sampler keeps them for every later epoch and saves them."""
        self.train_sampler.skip_steps(self.skip_steps, replace=self.replace)
        self._skip_pending = False

    def __getstate__(self) -> dict[str, Any]:  # pickled for ddp_spawn: a weak reference does not pickle
        return {**super().__getstate__(), "_train_loader": None}

    def _consumed(self) -> int | None:
        """Lightning's count of consumed micro-batches under ``Trainer.fit`` (:func:`fit_batches_consumed`), within
        the training sampler's epoch; None outside ``Trainer.fit``."""
        consumed = fit_batches_consumed(self.trainer)
        if consumed is None or self.train_sampler is None:
            return None
        earlier = self.train_sampler.first_micro_step  # consumed on other ranks before
        return min(max(consumed, earlier), len(self.train_sampler))

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position, for Lightning checkpoints (rank-independent, plain types).

        The position counts the micro-batches of the current epoch that Lightning's fit loop will count as
        done when it restores this checkpoint (:func:`fit_batches_consumed`), not those the DataLoader's
        workers fetched ahead: a checkpoint saved after a failure inside a training step (e.g. by
        ``OnExceptionCheckpoint``, also after Ctrl-C) resumes with the failed micro-batch. Empty before
        ``setup``.

        Returns:
            ``{"train_sampler": BalancedBatchSampler.state_dict(...), "data": data_identity(dm)}``
            (:func:`~lit_balance.lightning.resume_checks.data_identity`: a resume on another split names what changed);
            with ``max_tokens="auto"`` also ``"token_budget"`` (:meth:`AutoTokenBudget.state_dict`): a resume plans
            with it instead of probing again.
        """
        if self.stream is not None:
            return self.stream.state_dict(self)
        if self.train_sampler is None:
            return {}
        consumed = self._consumed()
        loader = None if self._train_loader is None else self._train_loader()
        if consumed is None and loader is not None and loader.balanced_sampler is self.train_sampler:
            consumed = loader.batches_consumed  # a plain loop: what this DataModule's loader handed to it
        state = {"train_sampler": self.train_sampler.state_dict(batches_consumed=consumed),
                 "data": data_identity(self)}
        if self.auto_budget is not None:  # planned, so the budget is known: a resume plans with it
            state["token_budget"] = self.auto_budget.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training sampler's position; applied when ``train_dataloader()`` is next called.

        The next training epoch then replays no micro-batch and skips none (see
        :meth:`BalancedBatchSampler.load_state_dict`, which also covers a different number of ranks).

        Raises:
            TypeError: ``state_dict`` is not a dict (mapping).
            ValueError: unknown keys; a bad ``token_budget``; here or at ``train_dataloader()``, another ``seed``,
                ``val_fraction``, ``max_length``, corpus or tokenizer than the checkpoint's (naming each).
        """
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(f"BalancedTextDataModule.load_state_dict expects the dict returned by state_dict() "
                                 f"(key 'train_sampler'), got {state_dict!r} of type {type(state_dict).__name__}")
        if self.stream is not None:
            return self.stream.load_state_dict(self, state_dict)
        unknown = set(state_dict) - {"train_sampler", "data", "token_budget"}
        if unknown:
            raise InputValueError(f"BalancedTextDataModule state_dict has unknown keys {sorted(unknown)}")
        self._saved_data = state_dict.get("data")  # absent from checkpoints of earlier versions
        if self._saved_data is not None and self.corpus is not None:
            check_saved_data(self._saved_data, data_identity(self))
        self._train_sampler_state = state_dict.get("train_sampler")
        self._skip_pending = self.skip_steps is not None  # placed after the restored position
        if self.auto_budget is not None and state_dict.get("token_budget"):
            self.auto_budget.load_state_dict(state_dict["token_budget"])  # checked now, planned at train_dataloader

    def val_dataloader(self) -> list[DataLoader]:
        """One loader of validation micro-batches (this rank's, unshuffled) per component with validation documents,
        named by :attr:`val_names` in order; ``[]`` without validation."""
        if self.stream is not None:
            return self.stream.val_loaders(self)
        if all(f == 0 and s.split_sizes is None for f, s in zip(self._val_fractions, self.sources)):
            return []
        if self.train_dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        self._plan(measure=True)
        return [self._loader(d, s) for d, s in zip(self.val_datasets, self.val_samplers)]

    def on_exception(self, exception: BaseException) -> None:
        """When one rank fails, make every rank's error name the cause (:func:`~lit_balance.lightning.rank_errors.
        share_failure`): the failing rank shares its message through the process group's store, the ranks that
        lost it in a collective add it to theirs. Nothing happens on one process. Then as :meth:`teardown` (Lightning
        calls no ``teardown`` after an exception)."""
        try:
            share_failure(exception)
        finally:
            self.teardown("fit")
