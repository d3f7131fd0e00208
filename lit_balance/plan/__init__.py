"""Planning (NumPy only): settings, cost models, plan types, the padded and packed planners, windows and figures."""

from lit_balance.plan.cost import CostModel, CostModelBase, CostModelProtocol
from lit_balance.plan.epoch import PLANNERS, Planner, plan_epoch, planner_for, too_long
from lit_balance.plan.settings import BatchingSettings
from lit_balance.plan.shapes import epoch_shapes, resolve_static_shapes
from lit_balance.plan.stats import PlanStats, RankBatches, batch_persistence, plan_stats, useful_fraction_bound
from lit_balance.plan.types import EpochPlan, MicroBatch, padded_lengths
from lit_balance.plan.windows import PlanWindows, WindowedPlan

__all__ = ["PLANNERS", "BatchingSettings", "CostModel", "CostModelBase", "CostModelProtocol", "EpochPlan", "MicroBatch",
           "PlanStats", "PlanWindows", "Planner", "RankBatches", "WindowedPlan", "batch_persistence", "epoch_shapes",
           "padded_lengths", "plan_epoch", "plan_stats", "planner_for", "resolve_static_shapes", "too_long",
           "useful_fraction_bound"]
