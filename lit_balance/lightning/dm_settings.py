"""The batching settings of :class:`~lit_balance.BalancedTextDataModule`, from ``settings=`` or its keywords.

Settings live in one place: a :class:`~lit_balance.BatchingSettings`, or the keywords given (None: not given); a
keyword given beside ``settings`` must say the same thing. With ``max_tokens="auto"`` there are no settings until
the budget is measured: the other values are checked at construction and kept, and an
:class:`~lit_balance.lightning.budget.AutoTokenBudget` owns the budget.
"""

from __future__ import annotations

from typing import Any

from lit_balance._checks import check_int
from lit_balance.errors import InputValueError
from lit_balance.lightning.budget import AutoTokenBudget
from lit_balance.plan.settings import BatchingSettings

__all__ = ["DEFAULT_MAX_TOKENS", "auto_budget", "batching_settings"]

#: ``max_tokens`` of :class:`BalancedTextDataModule` (and of ``lit-balance plan``) when not given: padded token
#: slots per micro-batch, per rank.
DEFAULT_MAX_TOKENS = 4096


def auto_budget(given: dict[str, Any], settings: BatchingSettings | None, memory_limit: Any,
                memory_fraction: Any, cpu_mmap_threshold: Any) -> AutoTokenBudget | None:
    """The owner of ``max_tokens="auto"``, or None for an int (or per-rank) budget."""
    if not (isinstance(given.get("max_tokens"), str) and given["max_tokens"] == "auto"):
        return None
    if settings is not None:
        raise InputValueError("max_tokens='auto' cannot be combined with settings= (whose max_tokens is an int): pass "
                              "the batching settings as keywords, or an int max_tokens", parameter="max_tokens")
    return AutoTokenBudget(memory_limit, memory_fraction, cpu_mmap_threshold=cpu_mmap_threshold)


def batching_settings(settings: BatchingSettings | None, given: dict[str, Any],
              auto: bool) -> tuple[BatchingSettings | None, dict[str, Any]]:
    """``(settings or None, the values of every setting but max_tokens)``: ``settings`` (every keyword given beside it
    must agree), or the keywords given (the others at :class:`BatchingSettings`' defaults, ``max_tokens`` at
    :data:`DEFAULT_MAX_TOKENS`); with ``max_tokens="auto"``, no settings yet (the other values checked now)."""
    if auto:  # every check but pad_to_multiple_of <= max_tokens holds for any budget: check with the smallest
        pad = check_int("pad_to_multiple_of", given.get("pad_to_multiple_of", 1), 1, "use 1 for no rounding")
        checked = BatchingSettings.build(None, {**given, "max_tokens": pad}, owner="BalancedTextDataModule")
        return None, {k: v for k, v in checked.to_dict().items() if k != "max_tokens"}
    if settings is None:
        given = {"max_tokens": DEFAULT_MAX_TOKENS, **given}
    built = BatchingSettings.build(settings, given, owner="BalancedTextDataModule")
    return built, {k: v for k, v in built.to_dict().items() if k != "max_tokens"}
