"""``lit-balance tokenize``: a JSONL corpus to a datatrove store on datatrove's LocalPipelineExecutor, the ids those of
the library's own tokenization cache, and training from the store in place (the DataModule, the Hydra recipe)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.cli import build_cli
from lit_balance.cli.tokenize import TOKENIZER_FILE, tokenize_corpus
from lit_balance.data import load_or_build, resolve_corpus
from lit_balance.data.sources import stdlib_docstrings
from lit_balance.data.stores.datatrove import DatatroveSource, DatatroveStore
from lit_balance.data.tokenizer import resolve_tokenizer

pytest.importorskip("datatrove")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-balance"])  # LightningCLI(args=...) warns when sys.argv holds more


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two JSONL files of real documents (standard-library docstrings), one row with empty text, one of spaces."""
    folder = tmp_path_factory.mktemp("corpus") / "jsonl"
    folder.mkdir()
    docs = stdlib_docstrings()[:400]
    rows = [{"text": d, "id": i} for i, d in enumerate(docs)]
    rows[7]["text"], rows[250]["text"] = "", "   "
    for part, chunk in enumerate((rows[:200], rows[200:])):
        with open(folder / f"part-{part:05d}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in chunk)
    return folder


def _documents(folder: Path) -> list[list[int]]:
    store = DatatroveStore(folder)
    return [store.read(d, int(n))[0].tolist() for d, n in enumerate(store.lengths)]


def test_the_subcommand_writes_a_store_of_the_cache_s_ids_and_the_data_module_trains_from_it(corpus, tmp_path,
                                                                                           capsys, monkeypatch):
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "default_cache"))
    out = tmp_path / "tokens"
    cli = build_cli(["tokenize", str(corpus), "--output-folder", str(out), "--tasks", "2", "--workers", "1"])
    result = cli.tokenize_result
    printed = capsys.readouterr().out
    assert f"wrote {result.num_documents} documents, {result.num_tokens} tokens in 2 .ds file(s) to {out}" in printed
    assert "2 tasks on 1 workers" in printed and f"DatatroveSource({str(out)!r})" in printed
    assert result.skipped_rows == 1 and "datatrove's reader skipped 1 input row(s)" in printed  # the empty text
    assert sorted(p.name for p in out.glob("*.ds*")) == sorted(
        f"0000{t}_unshuffled.ds{ext}" for t in (0, 1) for ext in ("", ".index", ".metadata"))
    assert (out / TOKENIZER_FILE).is_file()
    # the library's own path on the same two files: the same ids in the same order; datatrove's reader skipped the
    # empty row (the cache drops it as empty) and kept the row of spaces as a 0-token document (dropped on training)
    cached = load_or_build(resolve_corpus(sorted(corpus.glob("*.jsonl"))), resolve_tokenizer(), tmp_path / "cache")
    stored = _documents(out)
    assert [d for d in stored if d] == [cached.document(i).tolist() for i in range(len(cached))]
    assert len(stored) == 399 and sum(not d for d in stored) == 1 and cached.num_empty == 2
    assert result.num_tokens == sum(map(len, stored)) == int(cached.offsets[-1])
    # train from it in place: the vocabulary and padding id come from the tokenizer file the metadata names
    dm = BalancedTextDataModule(DatatroveSource(out), max_tokens=512, max_length=128, val_fraction=0.1)
    dm.prepare_data()
    dm.setup("fit")
    assert (dm.vocab_size, dm.pad_token_id) == (30522, 0)
    assert len(dm.train_dataset) + len(dm.val_dataset) == 398 and dm.corpus.num_empty == 1
    assert not (tmp_path / "default_cache").exists()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[1] <= 128
    # and lit-balance plan plans it from the index files
    corpus_arg = json.dumps({"class_path": "lit_balance.data.stores.datatrove.DatatroveSource",
                             "init_args": {"paths": str(out)}})
    build_cli(["plan", "--corpus", corpus_arg, "--max-tokens", "512", "--max-length", "128", "--num-replicas", "2",
               "--val-fraction", "0", "--plots", "false", "--output-dir", str(tmp_path / "plan")])
    summary = json.loads((tmp_path / "plan" / "plan_summary.json").read_text())
    assert summary["num_samples"] == 398
    assert not (tmp_path / "default_cache").exists()


def test_special_tokens_and_eos_follow_the_options(corpus, tmp_path):
    texts = [json.loads(line)["text"] for line in (corpus / "part-00000.jsonl").read_text().splitlines()]
    texts = [t for t in texts if t]
    special = tokenize_corpus(corpus / "part-00000.jsonl", tmp_path / "special", add_special_tokens=True, tasks=1)
    assert _documents(Path(special.output_folder)) == resolve_tokenizer(add_special_tokens=True).encode_batch(texts)
    eos = tokenize_corpus(corpus / "part-00000.jsonl", tmp_path / "eos", eos_token="[SEP]", tasks=1)
    plain = resolve_tokenizer().encode_batch(texts)
    assert _documents(Path(eos.output_folder)) == [ids + [102] for ids in plain]  # [SEP] = 102


def test_bad_arguments_exit_with_one_line(corpus, tmp_path, capsys):
    def fails(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            build_cli(["tokenize", *args])
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    err = fails(str(corpus), "--output-folder", str(tmp_path / "a"), "--tasks", "3")
    assert "tasks=3 but the input holds 2 file(s)" in err and "--tasks" in err
    err = fails(str(tmp_path / "nope.jsonl"), "--output-folder", str(tmp_path / "b"))
    assert "is neither a file nor a folder" in err
    err = fails(str(corpus), "--output-folder", str(tmp_path / "c"), "--glob-pattern", "*.parquet")
    assert "holds no file matching '*.parquet'" in err
    tokenize_corpus(corpus / "part-00001.jsonl", tmp_path / "d", tasks=1)
    err = fails(str(corpus), "--output-folder", str(tmp_path / "d"))
    assert "holds .ds files already" in err and "--output-folder" in err


@pytest.mark.slow
def test_the_console_script_and_the_recipe_train_from_the_store(corpus, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "LIT_BALANCE_CACHE": str(tmp_path / "default_cache")}
    out = tmp_path / "tokens"
    done = subprocess.run([sys.executable, "-m", "lit_balance.cli", "tokenize", str(corpus / "part-00000.jsonl"),
                           "--output-folder", str(out)], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote 199 documents" in done.stdout
    overrides = ["experiment=smoke", "data=datatrove", f"data.corpus.paths={out}", "data.num_workers=1",
                 "data.max_tokens=512", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), *overrides], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "datatrove store (1 file, 199 documents" in done.stdout
    assert re.search(r"last train/loss \d+\.\d+", done.stdout)
    assert not (tmp_path / "default_cache").exists()  # nothing went through the tokenization cache
    assert np.fromfile(out / "00000_unshuffled.ds.index", "<u8").size == 199


def test_several_workers_tokenize_on_one_thread_each_and_the_setting_is_restored(corpus, tmp_path, monkeypatch):
    from datatrove.executor import LocalPipelineExecutor

    seen = []
    run = LocalPipelineExecutor.run
    monkeypatch.setattr(LocalPipelineExecutor, "run",
                        lambda self: (seen.append(os.environ.get("TOKENIZERS_PARALLELISM")), run(self))[1])
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    tokenize_corpus(corpus, tmp_path / "two", workers=2, tasks=2)
    tokenize_corpus(corpus, tmp_path / "one", workers=1, tasks=2)
    assert seen == ["false", None] and "TOKENIZERS_PARALLELISM" not in os.environ
    assert _documents(tmp_path / "two") == _documents(tmp_path / "one")  # the same ids either way
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the caller's own setting wins
    tokenize_corpus(corpus, tmp_path / "mine", workers=2, tasks=2)
    assert seen[-1] == "true" and os.environ["TOKENIZERS_PARALLELISM"] == "true"
