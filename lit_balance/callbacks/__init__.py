"""Lightning callbacks that measure what each rank trained on."""

from lit_balance.callbacks.summary import RunSummary

__all__ = ["RunSummary"]
