"""Stores made on Ray, in one local Ray session of 2 CPUs (loopback only; about 5 s to start on a quiet machine):

* ``lit-balance tokenize --executor ray`` (datatrove's ``RayPipelineExecutor``) writes the files of the local
  executor, byte for byte;
* the Ray Data path of ``docs/store_arrow.md`` (read JSONL, tokenize in ``map_batches``, ``write_parquet``), run as
  written, gives the plans and micro-batches of the same documents through the tokenization cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.cli.tokenize import tokenize_corpus
from lit_balance.data.sources import stdlib_docstrings
from tests.data.test_stores import assert_same_batches, epoch_batches

ray = pytest.importorskip("ray")
pytest.importorskip("datatrove")
pytestmark = pytest.mark.slow  # a local Ray: seconds to start, shared by this module's tests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_ray_session():
    """The tests share the Ray that the first one starts; it is shut down after the last."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """``corpus/part-0000{0,1}.jsonl``: 160 docstrings of the standard library (no empty one)."""
    root = tmp_path_factory.mktemp("ray")
    (root / "corpus").mkdir()
    docs = [d for d in stdlib_docstrings()[:200] if d.strip()][:160]
    for part in (0, 1):
        with open(root / "corpus" / f"part-{part:05d}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": d}) + "\n" for d in docs[part * 80:(part + 1) * 80])
    return root


def test_the_ray_executor_writes_the_local_executor_s_files_byte_for_byte(corpus, tmp_path):
    local = tokenize_corpus(corpus / "corpus", tmp_path / "local", tasks=2, workers=1)
    on_ray = tokenize_corpus(corpus / "corpus", tmp_path / "ray", tasks=2, workers=2, executor="ray")
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2  # the local Ray it started
    assert on_ray.executor == "ray" and on_ray.num_documents == local.num_documents == 160
    names = sorted(p.name for p in (tmp_path / "local").glob("*.ds*"))
    assert names == sorted(p.name for p in (tmp_path / "ray").glob("*.ds*")) and len(names) == 6
    for name in names:
        mine, theirs = (tmp_path / "ray" / name).read_bytes(), (tmp_path / "local" / name).read_bytes()
        if name.endswith(".metadata"):  # names the tokenizer file, which lies in each output folder
            mine, theirs = (x.replace(str(tmp_path / d).encode(), b"OUT") for x, d in ((mine, "ray"),
                                                                                     (theirs, "local")))
        assert mine == theirs, name


def _blocks(page: Path, heading: str) -> list[str]:
    """The python code blocks of ``page`` under ``heading`` (up to the next heading of that level)."""
    text = page.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_documented_ray_data_path_trains_as_the_tokenization_cache(corpus, tmp_path, monkeypatch):
    tokenize_block, train_block = _blocks(ROOT / "docs" / "store_arrow.md", "Ray Data: tokenize to Parquet, train in "
                                                                            "place")
    monkeypatch.chdir(corpus)
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "cache_root"))
    if ray.is_initialized():  # started by the test above: the block's ray.init would refuse a second one
        tokenize_block = tokenize_block.replace("ray.init(", "ray.init(ignore_reinit_error=True, ", 1)
    exec(compile(tokenize_block, "store_arrow.md (Ray Data)", "exec"), {})  # noqa: S102  as written
    namespace: dict = {}
    exec(compile(train_block, "store_arrow.md (train)", "exec"), namespace)  # noqa: S102
    dm = namespace["dm"]
    reference = BalancedTextDataModule(sorted((corpus / "corpus").glob("*.jsonl")), max_tokens=4096, max_length=512,
                                       cache_dir=tmp_path / "cache")
    for module in (dm, reference):
        module.prepare_data()
        module.setup("fit")
    assert dm.corpus.num_empty == 0 and len(dm.corpus) == len(reference.corpus) == 160
    for epoch in (0, 1):
        assert_same_batches(epoch_batches(dm, epoch), epoch_batches(reference, epoch))
    assert_same_batches(list(dm.val_dataloader()[0]), list(reference.val_dataloader()[0]))
