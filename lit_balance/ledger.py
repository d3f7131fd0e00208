"""The ledger of an epoch: which documents every rank trains on at every optimizer step, written before training and
checked while training (:class:`lit_balance.callbacks.LedgerCheck`).

The public home of :mod:`lit_balance.lightning.ledger`: ``from lit_balance.ledger import write_ledger``.
"""

from lit_balance.lightning.ledger import (
    LEDGER_KEY,
    LEDGER_VERSION,
    check_ledger_header,
    ledger_columns,
    ledger_header,
    read_ledger,
    step_documents,
    write_datamodule_ledger,
    write_ledger,
)

__all__ = ["LEDGER_KEY", "LEDGER_VERSION", "check_ledger_header", "ledger_columns", "ledger_header", "read_ledger",
           "step_documents", "write_datamodule_ledger", "write_ledger"]
