"""A stream as the corpus of :class:`~lit_balance.BalancedTextDataModule`: what the DataModule does instead of caching,
splitting and sampling when its corpus declares itself a stream (:attr:`CorpusSource.streamed
<lit_balance.data.sources.CorpusSource.streamed>`, a :class:`~lit_balance.stream.StreamCorpus`).

Training reads the stream window by window while it trains (:class:`~lit_balance.stream.StreamBatches` through a
:class:`~lit_balance.stream.StreamLoader`): no cache, no pass before training, no ``len()``; the run ends at the
stream's end (every rank at the same micro-step) or at ``max_steps``. Validation is the stream's first
``val_documents`` documents (read by every rank at ``setup``, not trained) or a separate finite ``val_corpus``
(tokenized into the cache like any corpus); each is planned by a :class:`~lit_balance.BalancedBatchSampler`.

Settings that cannot apply to a stream are refused at construction, before any token is read, each naming both
settings (:func:`stream_component`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from lit_balance._checks import check_int
from lit_balance.data.cache import open_corpus
from lit_balance.data.collate import collator_for
from lit_balance.data.corpus_tokenizer import corpus_tokenizer
from lit_balance.data.fit_loop import fit_batches_consumed
from lit_balance.data.sources import CorpusSource, resolve_corpus
from lit_balance.data.splits import split_corpus
from lit_balance.data.stores import TokenizedCorpus
from lit_balance.data.tokenizer import TokenizerAdapter
from lit_balance.data.training_sampler import use_training_stream
from lit_balance.data.vocabulary import decide_vocabulary
from lit_balance.errors import InputValueError
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.stream import StreamBatches, StreamCorpus, StreamLoader
from lit_balance.world import data_parallel_world

__all__ = ["DEFAULT_WINDOW_DOCUMENTS", "StreamComponent", "stream_component"]

#: ``window_documents`` of a stream corpus when not given: documents per window, global.
DEFAULT_WINDOW_DOCUMENTS = 4096

_VERSION = 1


def _refuse(setting: str, value: Any, why: str, parameter: str) -> None:
    raise InputValueError(f"{setting}={value!r} cannot apply to a stream corpus (a StreamCorpus, read window by window "
                          f"while training): {why}", parameter=parameter)


def stream_component(names: Sequence[str], sources: Sequence[CorpusSource], plain: bool, *, settings: Any,
                     batching: dict[str, Any], auto: bool, num_workers: int, val_fraction: Any,
                     skip_steps: Any, window_documents: Any, val_documents: Any, val_corpus: Any,
                     text_key: str, txt_documents: str) -> StreamComponent | None:
    """The :class:`StreamComponent` of a DataModule whose one component is a stream, None for finite corpora (which
    then take none of the stream's settings).

    Args:
        names, sources: the blend's component names and sources (:attr:`CorpusSource.streamed` says which is a stream).
        plain: whether the blend is planned as one corpus (:attr:`Mixture.plain <lit_balance.Mixture.plain>`).
        settings: the DataModule's :class:`~lit_balance.BatchingSettings` (None with ``max_tokens="auto"``).
        batching: the batching settings' values but ``max_tokens``.
        auto: ``max_tokens="auto"``.
        num_workers, val_fraction, skip_steps: the DataModule's (``val_fraction`` as given, None when not).
        window_documents, val_documents, val_corpus: the stream's settings as given (None: not given).
        text_key, txt_documents: how a finite ``val_corpus`` is read.

    Raises:
        ValueError: naming both settings: a stream setting beside a finite corpus; a mixture holding a stream; per-rank
            or ``"auto"`` ``max_tokens``, ``num_workers > 0``, ``val_fraction``, ``drop_last``, a ``too_long`` other
            than ``"error"`` or ``skip_steps`` beside a stream; ``val_documents`` beside ``val_corpus``.
    """
    streams = [n for n, s in zip(names, sources) if s.streamed]
    if not streams:
        for name, value in (("window_documents", window_documents), ("val_documents", val_documents),
                            ("val_corpus", val_corpus)):
            if value is not None:
                raise InputValueError(f"{name}={value!r} applies to a stream corpus (a lit_balance.stream."
                                      f"StreamCorpus), and this corpus is finite ({', '.join(names)}): it is planned "
                                      "whole, with val_fraction held out; leave "
                                      f"{name}=None", parameter=name)
        return None
    if len(names) > 1 or not plain:
        finite = [n for n in names if n not in streams]
        other = (f"and {finite[0]!r} is finite" if finite else "and the mixture repeats it or sets its length"
                 if len(names) == 1 else f"beside {[n for n in names if n != streams[0]]}")
        raise InputValueError(
            f"mixture component {streams[0]!r} is a stream (StreamCorpus) {other}: corpus=Mixture(...) cannot hold a "
            "stream component yet (per-step shares need each component's lengths); train the stream alone "
            "(corpus=StreamCorpus(...)), or bound it as a finite component (its dataset with max_documents)",
            parameter=f"components.{streams[0]}")
    if auto:
        _refuse("max_tokens", "auto", "the budget probe measures the longest documents of the training split, and a "
                "stream's are not known before training; pass an int max_tokens", "max_tokens")
    if not isinstance(settings.max_tokens, int):
        _refuse("max_tokens", settings.max_tokens, "per-rank budgets are planned from the whole training split; pass "
                "one int max_tokens for every rank", "max_tokens")
    if num_workers:
        _refuse("num_workers", num_workers, "the stream's ranks exchange lengths and token ids while they read, in the "
                "training process; pass num_workers=0", "num_workers")
    if val_fraction is not None and val_fraction != 0:
        _refuse("val_fraction", val_fraction, "a share of a stream of unknown length cannot be held out; hold out its "
                "first documents (val_documents=N) or validate on a finite corpus (val_corpus=...)", "val_fraction")
    if batching["drop_last"]:
        _refuse("drop_last", True, "every window of a stream is planned to its end; a stream trains every document "
                "once, so drop_last=False", "drop_last")
    if batching["too_long"] != "error":
        _refuse("too_long", batching["too_long"], "a document over max_tokens raises on every rank; cut documents "
                "with max_length and leave too_long='error'", "too_long")
    if skip_steps is not None:
        _refuse("skip_steps", skip_steps, "steps are left out of a plan of the epoch, and a stream is planned window by "
                "window; leave skip_steps=None", "skip_steps")
    if val_documents is not None and val_corpus is not None:
        raise InputValueError(f"val_documents={val_documents!r} and val_corpus are two ways to validate a stream: pass "
                              "one (the stream's first documents, or a separate finite corpus)",
                              parameter="val_documents")
    window = check_int("window_documents", DEFAULT_WINDOW_DOCUMENTS if window_documents is None else window_documents,
                       1, "documents per window of the stream, global")
    held_out = 0 if val_documents is None else check_int(
        "val_documents", val_documents, 0, "the stream's first documents held out for validation")
    val_source = None if val_corpus is None else resolve_corpus(val_corpus, text_key=text_key,
                                                               txt_documents=txt_documents)
    if val_source is not None and val_source.streamed:
        raise InputValueError("val_corpus is a stream as well; validation runs over a finite corpus: pass its files "
                              "or documents themselves, or hold out the training stream's first documents "
                              "(val_documents=N)", parameter="val_corpus")
    return StreamComponent(sources[0], names[0], window, held_out, val_source)


class StreamComponent:
    """The stream of a :class:`~lit_balance.BalancedTextDataModule` and its validation: built by
    :func:`stream_component` at construction; the DataModule hands it each hook.

    Args:
        source: the stream (:class:`~lit_balance.stream.StreamCorpus`).
        name: the component's name (``train``).
        window_documents: documents per window, global (the same on any number of ranks, and when resuming).
        held_out: the stream's first documents held out for validation (not trained).
        val_source: a finite validation corpus, or None.

    Attributes:
        batches: the :class:`~lit_balance.stream.StreamBatches` of the last training loader, or None.
    """

    def __init__(self, source: StreamCorpus, name: str, window_documents: int, held_out: int,
                 val_source: CorpusSource | None) -> None:
        self.source, self.name = source, name
        self.window_documents, self.held_out, self.val_source = window_documents, held_out, val_source
        self.batches: StreamBatches | None = None
        self._state: dict[str, Any] | None = None
        self._corpus: StreamCorpus | None = None

    @property
    def description(self) -> str:
        """What the training stream is, in a line."""
        return f"{self.source.description}, windows of {self.window_documents} documents"

    def tokenizer(self, tokenizer: Any, *, vocab_size: Any, pad_token_id: Any, add_special_tokens: bool,
                  allow_tokenizer_mismatch: bool) -> TokenizerAdapter:
        """The tokenizer of the stream: the given one, else the built-in one; token ids without a tokenizer when only
        ``vocab_size`` is given (a stream of token ids, whose largest id is not known before training). The
        ``StreamCorpus``'s own tokenizer counts as given; given both ways, it is a ValueError. A finite ``val_corpus``
        must agree with it."""
        own = self.source.given_tokenizer
        if own is not None and tokenizer is not None and own is not tokenizer:
            raise InputValueError("a tokenizer is given to both the StreamCorpus and BalancedTextDataModule: give it "
                                  "to one of them (tokenizer=...)", parameter="tokenizer")
        tokenizer = own if tokenizer is None else tokenizer
        if tokenizer is None and vocab_size is not None:
            adapter = decide_vocabulary(None, vocab_size=vocab_size, pad_token_id=pad_token_id, holds_token_ids=True,
                                        add_special_tokens=add_special_tokens, kind="stream")
        else:
            adapter = decide_vocabulary(tokenizer, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                        add_special_tokens=add_special_tokens, kind="stream")
        if self.val_source is not None:
            val = corpus_tokenizer(self.val_source, tokenizer, vocab_size=adapter.vocab_size,
                                   pad_token_id=adapter.pad_token_id, add_special_tokens=add_special_tokens,
                                   allow_tokenizer_mismatch=allow_tokenizer_mismatch)
            if (val.vocab_size, val.pad_token_id) != (adapter.vocab_size, adapter.pad_token_id):
                raise InputValueError(f"val_corpus has vocab_size {val.vocab_size} and pad id {val.pad_token_id}, the "
                                      f"stream {adapter.vocab_size} and {adapter.pad_token_id}; give both one "
                                      "vocabulary", parameter="val_corpus")
        return adapter

    def corpus(self, dm: Any) -> StreamCorpus:
        """The stream as the DataModule reads it: a copy of the user's, tokenized by the DataModule's tokenizer and
        cut to the smaller of its own ``max_length`` and the DataModule's (the user's object is left as it is)."""
        if self._corpus is None:
            cuts = [c for c in (self.source.max_length, dm.max_length) if c is not None]
            self._corpus = self.source.with_tokenizer(dm.tokenizer, min(cuts) if cuts else None)
        return self._corpus

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def prepare_data(self, dm: Any) -> None:
        """Tokenize a finite ``val_corpus`` into the cache (the stream itself is read while training)."""
        if self.val_source is not None:
            open_corpus(self.val_source, dm.tokenizer, dm.cache_dir, progress=True)

    def _val_corpus(self, dm: Any) -> TokenizedCorpus | None:
        if self.val_source is not None:
            return open_corpus(self.val_source, dm.tokenizer, dm.cache_dir)
        if not self.held_out:
            return None
        ids = self.corpus(dm).head(self.held_out)
        if len(ids) < self.held_out:
            raise InputValueError(f"val_documents={self.held_out} holds out more documents than the stream has "
                                  f"({len(ids)}); lower val_documents", parameter="val_documents")
        lengths = np.array([a.shape[0] for a in ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(ids).astype(np.int32)
        return TokenizedCorpus(tokens, offsets, np.arange(len(ids), dtype=np.int64), num_empty=0,
                               vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id)

    def setup(self, dm: Any) -> list[tuple[str, int, bool]]:
        """Build the validation dataset and sampler on the DataModule (``val_names``, ``val_datasets``,
        ``val_samplers``); return what this rank planned, for the ranks' agreement check."""
        from lit_balance.lightning.agreement import plan_fingerprint

        dm.val_names, dm.val_datasets, dm.val_samplers = [], [], []
        part = self._val_corpus(dm)
        val_lengths = None
        if part is not None:
            val, _ = split_corpus(part, val_fraction=0.0, seed=dm.seed, max_length=dm.max_length)
            world = data_parallel_world(dm.trainer)
            settings = dm._train_settings().replace(shuffle=False, drop_last=False, largest_first=False,
                                                    accumulate_grad_batches=1)
            sampler = BalancedBatchSampler(val.lengths, settings=settings, num_replicas=world.num_replicas,
                                           rank=world.rank)
            dm.val_names, dm.val_datasets, dm.val_samplers = [self.name], [val], [sampler]
            self._val_collator = collator_for(sampler.settings, dm.pad_token_id)
            val_lengths = val.lengths
        accumulate = dm._train_settings().accumulate_grad_batches
        empty = np.zeros(0, np.int64)
        return plan_fingerprint(
            corpus_lengths=empty, tokenizer_fingerprint=dm.tokenizer.fingerprint, max_length=dm.max_length,
            seed=dm.seed, val_fraction=0.0,
            settings={**dm._batching, "max_tokens": dm.max_tokens, "accumulate_grad_batches": accumulate,
                      "window_documents": self.window_documents, "held_out": self.held_out,
                      "stream": self.source.fingerprint},
            train_lengths=empty, val_lengths=val_lengths)

    def train_loader(self, dm: Any) -> StreamLoader:
        """The training loader of this rank: a :class:`~lit_balance.stream.StreamLoader` over the stream's
        :class:`~lit_balance.stream.StreamBatches` (the same object on each call of a fit, so a new epoch is the next
        pass), after a restored state."""
        trainer = dm.trainer
        world = data_parallel_world(trainer)
        if self.batches is None or (self.batches.num_replicas, self.batches.rank) != (world.num_replicas, world.rank):
            if self.batches is not None and self._state is None:  # a fit on another world goes on where this stood
                self._state = self.batches.state_dict()
            self.batches = StreamBatches(self.corpus(dm), dm._train_settings(), window_documents=self.window_documents,
                                         num_replicas=world.num_replicas, rank=world.rank,
                                         process_group=world.process_group, cost_model=dm.cost_model,
                                         pad_token_id=dm.pad_token_id, held_out=self.held_out)
        if self._state is not None:
            self.batches.load_state_dict(self._state)
            self._state = None
        if trainer is not None:  # the callbacks that need a plan of the epoch say so by name
            use_training_stream(trainer, self.description)
        return StreamLoader(self.batches, trainer=trainer)

    def val_loaders(self, dm: Any) -> list[DataLoader]:
        """One loader of validation micro-batches of this rank (after ``setup``), or ``[]`` without validation."""
        return [DataLoader(d, sampler=s, batch_size=None, collate_fn=self._val_collator, num_workers=0,
                           pin_memory=dm.pin_memory) for d, s in zip(dm.val_datasets, dm.val_samplers)]

    def identity(self, dm: Any) -> dict[str, Any]:
        """What the stream's training is made from: checked when a checkpoint resumes."""
        return {"stream": self.source.fingerprint, "held_out": self.held_out, "seed": int(dm.seed),
                "max_length": dm.max_length, "tokenizer": dm.tokenizer.fingerprint}

    def state_dict(self, dm: Any) -> dict[str, Any]:
        """``{"stream": StreamBatches.state_dict(...), "data": identity}`` at the micro-batches the fit loop consumed
        (all yielded outside ``Trainer.fit``); ``{}`` before the training loader was built."""
        if self.batches is None:
            return {} if self._state is None else {"stream": self._state, "data": self.identity(dm)}
        consumed = fit_batches_consumed(dm.trainer)
        return {"stream": self.batches.state_dict(micro_batches=consumed), "data": self.identity(dm)}

    def load_state_dict(self, dm: Any, state: dict[str, Any]) -> None:
        """Keep a :meth:`state_dict` for the next training loader (any number of ranks).

        Raises:
            ValueError: unknown keys; a checkpoint of another stream, ``val_documents``, seed, ``max_length`` or
                tokenizer (naming each).
        """
        if not state:  # saved before the training loader was built: nothing consumed
            self._state = None
            return
        if set(state) - {"stream", "data"} or "stream" not in state:
            raise InputValueError(f"the state of a stream DataModule has keys ['data', 'stream'], got {sorted(state)}",
                                  parameter="state_dict")
        saved, now = state.get("data") or {}, self.identity(dm)
        diff = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if diff:
            raise InputValueError("cannot resume: the stream's training differs from the checkpoint's ("
                                  + "; ".join(diff) + "); resume with the run's own stream and settings",
                                  parameter="state_dict")
        self._state = dict(state["stream"])
