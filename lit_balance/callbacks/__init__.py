"""Lightning callbacks that measure what each rank trained on and adapt training to it."""

from lit_balance.callbacks.accumulation import AdaptiveGradAccumulation
from lit_balance.callbacks.feedback import CostModelFeedback
from lit_balance.callbacks.padding import PaddingRatioMonitor
from lit_balance.callbacks.straggler import StragglerMonitor
from lit_balance.callbacks.summary import RunSummary

__all__ = ["AdaptiveGradAccumulation", "CostModelFeedback", "PaddingRatioMonitor", "RunSummary", "StragglerMonitor"]
