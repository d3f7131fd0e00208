"""Lightning callbacks that measure what each rank trained on and adapt training to it.

The public home of :mod:`lit_balance.lightning.callbacks`: ``from lit_balance.callbacks import StragglerMonitor``.
"""

from lit_balance.lightning.callbacks import (
    AdaptiveGradAccumulation,
    BalanceProgressBar,
    CostModelFeedback,
    LastStepCheckpoint,
    LedgerCheck,
    LedgerMismatchError,
    MixtureMonitor,
    MixtureWeightsHook,
    PaddingRatioMonitor,
    RunSummary,
    StragglerMonitor,
    TimingWindow,
    TokensPerStepAccumulation,
    backward_is_local,
)

__all__ = ["AdaptiveGradAccumulation", "BalanceProgressBar", "CostModelFeedback", "LastStepCheckpoint", "LedgerCheck", "LedgerMismatchError",
           "MixtureMonitor", "MixtureWeightsHook", "PaddingRatioMonitor", "RunSummary", "StragglerMonitor", "TimingWindow", "TokensPerStepAccumulation",
           "backward_is_local"]
