"""The main job, recipes/train.py, as a user runs it: 2 CPU DDP ranks on the built-in corpus."""

import os
import re
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train.py"


def test_train_recipe_prints_per_rank_summary(tmp_path):
    env = {**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "cache")}
    overrides = ["trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
                 "model.d_model=32", "model.num_heads=2", "model.num_layers=1", "model.dim_feedforward=64",
                 "data.max_tokens=512"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "world size 2" in out and "standard library docstrings" in out
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\s*(0|1|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)}
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1"):
        micro, real, padded, ratio, _ = rows[rank]
        assert int(micro) == 3 and 0 < int(real) <= int(padded) <= 3 * 512
        assert abs(float(ratio) - (1 - int(real) / int(padded))) < 1e-4
    assert int(rows["total"][1]) == int(rows["0"][1]) + int(rows["1"][1])
    assert re.search(r"last train/loss \d+\.\d+", out)
