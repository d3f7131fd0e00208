"""Samplers of simulated ranks for the skip_steps tests (``tests/test_skip_steps.py``, ``tests/test_skip_replace.py``)."""

from lit_balance import BalancedBatchSampler
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.sampler.mixture import MixtureBatchSampler


def sampler_ranks(lengths, num_replicas, kwargs, state=None, skip=None, replace=False):
    """One sampler per rank, resumed from ``state`` and given ``skip`` (optimizer steps of the run, with ``replace``);
    ``kwargs`` with ``mixture=True``: a blend of two components (the first half of the lengths and the rest, weights
    3:1)."""
    out = []
    kwargs = dict(kwargs)
    blend = kwargs.pop("mixture", False)
    for rank in range(num_replicas):
        if blend:
            half = len(lengths) // 2
            s = MixtureBatchSampler(lengths, sizes=[half, len(lengths) - half], mixture=MixtureSettings(
                ("web", "code"), (3, 1)), num_replicas=num_replicas, rank=rank, **kwargs)
        else:
            s = BalancedBatchSampler(lengths, num_replicas=num_replicas, rank=rank, **kwargs)
        if state is not None:
            s.load_state_dict(state)
        if skip is not None:
            s.skip_steps(skip, replace=replace)
        out.append(s)
    return out
