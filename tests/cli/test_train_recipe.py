"""The main job, recipes/train.py on conf/config.yaml, as a user runs it: a Hydra app, 2 CPU DDP ranks."""

import csv
import fcntl
import json
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from launch import run_script  # launch.py (the repository root)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "train.py"


def _env(tmp_path: Path) -> dict[str, str]:
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # the default cache; the run below names its own, so nothing may land here
    return {**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "default_cache"), "PYTHONPATH": python_path}


def _forked(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """``python recipes/train.py *args`` in ``tmp_path``, forked from a process that imported torch, Lightning and the
    package once (launch.py): for runs that only compose the config; its exit status and output (stdout
    with stderr merged)."""
    return run_script(RECIPE, args, 300, cwd=tmp_path, env={"LIT_BALANCE_CACHE": str(tmp_path / "default_cache")})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """One tokenization cache for the module's other runs (the first run fills it; the cache's key is the corpus and
    tokenizer, so later runs read it as a user's second run does)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


def _table(out: str) -> dict[str, tuple[str, ...]]:
    """RunSummary's rows: rank -> (micro-batches, real tokens, padded slots, padding ratio, compute s, data wait s,
    rank wait s, other s)."""
    return {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\s*(0|1|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)$",
        out, flags=re.MULTILINE)}


@pytest.mark.ddp
def test_train_recipe_prints_per_rank_summary(tmp_path):
    # conf/experiment/smoke.yaml: 3 steps of a tiny model, max_tokens=512; a group choice, key overrides and a
    # relative cache directory, which every rank must read from the launch directory
    overrides = ["experiment=smoke", "trainer.log_every_n_steps=1", "data.cache_dir=cache"]  # the default callbacks
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.startswith("data-parallel size 2 | per-rank budget 512 padded slots per micro-batch\n"
                          "global budget 1024 padded slots per optimizer step | ")
    assert "standard library docstrings" in out.splitlines()[2]
    # the plan summary (BalancedTextDataModule.plan_summary) comes next and predicts the epoch's length
    plan = re.match(r"plan for 2 ranks: padding ratio (0\.\d{4}) \| useful compute fraction (0\.\d{4}|1\.0000) \| "
                    r"micro-batches per rank (\d+)$", out.splitlines()[3])
    assert plan, out.splitlines()[:5]
    assert re.search(rf"^micro-batches per rank per epoch {plan.group(3)} \|", out, flags=re.MULTILINE)
    rows = _table(out)
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1"):
        micro, real, padded, ratio, compute, data_wait, rank_wait, _ = rows[rank]
        assert int(micro) == 3 and 0 < int(real) <= int(padded) <= 3 * 512
        assert abs(float(ratio) - (1 - int(real) / int(padded))) < 1e-4
        assert float(compute) > 0 and float(data_wait) >= 0 and float(rank_wait) >= 0
    assert int(rows["total"][1]) == int(rows["0"][1]) + int(rows["1"][1])
    assert re.search(r"^wall \d+\.\d s \(slowest rank\) \| straggler ratio \d\.\d{3} \(whole run\)$", out,
                     flags=re.MULTILINE)
    assert re.search(r"last train/loss \d+\.\d+", out)

    # both ranks worked in the launch directory: one tokenization cache and one Hydra run directory, nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "outputs"]
    assert any((tmp_path / "cache").iterdir())
    (run_dir,) = (tmp_path / "outputs" / "train").glob("*/*")
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "logs", "train.log", "train_ddp_process_1.log"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["checkpoints", "hparams.yaml", "metrics.csv",
                                                                    "training.png"]
    assert sorted(p.name for p in (run_dir / "logs" / "checkpoints").iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == overrides  # rank 0's record

    # the last lines name the metrics file, the checkpoint and the plot, which exist
    named = re.findall(r"^(metrics file|checkpoint|training figures)[^:]*: (\S+)$", out, flags=re.MULTILINE)
    assert sorted({kind for kind, _ in named}) == ["checkpoint", "metrics file", "training figures"], out[-2000:]
    rel = run_dir.relative_to(tmp_path) / "logs"
    paths = {kind: [p for k, p in named if k == kind] for kind in ("metrics file", "checkpoint", "training figures")}
    assert paths["metrics file"] == [str(rel / "metrics.csv")]
    assert paths["training figures"] == [str(rel / "training.png")]
    assert paths["checkpoint"] == [str(rel / "checkpoints" / name) for name in ("epoch=0-step=3.ckpt", "last.ckpt")]
    assert all((tmp_path / path).is_file() for _, path in named)
    # the command that resumes: every override of the run, the checkpoint, twice the steps (the run reached its own)
    assert f"resume: python {RECIPE} {' '.join(overrides)} ckpt_path={rel / 'checkpoints' / 'last.ckpt'} " \
           "trainer.max_steps=6\n" in out
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "train/loss", "balance/real_tokens_per_s", "balance/padding_ratio_rank1", "balance/straggler_ratio",
            "balance/compute_s_rank1", "balance/data_wait_s_rank0", "balance/rank_wait_s_rank1",
            "balance/other_s_rank0"} <= set(header)

    # the progress bar (rank 0, stdout; its last frame, not a terminal: wrapped at 80 columns): the epoch, the step,
    # the figures and the window they cover
    bar = " ".join(out[out.rindex("Epoch "):].split())
    assert bar.startswith("Epoch 0 ") and "/-2" not in bar and "0.00it/s" not in bar, bar[:600]
    assert re.search(r"step: 3/3 window: steps 0-2 tokens/s: [\d,]+ straggler: \d\.\d\d compute: \d+% data wait: \d+% "
                     r"rank wait: \d+% other: \d+% padding \(epoch\): 0\.\d{3}", bar), bar[:600]


@pytest.mark.slow
def test_config_dir_and_config_name_select_another_config(tmp_path):
    # Hydra's own flags: a user's directory searched first, with a primary config that extends conf/config.yaml
    my_conf = tmp_path / "my_conf"
    (my_conf / "trainer").mkdir(parents=True)
    (my_conf / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\nseed: 7\n")
    shutil.copy(ROOT / "conf" / "trainer" / "cpu_ddp.yaml", my_conf / "trainer" / "my_trainer.yaml")
    args = ["--config-dir", "my_conf", "--config-name", "mine", "trainer=my_trainer", "trainer.devices=1", "--cfg", "job"]
    code, out = _forked(args, tmp_path)
    assert code == 0, out[-5000:]
    cfg = yaml.safe_load(out)
    assert cfg["seed"] == 7 and cfg["data"]["seed"] == "${seed}" and cfg["trainer"]["devices"] == 1
    assert cfg["model"]["_target_"] == "lit_balance.demo.DemoTransformerLM"
    assert list(cfg["callbacks"]) == ["run_summary", "padding_monitor", "straggler_monitor", "mixture_monitor",
                                      "progress_bar", "model_checkpoint", "last_step_checkpoint"]
    assert not (tmp_path / "outputs").exists()  # --cfg prints and exits: no run


@pytest.mark.slow
def test_a_mistyped_key_fails_with_hydras_hint(tmp_path):
    code, out = _forked(["trainer.devicez=4"], tmp_path)
    assert code == 1 and "+trainer.devicez=4" in out, out[-3000:]


@pytest.mark.slow
def test_max_tokens_auto_on_cpu_without_memory_limit_is_one_line_before_ranks_start(tmp_path):
    code, out = _forked(["experiment=smoke", "data.max_tokens=auto"], tmp_path)
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert errors[0].endswith("train.py: error: data.max_tokens=auto on a CPU needs data.memory_limit: the bytes of "
                              "resident memory one rank's process may use, e.g. data.memory_limit=8589934592 for 8 GiB")
    assert "Initializing distributed" not in out  # no rank started


@pytest.mark.ddp
@pytest.mark.e2e
def test_a_store_vocabulary_error_on_both_ranks_is_one_line_and_the_replaced_vocab_size_is_said_once(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 500, size=int(rng.integers(5, 60))).tolist() for _ in range(300)]
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "ids.parquet")
    overrides = ["experiment=smoke", "data=arrow", "data.corpus.paths=[ids.parquet]", "data.vocab_size=100",
                 "data.pad_token_id=0", "data.num_workers=0", "model.vocab_size=1000"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if re.search(r"error\b", line.lower())]  # not the tmp path's "_error_"
    assert proc.returncode == 2 and "Traceback" not in out and len(errors) == 1, out[-5000:]
    assert re.search(r"train\.py: error: row \d+ of ids\.parquet holds the token id \d+ at position \d+, outside the "
                     r"vocabulary \[0, 100\); train with a model \(data\.vocab_size\)", errors[0]), errors
    assert "Initializing distributed: GLOBAL_RANK: 1" in out  # both ranks ran (and both met the error)
    said = [line for line in proc.stdout.splitlines() if line.startswith("model.vocab_size=1000 replaced")]
    assert said == ["model.vocab_size=1000 replaced by the data's vocabulary, 100 token ids (the model's embedding "
                    "covers every id of the data)"], proc.stdout[-3000:]


@pytest.fixture(scope="module")
def packed_without_bar(tmp_path_factory, cache_dir):
    """One 2-rank run of the smoke model, packed, with the default callbacks and trainer.enable_progress_bar=false:
    its stdout."""
    tmp_path = tmp_path_factory.mktemp("packed")
    overrides = ["experiment=smoke", "data.packing=true", "trainer.enable_progress_bar=false", cache_dir]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.ddp
@pytest.mark.e2e
def test_train_recipe_trains_packed_with_data_packing_true(packed_without_bar):
    out = packed_without_bar
    assert out.startswith("data-parallel size 2 | per-rank budget 512 tokens per packed row per micro-batch\n")
    rows = _table(out)
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1", "total"):
        micro, real, slots, ratio = rows[rank][:4]
        assert 0 < int(real) == int(slots) and float(ratio) == 0.0  # packed rows: no padding at all
        assert int(micro) == (6 if rank == "total" else 3) and int(slots) <= int(micro) * 512
    assert re.search(r"last train/loss \d+\.\d+", out)


@pytest.mark.ddp
@pytest.mark.e2e
def test_train_recipe_runs_without_a_progress_bar_when_asked(packed_without_bar):
    # the default callbacks hold the live-figures bar; trainer.enable_progress_bar=false leaves it out
    assert set(_table(packed_without_bar)) == {"0", "1", "total"} and "Epoch 0" not in packed_without_bar


def _run_in_terminal(args: list[str], cwd: Path, env: dict[str, str], columns: int = 80, lines: int = 40,
                     timeout: float = 400, interrupt_at_step: int | None = None, command: list[str] | None = None,
                     interrupt_when: Callable[[list[str]], bool] | None = None,
                     signals: tuple[int, ...] = (signal.SIGINT,), gap_s: float = 0.15
                     ) -> tuple[int, list[list[str]]]:
    """Run the main job under a pseudo-terminal of ``columns`` x ``lines``, as a user does, and read its screen
    (pyte, a VT100 emulator) after every chunk of output. With ``interrupt_at_step``, press Ctrl-C (SIGINT to the
    job's process group, every rank and its DataLoader workers, as a terminal sends it) once the bar shows that
    optimizer step; with ``interrupt_when``, once it returns True for the screen (asked every chunk and every second).
    ``signals``: what is sent then to the group, ``gap_s`` seconds apart (``(SIGINT, SIGINT)``: Ctrl-C twice).
    ``command`` replaces ``python recipes/train.py``. Returns the exit status and every screen seen."""
    import pyte

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    env = {**env, "TERM": "xterm", "COLUMNS": str(columns), "LINES": str(lines)}
    proc = subprocess.Popen([*(command or [sys.executable, str(RECIPE)]), *args], stdin=slave, stdout=slave,
                            stderr=slave, cwd=cwd, env=env, start_new_session=True)
    os.close(slave)
    screen = pyte.Screen(columns, lines)
    stream = pyte.ByteStream(screen)
    screens = []
    deadline = time.monotonic() + timeout
    if interrupt_at_step is not None:
        at_step = interrupt_at_step
        interrupt_when = lambda shown: any(  # noqa: E731
            int(m[1]) >= at_step for line in shown if (m := re.search(r"\bstep: (\d+)/", line)))
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready and proc.poll() is not None:
                break
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # the terminal closed: every process of the job exited
                    break
                if not chunk:
                    break
                stream.feed(chunk)
                screens.append(list(screen.display))
            if interrupt_when is not None and screens and interrupt_when(screens[-1]):
                for k, signum in enumerate(signals):
                    if k:
                        time.sleep(gap_s)
                    os.killpg(proc.pid, signum)  # Ctrl-C (SIGINT), or a scheduler's SIGTERM to the job
                interrupt_when = None
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(timeout=60), screens


def _unwrapped(shown: list[str], columns: int = 80) -> str:
    """The screen's text with the terminal's line wrapping undone (a line filled to the last column continues)."""
    out = ""
    for line in shown:
        out += line.rstrip() + ("" if len(line.rstrip()) == columns else "\n")
    return out


_BAR = re.compile(r"^Epoch \d+\s.*?(\d+)/(\d+)\s+(\d+):(\d\d):(\d\d)")
_LABELS = ("train/loss", "step", "window", "tokens/s", "straggler", "compute", "data wait", "rank wait", "other",
           "padding (epoch)")


def _corpus(path: Path, documents: int = 600) -> None:
    """A JSONL corpus of real text: paragraphs of the standard library's pydoc topics."""
    from pydoc_data.topics import topics

    texts = [p for text in topics.values() for p in text.split("\n\n") if len(p) > 40][:documents]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


@pytest.mark.ddp
@pytest.mark.e2e
def test_ctrl_c_in_a_terminal_keeps_the_last_step_and_its_resume_line_resumes(tmp_path, cache_dir):
    # the main job on a corpus of files (a data= override), 12 steps of the smoke model under an 80 x 40 terminal;
    # Ctrl-C at step 3; then the resume line it printed, run as printed
    _corpus(tmp_path / "corpus.jsonl")
    env = _env(tmp_path)
    overrides = ["experiment=smoke", "data=files", "data.corpus=corpus.jsonl", "data.num_workers=0", cache_dir,
                 "trainer.max_steps=12", "callbacks.straggler_monitor.log_every_n_micro_batches=2",
                 "trainer.log_every_n_steps=2"]
    status, screens = _run_in_terminal(overrides, tmp_path, env, interrupt_at_step=3)
    final = [line.rstrip() for line in screens[-1]]
    text = _unwrapped(screens[-1])
    assert status == 128 + signal.SIGINT, "\n".join(final)  # stopped by Ctrl-C, as a shell reports it
    stopped = re.search(r"^stopped by SIGINT at optimizer step (\d+) of 12, on every rank$", text, flags=re.MULTILINE)
    assert stopped and 3 <= int(stopped[1]) < 12, text
    # the bar closed before the table: no frame of it below the table's header; nothing wider than the terminal
    head = next(i for i, line in enumerate(final) if re.match(r"^\s*rank\s+micro-\s", line))
    assert not any(_BAR.match(line) or "━" in line for line in final[head:]), "\n".join(final)
    table = text[text.index(final[head]):text.index("\nmetrics file")].splitlines()
    assert len(table) >= 10 and max(len(line) for line in table) < 80, table
    # every name: value of every frame of the bar on one line; no other output inside the bar's lines
    for shown in screens:
        for line in shown:
            for label in _LABELS:
                for match in re.finditer(rf"(?<![\w/]){re.escape(label)}:", line):
                    assert line[match.end():match.end() + 2].strip(), (label, "\n".join(shown))
    # nothing else between the bar and its items: log lines and the other rank's warnings go above it, or after it
    # has closed (rank 1's, prefixed "rank 1:")
    bar_line = re.compile(r"^(Epoch \d+|Validation|Sanity Checking)\s.*━")
    for shown in screens:
        rows = [line.rstrip() for line in shown]
        for i, line in enumerate(rows[:-1]):
            if bar_line.match(line) and not bar_line.match(rows[i + 1]) and rows[i + 1]:
                assert re.match(r"^(\w[\w/ ()]*): \S", rows[i + 1]), "\n".join(rows)
    held = [i for i, line in enumerate(final) if line.startswith("rank 1: ")]
    frames = [i for i, line in enumerate(final) if bar_line.match(line)]
    assert not held or not frames or min(held) > max(frames), "\n".join(final)
    # the bar's tokens/s is the metrics file's for that window (the last frame showing one)
    shown = [" ".join(line.split()) for shown in screens for line in shown]
    window = [m for line in shown if (m := re.search(r"window: steps (\d+)-(\d+) tokens/s: ([\d,]+)", line))][-1]
    (run_dir,) = (tmp_path / "outputs" / "train").glob("*/*")
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    logged = [float(r["balance/real_tokens_per_s"]) for r in rows
              if r["step"] == window[2] and r.get("balance/real_tokens_per_s")]
    assert logged and f"{logged[-1]:,.0f}" == window[3], (window[0], logged)
    # last.ckpt of the step it stopped at, and a resume line with every override
    resume = re.search(r"^resume: (.*)$", text, flags=re.MULTILINE)
    assert resume, text
    command = shlex.split(resume[1])
    assert command[0] == "python" and Path(command[1]).resolve() == RECIPE, command
    assert command[2:-1] == overrides and command[-1].startswith("ckpt_path="), command
    checkpoint = tmp_path / command[-1].split("=", 1)[1]
    assert checkpoint.name == "last.ckpt" and checkpoint.is_file()
    assert re.search(rf"^checkpoint: {re.escape(command[-1].split('=', 1)[1])}$", text, flags=re.MULTILINE), text
    import torch

    assert torch.load(checkpoint, weights_only=False)["global_step"] == int(stopped[1])

    status, screens = _run_in_terminal(command[2:], tmp_path, env, command=[sys.executable, command[1]])
    final = "\n".join(line.rstrip() for line in screens[-1])
    assert status == 0, final
    assert "cannot resume" not in final
    bars = [m for shown in screens for line in shown if (m := _BAR.match(line))]
    counts = [(int(m[1]), int(m[2])) for m in bars]
    assert counts and counts[-1] == (12, 12), counts  # the epoch's micro-batches from its start, to max_steps
    assert min(count for count, _ in counts if count > 0) > int(stopped[1]), counts  # resumed, not from step 0
    assert all(count <= total for count, total in counts), counts
    rows = _table(_unwrapped(screens[-1]))
    assert int(rows["0"][0]) == 12 - int(stopped[1]), rows  # the remaining steps, one micro-batch each
    assert re.search(r"^checkpoint: \S+/last\.ckpt$", _unwrapped(screens[-1]), flags=re.MULTILINE), final


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.e2e
def test_train_recipe_with_max_tokens_auto_measures_the_budget_on_both_ranks(tmp_path, cache_dir):
    overrides = ["experiment=smoke", "data.max_tokens=auto", f"data.memory_limit={2**30}",
                 "callbacks=[run_summary]", cache_dir]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=600, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.startswith("data-parallel size 2 | per-rank budget: auto, measured before the first epoch"), out[:300]
    budget = re.search(r"^token budget: max_tokens=(\d+) padded token slots per micro-batch, every rank \(probe;", out,
                       flags=re.MULTILINE)
    assert budget and int(budget.group(1)) > 0, out[-3000:]


def test_the_resume_command_keeps_every_override_quoted_for_the_shell():
    from lit_balance.lightning.outputs import hydra_resume_command

    overrides = ["data=files", "data.corpus=my docs/*.jsonl", "callbacks=[run_summary]", "+ckpt_path=old.ckpt",
                 "trainer.max_steps=12"]
    assert shlex.split(hydra_resume_command("recipes/train.py", overrides, "out/last.ckpt")) == [
        "python", "recipes/train.py", *overrides[:3], "trainer.max_steps=12", "ckpt_path=out/last.ckpt"]
    assert hydra_resume_command("r.py", overrides, "l.ckpt", max_steps=24, config_dir="my_conf",
                                config_name="mine").split()[2:6] == ["--config-dir", "my_conf", "--config-name", "mine"]
    assert hydra_resume_command("r.py", overrides, "l.ckpt", max_steps=24).endswith(" ckpt_path=l.ckpt trainer.max_steps=24")


@pytest.mark.ddp
@pytest.mark.e2e
def test_train_recipe_trains_from_a_stream_of_jsonl_files_with_data_stream(tmp_path):
    for k, count in enumerate((120, 12, 100)):  # one file 10x shorter
        (tmp_path / f"part{k}.jsonl").write_text("".join(
            json.dumps({"text": f"document {k} {i} " + "word " * (i % 31 + 1)}) + "\n" for i in range(count)))
    overrides = ["experiment=smoke", "data=stream", "data.corpus.source=part*.jsonl", "data.window_documents=64",
                 "data.val_documents=16", "trainer.enable_progress_bar=false"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-5000:]
    assert "corpus: stream of 3 file(s): part0.jsonl, part1.jsonl, part2.jsonl, windows of 64 documents" in out
    rows = _table(out)
    assert rows["0"][0] == rows["1"][0] == "3"  # 3 optimizer steps of one micro-batch, on both ranks
    assert re.search(r"stream: pass 0, window \d+, \d+ documents before it\n", out)
    assert re.search(r"last train/loss \d+\.\d+ \| val/loss \d+\.\d+", out)  # validated on the held-out documents
    assert not (tmp_path / "default_cache").exists()  # nothing tokenized before training or cached
