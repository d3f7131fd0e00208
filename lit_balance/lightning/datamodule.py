"""BalancedTextDataModule: tokenize a corpus once, feed every rank token-budgeted micro-batches."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lit_balance._checks import check_bool, check_int
from lit_balance._fingerprint import sha256_of, sha256_of_int64
from lit_balance.data.cache import TokenizedCorpus, default_cache_dir, load_or_build
from lit_balance.data.collate import PackedCollator, PadCollator
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModel, check_cost_model
from lit_balance.plan.padded import padded_lengths
from lit_balance.plan.settings import BatchingSettings, delegate_settings
from lit_balance.sampler.sampler import BalancedBatchSampler

__all__ = ["BalancedTextDataModule"]


_DEFAULT_MAX_TOKENS = 4096
_DEFAULT_VAL_FRACTION = 0.05  # val_fraction=None without a validation split of the corpus
_DATA_KEYS = ("seed", "val_fraction", "max_length", "num_documents", "corpus_lengths_sha256", "tokenizer")
_NUM_FINGERPRINT_FIELDS = 9  # len(BalancedTextDataModule._fingerprint())


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


def _process_group_ready() -> bool:
    """Whether a torch.distributed process group exists (Lightning's DDP creates it before ``setup``)."""
    return dist.is_available() and dist.is_initialized()


@delegate_settings
class BalancedTextDataModule(L.LightningDataModule):
    """A LightningDataModule that tokenizes a corpus and feeds each rank token-budgeted micro-batches.

    With no arguments it uses the built-in corpus (the docstrings of the running Python's standard
    library, so it needs no download) and the built-in BERT-uncased WordPiece tokenizer (30,522 tokens).

    Data flow: ``prepare_data`` (one process per node) tokenizes the corpus into a cache of plain
    arrays keyed by corpus and tokenizer; ``setup`` loads it on every rank, splits documents into train
    and validation (a permutation seeded by ``seed``), truncates each to ``max_length`` tokens, and
    builds one :class:`BalancedBatchSampler` per split from ``trainer.world_size`` and
    ``trainer.global_rank``: the training split's with :attr:`settings` and the Trainer's
    ``accumulate_grad_batches``, the validation split's unshuffled, without drop_last, largest_first or
    accumulation, with the default cost model. Loaders are ``DataLoader(dataset, sampler=sampler, batch_size=None)``:
    because the sampler is a ``DistributedSampler``, Lightning calls its ``set_epoch`` every epoch and
    leaves it in place under either value of ``Trainer(use_distributed_sampler=...)``.

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
            :mod:`lit_balance.data.hf_datasets`). Prompt–completion records and ``labels`` mask tokens: batches
            carry their labels (``-100`` on a prompt), and the plan's ``step_supervised_tokens`` counts exactly
            the targets left.
        tokenizer: None for the built-in tokenizer, a ``tokenizers.Tokenizer``, a Hugging Face tokenizer
            object, or a path to a ``tokenizer.json``. Ignored for token-id corpora unless given.
        max_tokens: padded token slots per micro-batch, per rank (the memory budget).
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
        cost_model: see :class:`BalancedBatchSampler` (training split); default: padded tokens.
        text_key: field holding the text in ``.jsonl`` files, or column holding it in a Hugging Face dataset.
        txt_documents: how plain-text (non-``.jsonl``) corpus files split into documents: ``"line"`` (the
            default: each non-blank line) or ``"paragraph"`` (runs of non-blank lines separated by blank
            lines, joined with ``"\\n"``, so wrapped paragraphs stay one document). Part of the cache key.
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
        max_tokens: int = 4096,
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
        add_special_tokens: bool = False,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if val_fraction is not None and (
                isinstance(val_fraction, (bool, np.bool_))
                or not isinstance(val_fraction, (int, float, np.integer, np.floating)) or not 0 <= val_fraction < 1):
            raise InputValueError(f"val_fraction must be a number in [0, 1) or None, got {val_fraction!r}")
        keywords = {"max_tokens": max_tokens, "shuffle": shuffle, "seed": seed, "drop_last": drop_last,
                    "too_long": too_long, "pad_to_multiple_of": pad_to_multiple_of, "max_batch_size": max_batch_size,
                    "shuffle_window": shuffle_window, "largest_first": largest_first, "packing": packing}
        if settings is not None:  # keywords left at their defaults say nothing
            defaults = {**BatchingSettings(max_tokens=_DEFAULT_MAX_TOKENS).to_dict(), "max_tokens": _DEFAULT_MAX_TOKENS}
            keywords = {k: v for k, v in keywords.items() if not (type(v) is type(defaults[k]) and v == defaults[k])}
        self.settings = BatchingSettings.build(settings, keywords, owner="BalancedTextDataModule")
        if max_length is not None:
            max_length = check_int("max_length", max_length, 1, "tokens kept per document, or None for no truncation")
        num_workers = check_int("num_workers", num_workers, 0, "DataLoader worker processes per rank")
        pin_memory = check_bool("pin_memory", pin_memory)
        add_special_tokens = check_bool("add_special_tokens", add_special_tokens)
        if vocab_size is not None:
            vocab_size = check_int("vocab_size", vocab_size, 1, "token ids of a token-id corpus without a "
                                   "tokenizer, or None (the default: largest id + 1, or the tokenizer's)",
                                   maximum=2**31)
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise InputTypeError(f"cache_dir must be a directory path (str or os.PathLike) or None, got {cache_dir!r} "
                            f"of type {type(cache_dir).__name__}")
        if cache_dir is not None and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
            raise InputValueError(f"cache_dir {str(cache_dir)!r} exists and is not a directory; pass a directory path")
        self.source = resolve_corpus(corpus, text_key=text_key, txt_documents=txt_documents)
        if self.source.split_sizes is not None and val_fraction is not None:
            raise InputValueError(
                f"val_fraction={val_fraction!r} conflicts with the corpus' own validation split "
                f"({self.source.split_sizes[1]} rows of the DatasetDict's 'validation'); leave val_fraction=None to "
                "validate on that split, or pass corpus=dataset_dict['train'] to hold out val_fraction of the "
                "training split instead (val_fraction=0: no validation)"
            )
        if val_fraction is None:
            val_fraction = 0.0 if self.source.split_sizes is not None else _DEFAULT_VAL_FRACTION
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
            raise InputTypeError(f"pad_token_id must be an int or None, got {type(pad_token_id).__name__} {pad_token_id!r}")
        if self.source.holds_token_ids and add_special_tokens:
            raise InputValueError("add_special_tokens=True applies to text corpora only: a token-id corpus is used as "
                             "given (never re-encoded, with or without a tokenizer), so add the special ids to each "
                             "document yourself, or leave add_special_tokens=False")
        if self.source.holds_token_ids and tokenizer is None:
            pad = 0 if pad_token_id is None else pad_token_id
            if self.source.key_after_reading and vocab_size is None:
                raise InputValueError("a Hugging Face IterableDataset of token ids is read once, into the cache, so its "
                                 "largest id is not known in advance: pass vocab_size= (or a tokenizer)")
            # an IterableDataset's ids are checked against vocab_size when it is read into the cache
            largest = 0 if self.source.key_after_reading else max(
                (int(np.max(d)) for d in self.source.load_token_ids() if len(d)), default=0)
            if vocab_size is None:
                vocab_size = max(largest, pad) + 1
            # validates vocab_size and pad_token_id now, not at prepare_data
            self.tokenizer = TokenizerAdapter.for_token_ids(vocab_size=vocab_size, pad_token_id=pad)
            if largest >= self.tokenizer.vocab_size:
                raise InputValueError(f"token id {largest} is outside vocab_size={vocab_size}; raise vocab_size")
        else:
            self.tokenizer = resolve_tokenizer(tokenizer, pad_token_id=pad_token_id,
                                               add_special_tokens=add_special_tokens)
            if vocab_size is not None and vocab_size != self.tokenizer.vocab_size:
                with_what = "the built-in tokenizer" if tokenizer is None else "the given tokenizer"
                raise InputValueError(
                    f"vocab_size={vocab_size} conflicts with {with_what}'s vocabulary of {self.tokenizer.vocab_size} "
                    f"token ids ({self.source.kind} corpus); the vocabulary is the tokenizer's, and vocab_size only "
                    "sets it for token-id corpora without a tokenizer: leave vocab_size unset (None)"
                )
        self.txt_documents = txt_documents
        self.add_special_tokens = add_special_tokens
        self.pad_token_id = self.tokenizer.pad_token_id
        self.vocab_size = self.tokenizer.vocab_size
        self.max_length = max_length
        #: Share of the corpus held out for validation (0.0 when the corpus brings its own validation split).
        self.val_fraction = float(val_fraction)
        self.num_workers = num_workers
        self.cost_model = None if cost_model is None else check_cost_model(cost_model)
        self._train_sampler_state: dict[str, Any] | None = None
        self._saved_data: dict[str, Any] | None = None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.pin_memory = pin_memory
        self.corpus: TokenizedCorpus | None = None
        self.train_dataset: TokenDataset | None = None
        self.val_dataset: TokenDataset | None = None
        self.train_sampler: BalancedBatchSampler | None = None
        self.val_sampler: BalancedBatchSampler | None = None

    # ------------------------------------------------------------------------------------------------
    def _tokenized(self) -> TokenizedCorpus:
        return load_or_build(self.source, self.tokenizer, self.cache_dir, progress=True)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (once per node; other ranks wait at Lightning's barrier)."""
        self._tokenized()

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def setup(self, stage: str | None = None) -> None:
        """Load the cache, split train/validation and build the samplers for this rank.

        Under a Trainer with several ranks, the ranks then compare what they planned (corpus document count
        and token lengths, tokenizer, ``max_length``, ``seed``, ``val_fraction``, batching settings, split
        lengths) in one small ``all_gather``; every rank takes part even when its own setup failed, and every
        rank raises when any differs or failed, so no rank trains on a plan the others do not share and none
        waits forever.

        Raises:
            ValueError: the corpus is too small for the requested validation split; with
                ``too_long="error"``, a document longer than ``max_tokens`` after ``max_length``
                truncation (naming its index in the corpus); a split the sampler cannot plan.
            RuntimeError: the ranks planned different data (naming the ranks, what differs and the likely
                cause), or another rank's setup failed.
        """
        error: BaseException | None = None
        try:
            self._plan_splits()
        except Exception as exc:  # the other ranks still wait on this one's fingerprint: tell them, then raise
            error = exc
        self._check_ranks_agree(error)

    def _split(self) -> tuple[np.ndarray, np.ndarray]:
        """``(train_docs, val_docs)``: the corpus' own splits, or a permutation seeded by ``seed``."""
        num_docs = len(self.corpus)
        if self.source.split_sizes is not None:  # a DatasetDict's train split, then its validation split
            is_val = np.asarray(self.corpus.source_index) >= self.source.split_sizes[0]
            train_docs, val_docs = np.flatnonzero(~is_val), np.flatnonzero(is_val)
            if not train_docs.size or not val_docs.size:
                which = "training" if not train_docs.size else "validation"
                raise InputValueError(f"every document of the corpus' {which} split is empty after tokenization")
            return train_docs, val_docs
        num_val = round(self.val_fraction * num_docs)
        if self.val_fraction > 0:
            num_val = max(num_val, 1)
        if num_docs - num_val < 1:
            raise InputValueError(
                f"the corpus has {num_docs} document(s); val_fraction={self.val_fraction} leaves none for training; "
                "lower val_fraction or add documents"
            )
        perm = np.random.default_rng(np.random.SeedSequence([int(self.seed), 0x5EED])).permutation(num_docs)
        return np.sort(perm[num_val:]), np.sort(perm[:num_val])

    def _plan_splits(self) -> None:
        self.corpus = self._tokenized()
        train_docs, val_docs = self._split()
        num_val = len(val_docs)
        world_size, rank = self._world()
        self._check_too_long()
        # The plan balances each optimizer step: Lightning's accumulate_grad_batches at setup time.
        train_settings = self.settings
        if self.trainer is not None:
            accumulate = getattr(self.trainer, "accumulate_grad_batches", 1)
            try:
                train_settings = train_settings.replace(accumulate_grad_batches=1 if accumulate is None else accumulate)
            except (TypeError, ValueError) as error:
                raise type(error)(f"the Trainer's accumulate_grad_batches={accumulate!r} cannot be planned: {error}; "
                                  "set Trainer(accumulate_grad_batches=...) to an int >= 1") from error
        val_settings = self.settings.replace(shuffle=False, drop_last=False, largest_first=False,
                                             accumulate_grad_batches=1)
        world = {"num_replicas": world_size, "rank": rank}
        labels = self.corpus.labels
        self.train_dataset = TokenDataset(self.corpus.token_ids, self.corpus.offsets, train_docs, self.max_length,
                                          labels=labels)
        self.train_sampler = self._sampler("training", self.train_dataset, train_settings, cost_model=self.cost_model,
                                           **world)
        self.val_dataset = self.val_sampler = None
        if num_val:
            self.val_dataset = TokenDataset(self.corpus.token_ids, self.corpus.offsets, val_docs, self.max_length,
                                            labels=labels)
            self.val_sampler = self._sampler("validation", self.val_dataset, val_settings, **world)
        truncate = self.train_sampler.truncate_to if self.too_long == "truncate" else None
        collator = PackedCollator if self.packing else PadCollator
        self.collator = collator(self.pad_token_id, self.pad_to_multiple_of, max_length=truncate)

    def _fingerprint(self) -> list[tuple[str, int, bool]]:
        """What this rank planned, as ``(field, int64 value, shown)``: a count, or a hash's first 8 bytes."""
        def digest(*parts: str | bytes) -> int:
            return int.from_bytes(bytes.fromhex(sha256_of(*parts))[:8], "little", signed=True)

        def lengths(values: np.ndarray) -> int:  # the int64 bytes' digest, hashed in chunks (no whole copy)
            return int.from_bytes(bytes.fromhex(sha256_of_int64(values))[:8], "little", signed=True)

        def split(dataset: TokenDataset | None) -> np.ndarray:
            return np.empty(0, np.int64) if dataset is None else np.asarray(dataset.lengths)

        corpus = self.corpus
        return [
            ("documents", len(corpus), True),
            ("corpus token lengths", lengths(corpus.lengths), False),
            ("tokenizer", digest(self.tokenizer.fingerprint), False),
            ("max_length", -1 if self.max_length is None else int(self.max_length), True),
            ("seed", int(self.seed), True),
            ("val_fraction", digest(repr(self.val_fraction)), False),
            ("batching settings", digest(json.dumps(self.train_sampler.settings.to_dict(), sort_keys=True)), False),
            ("training lengths", lengths(split(self.train_dataset)), False),
            ("validation lengths", lengths(split(self.val_dataset)), False),
        ]

    def _check_ranks_agree(self, error: BaseException | None) -> None:
        """Under a Trainer with several ranks, compare what every rank planned; all raise on a difference.

        One ``all_gather`` of a small int64 tensor, taken by every rank even when its own planning failed,
        so that no rank waits for one that stopped. Without a Trainer, with one rank, or without an
        initialised process group (ranks simulated by hand) only ``error`` is raised.

        Raises:
            RuntimeError: another rank's setup failed, or the ranks planned different data (naming the ranks
                and what differs, with the likely cause).
        """
        trainer = self.trainer
        if trainer is None or trainer.world_size <= 1 or not _process_group_ready():
            if error is not None:
                raise error
            return
        fields = self._fingerprint() if error is None else []
        local = torch.tensor([int(error is not None)] + [v for _, v, _ in fields] if fields else
                             [1] + [0] * _NUM_FINGERPRINT_FIELDS, dtype=torch.int64)
        gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device))
        table = gathered.cpu().reshape(trainer.world_size, -1).tolist()
        rank = trainer.global_rank
        failed = [r for r, row in enumerate(table) if row[0]]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"BalancedTextDataModule.setup failed on rank(s) {failed} (see their error); rank {rank} stops too, "
                "so that no rank waits for the others"
            )
        reference = table[0]
        differ = [r for r, row in enumerate(table) if row != reference]
        if not differ:
            return
        parts = []
        for i, (name, _, shown) in enumerate(fields, start=1):
            values = [row[i] for row in table]
            if len(set(values)) == 1:
                continue
            if shown:
                parts.append(f"{name}: " + ", ".join(f"rank {r} has {v}" for r, v in enumerate(values)))
            else:
                others = [r for r, v in enumerate(values) if v != values[0]]
                parts.append(f"{name} differ on rank(s) {others} from rank 0's")
        raise RuntimeError(
            f"ranks planned different data: rank(s) {differ} differ from rank 0 ({'; '.join(parts)}); every rank "
            "must tokenize the same corpus with the same tokenizer and settings. Likely causes: per-node corpus "
            "copies that differ (a stale copy on one node), a different tokenizer or tokenizer version, a "
            "different max_length, seed or val_fraction; make them the same on every rank"
        )

    def plan_summary(self, num_replicas: int, accumulate_grad_batches: int = 1, *, epoch: int = 0) -> dict[str, Any]:
        """Preview the training split's plan for ``num_replicas`` ranks, without a Trainer or the CLI.

        Tokenizes into the cache (:meth:`prepare_data`), splits train/validation as :meth:`setup` does, and
        plans epoch ``epoch`` of the training split with :func:`lit_balance.report.plan_report` (the figures
        are :func:`lit_balance.plan.stats.plan_stats`'s). The DataModule's samplers and datasets are left as they
        were. Call it before ``Trainer.fit`` or on every rank: with a Trainer of several ranks attached,
        ``setup`` compares the ranks' plans in a collective.

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
        from lit_balance.report.figures import plan_report

        settings = self.settings.replace(accumulate_grad_batches=accumulate_grad_batches)
        state = ("corpus", "train_dataset", "val_dataset", "train_sampler", "val_sampler", "collator")
        saved = {name: self.__dict__[name] for name in state if name in self.__dict__}
        try:
            self.prepare_data()
            self.setup("fit")
            lengths = np.asarray(self.train_dataset.lengths, dtype=np.int64)
        finally:
            for name in state:
                if name in saved:
                    setattr(self, name, saved[name])
                else:
                    self.__dict__.pop(name, None)
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

    def _check_too_long(self) -> None:
        """With ``too_long="error"``, name the corpus documents (source indices) that cannot fit."""
        if self.too_long != "error":
            return
        lengths = self.corpus.lengths if self.max_length is None else np.minimum(self.corpus.lengths, self.max_length)
        m = self.pad_to_multiple_of
        bad = np.flatnonzero(padded_lengths(lengths, m) > self.max_tokens)
        if bad.size:
            shown = ", ".join(f"document {self.corpus.source_index[d]}: {lengths[d]} tokens" for d in bad[:5])
            raise InputValueError(
                f"{bad.size} corpus document(s) are longer than max_tokens={self.max_tokens} padded token slots "
                f"(max_length={self.max_length}, pad_to_multiple_of={m}): {shown}{', ...' if bad.size > 5 else ''}; "
                f"set max_length <= {(self.max_tokens // m) * m} to truncate documents, raise max_tokens, or pass "
                'too_long="skip" or "truncate"'
            )

    def _sampler(self, split: str, dataset: TokenDataset, settings: BatchingSettings,
                 **kwargs: Any) -> BalancedBatchSampler:
        if dataset.labels is not None:  # masked labels: the plan counts each sample's next-token targets exactly
            cut = settings.truncate_to if settings.too_long == "truncate" else None
            kwargs["supervised_lengths"] = dataset.supervised_lengths(cut)
        try:
            return BalancedBatchSampler(dataset.lengths, settings=settings, **kwargs)
        except ValueError as error:
            raise InputValueError(f"{split} split ({len(dataset)} documents, val_fraction={self.val_fraction}): "
                             f"{error}") from error

    def _loader(self, dataset: TokenDataset | None, sampler: BalancedBatchSampler | None) -> DataLoader:
        if dataset is None or sampler is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return DataLoader(
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
        if self._train_sampler_state is not None and self.train_sampler is not None:
            if self._saved_data is not None:
                self._check_saved_data(self._saved_data)
            self.train_sampler.load_state_dict(self._train_sampler_state)
            self._train_sampler_state = None
        trainer = self.trainer
        if trainer is not None and self.train_sampler is not None and trainer.current_epoch > self.train_sampler.epoch:
            # Lightning reads len(loader) before it calls set_epoch; select the new epoch first, so that its
            # length counts a cost model or rank speeds handed over for it (unequal speeds can lengthen it).
            self.train_sampler.set_epoch(int(trainer.current_epoch))
        return self._loader(self.train_dataset, self.train_sampler)

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position, for Lightning checkpoints (rank-independent, plain types).

        The position counts the micro-batches of the current epoch that Lightning's fit loop will count as
        done when it restores this checkpoint (:func:`_batches_done_on_restore`), not those the DataLoader's
        workers fetched ahead: a checkpoint saved after a failure inside a training step (e.g. by
        ``OnExceptionCheckpoint``, also after Ctrl-C) resumes with the failed micro-batch. Empty before
        ``setup``.

        Returns:
            ``{"train_sampler": BalancedBatchSampler.state_dict(...), "data": {"seed", "val_fraction",
            "max_length", "num_documents", "corpus_lengths_sha256", "tokenizer"}}``: ``data`` identifies the
            training split, so that a resume with another one names what changed.
        """
        if self.train_sampler is None:
            return {}
        consumed = None
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit":  # also while validating inside fit
            consumed = _batches_done_on_restore(trainer.fit_loop.epoch_loop.batch_progress)
            earlier = self.train_sampler.first_micro_step  # consumed on other ranks before
            consumed = min(max(consumed, earlier), len(self.train_sampler))
        return {"train_sampler": self.train_sampler.state_dict(batches_consumed=consumed),
                "data": self._data_identity()}

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
        unknown = set(state_dict) - {"train_sampler", "data"}
        if unknown:
            raise InputValueError(f"BalancedTextDataModule state_dict has unknown keys {sorted(unknown)}")
        self._saved_data = state_dict.get("data")  # absent from checkpoints of earlier versions
        if self._saved_data is not None and self.corpus is not None:
            self._check_saved_data(self._saved_data)
        self._train_sampler_state = state_dict.get("train_sampler")
        if self._train_sampler_state is not None:
            # Lightning cannot see that this DataLoader resumes through its sampler; it does.
            warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")

    def val_dataloader(self) -> DataLoader | list:
        """Validation micro-batches of this rank (unshuffled), or ``[]`` without a validation split."""
        if self.val_fraction == 0 and self.source.split_sizes is None:
            return []
        return self._loader(self.val_dataset, self.val_sampler)
