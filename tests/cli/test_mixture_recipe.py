"""The main job on a mixture: recipes/train.py data=mixture, two JSONL components, 2 CPU DDP ranks; every component's
validation loss in metrics.csv as val/loss/<name> beside val/loss; every component's tokens per optimizer step and per
rank (MixtureMonitor) in metrics.csv, adding up to what the end-of-run table (RunSummary) counted on each rank; the
plan line's shares per step."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # an end-to-end tier of its own (docs/index.md#tests)

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
    assert {"val/loss", "val/loss/web", "val/loss/code"} <= set(header)
    names = ("web", "code")
    per_step = [f"train/{kind}/{n}" for n in names for kind in ("tokens", "supervised_tokens", "share")]
    per_rank = [f"train/{kind}/{n}_rank{r}" for n in names for kind in ("tokens", "supervised_tokens") for r in (0, 1)]
    assert set(per_step + per_rank) <= set(header)
    assert "shares of tokens per optimizer step" in proc.stdout  # the plan line before fit
    rows = [r for r in csv.DictReader(metrics.open()) if r["train/tokens/web"]]
    assert [int(float(r["step"])) for r in rows] == [0, 1, 2]  # experiment=smoke: 3 optimizer steps, one row each
    for r in rows:
        tokens = [float(r[f"train/tokens/{n}"]) for n in names]
        assert tokens == [float(r[f"train/tokens/{n}_rank0"]) + float(r[f"train/tokens/{n}_rank1"]) for n in names]
        assert float(r["train/share/web"]) == tokens[0] / sum(tokens)
    # the end-of-run table: per rank, each component's real / supervised tokens, the same counts summed over steps
    lines = proc.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.split() == ["rank", *names]))
    for rank in (0, 1):
        cells = lines[start + 1 + rank].split()
        assert cells[0] == str(rank)
        for c, name in enumerate(names):
            real, supervised = int(cells[1 + 3 * c]), int(cells[3 + 3 * c])
            assert real == sum(int(float(r[f"train/tokens/{name}_rank{rank}"])) for r in rows) > 0
            assert supervised == sum(int(float(r[f"train/supervised_tokens/{name}_rank{rank}"])) for r in rows)
