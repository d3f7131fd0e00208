"""docs/bring_your_own.md: every example marked as a script runs as written and trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "bring_your_own.md"
MARK = "<!-- runs as a script: tests/docs/test_bring_your_own.py -->"
EXAMPLES = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", PAGE.read_text("utf-8"), flags=re.DOTALL)


def test_the_page_marks_its_two_examples():
    assert len(EXAMPLES) == PAGE.read_text("utf-8").count(MARK) == 2
    assert "LlamaForCausalLM(config)" in EXAMPLES[0] and "BalancedTextDataModule" in EXAMPLES[0]
    assert "balanced_dataloader" in EXAMPLES[1] and "PadFieldsCollator" in EXAMPLES[1]


@pytest.mark.slow
@pytest.mark.parametrize("example", range(len(EXAMPLES)), ids=["hf_causal_lm", "classification"])
@pytest.mark.e2e
def test_example_runs_as_a_script_and_trains(tmp_path, example):
    script = tmp_path / "example.py"
    script.write_text(EXAMPLES[example], encoding="utf-8")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=400,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": path,
                                             "LIT_BALANCE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    trained = re.search(r"^trained (\d+) optimizer steps, train/loss (\d+\.\d+)$", proc.stdout, flags=re.MULTILINE)
    assert trained, proc.stdout[-3000:]
    steps, loss = int(trained.group(1)), float(trained.group(2))
    if example == 0:
        assert steps == 2 and 0 < loss < 20  # ln(30522) = 10.3 at random initialisation
    else:  # three epochs of the map-style path; the loss below ln(3), a guess among 3 classes
        assert steps > 2 and loss < 1.0986


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.e2e
def test_the_hugging_face_model_trains_from_the_command_line_as_the_page_shows(tmp_path):
    """The page's `lit-balance fit --model.class_path=my_lm.HFCausalLM ...` with the example saved as my_lm.py."""
    command = re.search(r"```bash\n(lit-balance fit --model\.class_path=my_lm\.HFCausalLM.*?)```", PAGE.read_text("utf-8"),
                        flags=re.DOTALL).group(1)
    args = command.replace("\\\n", " ").split()[1:]
    assert args[:2] == ["fit", "--model.class_path=my_lm.HFCausalLM"] and "--trainer.devices=2" in args
    (tmp_path / "my_lm.py").write_text(EXAMPLES[0], encoding="utf-8")
    # the installed console script, in the directory holding my_lm.py, which is on no path but the working directory
    console = Path(sys.executable).with_name("lit-balance")
    assert console.is_file(), f"no console script at {console}: install the package (pip install -e .)"
    proc = subprocess.run([str(console), *args, "--trainer.limit_val_batches=0"],
                          check=False, capture_output=True, text=True, timeout=500, cwd=tmp_path,
                          env={**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "data-parallel size 2 | per-rank budget 1024 padded slots" in proc.stdout
    assert re.search(r"max_steps=3. reached", proc.stderr + proc.stdout), (proc.stdout + proc.stderr)[-3000:]
    assert re.search(r"^checkpoint: lightning_logs/version_0/checkpoints/\S+\.ckpt$", proc.stdout, flags=re.MULTILINE)
    bar = " ".join(proc.stdout[proc.stdout.rindex("Epoch "):].split())  # the progress bar's last frame
    assert bar.startswith("Epoch 0 ") and "/-2" not in bar and "step: 3/3" in bar, bar[:600]
