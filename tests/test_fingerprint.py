"""Content fingerprints: the chunked int64 digest is the digest of the whole array's int64 bytes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance._fingerprint import sha256_of, sha256_of_int64


@settings(deadline=None, max_examples=60)
@given(values=st.lists(st.integers(0, 2**31 - 1), max_size=300),
       dtype=st.sampled_from([np.int32, np.int64, np.uint16, np.uint32]), chunk=st.integers(1, 50))
def test_chunked_digest_is_the_whole_arrays(values, dtype, chunk):
    arr = np.asarray(values, dtype=np.int64)
    arr = arr % (2**16) if dtype == np.uint16 else arr
    typed = arr.astype(dtype)
    assert sha256_of_int64(typed, chunk=chunk) == sha256_of(np.ascontiguousarray(typed, dtype="<i8").tobytes())


def test_chunked_digest_reads_a_memory_map(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(10_000, dtype=np.int32))
    mapped = np.load(path, mmap_mode="r")
    assert sha256_of_int64(mapped, chunk=999) == sha256_of(np.arange(10_000, dtype="<i8").tobytes())
