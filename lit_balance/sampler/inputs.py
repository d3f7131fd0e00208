"""What a sampler's plans are made from, fixed when it is built: the lengths as planned, the settings, the samples
every epoch plans, and the windows of a large corpus."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_balance._checks import check_supervised_lengths
from lit_balance._fingerprint import sha256_of_int64
from lit_balance.errors import InputValueError
from lit_balance.plan.cost import CostModelProtocol
from lit_balance.plan.epoch import plan_epoch, too_long
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.shapes import resolve_static_shapes
from lit_balance.plan.types import EpochPlan
from lit_balance.plan.windows import PlanWindows, WindowedPlan

__all__ = ["PlanInputs"]


@dataclass(frozen=True, eq=False)
class PlanInputs:
    """The inputs of every plan of one sampler (global: the same on every rank).

    Attributes:
        lengths: int ``[num_samples]``: tokens per sample as planned (after ``too_long="truncate"``); int64, or the
            dtype given (not copied, e.g. an int32 memory map) when the epoch is planned in windows.
        settings: the batching settings.
        eligible: bool ``[num_samples]`` of the samples every epoch plans (``too_long="skip"`` leaves the others
            out), or None for all.
        windows: the windows an epoch is planned in, or None when it is planned whole.
        supervised_lengths: int64 ``[num_samples]`` next-token targets per sample as planned, or None
            (``lengths - 1``).
        lengths_sha256: sha256 of the lengths as int64, what a resume state is checked against.
    """

    lengths: np.ndarray
    settings: BatchingSettings
    eligible: np.ndarray | None
    windows: PlanWindows | None
    supervised_lengths: np.ndarray | None
    lengths_sha256: str
    _window_counts: dict = field(default_factory=dict, repr=False)  # windows counted once (per budget and shapes)

    @classmethod
    def build(cls, lengths: np.ndarray, settings: BatchingSettings, supervised_lengths: Any = None,
              num_replicas: int = 1) -> PlanInputs:
        """Apply ``settings.too_long`` to ``lengths`` (int ``[num_samples]``, as ``check_lengths(lengths,
        keep_dtype=True)`` returns them).

        Up to ``plan_window`` samples the epoch is planned whole, on int64 lengths; beyond, window by window, and the
        lengths are read as they are (an int32 memory map stays one, without a copy).

        Raises:
            ValueError: a too-long sample with ``too_long="error"`` (naming its index and length); bad
                ``supervised_lengths``; every sample skipped.
        """
        lengths_arr = lengths
        windowed = lengths_arr.shape[0] > settings.plan_window
        if not windowed:
            lengths_arr = lengths_arr.astype(np.int64)
        too_long_mask = too_long(lengths_arr, settings.largest_max_tokens, settings.pad_to_multiple_of)
        eligible = None
        if too_long_mask.any():
            if settings.too_long == "error":
                raise _too_long_error(lengths_arr, np.flatnonzero(too_long_mask), settings)
            if settings.too_long == "skip":
                eligible = ~too_long_mask
            else:
                lengths_arr = np.minimum(lengths_arr, settings.truncate_to)
        # static shapes: once, over all samples (an int padded_shapes: rows for num_replicas ranks)
        settings = resolve_static_shapes(lengths_arr, settings, eligible, num_replicas)
        supervised = (None if supervised_lengths is None
                      else check_supervised_lengths(supervised_lengths, np.asarray(lengths_arr, np.int64)))
        windows = PlanWindows(lengths_arr.shape[0], settings.plan_window, settings.seed) if windowed else None
        inputs = cls(lengths_arr, settings, eligible, windows, supervised, sha256_of_int64(lengths_arr))
        if inputs.skipped_indices.size == lengths_arr.size:
            raise InputValueError(f"all {lengths_arr.size} samples exceed max_tokens={settings.largest_max_tokens} and "
                                  "too_long='skip' leaves none; raise max_tokens", parameter="max_tokens")
        return inputs

    @property
    def num_samples(self) -> int:
        """Samples, planned or skipped (``len(lengths)``)."""
        return int(self.lengths.shape[0])

    @property
    def skipped_indices(self) -> np.ndarray:
        """int64 indices of the samples left out every epoch by ``too_long="skip"``."""
        return np.empty(0, np.int64) if self.eligible is None else np.flatnonzero(~self.eligible)

    def plan(self, epoch: int, num_replicas: int, *, eligible: np.ndarray | None, speeds: np.ndarray | None,
             cost_model: CostModelProtocol, min_steps: int = 0,
             max_tokens: int | tuple[int, ...] | None = None,
             padded_shapes: tuple[tuple[int, int], ...] | None = None) -> EpochPlan | WindowedPlan:
        """The plan of ``eligible`` samples (None: :attr:`eligible`) in ``epoch`` on ``num_replicas`` ranks: an
        :class:`EpochPlan`, or a lazy :class:`WindowedPlan` (each window planned when it is reached). ``max_tokens``
        (None: the settings') is the budget of the ranks that run it: an earlier segment of a resumed epoch ran on
        ranks of other per-rank budgets; ``padded_shapes`` (None: the settings') the shapes they ran with (those an int
        ``padded_shapes`` chose for their number of ranks)."""
        settings = self.settings
        if max_tokens is not None and max_tokens != settings.max_tokens:
            settings = settings.replace(max_tokens=max_tokens)
        if padded_shapes is not None and padded_shapes != settings.padded_shapes:
            settings = settings.replace(padded_shapes=padded_shapes)
        if self.windows is not None:
            cache = self._window_counts.setdefault((settings.max_tokens, settings.padded_shapes), {})
            return WindowedPlan(self.lengths, settings, self.windows, num_replicas=num_replicas, epoch=epoch,
                                eligible=None if eligible is self.eligible else eligible, base_eligible=self.eligible,
                                cost_model=cost_model, rank_speeds=speeds, min_steps=min_steps, count_cache=cache,
                                supervised_lengths=self.supervised_lengths)
        return plan_epoch(self.lengths, settings, num_replicas=num_replicas, epoch=epoch, eligible=eligible,
                          cost_model=cost_model, rank_speeds=speeds, min_steps=min_steps)


def _too_long_error(lengths: np.ndarray, bad: np.ndarray, settings: BatchingSettings) -> InputValueError:
    shown = ", ".join(f"index {i}: {lengths[i]} tokens" for i in bad[:5])
    return InputValueError(
        f"{bad.size} sample(s) exceed max_tokens={settings.largest_max_tokens} padded token slots "
        f"(pad_to_multiple_of={settings.pad_to_multiple_of}): {shown}{', ...' if bad.size > 5 else ''}; "
        'raise max_tokens, truncate the data, or pass too_long="skip" or "truncate"', parameter="too_long")
