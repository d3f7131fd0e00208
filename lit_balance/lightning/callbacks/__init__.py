"""Lightning callbacks that measure what each rank trained on and adapt training to it."""

from lit_balance.lightning.callbacks.accumulation import AdaptiveGradAccumulation
from lit_balance.lightning.callbacks.checkpoint import LastStepCheckpoint
from lit_balance.lightning.callbacks.feedback import CostModelFeedback
from lit_balance.lightning.callbacks.ledger import LedgerCheck, LedgerMismatchError
from lit_balance.lightning.callbacks.mixture import MixtureMonitor
from lit_balance.lightning.callbacks.online_weights import MixtureWeightsHook
from lit_balance.lightning.callbacks.padding import PaddingRatioMonitor
from lit_balance.lightning.callbacks.progress import BalanceProgressBar, live_figures
from lit_balance.lightning.callbacks.step_tokens import TokensPerStepAccumulation
from lit_balance.lightning.callbacks.straggler import StragglerMonitor, TimingWindow, backward_is_local
from lit_balance.lightning.callbacks.summary import RunSummary

__all__ = ["AdaptiveGradAccumulation", "BalanceProgressBar", "CostModelFeedback", "LastStepCheckpoint", "LedgerCheck",
           "LedgerMismatchError",
           "MixtureMonitor", "MixtureWeightsHook", "PaddingRatioMonitor", "RunSummary", "StragglerMonitor", "TimingWindow", "TokensPerStepAccumulation",
           "backward_is_local", "live_figures"]
