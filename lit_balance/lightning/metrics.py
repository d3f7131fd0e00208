"""torchmetrics metrics kept as sums and divided once in ``compute()``: the padding ratio, the token-mean loss, the
tokens of each mixture component."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

from lit_balance.errors import InputValueError

__all__ = ["ComponentTokens", "PaddingRatio", "TokenMeanLoss"]


class PaddingRatio(Metric):
    """Share of padded token slots that hold padding: ``1 - real tokens / padded slots``.

    States are two sums, ``real_tokens`` and ``padded_tokens`` (float64 scalars, ``dist_reduce_fx="sum"``), so
    the synced value is the ratio over all ranks' tokens, never an average of per-rank ratios. With
    ``sync_on_compute=False`` it is this rank's own ratio.

    Which ranks: torchmetrics sums the states through ``torch.distributed`` itself, over its ``process_group``
    (default: every process of the default group, which under plain DDP is the data-parallel world of
    :func:`lit_balance.world.data_parallel_world`); pass ``process_group=`` (or set the attribute before syncing)
    ``data_parallel_world(...).process_group`` to sum over the data-parallel ranks only, where the processes of a
    tensor-parallel replica hold the same tokens.

    ``update(num_real_tokens, num_padded_tokens)`` takes the counts of one or more micro-batches (ints or
    tensors of any shape, summed), e.g. a :class:`lit_balance.PadCollator` batch's ``num_real_tokens`` and
    ``num_padded_tokens``.

    ``compute()`` returns a float64 scalar tensor in ``[0, 1]``; 0 before any padded slot was counted.

    Raises:
        ValueError: (in ``update``) negative counts, or more real tokens than padded slots.

    Example:
        >>> m = PaddingRatio()
        >>> m.update(6, 8); m.update(4, 4)
        >>> float(m.compute())
        0.16666666666666663
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("real_tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("padded_tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num_real_tokens: Any, num_padded_tokens: Any) -> None:
        real = float(torch.as_tensor(num_real_tokens, dtype=torch.float64).sum())
        padded = float(torch.as_tensor(num_padded_tokens, dtype=torch.float64).sum())
        if real < 0 or padded < 0 or real > padded:
            raise InputValueError(
                f"expected 0 <= num_real_tokens <= num_padded_tokens, got num_real_tokens={real:g}, "
                f"num_padded_tokens={padded:g}"
            )
        self.real_tokens += real
        self.padded_tokens += padded

    def compute(self) -> torch.Tensor:
        if float(self.padded_tokens) == 0:
            return torch.tensor(0.0, dtype=torch.float64)
        return 1.0 - self.real_tokens / self.padded_tokens


class TokenMeanLoss(Metric):
    """Mean loss per supervised token over every token of every rank: ``sum(token losses) / num_tokens``.

    States are two sums, ``loss_sum`` and ``num_tokens`` (float64 scalars, ``dist_reduce_fx="sum"``), so the
    synced value is the mean over all ranks' tokens however unequal their counts are; logging a per-rank mean
    with ``self.log(..., batch_size=n, sync_dist=True)`` instead reduces through an integer ``batch_size`` and
    comes out biased. With ``sync_on_compute=False`` it is this rank's own mean.

    Which ranks: torchmetrics sums the states through ``torch.distributed`` itself, over its ``process_group``
    (default: every process of the default group, which under plain DDP is the data-parallel world of
    :func:`lit_balance.world.data_parallel_world`); pass ``process_group=`` (or set the attribute before syncing)
    ``data_parallel_world(...).process_group`` to sum over the data-parallel ranks only, where the processes of a
    tensor-parallel replica hold the same tokens.

    ``update(loss_sum, num_tokens)`` takes the summed loss (a scalar tensor or number, e.g. the first value of
    :func:`lit_balance.lightning.loss.token_loss_sum`; detached here) and the number of tokens it sums over, of one or
    more micro-batches.

    ``compute()`` returns a float64 scalar tensor; NaN before any token was counted (a mean over no tokens).

    Raises:
        ValueError: (in ``update``) a negative or non-integral ``num_tokens``, a loss sum that is not finite,
            or a non-zero loss sum over zero tokens.

    Example:
        >>> m = TokenMeanLoss()
        >>> m.update(6.0, 3); m.update(1.0, 1)
        >>> float(m.compute())
        1.75
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Any, num_tokens: Any) -> None:
        total = torch.as_tensor(loss_sum).detach().to(dtype=torch.float64, device=self.loss_sum.device).sum()
        count = float(torch.as_tensor(num_tokens, dtype=torch.float64).sum())
        if count < 0 or count != int(count):
            raise InputValueError(f"expected num_tokens to be an int >= 0, got {count:g}")
        if not bool(torch.isfinite(total)) or (count == 0 and float(total) != 0):
            raise InputValueError(f"expected a finite loss_sum, 0 over 0 tokens; got loss_sum={float(total):g} over "
                                  f"num_tokens={count:g}")
        self.loss_sum += total
        self.num_tokens += count

    def compute(self) -> torch.Tensor:
        if float(self.num_tokens) == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.loss_sum / self.num_tokens


class ComponentTokens(Metric):
    """Real tokens, supervised tokens and documents of each component of a mixture, and each component's share.

    States are three sums, float64 ``[num_components]`` each (``dist_reduce_fx="sum"``): ``real_tokens``,
    ``supervised_tokens`` (tokens with a next-token target) and ``documents`` (real rows; fill rows are not counted by
    the caller). The synced values are sums over the ranks; shares are ratios of those sums, never averages of per-rank
    shares. With ``sync_on_compute=False`` they are this rank's own. Which ranks: as :class:`PaddingRatio`
    (``process_group``).

    ``update(components, real_tokens, supervised_tokens)`` takes one value per document (int arrays or tensors of one
    shape): its component (position in the mixture's names), its real tokens and its supervised tokens, e.g.
    :func:`lit_balance.lightning.callbacks._common.row_tokens` mapped through
    :meth:`~lit_balance.sampler.mixture.MixtureBatchSampler.component_of`.

    ``compute()`` returns float64 ``[num_components]``: each component's share of the counted units, in ``unit``
    (``"tokens"``: real tokens, ``"supervised_tokens"``, ``"documents"``: the unit of
    :class:`~lit_balance.plan.mixture.MixtureSettings`); zeros before anything was counted.

    Args:
        num_components: components of the mixture.
        unit: what :meth:`compute` shares.

    Raises:
        ValueError: ``num_components < 1`` or an unknown ``unit``; (in ``update``) arrays of different shapes, a
            component outside ``[0, num_components)``, negative counts or more supervised than real tokens.

    Example:
        >>> m = ComponentTokens(2)
        >>> m.update([0, 1, 0], [10, 30, 20], [9, 29, 19])
        >>> m.real_tokens.tolist(), m.compute().tolist()
        ([30.0, 30.0], [0.5, 0.5])
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False
    UNITS = {"tokens": "real_tokens", "supervised_tokens": "supervised_tokens", "documents": "documents"}

    def __init__(self, num_components: int, unit: str = "tokens", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(num_components, bool) or not isinstance(num_components, int) or num_components < 1:
            raise InputValueError(f"num_components must be an int >= 1, got {num_components!r}",
                                  parameter="num_components")
        if unit not in self.UNITS:
            raise InputValueError(f"unit must be one of {sorted(self.UNITS)}, got {unit!r}", parameter="unit")
        self.num_components, self.unit = num_components, unit
        for name in ("real_tokens", "supervised_tokens", "documents"):
            self.add_state(name, default=torch.zeros(num_components, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, components: Any, real_tokens: Any, supervised_tokens: Any) -> None:
        comps = torch.as_tensor(components).reshape(-1).long().cpu()
        real = torch.as_tensor(real_tokens, dtype=torch.float64).reshape(-1).cpu()
        supervised = torch.as_tensor(supervised_tokens, dtype=torch.float64).reshape(-1).cpu()
        if not comps.shape == real.shape == supervised.shape:
            raise InputValueError(f"expected one component, real and supervised token count per document, got "
                                  f"{comps.numel()}, {real.numel()} and {supervised.numel()} values")
        if comps.numel() and (int(comps.min()) < 0 or int(comps.max()) >= self.num_components):
            raise InputValueError(f"expected components in [0, {self.num_components}), got {comps.tolist()[:8]}")
        if bool((real < 0).any()) or bool((supervised < 0).any()) or bool((supervised > real).any()):
            raise InputValueError("expected 0 <= supervised_tokens <= real_tokens per document, got real "
                                  f"{real.tolist()[:8]} and supervised {supervised.tolist()[:8]}")
        device = self.real_tokens.device
        self.real_tokens += torch.bincount(comps, weights=real, minlength=self.num_components).to(device)
        self.supervised_tokens += torch.bincount(comps, weights=supervised, minlength=self.num_components).to(device)
        self.documents += torch.bincount(comps, minlength=self.num_components).to(device, torch.float64)

    def compute(self) -> torch.Tensor:
        units = getattr(self, self.UNITS[self.unit])
        total = float(units.sum())
        return units / total if total > 0 else torch.zeros_like(units)
