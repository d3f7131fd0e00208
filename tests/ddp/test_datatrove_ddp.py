"""Training from a datatrove token store (written by datatrove's DocumentTokenizer) on real 2-process CPU DDP (gloo):
every document once per epoch with its stored tokens, and a mid-epoch checkpoint resumed on 1 rank finishes the
epoch with every document once, as the uninterrupted 2-rank run trains it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from launch import run_scripts  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each
pytest.importorskip("datatrove")

SCRIPT = Path(__file__).with_name("fit_datatrove.py")
ROOT = SCRIPT.parents[2]
STOP_AT, MAX_LENGTH = 3, 48


def _read(out: Path, devices: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A two-task datatrove store of 300 docstrings of the standard library, the package's tokenizer (no truncation,
    padding or special tokens)."""
    import tokenizers
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    from lit_balance.data.sources import stdlib_docstrings

    root = tmp_path_factory.mktemp("datatrove")
    (root / "input").mkdir()
    docs = stdlib_docstrings()[:300]
    for part in (0, 1):
        with open(root / "input" / f"part-{part}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": d}) + "\n" for d in docs[part * 150:(part + 1) * 150])
    tok = tokenizers.Tokenizer.from_file(str(ROOT / "lit_balance/data/tokenizer/tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    tok.post_processor = None
    tok.save(str(root / "tokenizer.json"))
    steps = [JsonlReader(str(root / "input")),
             DocumentTokenizer(output_folder=str(root / "store"), tokenizer_name_or_path=str(root / "tokenizer.json"),
                               shuffle_documents=False)]
    LocalPipelineExecutor(pipeline=steps, tasks=2, workers=1, logging_dir=str(root / "logs")).run()
    return root / "store"


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    """Side by side: an uninterrupted 2-rank epoch (1 loader worker per rank) and one stopped after 3 micro-batches
    with a checkpoint (2 workers, which prefetch ahead); then the stopped one resumed on 1 rank (no worker)."""
    full_dir, stop_dir, resume_dir = (tmp_path_factory.mktemp(n) for n in ("full", "stop", "resume"))
    run_scripts(SCRIPT, {"full": [full_dir, "full", 2, 1, store], "stop": [stop_dir, "stop", 2, 2, store]}, 300)
    shutil.copy(stop_dir / "mid.ckpt", resume_dir / "mid.ckpt")
    run_scripts(SCRIPT, {"resume": [resume_dir, "resume", 1, 0, store]}, 300)
    return _read(full_dir, 2), _read(stop_dir, 2), _read(resume_dir, 1)


def _expected(store: Path) -> dict[int, list[int]]:
    """Dataset index -> the first MAX_LENGTH tokens of its document, read straight from the store (no document of
    this corpus is empty, so dataset index = store document)."""
    from lit_balance.data.stores.datatrove import DatatroveStore

    s = DatatroveStore(store)
    assert np.all(s.lengths > 0)
    return {d: s.read(d, min(int(n), MAX_LENGTH))[0].tolist() for d, n in enumerate(s.lengths)}


def _rows(records: list[dict]) -> list[list]:
    return [row for rank in records for batch in rank["batches"] for row in batch]


def test_every_document_trains_once_with_its_stored_tokens(runs, store):
    full, _, _ = runs
    expected = _expected(store)
    rows = _rows(full)
    assert full[0]["num_train"] == len(expected) == 300
    assert sorted(index for index, _ in rows) == list(range(300))  # each document once, on one of the ranks
    assert all(ids == expected[index] for index, ids in rows)
    assert len(full[0]["batches"]) == len(full[1]["batches"])  # equal micro-batch counts


def test_a_checkpoint_mid_epoch_resumes_on_one_rank_with_every_document_once(runs, store):
    full, stopped, resumed = runs
    expected = _expected(store)
    for r in (0, 1):  # the stopped run trained the uninterrupted run's first micro-batches
        assert len(stopped[r]["batches"]) == STOP_AT
        assert stopped[r]["batches"] == full[r]["batches"][:STOP_AT]
    assert resumed[0]["world_size"] == 1
    before, after = _rows(stopped), _rows(resumed)
    assert not {i for i, _ in before} & {i for i, _ in after}  # nothing trained twice
    assert sorted(i for i, _ in before + after) == list(range(300))  # nothing skipped
    assert all(ids == expected[index] for index, ids in before + after)
    # the rest is the uninterrupted run's rest, re-planned for one rank
    rest = {i for i, _ in _rows(full)} - {i for i, _ in before}
    assert {i for i, _ in after} == rest
