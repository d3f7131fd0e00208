"""torchmetrics metrics of what training consumed: the padding ratio, kept as sums and divided in ``compute()``."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

__all__ = ["PaddingRatio"]


class PaddingRatio(Metric):
    """Share of padded token slots that hold padding: ``1 - real tokens / padded slots``.

    States are two sums, ``real_tokens`` and ``padded_tokens`` (float64 scalars, ``dist_reduce_fx="sum"``), so
    the synced value is the ratio over all ranks' tokens, never an average of per-rank ratios. With
    ``sync_on_compute=False`` it is this rank's own ratio.

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
            raise ValueError(
                f"expected 0 <= num_real_tokens <= num_padded_tokens, got num_real_tokens={real:g}, "
                f"num_padded_tokens={padded:g}"
            )
        self.real_tokens += real
        self.padded_tokens += padded

    def compute(self) -> torch.Tensor:
        if float(self.padded_tokens) == 0:
            return torch.tensor(0.0, dtype=torch.float64)
        return 1.0 - self.real_tokens / self.padded_tokens
