"""What is written under cache_dir, at its edges: the Arrow copy of a Parquet file follows the file's content (a file
replaced by another of the same size, modification time kept, is copied again), and a read-only or full cache folder
(a real read-only mount and a real 1 MiB tmpfs, mounted where the machine allows) is refused naming cache_dir and the
bytes needed, for the Parquet copy and for the tokenization cache."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lit_balance.data import load_or_build, resolve_corpus
from lit_balance.data.stores import ArrowSource
from lit_balance.data.tokenizer import TokenizerAdapter

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402


def _write_parquet(path: Path, docs: list[list[int]]) -> Path:
    """Plain-encoded, uncompressed: files of the same shapes have the same size whatever their values."""
    table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))})
    pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=40)
    return path


def _docs(seed: int, num: int = 120, length: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 1000, size=(num, length)).tolist()


def _first_document(source: ArrowSource) -> list[int]:
    store = source.store
    return store.read(0, int(store.lengths[0]))[0].tolist()


def test_a_parquet_file_replaced_with_cp_p_by_one_of_equal_size_is_copied_again(tmp_path):
    old, new = _docs(0), _docs(1)
    path = _write_parquet(tmp_path / "ids.parquet", old)
    replacement = _write_parquet(tmp_path / "other.parquet", new)
    assert path.stat().st_size == replacement.stat().st_size  # the premise: equal size
    copies = tmp_path / "cache"
    assert _first_document(ArrowSource(path, cache_dir=copies)) == old[0]
    before = path.stat()
    shutil.copy2(replacement, path)  # cp -p
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old modification time kept (rsync -t)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert _first_document(ArrowSource(path, cache_dir=copies)) == new[0]
    assert len(list((copies / "parquet").glob("*.arrow"))) == 2
    assert _first_document(ArrowSource(path, cache_dir=copies)) == new[0]  # and reused once copied
    assert len(list((copies / "parquet").glob("*.arrow"))) == 2


# -- read-only and full cache folders: real mounts ----------------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(directory: Path, options: str):
    """A tmpfs mounted at ``directory`` with ``options`` (e.g. ``ro,size=1m``), or skip where mounting is not
    permitted (not root, no mount capability in this container)."""
    directory.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command: cannot make a read-only or full folder on this machine")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}): cannot make a read-only or full "
                    "folder on this machine")
    try:
        yield directory
    finally:
        subprocess.run([shutil.which("umount"), str(directory)], capture_output=True, timeout=30, check=True)


def _needed(message: str) -> int:
    found = re.search(r"needs ([\d,]+) bytes", message)
    assert found, message
    return int(found.group(1).replace(",", ""))


def test_a_read_only_cache_dir_refuses_the_parquet_copy_naming_it_and_the_bytes(tmp_path):
    path = _write_parquet(tmp_path / "ids.parquet", _docs(0))
    cache = tmp_path / "ro"
    with _tmpfs(cache, "ro,size=1m"):
        with pytest.raises(ValueError) as info:
            ArrowSource(path, cache_dir=cache).store
        message = str(info.value)
        assert f"cache_dir {str(cache)!r} is not writable" in message and "Read-only file system" in message, message
        assert _needed(message) >= 120 * 20 * 4  # at least the ids at 4 bytes each
        assert "cache_dir=" in message and getattr(info.value, "parameter", None) == "cache_dir"


def test_a_read_only_cache_dir_refuses_the_tokenization_cache_naming_it(tmp_path):
    cache = tmp_path / "ro"
    with _tmpfs(cache, "ro,size=1m"):
        with pytest.raises(ValueError, match=rf"cache_dir {re.escape(repr(str(cache)))} is not writable "
                                             r"\(Read-only file system\).*4 bytes per token .* and 16 per "
                                             r"document.*cache_dir="):
            load_or_build(resolve_corpus([[1, 2, 3]]), TokenizerAdapter.for_token_ids(10), cache)


def test_a_full_cache_dir_refuses_the_parquet_copy_before_writing(tmp_path):
    docs = _docs(0, num=400, length=1000)  # 1.6 MB of int32 ids: more than the 1 MiB folder
    path = _write_parquet(tmp_path / "ids.parquet", docs)
    cache = tmp_path / "full"
    with _tmpfs(cache, "size=1m"):
        with pytest.raises(ValueError) as info:
            ArrowSource(path, cache_dir=cache).store
        message = str(info.value)
        assert f"cache_dir {str(cache)!r} is full" in message and "bytes free" in message, message
        assert _needed(message) >= 400 * 1000 * 4
        assert not [p for p in (cache / "parquet").iterdir() if not p.name.endswith(".lock")]  # nothing left behind


def test_a_cache_dir_that_fills_while_tokenizing_is_named_with_the_bytes_written(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, size=2000).tolist() for _ in range(200)]  # 400k ids: 1.6 MB as int32
    cache = tmp_path / "full"
    with _tmpfs(cache, "size=1m"):
        with pytest.raises(ValueError) as info:
            load_or_build(resolve_corpus(docs), TokenizerAdapter.for_token_ids(1000), cache)
        message = str(info.value)
        assert f"cache_dir {str(cache)!r} is full (No space left on device" in message, message
        written = int(re.search(r"needs more than the ([\d,]+) bytes written", message).group(1).replace(",", ""))
        assert 0 < written <= 1 << 20
        assert "LIT_BALANCE_CACHE" in message and getattr(info.value, "parameter", None) == "cache_dir"
        assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]  # the partial entry gone
