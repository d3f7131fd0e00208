"""Stopping the main job as users stop it, and resuming it: the mixture recipe (``data=mixture``: one DataLoader worker
per rank), 2 CPU DDP ranks under a terminal; Ctrl-C once, Ctrl-C twice 0.15 s apart, and SIGTERM during validation,
each sent to the whole process group (every rank and its workers, as a terminal or a scheduler sends it). Each run
ends with ``last.ckpt``, the end table, the resume line and exit status 128 + the signal's number; the printed line
resumes, and the two runs' per-component tokens in ``metrics.csv`` are an uninterrupted run's, step for step."""

import csv
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_recipe import RECIPE, _env, _run_in_terminal, _unwrapped

pytestmark = [pytest.mark.e2e, pytest.mark.ddp]  # the end-to-end tier (docs/index.md#tests)

NAMES = ("web", "code")
# 10 steps of the smoke model; validation after step 5; figures gathered every 4 steps, so a stop at step 3 or 5 falls
# between two gathers
STEPS = ["trainer.max_steps=10", "trainer.val_check_interval=5", "trainer.log_every_n_steps=4"]

# a callback of the run that makes each validation inside training take 2 s, and marks it, so that the test sends
# SIGTERM while validation runs
_SLOW_VALIDATION = '''
import time
from pathlib import Path

import lightning as L


class SlowValidation(L.Callback):
    def __init__(self, marker):
        self.marker = Path(marker)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.marker.touch()
            time.sleep(2.0)
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL components of real text (paragraphs of the standard library's pydoc topics), one cache, and the
    uninterrupted run's tokens per step."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("stop")
    paragraphs = [p for text in topics.values() for p in text.split("\n\n") if len(p) > 40]
    for name, texts in (("web", paragraphs[:400]), ("code", paragraphs[400:700])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "stop_helpers.py").write_text(_SLOW_VALIDATION)
    overrides = ["data=mixture", "experiment=smoke", f"data.corpus.components.web.corpus={root / 'web.jsonl'}",
                 f"data.corpus.components.code.corpus={root / 'code.jsonl'}", "data.val_fraction=0.1",
                 f"data.cache_dir={root / 'cache'}", *STEPS]
    quiet = root / "quiet"
    quiet.mkdir()
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides, "trainer.enable_progress_bar=false"],
                          check=False, capture_output=True, text=True, timeout=600, env=_env(quiet), cwd=quiet)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run_dir,) = (quiet / "outputs" / "train").glob("*/*")
    tokens = _tokens(run_dir)
    assert sorted(tokens) == list(range(10)), sorted(tokens)
    return root, overrides, tokens


def _tokens(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.csv's per-component token figures (all ranks and per rank) by optimizer step; a step logged twice
    fails."""
    out: dict[int, dict[str, float]] = {}
    for row in csv.DictReader((run_dir / "logs" / "metrics.csv").open()):
        figures = {k: float(v) for k, v in row.items() if k.startswith("train/tokens/") and v}
        if figures:
            step = int(float(row["step"]))
            assert step not in out, (run_dir, step)
            out[step] = figures
    return out


def _table_tokens(text: str) -> dict[str, int]:
    """The end table's real tokens of each component, all ranks."""
    rows = {m[1]: int(m[2]) for m in re.finditer(r"^(web|code)\s+\d\.\d{4}\s+\d\.\d{4}\s+(\d+)\s+\d+\s+\d+$", text,
                                                 flags=re.MULTILINE)}
    assert sorted(rows) == sorted(NAMES), text[-3000:]
    return rows


def _resume_command(shown: list[str], columns: int = 80) -> list[str]:
    """The printed resume line, the last lines of the screen, as arguments. The terminal wraps it at ``columns``: a
    full line continues the same argument, and a line one short of full ended at a space the terminal wrapped on."""
    lines = [line.rstrip() for line in shown]
    start = max(i for i, line in enumerate(lines) if line.startswith("resume: "))
    command = ""
    for line in lines[start:]:
        command += line + ("" if len(line) == columns else " " if len(line) == columns - 1 else "\n")
    return shlex.split(command.split("\n", 1)[0].removeprefix("resume: "))


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c-twice", "sigterm-in-validation"])
def test_a_stop_keeps_every_step_and_the_printed_line_resumes_it(tmp_path, corpus, how):
    root, overrides, expected = corpus
    env = _env(tmp_path)
    env["PYTHONPATH"] = f"{root}:{env['PYTHONPATH']}"
    marker = tmp_path / "validating"
    if how == "sigterm-in-validation":
        overrides = [*overrides, "+callbacks.slow_validation._target_=stop_helpers.SlowValidation",
                     f"+callbacks.slow_validation.marker={marker}"]
        signum, kwargs = signal.SIGTERM, {"interrupt_when": lambda shown: marker.exists(), "signals": (signal.SIGTERM,)}
    else:
        signals = (signal.SIGINT, signal.SIGINT) if how == "ctrl-c-twice" else (signal.SIGINT,)
        signum, kwargs = signal.SIGINT, {"interrupt_at_step": 3, "signals": signals, "gap_s": 0.15}
    status, screens = _run_in_terminal(overrides, tmp_path, env, timeout=600, **kwargs)
    text = _unwrapped(screens[-1])
    whole = "\n".join(_unwrapped(shown) for shown in screens[-1:])
    assert status == 128 + signum, text[-4000:]  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports them
    assert "exited unexpectedly" not in whole and "Traceback" not in whole, text[-4000:]
    name = signal.Signals(signum).name
    stopped = re.search(rf"^stopped by {name} at optimizer step (\d+) of 10, on every rank$", text, flags=re.MULTILINE)
    assert stopped, text[-4000:]
    step = int(stopped[1])
    if how == "sigterm-in-validation":
        assert step == 5  # the validation after step 5 ends, and no step after it
    else:
        assert 3 <= step < 10
    table = _table_tokens(text)
    command = _resume_command(screens[-1])
    checkpoint = tmp_path / command[-1].split("=", 1)[1]
    assert command[-1].startswith("ckpt_path=") and checkpoint.name == "last.ckpt", command
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    (first_dir,) = (tmp_path / "outputs" / "train").glob("*/*")
    first = _tokens(first_dir)
    assert sorted(first) == list(range(step))  # every trained step, the ones after the last gather included
    assert table == {n: int(sum(f[f"train/tokens/{n}"] for f in first.values())) for n in NAMES}

    status, screens = _run_in_terminal(command[2:], tmp_path, env, timeout=600, command=[sys.executable, command[1]])
    text = _unwrapped(screens[-1])
    assert status == 0, text[-4000:]
    (second_dir,) = [d for d in (tmp_path / "outputs" / "train").glob("*/*") if d != first_dir]
    second = _tokens(second_dir)
    assert sorted(second) == list(range(step, 10))
    assert {**first, **second} == expected  # every component's tokens, all ranks and per rank, step for step
    assert _table_tokens(text) == {n: int(sum(f[f"train/tokens/{n}"] for f in second.values())) for n in NAMES}
