"""BalancedTextDataModule: tokenize a corpus once, feed every rank token-budgeted micro-batches.

Lightning glue over the data layer: :mod:`lit_balance.data` tokenizes and caches the corpus and splits it
(:mod:`lit_balance.data.splits`), :class:`~lit_balance.BalancedBatchSampler` plans each split for this rank of the
data-parallel world (:func:`lit_balance.world.data_parallel_world`), and :mod:`lit_balance.lightning.agreement`
checks at ``setup`` that every process planned the same data.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lit_balance._checks import check_bool, check_int, check_number
from lit_balance._fingerprint import sha256_of_int64
from lit_balance.data.cache import TokenizedCorpus, default_cache_dir
from lit_balance.data.collate import PackedCollator, PadCollator, collator_for
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.records import supervised_counts
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.splits import resolve_val_fraction, split_corpus
from lit_balance.data.stores import StoreSource, open_corpus, store_tokenizer
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.lightning.agreement import check_ranks_agree, plan_fingerprint
from lit_balance.lightning.budget import DEFAULT_MEMORY_FRACTION, TokenBudget, TokenBudgetProbe
from lit_balance.plan.cost import CostModel, check_cost_model
from lit_balance.plan.epoch import planner_for
from lit_balance.plan.settings import BatchingSettings, delegate_settings
from lit_balance.plan.types import padded_lengths
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.sampler.state import SettingsMismatchError
from lit_balance.world import DataParallelWorld, data_parallel_world

if TYPE_CHECKING:
    from lit_balance.data.sources import CorpusSource

__all__ = ["DEFAULT_MAX_TOKENS", "BalancedTextDataModule", "fit_batches_consumed"]

#: ``max_tokens`` of :class:`BalancedTextDataModule` (and of ``lit-balance plan``) when not given: padded token
#: slots per micro-batch, per rank.
DEFAULT_MAX_TOKENS = 4096
_DATA_KEYS = ("seed", "val_fraction", "max_length", "num_documents", "corpus_lengths_sha256", "tokenizer")


def _batches_done_on_restore(progress: Any) -> int:
    """Micro-batches of the current epoch that Lightning's fit loop counts as done when it restores ``progress``.

    ``progress`` is ``trainer.fit_loop.epoch_loop.batch_progress`` at save time. On restore, Lightning 2.x
    (``_TrainingEpochLoop.reset``) restarts from ``current.completed``, plus the batch of a checkpoint saved in
    ``on_train_batch_end`` (``ready == started == processed == completed + 1``: the step ran, its end hook did
    not count yet). ``ready`` also counts a batch whose training step raised (an exception, Ctrl-C): that one
    runs again.
    """
    total, current = progress.total, progress.current
    done = int(current.completed)
    if total.ready == total.started == total.processed == total.completed + 1:
        done += 1
    return done


def fit_batches_consumed(trainer: Any) -> int | None:
    """Training micro-batches of the current epoch that Lightning counts as done if a checkpoint is saved now.

    The count a resume state must hold (``BalancedBatchSampler.state_dict(batches_consumed=...)``): Lightning restores
    a mid-epoch checkpoint at its fit loop's *completed* batches, plus the batch of a checkpoint saved in
    ``on_train_batch_end``; a micro-batch whose training step raised (an exception, Ctrl-C, then
    ``OnExceptionCheckpoint``) is not done and runs again. :class:`BalancedTextDataModule` saves its sampler's position
    at this count; pass ``batches_consumed=lambda: fit_batches_consumed(self.trainer)`` to
    :func:`~lit_balance.balanced_dataloader` for the same with any map-style dataset.

    Args:
        trainer: the ``lightning.Trainer``.

    Returns:
        Micro-batches counted from the epoch's start, or None when the trainer is not fitting (no count applies).
    """
    if trainer is None or trainer.state.fn != "fit":  # also while validating inside fit
        return None
    return _batches_done_on_restore(trainer.fit_loop.epoch_loop.batch_progress)


def _settings_advice(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """The message of a resume whose batching settings differ from the checkpoint's, naming where a DataModule user
    sets each one: ``accumulate_grad_batches`` is the Trainer's, the others the DataModule's."""
    diff = "; ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in differences.items())
    fixes = []
    if "accumulate_grad_batches" in differences:
        fixes.append(f"set Trainer(accumulate_grad_batches={differences['accumulate_grad_batches'][0]!r}) as when "
                     "the checkpoint was saved")
    others = {k: old for k, (old, _) in differences.items() if k != "accumulate_grad_batches"}
    if others:
        fixes.append("construct BalancedTextDataModule with the saved " + ", ".join(f"{k}={v!r}" for k, v in
                                                                                   others.items())
                     + " (keywords, or settings=BatchingSettings(...) with them)")
    return (f"cannot resume: the training batching settings differ from the checkpoint's ({diff}); "
            + " and ".join(fixes) + ", or start without ckpt_path")


class _SamplerResumedLoader(DataLoader):
    """The training DataLoader: it resumes through its sampler, whose position the DataModule's state_dict holds.

    Lightning 2.x (``_TrainingEpochLoop.reset``) warns on a mid-epoch resume ("your dataloader is not resumable")
    unless every training loader is stateful: has ``state_dict`` and ``load_state_dict``
    (``lightning.fabric.utilities.types._Stateful``). It then saves ``state_dict()`` in the checkpoint's fit loop
    and hands it back to ``load_state_dict`` on restore. This loader keeps no state of its own: the sampler's
    position is saved by :meth:`BalancedTextDataModule.state_dict` and restored before the loader is built, so the
    loader saves ``{}`` and accepts only that.
    """

    def state_dict(self) -> dict[str, Any]:
        """``{}``: the position lives in the sampler (see :meth:`BalancedTextDataModule.state_dict`)."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Accept the ``{}`` that :meth:`state_dict` saved.

        Raises:
            ValueError: a non-empty state (not saved by this loader).
        """
        if not isinstance(state_dict, Mapping) or state_dict:
            raise InputValueError(
                f"the training DataLoader of BalancedTextDataModule saves no state of its own (its sampler's position "
                f"is in the DataModule's state), got {state_dict!r}; resume from a checkpoint written with "
                "BalancedTextDataModule, or without ckpt_path", parameter="state_dict")


class _Splits(NamedTuple):
    """The tokenized corpus and its training and validation datasets (the latter None without validation)."""

    corpus: TokenizedCorpus
    train_dataset: TokenDataset
    val_dataset: TokenDataset | None


def _batching_settings(settings: BatchingSettings | None, keywords: dict[str, Any]) -> BatchingSettings:
    """The DataModule's :class:`BatchingSettings`: ``settings``, or the keywords; keywords at their defaults say
    nothing beside ``settings``."""
    if settings is not None:
        defaults = {**BatchingSettings(max_tokens=DEFAULT_MAX_TOKENS).to_dict(), "max_tokens": DEFAULT_MAX_TOKENS}
        keywords = {k: v for k, v in keywords.items() if not (type(v) is type(defaults[k]) and v == defaults[k])}
    return BatchingSettings.build(settings, keywords, owner="BalancedTextDataModule")


def _check_cache_dir(cache_dir: Any) -> Path:
    """``cache_dir`` as a Path (the default cache directory for None)."""
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise InputTypeError(f"cache_dir must be a directory path (str or os.PathLike) or None, got {cache_dir!r} "
                             f"of type {type(cache_dir).__name__}", parameter="cache_dir")
    if Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise InputValueError(f"cache_dir {str(cache_dir)!r} exists and is not a directory; pass a directory path",
                              parameter="cache_dir")
    return Path(cache_dir)


def _check_vocab_size(vocab_size: Any) -> int | None:
    if vocab_size is None:
        return None
    return check_int("vocab_size", vocab_size, 1, "token ids of a token-id corpus without a tokenizer, or None (the "
                     "default: largest id + 1, or the tokenizer's)", maximum=2**31)


def _check_pad_token_id(pad_token_id: Any) -> int | None:
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise InputTypeError(f"pad_token_id must be an int or None, got {type(pad_token_id).__name__} "
                             f"{pad_token_id!r}", parameter="pad_token_id")
    return pad_token_id


def _token_id_tokenizer(source: CorpusSource, vocab_size: int | None, pad_token_id: int | None) -> TokenizerAdapter:
    """The vocabulary of a token-id corpus without a tokenizer: ``vocab_size``, or its largest id + 1."""
    pad = 0 if pad_token_id is None else pad_token_id
    if source.key_after_reading and vocab_size is None:
        raise InputValueError("a Hugging Face IterableDataset of token ids is read once, into the cache, so its "
                              "largest id is not known in advance: pass vocab_size= (or a tokenizer)",
                              parameter="vocab_size")
    # an IterableDataset's ids are checked against vocab_size when it is read into the cache
    largest = 0 if source.key_after_reading else max(
        (int(np.max(d)) for d in source.load_token_ids() if len(d)), default=0)
    if vocab_size is None:
        vocab_size = max(largest, pad) + 1
    # validates vocab_size and pad_token_id now, not at prepare_data
    adapter = TokenizerAdapter.for_token_ids(vocab_size=vocab_size, pad_token_id=pad)
    if largest >= adapter.vocab_size:
        raise InputValueError(f"token id {largest} is outside vocab_size={vocab_size}; raise vocab_size",
                              parameter="vocab_size")
    return adapter


def _corpus_tokenizer(source: CorpusSource, tokenizer: Any, *, vocab_size: int | None, pad_token_id: int | None,
                      add_special_tokens: bool) -> TokenizerAdapter:
    """The tokenizer of ``source``: the given one (or the built-in one), or a token-id corpus' vocabulary."""
    if source.holds_token_ids and add_special_tokens:
        raise InputValueError("add_special_tokens=True applies to text corpora only: a token-id corpus is used as "
                              "given (never re-encoded, with or without a tokenizer), so add the special ids to each "
                              "document yourself, or leave add_special_tokens=False", parameter="add_special_tokens")
    if isinstance(source, StoreSource):  # a tokenized store: its own metadata, or what is given
        return store_tokenizer(source, tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id)
    if source.holds_token_ids and tokenizer is None:
        return _token_id_tokenizer(source, vocab_size, pad_token_id)
    adapter = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id, add_special_tokens=add_special_tokens)
    if vocab_size is not None and vocab_size != adapter.vocab_size:
        with_what = "the built-in tokenizer" if tokenizer is None else "the given tokenizer"
        raise InputValueError(
            f"vocab_size={vocab_size} conflicts with {with_what}'s vocabulary of {adapter.vocab_size} "
            f"token ids ({source.kind} corpus); the vocabulary is the tokenizer's, and vocab_size only "
            "sets it for token-id corpora without a tokenizer: leave vocab_size unset (None)", parameter="vocab_size")
    return adapter


@delegate_settings
class BalancedTextDataModule(L.LightningDataModule):
    """A LightningDataModule that tokenizes a corpus and feeds each rank token-budgeted micro-batches.

    With no arguments it uses the built-in corpus (the docstrings of the running Python's standard
    library, so it needs no download) and the built-in BERT-uncased WordPiece tokenizer (30,522 tokens).

    Data flow: ``prepare_data`` (one process per node) tokenizes the corpus into a cache of plain
    arrays keyed by corpus and tokenizer; ``setup`` loads it on every rank, splits documents into train
    and validation (a permutation seeded by ``seed``), truncates each to ``max_length`` tokens, and
    builds one :class:`BalancedBatchSampler` per split for this rank of the data-parallel world
    (:func:`lit_balance.world.data_parallel_world`: the rank and size of the strategy's
    ``distributed_sampler_kwargs``; processes of one tensor-parallel replica get the same micro-batches): the training
    split's with :attr:`settings` and the Trainer's ``accumulate_grad_batches``, the validation split's unshuffled,
    without drop_last, largest_first or accumulation, with the default cost model. Loaders are
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
        corpus: None or ``"stdlib_docstrings"`` for the built-in corpus; a list of strings (documents);
            a path or list of paths to UTF-8 text files (one document per non-blank line) or ``.jsonl``
            files (one object per line: text under ``text_key``, or a prompt–completion record with
            ``prompt`` and ``completion``); a list of token-id sequences; or a Hugging Face
            ``datasets.Dataset``, ``DatasetDict`` or ``IterableDataset`` (columns ``input_ids`` with optional
            ``labels``, the ``text_key`` column, or ``prompt`` and ``completion``; see
            :mod:`lit_balance.data.sources.hf`). Prompt–completion records and ``labels`` mask tokens: batches
            carry their labels (``-100`` on a prompt), and the plan's ``step_supervised_tokens`` counts exactly
            the targets left.
        tokenizer: None for the built-in tokenizer, a ``tokenizers.Tokenizer``, a Hugging Face tokenizer
            object, or a path to a ``tokenizer.json``. Ignored for token-id corpora unless given.
        max_tokens: padded token slots per micro-batch, per rank (the memory budget): one int for every rank, a
            list of one per data-parallel rank (ranks of different memory; its length must be the world size), or
            ``"auto"``: measured
            before the first epoch under a Trainer by running the model's ``training_step`` forward and backward on
            worst-case micro-batches (:mod:`lit_balance.lightning.budget`, ``docs/token_budget.md``); the result is
            :attr:`token_budget`, logged, and saved by :meth:`state_dict` so that a resume uses it. Until it is
            known, ``dm.max_tokens`` reads ``"auto"``. Not with ``settings``.
        memory_limit: with ``max_tokens="auto"``: bytes one rank may use (on a CPU required: the process's peak
            resident set size; on CUDA optional, a cap below the device's memory). Ignored otherwise.
        memory_fraction: with ``max_tokens="auto"``: share of the capacity the budget may use, in (0, 1].
        max_length: keep at most this many tokens of each document (truncation), or None.
        val_fraction: share of documents held out for validation, in ``[0, 1)``; 0 disables validation. None
            (the default): 0.05, or, for a ``DatasetDict`` with a ``validation`` split, that split (nothing is
            held out of ``train``); a number together with such a split is a ValueError (pass
            ``corpus=dataset_dict["train"]`` to split the training rows by ``val_fraction`` instead).
        seed: seed of the train/validation split and of the samplers (the same on every rank).
        num_workers: DataLoader worker processes per rank.
        shuffle: reshuffle training micro-batches every epoch.
        drop_last, too_long, pad_to_multiple_of, max_batch_size, shuffle_window, largest_first, packing: batching
            settings, see :class:`~lit_balance.BatchingSettings` (``too_long`` only matters when ``max_length``
            exceeds ``max_tokens``; ``packing=True``: padding-free micro-batches, one row of whole documents each).
        settings: all batching settings as one :class:`~lit_balance.BatchingSettings` instead of the keywords
            above (``max_tokens`` ... ``packing``), which must then be left at their defaults or agree with
            it. Its ``accumulate_grad_batches`` is used only without a Trainer; with one, the Trainer's is.
        cost_model: cost of a training micro-batch, see :class:`BalancedBatchSampler`: a
            :class:`~lit_balance.CostModel` or any other cost model (:class:`~lit_balance.plan.CostModelProtocol`,
            e.g. a :class:`~lit_balance.plan.CostModelBase` subclass); default: padded tokens.
        text_key: field holding the text in ``.jsonl`` files, or column holding it in a Hugging Face dataset.
        txt_documents: how plain-text (non-``.jsonl``) corpus files split into documents: ``"line"`` (the
            default: each non-blank line) or ``"paragraph"`` (runs of non-blank lines separated by blank
            lines, joined with ``"\\n"``, so wrapped paragraphs stay one document). Part of the cache key.
        max_documents: rows read at most from a Hugging Face ``IterableDataset`` corpus (global, before the
            validation split), which needs this bound: a stream may never end, and one without it is refused. None
            (the default) for every other corpus, which is read to its end; a number beside one is a ValueError.
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

    Attributes:
        settings: the :class:`~lit_balance.BatchingSettings`, built and checked at construction; its fields are
            also readable as attributes (``dm.max_tokens``, ``dm.shuffle``, ...; read-only).
        vocab_size: number of token ids, known at construction.
        txt_documents, add_special_tokens: the tokenization options as given.
        pad_token_id: padding token id, known at construction.

    Raises:
        FileNotFoundError: a corpus path does not exist.
        ValueError: a bad setting (with the value), e.g. a ``vocab_size`` that differs from the
            tokenizer's; an unreadable, non-UTF-8 or empty corpus; a list of str that names files; a
            ``val_fraction`` beside a ``DatasetDict``'s ``validation`` split; a token-id ``IterableDataset``
            without ``vocab_size`` or tokenizer; a dataset without a usable column.
        TypeError: a setting of the wrong type (e.g. ``pin_memory="yes"``, ``cache_dir=5``), or a
            corpus or tokenizer of an unsupported type.
        ImportError: a Hugging Face ``datasets`` object while ``datasets`` cannot be imported (the message
            says ``pip install "lit_balance[datasets]"``).

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
        max_tokens: int | list[int] | Literal["auto"] = DEFAULT_MAX_TOKENS,
        max_length: int | None = 512,
        val_fraction: float | None = None,
        seed: int = 0,
        num_workers: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        too_long: str = "error",
        pad_to_multiple_of: int = 1,
        max_batch_size: int | None = None,
        shuffle_window: float = 0.25,
        cost_model: CostModel | None = None,
        largest_first: bool = False,
        packing: bool = False,
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
    ) -> None:
        super().__init__()
        if val_fraction is not None:
            resolve_val_fraction(val_fraction)  # its type and range, before the corpus is read
        #: True when ``max_tokens="auto"``: the budget is measured by the probe before the first epoch.
        self.auto_max_tokens = isinstance(max_tokens, str) and max_tokens == "auto"
        if self.auto_max_tokens:
            if settings is not None:
                raise InputValueError("max_tokens='auto' cannot be combined with settings= (whose max_tokens is an "
                                      "int): pass the batching settings as keywords, or an int max_tokens",
                                      parameter="max_tokens")
            max_tokens = DEFAULT_MAX_TOKENS  # a stand-in inside settings until the probe replaces it; never planned
            if memory_limit is not None:
                memory_limit = check_int("memory_limit", memory_limit, 1, "bytes one rank may use, e.g. 8 * 2**30")
            check_number("memory_fraction", memory_fraction, 0.0, 1.0, "the share of memory the budget may use, "
                         "e.g. 0.9", low_open=True)
        self.memory_limit, self.memory_fraction = memory_limit, memory_fraction
        #: The probe's result (:class:`~lit_balance.lightning.budget.TokenBudget`) with ``max_tokens="auto"``, once
        #: known; None before, and with an int ``max_tokens``.
        self.token_budget: TokenBudget | None = None
        self._saved_budget: dict[str, Any] | None = None
        self.settings = _batching_settings(settings, {
            "max_tokens": max_tokens, "shuffle": shuffle, "seed": seed, "drop_last": drop_last, "too_long": too_long,
            "pad_to_multiple_of": pad_to_multiple_of, "max_batch_size": max_batch_size,
            "shuffle_window": shuffle_window, "largest_first": largest_first, "packing": packing})
        if max_length is not None:
            max_length = check_int("max_length", max_length, 1, "tokens kept per document, or None for no truncation")
        self.max_length = max_length
        self.num_workers = check_int("num_workers", num_workers, 0, "DataLoader worker processes per rank")
        self.pin_memory = check_bool("pin_memory", pin_memory)
        self.add_special_tokens = check_bool("add_special_tokens", add_special_tokens)
        self.txt_documents = txt_documents
        vocab_size = _check_vocab_size(vocab_size)
        pad_token_id = _check_pad_token_id(pad_token_id)
        self.cache_dir = _check_cache_dir(cache_dir)
        self.source = resolve_corpus(corpus, text_key=text_key, txt_documents=txt_documents,
                                     max_documents=max_documents)
        self.max_documents = max_documents
        #: Share of the corpus held out for validation (0.0 when the corpus brings its own validation split).
        self.val_fraction = resolve_val_fraction(val_fraction, self.source.split_sizes)
        self.tokenizer = _corpus_tokenizer(self.source, tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                           add_special_tokens=self.add_special_tokens)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.vocab_size = self.tokenizer.vocab_size
        self.cost_model = None if cost_model is None else check_cost_model(cost_model)
        self._train_sampler_state: dict[str, Any] | None = None
        self._saved_data: dict[str, Any] | None = None
        self._warned_zero_targets = False
        self.corpus: TokenizedCorpus | None = None
        self.train_dataset: TokenDataset | None = None
        self.val_dataset: TokenDataset | None = None
        self.train_sampler: BalancedBatchSampler | None = None
        self.val_sampler: BalancedBatchSampler | None = None
        self.collator: PadCollator | PackedCollator | None = None

    # ------------------------------------------------------------------------------------------------
    def _tokenized(self) -> TokenizedCorpus:
        return open_corpus(self.source, self.tokenizer, self.cache_dir, progress=True)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (once per node; other ranks wait at Lightning's barrier)."""
        self._tokenized()

    def _world(self) -> DataParallelWorld:
        """The data-parallel rank and number of ranks the samplers are built for."""
        return data_parallel_world(self.trainer)

    def _splits(self) -> _Splits:
        """Load the cache and build the training and validation datasets; changes nothing on the DataModule.

        Raises:
            ValueError: as :func:`lit_balance.data.splits.split_corpus`; with ``too_long="error"``, a document
                longer than ``max_tokens`` after ``max_length`` truncation.
        """
        corpus = self._tokenized()
        train, val = split_corpus(corpus, val_fraction=self.val_fraction, seed=self.seed, max_length=self.max_length,
                                  split_sizes=self.source.split_sizes)
        self._check_too_long(corpus)
        return _Splits(corpus, train, val)

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

    def _check_targets(self, corpus: TokenizedCorpus, dataset: TokenDataset, supervised: np.ndarray,
                       cut: int | None) -> None:
        """Report training records whose labels leave no next-token target: warn once (count, first corpus records,
        the setting to change), or raise when no record has one."""
        zero = np.flatnonzero(supervised == 0)
        if zero.size == 0:
            return
        full = dataset.offsets[dataset.doc_ids + 1] - dataset.offsets[dataset.doc_ids]
        lost = int(np.count_nonzero(supervised_counts(dataset.labels, dataset.offsets, dataset.doc_ids[zero],
                                                      full[zero]) > 0))
        shown = ", ".join(str(int(corpus.source_index[d])) for d in dataset.doc_ids[zero[:5]])
        shown += ", ..." if zero.size > 5 else ""
        limit = f"max_length={self.max_length}" + (f" (and too_long='truncate' at {cut} tokens)" if cut else "")
        parts = []
        if lost:
            parts.append(f"{lost} of them lose every target to truncation ({limit}: the prompt fills the tokens kept)")
        if zero.size - lost:
            parts.append(f"{zero.size - lost} have none to begin with (a completion of at most one token, or labels "
                         "all -100)")
        why = ", ".join(parts)
        fix = ("raise max_length (or max_tokens with too_long='truncate') so that completions survive truncation, "
               "shorten those prompts, or drop those records")
        if zero.size == len(dataset):
            raise InputValueError(f"no training record has a next-token target: all {zero.size} records' labels are "
                                  f"-100 after the shift, so the loss would be 0 and the gradients zero; {why}; "
                                  f"{fix}", parameter="max_length")
        if not self._warned_zero_targets:
            self._warned_zero_targets = True
            warnings.warn(
                f"{zero.size} of {len(dataset)} training records have no next-token target (corpus records {shown}) "
                f"and train nothing; {why}; {fix}", UserWarning, stacklevel=2)

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
        try:
            if self._budget_pending():  # max_tokens="auto": the samplers are built once the probe has run
                self.corpus, self.train_dataset, self.val_dataset = self._splits()
            else:
                self._plan_splits()
            fields = self._fingerprint()
        except Exception as exc:  # noqa: BLE001  the other ranks wait on this one's fingerprint: tell them, then raise
            error = exc
        check_ranks_agree(self.trainer, fields, error)

    def _plan_splits(self) -> None:
        """Build the datasets, samplers and collator of this rank and assign them together."""
        splits = self._splits()
        world = self._world()
        train_sampler = self._sampler("training", splits.train_dataset, self._train_settings(), world,
                                      cost_model=self.cost_model)
        val_sampler = None
        if splits.val_dataset is not None:
            val_settings = self.settings.replace(shuffle=False, drop_last=False, largest_first=False,
                                                 accumulate_grad_batches=1)
            val_sampler = self._sampler("validation", splits.val_dataset, val_settings, world)
        truncate = train_sampler.truncate_to if self.too_long == "truncate" else None
        if train_sampler.supervised_lengths is not None:
            self._check_targets(splits.corpus, splits.train_dataset, train_sampler.supervised_lengths, truncate)
        self.corpus, self.train_dataset, self.val_dataset = splits
        self.train_sampler, self.val_sampler = train_sampler, val_sampler
        self.collator = collator_for(planner_for(self.settings).name, self.pad_token_id, self.pad_to_multiple_of,
                                     max_length=truncate)

    def _fingerprint(self) -> list[tuple[str, int, bool]]:
        """What this rank planned at ``setup``: :func:`lit_balance.lightning.agreement.plan_fingerprint`."""
        return plan_fingerprint(
            corpus_lengths=self.corpus.lengths, tokenizer_fingerprint=self.tokenizer.fingerprint,
            max_length=self.max_length, seed=self.seed, val_fraction=self.val_fraction,
            settings=self._fingerprint_settings(), train_lengths=self.train_dataset.lengths,
            val_lengths=None if self.val_dataset is None else self.val_dataset.lengths)

    def _fingerprint_settings(self) -> dict[str, Any]:
        if self._budget_pending():
            return {**self.settings.to_dict(), "max_tokens": "auto"}
        return self.train_sampler.settings.to_dict()

    # ---- max_tokens="auto" ------------------------------------------------------------------------------------
    def _budget_pending(self) -> bool:
        """True while ``max_tokens="auto"`` has no measured (or restored) budget yet."""
        return self.auto_max_tokens and self.token_budget is None

    def find_max_tokens(self, model: Any, *, memory_limit: int | None = None, memory_fraction: float | None = None,
                        trainer: Any = None, world: DataParallelWorld | None = None) -> TokenBudget:
        """Run only the probe (:class:`~lit_balance.lightning.budget.TokenBudgetProbe`) for ``model`` on this
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
            ValueError: on a CPU without ``memory_limit``; bad arguments.
        """
        train = self.train_dataset if self.train_dataset is not None else self._splits().train_dataset
        lengths = np.asarray(train.lengths, dtype=np.int64)
        longest = int(np.argmax(lengths))
        world = world if world is not None else data_parallel_world(trainer)
        probe = TokenBudgetProbe(
            model, lengths=lengths, settings=self.settings, pad_token_id=self.pad_token_id,
            token_ids=np.asarray(train[longest]["input_ids"], dtype=np.int64),
            memory_limit=self.memory_limit if memory_limit is None else memory_limit,
            memory_fraction=self.memory_fraction if memory_fraction is None else memory_fraction,
            trainer=trainer, world=world)
        return probe.run()

    def _resolve_max_tokens(self) -> None:
        """With ``max_tokens="auto"``: take the checkpoint's budget or run the probe, then plan with it."""
        if not self._budget_pending() or self.train_dataset is None:
            return
        if self._saved_budget is not None:
            budget = TokenBudget.from_dict(self._saved_budget)
        else:
            trainer = self.trainer
            if trainer is None or trainer.lightning_module is None:
                raise RuntimeError("max_tokens='auto' is measured with the model before the first epoch: run "
                                   "Trainer.fit(model, datamodule=dm), or call dm.find_max_tokens(model, ...) and "
                                   "pass its max_tokens")
            budget = self.find_max_tokens(trainer.lightning_module, trainer=trainer)
        self.token_budget = budget
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"BalancedTextDataModule token budget: {budget.describe()}")
        # per-rank budgets where the ranks' measurements differ by more than noise, else one for every rank
        self.settings = self.settings.replace(max_tokens=budget.plan_max_tokens(self._world().num_replicas))
        self._plan_splits()

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
            :meth:`lit_balance.report.PlanReport.summary`: ``summary["balanced"]`` holds ``padding_ratio``,
            ``useful_fraction``, ``micro_batches_per_rank`` (``len(train_sampler)`` under that world size),
            ``optimizer_steps``, ...; ``summary["distributed_sampler"]`` the fixed-batch-size comparison.

        Raises:
            ValueError, TypeError: as :meth:`setup`, or a bad ``num_replicas`` / ``accumulate_grad_batches``.

        Example:
            >>> dm = BalancedTextDataModule(["the cat sat", "a dog ran far away"], max_tokens=64, val_fraction=0,
            ...                             cache_dir=getfixture("tmp_path"))
            >>> dm.plan_summary(num_replicas=1)["balanced"]["micro_batches_per_rank"]
            1
        """
        from lit_balance.report import plan_report

        if self._budget_pending():
            raise RuntimeError("max_tokens='auto' is measured at fit start; preview the plan after Trainer.fit, or "
                               "pass the budget of dm.find_max_tokens(model, ...) (or lit-balance plan --max_tokens "
                               "auto --config <fit config>) as max_tokens")
        settings = self.settings.replace(accumulate_grad_batches=accumulate_grad_batches)
        lengths = np.asarray(self._splits().train_dataset.lengths, dtype=np.int64)
        report = plan_report(lengths, settings=settings, num_replicas=num_replicas, epoch=epoch,
                             cost_model=self.cost_model)
        return report.summary()

    @property
    def num_empty_documents(self) -> int:
        """Documents dropped because they were empty after tokenization (global count; after ``setup``).

        Raises:
            RuntimeError: called before ``setup``.
        """
        if self.corpus is None:
            raise RuntimeError("num_empty_documents is known after setup(); call setup() first")
        return int(self.corpus.num_empty)

    def _check_too_long(self, corpus: TokenizedCorpus) -> None:
        """With ``too_long="error"``, name the corpus documents (source indices) that cannot fit."""
        if self.too_long != "error" or self._budget_pending():
            return
        lengths = corpus.lengths if self.max_length is None else np.minimum(corpus.lengths, self.max_length)
        m = self.pad_to_multiple_of
        largest = self.settings.largest_max_tokens  # per-rank budgets: a document goes to a rank that holds it
        bad = np.flatnonzero(padded_lengths(lengths, m) > largest)
        if bad.size:
            shown = ", ".join(f"document {corpus.source_index[d]}: {lengths[d]} tokens" for d in bad[:5])
            raise InputValueError(
                f"{bad.size} corpus document(s) are longer than max_tokens={largest} padded token slots "
                f"(max_length={self.max_length}, pad_to_multiple_of={m}): {shown}{', ...' if bad.size > 5 else ''}; "
                f"set max_length <= {(largest // m) * m} to truncate documents, raise max_tokens, or pass "
                'too_long="skip" or "truncate"', parameter="max_length"
            )

    def _loader(self, dataset: TokenDataset | None, sampler: BalancedBatchSampler | None,
                loader_class: type[DataLoader] = DataLoader) -> DataLoader:
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
        )

    def train_dataloader(self) -> DataLoader:
        """Training micro-batches of this rank; ``len()`` is the same on every rank.

        After a checkpoint is restored (:meth:`load_state_dict`), the sampler continues the saved epoch (after
        checking that the training split is the saved one). When
        the trainer has moved on to a later epoch, the sampler is set to it here, before Lightning reads
        ``len()`` (with ``reload_dataloaders_every_n_epochs=1``, the length then counts rank speeds handed over
        by :class:`~lit_balance.callbacks.CostModelFeedback`).
        """
        self._resolve_max_tokens()
        if self._train_sampler_state is not None and self.train_sampler is not None:
            if self._saved_data is not None:
                self._check_saved_data(self._saved_data)
            try:
                self.train_sampler.load_state_dict(self._train_sampler_state)
            except SettingsMismatchError as error:
                raise InputValueError(_settings_advice(error.differences), parameter="settings") from error
            self._train_sampler_state = None
        trainer = self.trainer
        if trainer is not None and self.train_sampler is not None and trainer.current_epoch > self.train_sampler.epoch:
            # Lightning reads len(loader) before it calls set_epoch; select the new epoch first, so that its
            # length counts a cost model or rank speeds handed over for it (unequal speeds can lengthen it).
            self.train_sampler.set_epoch(int(trainer.current_epoch))
        return self._loader(self.train_dataset, self.train_sampler, _SamplerResumedLoader)

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position, for Lightning checkpoints (rank-independent, plain types).

        The position counts the micro-batches of the current epoch that Lightning's fit loop will count as
        done when it restores this checkpoint (:func:`fit_batches_consumed`), not those the DataLoader's
        workers fetched ahead: a checkpoint saved after a failure inside a training step (e.g. by
        ``OnExceptionCheckpoint``, also after Ctrl-C) resumes with the failed micro-batch. Empty before
        ``setup``.

        Returns:
            ``{"train_sampler": BalancedBatchSampler.state_dict(...), "data": {"seed", "val_fraction",
            "max_length", "num_documents", "corpus_lengths_sha256", "tokenizer"}}``: ``data`` identifies the
            training split, so that a resume with another one names what changed. With ``max_tokens="auto"`` also
            ``"token_budget"``: :meth:`~lit_balance.lightning.budget.TokenBudget.to_dict`, so that a resume plans with
            the measured budget instead of probing again.
        """
        if self.train_sampler is None:
            return {}
        consumed = fit_batches_consumed(self.trainer)
        if consumed is not None:
            earlier = self.train_sampler.first_micro_step  # consumed on other ranks before
            consumed = min(max(consumed, earlier), len(self.train_sampler))
        state = {"train_sampler": self.train_sampler.state_dict(batches_consumed=consumed),
                 "data": self._data_identity()}
        if self.auto_max_tokens and self.token_budget is not None:
            state["token_budget"] = self.token_budget.to_dict()
        return state

    def _data_identity(self) -> dict[str, Any]:
        """What the training split is made from, as plain types: settings outside the sampler's, and the corpus."""
        corpus = self.corpus
        return {
            "seed": int(self.seed),
            "val_fraction": float(self.val_fraction),
            "max_length": None if self.max_length is None else int(self.max_length),
            "num_documents": len(corpus),
            "corpus_lengths_sha256": sha256_of_int64(corpus.lengths),
            "tokenizer": self.tokenizer.fingerprint,
        }

    def _check_saved_data(self, saved: Any) -> None:
        """Compare a checkpoint's ``data`` entry with this DataModule; raise naming every difference."""
        if not isinstance(saved, Mapping) or set(saved) != set(_DATA_KEYS):
            got = sorted(saved) if isinstance(saved, Mapping) else saved
            raise InputValueError(f"BalancedTextDataModule state_dict 'data' must have keys {sorted(_DATA_KEYS)}, "
                                  f"got {got!r}")
        now = self._data_identity()
        diff = [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in ("seed", "val_fraction", "max_length")
                if saved[k] != now[k]]
        if saved["num_documents"] != now["num_documents"]:
            diff.append(f"corpus: saved {saved['num_documents']} documents, now {now['num_documents']}")
        elif saved["corpus_lengths_sha256"] != now["corpus_lengths_sha256"]:
            diff.append(f"corpus: the same number of documents ({now['num_documents']}), but their token lengths "
                        "differ")
        if saved["tokenizer"] != now["tokenizer"]:
            diff.append("tokenizer: another tokenizer (fingerprint) than the saved one")
        if diff:
            raise InputValueError(
                "cannot resume: the training split differs from the checkpoint's (" + "; ".join(diff) + "); "
                "construct the DataModule with the saved seed, val_fraction and max_length on the same corpus and "
                "tokenizer, or start without ckpt_path"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training sampler's position; applied when ``train_dataloader()`` is next called.

        The next training epoch then replays no micro-batch and skips none (see
        :meth:`BalancedBatchSampler.load_state_dict`, which also covers a different number of ranks).

        Raises:
            TypeError: ``state_dict`` is not a dict (mapping).
            ValueError: keys other than ``train_sampler`` and ``data``; here or at ``train_dataloader()``, a
                checkpoint saved with another ``seed``, ``val_fraction``, ``max_length``, corpus or tokenizer
                (naming each, with the saved and current values).
        """
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(f"BalancedTextDataModule.load_state_dict expects the dict returned by state_dict() "
                                 f"(key 'train_sampler'), got {state_dict!r} of type {type(state_dict).__name__}")
        unknown = set(state_dict) - {"train_sampler", "data", "token_budget"}
        if unknown:
            raise InputValueError(f"BalancedTextDataModule state_dict has unknown keys {sorted(unknown)}")
        self._saved_data = state_dict.get("data")  # absent from checkpoints of earlier versions
        if self._saved_data is not None and self.corpus is not None:
            self._check_saved_data(self._saved_data)
        self._train_sampler_state = state_dict.get("train_sampler")
        if self.auto_max_tokens and state_dict.get("token_budget") is not None:
            TokenBudget.from_dict(state_dict["token_budget"])  # checked now, used when the samplers are built
            self._saved_budget = dict(state_dict["token_budget"])

    def val_dataloader(self) -> DataLoader | list:
        """Validation micro-batches of this rank (unshuffled), or ``[]`` without a validation split."""
        if self.val_fraction == 0 and self.source.split_sizes is None:
            return []
        self._resolve_max_tokens()
        return self._loader(self.val_dataset, self.val_sampler)


def _max_tokens(self: BalancedTextDataModule) -> int | str:
    return "auto" if self._budget_pending() else self.settings.max_tokens


BalancedTextDataModule.max_tokens = property(  # type: ignore[assignment]
    _max_tokens, doc='``settings.max_tokens`` (read-only); ``"auto"`` while ``max_tokens="auto"`` is not measured.')
