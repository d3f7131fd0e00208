"""Content fingerprints shared by tokenizers, corpus sources and cache keys."""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["sha256_of", "sha256_of_int64"]


def sha256_of(*parts: str | bytes) -> str:
    """Return the sha256 hex digest of ``parts``, each length-prefixed so that boundaries count.

    Example:
        >>> sha256_of("ab", "c") == sha256_of("a", "bc")
        False
    """
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def sha256_of_int64(values: np.ndarray, chunk: int = 1 << 20) -> str:
    """Return ``sha256_of(np.ascontiguousarray(values, dtype="<i8").tobytes())`` without the whole copy.

    The array (any integer dtype, e.g. an int32 memory map) is converted ``chunk`` values at a time, so memory
    stays ``8 * chunk`` bytes beyond the array whatever its size.

    Example:
        >>> a = np.arange(5, dtype=np.int32)
        >>> sha256_of_int64(a, chunk=2) == sha256_of(a.astype("<i8").tobytes())
        True
    """
    values = np.asarray(values).reshape(-1)
    digest = hashlib.sha256()
    digest.update((8 * values.shape[0]).to_bytes(8, "little"))
    for start in range(0, values.shape[0], chunk):
        digest.update(np.ascontiguousarray(values[start:start + chunk], dtype="<i8").tobytes())
    return digest.hexdigest()
