"""MixtureBatchSampler: the balanced sampler over a weighted mixture of components, exact in its unit at every
optimizer step (:mod:`lit_balance.plan.mixture`), resumable on any number of ranks."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_balance.errors import InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.mixture import (MixtureLayout, MixtureSettings, mixture_units, plan_mixture,
                                      select_epoch)
from lit_balance.plan.settings import DEFAULT_PLAN_WINDOW, BatchingSettings
from lit_balance.plan.types import EpochPlan
from lit_balance.sampler.inputs import PlanInputs
from lit_balance.sampler.sampler import BalancedBatchSampler

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

    def chosen(self, epoch: int) -> np.ndarray:
        """bool ``[num_samples]``: the samples ``epoch`` reads."""
        units = mixture_units(self.mixture, self.lengths, self.supervised_lengths)
        return select_epoch(units, self.layout, self.mixture, seed=self.settings.seed, epoch=epoch,
                            eligible=self.eligible)

    def plan(self, epoch: int, num_replicas: int, *, eligible: np.ndarray | None, speeds: np.ndarray | None,
             cost_model: CostModelProtocol, min_steps: int = 0,
             max_tokens: int | tuple[int, ...] | None = None,
             padded_shapes: tuple[tuple[int, int], ...] | None = None) -> EpochPlan:
        settings = self.settings
        if max_tokens is not None and max_tokens != settings.max_tokens:
            settings = settings.replace(max_tokens=max_tokens)
        if padded_shapes is not None and padded_shapes != settings.padded_shapes:
            settings = settings.replace(padded_shapes=padded_shapes)
        exactly = None if eligible is self.eligible else self.chosen(epoch) & eligible
        return plan_mixture(self.lengths, self.layout, self.mixture, settings, num_replicas=num_replicas, epoch=epoch,
                            cost_model=cost_model, speeds=speeds, supervised_lengths=self.supervised_lengths,
                            eligible=self.eligible, plan_exactly=exactly).plan


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
        [[0, 4], [1, 2, 3], [5]]
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, sizes: Sequence[int], mixture: MixtureSettings,
                 max_tokens: int | None = None, *, supervised_lengths: Any = None, **kwargs: Any) -> None:
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
        inputs = _MixtureInputs(np.asarray(base.lengths, dtype=np.int64), base.settings, base.eligible, None,
                                base.supervised_lengths, base.lengths_sha256, layout=self.layout, mixture=self.mixture)
        inputs.chosen(0)  # an unreachable share or an empty component is an error now, before any token is read
        return inputs

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
        """As :meth:`BalancedBatchSampler.state_dict`, with the mixture's settings under ``"mixture"``."""
        state = super().state_dict(batches_consumed)
        state["mixture"] = self.mixture.to_dict()
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
            raise
