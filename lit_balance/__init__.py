"""lit_balance: token-budgeted, rank-balanced batches for PyTorch Lightning DDP on variable-length text."""

from lit_balance.collate import IGNORE_INDEX, PadCollator
from lit_balance.cost import CostModel
from lit_balance.datamodule import BalancedTextDataModule
from lit_balance.dataset import TokenDataset
from lit_balance.loss import StepTokenLoss, token_loss_sum
from lit_balance.metrics import PaddingRatio
from lit_balance.models import TransformerLM
from lit_balance.planning import EpochPlan, plan_epoch
from lit_balance.sampler import BalancedBatchSampler, MicroBatch

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "BalancedBatchSampler",
    "BalancedTextDataModule",
    "CostModel",
    "EpochPlan",
    "MicroBatch",
    "PadCollator",
    "PaddingRatio",
    "StepTokenLoss",
    "TokenDataset",
    "TransformerLM",
    "__version__",
    "plan_epoch",
    "token_loss_sum",
]
