"""Lightning glue: the DataModule, the token-weighted loss, metrics and callbacks.

Names and submodules are imported on first use (PEP 562), so that ``from lit_balance import TokenMeanLoss`` or
``import lit_balance.lightning.loss`` in a plain PyTorch loop does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "BalancedTextDataModule": "lit_balance.lightning.datamodule",
    "fit_batches_consumed": "lit_balance.lightning.datamodule",
    "StepTokenLoss": "lit_balance.lightning.loss",
    "token_loss_sum": "lit_balance.lightning.loss",
    "PaddingRatio": "lit_balance.lightning.metrics",
    "TokenMeanLoss": "lit_balance.lightning.metrics",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # static names for type checkers and IDEs
    from lit_balance.lightning.datamodule import BalancedTextDataModule, fit_batches_consumed  # noqa: F401
    from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum  # noqa: F401
    from lit_balance.lightning.metrics import PaddingRatio, TokenMeanLoss  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``lit_balance.lightning.budget.find_max_tokens``), imported on first use too
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module 'lit_balance.lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
