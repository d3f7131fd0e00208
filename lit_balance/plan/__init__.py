"""Planning (NumPy only): settings, cost models, plan types, the padded and packed planners, windows and figures."""

from lit_balance.plan.cost import CostModel, CostModelBase, CostModelProtocol
from lit_balance.plan.padded import EpochPlan, MicroBatch, padded_lengths, plan_epoch
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.stats import PlanStats, RankBatches, batch_persistence, plan_stats, useful_fraction_bound
from lit_balance.plan.windows import PlanWindows, WindowedPlan

__all__ = ["BatchingSettings", "CostModel", "CostModelBase", "CostModelProtocol", "EpochPlan", "MicroBatch", "PlanStats", "PlanWindows", "RankBatches", "WindowedPlan",
           "batch_persistence", "padded_lengths", "plan_epoch", "plan_stats", "useful_fraction_bound"]
