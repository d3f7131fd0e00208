"""``lit-balance ledger check``: compare what the ranks of a run received with the ledger of its plan.

``LedgerCheck(record=DIR)`` writes, per rank and pass over an epoch, the hash and indices of every micro-batch the rank
trained (:mod:`lit_balance.lightning.ledger_record`); ``lit-balance ledger check DIR --ledger LEDGER`` compares them
with a ledger (``lit-balance plan --ledger``) and prints one line per differing micro-batch (optimizer step, rank and
first differing document). Exit status: 0 when everything matches, 1 on a mismatch, 2 on bad input (a ledger of other
settings than the record's, naming each setting; a missing file).

Run:
    lit-balance ledger check outputs/received --ledger ledger.parquet
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_balance.cli.messages import ErrorFirstParser

__all__ = ["MAX_LINES", "ledger_parser", "run_ledger"]

#: Mismatches printed at most (the count of all of them follows).
MAX_LINES = 20


def ledger_parser() -> ErrorFirstParser:
    """The ``ledger`` subcommand's parser (jsonargparse): ``ledger check RECORD [RECORD ...] --ledger LEDGER``."""
    parser = ErrorFirstParser(allow_abbrev=False, prog="lit-balance ledger",
                              description="check: compare the record of what each rank received "
                                          "(LedgerCheck(record=DIR)) with the ledger of the run's plan (lit-balance "
                                          "plan --ledger); exit status 1 on a mismatch (docs/ledger.md)")
    parser.add_argument("action", choices=["check"], help="what to do: check")
    parser.add_argument("record", type=Path, nargs="+",
                        help="the record directory LedgerCheck(record=DIR) wrote, or record files in it")
    parser.add_argument("--ledger", type=Path, required=True, help="the ledger's Parquet file")
    return parser


def run_ledger(options: Any) -> Any:
    """Run ``ledger check`` with parsed options; print the result and exit with status 1 on a mismatch.

    Returns:
        The :class:`~lit_balance.lightning.ledger_record.RecordCheck` when everything matches.

    Raises:
        SystemExit: status 1 when a micro-batch differs (after printing them).
        ValueError, FileNotFoundError: as :func:`~lit_balance.lightning.ledger_record.check_record`.
    """
    from lit_balance.lightning.ledger_record import check_record

    check = options
    records = [Path(p) for p in (check.record if isinstance(check.record, list) else [check.record])]
    result = check_record(records, check.ledger)
    if result.ok:
        print(f"ledger check: {result.micro_batches} micro-batches of rank(s) {list(result.ranks)} received exactly "
              f"what the ledger {check.ledger} has", flush=True)
        return result
    for mismatch in result.mismatches[:MAX_LINES]:
        print(f"mismatch: {mismatch.message}", flush=True)
    more = len(result.mismatches) - MAX_LINES
    print(f"ledger check: {len(result.mismatches)} of {result.micro_batches} micro-batches differ from the ledger "
          f"{check.ledger}" + (f" ({more} not shown)" if more > 0 else "") + "; the first: "
          f"{result.mismatches[0].message}", flush=True)
    raise SystemExit(1)
