"""BalancedBatchSampler: token-budgeted, rank-balanced micro-batches for DDP."""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from lit_balance._checks import MAX_TOKENS_LIMIT, MIN_RANK_SPEED_RATIO, check_int, check_lengths, check_speeds
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.plan.cost import CostModelProtocol, check_cost_model
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.plan.settings import TOO_LONG_POLICIES, BatchingSettings, delegate_settings
from lit_balance.plan.types import EpochPlan, MicroBatch, PieceMicroBatch
from lit_balance.plan.windows import PlanWindows, WindowedPlan
from lit_balance.sampler import state as sampler_state  # the resume state: build, parse, replay
from lit_balance.sampler.inputs import PlanInputs
from lit_balance.sampler.plans import plans_for
from lit_balance.sampler.state import STATE_VERSION, ReplayRecord
from lit_balance.world import check_defaulted_world, resolve_world

__all__ = ["MAX_TOKENS_LIMIT", "MIN_RANK_SPEED_RATIO", "ONE_CORPUS", "STATE_VERSION", "TOO_LONG_POLICIES",
           "BalancedBatchSampler", "MicroBatch"]

#: The blend a sampler of one corpus plans: one component, ``"train"``, that holds every sample.
ONE_CORPUS = MixtureSettings(("train",), (1.0,))


@delegate_settings
class BalancedBatchSampler(DistributedSampler):
    """Token-budgeted micro-batches of equal cost, the same count on every rank, resumable mid-epoch.

    Yields, for this ``rank``, one micro-batch (a :class:`MicroBatch`, i.e. ``list[int]`` of dataset
    indices) per micro-step. Under Lightning, build the loader with :func:`~lit_balance.balanced_dataloader`
    (any map-style dataset of dicts, through :class:`~lit_balance.MicroBatchDataset`): it is
    ``DataLoader(dataset, sampler=sampler, batch_size=None)`` over a dataset indexed by a whole micro-batch, so
    that Lightning neither replaces the sampler nor forgets ``set_epoch`` whatever ``use_distributed_sampler``;
    outside Lightning ``DataLoader(dataset, batch_sampler=sampler)`` works too. It subclasses
    :class:`~torch.utils.data.distributed.DistributedSampler`
    because it already shards the data over ranks, which is how Lightning and Fabric recognise such a
    sampler; it calls none of the parent's code.

    Guarantees, per epoch:

    * **Budget.** Every micro-batch ``b`` has ``len(b) * padded(max(lengths[b])) <= max_tokens`` (per-rank budgets:
      ``max_tokens[r]`` of the rank ``r`` that runs it), where
      ``padded`` rounds up to a multiple of ``pad_to_multiple_of``; ``max_tokens`` counts padded slots. With
      ``packing=True`` a micro-batch is one row of whole documents: ``padded(sum(lengths[b])) <= max_tokens``
      (see :mod:`lit_balance.plan.packed`).
    * **Equal counts.** Every rank yields exactly ``len(self)`` micro-batches.
    * **Balanced cost.** The ``num_replicas * accumulate_grad_batches`` micro-batches of each optimizer step
      are formed to about the same cost (``cost_model``) and spread so that every rank's summed cost per
      optimizer step is about equal (or proportional to ``rank_speeds``).
    * **Nothing lost.** With ``drop_last=False`` every eligible index appears on some rank; duplicates
      (fill rows, marked in :attr:`MicroBatch.is_fill`) appear only when there are fewer samples than
      micro-batches needed, at most ``num_replicas - 1`` per epoch (per window, for an epoch planned in windows of
      ``plan_window`` samples). With ``drop_last=True`` there are no
      duplicates and only the samples that cannot be placed are dropped (:attr:`num_dropped`).
    * **Determinism.** The plan depends only on (lengths, settings, epoch, cost model, speeds), never on
      global RNG state or the process; every rank computes the same global plan and keeps its own column.
    * **Exact resume.** :meth:`state_dict` / :meth:`load_state_dict` continue an epoch where it stopped,
      also on a different number of ranks.

    See :mod:`lit_balance.plan.padded` for how the plan is made and the algorithms it follows.

    Args:
        lengths: 1-D sequence, array or tensor of ints ``[num_samples]``: tokens per sample.
        max_tokens: padded token slots per micro-batch (rows x longest padded row), per rank: a hard cap. One int
            for every rank, or a list of one int per data-parallel rank (``max_tokens[r]`` bounds rank ``r``'s
            micro-batches; :mod:`lit_balance.plan.budgets`). Shorthand for ``settings.max_tokens``; required unless
            ``settings`` is given.
        settings: the :class:`~lit_balance.BatchingSettings` of the plan (budget, shuffle, seed, drop_last,
            too_long, pad_to_multiple_of, max_batch_size, shuffle_window, accumulate_grad_batches,
            largest_first, packing). Without it, the keyword arguments ``**settings_kwargs`` (the same names) build it;
            with it, keywords may only repeat its values. ``too_long="truncate"`` keeps a too-long sample at
            :attr:`truncate_to` tokens (the collator must truncate it too); ``too_long="skip"`` leaves it out
            (:attr:`num_skipped`). ``accumulate_grad_batches`` should be the Trainer's value: each yielded
            micro-batch then also carries its optimizer step's global real tokens and rows.
        num_replicas: number of data-parallel ranks; defaults to the size of ``process_group``, else of the
            initialised default process group, else 1. Under Lightning, build the sampler in ``setup()`` or
            ``train_dataloader()`` and pass ``**self.trainer.distributed_sampler_kwargs`` (the data-parallel
            ``num_replicas`` and ``rank``; :func:`lit_balance.world.data_parallel_world` checks them) or use
            :class:`~lit_balance.BalancedTextDataModule`: a sampler built before the process group exists (in a
            DataModule's ``__init__``) cannot know its world. Left to the default then, it raises when the
            environment says the run is distributed (``WORLD_SIZE``, ``srun``'s ``SLURM_STEP_NUM_TASKS``,
            ``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE`` above 1), and at the first ``next()`` when the process
            group initialised since has another world size or rank. Explicit values are never checked.
        rank: this process's data-parallel rank in ``[0, num_replicas)``; defaults to its rank in ``process_group``,
            else in the default process group, else 0. Processes that hold one replica (tensor-parallel peers) pass
            the same rank and get the same micro-batches.
        process_group: the ``torch.distributed`` process group of the data-parallel ranks this process belongs to
            (``mesh["dp"].get_group()`` of a device mesh; ``data_parallel_world(mesh=...).process_group``), whose size
            and rank are the defaults of ``num_replicas`` and ``rank`` (then checked to agree with them); for a loop
            without Lightning whose processes are not all data-parallel ranks. Not kept.
        cost_model: cost of a micro-batch (:class:`~lit_balance.plan.cost.CostModel`); default: padded tokens.
        rank_speeds: ``[num_replicas]`` relative throughput of each rank (e.g. ``[1.0, 0.67]`` when rank 1
            is 1.5x slower), or None for equal ranks. With equal ranks the number of micro-batches per epoch
            depends only on the lengths and settings (never on the epoch or the cost model); unequal speeds
            can need more (the fast ranks' larger shares must stay within ``max_tokens``), so under
            Lightning reload the train dataloader every epoch (``reload_dataloaders_every_n_epochs=1``). A speed
            below :data:`MIN_RANK_SPEED_RATIO` (a millionth) of the fastest is planned at that ratio, where the
            rank already gets the least share, one row per micro-batch.
        supervised_lengths: ``[num_samples]`` next-token targets of each sample as planned (after the
            sampler's own truncation with ``too_long="truncate"``), for samples whose labels mask tokens (a
            prompt's tokens carry ``-100``): labels ``1 .. length-1`` that are not ``-100``, as
            :func:`lit_balance.lightning.loss.token_loss_sum` counts after the shift
            (:meth:`lit_balance.TokenDataset.supervised_lengths`). Each yielded micro-batch then carries their
            sum over its optimizer step (all ranks) as ``step_supervised_tokens``, the exact plan divisor of
            :class:`lit_balance.lightning.loss.StepTokenLoss`. None (the default): every token but a row's first is a
            target, ``lengths - 1``. Does not change the plan.
        max_length_schedule: a length warm-up that loses no tokens (:mod:`lit_balance.plan.warmup`): the longest row
            per optimizer step of the run, a :class:`~lit_balance.Schedule` in steps (a linear one rounded down to
            whole tokens) or what :meth:`Schedule.of <lit_balance.Schedule.of>` reads (an int, ``[[step, length],
            ...]``). A document longer than its step's value is trained as pieces of at most that many tokens, each a
            row of its own: the sampler then yields :class:`~lit_balance.plan.types.PieceMicroBatch` es (document
            indices with ``piece_start`` and ``piece_length``; read them with :class:`~lit_balance.PieceDataset`),
            :meth:`plan`'s rows are pieces, and the state saves the schedule. Every token of every document once per
            epoch; the budget, equal counts and resume (on any number of ranks, at an optimizer step's end) hold as
            without it. Not with ``drop_last``, ``too_long`` other than ``"error"``, static shapes, masked labels or
            rank speeds. None (the default): whole documents.
        **settings_kwargs: settings by name (``shuffle=False``, ``seed=3``, ...), as for ``settings``.

    Attributes:
        settings: the :class:`~lit_balance.BatchingSettings` in force; its fields are also readable as
            attributes of the sampler (``sampler.max_tokens``, ``sampler.shuffle``, ...; read-only).

    Raises:
        ValueError: ``lengths`` empty, not 1-D, not integers, or with a value < 1; ``max_tokens < 1``;
            ``rank`` outside ``[0, num_replicas)``; per-rank ``max_tokens`` of another length than
            ``num_replicas``, or with a budget below every sample; unknown ``too_long``; a length or ``max_tokens``
            above
            :data:`MAX_TOKENS_LIMIT`; a negative ``seed``; a too-long sample with
            ``too_long="error"`` (naming its index, length and ``max_tokens``); ``pad_to_multiple_of`` above
            ``max_tokens``; ``shuffle_window`` negative or not finite; ``rank_speeds`` of the wrong length or
            not positive; no sample left to plan; a keyword that disagrees with ``settings``.
        TypeError: an argument of the wrong type (e.g. ``shuffle="false"``), an unknown keyword argument.
        RuntimeError: ``num_replicas`` or ``rank`` left to the default in a distributed environment before the
            process group is initialised (and, at iteration, defaults that disagree with the process group).

    Example:
        >>> sampler = BalancedBatchSampler([95] * 5 + [20] * 5, max_tokens=100, num_replicas=2, rank=0,
        ...                                shuffle=False)
        >>> len(sampler), list(sampler)
        (3, [[5, 6, 7, 8, 9], [1], [3]])
        >>> settings = BatchingSettings(max_tokens=100, shuffle=False)  # the same plan, rank 1's column
        >>> list(BalancedBatchSampler([95] * 5 + [20] * 5, settings=settings, num_replicas=2, rank=1))
        [[0], [2], [4]]
    """

    #: The mixture's weights per optimizer step (:class:`~lit_balance.Schedule`, set by a mixture sampler given
    #: ``weights_schedule``), or None: fixed weights, or one corpus.
    _weights_schedule: Any = None

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int | None = None,
        *,
        settings: BatchingSettings | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        process_group: Any = None,
        cost_model: CostModelProtocol | None = None,
        rank_speeds: Sequence[float] | None = None,
        supervised_lengths: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        max_length_schedule: Any = None,
        **settings_kwargs: Any,
    ) -> None:
        self._plans = plans_for(max_length_schedule)  # whole samples, or pieces under a length warm-up
        lengths = check_lengths(lengths, keep_dtype=True)  # the lengths' own errors first, before any setting
        if max_tokens is not None or settings is None:
            settings_kwargs["max_tokens"] = max_tokens
        settings = BatchingSettings.build(settings, settings_kwargs, owner="BalancedBatchSampler")
        # Defaults come from the process group; which of them did is checked again at the first next().
        self._world_defaults = (num_replicas is None, rank is None) if process_group is None else (False, False)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank, process_group, owner="BalancedBatchSampler")
        cost_model = check_cost_model(cost_model)
        speeds = check_speeds(rank_speeds, self.num_replicas)
        settings.rank_max_tokens(self.num_replicas)  # per-rank budgets: one per rank
        self.dataset = None  # DistributedSampler attribute; this sampler works on lengths only
        self._inputs = self._build_inputs(lengths, settings, supervised_lengths)
        #: Longest length (tokens) that fits the budget once padded: max_tokens rounded down to the multiple.
        self.truncate_to = settings.truncate_to
        self._record = ReplayRecord(epoch=0, segments=(), cost_model=cost_model, rank_speeds=speeds)
        self._cursor = 0  # micro-steps of the current plan yielded by the latest iterator
        # A restored position is for the next pass that starts reading; later passes run the whole epoch.
        self._resume_pending = False
        self._replayed: tuple[tuple, sampler_state.Replay] | None = None  # (record key, replay) of the last plan
        self._reported_length: int | None = None  # what len() last told a consumer (a training loop fixes it)
        self._length_at_iter: int | None = None
        self._warned_length = False
        self._pass: _Pass | None = None  # the pass now running (or the latest), and who reads it
        self._reader: Any = None  # the BalancedDataLoader that iterates this sampler, a weak reference (see _read_by)
        self._warned_ahead = False
        self._skip_request: tuple | None = None  # (epoch, ranges, first_optimizer_step) given to skip_steps
        # (steps, epoch): the current epoch's first step is steps plus whole plans of the epochs from that one; or None
        self._first_step_lazy: tuple | None = None
        if not self._has_micro_steps():
            raise InputValueError(
                f"drop_last=True with {self._inputs.num_samples - self.num_skipped} sample(s) and "
                f"num_replicas={self.num_replicas} leaves no micro-batch for any rank; set drop_last=False",
                parameter="drop_last")

    def _build_inputs(self, lengths: np.ndarray, settings: BatchingSettings, supervised_lengths: Any) -> PlanInputs:
        """The inputs every plan of this sampler is made from (a subclass may plan otherwise)."""
        return self._plans.inputs(lengths, settings, supervised_lengths, self.num_replicas)

    # -- what the plans are made of ------------------------------------------------------------------
    @property
    def mixture(self) -> MixtureSettings:
        """The blend of named components this sampler plans (:class:`~lit_balance.plan.mixture.MixtureSettings`): one
        corpus is a blend of one, :data:`ONE_CORPUS`; a :class:`~lit_balance.sampler.mixture.MixtureBatchSampler`'s
        is its mixture."""
        return ONE_CORPUS

    @property
    def num_components(self) -> int:
        """Components of :attr:`mixture` (1 for one corpus)."""
        return len(self.mixture.names)

    def component_of(self, indices: Any) -> np.ndarray:
        """int64 ``[len(indices)]``: the component (position in ``mixture.names``) of each sample index; 0 for every
        sample of one corpus."""
        return np.zeros(np.asarray(indices).shape[0], dtype=np.int64)

    def step_targets(self, epoch: int | None = None) -> np.ndarray | None:
        """float64 ``[optimizer steps, num_components]``: each step's scheduled shares under a weight schedule
        (:class:`~lit_balance.sampler.mixture.MixtureBatchSampler`); None for fixed weights, as here."""
        return None

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(component, document, copy)``, int64 ``[len(indices)]`` each: the component (position in
        ``mixture.names``) of each sample index, the document's index in that component, and which read of the
        document in the epoch's sample space it is (0 for the first; a mixture with ``max_repetition`` above 1 reads a
        document again as another sample). One corpus: ``(0, index, 0)``."""
        indices = np.asarray(indices, dtype=np.int64)
        zeros = np.zeros(indices.shape[0], dtype=np.int64)
        return zeros, indices, zeros.copy()

    @property
    def settings(self) -> BatchingSettings:
        """The :class:`~lit_balance.BatchingSettings` in force."""
        return self._inputs.settings

    @property
    def lengths(self) -> np.ndarray:
        """int ``[num_samples]``: tokens per sample as planned (after truncation); int64, or the dtype passed in (not
        copied) when the epoch is planned in windows."""
        return self._inputs.lengths

    @property
    def lengths_sha256(self) -> str:
        """sha256 (hex) of :attr:`lengths` as little-endian int64: what a resume state is checked against."""
        return self._inputs.lengths_sha256

    @property
    def supervised_lengths(self) -> np.ndarray | None:
        """int64 ``[num_samples]`` next-token targets per sample as planned, or None (``lengths - 1``)."""
        return self._inputs.supervised_lengths

    @property
    def windows(self) -> PlanWindows | None:
        """The windows an epoch is planned in (:mod:`lit_balance.plan.windows`), or None when it is planned whole."""
        return self._inputs.windows

    @property
    def skipped_indices(self) -> np.ndarray:
        """int64 indices of samples left out by ``too_long="skip"`` (every epoch)."""
        return self._inputs.skipped_indices

    @property
    def epoch(self) -> int:
        """The current epoch (see :meth:`set_epoch`)."""
        return self._record.epoch

    @property
    def cost_model(self) -> CostModelProtocol:
        """Cost model of the current epoch's plan (see :meth:`set_cost_model`)."""
        return self._record.cost_model

    @property
    def rank_speeds(self) -> np.ndarray | None:
        """float64 ``[num_replicas]`` relative rank speeds of the current epoch's plan (fastest 1.0), or None."""
        return self._record.rank_speeds

    def _replay(self, epoch: int | None = None) -> sampler_state.Replay:
        """The current segment's plan of ``epoch`` (default: the current one) and what ran before it, cached."""
        record = self._record
        if epoch is not None and epoch != record.epoch:
            record = ReplayRecord(epoch=epoch, segments=(), cost_model=record.cost_model,
                                  rank_speeds=record.rank_speeds)
        key = record.key()
        if self._replayed is None or self._replayed[0] != key:
            self._replayed = (key, self._plans.replay(self._inputs, record, self.num_replicas))
        return self._replayed[1]

    def _segment(self, epoch: int | None = None) -> EpochPlan | WindowedPlan:
        """The plan the current segment of ``epoch`` runs: an :class:`EpochPlan`, or a lazy :class:`WindowedPlan`."""
        epoch = None if epoch is None else check_int("epoch", epoch, 0, "epochs count from 0")
        return self._replay(epoch).plan

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Return the global plan (all ranks) of ``epoch`` (default: the current epoch).

        After :meth:`load_state_dict` with a different ``num_replicas``, the current epoch's plan is the
        plan of the samples the saved run had not yet consumed, over the new ranks. An epoch planned in windows
        (more than ``plan_window`` samples) is planned whole here, every window at once: iterating plans one
        window at a time instead.
        """
        segment = self._segment(epoch)
        return segment.materialise() if isinstance(segment, WindowedPlan) else segment

    def plan_pieces(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Under a length warm-up (``max_length_schedule``), ``(doc, start, length)``, int64 ``[num_pieces]`` each: row
        ``p`` of :meth:`plan` (of ``epoch``, default the current one) is tokens ``[start[p], start[p] + length[p])``
        of document ``doc[p]``. None when the plan's rows are whole samples."""
        epoch = None if epoch is None else check_int("epoch", epoch, 0, "epochs count from 0")
        return self._replay(epoch).pieces

    def plan_parts(self, epoch: int | None = None) -> Iterator[EpochPlan]:
        """Yield the global plan of ``epoch`` in the parts it is made of, in the order the epoch runs them.

        One :class:`EpochPlan` per window (rows are corpus indices; micro-step ``s`` of a part is the epoch's
        micro-step ``s`` plus the micro-steps of the parts before it), each planned when the generator reaches it
        and then let go, so memory stays that of one window; one part, :meth:`plan`, when the epoch is planned whole.
        """
        segment = self._segment(epoch)
        if not isinstance(segment, WindowedPlan):
            yield segment
            return
        for position in range(segment.order.shape[0]):
            yield segment.window(position).plan
            segment.release_before(segment.start(position + 1))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to plan; with ``shuffle=True`` each epoch has its own composition and order.

        Moving to another epoch starts it from its first micro-batch and applies a cost model or rank speeds
        handed over by :meth:`set_cost_model`; setting the current epoch again changes nothing (so a resumed
        epoch keeps its position).

        Raises:
            ValueError: ``epoch`` is negative.
        """
        epoch = check_int("epoch", epoch, 0, "epochs count from 0")
        if epoch == self.epoch:
            return
        self._skip_request = None  # given for the resume of another epoch
        self._cursor = 0
        self._resume_pending = False
        self._pass = None  # what the last pass handed out was of the previous epoch
        if epoch == self.epoch + 1 and (self._record.segments or self._record.pending is not None):
            # the next epoch after a resume or with pending speeds: the current plan is at hand
            first_step = self._resolve_first_step()
            if first_step is not None:
                first_step += sampler_state.epoch_optimizer_steps(
                    self._record.earlier + self._segment().num_micro_steps, self.settings.accumulate_grad_batches)
            lazy = None
        else:  # counted when asked: whole plans of the epochs before it, from the current one's end or from 0
            lazy, first_step = (0, 0), None
            if epoch > self.epoch:
                lazy = (self._resolve_first_step(), self.epoch)
                if self._record.segments and lazy[0] is not None:  # a resumed epoch: its steps as it runs
                    lazy = (lazy[0] + sampler_state.epoch_optimizer_steps(
                        self._record.earlier + self._segment().num_micro_steps, self.settings.accumulate_grad_batches),
                        self.epoch + 1)
        record = dataclasses.replace(self._record.to_epoch(epoch), first_step=first_step)
        self._record, self._first_step_lazy = record, lazy
        if record.run_skips and record.replace:  # the ranges that start in this epoch or later
            self._record = dataclasses.replace(self._record, replaced=sampler_state.epoch_replaced(
                record.run_skips, self._resolve_first_step(), self.settings.accumulate_grad_batches))
        elif record.run_skips:  # the part of the run's skipped steps in this epoch
            first_step = self._resolve_first_step()
            if first_step is not None:
                self._record = dataclasses.replace(self._record, skips=sampler_state.epoch_skips(
                    self._record.run_skips, first_step, self.settings.accumulate_grad_batches,
                    self._segment().num_micro_steps))

    def _resolve_first_step(self) -> int | None:
        """The current epoch's first optimizer step of the run, counting the whole plans of the epochs it was moved
        past by :meth:`set_epoch` (on this number of ranks) when they were not run."""
        lazy = getattr(self, "_first_step_lazy", None)
        if lazy is None:
            return self._record.first_step
        first_step, start = lazy
        if first_step is not None:
            for e in range(start, self.epoch):
                first_step += sampler_state.epoch_optimizer_steps(self._planned_micro_steps(e),
                                                                  self.settings.accumulate_grad_batches)
        self._first_step_lazy = None
        self._record = dataclasses.replace(self._record, first_step=first_step)
        return first_step

    def _planned_micro_steps(self, epoch: int) -> int:
        """Micro-steps of the whole plan of ``epoch`` on this sampler's ranks (not its current record)."""
        record = ReplayRecord(epoch=epoch, segments=(), cost_model=self._record.cost_model,
                              rank_speeds=self._record.rank_speeds)
        return self._plans.replay(self._inputs, record, self.num_replicas).plan.num_micro_steps

    @property
    def first_optimizer_step(self) -> int | None:
        """Optimizer steps of the run before the current epoch, as the ledger numbers them (skipped ones counted): the
        ``optimizer_step`` of the epoch's first step. Counted as the sampler moves through epochs (:meth:`set_epoch`)
        and saved in :meth:`state_dict`; moving to an earlier epoch counts whole plans of the epochs before it on this
        number of ranks. None when unknown (a state saved in a later epoch before this was kept)."""
        return self._resolve_first_step()

    def set_cost_model(self, cost_model: CostModelProtocol, rank_speeds: Sequence[float] | None = None) -> None:
        """Hand over a (measured) cost model and per-rank relative speeds for the NEXT epoch's plan.

        The current epoch's plan never changes mid-epoch, so resume stays exact; the new values apply at the
        next :meth:`set_epoch` to another epoch and are saved by :meth:`state_dict` meanwhile. Call it with the
        same values on every rank (e.g. from timings gathered over all ranks). A new cost model keeps the epoch
        length; unequal ``rank_speeds`` can lengthen it (see the class docstring).

        Args:
            cost_model: the cost of a micro-batch, e.g. :meth:`CostModel.fit` of measured seconds.
            rank_speeds: ``[num_replicas]`` relative throughput per rank, or None for equal ranks; any positive
                finite values (those below :data:`MIN_RANK_SPEED_RATIO` of the fastest are planned at that ratio).

        Raises:
            TypeError: ``cost_model`` is not a cost model (:class:`~lit_balance.plan.CostModelProtocol`).
            ValueError: ``rank_speeds`` of the wrong length or not all positive.
        """
        if cost_model is None:
            raise InputTypeError("set_cost_model needs a cost model (e.g. a fitted lit_balance.CostModel), got None",
                                 parameter="cost_model")
        pending = (check_cost_model(cost_model), check_speeds(rank_speeds, self.num_replicas))
        self._record = dataclasses.replace(self._record, pending=pending)

    def _offset(self) -> int:
        """Micro-steps of the current plan already consumed before this sampler was restored."""
        return self._record.offset

    def __len__(self) -> int:
        """Micro-batches this rank yields in the current epoch (the same on every rank).

        After a resume this counts the micro-batches consumed before the checkpoint too, so that a training
        loop that counts batches from the start of the epoch ends it at the right place. A training loop that
        reads it before :meth:`set_epoch` (Lightning does, when it loads the train dataloader) gets the previous
        epoch's length; when the epoch that then runs is longer than the length reported before the pass began
        (rank speeds from :meth:`set_cost_model`), its first ``next()`` warns once, naming the fix. An epoch planned in
        windows counts, at the first read, the windows not counted yet (:class:`~lit_balance.plan.windows.WindowedPlan`:
        the first micro-batch needs only the first window's count).
        """
        length = self._epoch_length()
        self._reported_length = length
        return length

    def _has_micro_steps(self) -> bool:
        """Whether the current epoch has a micro-step to train; an epoch planned in windows counts its windows only
        until one has (the first, unless ``drop_last`` empties it)."""
        segment = self._segment()
        if isinstance(segment, WindowedPlan) and not self._record.skips and not self._record.earlier:
            return segment.has_micro_steps()
        return self._epoch_length() > 0

    def _epoch_length(self) -> int:
        """Micro-steps this rank trains in the current epoch: the plan's, less the skipped ones."""
        return sampler_state.trained_micro_step(self._record.skips,
                                                self._record.earlier + self._segment().num_micro_steps)

    def _skipped_mask(self, first: int, count: int) -> np.ndarray:
        """bool ``[count]``: whether each epoch micro-step ``first .. first + count - 1`` of the plan is skipped."""
        mask = np.zeros(count, dtype=bool)
        for a, b in self._record.skips:
            mask[max(a - first, 0):max(b - first, 0)] = True
        return mask

    @property
    def skip_micro_steps(self) -> tuple[tuple[int, int], ...]:
        """``((first, end), ...)``: the current epoch's skipped micro-steps (:meth:`skip_steps`), as epoch micro-steps
        of the plan (``[first, end)``, sorted); empty when nothing is skipped."""
        return self._record.skips

    @property
    def replaced_micro_steps(self) -> tuple[tuple[int, int], ...]:
        """``((first, end), ...)``: with ``skip_steps(..., replace=True)``, the ranges replaced in the current epoch as
        epoch micro-steps (``[first, end)``, sorted): at ``first`` the documents of ``end - first`` micro-steps were
        taken out and the rest of the epoch planned again; empty otherwise."""
        end = self._record.earlier + self._segment().num_micro_steps
        return tuple((a, b) for a, b in self._record.replaced if a < end)

    @property
    def first_plan_micro_step(self) -> int:
        """Epoch micro-step of the plan (skipped ones counted) at which this world size's plan starts: as
        :attr:`first_micro_step`, which does not count skipped micro-steps."""
        return self._record.earlier

    def skip_steps(self, skip_steps: Sequence[Sequence[int]], *, first_optimizer_step: int | None = None,
                   replace: bool = False) -> None:
        """Leave out the documents of optimizer steps ``[a, b)`` of the run: the sampler consumes their micro-batches
        without yielding them, so every later step trains exactly what the plan has there.

        Steps are counted over the run from the start of training, as the ledger's ``optimizer_step`` numbers them
        (:mod:`lit_balance.ledger`): the epoch's optimizer step ``k`` (micro-steps ``k * accumulate_grad_batches`` to
        ``(k + 1) * accumulate_grad_batches - 1`` of the plan, on every rank) is step ``first_optimizer_step + k`` of
        the run. Ranges are inclusive-exclusive and may lie in any epoch: the current one, a later one (applied when
        :meth:`set_epoch` reaches it), or across an epoch's end (its steps in each epoch). The skipped micro-steps are
        not yielded, so a training loop's counts (Lightning's ``batch_idx`` and ``global_step``, :meth:`__len__`,
        ``batches_consumed``) do not count them: the ``global_step`` after a skip is the plan's step less the steps
        skipped. The ranges are saved in :meth:`state_dict` and hold on any later resume, on any number of ranks;
        giving a saved range again is allowed. Call it before iterating (after :meth:`load_state_dict` or before: a
        later :meth:`load_state_dict` of the same epoch applies them again to its position, as a training loop that
        restores the sampler through its loader does).

        Args:
            skip_steps: ``[(a, b), ...]`` ints, ``0 <= a < b``, disjoint: optimizer steps ``a .. b - 1`` of the run.
            first_optimizer_step: optimizer steps of the run before the current epoch; default
                :attr:`first_optimizer_step`, which the sampler counts.
            replace: the next documents take the skipped steps' places: at a range's first step ``a`` the documents
                steps ``a .. b - 1`` would train (as the run numbers its steps then) are taken out and the rest of the
                epoch is planned again over what is left (on the ranks running then; a mixture keeps its shares), so
                the run's optimizer steps have no gap: step ``a`` trains what the re-planned rest starts with and the
                epoch ends earlier. The same value for every range of the run (saved in :meth:`state_dict`). Each
                range must end in the epoch it starts in (as planned when it is given; where a later restart on
                other ranks ends the epoch earlier, the range takes out the rest of the epoch only); not with an epoch
                planned in windows (``plan_window``) or a mixture's weight schedule.

        Raises:
            TypeError: ``skip_steps`` not a list of pairs of ints.
            ValueError: a range reversed or empty, negative, overlapping another (given or saved), or starting before
                the position the sampler resumes at (a range in the past of the checkpoint), naming the range and the
                resume step; the run's steps before the epoch unknown and ``first_optimizer_step`` not given; with
                ``replace=True``: a range that runs past its epoch's end, an epoch planned in windows, a weight
                schedule, or saved ranges of the other ``replace``.

        Example:
            >>> s = BalancedBatchSampler([10] * 16, max_tokens=20, num_replicas=2, rank=0, shuffle=False)
            >>> list(s)
            [[0, 1], [4, 5], [8, 9], [12, 13]]
            >>> s.skip_steps([(1, 3)])  # optimizer steps 1 and 2 are not trained
            >>> len(s), list(s)
            (2, [[0, 1], [12, 13]])
        """
        if not isinstance(replace, (bool, np.bool_)):
            raise InputTypeError(f"skip_steps replace must be True or False, got {replace!r} of type "
                                 f"{type(replace).__name__}", parameter="replace")
        replace = bool(replace)
        if replace and self.windows is not None:
            raise InputValueError(
                f"skip_steps with replace=True cannot re-plan an epoch planned in windows: plan_window="
                f"{self.settings.plan_window} is below the {self._inputs.num_samples} samples; raise plan_window to at "
                "least the number of samples, or pass replace=False", parameter="replace")
        if replace and not self._plans.replaces_skipped_steps:
            raise InputValueError(
                "skip_steps with replace=True cannot re-plan the pieces of a length warm-up (max_length_schedule); "
                "pass replace=False or leave max_length_schedule unset", parameter="replace")
        if replace and self._weights_schedule is not None:
            raise InputValueError(
                "skip_steps with replace=True is not supported with a mixture's weights_schedule (the re-planned rest "
                "would need the schedule's shares from the range on); pass replace=False or fixed weights",
                parameter="replace")
        acc = self.settings.accumulate_grad_batches
        if first_optimizer_step is None:
            first = self._resolve_first_step()
            if first is None:
                raise InputValueError(
                    f"skip_steps counts optimizer steps of the run, but this sampler does not know how many ran before "
                    f"epoch {self.epoch} (its state was saved without them); pass first_optimizer_step",
                    parameter="skip_steps")
        else:
            first = check_int("first_optimizer_step", first_optimizer_step, 0, "optimizer steps before the epoch")
        ranges = sampler_state.check_skip_steps(skip_steps)
        end = self._record.earlier + self._segment().num_micro_steps
        position = self._record.earlier + self._offset()
        resume_step = first + -(-position // acc)
        saved = set(self._record.run_skips) if first == self._resolve_first_step() else set()
        merged = set(saved)
        for a, b in ranges:
            if (a, b) in saved:  # given again: already part of the saved state
                continue
            if a < resume_step:
                raise InputValueError(
                    f"skip_steps range ({a}, {b}) starts in the past of the checkpoint: the run resumes at optimizer "
                    f"step {resume_step}, so steps before it have trained already; give ranges that start at step "
                    f"{resume_step} or later", parameter="skip_steps")
            merged.add((a, b))
        ordered = tuple(sorted(merged))
        for (a0, b0), (a1, b1) in zip(ordered, ordered[1:]):
            if a1 < b0:
                raise InputValueError(
                    f"skip_steps ranges overlap: optimizer steps [{a0}, {b0}) and [{a1}, {b1}) of the run, one given "
                    "or saved in the checkpoint; give disjoint ranges", parameter="skip_steps")
        if saved and self._record.replace != replace:
            raise InputValueError(
                f"skip_steps replace={replace}, but the checkpoint's ranges {sorted(saved)} were saved with "
                f"replace={self._record.replace}; a run skips all its ranges one way: pass "
                f"replace={self._record.replace}", parameter="replace")
        if replace:
            before = (self._record, self._replayed)
            self._record = dataclasses.replace(self._record, run_skips=ordered, first_step=first, skips=(),
                                               replace=True,
                                               replaced=sampler_state.epoch_replaced(ordered, first, acc))
            try:  # the re-planned epoch now, so a range past the epoch's end is refused before anything runs
                given = [r for r in ranges if r not in saved]  # a saved range was checked when it was given
                sampler_state.replay(self._inputs, self._record, self.num_replicas,
                                     strict=set(sampler_state.epoch_replaced(tuple(given), first, acc)))
            except Exception:
                self._record, self._replayed = before
                raise
        else:
            self._record = dataclasses.replace(self._record, run_skips=ordered, first_step=first,
                                               skips=sampler_state.epoch_skips(ordered, first, acc, end))
        self._skip_request = (self.epoch, tuple(ranges), first_optimizer_step, replace)

    def _check_length(self) -> None:
        """Warn (once) when the epoch about to run is longer than the ``len()`` reported before this pass began."""
        reported = getattr(self, "_length_at_iter", None)
        if reported is None or getattr(self, "_warned_length", False):  # no length to compare: nothing is counted
            return
        length = self._epoch_length()
        if length <= reported:
            return
        self._warned_length = True
        warnings.warn(
            f"BalancedBatchSampler: epoch {self.epoch} has {length} micro-batches on this rank, but len() reported "
            f"{reported} before this pass began, for an earlier plan (e.g. before set_epoch({self.epoch}) applied the "
            "rank speeds handed over by set_cost_model): a training loop that fixed the epoch's length from len() "
            f"(Lightning does, when it loads the train dataloader) skips the last {length - reported}. Under "
            "Lightning, pass Trainer(reload_dataloaders_every_n_epochs=1) and call "
            "sampler.set_epoch(self.trainer.current_epoch) in train_dataloader() before returning the loader, as "
            "lit_balance.BalancedTextDataModule does; "
            "CostModelFeedback(fit_speeds=False) keeps the epoch's length",
            RuntimeWarning, stacklevel=3,
        )

    def __iter__(self) -> Iterator[MicroBatch]:
        """Iterate over this rank's micro-batches of the current epoch.

        The first pass after :meth:`load_state_dict` continues from the restored position; a pass counts from
        its first ``next()``, so an iterator that never yields leaves the position to the next one. Any later
        pass over the same epoch (no :meth:`set_epoch` between) yields the whole epoch, as a fresh sampler does.
        """
        if self._record.segments and not self._resume_pending:  # an earlier pass ran from the restored position
            self._record = self._record.fresh()
        # The position moves back to the start now, so state_dict() of a fresh iterator is its start; the plan
        # is read at the first next(), after any set_epoch() (Lightning creates the iterator before it).
        self._cursor = self._offset()
        # The length a training loop fixed for this pass is the one len() told it before the pass began: Lightning
        # sets its limit when it loads the loader, and a len() it reads after iter() is capped by that limit.
        self._length_at_iter = getattr(self, "_reported_length", None)
        self._pass = _Pass(getattr(self, "_reader", None))
        return self._iterate(self._pass)

    def __getstate__(self) -> dict[str, Any]:
        """The sampler's attributes for pickling, without the loader that reads it and its pass (weak references)."""
        return {**self.__dict__, "_reader": None, "_pass": None}

    def _read_by(self, loader: Any) -> None:
        """Called by :class:`lit_balance.data.BalancedDataLoader` just before its DataLoader iterates this sampler: the
        passes that start from now on are read by ``loader`` (a weak reference), whose ``batches_consumed`` counts what
        training consumed."""
        self._reader = weakref.ref(loader)

    def _iterate(self, trace: _Pass) -> Iterator[MicroBatch]:
        self._check_world()
        self._check_length()
        if self.windows is not None:
            yield from self._iterate_windows(trace)
            return
        plan = self.plan()
        replayed = self._replay()
        column = plan.assignment[:, self.rank]
        start = self._offset()
        self._resume_pending = False
        self._cursor = start
        # per epoch micro-step (plan step s is epoch step earlier + s): totals of its Lightning window
        step_tokens, step_rows = sampler_state.window_totals(self._inputs, replayed)
        step_supervised = sampler_state.window_supervised_tokens(self._inputs, replayed, plan)
        earlier = step_tokens.shape[0] - plan.num_micro_steps
        skipped = self._skipped_mask(earlier, plan.num_micro_steps)
        for s in range(start, plan.num_micro_steps):
            if skipped[s]:  # a skipped optimizer step: consumed, never trained
                continue
            idx, fill = plan.batch(int(column[s]))
            self._cursor = s + 1
            totals = (int(step_tokens[earlier + s]), int(step_rows[earlier + s]), int(step_supervised[earlier + s]))
            if replayed.pieces is None:
                yield _SentMicroBatch(idx, fill, *totals, trace=trace)
            else:  # a length warm-up: the rows are pieces of documents
                doc, piece_start, piece_length = replayed.pieces
                yield _SentPieceMicroBatch(doc[idx], fill, step_real_tokens=totals[0], step_rows=totals[1],
                                           step_supervised_tokens=totals[2], piece_start=piece_start[idx],
                                           piece_length=piece_length[idx], trace=trace)

    def _iterate_windows(self, trace: _Pass) -> Iterator[MicroBatch]:
        """This rank's micro-batches of an epoch planned in windows: each window is planned when it is reached."""
        replayed = self._replay()
        plan, earlier_tokens, earlier_rows = replayed.plan, replayed.earlier_tokens, replayed.earlier_rows
        earlier_supervised = replayed.earlier_supervised
        start = self._offset()
        self._resume_pending = False
        self._cursor = start
        earlier, accumulate = earlier_tokens.shape[0], self.settings.accumulate_grad_batches
        # Windows are counted as they are reached (the first micro-batch needs the first window only).
        for position in range(plan.order.shape[0]):
            base, end = plan.start(position), plan.start(position + 1)
            first = max(base, start)
            if first >= end:
                continue
            skipped = self._skipped_mask(earlier + base, end - base)
            # the optimizer steps (Lightning's accumulation windows, counted in epoch micro-steps) of these steps,
            # cut at the epoch's end (step_sums stops there)
            lo = (earlier + first) // accumulate * accumulate
            hi = -(-(earlier + end) // accumulate) * accumulate
            plan.release_before(max(lo - earlier, 0))
            tokens, rows, supervised = plan.step_sums(max(lo - earlier, 0), hi - earlier)
            tokens = np.concatenate([earlier_tokens[lo:earlier], tokens])
            rows = np.concatenate([earlier_rows[lo:earlier], rows])
            supervised = np.concatenate([earlier_supervised[lo:earlier], supervised])
            cuts = np.arange(0, tokens.shape[0], accumulate)
            group_tokens = np.add.reduceat(tokens, cuts).tolist()
            group_rows = np.add.reduceat(rows, cuts).tolist()
            group_supervised = np.add.reduceat(supervised, cuts).tolist()
            held = plan.window(position).plan
            column = held.assignment[:, self.rank].tolist()
            for s in range(first, end):
                if skipped[s - base]:  # a skipped optimizer step: consumed, never trained
                    continue
                idx, fill = held.batch(column[s - base])
                g = (earlier + s - lo) // accumulate
                self._cursor = s + 1
                yield _SentMicroBatch(idx, fill, group_tokens[g], group_rows[g], group_supervised[g], trace=trace)

    def _check_world(self) -> None:
        """Raise when a defaulted ``num_replicas`` / ``rank`` disagrees with the initialised process group."""
        replicas_defaulted, rank_defaulted = getattr(self, "_world_defaults", (False, False))
        check_defaulted_world("BalancedBatchSampler", self.num_replicas, self.rank, replicas_defaulted, rank_defaulted)

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Position and plan inputs as plain Python types; the same on every rank.

        Args:
            batches_consumed: micro-batches of the current epoch consumed by training, counted from the
                start of the epoch (:attr:`start_micro_step` plus those the loop consumed in this pass); default:
                those yielded by the latest iterator. A DataLoader with workers (``num_workers > 0``) reads the
                sampler ahead of training (about ``num_workers * prefetch_factor`` micro-batches), so the default then
                counts micro-batches that were never trained: save
                :meth:`lit_balance.data.BalancedDataLoader.state_dict` instead, which counts what it handed to the
                loop, or pass the count.

        Returns:
            ``{"version", "epoch", "segments", "num_samples", "lengths_sha256", "settings", "cost_model",
            "rank_speeds", "first_rank_speeds", "pending"}``: ``segments`` is the epoch's history as ``[num_replicas,
            micro-steps consumed]`` pairs (more than one after a resume on a different number of ranks).
            Once the whole epoch is consumed, the state is the start of the next epoch. Loads with
            ``torch.load(weights_only=True)``.

        Raises:
            TypeError: ``batches_consumed`` is not an int (a bool, a float, a string), naming the value.
            ValueError: ``batches_consumed`` negative, below :attr:`first_micro_step` or beyond the epoch's
                micro-batches, naming the value and the range.
            RuntimeError: no ``batches_consumed`` while a :class:`~lit_balance.data.BalancedDataLoader` iterates this
                sampler and has handed the training loop fewer micro-batches than the sampler gave out (its workers
                read ahead): the default would skip those on resume; the message names both counts and the call to
                make instead.

        Warns:
            RuntimeWarning: once per sampler, no ``batches_consumed`` while another DataLoader sent this pass's
                micro-batches to worker processes (they read ahead of training), naming what to call instead.
        """
        earlier = self.first_micro_step
        if batches_consumed is None:
            self._check_default_count()
            return self._build_state(self._cursor)
        batches_consumed = check_int("batches_consumed", batches_consumed, 0,
                                     "pass the micro-batches of the current epoch consumed by training, counted from "
                                     "the epoch's start")
        length = self._epoch_length()
        if batches_consumed < earlier or batches_consumed > length:
            raise InputValueError(
                f"batches_consumed must be in [{earlier}, {length}] for epoch {self.epoch} (the micro-batches this "
                f"rank runs in it, counted from the epoch's start), got {batches_consumed}; pass the micro-batches "
                "training consumed, e.g. sampler.start_micro_step plus those the loop trained in this pass",
                parameter="batches_consumed")
        position = sampler_state.plan_micro_step(self._record.skips, batches_consumed)
        return self._build_state(min(position, self._record.earlier + self._segment().num_micro_steps)
                                 - self._record.earlier)

    def _check_default_count(self) -> None:
        """Refuse (or warn) when the default count of :meth:`state_dict`, the micro-batches handed out, is not what
        training consumed because a DataLoader's workers read this sampler ahead."""
        trace = getattr(self, "_pass", None)
        if trace is None:
            return
        handed = sampler_state.trained_micro_step(self._record.skips, self._record.earlier + self._cursor)
        reader = trace.reader() if trace.reader is not None else None
        if reader is not None and getattr(reader, "balanced_sampler", None) is self:
            consumed = reader.batches_consumed
            if consumed != handed:
                raise RuntimeError(
                    f"BalancedBatchSampler.state_dict() was called without batches_consumed while a "
                    f"BalancedDataLoader with num_workers={reader.num_workers} reads this sampler: the sampler has "
                    f"handed out {handed} micro-batches of epoch {self.epoch}, training has consumed {consumed}, so "
                    f"a resume from this state would skip {handed - consumed} that never trained. Save "
                    f"loader.state_dict() instead (it counts what training consumed; restore it with "
                    f"loader.load_state_dict(...)), or call sampler.state_dict(batches_consumed={consumed}).")
        elif trace.sent_to_workers and not getattr(self, "_warned_ahead", False):
            self._warned_ahead = True
            warnings.warn(
                f"BalancedBatchSampler.state_dict() was called without batches_consumed while a DataLoader's worker "
                f"processes read this sampler ahead of training: the state counts the {handed} micro-batches of "
                f"epoch {self.epoch} handed to the workers, not those the loop trained, so a resume from it skips the "
                f"ones fetched but not trained. {_SAVE_WHAT_TRAINED}",
                RuntimeWarning, stacklevel=3)

    def _build_state(self, consumed: int) -> dict[str, Any]:
        """The state with ``consumed`` micro-steps of the current plan consumed."""
        self._resolve_first_step()
        state = sampler_state.build_state(self._inputs, self._record, self.num_replicas, consumed,
                                          self._segment().num_micro_steps)
        return {**state, **self._plans.state(self._inputs, self._record, self.num_replicas, state["epoch"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next iterator yields exactly the micro-batches an
        uninterrupted run would have yielded from there on, then full later epochs.

        The restored position applies to one pass: iterating the same epoch again (without :meth:`set_epoch`)
        yields the whole epoch, as on a fresh sampler.

        Rule for a different ``num_replicas``: the rest of the saved epoch is re-planned over the new ranks
        from the samples not yet consumed (nothing lost, nothing repeated beyond marked fill rows); rank
        speeds of the old ranks are dropped (equal ranks) until the next :meth:`set_cost_model`. ``max_tokens`` must
        equal the saved one on the same number of ranks; on another number it may change (per-rank budgets: a list
        of the new length), keeping the largest budget where ``too_long`` cuts or skips samples between the two
        (:mod:`lit_balance.sampler.state`).

        Raises:
            ValueError: unknown or missing keys, another ``version``, different lengths (count or content) or
                different planning settings (naming each one with both values).
            TypeError: ``state_dict`` is not a dict.
        """
        record = sampler_state.parse_state(state_dict, self._inputs, num_replicas=self.num_replicas,
                                           cost_class=type(self.cost_model))
        consumed = record.offset
        self._plans.load_state(state_dict, record)
        plan_steps = self._plans.replay(self._inputs, record, self.num_replicas).plan.num_micro_steps
        if consumed > plan_steps:  # checked before anything changes: a state that does not fit leaves the sampler
            raise InputValueError(
                f"the saved state consumed {consumed} micro-steps of epoch {record.epoch}, but its plan has "
                f"only {plan_steps}: the state does not belong to this sampler's plan"
            )
        if record.run_skips and record.first_step is not None and not record.replace:
            end = record.earlier + plan_steps  # the part of the run's skipped steps in this epoch
            record = dataclasses.replace(record, skips=sampler_state.epoch_skips(
                record.run_skips, record.first_step, self.settings.accumulate_grad_batches, end))
        self._record, self._replayed = record, None
        self._first_step_lazy = None
        self._cursor = consumed
        self._resume_pending = True
        self._pass = None
        request = getattr(self, "_skip_request", None)
        if request is not None and request[0] == record.epoch:  # given for this resume: they hold whichever restore
            self.skip_steps(request[1], first_optimizer_step=request[2],  # (DataModule's or loader's) comes last
                            replace=request[3] if len(request) > 3 else False)

    @property
    def first_micro_step(self) -> int:
        """Micro-step of the current epoch at which this world size's plan starts (global, the same on every rank).

        0 unless the epoch was resumed on another number of ranks (:meth:`load_state_dict`): then the micro-steps
        before it ran on the old ranks, and ``len(self)`` counts them too.
        """
        return sampler_state.trained_micro_step(self._record.skips, self._record.earlier)

    @property
    def start_micro_step(self) -> int:
        """Micro-step of the current epoch (counted from its start, on every rank) at which the pass now running, or
        the next one, begins: 0, or the position restored by :meth:`load_state_dict`.

        A loop that counts the micro-batches it consumed in this pass saves ``state_dict(batches_consumed=
        sampler.start_micro_step + consumed)`` (:class:`lit_balance.data.BalancedDataLoader` does).
        """
        return sampler_state.trained_micro_step(self._record.skips, self._record.earlier + self._offset())

    def micro_step_totals(self) -> tuple[np.ndarray, np.ndarray]:
        """Real tokens and rows of every micro-step of the current epoch, summed over the ranks (global).

        Returns:
            int64 ``[len(self)]`` each: at epoch micro-step ``t`` (Lightning's ``batch_idx``), the real tokens and rows
            (fill rows excluded) of every rank's micro-batch; micro-steps before :attr:`first_micro_step` are those
            the old ranks ran. Every rank computes the same, without communication.
        """
        tokens, rows = sampler_state.micro_step_totals(self._inputs, self._replay())
        if self._record.skips:  # the skipped micro-steps are not trained: Lightning's batch_idx does not count them
            keep = ~self._skipped_mask(0, tokens.shape[0])
            tokens, rows = tokens[keep], rows[keep]
        return tokens, rows

    @property
    def num_skipped(self) -> int:
        """Samples left out every epoch by ``too_long="skip"`` (global count)."""
        return int(self.skipped_indices.size)

    @property
    def num_dropped(self) -> int:
        """Samples dropped in the current epoch by ``drop_last=True`` (global count)."""
        return int(self.plan().dropped.size)

    @property
    def num_fill_rows(self) -> int:
        """Fill rows (marked duplicates) in the current epoch over all ranks (at most ``num_replicas - 1``, per window
        for an epoch planned in windows)."""
        return int(self.plan().is_fill.sum())


_SAVE_WHAT_TRAINED = (
    "Build the loader with lit_balance.balanced_dataloader(...) and save loader.state_dict() after the steps trained "
    "(restore it with loader.load_state_dict(...)), or count the micro-batches the loop trained and call "
    "sampler.state_dict(batches_consumed=sampler.start_micro_step + trained)."
)


class _Pass:
    """One pass over a sampler: the loader that reads it (a weak reference, or None) and whether its micro-batches
    were sent to DataLoader worker processes (pickled: a loader with ``num_workers > 0`` reads ahead of training)."""

    __slots__ = ("reader", "sent_to_workers")

    def __init__(self, reader: Any = None) -> None:
        self.reader = reader
        self.sent_to_workers = False


def _rebuild(cls: type, items: list, state: dict[str, Any]) -> MicroBatch:
    """A plain micro-batch of class ``cls`` with ``items`` and attributes ``state`` (what a sent one pickles to)."""
    plain = cls.__new__(cls)
    plain.extend(items)
    plain.__dict__.update(state)
    return plain


class _SentMicroBatch(MicroBatch):
    """A micro-batch as the sampler yields it: pickling it (a DataLoader sends it to a worker process) marks its pass
    as read by workers, and it arrives there as a plain :class:`MicroBatch`; a copy is a plain one too."""

    _plain_class: type = MicroBatch

    def __init__(self, *args: Any, trace: _Pass | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trace = trace

    def _plain(self) -> MicroBatch:
        return _rebuild(self._plain_class, list(self), {k: v for k, v in self.__dict__.items() if k != "_trace"})

    def __reduce_ex__(self, protocol: Any) -> Any:
        trace = self.__dict__.get("_trace")
        if trace is not None:
            trace.sent_to_workers = True
        return _rebuild, (self._plain_class, list(self), {k: v for k, v in self.__dict__.items() if k != "_trace"})

    def __copy__(self) -> MicroBatch:
        return self._plain()

    def __deepcopy__(self, memo: dict) -> MicroBatch:
        return copy.deepcopy(self._plain(), memo)



class _SentPieceMicroBatch(_SentMicroBatch, PieceMicroBatch):
    """A :class:`~lit_balance.plan.types.PieceMicroBatch` as the sampler yields it (see :class:`_SentMicroBatch`)."""

    _plain_class = PieceMicroBatch
