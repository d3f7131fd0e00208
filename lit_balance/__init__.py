"""lit_balance: token-budgeted, rank-balanced batches for PyTorch Lightning DDP on variable-length text.

Names are imported on first use (PEP 562), so that ``import lit_balance.planning`` (the pure planner) does not
import Lightning; ``from lit_balance import BalancedBatchSampler`` works as usual. The demo model is
``lit_balance.demo.DemoTransformerLM``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "IGNORE_INDEX": "lit_balance.collate",
    "PackedCollator": "lit_balance.collate",
    "PadCollator": "lit_balance.collate",
    "CostModel": "lit_balance.cost",
    "BalancedTextDataModule": "lit_balance.datamodule",
    "TokenDataset": "lit_balance.dataset",
    "MicroBatchDataset": "lit_balance.loader",
    "PadFieldsCollator": "lit_balance.loader",
    "balanced_dataloader": "lit_balance.loader",
    "item_lengths": "lit_balance.loader",
    "StepTokenLoss": "lit_balance.loss",
    "token_loss_sum": "lit_balance.loss",
    "PaddingRatio": "lit_balance.metrics",
    "TokenMeanLoss": "lit_balance.metrics",
    "EpochPlan": "lit_balance.planning",
    "MicroBatch": "lit_balance.planning",
    "plan_epoch": "lit_balance.planning",
    "PlanReport": "lit_balance.report",
    "plan_report": "lit_balance.report",
    "BalancedBatchSampler": "lit_balance.sampler",
    "BatchingSettings": "lit_balance.settings",
    "PlanStats": "lit_balance.stats",
    "plan_stats": "lit_balance.stats",
    "PlanWindows": "lit_balance.windows",
    "WindowedPlan": "lit_balance.windows",
    "useful_fraction_bound": "lit_balance.stats",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:  # static names for type checkers and IDEs
    from lit_balance.collate import IGNORE_INDEX, PackedCollator, PadCollator  # noqa: F401
    from lit_balance.cost import CostModel  # noqa: F401
    from lit_balance.datamodule import BalancedTextDataModule  # noqa: F401
    from lit_balance.dataset import TokenDataset  # noqa: F401
    from lit_balance.loader import MicroBatchDataset, PadFieldsCollator, balanced_dataloader, item_lengths  # noqa: F401
    from lit_balance.loss import StepTokenLoss, token_loss_sum  # noqa: F401
    from lit_balance.metrics import PaddingRatio, TokenMeanLoss  # noqa: F401
    from lit_balance.planning import EpochPlan, MicroBatch, plan_epoch  # noqa: F401
    from lit_balance.report import PlanReport, plan_report  # noqa: F401
    from lit_balance.sampler import BalancedBatchSampler  # noqa: F401
    from lit_balance.settings import BatchingSettings  # noqa: F401
    from lit_balance.stats import PlanStats, plan_stats, useful_fraction_bound  # noqa: F401
    from lit_balance.windows import PlanWindows, WindowedPlan  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lit_balance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
