"""The sampler (torch, no Lightning): each rank's micro-batches of the plan, and its resume state."""

from lit_balance.sampler.sampler import BalancedBatchSampler

__all__ = ["BalancedBatchSampler"]
