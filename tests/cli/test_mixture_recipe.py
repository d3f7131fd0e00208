"""The main job on a mixture: recipes/train.py data=mixture, two JSONL components, 2 CPU DDP ranks; every component's
validation loss in metrics.csv as val/loss/<name> beside val/loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "train.py"


def _write(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.mark.ddp
def test_train_recipe_with_data_mixture_logs_each_components_validation_loss(tmp_path):
    words = "the cat sat on a mat while dogs ran far away over green hills".split()
    web = _write(tmp_path / "web.jsonl", [" ".join(words[(i + j) % 14] for j in range(4 + i % 9)) for i in range(120)])
    code = _write(tmp_path / "code.jsonl", [" ".join(f"x{(i * j) % 7} = {j}" for j in range(2 + i % 20))
                                            for i in range(80)])
    overrides = ["data=mixture", "experiment=smoke", f"data.corpus.components.web.corpus={web}",
                 f"data.corpus.components.code.corpus={code}", "data.val_fraction=0.1", "data.cache_dir=cache",
                 "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "default_cache"), "PYTHONPATH": python_path}
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "plan for 2 ranks: padding ratio" in proc.stdout
    (metrics,) = (tmp_path / "outputs" / "train").glob("*/*/logs/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"val/loss", "val/loss/web", "val/loss/code", "mixture/web/tokens", "mixture/code/tokens"} <= set(header)
