"""The optimizer state the first optimizer step will allocate: what the token budget probe adds to each measured peak
(the probe never steps an optimizer); and the refusal of a module that steps its optimizers itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lit_balance.errors import InputValueError

__all__ = ["optimizer_state_bytes", "optimizers_of", "refuse_manual_optimization"]

_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "SparseAdam": 2,
                    "Adagrad": 0, "SGD": 1, "RMSprop": 1, "Rprop": 2, "ASGD": 1, "LBFGS": 2}


def optimizers_of(obj: Any) -> list[torch.optim.Optimizer]:
    """Every optimizer in what ``configure_optimizers`` returns (an optimizer, lists, tuples, dicts)."""
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    if isinstance(obj, Mapping):
        return optimizers_of(obj.get("optimizer"))
    if isinstance(obj, (list, tuple)):
        return [o for item in obj for o in optimizers_of(item)]
    return []


def _state_tensors(name: str, group: Mapping[str, Any]) -> int:
    """State tensors per parameter that an optimizer of class ``name`` keeps for a parameter group."""
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name in ("Adam", "AdamW") and group.get("amsgrad", False):
        return 3
    return _STATE_PER_PARAM.get(name, 2)


def optimizer_state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes the optimizers' first step will allocate for parameters that have no state yet.

    Adam-family optimizers keep two tensors per parameter (``exp_avg``, ``exp_avg_sq``; three with ``amsgrad``), SGD
    with momentum and RMSprop one (RMSprop two with momentum, three centred); Adagrad allocates its state at
    construction (counted in the measured memory). An optimizer of another class counts two tensors per parameter.

    Args:
        optimizers: the optimizers (e.g. ``trainer.optimizers``).

    Returns:
        Bytes (per rank, of unsharded parameters as this process holds them).

    Example:
        >>> layer = torch.nn.Linear(4, 2)  # 10 float32 parameters
        >>> optimizer_state_bytes([torch.optim.AdamW(layer.parameters())])
        80
    """
    total = 0
    for opt in optimizers:
        for group in opt.param_groups:
            per = _state_tensors(type(opt).__name__, group)
            total += sum(per * p.numel() * p.element_size() for p in group["params"]
                         if p.requires_grad and not opt.state.get(p))
    return total


def refuse_manual_optimization(module: Any) -> None:
    """Raise when ``module`` steps its optimizers itself (the probe must not)."""
    if getattr(module, "automatic_optimization", True) is False:
        raise InputValueError(
            f"max_tokens='auto' measures memory by running training_step forward and backward, but "
            f"{type(module).__name__} uses manual optimization (automatic_optimization = False): its training_step "
            "steps its optimizers itself, which the probe must not do. Pass max_tokens as an int (padded token slots "
            "per micro-batch, per rank), e.g. one measured with dm.find_max_tokens(model) on a copy of the model with "
            "automatic optimization", parameter="max_tokens")
