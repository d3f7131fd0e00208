"""Lightning glue: the DataModule, the token-weighted loss, metrics and callbacks."""

from lit_balance.lightning.datamodule import BalancedTextDataModule, fit_batches_consumed
from lit_balance.lightning.fit_count import FitLoopCount
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum
from lit_balance.lightning.metrics import PaddingRatio, TokenMeanLoss

__all__ = ["BalancedTextDataModule", "FitLoopCount", "PaddingRatio", "StepTokenLoss", "TokenMeanLoss",
           "fit_batches_consumed", "token_loss_sum"]
