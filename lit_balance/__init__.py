"""lit_balance: token-budgeted, rank-balanced batches for PyTorch Lightning DDP on variable-length text.

Names are imported on first use (PEP 562), so that ``import lit_balance.plan.padded`` (the pure planner) does not
import Lightning; ``from lit_balance import BalancedBatchSampler`` works as usual. The demo model is
``lit_balance.demo.DemoTransformerLM``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "IGNORE_INDEX": "lit_balance.data.records",
    "PackedCollator": "lit_balance.data.collate",
    "PadCollator": "lit_balance.data.collate",
    "CostModel": "lit_balance.plan.cost",
    "BalancedTextDataModule": "lit_balance.lightning.datamodule",
    "TokenDataset": "lit_balance.data.dataset",
    "MicroBatchDataset": "lit_balance.data.loader",
    "PadFieldsCollator": "lit_balance.data.loader",
    "balanced_dataloader": "lit_balance.data.loader",
    "BalancedDataLoader": "lit_balance.data.loader",
    "item_lengths": "lit_balance.data.loader",
    "use_training_sampler": "lit_balance.data.training_sampler",
    "StepTokenLoss": "lit_balance.lightning.loss",
    "token_loss_sum": "lit_balance.lightning.loss",
    "PaddingRatio": "lit_balance.lightning.metrics",
    "TokenMeanLoss": "lit_balance.lightning.metrics",
    "EpochPlan": "lit_balance.plan.types",
    "MicroBatch": "lit_balance.plan.types",
    "plan_epoch": "lit_balance.plan.epoch",
    "PlanReport": "lit_balance.report.figures",
    "plan_report": "lit_balance.report.figures",
    "BalancedBatchSampler": "lit_balance.sampler.sampler",
    "Mixture": "lit_balance.data.mixture",
    "MixtureBatchSampler": "lit_balance.sampler.mixture",
    "MixtureSettings": "lit_balance.plan.mixture",
    "plan_mixture": "lit_balance.plan.mixture",
    "BatchingSettings": "lit_balance.plan.settings",
    "Schedule": "lit_balance.schedule",
    "PlanStats": "lit_balance.plan.stats",
    "plan_stats": "lit_balance.plan.stats",
    "PlanWindows": "lit_balance.plan.windows",
    "WindowedPlan": "lit_balance.plan.windows",
    "useful_fraction_bound": "lit_balance.plan.stats",
    "LengthWarmupPlan": "lit_balance.plan.warmup",
    "plan_length_warmup": "lit_balance.plan.warmup",
    "PieceMicroBatch": "lit_balance.plan.types",
    "PieceDataset": "lit_balance.data.pieces",
    "TokenStepPlan": "lit_balance.plan.step_tokens",
    "plan_tokens_per_step": "lit_balance.plan.step_tokens",
    "TokensPerStepSampler": "lit_balance.sampler.step_tokens",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:  # static names for type checkers and IDEs
    from lit_balance.data.collate import IGNORE_INDEX, PackedCollator, PadCollator  # noqa: F401
    from lit_balance.data.dataset import TokenDataset  # noqa: F401
    from lit_balance.data.loader import (  # noqa: F401
        BalancedDataLoader,
        MicroBatchDataset,
        PadFieldsCollator,
        balanced_dataloader,
        item_lengths,
    )
    from lit_balance.data.training_sampler import use_training_sampler  # noqa: F401
    from lit_balance.lightning.datamodule import BalancedTextDataModule  # noqa: F401
    from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum  # noqa: F401
    from lit_balance.lightning.metrics import PaddingRatio, TokenMeanLoss  # noqa: F401
    from lit_balance.plan.cost import CostModel  # noqa: F401
    from lit_balance.plan.epoch import plan_epoch  # noqa: F401
    from lit_balance.plan.settings import BatchingSettings  # noqa: F401
    from lit_balance.plan.stats import PlanStats, plan_stats, useful_fraction_bound  # noqa: F401
    from lit_balance.plan.types import EpochPlan, MicroBatch  # noqa: F401
    from lit_balance.plan.windows import PlanWindows, WindowedPlan  # noqa: F401
    from lit_balance.report.figures import PlanReport, plan_report  # noqa: F401
    from lit_balance.sampler.sampler import BalancedBatchSampler  # noqa: F401
    from lit_balance.data.mixture import Mixture  # noqa: F401
    from lit_balance.plan.mixture import MixtureSettings, plan_mixture  # noqa: F401
    from lit_balance.sampler.mixture import MixtureBatchSampler  # noqa: F401
    from lit_balance.plan.warmup import LengthWarmupPlan, plan_length_warmup  # noqa: F401
    from lit_balance.plan.types import PieceMicroBatch  # noqa: F401
    from lit_balance.data.pieces import PieceDataset  # noqa: F401
    from lit_balance.schedule import Schedule  # noqa: F401
    from lit_balance.plan.step_tokens import TokenStepPlan, plan_tokens_per_step  # noqa: F401
    from lit_balance.sampler.step_tokens import TokensPerStepSampler  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lit_balance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
