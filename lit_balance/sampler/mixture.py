"""MixtureBatchSampler: the balanced sampler over a weighted mixture of components, exact in its unit at every
optimizer step (:mod:`lit_balance.plan.mixture`), resumable on any number of ranks."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.mixture import (MixtureLayout, MixtureSettings, MixturePlan, mixture_units, plan_mixture,
                                      select_epoch)
from lit_balance.plan.mixture_schedule import StepShares, check_weights_schedule
from lit_balance.plan.settings import DEFAULT_PLAN_WINDOW, BatchingSettings
from lit_balance.plan.types import EpochPlan
from lit_balance.sampler.inputs import PlanInputs
from lit_balance.sampler.sampler import BalancedBatchSampler
from lit_balance.schedule import Schedule

__all__ = ["MixtureBatchSampler"]

_SHARE_RTOL = 1e-9  # shares this close are one mixture's (weights given at another scale)


def _plan_window(kwargs: dict[str, Any]) -> int:
    """The ``plan_window`` the sampler's settings will have (``settings``' or the keyword's, else the default); a bad
    value is left for :class:`~lit_balance.BatchingSettings` to refuse (then the default here)."""
    settings = kwargs.get("settings")
    window = settings.plan_window if isinstance(settings, BatchingSettings) else kwargs.get("plan_window")
    if isinstance(window, numbers.Integral) and not isinstance(window, bool) and window >= 1:
        return int(window)
    return DEFAULT_PLAN_WINDOW


def _check_sample_space(lengths: np.ndarray, sizes: np.ndarray, mixture: MixtureSettings, supervised: Any,
                        plan_window: int) -> None:
    """Refuse, before anything is tiled or planned, a sample space (documents x ``max_repetition``) larger than
    ``plan_window``, the most samples one epoch is planned over (memory and time grow with it), naming the epoch that
    ``max_repetition`` implies: about how many documents and tokens it reads."""
    documents = int(sizes.sum())
    samples = documents * mixture.max_repetition
    if samples <= plan_window:
        return
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    units = mixture_units(mixture, lengths, None if supervised is None else np.asarray(supervised))
    totals = np.array([units[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])], dtype=np.float64)
    tokens = np.array([lengths[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])], dtype=np.float64)
    shares, reps = mixture.shares, mixture.max_repetition
    live = (shares > 0) & (totals > 0)
    epoch = ""
    if live.any():  # the epoch of select_epoch: the limiting component read max_repetition times, the rest pro rata
        length = float(mixture.units_per_epoch) if mixture.units_per_epoch is not None else \
            float(np.min(reps * totals[live] / shares[live]))
        passes = np.where(live, np.minimum(reps, shares * length / np.where(totals > 0, totals, 1)), 0.0)
        epoch = (f"; it implies an epoch of about {float(passes @ sizes):,.0f} documents and "
                 f"{float(passes @ tokens):,.0f} tokens (global)")
    raise InputValueError(
        f"max_repetition={reps} over the mixture's {documents:,} documents (components {list(mixture.names)}) makes a "
        f"sample space of {samples:,} samples, more than plan_window={plan_window:,}, the most one epoch is planned "
        f"over (a mixture plans whole epochs; memory and planning time grow with it){epoch}. Lower max_repetition to "
        f"at most {max(plan_window // max(documents, 1), 1):,}, or raise plan_window to at least {samples:,}",
        parameter="max_repetition")


@dataclass(frozen=True, eq=False)
class _MixtureInputs(PlanInputs):
    """:class:`PlanInputs` whose plans are mixture plans: a whole epoch selects its samples, the rest of an epoch
    resumed on new ranks plans exactly the chosen samples not yet consumed."""

    layout: MixtureLayout | None = None
    mixture: MixtureSettings | None = None
    schedule: Any = None  # the weight schedule (lit_balance.schedule.Schedule), or None for fixed weights
    starts: dict = field(default_factory=dict, repr=False)  # epoch -> (first step, tokens before, carry)
    # a resumed epoch: (epoch, segments ((num_replicas, micro-steps consumed), ...), the schedule it began with)
    cut: Any = None
    _chain: dict = field(default_factory=dict, repr=False)  # the cut epoch's plans per segment, once
    ends: dict = field(default_factory=dict, repr=False)  # where each whole-epoch plan ended, by its inputs

    def chosen(self, epoch: int) -> np.ndarray:
        """bool ``[num_samples]``: the samples ``epoch`` reads."""
        if self.schedule is not None:
            raise RuntimeError("a mixture with a weight schedule selects its samples while it plans the epoch")
        units = mixture_units(self.mixture, self.lengths, self.supervised_lengths)
        return select_epoch(units, self.layout, self.mixture, seed=self.settings.seed, epoch=epoch,
                            eligible=self.eligible)

    def step_shares(self, epoch: int, num_replicas: int, cost_model: CostModelProtocol) -> StepShares | None:
        """Where ``epoch`` starts in the run (its first optimizer step, the tokens before it, each component's
        carried deficit) under the weight schedule; the epochs before it are planned once to learn it (on
        ``num_replicas`` ranks), unless a resume state gave it. None without a schedule."""
        if self.schedule is None:
            return None
        if not self.starts:
            self.starts[0] = (0, 0, None)
        if epoch not in self.starts:
            e = max((k for k in self.starts if k < epoch), default=0)
            while e < epoch:
                if self.cut is not None and self.cut[0] == e:  # a resumed epoch ends where its last segment does
                    _, mp, shares = self.segments_chain(cost_model)[-1]
                else:
                    mp, shares = self.plan_whole(e, num_replicas, cost_model), self.step_shares(e, num_replicas,
                                                                                                  cost_model)
                self.starts[e + 1] = _end_of(mp, shares, self.lengths)
                e += 1
        first, tokens, carry = self.starts[epoch]
        schedule = self.cut[2] if self.cut is not None and self.cut[0] == epoch else self.schedule
        return StepShares(schedule, self.mixture.names, first, tokens, carry)

    def segments_chain(self, cost_model: CostModelProtocol) -> list[tuple[np.ndarray | None, MixturePlan,
                                                                              StepShares]]:
        """The resumed epoch (:attr:`cut`) segment by segment: ``(samples still to plan, plan, shares)`` each. The
        first segment's plan is the whole epoch under the schedule it began with; each later one plans exactly the
        samples its predecessors left, on its ranks, from the step after the cut, with the deficits at the cut and
        the current schedule."""
        epoch, segments, _ = self.cut
        if self._chain.get("key") == (epoch, segments, cost_model):
            return self._chain["value"]
        k = len(self.mixture.names)
        units = mixture_units(self.mixture, self.lengths, self.supervised_lengths)
        acc = self.settings.accumulate_grad_batches
        shares = self.step_shares(epoch, segments[0][0], cost_model)
        mp = plan_mixture(self.lengths, self.layout, self.mixture, self.settings, num_replicas=segments[0][0],
                          epoch=epoch, cost_model=cost_model, supervised_lengths=self.supervised_lengths,
                          eligible=self.eligible, step_shares=shares)
        out = [(self.eligible, mp, shares)]
        eligible = self.eligible
        for i in range(1, len(segments)):
            consumed = int(segments[i - 1][1])
            seen = np.zeros(self.num_samples, dtype=bool)
            mp.plan.mark_rows(consumed, seen)
            got = _micro_step_units(mp, units, self.layout, consumed, k)  # [consumed, k]
            step = np.arange(consumed) // acc
            asked = mp.step_targets[step] * got.sum(axis=1, keepdims=True)
            carry = shares.initial_carry + (asked - got).sum(axis=0)
            tokens = int(_micro_step_tokens(mp, self.lengths)[:consumed].sum())
            shares = StepShares(self.schedule, self.mixture.names, shares.first_step + -(-consumed // acc),
                                shares.tokens_before + tokens, tuple(float(x) for x in carry))
            eligible = (np.ones(self.num_samples, dtype=bool) if eligible is None else eligible) & ~seen
            mp = plan_mixture(self.lengths, self.layout, self.mixture, self.settings, num_replicas=segments[i][0],
                              epoch=epoch, cost_model=cost_model, supervised_lengths=self.supervised_lengths,
                              eligible=self.eligible, plan_exactly=mp.chosen & eligible, step_shares=shares)
            out.append((eligible, mp, shares))
        self._chain.clear()
        self._chain.update(key=(epoch, segments, cost_model), value=out)
        return out

    def plan_whole(self, epoch: int, num_replicas: int, cost_model: CostModelProtocol,
                   speeds: np.ndarray | None = None, settings: BatchingSettings | None = None) -> MixturePlan:
        """The mixture plan of the whole ``epoch`` (with a schedule, where it ends is kept: :meth:`ended`)."""
        shares = self.step_shares(epoch, num_replicas, cost_model)
        mp = plan_mixture(self.lengths, self.layout, self.mixture, settings or self.settings,
                          num_replicas=num_replicas, epoch=epoch, cost_model=cost_model, speeds=speeds,
                          supervised_lengths=self.supervised_lengths, eligible=self.eligible, step_shares=shares)
        if shares is not None:
            own = settings is None or settings == self.settings
            self.ends[_end_key(epoch, num_replicas, speeds, cost_model, None if own else settings)] = _end_of(
                mp, shares, self.lengths)
        return mp

    def ended(self, epoch: int, num_replicas: int, speeds: Any, cost_model: CostModelProtocol) -> tuple | None:
        """Where ``epoch`` ended as planned with these ranks, speeds and cost model (the plan the sampler ran), or
        None when it was not planned so."""
        return self.ends.get(_end_key(epoch, num_replicas, speeds, cost_model, None))

    def plan(self, epoch: int, num_replicas: int, *, eligible: np.ndarray | None, speeds: np.ndarray | None,
             cost_model: CostModelProtocol, min_steps: int = 0,
             max_tokens: int | tuple[int, ...] | None = None,
             padded_shapes: tuple[tuple[int, int], ...] | None = None) -> EpochPlan:
        settings = self.settings
        if max_tokens is not None and max_tokens != settings.max_tokens:
            settings = settings.replace(max_tokens=max_tokens)
        if padded_shapes is not None and padded_shapes != settings.padded_shapes:
            settings = settings.replace(padded_shapes=padded_shapes)
        if eligible is self.eligible:
            return self.plan_whole(epoch, num_replicas, cost_model, speeds, settings).plan
        if self.schedule is not None:  # a later segment of the resumed epoch
            if self.cut is not None and self.cut[0] == epoch:
                for remaining, mp, _ in self.segments_chain(cost_model)[1:]:
                    if np.array_equal(remaining, eligible):
                        return mp.plan
            raise RuntimeError(f"no segment of the resumed epoch {epoch} plans these samples (a bug)")
        exactly = self.chosen(epoch) & eligible
        return plan_mixture(self.lengths, self.layout, self.mixture, settings, num_replicas=num_replicas, epoch=epoch,
                            cost_model=cost_model, speeds=speeds, supervised_lengths=self.supervised_lengths,
                            eligible=self.eligible, plan_exactly=exactly).plan


def _end_key(epoch: int, num_replicas: int, speeds: Any, cost_model: Any, settings: Any) -> tuple:
    return (int(epoch), int(num_replicas), None if speeds is None else tuple(float(x) for x in speeds), cost_model,
            settings)


def _end_of(mp: MixturePlan, shares: StepShares, lengths: np.ndarray) -> tuple:
    """``(first step, tokens before, carry)`` of the epoch after the one ``mp`` plans from ``shares``."""
    return (shares.first_step + int(mp.step_units.shape[0]), shares.tokens_before + _real_tokens(mp, lengths),
            tuple(float(x) for x in mp.carry))


def _micro_step_units(mp: MixturePlan, units: np.ndarray, layout: MixtureLayout, upto: int, k: int) -> np.ndarray:
    """float64 ``[upto, k]``: each component's units (fill rows excluded) at micro-steps ``0 .. upto - 1``, all
    ranks."""
    plan = mp.plan
    out = np.zeros((upto, k))
    for t in range(upto):
        for b in plan.assignment[t]:
            rows, fill = plan.batch(int(b))
            rows = rows[~fill]
            np.add.at(out[t], layout.component_of(rows), units[rows])
    return out


def _real_tokens(mp: MixturePlan, lengths: np.ndarray) -> int:
    """Real tokens (fill rows excluded) of a mixture plan, all ranks."""
    plan = mp.plan
    return int(np.asarray(lengths)[plan.rows[~plan.is_fill]].sum())


class MixtureBatchSampler(BalancedBatchSampler):
    """A :class:`~lit_balance.BalancedBatchSampler` over a mixture: every optimizer step holds each component's share.

    Samples are the mixture's sample space (:class:`~lit_balance.plan.mixture.MixtureLayout`): the components'
    documents one after the other, repeated ``max_repetition`` times, so sample ``i`` is document ``i % N`` of the
    concatenation (``N`` documents). Each epoch reads the samples :func:`~lit_balance.plan.mixture.select_epoch`
    chooses (a new subset every epoch) and plans them step by step (:func:`~lit_balance.plan.mixture.plan_mixture`):
    every guarantee of the base class holds (budget, equal counts, determinism, exact resume, on a new number of
    ranks too), and each optimizer step is within one document of each component's share. Epochs may differ in
    length by a step or so (another subset): under Lightning reload the train dataloader every epoch
    (``reload_dataloaders_every_n_epochs=1``; :class:`~lit_balance.BalancedTextDataModule` sets the epoch there).
    A mixture plans whole epochs, never in windows: a sample space larger than ``plan_window`` is refused (raise
    ``plan_window``). Static shapes (``static_packing``, ``padded_shapes``) are chosen once over every sample, as for
    one corpus.

    Args:
        lengths: int ``[N]``: tokens per document, components concatenated in order (one copy).
        sizes: documents per component, in order.
        mixture: the :class:`~lit_balance.plan.mixture.MixtureSettings` (names, weights, unit, epoch length).
        supervised_lengths: int ``[N]`` next-token targets per document, or None.
        weights_schedule: the mixture's weights per optimizer step of the run, a
            :class:`~lit_balance.schedule.Schedule` whose values name every component (or what
            :meth:`Schedule.of <lit_balance.schedule.Schedule.of>` takes), or None for the fixed weights of
            ``mixture`` (:mod:`lit_balance.plan.mixture_schedule`; docs/schedules.md).
        **kwargs: as :class:`~lit_balance.BalancedBatchSampler` (``settings`` or its keywords, ``num_replicas``,
            ``rank``, ``cost_model``, ``rank_speeds``).

    Raises:
        ValueError: ``sizes`` that do not sum to ``len(lengths)`` or do not match the mixture's components; a sample
            space (documents x ``max_repetition``) larger than ``plan_window``, before anything is tiled or planned
            (naming the epoch ``max_repetition`` implies, in documents and tokens, and both settings); as :class:`~lit_balance.BalancedBatchSampler` and
            :func:`~lit_balance.plan.mixture.select_epoch`.

    Example:
        >>> mix = MixtureSettings(("a", "b"), (1, 1))
        >>> s = MixtureBatchSampler([10] * 4 + [20] * 2, sizes=[4, 2], mixture=mix, max_tokens=40, num_replicas=1,
        ...                         rank=0, shuffle=False)
        >>> [sorted(b) for b in s]
        [[4, 5], [0, 1, 2, 3]]
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, sizes: Sequence[int], mixture: MixtureSettings,
                 max_tokens: int | None = None, *, supervised_lengths: Any = None, weights_schedule: Any = None,
                 **kwargs: Any) -> None:
        if not isinstance(mixture, MixtureSettings):
            raise InputValueError(f"mixture must be a lit_balance.plan.mixture.MixtureSettings, got "
                                  f"{type(mixture).__name__}", parameter="mixture")
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.ndim != 1 or sizes.size != len(mixture.names) or (sizes < 0).any():
            raise InputValueError(f"sizes must give the documents of each of the {len(mixture.names)} components "
                                  f"{list(mixture.names)}, got {sizes.tolist()}", parameter="sizes")
        if int(sizes.sum()) != len(lengths):
            raise InputValueError(f"the components' sizes {sizes.tolist()} sum to {int(sizes.sum())} documents, but "
                                  f"lengths holds {len(lengths)}", parameter="sizes")
        _check_sample_space(np.asarray(lengths), sizes, mixture, supervised_lengths, _plan_window(kwargs))
        self._weights_schedule = None if weights_schedule is None else check_weights_schedule(weights_schedule,
                                                                                              mixture.names)
        self.layout = MixtureLayout(sizes, mixture.max_repetition)
        self._mixture = mixture
        lengths = self.layout.tile(np.asarray(lengths))
        if supervised_lengths is not None:
            supervised_lengths = self.layout.tile(np.asarray(supervised_lengths))
        super().__init__(lengths, max_tokens, supervised_lengths=supervised_lengths, **kwargs)

    @property
    def mixture(self) -> MixtureSettings:
        """The mixture's settings: names, weights, unit, epoch length."""
        return self._mixture

    def _build_inputs(self, lengths: np.ndarray, settings: BatchingSettings, supervised_lengths: Any) -> PlanInputs:
        base = PlanInputs.build(lengths, settings, supervised_lengths, self.num_replicas)
        # base.settings: static shapes resolved once over every sample (packing's document cap, padded_shapes=K)
        schedule = self._weights_schedule
        inputs = _MixtureInputs(np.asarray(base.lengths, dtype=np.int64), base.settings, base.eligible, None,
                                base.supervised_lengths, base.lengths_sha256, layout=self.layout, mixture=self.mixture,
                                schedule=schedule)
        if schedule is None:
            inputs.chosen(0)  # an unreachable share or an empty component is an error now, before any token is read
        else:
            _check_scheduled(inputs, schedule)
        return inputs

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`BalancedBatchSampler.set_epoch`; under a weight schedule, moving to the next epoch first keeps
        where the current one ended as this sampler planned it (its ranks, rank speeds and cost model), so the next
        epoch's steps continue the run's step count."""
        inputs = self._inputs
        if self._weights_schedule is not None and epoch == self.epoch + 1 and not (
                inputs.cut is not None and inputs.cut[0] == self.epoch):  # a resumed epoch ends as its last segment
            record = self._record
            end = inputs.ended(self.epoch, self.num_replicas, record.rank_speeds, record.cost_model)
            if end is not None and inputs.starts.get(epoch) != end:  # a preview planned otherwise gives way
                for later in [e for e in inputs.starts if e >= epoch]:
                    del inputs.starts[later]
                inputs.starts[epoch] = end
        super().set_epoch(epoch)

    @property
    def weights_schedule(self) -> Any:
        """The weight schedule (:class:`~lit_balance.schedule.Schedule`), or None for fixed weights."""
        return self._weights_schedule

    def set_weights_from(self, step: int, weights: Mapping[str, float], *, check_step: bool = True) -> Any:
        """Change the weight schedule to ``weights`` from optimizer step ``step`` of the run on (a future edit: the
        values before ``step`` are kept, :meth:`Schedule.set_from <lit_balance.Schedule.set_from>`), as a resume with
        an edited schedule would; the state saves the edited schedule.

        The edit applies to epochs not planned yet: ``step`` must be at or after the first step of the next epoch
        (:meth:`schedule_start` of ``epoch + 1``), and the epochs after the current one are planned again.
        :class:`lit_balance.callbacks.MixtureWeightsHook` calls it on every rank with the same arguments.

        Args:
            step: the run's optimizer step from which ``weights`` hold.
            weights: ``{component: weight}`` naming every component (normalised per step).
            check_step: False when restoring edits a run made before its checkpoint (the step is then in the past).

        Returns:
            The edited :class:`~lit_balance.Schedule`.

        Raises:
            ValueError: no weight schedule (fixed weights); ``step`` inside a planned epoch; weights the schedule
                refuses (another component, a negative or NaN weight, a sum of 0, a positive weight on a component with
                nothing to read).
        """
        if self._weights_schedule is None:
            raise InputValueError("set_weights_from changes a weight schedule, but this mixture has fixed weights; "
                                  "pass weights_schedule (e.g. the mixture's weights as one point) to set weights "
                                  "during training", parameter="weights_schedule")
        if check_step:
            first = self.schedule_start(self.epoch + 1)[0]
            if step < first:
                raise InputValueError(f"set_weights_from: step {step} lies in an epoch already planned; new weights "
                                      f"apply from the next epoch's first optimizer step ({first}) on",
                                      parameter="step")
        edited = check_weights_schedule(self._weights_schedule.set_from(int(step), dict(weights)), self.mixture.names)
        inputs = self._inputs
        _check_scheduled(inputs, edited)
        keep = self.epoch + 1
        if check_step:
            inputs.starts.setdefault(keep, self.schedule_start(keep))
        for later in [e for e in inputs.starts if e > (keep if check_step else -1)]:
            del inputs.starts[later]
        for key in [k for k in inputs.ends if not check_step or k[0] >= keep]:
            del inputs.ends[key]
        object.__setattr__(inputs, "schedule", edited)  # the plans of later epochs read it
        self._weights_schedule = edited
        return edited

    def step_targets(self, epoch: int | None = None) -> np.ndarray | None:
        """float64 ``[optimizer steps, num_components]``: each step's scheduled shares (None for fixed weights): of
        the whole epoch on this sampler's ranks, or, for an epoch resumed from a state whose rest is planned anew
        (on other ranks, or under an edited schedule), of the steps planned after the cut."""
        if self._weights_schedule is None:
            return None
        epoch = self.epoch if epoch is None else epoch
        cut = self._inputs.cut
        if cut is not None and cut[0] == epoch and len(cut[1]) > 1:
            return self._inputs.segments_chain(self.cost_model)[-1][1].step_targets
        speeds = self.rank_speeds if epoch == self.epoch else None
        return self._inputs.plan_whole(epoch, self.num_replicas, self.cost_model, speeds).step_targets

    def schedule_start(self, epoch: int | None = None) -> tuple[int, int, tuple[float, ...] | None]:
        """``(first optimizer step, real tokens before, carried deficits)`` of ``epoch`` in the run under the weight
        schedule ((0, 0, None) without one). For an epoch after the current one this plans the epochs between with the
        current cost model and rank speeds: a preview, which :meth:`set_epoch` replaces by where the epoch the sampler
        ran ended."""
        epoch = self.epoch if epoch is None else epoch
        shares = self._inputs.step_shares(epoch, self.num_replicas, self.cost_model)
        return (0, 0, None) if shares is None else (shares.first_step, shares.tokens_before, shares.carry)

    def component_of(self, indices: np.ndarray) -> np.ndarray:
        """int64: the component (position in ``mixture.names``) of each sample index."""
        return self.layout.component_of(indices)

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`BalancedBatchSampler.locate`: sample ``i`` is document ``(i % N) - offsets[c]`` of component
        ``c``, read for the ``i // N``-th time (:class:`~lit_balance.plan.mixture.MixtureLayout`)."""
        indices = np.asarray(indices, dtype=np.int64)
        located = self.layout.locate(indices)
        return located[:, 0], located[:, 1], indices // max(self.layout.num_documents, 1)

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """As :meth:`BalancedBatchSampler.state_dict`, with the mixture's settings under ``"mixture"``; with a weight
        schedule also ``"weights_schedule"`` (:meth:`Schedule.to_dict <lit_balance.schedule.Schedule.to_dict>`) and
        ``"schedule_start"``, where the state's epoch starts in the run: ``[first optimizer step, real tokens
        before, carried deficits]``."""
        state = super().state_dict(batches_consumed)
        state["mixture"] = self.mixture.to_dict()
        if self._weights_schedule is not None:
            first, tokens, carry = self.schedule_start(state["epoch"])
            state["weights_schedule"] = self._weights_schedule.to_dict()
            state["schedule_start"] = [int(first), int(tokens), None if carry is None else [float(x) for x in carry]]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`BalancedBatchSampler.load_state_dict`; the saved mixture must be this one.

        Weights are compared as shares (normalised): ``5, 2, 3`` resumes a run of ``0.5, 0.2, 0.3``. Where the two
        round to shares a few ulps apart, the resumed sampler plans with the saved weights, so the saved epoch is
        planned bit for bit as before.

        Raises:
            ValueError: no ``"mixture"`` key, or another mixture: other names, unit, ``max_repetition`` or epoch
                length, or shares that differ (naming both).
        """
        if not isinstance(state_dict, dict) or "mixture" not in state_dict:
            raise InputValueError("cannot resume a MixtureBatchSampler from a state without 'mixture' (saved by a "
                                  "sampler of one corpus?)")
        state = dict(state_dict)
        saved_schedule, saved_start = state.pop("weights_schedule", None), state.pop("schedule_start", None)
        restore_starts = self._resume_schedule(state, saved_schedule, saved_start)
        saved = state.pop("mixture")
        mine = self.mixture
        try:
            theirs = MixtureSettings(**saved)
        except (TypeError, ValueError):
            theirs = None
        same = theirs is not None and (theirs.names, theirs.unit, theirs.max_repetition, theirs.units_per_epoch) == (
            mine.names, mine.unit, mine.max_repetition, mine.units_per_epoch) and np.allclose(
            theirs.shares, mine.shares, rtol=_SHARE_RTOL, atol=0.0)
        if not same:
            shares = "" if theirs is None or theirs.names != mine.names else (
                f" (shares saved {[round(x, 6) for x in theirs.shares.tolist()]}, now "
                f"{[round(x, 6) for x in mine.shares.tolist()]})")
            raise InputValueError(f"cannot resume: the saved mixture {saved} is not this one {mine.to_dict()}{shares}; "
                                  "resume with the same components, weights (any scale: they are compared as "
                                  "shares), unit and epoch length", parameter="mixture")
        before = (self._mixture, self._inputs)
        if theirs.weights != mine.weights:  # the same shares: plan with the saved weights, bit for bit as saved
            self._mixture = theirs
            self._inputs = dataclasses.replace(self._inputs, mixture=theirs)
        try:
            super().load_state_dict(state)
        except BaseException:
            self._mixture, self._inputs = before
            restore_starts()
            raise

    def _resume_schedule(self, state: dict[str, Any], saved: Any, start: Any) -> Any:
        """Check the saved weight schedule against this sampler's and plan the resumed epoch from where it starts in
        the run; returns a function that undoes it (for a state refused later). A schedule edited after the resume
        point within the resumed epoch makes the rest of the epoch a new segment on the same ranks (``state``'s
        segments rewritten), planned with the new schedule from the step after the cut.

        Raises:
            ValueError: a schedule on one side only; an edit of the schedule at a step the run has trained (naming
                the first differing point); a malformed ``schedule_start``.
        """
        mine = self._weights_schedule
        if (saved is None) != (mine is None):
            raise InputValueError(
                f"cannot resume: the state was saved {'without' if saved is None else 'with'} a weights_schedule and "
                f"this sampler has {'one' if mine is not None else 'none'}; resume with the same kind of weights",
                parameter="weights_schedule")
        if mine is None:
            return lambda: None
        saved = Schedule.from_dict(saved)
        if not (isinstance(start, list) and len(start) == 3):
            raise InputValueError(f"sampler state_dict schedule_start must be [first step, tokens before, carry], got "
                                  f"{start!r}")
        epoch = int(state.get("epoch", 0))
        carry = None if start[2] is None else tuple(float(x) for x in start[2])
        segments = [[int(r), int(c)] for r, c in (state.get("segments") or [[self.num_replicas, 0]])]
        consumed = sum(c for _, c in segments)
        if consumed == 0:  # the epoch not begun: it starts on this sampler's ranks
            segments = state["segments"] = [[self.num_replicas, 0]]
        elif segments[-1][0] != self.num_replicas:
            segments = segments + [[self.num_replicas, 0]]  # as parse_state makes it: the rest on the new ranks
        inputs = self._inputs
        before = (dict(inputs.starts), inputs.schedule, inputs.cut)

        def restore() -> None:
            object.__setattr__(inputs, "schedule", before[1])
            object.__setattr__(inputs, "cut", before[2])
            inputs.starts.clear()
            inputs.starts.update(before[0])
            inputs._chain.clear()

        try:
            object.__setattr__(inputs, "schedule", mine)
            object.__setattr__(inputs, "cut", (epoch, tuple(tuple(x) for x in segments), saved))
            inputs.starts.clear()
            inputs.starts[epoch] = (int(start[0]), int(start[1]), carry)
            inputs._chain.clear()
            # where the run stands: after the micro-steps consumed (a step begun counts as trained)
            chain = inputs.segments_chain(self.cost_model) if consumed else None
            now = (int(start[0]), int(start[1])) if not consumed else _position_after(
                chain[-1][1], chain[-1][2], segments[-1][1], self.settings.accumulate_grad_batches, inputs.lengths)
            now = now[0] if saved.unit == "steps" else now[1]
            saved.check_unchanged_before(mine, now)
            if consumed and len(segments) == 1 and saved != mine:
                # the rest of the epoch under the new schedule: a new segment on the same ranks from the cut
                segments = state["segments"] = [[self.num_replicas, segments[0][1]], [self.num_replicas, 0]]
                object.__setattr__(inputs, "cut", (epoch, tuple(tuple(x) for x in segments), saved))
                inputs._chain.clear()
        except BaseException:
            restore()
            raise
        return restore


def _position_after(mp: MixturePlan, shares: StepShares, consumed: int, acc: int,
                    lengths: np.ndarray) -> tuple[int, int]:
    """``(optimizer step, tokens trained)`` of the run after ``consumed`` micro-steps of ``mp`` (which starts at
    ``shares``); a step begun counts as trained."""
    tokens = int(_micro_step_tokens(mp, lengths)[:consumed].sum())
    return shares.first_step + -(-consumed // acc), shares.tokens_before + tokens


def _check_scheduled(inputs: _MixtureInputs, schedule: Schedule) -> None:
    """Refuse, before any token is read, a component that a weight schedule gives a positive weight but that has
    nothing to read, and ``largest_first`` beside a schedule."""
    if inputs.settings.largest_first:
        raise InputValueError("largest_first=True moves the step of the longest document first, but a "
                              "weights_schedule plans every optimizer step with its own shares in order; set "
                              "largest_first=False or give fixed weights", parameter="largest_first")
    units = mixture_units(inputs.mixture, inputs.lengths, inputs.supervised_lengths)
    n, offsets = inputs.layout.num_documents, inputs.layout.offsets
    ok = np.ones(n, dtype=bool) if inputs.eligible is None else inputs.eligible[:n]
    for c, name in enumerate(inputs.mixture.names):
        total = int(units[:n][offsets[c]:offsets[c + 1]][ok[offsets[c]:offsets[c + 1]]].sum())
        weight = max(value[name] for value in schedule.values)
        if weight > 0 and total <= 0:
            raise InputValueError(f"component {name!r} has weight {weight} in the weights_schedule but no "
                                  f"{inputs.mixture.unit} to read ({int(inputs.layout.sizes[c])} documents after "
                                  "too_long); give it documents or a weight of 0 at every point",
                                  parameter="weights_schedule")


def _micro_step_tokens(mp: MixturePlan, lengths: np.ndarray) -> np.ndarray:
    """int64 ``[micro-steps]``: real tokens of every rank at each micro-step of a mixture plan."""
    plan = mp.plan
    return plan.real_tokens_per_batch(np.asarray(lengths))[plan.assignment].sum(axis=1).astype(np.int64)
