"""A cache folder that cannot take what must be written there: one error naming ``cache_dir`` and the bytes needed.

The tokenization cache (:mod:`lit_balance.data.cache`) and the Arrow copies of Parquet files
(:mod:`lit_balance.data.stores.parquet`) write under ``cache_dir``. A read-only folder (a read-only mount, no write
permission) or a full one (no space left, a quota) surfaces from the operating system as an ``OSError`` naming a
temporary file; :func:`cache_dir_error` turns it into an :class:`~lit_balance.errors.InputValueError` that names
``cache_dir``, the bytes the write needs (or had written when the folder filled: a lower bound) and the bytes free,
and the setting to change. :func:`check_free_space` refuses a write whose size is known before it starts.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from lit_balance.errors import InputValueError

__all__ = ["FULL", "READ_ONLY", "cache_dir_error", "check_free_space", "free_bytes", "is_cache_dir_error"]

#: errno values of a folder that takes no write, and of one that is full.
READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_ADVICE = ("pass another cache_dir= (--data.cache_dir) or set the environment variable LIT_BALANCE_CACHE to a "
           "writable folder with room (cache_dir=None uses $LIT_BALANCE_CACHE, else $XDG_CACHE_HOME/lit_balance, "
           "else ~/.cache/lit_balance)")


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes free to an unprivileged writer in ``folder`` (or its nearest existing parent), or None if unknown."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return None


def is_cache_dir_error(error: BaseException) -> bool:
    """Whether ``error`` says the folder is read-only or full (not, e.g., a missing input file)."""
    return isinstance(error, OSError) and error.errno in READ_ONLY | FULL


def cache_dir_error(cache_dir: str | os.PathLike, error: OSError, *, what: str, needed: int | None = None,
                    written: int | None = None, rule: str | None = None) -> InputValueError:
    """The error to raise for ``error``, an ``OSError`` of a write under ``cache_dir``.

    Args:
        cache_dir: the cache folder (the setting's value).
        error: the operating system's error (``EROFS``, ``EACCES``, ``ENOSPC``, ...).
        what: what was being written, e.g. ``"the tokenized corpus"``.
        needed: bytes the write needs, when known.
        written: bytes written when the folder filled (a lower bound of what is needed), when ``needed`` is not known.
        rule: how the size follows from the data, when neither is known (e.g. before tokenizing).
    """
    free = free_bytes(cache_dir)
    free_text = "unknown" if free is None else f"{free:,}"
    if needed is not None:
        need_text = f"needs {needed:,} bytes"
    elif written is not None:
        need_text = f"needs more than the {written:,} bytes written when it failed"
    else:
        need_text = rule or "needs room for it"
    if error.errno in FULL:
        state = f"is full ({error.strerror or error}; {free_text} bytes free)"
    else:
        state = f"is not writable ({error.strerror or error})"
    return InputValueError(f"cache_dir {os.fspath(cache_dir)!r} {state}: expected a writable folder for {what}, which "
                           f"{need_text}; {_ADVICE}", parameter="cache_dir")


def check_free_space(cache_dir: str | os.PathLike, folder: str | os.PathLike, needed: int, *, what: str) -> None:
    """Refuse a write of ``needed`` bytes into ``folder`` (under ``cache_dir``) that cannot fit.

    Raises:
        ValueError: fewer than ``needed`` bytes are free there (naming ``cache_dir``, both figures and the setting).
    """
    free = free_bytes(folder)
    if free is not None and free < needed:
        raise cache_dir_error(cache_dir, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), what=what, needed=needed)
