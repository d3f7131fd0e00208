"""The tokenization cache at its seams: content staleness, file modes, leftovers, read-only dirs, non-regular files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lit_balance.data.cache import build_cache, cache_key, load_cache, load_or_build
from lit_balance.data.sources import files as files_module
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer


@pytest.fixture(scope="module")
def tok() -> TokenizerAdapter:
    return resolve_tokenizer()


def _forbid_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self, texts):
        raise AssertionError("the corpus was tokenized")

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", fail)


# -- staleness by content -------------------------------------------------------------------------------------

def test_an_edit_keeping_size_and_mtime_rebuilds(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n", encoding="utf-8")
    before = os.stat(path)
    first = load_or_build(resolve_corpus(path), tok, tmp_path / "cache")
    assert first.token_ids.tolist() == tok.encode_batch(["hello world"])[0]
    # the `cp -p` / `rsync -t` case: other bytes, same size, same mtime
    path.write_text("again world\n", encoding="utf-8")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = load_or_build(resolve_corpus(path), tok, tmp_path / "cache")
    assert second.token_ids.tolist() == tok.encode_batch(["again world"])[0]


def test_the_key_follows_content_not_path_or_mtime(tmp_path, tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b" / "a.jsonl"
    a.write_text('{"text": "same words"}\n', encoding="utf-8")
    b.parent.mkdir()
    shutil.copy(a, b)  # same bytes, another path and mtime
    os.utime(b, (1, 1))
    assert cache_key(resolve_corpus(a), tok) == cache_key(resolve_corpus(b), tok)
    # the format counts: the same bytes as plain text are other documents
    c = tmp_path / "a.txt"
    shutil.copy(a, c)
    assert cache_key(resolve_corpus(c), tok) != cache_key(resolve_corpus(a), tok)
    assert cache_key(resolve_corpus(a, text_key="body"), tok) != cache_key(resolve_corpus(a), tok)


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.jsonl"])
def test_a_file_changed_while_it_is_read_is_not_cached_under_the_old_key(tmp_path, tok, monkeypatch, name):
    """The file is edited (same size) after its first block was read: what was read is not what was hashed."""
    path = tmp_path / name
    lines = ["first", *["filler"] * 3000, "later"]  # longer than a read buffer: "later" is read after the edit
    if name.endswith(".jsonl"):
        lines = [json.dumps({"text": line}) for line in lines]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = resolve_corpus(path)
    monkeypatch.setattr(files_module, "_READ_BLOCK", 8)
    split = files_module._split_lines

    def edit_after_the_first_block(text):
        path.write_text(path.read_text(encoding="utf-8").replace("later", "other"), encoding="utf-8")
        return split(text)

    monkeypatch.setattr(files_module, "_split_lines", edit_after_the_first_block)
    with pytest.raises(RuntimeError, match=r"changed while it was tokenized; run again"):
        build_cache(source, tok, tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []


def test_a_file_changed_after_it_was_read_keeps_the_entry_of_what_was_read(tmp_path, tok, monkeypatch):
    """An edit once the file was read (here: while its only chunk is encoded) leaves an entry keyed by the content
    that was read and tokenized; the edited file has another key, so it is built anew."""
    path = tmp_path / "corpus.txt"
    path.write_text("first text\n", encoding="utf-8")
    source = resolve_corpus(path)
    key = cache_key(source, tok)
    encode = TokenizerAdapter.encode_batch_deferred

    def edit_then_encode(self, texts):
        path.write_text("other text\n", encoding="utf-8")
        return encode(self, texts)

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", edit_then_encode)
    entry = build_cache(source, tok, tmp_path / "cache")
    monkeypatch.undo()
    assert entry.name == key != cache_key(source, tok)
    assert np.load(entry / "token_ids.npy").tolist() == tok.encode_batch(["first text"])[0]
    assert load_cache(source, tok, tmp_path / "cache") is None
    path.write_text("first text\n", encoding="utf-8")
    assert load_cache(source, tok, tmp_path / "cache").token_ids.tolist() == tok.encode_batch(["first text"])[0]


@pytest.mark.parametrize("files", [
    {"a.jsonl": b'\xef\xbb\xbf{"text": "x"}\r\n\n{"prompt": "p", "completion": "c"}'},
    {"a.txt": b"one\rtwo\n\nthree", "b.jsonl": b'{"text": "y"}\n'},
    {"a.txt": "caf\u00e9\n".encode() * 5000},
])
@pytest.mark.parametrize("txt_documents", ["line", "paragraph"])
def test_the_digest_of_what_was_read_equals_a_fresh_hash_of_the_files(tmp_path, tok, monkeypatch, files,
                                                                       txt_documents):
    monkeypatch.setattr(files_module, "_READ_BLOCK", 1000)  # several blocks, cut inside multi-byte characters
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    source = resolve_corpus(paths, txt_documents=txt_documents)
    assert source.fingerprint_of_read() is None
    chunks = source.iter_chunks(max_docs=2)
    next(chunks)
    if txt_documents == "line" and sum(map(len, files.values())) > 2000:  # many blocks: not all read yet
        assert source.fingerprint_of_read() is None
    for _ in chunks:
        pass
    assert source.fingerprint_of_read() == source.content_fingerprint()
    expected = cache_key(source, tok)
    assert build_cache(source, tok, tmp_path / "cache").name == expected


# -- file modes -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["umask022", "umask002"])
def test_entries_honour_the_umask(tmp_path, tok, umask):
    old = os.umask(umask)
    try:
        entry = build_cache(resolve_corpus(["shared by a group"]), tok, tmp_path / "cache")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [entry, *entry.iterdir()]}
    expected = {name: 0o666 & ~umask for name in ["meta.json", "offsets.npy", "source_index.npy", "token_ids.npy"]}
    assert modes == {entry.name: 0o777 & ~umask, **expected}


# -- leftovers of killed builds -------------------------------------------------------------------------------

_STUCK_BUILD = """
import sys, time
from lit_balance.data import cache
from lit_balance.data.cache import build_cache
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import TokenizerAdapter

def stuck(*args, **kwargs):  # the build is inside its temporary directory when it stops here
    print("writing", flush=True)
    time.sleep(300)

cache._array_sha256 = stuck  # called on the written arrays, before the rename
build_cache(resolve_corpus([[int(sys.argv[2]), 1]]), TokenizerAdapter.for_token_ids(10), sys.argv[1])
"""


def _stuck_build(cache_dir: Path, token: int) -> subprocess.Popen:
    """A build in another process, stopped while it writes its temporary directory."""
    process = subprocess.Popen([sys.executable, "-c", _STUCK_BUILD, str(cache_dir), str(token)],
                               stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    line = ""
    with contextlib.suppress(Exception):
        line = process.stdout.readline()  # blocks until the child writes or dies
    if line.strip() != "writing":
        process.kill()
        process.wait(30)
        pytest.fail(f"the stuck build did not start (exit code {process.returncode})")
    return process


def _tmp_names(cache_dir: Path) -> set[str]:
    return {name for name in os.listdir(cache_dir) if name.startswith(".tmp-")}


def _aged(path: Path, seconds: float) -> Path:
    path.mkdir()
    (path / "token_ids.npy").write_bytes(b"x" * 100)
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_leftovers_of_killed_builds_are_removed_and_live_builds_kept(tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    adapter = TokenizerAdapter.for_token_ids(10)
    live = _stuck_build(cache_dir, 2)
    try:
        live_names = _tmp_names(cache_dir)
        killed = _stuck_build(cache_dir, 3)
        killed_names = _tmp_names(cache_dir) - live_names
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert live_names and killed_names
        old_trash = _aged(cache_dir / ".trash-0123456789abcdef-1-aa", 3600)
        young_trash = _aged(cache_dir / ".trash-0123456789abcdef-2-bb", 0)
        old_unlocked = _aged(cache_dir / ".tmp-0123456789abcdef-3-cc", 2 * 24 * 3600)
        young_unlocked = _aged(cache_dir / ".tmp-0123456789abcdef-4-dd", 3600)

        entry = build_cache(resolve_corpus([[4, 5]]), adapter, cache_dir)

        left = set(os.listdir(cache_dir))
        assert left == {entry.name, *live_names, young_trash.name, young_unlocked.name}, left
        assert old_trash.name not in left and old_unlocked.name not in left
    finally:
        live.kill()
        live.wait(30)
    # the live build died too: the next build removes its leftovers
    entry = build_cache(resolve_corpus([[6]]), adapter, cache_dir)
    assert not _tmp_names(cache_dir) - {young_unlocked.name}
    assert entry.name in os.listdir(cache_dir)


# -- read-only cache dir --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _read_only(directory: Path):
    """Make ``directory`` read-only for this process (root ignores modes: then ``chattr +i``), or skip."""
    directory.chmod(0o555)
    immutable = False
    try:
        probe = directory / ".probe"
        try:
            probe.touch()
        except OSError:
            pass
        else:  # running as root
            probe.unlink()
            chattr = shutil.which("chattr")
            if chattr is None or subprocess.run([chattr, "+i", str(directory)], capture_output=True,
                                                timeout=30).returncode:
                pytest.skip("cannot make a directory read-only for this user here (root without chattr +i)")
            immutable = True
        yield directory
    finally:
        if immutable:
            subprocess.run([shutil.which("chattr"), "-i", str(directory)], capture_output=True, timeout=30)
        directory.chmod(0o755)


def test_a_read_only_cache_dir_fails_before_tokenizing(tmp_path, tok, monkeypatch):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    source = resolve_corpus(["never tokenized"])
    with _read_only(cache_dir):
        _forbid_encoding(monkeypatch)
        with pytest.raises(ValueError) as info:
            load_or_build(source, tok, cache_dir)
        message = str(info.value)
        for word in (f"cache_dir {str(cache_dir)!r} is not writable", "cache_dir=", "LIT_BALANCE_CACHE"):
            assert word in message, message
        with pytest.raises(ValueError, match=r"cache_dir .*missing.* is not writable.*LIT_BALANCE_CACHE"):
            load_or_build(source, tok, cache_dir / "missing")  # cannot even be created


def test_a_read_only_cache_dir_still_serves_its_entries(tmp_path, tok, monkeypatch):
    cache_dir = tmp_path / "cache"
    source = resolve_corpus(["built before"])
    expected = load_or_build(source, tok, cache_dir).token_ids.tolist()
    with _read_only(cache_dir):
        _forbid_encoding(monkeypatch)
        assert load_or_build(source, tok, cache_dir).token_ids.tolist() == expected


# -- non-regular corpus files ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _deadline(seconds: int):
    """Turn a call that blocks (e.g. opening a FIFO without a writer) into a failure instead of a hang."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_as_the_corpus_is_refused_without_blocking(tmp_path, tok):
    fifo = tmp_path / "docs.txt"
    os.mkfifo(fifo)
    with _deadline(10), pytest.raises(ValueError, match=r"docs\.txt.*cannot be read: it is a pipe or FIFO, "
                                                        r"not a regular file"):
        resolve_corpus(fifo)
    with _deadline(10), pytest.raises(ValueError, match="pipe or FIFO"):
        resolve_corpus(str(fifo))


def test_an_anonymous_pipe_as_the_corpus_is_refused_without_blocking():
    read_end, write_end = os.pipe()  # e.g. what `--corpus <(zcat docs.txt.gz)` hands over as /dev/fd/N
    try:
        path = Path(f"/dev/fd/{read_end}")
        if not path.exists():
            pytest.skip("needs /dev/fd")
        with _deadline(10), pytest.raises(ValueError, match=r"cannot be read: it is a pipe or FIFO"):
            resolve_corpus(path)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_file_replaced_by_a_fifo_after_resolving_is_refused_without_blocking(tmp_path, tok):
    path = tmp_path / "docs.txt"
    path.write_text("a document\n", encoding="utf-8")
    source = resolve_corpus(path)
    path.unlink()
    os.mkfifo(path)
    with _deadline(10), pytest.raises(ValueError, match="it is a pipe or FIFO"):
        load_or_build(source, tok, tmp_path / "cache")
    with _deadline(10), pytest.raises(ValueError, match="it is a pipe or FIFO"):
        source.load_texts()


def test_a_character_device_is_refused(tok):
    if not os.path.exists("/dev/null"):
        pytest.skip("needs /dev/null")
    with pytest.raises(ValueError, match=r"/dev/null.*it is a character device, not a regular file"):
        resolve_corpus(Path("/dev/null"))


def test_the_garbage_collector_is_paused_while_tokenizing_and_restored(tmp_path, tok, monkeypatch):
    import gc

    seen = []
    encode = TokenizerAdapter.encode_batch_deferred

    def recording(self, texts):
        seen.append(gc.isenabled())
        return encode(self, texts)

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", recording)
    assert gc.isenabled()
    build_cache(resolve_corpus(["hello world", "more text"]), tok, tmp_path / "on")
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        build_cache(resolve_corpus(["other text"]), tok, tmp_path / "off")
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_the_garbage_collector_is_restored_when_tokenizing_fails(tmp_path, tok, monkeypatch):
    import gc

    def fail(self, texts):
        raise RuntimeError("tokenizer broke")

    monkeypatch.setattr(TokenizerAdapter, "encode_batch_deferred", fail)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        build_cache(resolve_corpus(["hello world"]), tok, tmp_path / "cache")
    assert gc.isenabled()
