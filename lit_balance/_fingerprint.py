"""Content fingerprints shared by tokenizers, corpus sources and cache keys."""

from __future__ import annotations

import hashlib
from typing import BinaryIO

import numpy as np

__all__ = ["sha256_of", "sha256_of_int64", "sha256_of_stream"]

HASH_BLOCK = 1 << 22  # bytes read per update by sha256_of_stream unless told otherwise


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
        digest.update(memoryview(np.ascontiguousarray(values[start:start + chunk], dtype="<i8")))
    return digest.hexdigest()


def sha256_of_stream(handle: BinaryIO, block_size: int = HASH_BLOCK) -> tuple[int, str]:
    """Return the number of bytes and the sha256 hex digest of what a binary handle reads until its end.

    The handle is read ``block_size`` bytes at a time, so memory stays one block whatever the size of the file;
    the caller opens (and closes) it, and errors of ``read`` reach the caller as they are.

    Args:
        handle: an open binary file object (anything with ``read(n) -> bytes``), read from where it stands.
        block_size: bytes per ``read`` call.

    Returns:
        ``(size in bytes, sha256 hex digest)`` of the bytes read.

    Example:
        >>> import io
        >>> sha256_of_stream(io.BytesIO(b"abc"), block_size=2) == (3, hashlib.sha256(b"abc").hexdigest())
        True
    """
    digest, size = hashlib.sha256(), 0
    for block in iter(lambda: handle.read(block_size), b""):
        digest.update(block)
        size += len(block)
    return size, digest.hexdigest()
