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
    assert result.skipped_rows == 1 and result.skipped == {"empty text": 1}  # the empty row
    assert "skipped 1 input row(s) under --text-key 'text': 1 empty text" in printed
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
    (tmp_path / "a_file").write_text("not a folder")
    for output, got in ((tmp_path / "a_file", "got an existing file"),
                        (tmp_path / "a_file" / "sub", f"got a path under the file {str(tmp_path / 'a_file')!r}")):
        err = fails(str(corpus), "--output-folder", str(output))
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"--output-folder {str(output)!r}: expected a new or empty folder, {got}" in err, err
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_the_output_folder_says_its_tokenizer_and_a_run_with_another_is_refused(corpus, tmp_path):
    """``tokenize`` writes ``tokenizer_identity.json`` beside the store; the store then refuses a run with a tokenizer
    other than the one it was written with, and takes the same one."""
    from lit_balance import BalancedTextDataModule
    from lit_balance.data.stores import DatatroveSource
    from lit_balance.data.tokenizer_identity import read_sidecar

    tokenizer = tmp_path / "swapped.json"
    data = json.loads((ROOT / "lit_balance" / "data" / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    tokenizer.write_text(json.dumps(data), encoding="utf-8")
    out = tokenize_corpus(corpus / "part-00000.jsonl", tmp_path / "tokens", tokenizer, tasks=1).output_folder
    said = read_sidecar(Path(out) / "tokenizer_identity.json")
    assert said.name == str(tokenizer) and len(said.sha256) == 64
    kwargs = {"max_tokens": 1024, "val_fraction": 0, "cache_dir": tmp_path / "cache"}
    with pytest.raises(ValueError, match=r"swapped\.json.*the built-in tokenizer.*allow_tokenizer_mismatch=True"):
        BalancedTextDataModule(DatatroveSource(out), tokenizer=resolve_tokenizer(None), **kwargs)
    assert BalancedTextDataModule(DatatroveSource(out), tokenizer=str(tokenizer), **kwargs).vocab_size == 30522


@pytest.mark.slow
@pytest.mark.e2e
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

    class Stop(Exception):
        pass

    def record_only(self):  # the setting where the workers would start; the pool itself ran above
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        raise Stop

    monkeypatch.setattr(LocalPipelineExecutor, "run", record_only)
    with pytest.raises(Stop):
        tokenize_corpus(corpus, tmp_path / "mine", workers=2, tasks=2)
    assert seen[-1] == "true" and os.environ["TOKENIZERS_PARALLELISM"] == "true"  # kept, also when the run fails


# -- bad rows, empty runs, reused logging folders -------------------------------------------------------------------

def _bad_rows_corpus(folder: Path) -> tuple[Path, list[str]]:
    """One file of good rows among rows datatrove's own reader crashes on or drops the file at; the good texts."""
    folder.mkdir(parents=True)
    good = stdlib_docstrings()[:12]
    lines = [json.dumps({"text": good[0]}).encode(),
             json.dumps({"text": 7}).encode(),  # text not a string: an int
             json.dumps({"text": good[1]}).encode(),
             json.dumps({"text": ["a", "list"]}).encode(),
             json.dumps({"text": None}).encode(),
             json.dumps({"body": "no text key"}).encode(),
             b'{"text": "invalid \xff\xfe UTF-8"}',  # one invalid UTF-8 byte: this row only
             b'{"text": "not json',
             json.dumps([1, 2]).encode(),
             json.dumps({"text": ""}).encode(),
             *[json.dumps({"text": t}).encode() for t in good[2:]]]
    (folder / "part-00000.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return folder, good


def test_bad_rows_are_counted_by_cause_and_the_file_s_good_rows_kept(tmp_path, capsys):
    folder, good = _bad_rows_corpus(tmp_path / "in")
    out = tmp_path / "tokens"
    result = build_cli(["tokenize", str(folder), "--output-folder", str(out), "--tasks", "1"]).tokenize_result
    assert result.skipped == {"text not a string": 3, "no text key": 1, "invalid UTF-8": 1, "invalid JSON": 1,
                              "not a JSON object": 1, "empty text": 1}
    printed = capsys.readouterr().out
    assert ("skipped 8 input row(s) under --text-key 'text': 1 empty text, 1 invalid JSON, 1 invalid UTF-8, 1 no text "
            "key, 1 not a JSON object, 3 text not a string; the other rows of their files are in the store") in printed
    tok = resolve_tokenizer()
    assert _documents(out) == [list(ids) for ids in tok.encode_batch(good)]  # every good row, in order
    log = "".join(p.read_text() for p in (out / "logs" / "logs").glob("*.log"))
    assert "part-00000.jsonl:7: skipped, invalid UTF-8 (byte b'\\xff' at 18)" in log


def test_a_run_that_writes_no_document_names_the_input_and_the_text_key(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "latin1.jsonl").write_bytes("{\"text\": \"caf\xe9\"}\n".encode("latin-1") * 3)  # not UTF-8 at all
    (folder / "other_key.jsonl").write_text(json.dumps({"content": "words"}) + "\n")
    with pytest.raises(ValueError, match=rf"no document was written to .*: no row of '{folder}' has a non-empty text "
                                         r"under the key 'text' \(3 invalid UTF-8, 1 no text key\); check --text-key"):
        tokenize_corpus(folder, tmp_path / "out", tasks=1)
    with pytest.raises(ValueError, match=r"under the key 'body' \(no row read\)"):
        tokenize_corpus(folder / "empty.jsonl", tmp_path / "out2", text_key="body", tasks=1)


def test_a_logging_folder_of_another_run_is_refused(corpus, tmp_path):
    tokenize_corpus(corpus / "part-00000.jsonl", tmp_path / "first", tasks=1, logging_dir=tmp_path / "logs")
    with pytest.raises(ValueError, match=r"logging folder .*logs' holds completion markers of another run \(1 task\(s\) "
                                         r"marked done, e.g. 00000\): datatrove would skip those tasks .* --logging-dir"):
        tokenize_corpus(corpus, tmp_path / "second", tasks=2, logging_dir=tmp_path / "logs")
    assert not list((tmp_path / "second").glob("*.ds"))


# -- executors: names, Ray missing or unreachable, Slurm without a cluster ---------------------------------------------

def test_a_wrong_executor_or_option_is_named(corpus, tmp_path):
    with pytest.raises(ValueError, match="--executor must be one of local, ray, slurm, got 'dask'"):
        tokenize_corpus(corpus, tmp_path / "a", executor="dask")
    with pytest.raises(ValueError, match=r"--executor-options: LocalPipelineExecutor takes no 'partition' \(it takes "):
        tokenize_corpus(corpus, tmp_path / "b", tasks=1, executor_options={"partition": "cpu"})
    err = _cli_error(["tokenize", str(corpus), "--output-folder", str(tmp_path / "c"), "--executor-options", "[1]"])
    assert "--executor-options must be a JSON object" in err


def _cli_error(args: list[str]) -> str:
    import contextlib
    import io

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), pytest.raises(SystemExit) as exit_info:
        build_cli(args)
    assert exit_info.value.code == 2
    return stream.getvalue()


def test_ray_not_installed_or_not_reachable_is_a_clear_error_never_a_hang(corpus, tmp_path, monkeypatch):
    import socket
    import time

    try:
        import ray
    except ImportError:
        ray = None
    monkeypatch.setitem(sys.modules, "ray", None)  # as without Ray installed
    with pytest.raises(ImportError, match=r'--executor ray runs datatrove\'s RayPipelineExecutor, which needs Ray: '
                                          r'pip install -e "\.\[ray\]"'):
        tokenize_corpus(corpus, tmp_path / "a", executor="ray")
    if ray is None:
        pytest.skip("ray is not installed (the test extra installs it)")
    monkeypatch.setitem(sys.modules, "ray", ray)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"--ray-address '127.0.0.1:{port}': no Ray cluster answers at "
                                         rf"127.0.0.1:{port}.*ray start --head"):
        tokenize_corpus(corpus, tmp_path / "b", executor="ray", ray_address=f"127.0.0.1:{port}", timeout_s=5)
    assert time.monotonic() - start < 30


def _fake_sbatch(folder: Path, body: str) -> None:
    folder.mkdir(exist_ok=True)
    sbatch = folder / "sbatch"
    sbatch.write_text(f"#!/bin/sh\n{body}\n")
    sbatch.chmod(0o755)


def test_slurm_writes_datatrove_s_job_script_with_the_options_and_submits_it(corpus, tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    _fake_sbatch(bin_dir, f'for last; do :; done; cp "$last" {tmp_path}/submitted-$$.slurm; '
                          'echo "Submitted batch job 4242"')  # sbatch [options] SCRIPT
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    options = {"partition": "cpu-long", "time": "03:30:00", "cpus_per_task": 3, "mem_per_cpu_gb": 5,
               "sbatch_args": {"account": "tokens-proj"}, "venv_path": "/shared/venv/bin/activate"}
    out = tmp_path / "tokens"
    result = build_cli(["tokenize", str(corpus), "--output-folder", str(out), "--tasks", "2", "--executor", "slurm",
                        "--executor-options", json.dumps(options)]).tokenize_result
    assert result.job_id == "4242" and result.executor == "slurm"
    script = (out / "logs" / "launch_script.slurm").read_text()
    submitted = [p.read_text() for p in tmp_path.glob("submitted-*.slurm")]  # the job, then datatrove's stats merge
    assert script in submitted  # what sbatch received is datatrove's script
    for line in ("#SBATCH --partition=cpu-long", "#SBATCH --time=03:30:00", "#SBATCH --cpus-per-task=3",
                 "#SBATCH --mem-per-cpu=5G", "#SBATCH --account=tokens-proj", "#SBATCH --array=0-1",
                 "#SBATCH --job-name=lit_balance_tokenize", "source /shared/venv/bin/activate"):
        assert line in script, (line, script)
    assert f"launch_pickled_pipeline {out / 'logs' / 'executor.pik'}" in script
    assert "submitted Slurm job 4242: 2 tasks tokenizing into" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--executor slurm needs time in --executor-options"):
        tokenize_corpus(corpus, tmp_path / "t2", executor="slurm", executor_options={"partition": "cpu"})


def test_slurm_without_sbatch_or_with_a_hanging_one_is_a_clear_error(corpus, tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("PATH", str(tmp_path / "empty_bin"))
    options = {"partition": "cpu", "time": "01:00:00"}
    with pytest.raises(ValueError, match="--executor slurm submits datatrove's job with sbatch, which is not on PATH"):
        tokenize_corpus(corpus, tmp_path / "a", executor="slurm", executor_options=options)
    _fake_sbatch(tmp_path / "bin", "sleep 60")  # a cluster that does not answer
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"--executor slurm: sbatch did not answer within 2 s"):
        tokenize_corpus(corpus, tmp_path / "b", executor="slurm", executor_options=options, timeout_s=2)
    assert time.monotonic() - start < 30
