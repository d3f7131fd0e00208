"""The ``lightning.pytorch.callbacks_factory`` entry point of earlier versions of the package, kept inert.

A :class:`~lit_balance.BalancedDataLoader` takes the fit loop's count from the ``Trainer`` handed to it
(``trainer=self.trainer``, :mod:`lit_balance.data.fit_loop`), under ``lightning`` and the standalone
``pytorch_lightning`` alike, so the package adds no callback to any ``Trainer``. An installation whose metadata still
lists the entry point (an editable install made before) calls :func:`trainer_callbacks`, which adds nothing, and
Lightning then logs nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["trainer_callbacks"]


def trainer_callbacks() -> list[Any]:
    """``[]``: no callback for any ``Trainer``."""
    return []
