"""docs/schedules.md: the length warm-up example runs as written and trains every token of its documents once."""

import re
from pathlib import Path

import numpy as np

from lit_balance import TokenDataset

PAGE = Path(__file__).resolve().parents[2] / "docs" / "schedules.md"


def test_the_length_warmup_example_runs_and_loses_no_token():
    code = re.search(r"## Length warm-up.*?```python\n.*?```.*?```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 3000, size=60)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    dataset = TokenDataset(rng.integers(1, 100, size=int(offsets[-1])), offsets, np.arange(lengths.size))
    trained = 0
    for rank in range(2):
        scope = {"dataset": dataset, "world_size": 2, "rank": rank}
        exec(compile(code, str(PAGE), "exec"), scope)
        for batch in scope["loader"]:
            cu = batch["cu_seq_lens_q"].diff()
            keep = ~batch["is_fill"]
            trained += int(cu[: keep.numel()][keep].sum())
            assert int(cu.max()) <= 4096
    assert trained == int(lengths.sum())


def test_the_datamodule_example_builds_with_a_warm_up(tmp_path, monkeypatch):
    code = re.search(r"## Length warm-up.*?```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "cache"))
    scope = {}
    exec(compile(code, str(PAGE), "exec"), scope)
    assert scope["dm"].max_length_schedule.points_as_given() == [(0, 256), (1000, 4096)]
