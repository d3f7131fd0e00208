"""The main job, recipes/train.py on conf/config.yaml, as a user runs it: 2 CPU DDP ranks on the built-in corpus."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train.py"


def test_train_recipe_prints_per_rank_summary(tmp_path):
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": python_path}
    # conf/experiment/smoke.yaml: 3 steps of a tiny model, max_tokens=512; a group choice and a key override
    overrides = ["experiment=smoke", "callbacks=[run_summary]", "trainer.log_every_n_steps=1"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "world size 2" in out and "standard library docstrings" in out and "per-rank budget 512 " in out
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\s*(0|1|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.MULTILINE)}
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1"):
        micro, real, padded, ratio, _ = rows[rank]
        assert int(micro) == 3 and 0 < int(real) <= int(padded) <= 3 * 512
        assert abs(float(ratio) - (1 - int(real) / int(padded))) < 1e-4
    assert int(rows["total"][1]) == int(rows["0"][1]) + int(rows["1"][1])
    assert re.search(r"last train/loss \d+\.\d+", out)
