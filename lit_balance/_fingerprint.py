"""Content fingerprints shared by tokenizers, corpus sources and cache keys."""

from __future__ import annotations

import hashlib

__all__ = ["sha256_of"]


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
