"""Token-budgeted, rank-balanced micro-batches from a stream, window by window, on every data-parallel rank.

Per window of ``window_documents`` documents (:mod:`lit_balance.stream.plan`), on every rank, in this order:

1. **read**: every rank iterates the window's documents; rank ``r`` tokenizes only positions ``p`` with
   ``p % num_replicas == r`` (the others are read and passed over, as ``split_dataset_by_node`` does for a stream
   whose shards do not divide among the ranks);
2. **lengths**: one ``all_gather`` of an int64 vector per rank: the documents read, an error flag, and the lengths of
   the documents it tokenized (``3 + ceil(window_documents / num_replicas)`` int64 per rank);
3. **plan**: the window's lengths are put together in stream order and planned by :func:`plan_window`, identically on
   every rank; a window with fewer than ``window_documents`` documents is the stream's last, known to every rank at
   the same micro-step;
4. **token ids**: one ``all_to_all_single`` of int32 token ids: each rank sends the documents it tokenized that
   another rank trains, and receives those it trains but did not tokenize (sizes known to all from the lengths);
5. **micro-batches**: this rank's column of the plan, collated (padded or packed, as the settings plan).

Memory is that of one window: its lengths, the token ids this rank tokenized and those it trains.

State (:meth:`StreamBatches.state_dict`, the same on every rank): the pass, the window index, the documents before the
window, the source's seek position there, and which documents of the window the micro-steps already yielded trained
(a bit per document). A resume (any number of ranks) re-reads that window, plans only its untrained documents, and
goes on: the documents trained are exactly those of an uninterrupted run.
"""

from __future__ import annotations

import math
import traceback
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lit_balance.data.collate import collator_for
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.shapes import resolve_static_shapes
from lit_balance.plan.types import EpochPlan
from lit_balance.stream.plan import plan_window, trained_by
from lit_balance.stream.source import StreamCorpus
from lit_balance.world import DataParallelWorld, resolve_world

__all__ = ["StreamBatches", "StreamLoader", "StreamRankError"]

_VERSION = 1
_HISTORY = 16  # states kept for a loader that runs ahead of training (Lightning prefetches one batch)


class StreamRankError(RuntimeError):
    """The stream raised on another data-parallel rank; raised on every rank that did not raise itself."""


class StreamBatches(torch.utils.data.IterableDataset):
    """This rank's collated micro-batches of a :class:`~lit_balance.stream.StreamCorpus`, planned window by window.

    Use it as the dataset of ``DataLoader(stream_batches, batch_size=None, num_workers=0)`` (each item is already a
    batch; the collectives run in the loading process, so workers are refused). It has no ``len()``: the run ends at
    the stream's end (every rank at the same micro-step) or at the trainer's ``max_steps``. Iterating again after the
    end starts the next pass over the stream (``epoch + 1``); after a loop broke off, it goes on where it stopped.

    Args:
        corpus: the stream.
        settings: the batching settings (``max_tokens`` an int; static shapes are chosen from the first window and
            kept).
        window_documents: documents per window (global, the same on any number of ranks), at least
            ``num_replicas * accumulate_grad_batches`` (one optimizer step of one document per micro-batch).
        num_replicas, rank, process_group: the data-parallel world (default: the process group's, as
            :class:`~lit_balance.BalancedBatchSampler`).
        cost_model: the micro-batch cost the plan balances (default: padded token slots).
        pad_token_id: the padding id (default: the corpus tokenizer's, 0 for token ids).
        held_out: the stream's first ``held_out`` documents are not trained (a validation set:
            ``corpus.head(held_out)``).

    Raises:
        TypeError: ``corpus`` is not a :class:`StreamCorpus`, ``settings`` not a ``BatchingSettings``.
        ValueError: ``window_documents`` below one optimizer step (names both settings); per-rank budgets;
            ``held_out`` < 0. At iteration: a stream with no document; a record without the text key; a document
            over ``max_tokens``; ``num_workers > 0``.
        StreamRankError: at iteration, on every other rank, when the stream raised on one rank.

    Example:
        >>> from lit_balance import BatchingSettings
        >>> corpus = StreamCorpus(lambda: ([7] * n for n in (3, 5, 2, 4, 1)))
        >>> batches = StreamBatches(corpus, BatchingSettings(max_tokens=8, shuffle=False), window_documents=2,
        ...                         num_replicas=1, rank=0)
        >>> sorted(i for b in batches for i in b["indices"].tolist())
        [0, 1, 2, 3, 4]
    """

    def __init__(self, corpus: StreamCorpus, settings: BatchingSettings, *, window_documents: int,
                 num_replicas: int | None = None, rank: int | None = None, process_group: Any = None,
                 cost_model: CostModelProtocol | None = None, pad_token_id: int | None = None,
                 held_out: int = 0) -> None:
        if not isinstance(corpus, StreamCorpus):
            raise InputTypeError(f"corpus must be a lit_balance.stream.StreamCorpus, got {type(corpus).__name__}",
                                 parameter="corpus")
        if not isinstance(settings, BatchingSettings):
            raise InputTypeError(f"settings must be a lit_balance.BatchingSettings, got {type(settings).__name__}",
                                 parameter="settings")
        if not isinstance(settings.max_tokens, int):
            raise InputValueError(f"a stream takes one max_tokens for every rank, got {settings.max_tokens!r}; "
                                  "per-rank budgets are not supported with streams", parameter="max_tokens")
        replicas, this_rank = resolve_world(num_replicas, rank, process_group, owner="StreamBatches")
        self.world = DataParallelWorld(rank=this_rank, num_replicas=replicas, process_group=process_group)
        self.rank, self.num_replicas = self.world.rank, self.world.num_replicas
        self.process_group = process_group
        step = self.num_replicas * settings.accumulate_grad_batches
        if isinstance(window_documents, bool) or not isinstance(window_documents, int) or window_documents < step:
            raise InputValueError(
                f"window_documents={window_documents!r} is smaller than one optimizer step: num_replicas="
                f"{self.num_replicas} x accumulate_grad_batches={settings.accumulate_grad_batches} = {step} "
                f"micro-batches of at least one document each; raise window_documents to >= {step}",
                parameter="window_documents")
        if isinstance(held_out, bool) or not isinstance(held_out, int) or held_out < 0:
            raise InputValueError(f"held_out must be an int >= 0, got {held_out!r}", parameter="held_out")
        self.corpus, self.settings, self.window_documents = corpus, settings, window_documents
        self.cost_model, self.held_out = cost_model, held_out
        self._pad_token_id = pad_token_id
        self._resolved: BatchingSettings | None = None  # static shapes chosen from the first window
        self.epoch, self.window, self.start, self.position = 0, 0, held_out, None
        self._trained: np.ndarray | None = None  # bool [window] trained before the window's current plan
        self._plan: EpochPlan | None = None
        self._steps_done = 0
        self._finished = False
        self._yielded = 0  # micro-batches yielded in this pass
        self._history: deque = deque(maxlen=_HISTORY)  # the state after each of the last micro-batches yielded

    # ----------------------------------------------------------------------------------------------- collectives
    def _all_gather(self, vector: np.ndarray) -> np.ndarray:
        return self.world.all_gather(torch.from_numpy(vector)).numpy()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if self.num_replicas == 1:
            return [obj]
        out: list[Any] = [None] * self.num_replicas
        dist.all_gather_object(out, obj, group=self.world.process_group)
        return out

    def _exchange(self, send: np.ndarray, send_sizes: list[int], recv_sizes: list[int]) -> np.ndarray:
        if self.num_replicas == 1:
            return send.copy()
        out = torch.empty(sum(recv_sizes), dtype=torch.int32)
        dist.all_to_all_single(out, torch.from_numpy(send), recv_sizes, send_sizes, group=self.world.process_group)
        return out.numpy()

    # ------------------------------------------------------------------------------------------------- windows
    def _read_window(self, reader: Any) -> tuple[int, dict[int, np.ndarray], np.ndarray]:
        """Read one window; return ``(documents read, {position: ids} tokenized here, window lengths)``."""
        R, r, W = self.num_replicas, self.rank, self.window_documents
        start = reader.next_document
        error: BaseException | None = None
        docs: list[tuple[int, Any]] = []
        try:
            docs = reader.read(W, tokenize=lambda p: (p - start) % R == r)
        except Exception as caught:  # noqa: BLE001 (every rank must learn of it before anyone raises)
            error = caught
        mine = {p - start: ids for p, ids in docs if ids is not None}
        width = math.ceil(W / R)
        vector = np.full(3 + width, -1, dtype=np.int64)
        vector[0], vector[1], vector[2] = len(docs), int(error is not None), start
        for p, ids in mine.items():
            vector[3 + p // R] = ids.shape[0]
        gathered = self._all_gather(vector)
        if gathered[:, 1].any():
            text = None if error is None else "".join(traceback.format_exception_only(type(error), error)).strip()
            messages = self._all_gather_object(text)
            if error is not None:
                raise error
            failed = int(np.flatnonzero(gathered[:, 1])[0])
            raise StreamRankError(f"the stream raised on data-parallel rank {failed} while reading documents from "
                                  f"{int(gathered[failed, 2])}: {messages[failed]}")
        if (gathered[:, 0] != gathered[0, 0]).any() or (gathered[:, 2] != gathered[0, 2]).any():
            raise RuntimeError(f"the ranks read different windows of the stream (documents read {gathered[:, 0]}, "
                               f"from {gathered[:, 2]}): every rank must be given the same stream")
        n = int(gathered[0, 0])
        positions = np.arange(n)
        lengths = gathered[positions % R, 3 + positions // R] if n else np.zeros(0, np.int64)
        return n, mine, lengths

    def _settings_for(self, lengths: np.ndarray, eligible: np.ndarray | None) -> BatchingSettings:
        """The settings with static shapes chosen from the first window, plus one document of the longest length the
        budget allows, so that the shapes hold any later document that the budget holds."""
        if self._resolved is None:
            m = self.settings.pad_to_multiple_of
            sample = lengths if eligible is None else lengths[eligible]
            longest = np.array([self.settings.max_tokens // m * m], dtype=np.int64)
            self._resolved = resolve_static_shapes(np.concatenate([sample, longest]), self.settings)
        return self._resolved

    def _gather_ids(self, plan: EpochPlan, lengths: np.ndarray, mine: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Token ids of the documents this rank trains: its own, and the others' through one ``all_to_all``."""
        R, r = self.num_replicas, self.rank
        needs = [trained_by(plan, q) for q in range(R)]
        send_parts, send_sizes = [], []
        for q in range(R):
            sent = needs[q][needs[q] % R == r] if q != r else np.zeros(0, np.int64)
            send_parts.extend(mine[int(p)].astype(np.int32) for p in sent)
            send_sizes.append(int(lengths[sent].sum()))
        incoming = [needs[r][(needs[r] % R == i)] if i != r else np.zeros(0, np.int64) for i in range(R)]
        recv_sizes = [int(lengths[p].sum()) for p in incoming]
        send = np.concatenate(send_parts) if send_parts else np.zeros(0, np.int32)
        received = self._exchange(send, send_sizes, recv_sizes)
        out = {int(p): mine[int(p)] for p in needs[r] if int(p) % R == r}
        at = 0
        for part in incoming:
            for p in part:
                size = int(lengths[p])
                out[int(p)] = received[at:at + size].astype(np.int64)
                at += size
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise InputValueError("StreamBatches runs collectives while it reads, so it must be iterated in the "
                                  "training process: pass DataLoader(num_workers=0)", parameter="num_workers")
        if self._finished:  # the next pass over the stream
            self.epoch, self.window, self.start, self.position = self.epoch + 1, 0, self.held_out, None
            self._trained, self._plan, self._steps_done, self._finished = None, None, 0, False
            self._yielded = 0
            self._history.clear()
        elif self._plan is not None:  # a pass left mid-window (a loop that broke off): go on where it stopped
            self.load_state_dict(self.state_dict())
        reader = self.corpus.reader(self.position, self.start)
        collate = None
        try:
            while True:
                self.position, self.start = reader.position(), reader.next_document
                n, mine, lengths = self._read_window(reader)
                if n == 0 and self.window == 0 and self._trained is None:
                    raise InputValueError(f"the stream yielded no documents after the first {self.start} "
                                          f"(held_out={self.held_out}); pass a stream with documents",
                                          parameter="source")
                last = n < self.window_documents
                trained = self._trained[:n] if self._trained is not None else np.zeros(n, dtype=bool)
                eligible = None if not trained.any() else ~trained
                plan = None
                if n and not trained.all():
                    settings = self._settings_for(lengths, eligible)
                    plan = plan_window(lengths, settings, num_replicas=self.num_replicas, epoch=self.epoch,
                                       window=self.window, last=last, eligible=eligible, cost_model=self.cost_model)
                    if collate is None:
                        pad = self._pad_token_id
                        if pad is None:
                            pad = self.corpus.pad_token_id if self.corpus.pad_token_id is not None else 0
                        collate = collator_for(settings, pad)
                    self._trained, self._plan, self._steps_done = trained, plan, 0
                    yield from self._window_batches(plan, lengths, mine, collate)
                if last:
                    self._finished = True
                    return
                self.window += 1
                self._trained, self._plan, self._steps_done = None, None, 0
                del mine
        finally:
            reader.close()

    def _window_batches(self, plan: EpochPlan, lengths: np.ndarray, mine: dict[int, np.ndarray],
                        collate: Any) -> Iterator[dict[str, Any]]:
        ids = self._gather_ids(plan, lengths, mine)
        acc = plan.accumulate_grad_batches
        real = plan.real_tokens_per_batch(lengths)[plan.assignment].sum(axis=1)
        rows = plan.real_rows_per_batch()[plan.assignment].sum(axis=1)
        steps = -(-plan.num_micro_steps // acc)
        group = np.repeat(np.arange(steps), acc)[:plan.num_micro_steps]
        step_real, step_rows = np.bincount(group, real, steps), np.bincount(group, rows, steps)
        for s in range(plan.num_micro_steps):
            positions, fills = plan.batch(int(plan.assignment[s, self.rank]))
            g = int(group[s])
            items = [{"input_ids": ids[int(p)], "index": self.start + int(p), "is_fill": bool(f),
                      "step_real_tokens": int(step_real[g]), "step_rows": int(step_rows[g])}
                     for p, f in zip(positions, fills)]
            batch = collate(items)
            self._steps_done, self._yielded = s + 1, self._yielded + 1
            self._history.append(self._snapshot())
            yield batch

    # ---------------------------------------------------------------------------------------------------- state
    def _snapshot(self) -> tuple:
        return (self._yielded, self.epoch, self.window, self.start, self.position, self._trained, self._plan,
                self._steps_done, self._finished)

    def state_dict(self, micro_batches: int | None = None) -> dict[str, Any]:
        """Where the stream stands after the micro-batches yielded so far, or after the first ``micro_batches`` of this
        pass (plain types; the same on every rank).

        Args:
            micro_batches: micro-batches of this pass that training consumed, when a loader runs ahead of training
                (Lightning's fit-loop count, :class:`StreamLoader`); one of the last 16 yielded. None: all yielded.

        Keys: ``version``, ``epoch``, ``window``, ``start`` (documents of the stream before the window),
        ``position`` (the source's seek position there, or None), ``window_documents``, ``trained`` (a list of
        the window's positions already trained), ``finished``, ``micro_batches`` (of this pass), and the static shapes
        chosen (``padded_shapes``, ``max_batch_size``) or None.

        Raises:
            RuntimeError: ``micro_batches`` is not one of the last micro-batches yielded.
        """
        snapshot = self._snapshot()
        if micro_batches is not None and micro_batches != self._yielded:
            held = [s for s in self._history if s[0] == micro_batches]
            if not held:
                raise RuntimeError(f"the state after micro-batch {micro_batches} of this pass is not held: "
                                   f"{self._yielded} were yielded, the last {len(self._history)} states are kept")
            snapshot = held[0]
        count, epoch, window, start, position, trained, plan, steps_done, finished = snapshot
        trained = np.zeros(0, dtype=bool) if trained is None else trained.copy()
        if plan is not None:
            plan.mark_rows(steps_done, trained)
        resolved = self._resolved
        return {"version": _VERSION, "epoch": epoch, "window": window, "start": start, "position": position,
                "window_documents": self.window_documents, "trained": np.flatnonzero(trained).tolist(),
                "finished": finished, "micro_batches": count,
                "shapes": None if resolved is None else {"padded_shapes": resolved.padded_shapes,
                                                         "max_batch_size": resolved.max_batch_size}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` saved on any number of ranks (before the first ``iter()``).

        Raises:
            ValueError: unknown or missing keys, another version, or another ``window_documents`` (windows are
                cut by it: change it only between passes).
        """
        keys = {"version", "epoch", "window", "start", "position", "window_documents", "trained", "finished",
                "micro_batches", "shapes"}
        if set(state) != keys:
            raise InputValueError(f"a StreamBatches state has keys {sorted(keys)}, got {sorted(state)}",
                                  parameter="state_dict")
        if state["version"] != _VERSION:
            raise InputValueError(f"StreamBatches state version {state['version']} is not {_VERSION}",
                                  parameter="state_dict")
        if state["window_documents"] != self.window_documents:
            raise InputValueError(f"the state was saved with window_documents={state['window_documents']}, this "
                                  f"stream has window_documents={self.window_documents}; resume with the same value",
                                  parameter="window_documents")
        self.epoch, self.window, self.start = int(state["epoch"]), int(state["window"]), int(state["start"])
        self.position, self._finished = state["position"], bool(state["finished"])
        trained = np.zeros(self.window_documents, dtype=bool)
        trained[np.asarray(state["trained"], dtype=np.int64)] = True
        self._trained = trained if trained.any() else None
        self._plan, self._steps_done, self._yielded = None, 0, int(state["micro_batches"])
        self._history.clear()
        shapes = state["shapes"]
        self._resolved = None if shapes is None else self.settings.replace(
            padded_shapes=shapes["padded_shapes"] if self.settings.padded_shapes is not None else None,
            max_batch_size=shapes["max_batch_size"])


class StreamLoader(torch.utils.data.DataLoader):
    """``DataLoader(batches, batch_size=None, num_workers=0)`` whose ``state_dict`` Lightning saves in a checkpoint.

    Under ``Trainer.fit`` (pass ``trainer=self.trainer`` from a ``train_dataloader`` hook) the state is taken at the
    micro-batches the fit loop counts as done (:func:`~lit_balance.data.fit_loop.fit_batches_consumed`), not at those
    the loader prefetched; Lightning restores it with ``load_state_dict`` before the loader is iterated again.

    Args:
        batches: the :class:`StreamBatches` of this rank.
        trainer: the ``Trainer`` that fits with this loader, or None (the state counts every micro-batch yielded).

    Example:
        >>> from lit_balance import BatchingSettings
        >>> corpus = StreamCorpus(lambda: ([3] * n for n in (3, 5, 2)))
        >>> loader = StreamLoader(StreamBatches(corpus, BatchingSettings(max_tokens=8), window_documents=2,
        ...                                     num_replicas=1, rank=0))
        >>> sum(len(b["indices"]) for b in loader), loader.state_dict()["finished"]
        (3, True)
    """

    def __init__(self, batches: StreamBatches, trainer: Any = None) -> None:
        if not isinstance(batches, StreamBatches):
            raise InputTypeError(f"StreamLoader takes a StreamBatches, got {type(batches).__name__}",
                                 parameter="batches")
        super().__init__(batches, batch_size=None, num_workers=0)
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        from lit_balance.data.fit_loop import fit_batches_consumed

        return self.dataset.state_dict(micro_batches=fit_batches_consumed(self.trainer))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
